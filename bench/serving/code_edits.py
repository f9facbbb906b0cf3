"""c1-code's requests (issue 25's "code edit with the file in the prompt"): twelve small source files in Python,
JavaScript, Go and SQL, each with an ordinary edit to make to it, written for this benchmark (not chosen by what
the default model copies well)."""
from __future__ import annotations

CODE, CODE_NEW_TOKENS = "code", 320  # c1-code's key in the prompt sets, and its new-token cap

# (ask, language, file)
CODE_EDITS = [
    ("Rename the function `calc` to `order_total` everywhere in this file.", "python", '''\
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def calc(items, discount=0.0):
    subtotal = sum(item.price * item.quantity for item in items)
    return round(subtotal * (1 - discount), 2)


def receipt(items, discount=0.0):
    lines = [f"{item.name} x{item.quantity}: {item.price * item.quantity:.2f}" for item in items]
    lines.append(f"Total: {calc(items, discount):.2f}")
    return "\\n".join(lines)


if __name__ == "__main__":
    cart = [Item("apple", 0.5, 6), Item("bread", 2.25, 1), Item("milk", 1.1, 2)]
    print(receipt(cart, discount=0.1))
'''),
    ("Add type hints to every function in this module.", "python", '''\
import csv
from collections import defaultdict


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def group_by(rows, key):
    groups = defaultdict(list)
    for row in rows:
        groups[row[key]].append(row)
    return dict(groups)


def average(values):
    if not values:
        return 0.0
    return sum(values) / len(values)


def mean_salary_by_department(path):
    groups = group_by(read_rows(path), "department")
    return {dept: average([float(r["salary"]) for r in rows]) for dept, rows in groups.items()}
'''),
    ("Add a docstring to each function.", "python", '''\
import hashlib
import os


def file_digest(path, chunk_size=65536):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def find_duplicates(root):
    seen = {}
    duplicates = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            digest = file_digest(path)
            if digest in seen:
                duplicates.append((seen[digest], path))
            else:
                seen[digest] = path
    return duplicates
'''),
    ("There is an off-by-one error in `moving_average`: the last window is never included. Fix it.", "python",
     '''\
def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    for start in range(len(values) - window):
        chunk = values[start:start + window]
        averages.append(sum(chunk) / window)
    return averages


def largest_jump(values):
    best = 0
    for i in range(1, len(values)):
        best = max(best, abs(values[i] - values[i - 1]))
    return best


if __name__ == "__main__":
    temps = [12.1, 13.4, 15.0, 14.2, 16.8, 18.3, 17.9]
    print(moving_average(temps, 3))
    print(largest_jump(temps))
'''),
    ("Convert all the string formatting in this code to f-strings.", "python", '''\
import datetime


def greet(name, visits):
    if visits == 1:
        return "Welcome, %s! This is your first visit." % name
    return "Welcome back, {}! You have visited {} times.".format(name, visits)


def log_line(level, message):
    now = datetime.datetime.now().strftime("%H:%M:%S")
    return "[%s] %s: %s" % (now, level.upper(), message)


def summary(user, total, limit):
    percent = 100 * total / limit
    return "{0} has used {1} of {2} MB ({3:.1f}%)".format(user, total, limit, percent)


print(greet("Ada", 3))
print(log_line("info", "server started"))
print(summary("ada", 512, 2048))
'''),
    ("Replace every `var` with `const` or `let` as appropriate.", "javascript", '''\
var API_URL = "https://api.example.com/v1";

function fetchUsers(page) {
  var url = API_URL + "/users?page=" + page;
  return fetch(url).then(function (response) {
    if (!response.ok) {
      throw new Error("Request failed: " + response.status);
    }
    return response.json();
  });
}

function countActive(users) {
  var count = 0;
  for (var i = 0; i < users.length; i++) {
    if (users[i].active) {
      count += 1;
    }
  }
  return count;
}

fetchUsers(1).then(function (data) {
  var active = countActive(data.users);
  console.log("Active users: " + active);
});
'''),
    ("Rename the variable `tmp` to `cartTotal` in this function.", "javascript", '''\
function checkout(cart, coupon) {
  let tmp = 0;
  for (const line of cart.lines) {
    tmp += line.unitPrice * line.quantity;
  }
  if (coupon && coupon.percentOff) {
    tmp -= tmp * (coupon.percentOff / 100);
  }
  if (tmp < 0) {
    tmp = 0;
  }
  const shipping = tmp > 50 ? 0 : 4.99;
  return {
    subtotal: tmp,
    shipping: shipping,
    total: Math.round((tmp + shipping) * 100) / 100,
  };
}

module.exports = { checkout };
'''),
    ("Make `LoadConfig` return an error instead of calling log.Fatal, and update `main` to handle it.", "go", '''\
package main

import (
	"encoding/json"
	"fmt"
	"log"
	"os"
)

type Config struct {
	Port    int    `json:"port"`
	Host    string `json:"host"`
	Verbose bool   `json:"verbose"`
}

func LoadConfig(path string) Config {
	data, err := os.ReadFile(path)
	if err != nil {
		log.Fatal(err)
	}
	var cfg Config
	if err := json.Unmarshal(data, &cfg); err != nil {
		log.Fatal(err)
	}
	return cfg
}

func main() {
	cfg := LoadConfig("config.json")
	fmt.Printf("listening on %s:%d\\n", cfg.Host, cfg.Port)
}
'''),
    ("Change this query so it only counts orders from 2024 and orders the result by revenue, highest first.", "sql",
     '''\
SELECT
    c.customer_id,
    c.name,
    c.country,
    COUNT(o.order_id) AS order_count,
    SUM(o.amount) AS revenue
FROM customers AS c
JOIN orders AS o
    ON o.customer_id = c.customer_id
WHERE o.status = 'completed'
GROUP BY
    c.customer_id,
    c.name,
    c.country
HAVING COUNT(o.order_id) >= 3
ORDER BY c.name;
'''),
    ("Replace the print calls with the logging module (a module-level logger).", "python", '''\
import json
import urllib.request


def fetch_json(url, timeout=10):
    print("fetching", url)
    with urllib.request.urlopen(url, timeout=timeout) as response:
        if response.status != 200:
            print("unexpected status", response.status)
            return None
        return json.load(response)


def sync_prices(urls, store):
    updated = 0
    for url in urls:
        data = fetch_json(url)
        if data is None:
            print("skipping", url)
            continue
        for sku, price in data.items():
            store[sku] = price
            updated += 1
    print("updated", updated, "prices")
    return updated
'''),
    ("Fix the bug: `binarySearch` loops forever when the target is not in the slice.", "go", '''\
package search

// binarySearch returns the index of target in the sorted slice xs, or -1.
func binarySearch(xs []int, target int) int {
	lo, hi := 0, len(xs)-1
	for lo <= hi {
		mid := lo + (hi-lo)/2
		switch {
		case xs[mid] == target:
			return mid
		case xs[mid] < target:
			lo = mid
		default:
			hi = mid
		}
	}
	return -1
}

// contains reports whether target is in the sorted slice xs.
func contains(xs []int, target int) bool {
	return binarySearch(xs, target) >= 0
}
'''),
    ("Convert this class component to a function component using hooks.", "javascript", '''\
import React from "react";

class Counter extends React.Component {
  constructor(props) {
    super(props);
    this.state = { count: props.initial || 0 };
    this.increment = this.increment.bind(this);
    this.reset = this.reset.bind(this);
  }

  increment() {
    this.setState({ count: this.state.count + 1 });
  }

  reset() {
    this.setState({ count: 0 });
  }

  render() {
    return (
      <div className="counter">
        <span>{this.state.count}</span>
        <button onClick={this.increment}>+1</button>
        <button onClick={this.reset}>Reset</button>
      </div>
    );
  }
}

export default Counter;
'''),
]


def build_code_prompts(base: bool = False) -> list[str]:
    """Each file with its edit: a user turn (the ask, then the file in a fenced block) and the opening of the
    assistant's (ChatML); ``base``: the file, then the edit announced and the copy's fence opened, for a base model
    to continue."""
    if base:
        return [f"```{lang}\n{code}```\n\nThe same file after this change. {ask}\n\n```{lang}\n"
                for ask, lang, code in CODE_EDITS]
    return [f"<|im_start|>user\n{ask}\n\n```{lang}\n{code}```<|im_end|>\n<|im_start|>assistant\n"
            for ask, lang, code in CODE_EDITS]

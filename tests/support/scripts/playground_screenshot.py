"""Take the README's picture of the playground (docs/playground.png) from a running server, in headless Chromium.

    mindserve serve --port 8123 &          # the default model, the shipped config
    python -m tests.support.scripts.playground_screenshot --url http://127.0.0.1:8123 [--out docs/playground.png]

The run is real: the page streams the answer from the server; the picture is taken once it has ended.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tests.support.browser import chromium
from tests.support.paths import REPO

PROMPT = "<|im_start|>user\nWhat makes a good cup of tea?<|im_end|>\n<|im_start|>assistant\n"
SETTINGS = {"do_sample": "true", "temperature": "0.7", "top_p": "0.9", "seed": "42", "max_new_tokens": "48"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server's business URL")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "playground.png")
    args = parser.parse_args()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    with chromium(width=1360, height=1000) as driver:
        driver.get(args.url.rstrip("/") + "/playground")
        WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "status").text == "ready")
        driver.find_element(By.ID, "inputs").send_keys(PROMPT)
        for name, value in SETTINGS.items():
            control = driver.find_element(By.ID, f"param-{name}")
            if control.tag_name == "select":
                Select(control).select_by_visible_text(value)
            else:
                control.send_keys(value)
        driver.find_element(By.ID, "generate").click()
        WebDriverWait(driver, 300).until(
            lambda d: d.find_element(By.ID, "output").get_attribute("data-state") not in (None, "running"))
        state = driver.find_element(By.ID, "output").get_attribute("data-state")
        if state != "done":
            raise SystemExit(f"the run ended {state}: {driver.find_element(By.ID, 'error').text}")
        driver.execute_script("document.activeElement.blur(); window.scrollTo(0, 0);")
        args.out.write_bytes(driver.get_screenshot_as_png())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Structured output throughput: tokens/s of JSON-Schema-constrained generation against unconstrained
generation on the same load, at 1 and 16 concurrent clients, on the default model in-process (the engine
the server runs; HTTP adds the same cost to both sides).

    python -m bench structured [--clients 1 16] [--requests-per-client 3] [--max-new-tokens 64]

Each client sends its requests one after another; every request is a chat prompt asking for one of the
object schemas of tests/data/structured_schemas.json (client i, request j: schema (i + j) mod 9). The
unconstrained run sends the same prompts without the grammar, with ``min_tokens`` set to the token count
the constrained run generated for that request (its own EOS held back until then) and that count as
``max_new_tokens``, so both runs generate the same number of tokens per request. Reported: generated
tokens / wall seconds, the ratio (bar: >= 0.8), and the mask cost per constrained token
(``Engine.masks.stats``: wall time of the mask thread, which overlaps the forward pass).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import TYPE_CHECKING

from backends.types import Grammar, RequestParams
from bench import harness
from bench.harness.paths import REPO

if TYPE_CHECKING:
    from backends.mindspore.engine.engine import Engine

ALL_SCHEMAS = json.loads((REPO / "tests" / "data" / "structured_schemas.json").read_text())["schemas"]
OBJECTS = ("person", "point", "nested", "array_objects", "nested_array_in_object", "object_enum_and_pattern",
           "optional_fields", "refs", "tuple_prefix_items")  # the ones with the longer answers
SCHEMAS = {name: ALL_SCHEMAS[name] for name in OBJECTS}


def requests_for(engine: Engine, clients: int, per_client: int, max_new: int) -> list[list[tuple[str, RequestParams]]]:
    names = list(SCHEMAS)
    load = []
    for i in range(clients):
        mine = []
        for j in range(per_client):
            name = names[(i + j) % len(names)]
            question = f"Answer in JSON only: an example of {name}."
            prompt = engine.apply_chat_template([{"role": "user", "content": question}])
            grammar = Grammar("json", json.dumps(SCHEMAS[name]))
            mine.append((prompt, RequestParams(grammar=grammar, max_new_tokens=max_new, do_sample=False)))
        load.append(mine)
    return load


def run(engine: Engine, load: list[list[tuple[str, RequestParams]]]) -> tuple[float, list[list[int]]]:
    """Every client's requests, clients in parallel: (wall seconds, generated tokens per request)."""
    counts: list[list[int]] = [[] for _ in load]

    def client(i: int) -> None:
        for prompt, params in load[i]:
            counts[i].append(engine.generate(prompt, params).generated_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(load))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, counts


def unconstrained_twin(load, counts):
    """The same prompts without the grammar, each generating exactly as many tokens as its constrained run."""
    return [[(prompt, RequestParams(max_new_tokens=n, min_tokens=n, do_sample=False))
             for (prompt, _), n in zip(mine, got)] for mine, got in zip(load, counts)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="constrained/unconstrained pairs, interleaved")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    results = {}
    with harness.engine(max_seq_len=512, max_input_tokens=256, max_batch_size=max(args.clients),
                max_iter_times=args.max_new_tokens) as engine:
        engine.generate("warm", RequestParams(grammar=Grammar("regex", "[a-z]{3}"), max_new_tokens=4))
        print(f"structured_bench: {engine.model_name}, kernels {engine.runner.kernels}, "
              f"{args.requests_per_client} requests per client, max_new_tokens {args.max_new_tokens}, greedy")
        print(f"{'clients':>7} {'constrained tok/s':>18} {'unconstrained tok/s':>20} {'ratio':>6} "
              f"{'tokens':>7} {'mask ms/token':>14}")
        for clients in args.clients:
            load = requests_for(engine, clients, args.requests_per_client, args.max_new_tokens)
            on, off, mask_ms, tokens = [], [], [], 0
            for _ in range(args.rounds):
                before = (engine.masks.stats.seconds, engine.masks.stats.masks)
                wall, counts = run(engine, load)
                tokens = sum(map(sum, counts))
                on.append(tokens / wall)
                seconds, masks = engine.masks.stats.seconds - before[0], engine.masks.stats.masks - before[1]
                mask_ms.append(1000 * seconds / max(masks, 1))
                wall_off, counts_off = run(engine, unconstrained_twin(load, counts))
                assert sum(map(sum, counts_off)) == tokens, "the twin run generated a different token count"
                off.append(tokens / wall_off)
            con, unc = statistics.median(on), statistics.median(off)
            print(f"{clients:>7} {con:>18.1f} {unc:>20.1f} {con / unc:>6.2f} {tokens:>7} "
                  f"{statistics.median(mask_ms):>14.3f}")
            results[f"c{clients}"] = {"constrained_tok_s": con, "unconstrained_tok_s": unc, "ratio": con / unc,
                                      "tokens": tokens, "mask_ms_per_token": statistics.median(mask_ms)}
    harness.save_results(args, "structured", {"max_new_tokens": args.max_new_tokens, "clients": results})


if __name__ == "__main__":
    main()

"""What patch `ggml-one-query-row-s-flash-attention-is-one-row-of-a` costs: one-token decoding speed with a single query row
computed as a block's row (the default) against the base's narrowed keys split over threads (IKDFLASH_FA_SPLIT_ROW=1).

    python -m benchmarks.passes one-token [--target T.gguf] [--contexts 512 2048 4096] [--threads 2]

The target (default: the built-in pair's) reads a prompt of each context length, then decodes
--tokens tokens one at a time; decoding tokens/s (prompt excluded) is reported for both settings,
which run in alternating child processes (the switch is read once per process), medians of
--repeats, and their ratio. The split can only pay where a CPU has more threads than the model
has attention heads; on 2 threads it should not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks.harness import write_result

CHILD = """
import json, sys
from ikdflash import Engine
target, context, tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with Engine(target, None, n_ctx=context + tokens + 16, n_threads=threads) as engine:
    prompt = [(17 * i) % 5000 + 100 for i in range(context)]
    out = engine.generate(prompt, max_tokens=tokens)
    print(json.dumps({"tps": out.stats.tokens_per_second}))
"""


def decode_speed(target: str, context: int, tokens: int, threads: int, split: bool) -> float:
    env = {**os.environ, "IKDFLASH_FA_SPLIT_ROW": "1" if split else "0"}
    run = subprocess.run([sys.executable, "-c", CHILD, target, str(context), str(tokens), str(threads)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(run.stdout.splitlines()[-1])["tps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target GGUF (default: the built-in pair's, downloaded once)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the table here too")
    args = parser.parse_args()
    if args.target is None:
        from ikdflash.sources.references import resolve_pair
        args.target = str(resolve_pair("smollm2-135m-swa")[0])
    rows = []
    print(f"{'context':>8} {'block row tok/s':>16} {'split tok/s':>12} {'ratio':>6}")
    for context in args.contexts:
        speeds: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for split in (False, True):
                speeds[split].append(decode_speed(args.target, context, args.tokens, args.threads, split))
        row = {"context": context, "block_row_tps": statistics.median(speeds[False]),
               "split_tps": statistics.median(speeds[True])}
        row["ratio"] = row["block_row_tps"] / row["split_tps"]
        rows.append(row)
        print(f"{context:>8} {row['block_row_tps']:>16.1f} {row['split_tps']:>12.1f} {row['ratio']:>6.2f}")
    if args.json:
        write_result(args.json, {"tokens": args.tokens, "rows": rows}, args.threads)

"""Target pass costs with the installed fork's ggml against another build of it, paired.

    python -m benchmarks.passes kernel-ab OTHER/libggml.so [--target T.gguf] [--rows 1 2 3 5] [--context 128]
                                   [--rounds 6] [--repeats 9] [--repack] [--json out.json]

For a kernel change in the fork: build the fork before the change, keep its libggml.so, install
the change, and compare. Each round measures both builds, one process each (the other one
preloaded with LD_PRELOAD, which takes the place of the installed library of the same name), in
alternating order; a process times --repeats passes of each row count after --context cached
tokens (pass_cost.py's timing). Reported per row count: the medians of both, the median of the
per-round ratios installed / other (rounds pair the builds a few seconds apart, so the machine's
drift mostly cancels), and each build's cost against its own one-row pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from benchmarks.harness import json_of_process, write_result


THREADS = 2


def child(target: str, rows: list[int], context: int, repeats: int, repack: bool) -> None:
    from ikdflash import _core

    model = _core.Model(target, n_ctx=context + max(rows) + 8, n_threads=THREADS, n_batch=max(rows), repack=repack)
    try:
        _core.measure.time_passes(model, rows, context, 2)  # warm-up: pages weights in, plans buffers
        times = _core.measure.time_passes(model, rows, context, repeats)
    finally:
        model.close()
    print(json.dumps([statistics.median(t) for t in times]))


def measure(other: Path | None, args: argparse.Namespace, target: str) -> list[float]:
    env = dict(os.environ)
    if other is not None:
        env["LD_PRELOAD"] = str(other)
    command = [sys.executable, "-m", "benchmarks.passes", "kernel-ab", "--child", "--target", target,
               "--context", str(args.context), "--repeats", str(args.repeats), "--rows", *map(str, args.rows),
               *(["--repack"] if args.repack else [])]
    return json_of_process(command, f"a measuring process failed ({'other' if other else 'installed'} build)", env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, nargs="?", help="the other build's libggml.so")
    parser.add_argument("--target", help="target GGUF (default: the built-in pair's, downloaded once)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--repack", action="store_true",
                        help="repack the weights at load (llama-server's -rtr; the built-in target's default)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows[0] != 1:
        parser.error("--rows must start with 1 (the other counts are reported against it)")
    if args.child:
        child(args.target, args.rows, args.context, args.repeats, args.repack)
        return
    if args.other is None or not args.other.is_file():
        parser.error(f"the other build's libggml.so is required and must exist (got {args.other})")
    if args.target is None:
        from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

        args.target = str(resolve_pair(DEFAULT_PAIR)[0])
    runs: dict[str, list[list[float]]] = {"installed": [], "other": []}
    for r in range(args.rounds):
        order = ("installed", "other") if r % 2 == 0 else ("other", "installed")
        for name in order:
            runs[name].append(measure(args.other.resolve() if name == "other" else None, args, args.target))
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr)
    table = []
    print(f"{'rows':>4} | {'installed':>9} {'other':>9} | installed/other | x1 row: installed other")
    for j, n in enumerate(args.rows):
        mine = statistics.median(m[j] for m in runs["installed"])
        theirs = statistics.median(o[j] for o in runs["other"])
        paired = statistics.median(m[j] / o[j] for m, o in zip(runs["installed"], runs["other"], strict=True))
        own = [statistics.median(x[j] / x[0] for x in runs[k]) for k in ("installed", "other")]
        table.append({"rows": n, "installed_ms": mine, "other_ms": theirs, "installed_over_other": paired,
                      "per_round": [m[j] / o[j] for m, o in zip(runs["installed"], runs["other"], strict=True)],
                      "installed_vs_one_row": own[0], "other_vs_one_row": own[1]})
        print(f"{n:>4} | {mine:7.2f}ms {theirs:7.2f}ms | {paired:15.3f} | {own[0]:17.2f}x {own[1]:5.2f}x")
    if args.json:
        write_result(args.json, {"target": args.target, "other": str(args.other), "context": args.context, "repack": args.repack,
                                 "rounds": args.rounds, "repeats": args.repeats, "rows": table}, THREADS)

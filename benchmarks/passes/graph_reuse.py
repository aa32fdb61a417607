"""What a target pass of n rows costs when its graph is reused (the same shape as the pass before,
as in a run of DFlash steps that verify the same number of drafts) against rebuilt (another
shape came between), and the multi-row cost curve of each.

    python -m benchmarks.passes graph-reuse [--target T.gguf] [--rows 1 2 3 4 5] [--context 256]
                                     [--rounds 15] [--passes 6] [--threads 2] [--json out.json]

The fork keeps the last pass's graph and reuses it for a pass of the same shape (tokens, outputs,
KV cells in view, one sequence); any other shape rebuilds and re-plans it. Each round times, for
every row count, --passes passes back to back (all but the first reuse the graph) and as many
taking turns with a pass of another row count (each one rebuilt); the rounds interleave the
modes so that a shared machine's drift falls on both. Reported: the medians per mode, the share
of a pass that rebuilding costs, and each row count's cost as a multiple of one row's, per mode.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from ikdflash import _core
from benchmarks.passes.cost import add_target_and_rows, check_target_and_rows
from benchmarks.harness import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_and_rows(parser, [1, 2, 3, 4, 5])
    parser.add_argument("--context", type=int, default=256, help="cached tokens before every pass")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--passes", type=int, default=6, help="passes per mode, row count and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    check_target_and_rows(parser, args)

    most = max(args.rows) + 1
    model = _core.Model(str(args.target), n_ctx=args.context + most, n_threads=args.threads, n_batch=most)
    reused: dict[int, list[float]] = {n: [] for n in args.rows}
    rebuilt: dict[int, list[float]] = {n: [] for n in args.rows}
    try:
        _core.measure.time_passes(model, args.rows, args.context, 1)  # warm-up: pages weights in, plans buffers
        for _ in range(args.rounds):
            for n in args.rows:
                reused[n] += _core.measure.time_passes(model, [n], args.context, args.passes)[0][1:]  # first: a build
                rebuilt[n] += _core.measure.time_passes(model, [n, n + 1], args.context, args.passes)[0]
    finally:
        model.close()

    def median(d: dict[int, list[float]]) -> dict[int, float]:
        return {n: statistics.median(v) for n, v in d.items()}

    ms_reused, ms_rebuilt = median(reused), median(rebuilt)
    print(f"{args.target.name}, {args.context} cached tokens, {args.threads} threads, {args.rounds} rounds")
    print(f"{'rows':>4} {'reused ms':>9} {'rebuilt ms':>10} {'rebuild share':>13} {'x 1 row reused':>14} "
          f"{'x 1 row rebuilt':>15}")
    rows = []
    for n in args.rows:
        share = 1 - ms_reused[n] / ms_rebuilt[n]
        row = {"rows": n, "reused_ms": round(ms_reused[n], 3), "rebuilt_ms": round(ms_rebuilt[n], 3),
               "rebuild_share": round(share, 3), "ratio_reused": round(ms_reused[n] / ms_reused[1], 3),
               "ratio_rebuilt": round(ms_rebuilt[n] / ms_rebuilt[1], 3)}
        rows.append(row)
        print(f"{n:>4} {row['reused_ms']:>9.2f} {row['rebuilt_ms']:>10.2f} {share:>13.1%} "
              f"{row['ratio_reused']:>14.2f} {row['ratio_rebuilt']:>15.2f}")
    if args.json:
        write_result(args.json, {"target": args.target.name, "context": args.context, "rounds": args.rounds,
                                 "passes": args.passes, "rows": rows}, args.threads)

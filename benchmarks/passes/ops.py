"""Where a multi-row target pass spends what a one-row pass does not: the pass split by operation.

    python -m benchmarks.passes ops [--target T.gguf] [--rows 1 2 5] [--context 512] [--repeats 7]
                                  [--threads 2] [--repack] [--json out.json]

pass_cost.py says how much a pass of n rows costs against one row; this says where the extra goes.
Each pass runs through the context's eval callback, which makes ggml compute the graph one node at
a time and report each: a matrix product is named by its weight ("mul_mat attn_q" sums that
weight's products over every layer, "mul_mat output" is the head), other nodes by their operation.
A node computed alone also pays a thread pool's start, the same at every row count, so the split's
total is above an undivided pass's (both are printed); the columns to read are each operation's
extra milliseconds over one row and its share of the whole extra. Medians over --repeats passes
per row count, the counts taking turns (pass_cost.py's timing).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from ikdflash import _core
from benchmarks.passes.cost import add_target_and_rows, check_target_and_rows
from benchmarks.harness import write_result


def split(path: Path, rows: list[int], context: int, repeats: int, threads: int, repack: bool) -> dict:
    """Per row count: the undivided pass's median ms, and each operation's median ms."""
    model = _core.Model(str(path), n_ctx=context + max(rows) + 8, n_threads=threads, n_batch=max(rows),
                        repack=repack)
    try:
        _core.measure.time_passes(model, rows, context, 2)  # warm-up: pages weights in, plans buffers
        undivided = _core.measure.time_passes(model, rows, context, repeats)
        by_op = _core.measure.time_pass_ops(model, rows, context, repeats)
    finally:
        model.close()
    out = {}
    for n, passes, ops in zip(rows, undivided, by_op, strict=True):
        names = sorted({name for one in ops for name in one})
        out[n] = {"pass_ms": statistics.median(passes),
                  "op_ms": {name: statistics.median(one.get(name, 0.0) for one in ops) for name in names}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_and_rows(parser, [1, 2, 5])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repack", action="store_true", help="repack weights at load (llama-server's -rtr)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    check_target_and_rows(parser, args)
    result = split(args.target, args.rows, args.context, args.repeats, args.threads, args.repack)
    one, most = result[args.rows[0]], result[args.rows[-1]]
    names = sorted(one["op_ms"], key=lambda name: most["op_ms"].get(name, 0.0) - one["op_ms"][name], reverse=True)
    extra_total = {n: sum(result[n]["op_ms"].values()) - sum(one["op_ms"].values()) for n in args.rows[1:]}
    print(f"{args.target.name}, {args.context} cached tokens, {args.threads} threads"
          f"{', repacked' if args.repack else ''}; extra ms over one row (share of the whole extra)")
    print(f"{'operation':>24} {'1 row':>8} | " + " ".join(f"{f'{n} rows':>16}" for n in args.rows[1:]))
    for name in names:
        cells = []
        for n in args.rows[1:]:
            extra = result[n]["op_ms"].get(name, 0.0) - one["op_ms"][name]
            cells.append(f"{extra:>+7.2f} ({extra / extra_total[n]:>5.0%})" if extra_total[n] else f"{extra:>+16.2f}")
        print(f"{name:>24} {one['op_ms'][name]:>6.2f}ms | " + " ".join(cells))
    print(f"{'split total':>24} {sum(one['op_ms'].values()):>6.2f}ms | "
          + " ".join(f"{extra_total[n]:>+7.2f}{'':>9}" for n in args.rows[1:]))
    print(f"{'undivided pass':>24} {one['pass_ms']:>6.2f}ms | "
          + " ".join(f"{result[n]['pass_ms'] / one['pass_ms']:>6.2f}x{'':>9}" for n in args.rows[1:]))
    if args.json:
        write_result(args.json, {"target": str(args.target), "context": args.context, "repack": args.repack,
                                 "rows": result}, args.threads)

"""What a target pass over n rows costs against one row, per weight type, with and without run-time
repacking, beside the machine's memory-read floor.

    python -m benchmarks.passes cost [--target T.gguf] [--types shipped Q4_0 Q8_0 Q4_K_M Q6_K IQ4_XS IQ4_NL]
                                   [--rows 1 2 3 4 5 6 8 12 16] [--contexts 64 512 2048]
                                   [--repeats 7] [--threads 2] [--json out.json]

A DFlash step verifies k drafts in one target pass of k + 1 rows, so speculation pays only where
such a pass costs little more than one row. For each type (`shipped` is the target as given; the
others are requantized from it with the fork's own quantizer, lossy on lossy, which is fine for a
cost), the target is loaded with and without run-time repacking (llama-server's -rtr), and for each
context length the passes of every row count take turns, --repeats rounds, each pass after the same
cached tokens (every row's logits kept, as in a verification pass). Reported: the median time of a
one-row pass, each row count's median as a multiple of it, and the floor: the file's bytes over the
2-thread memory-read bandwidth measured first (weights that do not fit in cache are read once per
pass whatever the row count). Each (type, repacking) runs in a process of its own, so one that
aborts in the fork is reported and the others still run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from ikdflash import _core

from benchmarks.harness import write_result


def add_target_and_rows(parser: argparse.ArgumentParser, rows: list[int]) -> None:
    """--target and --rows, as the pass-cost benchmarks take them."""
    parser.add_argument("--target", type=Path, help="target GGUF (default: the built-in pair's, downloaded once)")
    parser.add_argument("--rows", type=int, nargs="+", default=rows)


def check_target_and_rows(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--rows must start at one row (the others are reported against it); no --target: the
    built-in pair's."""
    if args.rows[0] != 1:
        parser.error("--rows must start with 1 (the other counts are reported against it)")
    if args.target is None:
        from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

        args.target = resolve_pair(DEFAULT_PAIR)[0]


def measure(path: Path, repack: bool, rows: list[int], contexts: list[int], repeats: int, threads: int) -> dict:
    model = _core.Model(str(path), n_ctx=max(contexts) + max(rows), n_threads=threads, n_batch=max(rows),
                        repack=repack)
    try:
        _core.measure.time_passes(model, rows, min(contexts), 1)  # warm-up: pages weights in, plans buffers
        out = {}
        for n_context in contexts:
            times = _core.measure.time_passes(model, rows, n_context, repeats)
            ms = [statistics.median(t) for t in times]
            out[n_context] = {"one_row_ms": ms[0], "ratio": {r: m / ms[0] for r, m in zip(rows, ms, strict=True)}}
        return out
    finally:
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_and_rows(parser, [1, 2, 3, 4, 5, 6, 8, 12, 16])
    parser.add_argument("--types", nargs="+", default=["shipped", "Q4_0", "Q8_0", "Q4_K_M", "Q6_K", "IQ4_XS", "IQ4_NL"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    check_target_and_rows(parser, args)
    bandwidth = _core.measure.memory_read_bandwidth(args.threads)
    print(f"memory read, {args.threads} threads: {bandwidth:.1f} GB/s")
    header = f"{'type':>8} {'rtr':>3} {'MB':>5} {'floor':>6} {'ctx':>5} {'1 row':>7} | " + " ".join(
        f"{r:>5}" for r in args.rows[1:])
    print(header)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for type_name in args.types:
            path = args.target
            if type_name != "shipped":
                path = Path(tmp) / f"{type_name}.gguf"
                _core.measure.quantize(str(args.target), str(path), type_name, args.threads)
            size_mb = path.stat().st_size / 1e6
            floor_ms = size_mb / bandwidth  # MB over GB/s: milliseconds
            for repack in (False, True):
                try:
                    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                        by_context = pool.submit(measure, path, repack, args.rows, args.contexts, args.repeats,
                                                 args.threads).result()
                except BrokenProcessPool:
                    print(f"{type_name:>8} {'on' if repack else 'off':>3} {size_mb:>5.0f}: the fork aborted "
                          "(its message is above)", flush=True)
                    results.append({"type": type_name, "repack": repack, "size_mb": size_mb, "aborted": True})
                    continue
                for n_context, row in by_context.items():
                    print(f"{type_name:>8} {'on' if repack else 'off':>3} {size_mb:>5.0f} {floor_ms:>5.1f}ms "
                          f"{n_context:>5} {row['one_row_ms']:>5.2f}ms | "
                          + " ".join(f"{row['ratio'][r]:>4.2f}x" for r in args.rows[1:]), flush=True)
                results.append({"type": type_name, "repack": repack, "size_mb": size_mb, "floor_ms": floor_ms,
                                "contexts": by_context})
    if args.json:
        write_result(args.json, {"target": str(args.target), "read_gb_per_s": bandwidth, "rows": args.rows,
                                 "results": results}, args.threads)

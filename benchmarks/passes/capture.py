"""What capturing the draft's target layers costs a target pass: the same passes with and without
the capture, side by side.

    python -m benchmarks.passes capture [--target T.gguf] [--layers 1 14 27] [--tokens 5 16 512]
                                      [--threads 2] [--gpu-layers 0] [--repeats 9] [--top-k 16] [--json out.json]

For each pass size in --tokens (5 is a verification block at n_max 4, 16 a block of the draft's
size, 512 a prompt chunk), the target (default: the built-in pair's, whose draft reads layers 1,
14 and 27) runs a run of consecutive passes of that size from an empty KV cache, up to 2048
positions, through `Model.layer_features` with n_batch = the pass size: once capturing --layers
and once capturing nothing, alternating, --repeats times. The capture is set up once per run, as
the speculative loop sets it up once, so its setup is spread over the run's passes. Reported:
medians of the time per pass, and their ratio. --top-k K adds a third turn: the capture with each
row's K likeliest next tokens kept too (what training data is made with), against the capture alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ikdflash import _core

from benchmarks.harness import write_result

RUN_POSITIONS = 2048  # a run of passes fills the KV cache up to here


def pass_ms(model: _core.Model, tokens: list[int], layer_ids: list[int], n_passes: int, top_k: int = 0) -> float:
    start = time.perf_counter()
    _core.training.layer_features(model, tokens, layer_ids, top_k)
    return (time.perf_counter() - start) * 1000 / n_passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target GGUF (default: the built-in pair's, downloaded once)")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 14, 27], help="target layers to capture")
    parser.add_argument("--tokens", type=int, nargs="+", default=[5, 16, 512], help="pass sizes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--top-k", type=int, default=0, help="also time the capture keeping K top tokens a row")
    parser.add_argument("--json", help="write the table here too")
    args = parser.parse_args()
    if args.target is None:
        from ikdflash.sources.references import resolve_pair
        args.target = str(resolve_pair("smollm2-135m-swa")[0])
    rows = []
    top = f" {'+top ms':>8} {'ratio':>6}" if args.top_k else ""
    print(f"{'tokens':>7} {'passes':>7} {'no capture ms':>14} {'capture ms':>11} {'ratio':>6}{top}")
    for n in args.tokens:
        n_passes = max(2, min(64, RUN_POSITIONS // n))
        model = _core.Model(args.target, n_ctx=n * n_passes, n_threads=args.threads,
                            n_gpu_layers=args.gpu_layers, n_batch=n)
        tokens = [(17 * i + 100) % model.n_vocab for i in range(n * n_passes)]
        pass_ms(model, tokens, args.layers, n_passes)  # warm-up: buffers sized, caches filled
        times: dict[str, list[float]] = {"off": [], "on": [], "top": []}
        for _ in range(args.repeats):
            times["off"].append(pass_ms(model, tokens, [], n_passes))
            times["on"].append(pass_ms(model, tokens, args.layers, n_passes))
            if args.top_k:
                times["top"].append(pass_ms(model, tokens, args.layers, n_passes, args.top_k))
        model.close()
        row = {"tokens": n, "passes": n_passes, "no_capture_ms": statistics.median(times["off"]),
               "capture_ms": statistics.median(times["on"])}
        row["ratio"] = row["capture_ms"] / row["no_capture_ms"]
        line = f"{n:>7} {n_passes:>7} {row['no_capture_ms']:>14.2f} {row['capture_ms']:>11.2f} {row['ratio']:>6.3f}"
        if args.top_k:
            row["top_ms"] = statistics.median(times["top"])
            row["top_ratio"] = row["top_ms"] / row["capture_ms"]  # against the capture alone
            line += f" {row['top_ms']:>8.2f} {row['top_ratio']:>6.3f}"
        rows.append(row)
        print(line)
    if args.json:
        write_result(args.json, {"target": args.target, "layers": args.layers, "gpu_layers": args.gpu_layers,
                                 "top_k": args.top_k, "rows": rows}, args.threads)

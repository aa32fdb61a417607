"""Draft-step time against cross_ctx on the CPU: sliding window honoured vs every layer full.

    python -m benchmarks.passes draft-step [--cross-ctx 256 1024 4096] [--window 64] [--repeats 3] [--json out.json]
    python -m benchmarks.passes draft-step --prompt-tokens 64 --cross-ctx 512 65536   # a short prompt

A tiny 5 sliding + 1 full draft (small window) on a tiny qwen3 target. For each cross_ctx the
prompt is longer than cross_ctx (or --prompt-tokens long), so the cross-context is full when
drafting starts; the engine then speculates and reports the time spent in draft steps. With a
short prompt, a large cross_ctx must cost nothing until rows fill it: the last line gives the
first cross_ctx's draft steps per second over the last's. The two modes run interleaved, in
one process, and the median of the repeats is reported: compare the ratios, not the absolute
times (shared, noisy machines).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from ikdflash import Engine
from ikdflash.convert import convert
from tests.fixtures.tinydraft import write_hf_target, write_tiny_draft
from tests.fixtures.tinymodels import write_tiny_model
from benchmarks.harness import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cross-ctx", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (default: cross_ctx + 64)")
    parser.add_argument("--gpu-layers", type=int, default=0, help="target layers on the GPU (the draft follows)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = write_tiny_model(tmp / "target.gguf", arch="qwen3", n_ctx_train=65536)
        hf = write_hf_target(tmp / "hf", target)
        checkpoint = write_tiny_draft(tmp / "draft", hf, target_layer_ids=[0, 2], block_size=16,
                                      layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                      sliding_window=args.window)
        draft = convert(checkpoint, hf, outtype="f16", log=lambda _: None)
        for cross_ctx in args.cross_ctx:
            prompt = [(i * 7919) % 250 for i in range(args.prompt_tokens or cross_ctx + 64)]
            n_ctx = max(len(prompt) + args.max_tokens + 16, cross_ctx)
            times: dict[str, list[float]] = {"sliding": [], "all_full": []}
            engines = {mode: Engine(target, draft, n_ctx=n_ctx, cross_ctx=cross_ctx, n_threads=args.threads,
                                    full_attention=(mode == "all_full"), n_gpu_layers=args.gpu_layers)
                       for mode in times}
            for _ in range(args.repeats):
                for mode, engine in engines.items():
                    st = engine.speculate(prompt, max_tokens=args.max_tokens, n_max=15, adaptive=False).stats
                    times[mode].append(st.draft_time / st.steps * 1e3)
            for engine in engines.values():
                engine.close()
            row = {"cross_ctx": cross_ctx, "window": args.window,
                   "sliding_ms": statistics.median(times["sliding"]),
                   "all_full_ms": statistics.median(times["all_full"])}
            row["all_full_over_sliding"] = row["all_full_ms"] / row["sliding_ms"]
            rows.append(row)
            print(f"cross_ctx {cross_ctx:>6}: draft step {row['sliding_ms']:7.2f} ms sliding, "
                  f"{row['all_full_ms']:7.2f} ms all-full  ({row['all_full_over_sliding']:.2f}x)", flush=True)
    if len(rows) > 1:
        ratio = rows[0]["sliding_ms"] / rows[-1]["sliding_ms"]
        print(f"draft steps/s at cross_ctx {rows[-1]['cross_ctx']} over {rows[0]['cross_ctx']}: {ratio:.2f} (sliding)")
    if args.json:
        write_result(args.json, rows, args.threads)

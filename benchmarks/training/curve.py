"""Held-out acceptance against training time: every snapshot of one or more `ikdflash train` runs
(made with --snapshot-minutes), converted to GGUF and measured in the fork's own loop.

    python -m benchmarks.training curve runs/smollm2-seed runs/smollm2-all-sliding --prompts 24 --json curve.json
    python -m benchmarks.training curve runs/v7/ft --target T.gguf --system "You are a helpful assistant."   # as chat_tau.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ikdflash.convert import convert
from ikdflash.sources.references import resolve
from ikdflash.train.evaluate import held_out_prompts
from ikdflash.train.evaluate import measure_acceptance

from benchmarks.harness import write_result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--target", required=True, help="the target GGUF: a path, a hub reference or a packaged model")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--system", help="a system message before each prompt (default: the template's own)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    args.target = str(resolve(args.target, role="target"))
    prompts = held_out_prompts(args.target, None, args.prompts, system=args.system)
    rows = []
    print(f"{'run':<28} {'minutes':>8} {'steps':>7} {'tau':>6} {'accept':>7}  per position")
    for run in args.runs:
        snapshots = sorted((run / "snapshots").glob("step-*")) + [run / "draft-hf"]
        for folder in snapshots:
            if not (folder / "config.json").is_file():
                continue
            notes = json.loads((folder / "config.json").read_text()).get("ikdflash_train", {})
            with tempfile.TemporaryDirectory() as tmp:
                gguf = convert(folder, Path(args.target), outtype="q8_0", outfile=Path(tmp) / "draft.gguf",
                               log=lambda _: None)
                result = measure_acceptance(args.target, gguf, prompts, max_tokens=args.max_tokens,
                                            n_threads=args.threads)
            row = {"run": run.name, "minutes": notes.get("train_seconds", 0) / 60, "steps": notes.get("steps"),
                   **result.as_dict()}
            rows.append(row)
            print(f"{run.name:<28} {row['minutes']:>8.1f} {row['steps']:>7} {result.tau:>6.3f} "
                  f"{result.acceptance:>7.1%}  " + " ".join(f"{p:.2f}" for p in result.per_position), flush=True)
    if args.json:
        write_result(args.json, rows, args.threads)
    return 0

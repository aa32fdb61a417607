"""The model card's validation, reproducible: acceptance and speed against prompt length, with
the draft's sliding windows honoured, with every layer full, and without a draft.

    ikdflash bench --target T.gguf --draft D.gguf --lengths 1024 4096 8192 16384
    ikdflash bench --target T.gguf --draft D.gguf --text book.txt --csv out.csv --json out.json
    ikdflash bench --pair qwen3.5-35b-a3b-swa --gpu-layers 99     # models as serve/download take them

Prompts are cut from --text (or from a built-in paragraph, repeated) to each length in tokens.
Each mode loads the models once and runs every length, in the same process, so the columns are
comparable side by side; compare ratios, not absolute speeds, on shared machines.
Columns: clip = share of the prompt outside the window, (length - W) / length; acceptance =
accepted / drafted; tau = tokens per verification pass; tok/s = generation speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ikdflash.engine import Engine, SpeculationStats
from ikdflash.hub import HubError, add_model_arguments, resolve_models
from ikdflash.pair import check_pair

FILLER = ("The history of the river town is the history of its bridges. Each generation built one, "
          "argued about it, and then watched the water take it away in a spring flood. ")
MODES = ("sliding", "full_attention", "no_draft")


@dataclass
class Row:
    length: int
    clip: float
    sliding_acceptance: float
    sliding_tau: float
    sliding_tps: float
    full_acceptance: float
    full_tau: float
    full_tps: float
    no_draft_tps: float

    @property
    def acceptance_change(self) -> float:
        return self.sliding_acceptance - self.full_acceptance

    @property
    def speedup(self) -> float:
        return self.sliding_tps / self.no_draft_tps if self.no_draft_tps else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--text", type=Path, help="cut prompts from this file (default: a built-in paragraph)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-max", type=int, default=4)
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--csv", type=Path, help="also write the table as CSV")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")


def progress(done: int, total: int, what: str) -> None:
    width = 24
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}", end="", file=sys.stderr,
          flush=True)


def prompts_for(engine: Engine, lengths: list[int], text_file: Path | None) -> dict[int, list[int]]:
    text = text_file.read_text(errors="replace") if text_file else FILLER
    tokens = engine.target.tokenize(text, add_special=False)
    if not tokens:
        raise ValueError(f"{text_file}: no text to cut prompts from")
    while len(tokens) < max(lengths):
        tokens = tokens + tokens
    return {n: tokens[:n] for n in lengths}


def measure(args: argparse.Namespace, window: int) -> list[Row]:
    n_ctx = max(args.lengths) + args.max_tokens + 16
    results: dict[str, dict[int, SpeculationStats]] = {m: {} for m in MODES}
    total, done = len(MODES) * len(args.lengths), 0
    for mode in MODES:
        with Engine(args.target, None if mode == "no_draft" else args.draft, n_ctx=n_ctx, n_threads=args.threads,
                    n_gpu_layers=args.gpu_layers, full_attention=(mode == "full_attention")) as engine:
            prompts = prompts_for(engine, args.lengths, args.text)
            for length in args.lengths:
                progress(done, total, f"{mode}, {length} tokens")
                if mode == "no_draft":
                    out = engine.generate(prompts[length], max_tokens=args.max_tokens)
                else:
                    out = engine.speculate(prompts[length], max_tokens=args.max_tokens, n_max=args.n_max)
                results[mode][length] = out.stats
                done += 1
    progress(done, total, "done")
    print(file=sys.stderr)
    rows = []
    for n in args.lengths:
        s, f, b = results["sliding"][n], results["full_attention"][n], results["no_draft"][n]
        rows.append(Row(length=n, clip=max(0.0, (n - window) / n) if window else 0.0,
                        sliding_acceptance=s.acceptance, sliding_tau=s.mean_acceptance_length,
                        sliding_tps=s.tokens_per_second, full_acceptance=f.acceptance,
                        full_tau=f.mean_acceptance_length, full_tps=f.tokens_per_second,
                        no_draft_tps=b.tokens_per_second))
    return rows


def table(rows: list[Row], window: int) -> str:
    head = (f"{'length':>7} {'clip':>6} | {'accept':>7} {'tau':>5} {'tok/s':>8} | {'full: accept':>12} {'tau':>5} "
            f"{'tok/s':>8} | {'Δaccept':>8} | {'no draft tok/s':>14} {'speed-up':>8}")
    lines = [f"window {window}" if window else "no sliding window", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.length:>7} {r.clip:>6.1%} | {r.sliding_acceptance:>7.1%} {r.sliding_tau:>5.2f} "
                     f"{r.sliding_tps:>8.1f} | {r.full_acceptance:>12.1%} {r.full_tau:>5.2f} {r.full_tps:>8.1f} | "
                     f"{r.acceptance_change:>+8.1%} | {r.no_draft_tps:>14.1f} {r.speedup:>7.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if min(args.lengths) < 1 or args.max_tokens < 1 or args.n_max < 1:
        print("ikdflash bench: error: lengths, --max-tokens and --n-max must be at least 1", file=sys.stderr)
        return 2
    try:
        args.target, args.draft = resolve_models(args)
        report = check_pair(args.target, args.draft)
    except (HubError, FileNotFoundError, ValueError) as e:
        print(f"ikdflash bench: error: {e}", file=sys.stderr)
        return 2
    if report.problems:
        for problem in report.problems:
            print(f"ikdflash bench: error: {problem}", file=sys.stderr)
        return 2
    window = int(report.facts["window"]) if report.facts["sliding_layers"] else 0
    rows = measure(args, window)
    print(table(rows, window))
    records = [asdict(r) | {"acceptance_change": r.acceptance_change, "speedup": r.speedup} for r in rows]
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    if args.json:
        args.json.write_text(json.dumps({"window": window, "n_max": args.n_max, "rows": records}, indent=2))
    return 0

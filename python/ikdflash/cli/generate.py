"""Generate with DFlash and say how much the draft helped.

    ikdflash generate "Explain rainbows to a child."            # the built-in pair, as a chat
    ikdflash generate --system "You are a helpful assistant." "..."
    ikdflash generate --pair NAME --max-tokens 256 "..."
    echo "Once upon a time" | ikdflash generate --raw --target T.gguf --draft D.gguf
    ikdflash generate --no-compare "..."                        # without the target alone's run

The prompt is wrapped in the target's chat template unless --raw. The text streams to stdout as
each step commits it; on stderr follow a line with tokens, speed, acceptance, mean acceptance
length (tau), why the text ended and what the adaptive block length did, then the target alone's
run of the same prompt and how DFlash's speed compares with it. The two runs are measured alike:
the target alone runs on DFlash's own engine, in the same memory (two engines in one process
decode at speeds that follow the order they were loaded in), after a short warm-up generation
(where the adaptive block length also times the target's passes); both stream through the same
path, and each speed is generated tokens over generation time (the prompt's pass excluded). The
built-in pair answers with a plain system prompt and a repetition penalty of 1.1 unless told
otherwise (sources.references.PAIR_CHAT_DEFAULTS).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ikdflash import pausepoint, rules
from ikdflash.cli.decoding import add_decoding_arguments, check_engine_options, decoding_options, system_message
from ikdflash.cli.stats import summary
from ikdflash.engine import Engine, SpeculationResult, SpeculationStats
from ikdflash.sources.references import HubError, add_model_arguments, resolve_models

# Below this speed-up DFlash is said not to pay: the machine's noise is a few percent.
PAYS = 1.03


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_arguments(parser)
    parser.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template")
    parser.add_argument("--system", help="a system message before the prompt (default: the built-in pair's "
                        "plain one; else the template's own, if any)")
    parser.add_argument("--max-tokens", type=int, default=256)
    add_decoding_arguments(parser)
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--stop", action="append", help="a string that ends the text (repeatable)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also generate with the target alone and compare speeds (default; --no-compare skips it)")


WARM_UP_TOKENS = 4  # a short generation before the timed ones


def streamed(engine: Engine, tokens: list[int], echo: bool, max_tokens: int, stop: Sequence[str],
             options: dict) -> SpeculationResult:
    """One generation through Engine.stream, printed as it commits when echo. Closed on the way
    out: Ctrl-C ends the generation after its current step, where the engine's close would
    otherwise wait for it to run to max_tokens."""
    with engine.stream(tokens, max_tokens=max_tokens, stop=stop, **options) as stream:
        for n, piece in enumerate(stream):
            if echo:
                print(piece, end="", flush=True)
                if n == 0:
                    pausepoint.reached("reply")
    assert stream.result is not None and stream.result.stats is not None
    return stream.result


SLACK = 1.15  # how far past its bounds a ratio may fall before the two runs count as unlike


def ratio_bounds(out: SpeculationStats, plain: SpeculationStats) -> tuple[float, float]:
    """The speed ratios DFlash's run can have against the target alone's when both ran at the
    machine's same speed (docs/commands.md#generate), in units of the target alone's step: at
    best each of DFlash's target passes cost one step and its drafting nothing; at worst each row
    it verified cost a step too, and its drafting came on top."""
    plain_busy = plain.draft_time + plain.verify_time
    plain_step = plain_busy / max(plain.steps, 1)
    best_time = max(out.steps, 1) * plain_step
    worst_time = (max(out.steps, 1) + out.drafted) * plain_step + out.draft_time
    speed = out.generated * plain_busy / plain.generated  # the ratio is speed / DFlash's time
    return speed / worst_time, speed / best_time


def comparison(out: SpeculationResult, plain: SpeculationResult) -> str:
    """The target alone's line: its speed, DFlash's against it, and plainly whether drafting paid;
    when the ratio is outside what the two runs' own counts allow, that the runs were too unlike
    to compare (the machine's speed changed between them). Outputs that differ are said always."""
    assert out.stats is not None and plain.stats is not None
    line = summary("target alone", plain.stats, plain.finish_reason)
    differ = " (outputs differ!)" if plain.tokens != out.tokens else ""
    if not (plain.stats.tokens_per_second > 0 and out.stats.tokens_per_second > 0):
        return line + differ  # a run that was all prompt pass (one token, or a stop at the first) has no speed
    ratio = out.stats.tokens_per_second / plain.stats.tokens_per_second
    low, high = ratio_bounds(out.stats, plain.stats)
    if not low / SLACK <= ratio <= high * SLACK:
        return line + (f"; the two runs are too unlike to compare (DFlash read {ratio:.2f}x, where its own counts "
                       f"allow {low:.2f}x to {high:.2f}x: the machine's speed changed between them)") + differ
    line += f"; DFlash {ratio:.2f}x its speed" + differ
    if not differ and out.stats.accepted:
        kept = {name: counts["accepted"] for name, counts in out.stats.by_proposer.items()}
        line += f" (most kept tokens proposed by the {max(kept, key=kept.__getitem__)})"
    if not differ and ratio < PAYS:
        share = out.stats.plain_share
        line += (": drafting does not pay for this pair on this machine" +
                 (f"; the adaptive block length decoded {share:.0%} of the tokens without drafts" if share else ""))
    return line


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("ikdflash generate: error: the prompt is empty", file=sys.stderr)
        return 2
    try:
        check_engine_options(args)
        options = decoding_options(args)
        target, draft = resolve_models(args)
        with Engine(target, draft, n_ctx=args.ctx_size, n_threads=args.threads) as engine:
            rules.n_max(args.n_max, engine.max_proposal, name="--n-max")
            if args.raw:
                tokens = engine.target.tokenize(prompt)
            else:
                system = system_message(args)
                tokens = engine.chat_tokens(([("system", system)] if system else []) + [("user", prompt)])
            alone_options = {k: v for k, v in options.items() if k not in ("n_max", "adaptive", "lookup", "confidence", "conf_min")}
            alone_options.update(n_max=0, adaptive=False)
            stop = args.stop or ()
            if args.compare:
                streamed(engine, tokens, False, WARM_UP_TOKENS, stop, options)
            out = streamed(engine, tokens, True, args.max_tokens, stop, options)
            print()
            assert out.stats is not None
            print(summary("dflash", out.stats, out.finish_reason), file=sys.stderr)
            if args.compare:
                plain = streamed(engine, tokens, False, args.max_tokens, stop, alone_options)
                print(comparison(out, plain), file=sys.stderr)
    except (HubError, FileNotFoundError, ValueError, RuntimeError) as e:  # RuntimeError: a failed decode
        print(f"ikdflash generate: error: {e}", file=sys.stderr)
        return 2
    return 0

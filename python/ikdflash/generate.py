"""Generate with DFlash and say how much the draft helped.

    ikdflash generate "Explain rainbows to a child."            # the built-in pair, as a chat
    ikdflash generate --system "You are a helpful assistant." "..."
    ikdflash generate --pair NAME --max-tokens 256 "..."
    echo "Once upon a time" | ikdflash generate --raw --target T.gguf --draft D.gguf
    ikdflash generate --compare "..."                           # and the target alone, side by side

The prompt is wrapped in the target's chat template unless --raw. The text streams to stdout as
each step commits it; the last line (stderr) gives tokens, speed, acceptance, mean acceptance
length (tau) and why the text ended.
"""

from __future__ import annotations

import argparse
import sys

from ikdflash import pausepoint
from ikdflash.engine import Engine, SpeculationStats
from ikdflash.hub import HubError, add_model_arguments, resolve_models


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_arguments(parser)
    parser.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template")
    parser.add_argument("--system", help="a system message before the prompt (default: the template's own, if any)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--n-max", type=int, default=4, help="draft tokens per step (default 4)")
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--stop", action="append", help="a string that ends the text (repeatable)")
    parser.add_argument("--compare", action="store_true", help="also generate with the target alone")


def summary(label: str, stats: SpeculationStats, finish_reason: str) -> str:
    line = f"{label}: {stats.generated} tokens ({finish_reason}), {stats.tokens_per_second:.1f} tok/s"
    if stats.drafted:
        line += (f", acceptance {stats.acceptance:.1%}, tau {stats.mean_acceptance_length:.2f} "
                 f"({stats.accepted}/{stats.drafted} drafts accepted in {stats.steps} steps)")
    return line


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("ikdflash generate: error: the prompt is empty", file=sys.stderr)
        return 2
    try:
        target, draft = resolve_models(args)
        with Engine(target, draft, n_ctx=args.ctx_size, n_threads=args.threads) as engine:
            if args.raw:
                tokens = engine.target.tokenize(prompt)
            else:
                tokens = engine.chat_tokens(([("system", args.system)] if args.system else []) + [("user", prompt)])
            # closed on the way out: Ctrl-C ends the generation after its current step, where the
            # engine's close would otherwise wait for it to run to max_tokens
            with engine.stream(tokens, max_tokens=args.max_tokens, n_max=args.n_max, stop=args.stop or ()) as stream:
                for n, piece in enumerate(stream):
                    print(piece, end="", flush=True)
                    if n == 0:
                        pausepoint.reached("reply")
            print()
            out = stream.result
            assert out.stats is not None
            print(summary("dflash", out.stats, out.finish_reason), file=sys.stderr)
            if args.compare:
                plain = engine.generate(tokens, max_tokens=args.max_tokens, stop=args.stop or ())
                assert plain.stats is not None
                ratio = out.stats.tokens_per_second / plain.stats.tokens_per_second if plain.stats.generated else 0.0
                print(summary("target alone", plain.stats, plain.finish_reason) + f"; DFlash speed-up {ratio:.2f}x"
                      + ("" if plain.tokens == out.tokens else " (outputs differ!)"), file=sys.stderr)
    except (HubError, FileNotFoundError, ValueError) as e:
        print(f"ikdflash generate: error: {e}", file=sys.stderr)
        return 2
    return 0

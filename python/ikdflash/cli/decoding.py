"""What the commands that generate (generate, chat) share: the draft length and sampling flags,
their checks, and the built-in pair's chat defaults under them."""

from __future__ import annotations

import argparse

from ikdflash import rules
from ikdflash.engine import Sampling
from ikdflash.sources.references import chat_defaults


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Draft length and sampling, for the commands that generate (generate, chat)."""
    parser.add_argument("--n-max", type=int, help="draft tokens per step, at most: 1 up to what one draft pass "
                        "proposes (default 4, or that when fewer)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="each step verifies as many drafts as pay on this machine (default); "
                             "--no-adaptive: always --n-max")
    add_proposal_arguments(parser)
    parser.add_argument("--temperature", type=float, help="0: greedy (default)")
    parser.add_argument("--repeat-penalty", type=float,
                        help="penalty on the last 64 tokens (default 1: off; the built-in pair: 1.1)")
    parser.add_argument("--seed", type=int, help="sampling seed (with --temperature)")


def add_proposal_arguments(parser: argparse.ArgumentParser) -> None:
    """--lookup and --confidence (and their --no- forms) and --conf-min, for every command that
    speculates (generate, chat, serve)."""
    parser.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                        help="an n-gram lookup over the prompt and the reply proposes beside the draft, verified "
                             "where it pays more (default; adaptive only); --no-lookup: the draft alone")
    parser.add_argument("--confidence", action=argparse.BooleanOptionalAction, default=False,
                        help="each draft token's confidence, calibrated against what the target keeps, sets how "
                             "many of a step's drafts are verified (adaptive only; default off: it has not paid "
                             "on a CPU yet)")
    parser.add_argument("--conf-min", type=float, default=0.0,
                        help="no draft token from the first whose confidence is below this is verified (0..1; "
                             "default 0: none; llama.cpp's --spec-draft-conf-min)")


def check_engine_options(args: argparse.Namespace) -> None:
    """The context and thread counts of the commands that load an engine (generate, chat)."""
    rules.at_least_one(args.ctx_size, "--ctx-size")
    if args.threads is not None:
        rules.at_least_one(args.threads, "--threads")


def decoding_options(args: argparse.Namespace) -> dict:
    """Engine keywords from add_decoding_arguments' options (and --max-tokens), over the pair's
    chat defaults; each value checked by its rule before anything is loaded (ValueError)."""
    rules.max_tokens(args.max_tokens, name="--max-tokens")
    rules.n_max(args.n_max, None, name="--n-max")  # its upper bound once the draft is loaded
    options = {k: v for k, v in chat_defaults(args).items() if k != "system"}
    options.update({name: getattr(args, name) for name in ("temperature", "repeat_penalty", "seed")
                    if getattr(args, name) is not None})
    sampling = Sampling(**options)  # the sampling rules
    if "seed" in options:
        options["seed"] = sampling.seed  # -1 drawn once, so that every run of the command shares it
    return {"n_max": args.n_max, "adaptive": args.adaptive, "lookup": args.lookup, "confidence": args.confidence,
            "conf_min": rules.conf_min(args.conf_min, "--conf-min"), **options}


def system_message(args: argparse.Namespace) -> str | None:
    return args.system if args.system is not None else chat_defaults(args).get("system")

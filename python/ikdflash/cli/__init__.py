"""The `ikdflash` command. This file only wires subcommands; each lives in its own module here,
imported when the parser is built (so `python -m ikdflash.cli.train` and `python -m
ikdflash.cli.convert` run without the compiled fork)."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ["generate", "chat", "serve", "bench", "download", "doctor", "models", "convert", "train", "rpc-worker"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ikdflash", description="DFlash speculative decoding with sliding-window drafts on ik_llama.cpp.")
    from ikdflash import __version__
    parser.add_argument("--version", action="version", version=f"ikdflash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"ikdflash.cli.{name.replace('-', '_')}")
        summary = (module.__doc__ or "").strip().splitlines()[0]
        command = sub.add_parser(name, help=summary, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # for commands that record how they ran
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (convert leaves no partial file)
        print(f"\nikdflash {args.command}: interrupted", file=sys.stderr)
        return 130


"""The `ikdflash` command. This file only wires subcommands; each lives in its own module."""

from __future__ import annotations

import argparse
import sys

from ikdflash import (__version__, bench, chat_repl, convert, doctor, download, generate, models, rpc_worker, serve,
                      train)

SUBCOMMANDS = {"generate": generate, "chat": chat_repl, "serve": serve, "bench": bench, "download": download,
               "doctor": doctor, "models": models, "convert": convert, "train": train, "rpc-worker": rpc_worker}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ikdflash", description="DFlash speculative decoding with sliding-window drafts on ik_llama.cpp.")
    parser.add_argument("--version", action="version", version=f"ikdflash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
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


if __name__ == "__main__":
    sys.exit(main())

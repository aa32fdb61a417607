"""Chat with a model in the terminal, with DFlash drafting each reply.

    ikdflash chat                                    # the built-in pair
    ikdflash chat --pair NAME --system "You are a terse assistant."
    ikdflash chat --target T.gguf --draft D.gguf --no-stats

Each turn goes through the target's own chat template with the whole conversation so far.
Replies stream as each verification step commits them; a line on stderr follows with tokens,
speed, acceptance and mean acceptance length. Ctrl-C stops a reply (what was said stays in the
conversation), Ctrl-D or /exit leaves, /reset starts a new conversation, /help lists these
commands; no line starting with "/" is sent to the model. Line editing and
history (kept in ~/.cache/ikdflash/chat_history) come from readline where Python has it. When
the conversation outgrows the context, its oldest turns are dropped, and the chat says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ikdflash import pausepoint, rules
from ikdflash.engine import Engine
from ikdflash.cli.decoding import add_decoding_arguments, check_engine_options, decoding_options, system_message
from ikdflash.cli.stats import summary
from ikdflash.sources.references import HubError, add_model_arguments, resolve_models

HISTORY = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ikdflash" / "chat_history"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--system", help="a system message that opens the conversation (default: the built-in "
                        "pair's plain one; else the template's own, if any)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per reply at most (default 512)")
    add_decoding_arguments(parser)
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--no-stats", action="store_true", help="no statistics line after each reply")


def enable_history() -> None:
    """Line editing and a persistent history, where Python was built with readline."""
    try:
        import atexit
        import readline
    except ImportError:
        return
    try:
        readline.read_history_file(HISTORY)
    except OSError:
        pass

    def save() -> None:
        try:
            HISTORY.parent.mkdir(parents=True, exist_ok=True)
            readline.set_history_length(1000)
            readline.write_history_file(HISTORY)
        except OSError:
            pass

    atexit.register(save)


class Conversation:
    """The messages so far, trimmed (oldest turns first, the system message kept) to leave room
    for a reply in the context."""

    def __init__(self, engine: Engine, system: str | None, reply_room: int) -> None:
        self.engine, self.reply_room = engine, reply_room
        self.opening = [("system", system)] if system else []
        self.turns: list[tuple[str, str]] = []

    def prompt(self) -> tuple[list[int], int]:
        """The tokens for the next reply, and how many earlier turns were dropped to fit."""
        dropped = 0
        tokens = self.engine.chat_tokens(self.opening + self.turns)
        while len(tokens) + self.reply_room > self.engine.target.n_ctx and len(self.turns) > 2:
            del self.turns[:2]  # the oldest question and its answer
            dropped += 1
            tokens = self.engine.chat_tokens(self.opening + self.turns)
        return tokens, dropped


def reply(engine: Engine, tokens: list[int], args: argparse.Namespace, options: dict) -> tuple[str, str]:
    """Stream one reply to stdout, with decoding_options' keywords; (its text, the statistics
    line). Ctrl-C ends it early."""
    if engine.draft is None:
        options = {**options, "n_max": 0}
    drafting = options["n_max"] != 0
    stream = engine.stream(tokens, max_tokens=args.max_tokens, **options)
    stopped = False
    try:
        for n, piece in enumerate(stream):
            print(piece, end="", flush=True)
            if n == 0:
                pausepoint.reached("reply")
    except KeyboardInterrupt:
        stopped = True
        stream.close()  # the generation ends after its current step
    print()
    out = stream.result
    assert out is not None and out.stats is not None
    return out.text, summary("dflash" if drafting else "target", out.stats, "stopped" if stopped else out.finish_reason)


COMMANDS = {"/help": "list these commands", "/reset": "start a new conversation", "/exit": "leave (as Ctrl-D)"}


def command(line: str, conversation: Conversation) -> str | None:
    """Carry out a line that starts with "/": a command, never a message to the model. Returns
    "exit" for /exit."""
    name = line.split()[0]
    if name == "/exit":
        return "exit"
    if name == "/reset":
        conversation.turns.clear()
        print("(a new conversation)", file=sys.stderr)
    elif name == "/help":
        for known, what in COMMANDS.items():
            print(f"{known:8} {what}", file=sys.stderr)
    else:
        print(f"ikdflash chat: unknown command {name}; /help lists the commands (nothing was sent)", file=sys.stderr)
    return None


def run(args: argparse.Namespace) -> int:
    try:
        check_engine_options(args)
        options = decoding_options(args)
        target, draft = resolve_models(args)
        engine = Engine(target, draft, n_ctx=args.ctx_size, n_threads=args.threads)
    except (HubError, FileNotFoundError, ValueError) as e:
        print(f"ikdflash chat: error: {e}", file=sys.stderr)
        return 2
    try:
        rules.n_max(args.n_max, engine.max_proposal, name="--n-max")
    except ValueError as e:
        engine.close()
        print(f"ikdflash chat: error: {e}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        enable_history()
        print(f"ikdflash chat: {target.name} with {draft.name}. Ctrl-C stops a reply, Ctrl-D or /exit leaves; "
              "/help lists the commands.", file=sys.stderr)
    conversation = Conversation(engine, system_message(args), args.max_tokens)
    with engine:
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:  # at the prompt: a fresh line, as shells do
                print()
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if command(text, conversation) == "exit":
                    break
                continue
            conversation.turns.append(("user", text))
            tokens, dropped = conversation.prompt()
            if dropped:
                print(f"(the {dropped} oldest exchange{'s' if dropped > 1 else ''} no longer fit the context "
                      f"of {engine.target.n_ctx} tokens and were dropped)", file=sys.stderr)
            try:
                answer, stats = reply(engine, tokens, args, options)
            except (ValueError, RuntimeError) as e:  # one message longer than the context; a failed decode
                print(f"ikdflash chat: error: {e}", file=sys.stderr)
                conversation.turns.pop()
                continue
            conversation.turns.append(("assistant", answer))
            if not args.no_stats:
                print(stats, file=sys.stderr)
    return 0

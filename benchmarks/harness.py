"""What every benchmark shares: the built-in pair's chat questions, the result file with its
provenance, and the entry points' subcommands.

A result file records where and from what it was measured (ikdflash.serving.fork.provenance):
the commit (with "-dirty" when the tree had changes), a fingerprint of the patch series compiled
in, the build's backends and CPU features, the CPU model, the threads and the date."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ikdflash.serving.fork import provenance as fork_provenance
from ikdflash.sources.references import DEFAULT_PAIR, PAIR_CHAT_DEFAULTS

if TYPE_CHECKING:
    from ikdflash import Engine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

SYSTEM = PAIR_CHAT_DEFAULTS[DEFAULT_PAIR]["system"]  # what `ikdflash chat` sends with the built-in pair
QUESTIONS = ["Explain rainbows to a child.", "What is the capital of France, and why is it famous?",
             "Give me three tips for learning to cook.", "Write a short poem about the sea."]


def chat_prompts(engine: Engine, questions: list[str]) -> list[list[int]]:
    """Each question under the built-in pair's system prompt, as `ikdflash chat` sends it."""
    return [engine.chat_tokens([("system", SYSTEM), ("user", q)]) for q in questions]


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def provenance(threads: int) -> dict:
    """The package's provenance of a measurement, with this checkout's commit."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = "-dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""
    return fork_provenance(threads, commit + dirty)


def write_result(path: Path | str, result: dict[str, Any] | list[Any], threads: int) -> None:
    """The result as JSON at path, with its provenance (a list goes under "rows")."""
    payload = dict(result) if isinstance(result, dict) else {"rows": result}
    payload["provenance"] = provenance(threads)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def json_of_process(command: list[str], failure: str, env: dict[str, str] | None = None) -> Any:
    """The JSON on the last line a measuring process prints (run from the repository root); one
    that fails ends the benchmark with `failure` and the end of its stderr."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{failure}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_command(package: str, doc: str, commands: dict[str, str]) -> int:
    """An entry point's subcommands: `python -m benchmarks.GROUP COMMAND [options]` runs the main()
    of the module commands[COMMAND] names (under package) with the options after it."""
    lines = []
    for name, module in commands.items():  # each module's first paragraph, read without importing it
        source = Path(str(importlib.util.find_spec(f"{package}.{module}").origin)).read_text()
        summary = " ".join((ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0].split())
        lines += textwrap.wrap(summary, 100, initial_indent=f"  {name:<18} ", subsequent_indent=" " * 21)
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=doc.strip().split("\n\n")[0],
                                     epilog="commands:\n" + "\n".join(lines) + "\n\n`COMMAND --help` says more.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=list(commands), metavar="COMMAND")
    parser.add_argument("options", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    module = importlib.import_module(f"{package}.{commands[args.command]}")
    sys.argv = [f"python -m {package} {args.command}", *args.options]
    return module.main() or 0

"""What the fuzzers share: a worker process that judges one input per line of stdin and is
restarted when it dies, and the tally of outcomes.

A worker prints one verdict line per input, "<OUTCOME> <detail>", with OUTCOME one of the words
it was started with (e.g. LOADED, REFUSED). Anything else (a signal, an uncaught exception, an
exit without a verdict) is a crash; no verdict within the timeout is a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence


@dataclass
class Case:
    index: int
    mutation: str
    via: str            # what judged it: "core", "server", "convert"
    outcome: str        # a worker's verdict in lower case, or "crash" | "hang"
    detail: str


class Worker:
    """python -c SCRIPT ARGS..., fed one input per line."""

    def __init__(self, script: str, args: Sequence[str], verdicts: Sequence[str], timeout: float) -> None:
        self.argv = [sys.executable, "-c", script, *args]
        self.verdicts, self.timeout, self.process = tuple(verdicts), timeout, None

    def judge(self, line: str) -> tuple[str, str]:
        if self.process is None or self.process.poll() is not None:
            self.close()
            # no PATH: ggml's abort handler would spend seconds attaching gdb for a backtrace
            self.process = subprocess.Popen(self.argv, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, env={**os.environ, "PATH": ""})
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()
        answer = _readline(self.process, self.timeout)
        if answer is None:
            self.process.kill()
            self.close()
            return "hang", f"no verdict in {self.timeout:.0f} s"
        verdict, _, detail = answer.strip().partition(" ")
        if verdict in self.verdicts:
            return verdict.lower(), detail
        code = self.process.wait()
        return "crash", f"exit {code}: {last_complaint(answer + self.process.stderr.read())}"

    def close(self) -> None:
        if self.process is None:
            return
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            pipe.close()
        self.process.wait()
        self.process = None


def last_complaint(log: str) -> str:
    """The last line of a log that says what went wrong (an assert, an error, an exception)."""
    lines = [line for line in log.splitlines()
             if any(word in line for word in ("ASSERT", "error", "Error", "terminate", "what()", "Segmentation"))]
    return (lines[-1] if lines else log[-300:]).strip()[:300]


def _readline(process: subprocess.Popen, timeout: float) -> str | None:
    """A line of the worker's stdout, "" when it exited, None on timeout."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            return None
    return process.stdout.readline()


def summary(results: list[Case]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for case in results:
        key = f"{case.via}:{case.outcome}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def failures(results: list[Case]) -> list[Case]:
    return [case for case in results if case.outcome in ("crash", "hang")]


# --- the fuzzers' command line -------------------------------------------------------------------

def arguments(description: str, timeout: float) -> argparse.ArgumentParser:
    """The options every fuzzer takes; a fuzzer adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds before a case counts as a hang")
    parser.add_argument("--report", type=Path, help="write every case as JSON here")
    return parser


class Progress:
    """Prints every 100th case, and each crash or hang as it happens."""

    def __init__(self, cases: int) -> None:
        self.cases, self.start, self.printed = cases, time.monotonic(), -1

    def __call__(self, case: Case) -> None:
        if case.index % 100 == 0 and case.index != self.printed:
            self.printed = case.index
            print(f"{case.index}/{self.cases} cases, {self.elapsed:.0f} s", flush=True)
        if case.outcome in ("crash", "hang"):
            print(f"case {case.index} ({case.via}) {case.outcome}: {case.mutation}: {case.detail}", flush=True)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start


def finish(results: list[Case], progress: Progress, report: Path | None) -> int:
    """Print the tally, write the report if asked; the exit code (1 on any crash or hang)."""
    print(json.dumps(summary(results), sort_keys=True), f"in {progress.elapsed:.0f} s")
    if report:
        report.write_text(json.dumps([asdict(c) for c in results], indent=1))
    return 1 if failures(results) else 0

"""What the fuzzers share: a worker process that judges one input per line of stdin and is
restarted when it dies, and the tally of outcomes.

A worker prints one verdict line per input, "<OUTCOME> <detail>", with OUTCOME one of the words
it was started with (e.g. LOADED, REFUSED). Anything else (a signal, an uncaught exception, an
exit without a verdict) is a crash; no verdict within the timeout is a hang.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
from dataclasses import dataclass
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

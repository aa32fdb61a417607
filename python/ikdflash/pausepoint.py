"""Pause points: named places where a test can hold a command, then signal it there. A test
hook, inert unless IKDFLASH_TEST_PAUSE is set; CONTRIBUTING.md ("Fault points and pause
points") documents it with the runtime's fault points.

    IKDFLASH_TEST_PAUSE=point@k,...     (k defaults to 1; read once per process)

The k-th time the process reaches a listed point it writes ``ikdflash: paused at point@k`` to
stderr and waits for good: a test reads that line, then sends SIGINT, which arrives as
KeyboardInterrupt at that place, however fast the machine. Signals reach Python's handlers in
the main thread only, so the points are on the main thread of the commands. Unset, reached()
returns at once. Points:

    convert   `ikdflash convert` has written a tensor (its partial output file exists)
    reply     `ikdflash chat` or `ikdflash generate` has printed a reply's first piece (the
              generation goes on in its worker thread)
"""

from __future__ import annotations

import os
import sys
import time


def _parse(spec: str) -> dict[str, set[int]]:
    points: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, k = item.partition("@")
        points.setdefault(name, set()).add(int(k or 1))
    return points


_PAUSES = _parse(os.environ.get("IKDFLASH_TEST_PAUSE", ""))
_counts: dict[str, int] = {}


def reached(point: str) -> None:
    """Count a pass through ``point``; wait for a signal if IKDFLASH_TEST_PAUSE lists this pass."""
    if point not in _PAUSES:
        return
    k = _counts[point] = _counts.get(point, 0) + 1
    if k in _PAUSES[point]:
        print(f"ikdflash: paused at {point}@{k}", file=sys.stderr, flush=True)
        while True:  # not signal.pause(): a signal that came just before it would be waited for again
            time.sleep(0.1)

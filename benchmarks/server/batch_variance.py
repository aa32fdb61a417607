"""How much a greedy reply depends on what else llama-server is doing: replies under --parallel N
against the same requests one at a time on --parallel 1.

    python -m benchmarks.server batch-variance [--slots 4] [--tokens 64] [--json out.json]

The built-in target answers the 8 chat questions of `benchmarks.server load` (greedy, the pair's
system prompt, no prompt cache), first on --parallel 1, one request at a time: the reference.
Then, on --parallel N, without a draft and with the built-in draft (default --spec-type dflash):
  sequential   the same requests one at a time (a slot's cells sit where another slot's were:
               what the cells' places in the shared KV cache change)
  concurrent   N at a time (the batch's other rows and row counts change too)
Reported per setting: how many of the 8 replies' texts differ from the reference, and the
character where each first differs. DFlash is exact against the target in the same batch, so a DFlash reply
differs from the reference only where the plain reply in the same setting can.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ikdflash import Server
from ikdflash.serving.client import post_json
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

from benchmarks.harness import write_result
from benchmarks.server.load import QUESTIONS, chat_bodies, post_in_waves, server_flags


def answers(target: Path, draft: Path | None, slots: int, tokens: int, concurrent: bool) -> list[str]:
    bodies = chat_bodies(tokens)
    with Server(target, ctx_size=2048 * slots, extra_args=server_flags(draft, slots)) as url:
        route = url + "/v1/chat/completions"
        replies = post_in_waves(route, bodies, slots) if concurrent else [post_json(route, body) for body in bodies]
    return [reply["choices"][0]["message"]["content"] for reply in replies]


def first_difference(a: str, b: str) -> int | None:
    """The first character where a and b differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, draft = resolve_pair(DEFAULT_PAIR)
    reference = answers(target, None, 1, args.tokens, concurrent=False)
    rows = []
    for kind, with_draft in (("plain", None), ("dflash", draft)):
        for concurrent in (False, True):
            got = answers(target, with_draft, args.slots, args.tokens, concurrent)
            where = [first_difference(r, g) for r, g in zip(reference, got)]
            row = {"draft": kind, "concurrent": concurrent, "differ": sum(w is not None for w in where),
                   "first_difference": where}
            rows.append(row)
            print(f"--parallel {args.slots} {kind:6} {'concurrent' if concurrent else 'sequential':10}: "
                  f"{row['differ']} of {len(QUESTIONS)} replies differ from --parallel 1 (first at {where})", flush=True)
    if args.json:
        write_result(args.json, {"slots": args.slots, "tokens": args.tokens, "rows": rows}, os.cpu_count() or 1)

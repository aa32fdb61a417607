"""How much a greedy reply depends on what else llama-server is doing: replies under --parallel N
against the same requests one at a time on --parallel 1; with --batch-invariant, and what that
costs.

    python -m benchmarks.server batch-variance [--slots 4] [--tokens 64] [--batch-invariant]
        [--cost ROUNDS] [--json out.json]

The built-in target answers the 8 chat questions of `benchmarks.server load` (greedy, the pair's
system prompt, no prompt cache), first on --parallel 1, one request at a time: the reference.
Then, on --parallel N, without a draft and with the built-in draft (default --spec-type dflash):
  sequential   the same requests one at a time (a slot's cells sit where another slot's were:
               what the cells' places in the shared KV cache change)
  concurrent   N at a time (the batch's other rows and row counts change too)
Reported per setting: how many of the 8 replies' texts differ from the reference, and the
character where each first differs. DFlash is exact against the target in the same batch, so a DFlash reply
differs from the reference only where the plain reply in the same setting can.
--batch-invariant gives every server, the reference's too, --batch-invariant.
--cost ROUNDS measures instead what --batch-invariant costs the plain server: --parallel 1 and
--parallel N, the 8 questions as `benchmarks.server load` sends them, each round with and without
the flag in alternating order; per round the ratio of generated tokens/s (with / without) and of
the replies' prompt tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from ikdflash import Server
from ikdflash.serving.client import post_json
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

from benchmarks.harness import write_result
from benchmarks.server.load import QUESTIONS, chat_bodies, post_in_waves, serve_once, server_flags

INVARIANT = ["--batch-invariant"]


def answers(target: Path, draft: Path | None, slots: int, tokens: int, concurrent: bool,
            extra: list[str]) -> list[str]:
    bodies = chat_bodies(tokens)
    with Server(target, ctx_size=2048 * slots, extra_args=server_flags(draft, slots) + extra) as url:
        route = url + "/v1/chat/completions"
        replies = post_in_waves(route, bodies, slots) if concurrent else [post_json(route, body) for body in bodies]
    return [reply["choices"][0]["message"]["content"] for reply in replies]


def first_difference(a: str, b: str) -> int | None:
    """The first character where a and b differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def variance(target: Path, draft: Path, slots: int, tokens: int, extra: list[str]) -> list[dict]:
    reference = answers(target, None, 1, tokens, False, extra)
    rows = []
    for kind, with_draft in (("plain", None), ("dflash", draft)):
        for concurrent in (False, True):
            got = answers(target, with_draft, slots, tokens, concurrent, extra)
            where = [first_difference(r, g) for r, g in zip(reference, got)]
            row = {"draft": kind, "concurrent": concurrent, "differ": sum(w is not None for w in where),
                   "first_difference": where}
            rows.append(row)
            print(f"--parallel {slots} {' '.join(extra)} {kind:6} {'concurrent' if concurrent else 'sequential':10}: "
                  f"{row['differ']} of {len(QUESTIONS)} replies differ from --parallel 1 (first at {where})", flush=True)
    return rows


def cost(target: Path, slots: int, tokens: int, rounds: int) -> dict:
    results = {}
    for n in (1, slots):
        runs = []
        for r in range(rounds):
            order = [INVARIANT, []] if r % 2 else [[], INVARIANT]
            got = {bool(extra): serve_once(target, None, n, tokens, extra=extra) for extra in order}
            ratio = got[True]["tokens_per_second"] / got[False]["tokens_per_second"]
            prompt_ratio = got[True]["prompt_tokens_per_second"] / got[False]["prompt_tokens_per_second"]
            runs.append({"invariant": got[True], "default": got[False], "ratio": ratio, "prompt_ratio": prompt_ratio})
            print(f"--parallel {n} round {r + 1}: --batch-invariant {got[True]['tokens_per_second']:.1f} tok/s, "
                  f"default {got[False]['tokens_per_second']:.1f} tok/s: {ratio:.3f}x; prompts {prompt_ratio:.3f}x",
                  flush=True)
        median = statistics.median(run["ratio"] for run in runs)
        prompt_median = statistics.median(run["prompt_ratio"] for run in runs)
        print(f"--parallel {n}: median {median:.3f}x generated, {prompt_median:.3f}x prompt tokens/s")
        results[str(n)] = {"rounds": runs, "median_ratio": median, "median_prompt_ratio": prompt_median}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--cost", type=int, metavar="ROUNDS", default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, draft = resolve_pair(DEFAULT_PAIR)
    if args.cost:
        result = {"slots": args.slots, "tokens": args.tokens, "cost": cost(target, args.slots, args.tokens, args.cost)}
    else:
        extra = INVARIANT if args.batch_invariant else []
        result = {"slots": args.slots, "tokens": args.tokens, "batch_invariant": args.batch_invariant,
                  "rows": variance(target, draft, args.slots, args.tokens, extra)}
    if args.json:
        write_result(args.json, result, os.cpu_count() or 1)

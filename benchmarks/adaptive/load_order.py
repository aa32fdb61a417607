"""Two engines in one process, as `ikdflash generate` compares them: DFlash (adaptive) against
the target alone, each loaded first in turn.

    python -m benchmarks.adaptive load-order [--rounds 10] [--max-tokens 200] [--lookup] [--json out.json]

For each load order a process loads both engines, warms both up, then runs --rounds rounds of the
first command's prompt (the built-in pair's chat defaults, repetition penalty included), the two
engines taking turns in alternating order. Reported per load order: the median over rounds of
DFlash's speed against the target alone's (generated tokens over the passes' and draft steps'
time), and how many of DFlash's steps verified nothing. With the draft seldom verified the two
should read about 1.0x whichever engine was loaded first; a ratio that follows the load order
measures where the engines' memory landed, not DFlash.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.harness import SYSTEM, json_of_process, write_result

PROMPT = "Explain rainbows to a child."
THREADS = 2


def child(dflash_first: bool, rounds: int, max_tokens: int, lookup: bool) -> None:
    from ikdflash import Engine
    from ikdflash.sources.references import DEFAULT_PAIR, PAIR_CHAT_DEFAULTS, resolve_pair

    target, draft = resolve_pair(DEFAULT_PAIR)
    load = [(target, draft), (target, None)] if dflash_first else [(target, None), (target, draft)]
    engines = {("dflash" if d else "alone"): Engine(t, d, n_ctx=2048, n_threads=THREADS) for t, d in load}
    tokens = engines["dflash"].chat_tokens([("system", SYSTEM), ("user", PROMPT)])
    penalty = PAIR_CHAT_DEFAULTS[DEFAULT_PAIR]["repeat_penalty"]

    def run(name: str):
        if name == "dflash":
            return engines[name].speculate(tokens, max_tokens=max_tokens, lookup=lookup, repeat_penalty=penalty).stats
        return engines[name].generate(tokens, max_tokens=max_tokens, repeat_penalty=penalty).stats

    run("dflash"), run("alone")  # warm-up: the adaptive block length times the passes here
    ratios, plain = [], []
    for r in range(rounds):
        stats = {name: run(name) for name in (("dflash", "alone") if r % 2 == 0 else ("alone", "dflash"))}
        speed = {name: s.generated / (s.draft_time + s.verify_time) for name, s in stats.items()}
        ratios.append(speed["dflash"] / speed["alone"])
        plain.append(stats["dflash"].steps_by_verified[0] / max(stats["dflash"].steps, 1))
    for engine in engines.values():
        engine.close()
    print(json.dumps({"ratios": ratios, "plain_share": plain}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--lookup", action="store_true", help="the n-gram lookup on (default: off, the draft alone)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--child", choices=["dflash-first", "alone-first"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child == "dflash-first", args.rounds, args.max_tokens, args.lookup)
        return
    results = {}
    for order in ("dflash-first", "alone-first"):
        command = [sys.executable, "-m", "benchmarks.adaptive", "load-order", "--child", order,
                   "--rounds", str(args.rounds), "--max-tokens", str(args.max_tokens),
                   *(["--lookup"] if args.lookup else [])]
        results[order] = json_of_process(command, f"the {order} process failed")
        ratios = results[order]["ratios"]
        print(f"{order:>12}: DFlash {statistics.median(ratios):.3f}x the target alone "
              f"(rounds {', '.join(f'{x:.3f}' for x in ratios)}); "
              f"{statistics.median(results[order]['plain_share']):.0%} of its steps verified nothing")
    if args.json:
        write_result(args.json, {"rounds": args.rounds, "max_tokens": args.max_tokens, "lookup": args.lookup,
                                 "orders": results}, THREADS)


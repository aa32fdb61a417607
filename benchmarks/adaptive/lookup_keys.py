"""The n-gram lookup's key length, chosen on the copy-heavy requests: the engine's speed with each
key length against the target alone, DFlash beside it as served (adaptive, n_max 4).

    python -m benchmarks.adaptive lookup-keys [--keys 2 3 4 6] [--rounds 3] [--tokens 256]
        [--threads 2] [--json out.json]

The built-in pair in the Engine (the same lookup and controller as llama-server's slots), greedy,
benchmarks/server/copy_heavy.py's 14 requests one after another. Each round runs the
target alone, DFlash with the lookup off (key 0) and each key length, in an order reversed every
other round; a setting's speed in a round is its generated tokens over its decoding time.
Reported: each setting's median over rounds against the target alone's.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from ikdflash import Engine

from benchmarks.harness import SYSTEM, write_result
from benchmarks.server.copy_heavy import REQUESTS

PLAIN = -1  # the target alone


def speed(engine: Engine, prompts: list[list[int]], key: int, tokens: int) -> float:
    generated, ms = 0, 0.0
    for prompt in prompts:
        _, stats, _ = engine._native.generate(prompt, tokens, 0 if key == PLAIN else 4, True, max(key, 0))
        generated += stats["n_generated"]
        ms += stats["t_draft_ms"] + stats["t_verify_ms"]
    return 1e3 * generated / ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[2, 3, 4, 6])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if any(k < 1 for k in args.keys):
        parser.error("--keys: key lengths are at least 1")
    settings = [PLAIN, 0, *args.keys]
    speeds: dict[int, list[float]] = {k: [] for k in settings}
    with Engine.from_pair(n_ctx=4096, n_threads=args.threads) as engine:
        prompts = [engine.chat_tokens([{"role": "system", "content": SYSTEM}, *messages]) for _, messages in REQUESTS]
        for r in range(args.rounds):
            for key in settings if r % 2 == 0 else reversed(settings):
                speeds[key].append(speed(engine, prompts, key, args.tokens))
    base = statistics.median(speeds[PLAIN])
    rows = [{"key": "target alone" if k == PLAIN else "lookup off" if k == 0 else k,
             "tps": statistics.median(speeds[k]), "ratio": statistics.median(speeds[k]) / base, "runs": speeds[k]}
            for k in settings]
    for row in rows:
        print(f"{row['key']!s:>12} | {row['tps']:>7.1f} tok/s | {row['ratio']:.3f}x "
              f"({', '.join(f'{x:.0f}' for x in row['runs'])})")
    if args.json:
        write_result(args.json, {"tokens": args.tokens, "rows": rows}, args.threads)
    return 0

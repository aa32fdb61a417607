"""Requests whose replies repeat what the conversation already holds, through llama-server: the
target alone, DFlash with the n-gram lookup off (lookup=0), and DFlash as served by default.

    python -m benchmarks.server copy-heavy [--rounds 5] [--tokens 256] [--threads 2] [--json out.json]

The built-in pair, greedy, one request at a time, default settings otherwise. The 14 requests
(benchmarks/server/copy_heavy_requests.py): code edits, a text repeated and extended, lists
reordered, answers quoting their source, a second chat turn that restates the first. Each round
starts each server in turn (the order rotated every round, so a slow moment of the machine falls
on all three), sends every request, and stops it. A server's speed in a round is its generated
tokens over its decoding time (timings.predicted_ms, prompt processing excluded), summed over the
requests; reported: the median over rounds of each server's speed and of the per-round ratios
against the target alone. Every reply must equal the target alone's (lossless).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ikdflash.serving.client import post_json
from ikdflash.serving.server import Server
from ikdflash.serving.spectype import SpecType
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

from benchmarks.harness import SYSTEM, write_result
from benchmarks.server.copy_heavy_requests import REQUESTS

SERVERS = {
    "target alone": None,
    "dflash lookup=0": SpecType(lookup=False),
    "dflash": SpecType(),
}


def reply(url: str, messages: list[dict[str, str]], tokens: int) -> tuple[str, int, float, dict]:
    """(text, tokens generated, decoding ms, timings) of one greedy chat request."""
    out = post_json(url + "/v1/chat/completions", {"messages": messages, "max_tokens": tokens, "temperature": 0},
                    timeout=600)
    t = out["timings"]
    return out["choices"][0]["message"]["content"], int(t["predicted_n"]), float(t["predicted_ms"]), t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target, draft = resolve_pair(DEFAULT_PAIR)
    conversations = [[{"role": "system", "content": SYSTEM}, *messages] for _, messages in REQUESTS]
    speeds: dict[str, list[float]] = {name: [] for name in SERVERS}
    texts: dict[str, list[str]] = {}
    proposer: dict[str, dict[str, int]] = {name: {"drafted": 0, "accepted": 0, "lookup_drafted": 0,
                                                  "lookup_accepted": 0} for name in SERVERS}
    names = list(SERVERS)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            spec = SERVERS[name]
            extra = ["--model-draft", str(draft), "--spec-type", spec.flag()] if spec else []
            with Server(target, ctx_size=4096, n_threads=args.threads, extra_args=extra) as url:
                reply(url, conversations[0], 8)  # warm-up: weights paged in
                n_total, ms_total, replies = 0, 0.0, []
                for messages in conversations:
                    text, n, ms, timings = reply(url, messages, args.tokens)
                    replies.append(text)
                    n_total += n
                    ms_total += ms
                    if r == 0 and spec:
                        counts = proposer[name]
                        counts["drafted"] += timings["draft_n"]
                        counts["accepted"] += timings["draft_n_accepted"]
                        counts["lookup_drafted"] += timings["draft_n_lookup"]
                        counts["lookup_accepted"] += timings["draft_n_accepted_lookup"]
            speeds[name].append(1e3 * n_total / ms_total)
            if name in texts and texts[name] != replies:
                raise SystemExit(f"{name}: round {r + 1}'s replies differ from round 1's")
            texts[name] = replies
            print(f"  round {r + 1}/{args.rounds}: {name} {speeds[name][-1]:.1f} tok/s", file=sys.stderr)
    differ = [REQUESTS[i][0] for i, text in enumerate(texts["target alone"])
              if any(texts[name][i] != text for name in SERVERS)]
    base = speeds["target alone"]
    rows = []
    for name in SERVERS:
        ratios = [s / b for s, b in zip(speeds[name], base, strict=True)]
        rows.append({"server": name, "tps": statistics.median(speeds[name]), "ratio": statistics.median(ratios),
                     "ratios": ratios, **({"statistics": proposer[name]} if SERVERS[name] else {})})
    print(f"{'server':<16} | {'tok/s':>7} | vs the target alone (per round)")
    for row in rows:
        print(f"{row['server']:<16} | {row['tps']:>7.1f} | {row['ratio']:.3f}x "
              f"({', '.join(f'{x:.2f}' for x in row['ratios'])})")
    for name, counts in proposer.items():
        if SERVERS[name]:
            print(f"{name}: draft kept {counts['accepted'] - counts['lookup_accepted']} of "
                  f"{counts['drafted'] - counts['lookup_drafted']}, lookup kept {counts['lookup_accepted']} of "
                  f"{counts['lookup_drafted']} (round 1)")
    print("lossless: every reply equals the target alone's" if not differ else f"REPLIES DIFFER: {differ}")
    if args.json:
        write_result(args.json, {"requests": [kind for kind, _ in REQUESTS], "tokens": args.tokens,
                                 "rounds": args.rounds, "rows": rows, "differ": differ}, args.threads)
    return 1 if differ else 0

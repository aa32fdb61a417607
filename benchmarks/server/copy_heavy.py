"""Requests whose replies repeat what the conversation already holds, through llama-server: the
target alone, DFlash with the n-gram lookup off (lookup=0), and DFlash as served by default.

    python -m benchmarks.server copy-heavy [--rounds 5] [--tokens 256] [--threads 2] [--json out.json]

The built-in pair, greedy, one request at a time, default settings otherwise. The 14 requests
(REQUESTS below): code edits, a text repeated and extended, lists
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

# --- the requests: (kind, messages), each asking for a reply that repeats much of the conversation

INVENTORY = '''def restock(inventory, item, amount):
    """Add amount units of item to the inventory and return the new count."""
    if amount <= 0:
        raise ValueError("amount must be positive")
    current = inventory.get(item, 0)
    inventory[item] = current + amount
    return inventory[item]


def sell(inventory, item, amount):
    """Remove amount units of item from the inventory and return what is left."""
    current = inventory.get(item, 0)
    if amount > current:
        raise ValueError("not enough stock")
    inventory[item] = current - amount
    return inventory[item]
'''

AVERAGE = '''#include <stdio.h>

int average(const int *values, int count) {
    int total = 0;
    for (int i = 0; i < count; i++) {
        total += values[i];
    }
    return count > 0 ? total / count : 0;
}

int main(void) {
    int scores[] = {71, 88, 93, 64, 80};
    printf("average: %d\\n", average(scores, 5));
    return 0;
}
'''

GARDEN = ("Every spring the community garden opens its gates on the first Saturday of April. "
          "Volunteers arrive early to turn the soil, repair the wooden beds and sort the seeds that "
          "were saved from last autumn. By noon the children have planted rows of beans and "
          "sunflowers, and the older members have set up the watering rota for the summer. In the "
          "afternoon everyone shares soup made from the last of the winter vegetables.")

GARDEN_TYPOS = GARDEN.replace("spring", "sprign").replace("Volunteers", "Volunters").replace(
    "repair", "repiar").replace("children", "chidlren").replace("afternoon", "afternon")

RIVER = ("The town of Elmford grew up where two roads crossed the river Wend. In the twelfth century "
         "a stone bridge replaced the old ford, and a market was held beside it every Thursday. The "
         "river carried wool and timber down to the coast, and the mills along its banks ground "
         "grain for the whole valley. A great flood in 1736 swept the bridge away; the one that "
         "stands today was finished in 1741. The market still meets on Thursdays, although it now "
         "sells cheese, bread and pottery to visitors.")

STEPS = ("To make a cup of tea: 1. Fill the kettle with fresh water. 2. Bring the water to the boil. "
         "3. Warm the teapot with a little hot water and pour it away. 4. Put one spoon of tea per "
         "person into the pot.")

FRUIT = ["plum", "apple", "mango", "cherry", "banana", "kiwi", "orange", "grape", "lemon", "apricot", "pear",
         "fig"]

PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]

SETTINGS = ('{"name": "office printer", "location": "second floor", "duplex": true, "paper": "A4", '
            '"trays": 2, "colour": false, "queue_limit": 50, "owner": "facilities"}')

SALES = ("region,quarter,units,revenue\nnorth,Q1,120,3600\nnorth,Q2,135,4050\nsouth,Q1,98,2940\n"
         "south,Q2,110,3300\neast,Q1,143,4290\neast,Q2,150,4500")

FIRST_ANSWER = ("A rainbow appears when sunlight passes through raindrops. Each drop bends the light and "
                "splits it into its colours, red on the outside and violet on the inside, so you see a "
                "curved band of colours in the part of the sky opposite the sun.")


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def lines(items: list[str]) -> str:
    return "\n".join(items)


REQUESTS: list[tuple[str, list[dict[str, str]]]] = [
    ("code edit: rename a function", user(
        "Rename the function sell to remove_stock in this code. Change nothing else and reply with the "
        "whole code.\n\n" + INVENTORY)),
    ("code edit: change a check", user(
        "In this code, make restock also accept an amount of zero. Reply with the whole code.\n\n" + INVENTORY)),
    ("code edit: change a type", user(
        "Change the return type of average to double in this C program and print it with %f. Reply with "
        "the whole program.\n\n" + AVERAGE)),
    ("fix the spelling", user("Correct the spelling mistakes in this paragraph and return it:\n\n" + GARDEN_TYPOS)),
    ("repeat and extend", user(
        "Repeat this paragraph exactly, then add one more sentence about the evening.\n\n" + GARDEN)),
    ("repeat and continue a list", user(
        "Copy these steps and continue them until the tea is ready.\n\n" + STEPS)),
    ("sort a list", user("Sort this list alphabetically, one item per line:\n\n" + lines(FRUIT))),
    ("reverse a list", user("Write this list in reverse order, one item per line:\n\n" + lines(PLANETS))),
    ("quote the source", user(
        "Read the text and quote the sentence that says when the present bridge was finished.\n\n" + RIVER)),
    ("quote every match", user(
        "Quote every sentence of this text that mentions the market, word for word.\n\n" + RIVER)),
    ("edit a JSON object", user(
        "Set duplex to false and trays to 3 in this JSON object. Reply with the whole object.\n\n" + SETTINGS)),
    ("table to markdown", user("Turn this CSV into a markdown table:\n\n" + SALES)),
    ("restate the last answer", [
        {"role": "user", "content": "Why do rainbows appear?"},
        {"role": "assistant", "content": FIRST_ANSWER},
        {"role": "user", "content": "Please repeat your answer word for word."}]),
    ("restate as a list", [
        {"role": "user", "content": "Why do rainbows appear?"},
        {"role": "assistant", "content": FIRST_ANSWER},
        {"role": "user", "content": "Say that again, one sentence per bullet point."}]),
]


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

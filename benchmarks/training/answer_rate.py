"""Training data from the target's own answers: rows per core-second, one sequence at a time
against several decoded side by side (Model.generate_many), on the built-in target.

    python -m benchmarks.training answer-rate [--prompts 32] [--tokens 128] [--parallel 1 4 8 16 32] [--json out.json]

The prompts are first user turns of training conversations (never the held-out ones) under the
plain system prompt the built-in draft's answers use. Each setting answers the same prompts,
greedy, in the order given, so the rows are the same work; the ratio column is each setting's
rate against one sequence at a time, measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ikdflash.chat import chat_template, render
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.model import Model
from ikdflash.train.corpus import read_conversations

from benchmarks.harness import SYSTEM, write_result



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128, help="answer tokens at most, each")
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, _ = resolve_pair(DEFAULT_PAIR)
    template = chat_template(target)
    with Model(target, n_ctx=64, n_threads=args.threads) as model:
        prompts = []
        for conv in read_conversations(None):
            if conv.held_out:
                continue
            text = render(template, [("system", SYSTEM), ("user", conv.first_user_turn)], add_generation_prompt=True)
            tokens = model.tokenize(text, add_special=False, parse_special=True)
            if len(tokens) <= 512:
                prompts.append(tokens)
            if len(prompts) == args.prompts:
                break
        rows = []
        for n_parallel in args.parallel:
            start = time.perf_counter()
            answers = model.generate_many(prompts, max_tokens=args.tokens, n_parallel=n_parallel)
            seconds = time.perf_counter() - start
            n_rows = sum(len(a) for a in answers)
            rows.append({"n_parallel": n_parallel, "answer_rows": n_rows, "seconds": round(seconds, 2),
                         "rows_per_core_second": round(n_rows / seconds / args.threads, 1)})
    base = rows[0]["rows_per_core_second"]
    print(f"{len(prompts)} prompts, up to {args.tokens} answer tokens each, {args.threads} threads")
    print(" parallel  answer rows  seconds  rows/core-s  vs first")
    for r in rows:
        print(f"{r['n_parallel']:9d} {r['answer_rows']:12d} {r['seconds']:8.1f} {r['rows_per_core_second']:12.1f} "
              f"{r['rows_per_core_second'] / base:8.2f}x")
    if args.json:
        write_result(args.json, {"prompts": len(prompts), "tokens": args.tokens, "target": Path(target).name,
                                 "rows": rows}, args.threads)
    return 0

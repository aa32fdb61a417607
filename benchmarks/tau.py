"""Held-out chat acceptance of one or more drafts for the built-in target, on the same prompts:
first user turns of held-out conversations under a plain system prompt, greedy, fixed n_max 4.

    python -m benchmarks.tau DRAFT.gguf [DRAFT.gguf ...] [--prompts 24] [--tokens 128] [--json out.json]
    python -m benchmarks.tau shipped DRAFT.gguf --server    # what a llama-server user gets

--server asks the package's llama-server instead (`/v1/chat/completions`, the held-out first
user turns as plain messages, no system message, so the chat template's own default applies; greedy;
`--spec-type dflash:n_max=N,adaptive=0`): tau = 1 + accepted drafts / verification steps.

"shipped" names the draft inside ikdflash. This is the evaluation a retrained built-in draft must
win before it ships (docs/training.md).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from ikdflash import Server
from ikdflash.serving.client import post_json
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.train.corpus import read_conversations
from ikdflash.train.evaluate import held_out_prompts
from ikdflash.train.evaluate import measure_acceptance

from benchmarks.harness import SYSTEM, write_result



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", nargs="+")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--n-max", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server", action="store_true", help="through llama-server's chat endpoint")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, shipped = resolve_pair(DEFAULT_PAIR)
    if args.server:
        return server_tau(args, target, shipped)
    prompts = held_out_prompts(target, None, args.prompts, system=SYSTEM)
    results = {}
    print(f"{len(prompts)} held-out first turns, up to {args.tokens} tokens each, n_max {args.n_max}")
    for name in args.drafts:
        path = shipped if name == "shipped" else Path(name)
        result = measure_acceptance(target, path, prompts, n_max=args.n_max, max_tokens=args.tokens,
                                    n_threads=args.threads)
        results[name] = result.as_dict()
        print(f"{name}: tau {result.tau:.2f}, acceptance {result.acceptance:.1%}, {result.steps} steps, per position "
              + " / ".join(f"{p:.2f}" for p in result.per_position))
    if args.json:
        write_result(args.json, {"prompts": len(prompts), "tokens": args.tokens, "n_max": args.n_max,
                                 "system": SYSTEM, "drafts": results}, args.threads)
    return 0


def held_out_questions(count: int) -> list[str]:
    """The held-out conversations' first user turns, as text (held_out_prompts also leaves out
    those longer than 1,024 tokens; the server's context holds them)."""
    return list(itertools.islice((conv.first_user_turn for conv in read_conversations(None) if conv.held_out), count))


def server_tau(args: argparse.Namespace, target: Path, shipped: Path) -> int:
    questions = held_out_questions(args.prompts)
    print(f"{len(questions)} held-out first turns through llama-server, no system message, up to {args.tokens} "
          f"tokens each, n_max {args.n_max}")
    results = {}
    for name in args.drafts:
        path = shipped if name == "shipped" else Path(name)
        spec = ["--model-draft", str(path), "--spec-type", f"dflash:n_max={args.n_max},adaptive=0"]
        accepted = steps = 0
        with Server(target, ctx_size=4096, n_threads=args.threads, extra_args=spec) as url:
            for question in questions:
                body = {"messages": [{"role": "user", "content": question}], "max_tokens": args.tokens,
                        "temperature": 0}
                timings = post_json(url + "/v1/chat/completions", body)["timings"]
                accepted += timings["draft_n_accepted"]
                steps += timings["draft_steps"]
        results[name] = {"tau": 1 + accepted / max(1, steps), "accepted": accepted, "steps": steps}
        print(f"{name}: tau {results[name]['tau']:.2f} ({accepted} drafts accepted in {steps} steps)")
    if args.json:
        write_result(args.json, {"prompts": len(questions), "tokens": args.tokens, "n_max": args.n_max,
                                 "server": True, "system": None, "drafts": results}, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Held-out chat acceptance of one or more drafts for the built-in target, on the same prompts:
first user turns of held-out conversations under a plain system prompt, greedy, fixed n_max 4.

    python benchmarks/chat_tau.py DRAFT.gguf [DRAFT.gguf ...] [--prompts 24] [--tokens 128] [--json out.json]

"shipped" names the draft inside ikdflash. This is the evaluation a retrained built-in draft must
win before it ships (python/ikdflash/drafts/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ikdflash.hub import DEFAULT_PAIR, PAIR_CHAT_DEFAULTS, resolve_pair
from ikdflash.train import held_out_prompts
from ikdflash.train.evaluate import measure_acceptance

SYSTEM = PAIR_CHAT_DEFAULTS[DEFAULT_PAIR]["system"]  # what `ikdflash chat` sends with the built-in pair


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", nargs="+")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--n-max", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, shipped = resolve_pair(DEFAULT_PAIR)
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
        args.json.write_text(json.dumps({"prompts": len(prompts), "tokens": args.tokens, "n_max": args.n_max,
                                         "system": SYSTEM, "drafts": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does the draft's own confidence predict whether the target keeps its first draft token?

    python -m benchmarks.adaptive draft-confidence [DRAFT.gguf] [--prompts 24] [--tokens 128] [--json out.json]

The built-in target's greedy answers to held-out chat prompts (first user turns under the plain
system prompt, as benchmarks/tau.py), teacher-forced: at every answer position the draft
(default: the shipped one) reads the target's layers for the positions before it and proposes the
next token; its confidence is the draft's own (dflash_seq_draft: a DSpark draft's confidence head,
else the token's probability under its row's softmax over the draft's head). Reported: how often
the first draft token equals the target's, by confidence bucket, above and below thresholds, and
after a kept or a missed position. A controller that
verifies a draft only when its confidence pays must still run the draft at every step to know
it: the summary line prices that with the costs given (--draft-cost and --two-rows, in one-row
target passes; this machine's engine measured ~0.19 and ~1.24 on the built-in pair).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ikdflash import _core
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.train.evaluate import held_out_prompts

from benchmarks.harness import SYSTEM, write_result

EDGES = np.linspace(0.0, 1.0, 11)


TOP_K = 16  # the target's likeliest tokens kept per position (what its own confidence is computed over)


def draft_steps(target: Path, draft_path: Path, prompts: list[list[int]], tokens: int):
    """The draft teacher-forced on the target's greedy answer to each prompt, as the engine's draft
    reads it on the greedy path: for each prompt (its index i) and each answer position s that has
    a next token, yields (i, seq, s, best, confidence, chose): the draft's proposal after seq[s],
    with the target's layers for the positions before s; best[j] is its guess for seq[s + 1 + j],
    confidence[j] its confidence in it, and chose the target's TOP_K logits, less the largest, where
    it chose seq[s] (what a step knows of the target for free)."""
    model = _core.Model(str(target), n_ctx=1024, n_threads=2)
    draft = _core.Draft(model, str(draft_path), 2)
    context = None
    try:
        layers, n_proposed = draft.info()["target_layer_ids"], draft.info()["max_proposal"]
        for i, prompt in enumerate(prompts):
            seq = list(prompt) + model.generate_greedy(list(prompt), tokens)
            features, _, _, top_logits = _core.training.layer_features(model, seq, layers, TOP_K)
            context = _core.CrossContext(draft, 2048)
            context.append(features[:len(prompt)], np.arange(len(prompt), dtype=np.int32))
            for s in range(len(prompt), len(seq) - 1):
                best, confidence = context.propose_with_confidence(seq[s], s, n_proposed)
                yield i, seq, s, best, confidence, top_logits[s - 1]
                context.append(features[s:s + 1], np.array([s], dtype=np.int32))
            context = None
    finally:
        context = None  # the draft closes only once no cross-context uses it
        draft.close()
        model.close()


def confidences(target: Path, draft_path: Path, prompts: list[list[int]], tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Per answer position: the draft's confidence in its first token, and whether it was the target's."""
    conf, kept = [], []
    for _, seq, s, best, confidence, _ in draft_steps(target, draft_path, prompts, tokens):
        conf.append(confidence[0])
        kept.append(best[0] == seq[s + 1])
    return np.array(conf), np.array(kept, dtype=float)


def gated_rate(conf: np.ndarray, kept: np.ndarray, threshold: float, draft_cost: float, two_rows: float) -> float:
    """Tokens per one-row pass when every step drafts one token and verifies it only at confidence
    >= threshold (a step's yield and cost, averaged over positions; the target alone: 1.0)."""
    verify = conf >= threshold
    tokens = 1.0 + (kept * verify).mean()
    cost = draft_cost + np.where(verify, two_rows, 1.0).mean()
    return tokens / cost


def teacher_forced_command(description: str) -> tuple[argparse.Namespace, Path, Path, list[list[int]]]:
    """The command line of the teacher-forced measurements (this one and free-signals): its
    arguments, the target, the draft, and the held-out prompts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("draft", nargs="?", type=Path)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft-cost", type=float, default=0.19, help="a draft step, in one-row target passes")
    parser.add_argument("--two-rows", type=float, default=1.24, help="a two-row target pass, in one-row passes")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target, shipped = resolve_pair(DEFAULT_PAIR)
    return args, target, args.draft or shipped, held_out_prompts(target, None, args.prompts, system=SYSTEM)


def main() -> int:
    args, target, draft, prompts = teacher_forced_command(__doc__.split("\n\n")[0])
    conf, kept = confidences(target, draft, prompts, args.tokens)
    print(f"{len(kept)} answer positions of {len(prompts)} held-out prompts: first draft token kept {kept.mean():.3f}")
    buckets = []
    for lo, hi in zip(EDGES[:-1], EDGES[1:], strict=True):
        inside = (conf >= lo) & ((conf < hi) if hi < 1.0 else (conf <= hi))
        buckets.append({"from": lo, "to": hi, "share": float(inside.mean()),
                        "kept": float(kept[inside].mean()) if inside.any() else None})
        if inside.any():
            print(f"confidence {lo:.1f}-{hi:.1f}: {inside.mean():6.1%} of positions, kept {kept[inside].mean():.3f}")
    previous = kept[:-1]  # positions follow each other within a prompt; the seams are a handful
    after = {"kept": float(kept[1:][previous == 1].mean()), "missed": float(kept[1:][previous == 0].mean())}
    print(f"after a kept position: kept {after['kept']:.3f}; after a missed one: {after['missed']:.3f}")
    rates = {f"{t:.1f}": gated_rate(conf, kept, t, args.draft_cost, args.two_rows) for t in EDGES[:-1]}
    best = max(rates, key=rates.get)
    print(f"draft every step, verify at confidence >= t (draft {args.draft_cost}, 2 rows {args.two_rows} one-row "
          f"passes): " + ", ".join(f"t {t}: {r:.3f}x" for t, r in rates.items()) + f"; best t {best}")
    if args.json:
        write_result(args.json, {"draft": str(args.draft or "shipped"), "prompts": len(prompts), "positions": len(kept),
                                 "kept": float(kept.mean()), "buckets": buckets, "after": after, "gated_rate": rates,
                                 "costs": {"draft": args.draft_cost, "two_rows": args.two_rows}}, threads=2)
    return 0

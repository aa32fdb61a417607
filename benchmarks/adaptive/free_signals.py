"""Which signals that cost nothing predict whether the draft's first token will be kept?

    python -m benchmarks.adaptive free-signals [DRAFT.gguf] [--prompts 24] [--tokens 128] [--json out.json]

A step could decide whether to run the draft at all before paying for it, from what it already
knows: the target's own confidence where it chose the current token (its top-1 probability over
its 16 likeliest tokens, and the margin between its two best logits), whether the previous
position's first draft token was kept, and whether an n-gram lookup over the prompt and the reply
(the last 3 tokens found earlier) has a proposal. Teacher-forced on the built-in target's greedy
answers to the held-out chat prompts, as `draft-confidence`. Reported per signal: how often the
first draft token is kept in each of its buckets, and the tokens per one-row target pass a step
would make if it drafted one token only where the signal clears a threshold (the draft's cost paid
only there), against drafting everywhere and nowhere (1.0), with the costs given (--draft-cost,
--two-rows, in one-row passes), beside the draft's own confidence (paid for at every step). The
free signals are also combined: a logistic regression on all four, fitted on half the prompts and
scored on the other half (and the other way round), gates the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


from benchmarks.adaptive.draft_confidence import draft_steps, gated_rate, teacher_forced_command
from benchmarks.harness import write_result

LOOKUP_KEY = 3  # the lookup's key length (docs/design.md#n-gram-lookup)


def lookup_matches(seq: list[int], s: int) -> bool:
    """Whether the last LOOKUP_KEY tokens up to seq[s] occur earlier in seq[:s + 1] with a token after them."""
    if s + 1 < LOOKUP_KEY + 1:
        return False
    key = seq[s + 1 - LOOKUP_KEY:s + 1]
    return any(seq[i:i + LOOKUP_KEY] == key for i in range(0, s + 1 - LOOKUP_KEY))


def signals(target: Path, draft_path: Path, prompts: list[list[int]], tokens: int) -> dict[str, np.ndarray]:
    """Per answer position: each signal, the draft's own confidence, and whether its first token was kept."""
    rows: dict[str, list] = {"target_p": [], "target_margin": [], "lookup": [], "draft_confidence": [], "kept": [],
                             "prompt": []}
    for i, seq, s, best, confidence, chose in draft_steps(target, draft_path, prompts, tokens):
        weights = np.exp(chose - chose.max())
        rows["target_p"].append(weights.max() / weights.sum())
        rows["target_margin"].append(float(-np.sort(chose)[-2]))  # chose holds logits less the largest
        rows["lookup"].append(lookup_matches(seq, s))
        rows["draft_confidence"].append(confidence[0])
        rows["kept"].append(best[0] == seq[s + 1])
        rows["prompt"].append(i)
    out = {name: np.array(values, dtype=float) for name, values in rows.items()}
    same_prompt = out["prompt"][1:] == out["prompt"][:-1]
    out["previous_kept"] = np.concatenate([[np.nan], np.where(same_prompt, out["kept"][:-1], np.nan)])
    return out


def free_gated_rate(signal: np.ndarray, kept: np.ndarray, threshold: float, draft_cost: float, two_rows: float) -> float:
    """Tokens per one-row pass when a step drafts one token, and pays the draft step, only where
    the signal is >= threshold; elsewhere it decodes one token (1 pass)."""
    draft = signal >= threshold
    tokens = 1.0 + (kept * draft).mean()
    cost = np.where(draft, draft_cost + two_rows, 1.0).mean()
    return float(tokens / cost)


def combined(found: dict[str, np.ndarray], known: np.ndarray) -> np.ndarray:
    """P(kept) from the four free signals at the positions with a previous one: a logistic
    regression fitted on the even prompts predicts the odd ones, and the other way round."""
    features = np.stack([found["previous_kept"], found["lookup"], np.minimum(found["target_margin"], 10.0) / 10.0,
                         found["target_p"], np.ones(len(found["kept"]))], axis=1)[known]
    kept, half = found["kept"][known], found["prompt"][known] % 2
    predicted = np.zeros(len(kept))
    for held in (0, 1):
        fit = half != held
        w = np.zeros(features.shape[1])
        for _ in range(3000):  # gradient descent on the log-loss; the features are all in [0, 1]
            p = 1.0 / (1.0 + np.exp(-features[fit] @ w))
            w -= 0.5 * features[fit].T @ (p - kept[fit]) / fit.sum()
        predicted[~fit] = 1.0 / (1.0 + np.exp(-features[~fit] @ w))
    return predicted


def buckets(signal: np.ndarray, kept: np.ndarray, edges: np.ndarray) -> list[dict]:
    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = (signal >= lo) & ((signal < hi) if hi < edges[-1] else (signal <= hi))
        out.append({"from": float(lo), "to": float(hi), "share": float(inside.mean()),
                    "kept": float(kept[inside].mean()) if inside.any() else None})
    return out


def main() -> int:
    args, target, draft, prompts = teacher_forced_command(__doc__.split("\n\n")[0])
    found = signals(target, draft, prompts, args.tokens)
    kept = found["kept"]
    known = ~np.isnan(found["previous_kept"])
    print(f"{len(kept)} answer positions of {len(prompts)} held-out prompts: first draft token kept {kept.mean():.3f}")
    margin_edges = np.array([0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, np.inf])
    report = {
        "target_p": buckets(found["target_p"], kept, np.linspace(0.0, 1.0, 11)),
        "target_margin": buckets(found["target_margin"], kept, margin_edges),
        "previous_kept": buckets(found["previous_kept"][known], kept[known], np.array([0.0, 0.5, 1.0])),
        "lookup": buckets(found["lookup"], kept, np.array([0.0, 0.5, 1.0])),
    }
    predicted = combined(found, known)
    report["combined"] = buckets(predicted, kept[known], np.quantile(predicted, np.linspace(0.0, 1.0, 6)))
    for name, table in report.items():
        print(f"{name}: " + "; ".join(f"{b['from']:g}-{b['to']:g}: {b['share']:.1%} kept {b['kept']:.3f}"
                                       for b in table if b["kept"] is not None))
    costs = (args.draft_cost, args.two_rows)
    rates = {
        "always": free_gated_rate(np.ones_like(kept), kept, 0.5, *costs),
        "target_p": {f"{t:.2f}": free_gated_rate(found["target_p"], kept, t, *costs) for t in np.linspace(0.3, 0.95, 14)},
        "target_margin": {f"{t:g}": free_gated_rate(found["target_margin"], kept, t, *costs) for t in margin_edges[1:-1]},
        "combined": {f"{t:.2f}": free_gated_rate(predicted, kept[known], t, *costs) for t in np.linspace(0.3, 0.8, 11)},
        "draft_confidence": {f"{t:.1f}": gated_rate(found["draft_confidence"], kept, t, *costs)
                             for t in np.linspace(0.0, 0.9, 10)},
    }
    print(f"one draft token a step (draft {costs[0]}, 2 rows {costs[1]} one-row passes), tokens per pass: "
          f"always {rates['always']:.3f}")
    for name in ("target_p", "target_margin", "combined", "draft_confidence"):
        best = max(rates[name], key=rates[name].get)
        paid = "(drafting every step)" if name == "draft_confidence" else "(drafting only there)"
        print(f"  gated by {name} >= t {paid}: best t {best}: {rates[name][best]:.3f}")
    if args.json:
        write_result(args.json, {"draft": str(args.draft or "shipped"), "prompts": len(prompts), "positions": len(kept),
                                 "kept": float(kept.mean()), "buckets": report, "rates": rates,
                                 "costs": {"draft": args.draft_cost, "two_rows": args.two_rows}}, threads=2)
    return 0

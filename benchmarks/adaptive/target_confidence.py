"""How often the draft's first token is right, by how sure the target itself was there.

    python -m benchmarks.adaptive target-confidence DATA_FOLDER [--draft DRAFT.gguf] [--batches 40] [--json out.json]

Teacher-forced on a data folder (best: answers no stage of the draft trained on, e.g. a
`data refresh --sequences 2559:` of the saved answers): random anchors in the answers, as training
draws them, the draft (default: the shipped one) run in PyTorch from its GGUF, its block row 1
against the target's greedy token; the target's confidence is its top-1 probability over the 16
tokens the data keeps. If the draft misses where the target is sure, what it can infer from its
inputs, not the target's own uncertainty, is what holds acceptance down.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from ikdflash.gguf_files import gguf_field, open_gguf, target_weights
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.train import data, draft, loop

from benchmarks.harness import write_result

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01)


def draft_model(path: Path, target: Path) -> tuple[draft.DraftModel, np.ndarray]:
    """The draft GGUF as the trainer's model, and the ids its head scores."""
    from ikdflash.convert import DFLASH1_LAYOUT

    reader = open_gguf(path, "draft")
    field = lambda key, default=None: gguf_field(reader, f"{DFLASH1_LAYOUT.arch}.{key}", default)  # noqa: E731
    embd, head, _, hp = target_weights(target, [])
    n_layer, window = int(field("block_count")), int(field("attention.sliding_window", 0))
    pattern = field("attention.sliding_window_pattern", [True] * n_layer)
    cfg = draft.DraftConfig(
        hidden_size=embd.shape[1], vocab_size=embd.shape[0], num_target_layers=hp["n_layer"],
        target_layer_ids=[int(i) for i in field("dflash.target_layer_ids")],
        layer_types=["sliding_attention" if window and p else "full_attention" for p in pattern],
        sliding_window=window, num_attention_heads=int(field("attention.head_count")),
        num_key_value_heads=int(field("attention.head_count_kv")), head_dim=int(field("attention.key_length")),
        intermediate_size=int(field("feed_forward_length")), block_size=int(field("dflash.block_size")),
        mask_token_id=int(field("dflash.mask_token_id")), rope_theta=float(field("rope.freq_base")))
    model = draft.DraftModel(cfg, embd, head)
    draft.init_from_draft(model, path)  # sets cfg.head_token_ids from the file's cut, if any
    ids = cfg.head_token_ids or range(cfg.vocab_size)
    return model.eval(), np.asarray(ids, dtype=np.int64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--batches", type=int, default=40, help="batches of 4 sequences x 48 anchors (default 40)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, shipped = resolve_pair(DEFAULT_PAIR)
    model, ids = draft_model(args.draft or shipped, target)
    folder = data.open_dataset(args.data)
    settings = loop.TrainSettings(minutes=1, soft_labels=1.0)  # soft labels: the batches carry the top tokens
    batches = loop.Batches([folder], model.cfg.block_size, model.cfg.mask_token_id, settings,
                           loop.label_rows(ids, model.cfg.vocab_size))
    head = model.head[torch.from_numpy(ids)]
    rng = np.random.default_rng(args.seed)
    sure, right = [], []
    with torch.no_grad():
        for _ in range(args.batches):
            batch = batches.sample(rng)
            S, A = batch["anchors"].shape
            rows = model.hidden(batch["features"], batch["block"], batch["anchors"]).view(S, A, -1, head.shape[1])
            guess = (rows[:, :, 1] @ head.T).argmax(-1)
            labelled = batch["weight"][:, :, 0] > 0
            sure.append(batch["soft_probs"][:, :, 0, 0][labelled].numpy())
            right.append((guess == batch["labels"][:, :, 0])[labelled].numpy())
    p_max, hit = np.concatenate(sure), np.concatenate(right)
    result = {"data": str(args.data), "draft": str(args.draft or "shipped"), "positions": int(len(hit)),
              "first_token_right": float(hit.mean()), "target_p_max_mean": float(p_max.mean()), "buckets": []}
    print(f"{len(hit)} positions: the draft's first token right {hit.mean():.1%}; the target's mean p_max "
          f"{p_max.mean():.2f}")
    for lo, hi in zip(EDGES, EDGES[1:]):
        chosen = (p_max >= lo) & (p_max < hi)
        share, rate = float(chosen.mean()), float(hit[chosen].mean()) if chosen.any() else 0.0
        result["buckets"].append({"p_max": [lo, min(hi, 1.0)], "share": share, "first_token_right": rate})
        print(f"  target p_max {lo:.2f}-{min(hi, 1.0):.2f}: {share:6.1%} of positions, draft right {rate:.1%}")
    if args.json:
        write_result(args.json, result, args.threads)
    return 0

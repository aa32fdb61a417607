"""The DFlash training recipe on data from `ikdflash.train.data`.

Each step takes a few sequences and, in each, random anchor positions a among its assistant rows.
Block i is [token a_i, mask x (B-1)] at positions a_i..a_i+B-1 and sees the context rows before
a_i; block position j is trained towards the token the target would emit there, with a loss
weight that decays with j. Labels ("target", the default) are the target's greedy tokens: position
j is the target's argmax after row a+j-1. Where the text from a+1 to a+j-1 is what the target
itself would have said, that label is exactly the token speculation must guess (at inference a
later position counts only once every earlier one was accepted, and then the context *is* the
target's own text); past the first place where the text leaves the target's path the label only
approximates it, and weighs off_path_weight (0 drops it; with so few on-path positions in human
text, a draft trained on those alone learns position 1 and little else). "corpus" trains on the
text's own next tokens instead.

Soft labels (soft_labels > 0) also train each position towards the target's distribution there,
its top tokens as the data kept them (renormalised over those the head holds): the label says
which token wins, the distribution also how close the others came, which is more to learn from
each row when rows are what a CPU can least afford.

The embedding and head stay the target's, frozen. The head may be cut to the ids the labels use
most (head_vocab), which makes a step several times cheaper; the cut is chosen once (or kept from
the draft a run starts from, when it has as many ids), kept in the checkpoint and exported
(dflash_config.head_token_ids), so the fork's draft scores exactly the ids it was trained on, and
reads a fraction of the head's weights each step.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from ikdflash.train.data import Dataset
from ikdflash.train.draft import DraftModel, decay_weights

LABELS = ("target", "corpus")


@dataclass
class TrainSettings:
    minutes: float                 # budget of this run (resumed runs add their own)
    seed: int = 0
    lr: float = 6e-4
    warmup_steps: int = 100
    sequences_per_step: int = 4
    anchors_per_sequence: int = 48
    gamma: float = 4.0             # loss weight exp(-(j-1)/gamma) at block position j
    labels: str = "target"
    off_path_weight: float = 1.0   # "target" labels past the first place the text leaves the target's path
    soft_labels: float = 0.0       # share of each position's loss on the target's top tokens (0: greedy label only)
    confidence_weight: float = 1.0  # a DSpark draft's confidence loss against its token loss
    first_share: float | None = None  # share of anchors from the first data folder (None: by size)
    head_vocab: int = 16384        # 0: the whole vocabulary
    n_max: int = 4                 # drafted tokens the running acceptance estimate counts
    checkpoint_minutes: float = 5.0
    snapshot_minutes: float = 0.0  # also keep the draft every so many minutes (0: never), for learning curves
    max_steps: int | None = None
    n_threads: int | None = None
    # The learning-rate schedule's length over every run of the draft, minutes of training: a
    # resumed run goes on along the same schedule and stops where it ends (None: each run
    # schedules its own budget, so stages restart the warm-up and decay).
    total_minutes: float | None = None

    def __post_init__(self) -> None:
        for flag, value in (("--minutes", self.minutes), ("--total-minutes", self.total_minutes),
                            ("--gamma", self.gamma), ("--batch-sequences", self.sequences_per_step)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag} must be positive, got {value:g}")
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        if not 0 <= self.soft_labels <= 1:
            raise ValueError(f"--soft-labels must lie in 0..1, got {self.soft_labels:g}")
        if self.soft_labels and self.labels != "target":
            raise ValueError("--soft-labels trains towards the target's distribution: it needs --labels target")
        if not self.confidence_weight >= 0:
            raise ValueError(f"--confidence-weight must be at least 0, got {self.confidence_weight:g}")
        if self.first_share is not None and not 0 < self.first_share < 1:
            raise ValueError(f"--data-share must be between 0 and 1, got {self.first_share:g}")


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    history: list = field(default_factory=list)  # (step, seconds, loss, tau estimate)


class Batches:
    """Random (sequence, anchors) batches over one or more data folders: anchors on assistant rows
    with at least one label, sequences drawn in proportion to their anchors."""

    def __init__(self, datasets: Sequence[Dataset], block_size: int, mask_token: int, settings: TrainSettings,
                 label_map: np.ndarray) -> None:
        self.datasets, self.B, self.mask, self.s = list(datasets), block_size, mask_token, settings
        self.label_map = label_map
        self.width = self.datasets[0].width
        self.top_k = min(d.top_k for d in self.datasets) if settings.soft_labels else 0
        if settings.soft_labels and not self.top_k:
            old = next(d.folder for d in self.datasets if not d.top_k)
            raise ValueError(f"{old}: made before data kept the target's top tokens, which --soft-labels needs; "
                             f"refresh it (python -m ikdflash.train.data refresh)")
        self.sequences = []  # (dataset, first row, length, anchor candidates)
        weights, owner = [], []
        for k, data in enumerate(self.datasets):
            if data.width != self.width:
                raise ValueError(f"{data.folder}: features of width {data.width}, not {self.width} like the others")
            for start, length in np.asarray(data.index):
                trainable = np.asarray(data.trainable[start:start + length - 1]).astype(bool)
                trainable[0] = False  # a block needs at least one context row
                candidates = np.flatnonzero(trainable)
                if len(candidates):
                    self.sequences.append((data, int(start), int(length), candidates))
                    weights.append(len(candidates))
                    owner.append(k)
        if not self.sequences:
            raise ValueError("no sequence in the data has an assistant row to train on")
        p = np.array(weights, dtype=np.float64)
        first = np.array(owner) == 0
        if settings.first_share is not None and 0 < first.sum() < len(p):
            p[first] *= settings.first_share / p[first].sum()
            p[~first] *= (1 - settings.first_share) / p[~first].sum()
        self.p = p / p.sum()

    def labels(self, tokens: np.ndarray, greedy: np.ndarray,
               a: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Labels of block positions 1..B-1 for anchor a of one sequence (rows of the cut head),
        their loss weights (0: no label), whether each is on the target's own path, and the label
        tokens themselves (vocabulary ids, which a DFlash2 selector reads as predecessors)."""
        B, length = self.B, len(tokens)
        lab = np.zeros(B - 1, dtype=np.int64)
        weight = np.zeros(B - 1, dtype=np.float32)
        on_path = np.zeros(B - 1, dtype=bool)
        path = True
        for j in range(1, B):
            if self.s.labels == "corpus":
                if a + j >= length:
                    break
                lab[j - 1], weight[j - 1], on_path[j - 1] = tokens[a + j], 1.0, True  # the text is the path
            else:
                if a + j - 1 >= length:
                    break
                path = path and (j == 1 or tokens[a + j - 1] == greedy[a + j - 2])
                lab[j - 1] = greedy[a + j - 1]
                weight[j - 1] = 1.0 if path else self.s.off_path_weight
                on_path[j - 1] = path
        mapped = self.label_map[lab]
        weight[mapped < 0] = 0.0
        return mapped, weight, on_path & (mapped >= 0), lab

    def sample(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        S, A, B = self.s.sequences_per_step, self.s.anchors_per_sequence, self.B
        picks = [self.sequences[k] for k in rng.choice(len(self.sequences), size=S, p=self.p)]
        anchors = np.full((S, A), -1, dtype=np.int64)
        for i, (_, _, _, candidates) in enumerate(picks):
            chosen = rng.choice(candidates, size=min(A, len(candidates)), replace=False)
            anchors[i, :len(chosen)] = np.sort(chosen)
        L = int(anchors.max())  # context rows needed: those before the furthest anchor
        features = np.zeros((S, L, self.width), dtype=np.float16)  # as stored: half the bytes to copy and move
        block = np.full((S, A, B), self.mask, dtype=np.int64)
        labels = np.zeros((S, A, B - 1), dtype=np.int64)
        label_tokens = np.zeros((S, A, B - 1), dtype=np.int64)
        weight = np.zeros((S, A, B - 1), dtype=np.float32)
        on_path = np.zeros((S, A, B - 1), dtype=bool)
        K = self.top_k
        soft_ids = np.zeros((S, A, B - 1, K), dtype=np.int64)
        soft_logits = np.full((S, A, B - 1, K), -np.inf, dtype=np.float32)
        for i, (data, start, length, _) in enumerate(picks):
            n_ctx = min(L, length)
            features[i, :n_ctx] = data.features[start:start + n_ctx]
            tokens = np.asarray(data.tokens[start:start + length])
            greedy = np.asarray(data.greedy[start:start + length])
            for j, a in enumerate(anchors[i]):
                if a >= 0:
                    block[i, j, 0] = tokens[a]
                    (labels[i, j], weight[i, j], on_path[i, j],
                     label_tokens[i, j]) = self.labels(tokens, greedy, int(a))
            if K:
                # position j's distribution is the one after row a+j-1
                rows = anchors[i][:, None] + np.arange(B - 1)
                valid = (anchors[i][:, None] >= 0) & (rows < length)
                ids = self.label_map[np.asarray(data.top_ids[start + rows[valid], :K])]
                soft_ids[i][valid] = np.maximum(ids, 0)
                soft_logits[i][valid] = np.where(ids >= 0, np.asarray(data.top_logits[start + rows[valid], :K]), -np.inf)
        batch = {"features": torch.from_numpy(features), "block": torch.from_numpy(block),
                 "anchors": torch.from_numpy(anchors), "labels": torch.from_numpy(labels),
                 "label_tokens": torch.from_numpy(label_tokens),
                 "weight": torch.from_numpy(weight), "on_path": torch.from_numpy(on_path)}
        if K:
            batch["soft_ids"] = torch.from_numpy(soft_ids)
            batch["soft_probs"] = torch.softmax(torch.from_numpy(soft_logits), -1).nan_to_num(0.0)
        return batch


def head_subset(datasets: Sequence[Dataset], vocab: int, size: int) -> np.ndarray:
    """The ids the data's labels use most, increasing (all ids when size is 0 or covers them)."""
    if size <= 0 or size >= vocab:
        return np.arange(vocab)
    counts = sum(np.bincount(np.asarray(d.greedy), minlength=vocab)
                 + np.bincount(np.asarray(d.tokens), minlength=vocab) for d in datasets)
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def label_rows(ids: np.ndarray, vocab: int) -> np.ndarray:
    """The map from a vocabulary id to its row in the cut head (-1: not in it)."""
    label_map = np.full(vocab, -1, dtype=np.int64)
    label_map[ids] = np.arange(len(ids))
    return label_map


def selector_loss(model: DraftModel, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  previous: torch.Tensor, head_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash2 selector's cross-entropy, per labelled row, over that row's top_k candidates
    (the ids the head scores best) given the previous label as the predecessor (the anchor for
    position 1): teacher-forced, as acceptance is (a row counts only when every row before it
    was right, and then its predecessor is the label). The logits enter detached: the head is
    trained by the token loss, the selector learns what to add to it. Rows whose label is not a
    candidate, which the selector cannot choose, weigh 0. Also each row's choice (a head row)."""
    selector = model.candidate_selector
    assert selector is not None, "a DFlash2 draft's loss"
    top = min(selector.top_k, logits.shape[-1])
    unary, candidates = torch.topk(logits.detach(), top, dim=-1)
    scores = unary + selector.pair_scores(hidden, previous, head_ids[candidates])
    is_label = candidates == labels[:, None]
    per_row = F.cross_entropy(scores, is_label.to(torch.int64).argmax(-1), reduction="none")
    per_row = torch.where(is_label.any(-1), per_row, 0.0)
    return per_row, candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]


def step_loss(model: DraftModel, batch: dict[str, torch.Tensor], head: torch.Tensor, weights: torch.Tensor,
              n_max: int, soft_labels: float = 0.0, head_ids: torch.Tensor | None = None,
              confidence_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy over the labelled block positions (a soft_labels share of it
    towards the batch's soft_probs over soft_ids; a DFlash2 draft adds its selector's, for which
    head_ids are the vocabulary ids of the head's rows; a DSpark draft's logits have its Markov
    bias, and it adds confidence_weight times its confidence head's binary cross-entropy against
    whether the row's token is the target's, on its path), and each anchor's accepted length:
    consecutive hits (the argmax, or the selector's choice) on the target's path at positions
    1..n_max (-1: unused anchor; "corpus" labels count as the path). Teacher-forced: a row's
    previous token is the label before it (the anchor for position 1)."""
    S, A = batch["anchors"].shape
    B = model.cfg.block_size
    hidden = model.hidden(batch["features"], batch["block"], batch["anchors"]).view(S, A, B, -1)[:, :, 1:]
    labelled = batch["weight"] > 0
    logits = hidden[labelled] @ head.T
    previous = torch.cat([batch["block"][:, :, :1], batch["label_tokens"][:, :, :-1]], dim=2)[labelled]
    w1_rows = None
    if model.markov_head is not None:
        assert head_ids is not None
        w1_rows = model.markov_head.markov_w1(previous)
        logits = logits + F.linear(w1_rows, model.markov_head.markov_w2.weight[head_ids])
    choice = logits.argmax(-1)
    w = (weights.expand(S, A, B - 1) * batch["weight"])[labelled]
    per_position = F.cross_entropy(logits, batch["labels"][labelled], reduction="none")
    if soft_labels:
        log_q = F.log_softmax(logits, -1).gather(-1, batch["soft_ids"][labelled])
        probs = batch["soft_probs"][labelled]
        soft = -torch.where(probs > 0, probs * log_q, 0.0).sum(-1)  # dropped ids weigh nothing, whatever their log_q
        per_position = (1 - soft_labels) * per_position + soft_labels * soft
    if model.candidate_selector is not None:
        assert head_ids is not None
        selected, choice = selector_loss(model, hidden[labelled], logits, batch["labels"][labelled], previous, head_ids)
        per_position = per_position + selected
    if model.confidence_head is not None:
        features = hidden[labelled] if w1_rows is None else torch.cat([hidden[labelled], w1_rows], dim=-1)
        kept = (choice == batch["labels"][labelled]) & batch["on_path"][labelled]
        confident = model.confidence_head.proj(features)[:, 0]
        per_position = per_position + confidence_weight * F.binary_cross_entropy_with_logits(
            confident, kept.to(confident.dtype), reduction="none")
    loss = (per_position * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        hit = torch.zeros(S, A, B - 1, dtype=torch.bool, device=labelled.device)
        hit[labelled] = choice == batch["labels"][labelled]
        hit &= batch["on_path"]
        accepted = hit[:, :, :n_max].to(torch.int64).cumprod(-1).sum(-1)
        accepted[batch["anchors"] < 0] = -1
    return loss, accepted


def _lr(settings: TrainSettings, step: int, fraction: float) -> float:
    """Warm-up, then flat, then a linear fall to 10% over the last quarter of the budget."""
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    tail = 1.0 if fraction < 0.75 else 1.0 - 0.9 * min(1.0, (fraction - 0.75) / 0.25)
    return settings.lr * warm * tail


def train(model: DraftModel, datasets: Sequence[Dataset], settings: TrainSettings, checkpoint: str | os.PathLike[str],
          *, progress: bool = True, on_snapshot: Callable[[TrainState], None] | None = None) -> TrainState:
    """Train for settings.minutes (or max_steps), resuming from checkpoint when it exists;
    on_snapshot is called every settings.snapshot_minutes of training."""
    if settings.n_threads:
        torch.set_num_threads(settings.n_threads)
    torch.manual_seed(settings.seed)
    cfg = model.cfg
    device = "cuda" if torch.cuda.is_available() else "cpu"  # minutes of a GPU are days of this CPU
    model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.lr,
                                  betas=(0.9, 0.95), weight_decay=0.01)
    state = TrainState()
    rng = np.random.default_rng(settings.seed)
    saved = None
    if os.path.exists(checkpoint):
        try:
            saved = torch.load(checkpoint, weights_only=False, map_location="cpu")
        except Exception as e:  # torch raises pickle, zip and runtime errors alike
            raise ValueError(f"{checkpoint}: not a training checkpoint ({e}); delete it to start over") from None
        if saved.get("config") != cfg.to_json():
            raise ValueError(f"{checkpoint}: made for another draft configuration; use another --out folder")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        rng.bit_generator.state = saved["rng"]
        torch.set_rng_state(saved["torch_rng"])
    # the head's cut is the draft's for good: a resumed run keeps it whatever data it adds, and so
    # does a run going on from a draft with that many ids (a different count asks for a new cut)
    if saved is not None:
        ids = saved["head_ids"]
    elif cfg.head_token_ids and len(cfg.head_token_ids) == settings.head_vocab:
        ids = np.asarray(cfg.head_token_ids, dtype=np.int64)
    else:
        ids = head_subset(datasets, cfg.vocab_size, settings.head_vocab)
    cfg.head_token_ids = [int(i) for i in ids] if len(ids) < cfg.vocab_size else None
    head_ids = torch.from_numpy(ids).to(device)
    head = model.head[head_ids]
    weights = decay_weights(cfg.block_size, settings.gamma).to(device)
    batches = Batches(datasets, cfg.block_size, cfg.mask_token_id, settings, label_rows(ids, cfg.vocab_size))

    def save() -> None:
        tmp = f"{checkpoint}.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                    "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                    "config": cfg.to_json(), "head_ids": ids}, tmp)
        os.replace(tmp, checkpoint)

    budget = settings.minutes * 60
    seconds_before = state.seconds
    t0 = last_save = last_report = last_snapshot = time.monotonic()
    run_steps = 0
    recent: list[tuple[float, float]] = []  # (loss, tau estimate) of the steps since the last report
    model.train()
    while True:
        elapsed = time.monotonic() - t0
        if settings.total_minutes:
            fraction = (seconds_before + elapsed) / (settings.total_minutes * 60)
        else:
            fraction = elapsed / budget
        if (elapsed >= budget or fraction >= 1.0
                or (settings.max_steps is not None and run_steps >= settings.max_steps)):
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(settings, state.step, fraction)
        batch = {name: tensor.to(device) for name, tensor in batches.sample(rng).items()}
        loss, accepted = step_loss(model, batch, head, weights, settings.n_max, settings.soft_labels, head_ids,
                                   settings.confidence_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        state.step += 1
        run_steps += 1
        used = accepted[accepted >= 0]
        recent.append((loss.item(), 1.0 + used.float().mean().item() if used.numel() else 1.0))
        now = time.monotonic()
        state.seconds = seconds_before + now - t0
        if now - last_report >= 30 or run_steps == 1:
            report(state, recent, progress, f"{(now - t0) / 60:.1f}/{settings.minutes:g} min")
            last_report = now
        if now - last_save >= settings.checkpoint_minutes * 60:
            save()
            last_save = now
        if on_snapshot and settings.snapshot_minutes > 0 and now - last_snapshot >= settings.snapshot_minutes * 60:
            on_snapshot(state)
            last_snapshot = now
    report(state, recent, progress, "done")
    save()
    return state


def report(state: TrainState, recent: list[tuple[float, float]], progress: bool, when: str) -> None:
    """Record the mean loss and running acceptance estimate (tau at n_max, on training batches)
    of the steps since the last record."""
    if not recent:
        return
    loss = sum(r[0] for r in recent) / len(recent)
    tau = sum(r[1] for r in recent) / len(recent)
    state.history.append((state.step, round(state.seconds, 1), loss, tau))
    recent.clear()
    if progress:
        print(f"train: step {state.step}  loss {loss:.3f}  tau~{tau:.2f}  {when}", file=sys.stderr, flush=True)

"""The DFlash reference (PyPI `dflash` 0.1.0, PyTorch on the CPU) run on a tiny checkpoint, so
the fork's draft can be compared with what the draft was trained to compute."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ikdflash.sources.hf import read_tensors


class ReferenceDraft:
    def __init__(self, draft_dir: Path, hf_target: Path) -> None:
        import json

        import torch
        from dflash.model import DFlash2DraftModel, DFlashDraftModel

        self.torch = torch
        archs = json.loads((Path(draft_dir) / "config.json").read_text()).get("architectures", [])
        model_class = DFlash2DraftModel if "DFlash2DraftModel" in archs else DFlashDraftModel
        self.model = model_class.from_pretrained(draft_dir, dtype=torch.float32).eval()
        weights = read_tensors(hf_target)
        self.embed = torch.from_numpy(weights["model.embed_tokens.weight"])
        self.head = torch.nn.Linear(self.embed.shape[1], self.embed.shape[0], bias=False)
        self.head.weight.data = torch.from_numpy(weights["lm_head.weight"])

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def logits(self, features: np.ndarray, first_token: int, start: int) -> np.ndarray:
        """Logits of the block [first_token, mask, ...] at start.., context rows at start-n..start-1."""
        hidden = self._hidden(features, first_token, start)
        with self.torch.inference_mode():
            return self.model.compute_logits(hidden, self.head)[0].numpy()

    def proposal(self, features: np.ndarray, first_token: int, start: int) -> list[int]:
        """The block's greedy draft tokens (rows 1..): the argmax, or a DFlash2 draft's selector."""
        from dflash.model import DFlash2DraftModel

        hidden = self._hidden(features, first_token, start)[:, 1:]
        with self.torch.inference_mode():
            if isinstance(self.model, DFlash2DraftModel):
                tokens = self.model.propose(hidden, self.torch.tensor([first_token]), self.head, 0.0)[0]
            else:
                tokens = self.model.compute_logits(hidden, self.head).argmax(dim=-1)
        return [int(t) for t in tokens[0]]

    def _hidden(self, features: np.ndarray, first_token: int, start: int):
        """The draft's normed hidden states of the whole block (before the head)."""
        torch = self.torch
        block = torch.tensor([[first_token] + [self.model.mask_token_id] * (self.block_size - 1)])
        n_ctx = features.shape[0]
        scale = float(self.model.config.dflash_config.get("input_embedding_scale",
                                                          getattr(self.model.config, "input_embedding_scale", 1.0)))
        with torch.inference_mode():
            hidden = self.model(
                target_hidden=torch.from_numpy(features)[None],
                noise_embedding=torch.nn.functional.embedding(block, self.embed) * scale,
                position_ids=torch.arange(start - n_ctx, start + self.block_size)[None],
                use_cache=False,
            )
        return hidden


class ReferenceDspark:
    """speculators 0.9.0's DSparkDraftModel on a speculators checkpoint: its backbone on one block
    (eager attention, the anchor-block mask it trains with), then greedy drafting left to right with
    its Markov head, and its confidence head on each proposing row."""

    def __init__(self, draft_dir: Path, hf_target: Path) -> None:
        import json
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the config names a verifier it would look up
        import warnings

        import torch

        with warnings.catch_warnings():  # speculators' imports use torch APIs torch deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

        self.torch = torch
        config = DSparkSpeculatorConfig(**json.loads((Path(draft_dir) / "config.json").read_text()))
        config.transformer_layer_config._attn_implementation = "eager"
        self.model = DSparkDraftModel(config).eval()
        weights = {k: torch.from_numpy(v) for k, v in read_tensors(draft_dir).items()}
        target = read_tensors(hf_target)
        head = torch.from_numpy(target["lm_head.weight"])
        weights |= {"embed_tokens.weight": torch.from_numpy(target["model.embed_tokens.weight"]),
                    "lm_head.weight": head, "verifier_lm_head.weight": head}
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"verifier_norm.weight"}, (missing, unexpected)

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def draft(self, features: np.ndarray, first_token: int, start: int, head_ids: list[int] | None = None):
        """(every block row's logits with the Markov bias, the proposals, their confidences or
        None) for the block at start, context rows at start-n..start-1; head_ids: the proposals
        are the best of these ids only."""
        torch, model = self.torch, self.model
        n_ctx, block = features.shape[0], self.block_size
        length = n_ctx + block + 1  # the anchor at n_ctx; anchors are drawn before the last block
        hidden_states = torch.zeros(1, length, features.shape[1])
        hidden_states[0, :n_ctx] = torch.from_numpy(features)
        input_ids = torch.zeros(1, length, dtype=torch.long)
        input_ids[0, n_ctx] = first_token
        loss_mask = torch.zeros(1, length)
        loss_mask[0, n_ctx] = 1  # the only anchor
        with torch.inference_mode():
            hidden, logits, _, _, _ = model._backbone_forward(
                hidden_states, input_ids, loss_mask, torch.zeros(1, length, model.hidden_size),
                torch.zeros(1, length, dtype=torch.long),
                torch.arange(start - n_ctx, start - n_ctx + length)[None], max_anchors=1)
            first_proposing = 0 if model.config.sample_from_anchor else 1
            previous, rows, tokens, confidence = first_token, [], [], []
            for k in range(block):
                row, w1_row = logits[0, k], None
                if model.markov_head is not None:
                    w1_row = model.markov_head.prev_embeddings(torch.tensor([[previous]]))
                    row = row + model.markov_head.block_bias(prev_token_ids=torch.tensor([[previous]]),
                                                             hidden_states=hidden[:, k:k + 1], prev_emb=w1_row)[0, 0]
                rows.append(row.numpy())
                if k < first_proposing:
                    continue
                previous = int(row.argmax()) if head_ids is None else head_ids[int(row[head_ids].argmax())]
                tokens.append(previous)
                if model.confidence_head is not None:
                    features_k = hidden[0, k]
                    if model.config.confidence_head_with_markov:
                        features_k = torch.cat([features_k, w1_row[0, 0]])
                    confidence.append(float(torch.sigmoid(model.confidence_head(features_k))))
        return np.stack(rows), tokens, confidence or None


class ReferenceSpecforge:
    """SpecForge 0.2.0's DSparkDraftModel on a SpecForge checkpoint, as its own generation runs it:
    the backbone with no attention mask (every layer sees the context and the whole block), then
    its Markov head's greedy block over rows 1.. from the anchor, and its confidence head."""

    def __init__(self, draft_dir: Path, hf_target: Path) -> None:
        import json

        import torch
        from transformers import Qwen3Config

        self.torch = torch
        config = Qwen3Config(**json.loads((Path(draft_dir) / "config.json").read_text()))
        config._attn_implementation = "eager"
        self.model = _specforge_dspark()(config).eval()
        weights = {k: torch.from_numpy(v) for k, v in read_tensors(draft_dir).items()}
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        target = read_tensors(hf_target)
        self.embed = torch.from_numpy(target["model.embed_tokens.weight"])
        self.head = torch.from_numpy(target["lm_head.weight"])

    def draft(self, features: np.ndarray, first_token: int, start: int):
        """(the proposing rows' logits with the Markov bias, the proposals, their confidences or
        None) for the block at start, context rows at start-n..start-1."""
        torch, model = self.torch, self.model
        block = torch.tensor([[first_token] + [model.mask_token_id] * (model.block_size - 1)])
        with torch.inference_mode():
            hidden = model(position_ids=torch.arange(start - features.shape[0], start + model.block_size)[None],
                           noise_embedding=torch.nn.functional.embedding(block, self.embed),
                           target_hidden=torch.from_numpy(features)[None])[:, 1:]
            logits = hidden @ self.head.T
            anchor = torch.tensor([first_token])
            if model.markov_head is None:
                tokens = logits.argmax(dim=-1)
            else:
                tokens, logits = model.markov_head.sample_block_tokens(logits, first_prev_token_ids=anchor,
                                                                       hidden_states=hidden)
            previous = torch.cat([anchor[None], tokens[:, :-1]], dim=1)
            confidence = model.predict_confidence(hidden, prev_token_ids=previous)
        return (logits[0].numpy(), [int(t) for t in tokens[0]],
                None if confidence is None else torch.sigmoid(confidence[0]).tolist())


def _specforge_dspark():
    """SpecForge's DSparkDraftModel class, its package imported on a thread of its own: one of its
    modules keeps an exception raised while it was imported, whose traceback would keep every frame
    that imported it alive (a test's, with the Draft that holds its model)."""
    import importlib
    import sys
    import threading
    import warnings

    name = "specforge.modeling.draft.dspark"
    if name not in sys.modules:
        def load() -> None:
            with warnings.catch_warnings():  # the package warns of GPU kernels it cannot import
                warnings.simplefilter("ignore")
                importlib.import_module(name)

        loader = threading.Thread(target=load)
        loader.start()
        loader.join()
    return sys.modules[name].DSparkDraftModel

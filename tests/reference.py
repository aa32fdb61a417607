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

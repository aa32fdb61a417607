"""The DFlash reference (PyPI `dflash` 0.1.0, PyTorch on the CPU) run on a tiny checkpoint, so
the fork's draft can be compared with what the draft was trained to compute."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ikdflash.hf import read_tensors


class ReferenceDraft:
    def __init__(self, draft_dir: Path, hf_target: Path) -> None:
        import torch
        from dflash.model import DFlashDraftModel

        self.torch = torch
        self.model = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
        weights = read_tensors(hf_target)
        self.embed = torch.from_numpy(weights["model.embed_tokens.weight"])
        self.head = torch.nn.Linear(self.embed.shape[1], self.embed.shape[0], bias=False)
        self.head.weight.data = torch.from_numpy(weights["lm_head.weight"])

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def logits(self, features: np.ndarray, first_token: int, start: int) -> np.ndarray:
        """Logits of the block [first_token, mask, ...] at start.., context rows at start-n..start-1."""
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
            return self.model.compute_logits(hidden, self.head)[0].numpy()

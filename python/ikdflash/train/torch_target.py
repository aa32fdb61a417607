"""The target in PyTorch: the fork's training-data capture (features at the draft's layer ids, the
greedy next token, the top tokens and their logits) for many sequences a pass, on a GPU when torch
has one. It is for a machine where the fork is not built or a GPU is lent for minutes: the whole
saved-answer set is seconds of an H200, against ~2 hours of this project's 2-core CPU.

The weights are the GGUF's own, dequantized; the fork multiplies the same weights by activations
it rounds to 8 bits, so features agree closely, not bit for bit, and a draft trained on either
runs on the fork's (tests/test_train.py measures both). llama and qwen3 targets (attention + dense
FFN); anything else is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
from torch.nn import functional as F

from ikdflash.train.draft import rope, unpermute_llama_qk

ARCHS = ("llama", "qwen3")
LOGIT_ROWS = 4096  # rows whose full logits exist at once (49,152 ids: 800 MB in f32)
# padded tokens a capture call takes at most: a GPU wants big passes, a CPU's memory small ones
TOKENS_PER_CALL = {"cuda": 65536, "cpu": 4096}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TorchTarget:
    """capture(sequences, layer_ids, top_k) returns, per sequence, what the fork's
    Model._native.layer_features returns for it."""

    def __init__(self, path: str | os.PathLike[str], device: str | None = None) -> None:
        from ikdflash.pair import gguf_field, open_gguf
        from ikdflash.train import target_weights

        reader = open_gguf(path, "target")
        arch = gguf_field(reader, "general.architecture")
        if arch not in ARCHS:
            raise ValueError(f"{path}: a {arch} target; the PyTorch capture runs {' and '.join(ARCHS)} targets "
                             f"(use the fork's: --capture fork)")
        n_layer = int(gguf_field(reader, f"{arch}.block_count"))
        self.eps = float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"))
        embd, head, layers, hp = target_weights(path, list(range(n_layer)))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokens_per_call = TOKENS_PER_CALL.get(self.device.type, TOKENS_PER_CALL["cpu"])
        self.arch, self.hp = arch, hp
        self.n_layer, self.n_vocab, self.n_embd = n_layer, embd.shape[0], embd.shape[1]
        self.head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", self.n_embd // hp["n_head"]))

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.tensor(np.asarray(a, dtype=np.float32), device=self.device)

        self.embedding, self.head, self.output_norm = put(embd), put(head), put(hp["output_norm"])
        self.layers = []
        for w in layers:
            q, k = w["attn_q.weight"], w["attn_k.weight"]
            if arch == "llama":  # the GGUF keeps llama's Q/K rows in ggml's interleaved RoPE order
                q, k = unpermute_llama_qk(q, hp["n_head"]), unpermute_llama_qk(k, hp["n_head_kv"])
            layer = {name: put(value) for name, value in w.items()}
            layer["attn_q.weight"], layer["attn_k.weight"] = put(q), put(k)
            self.layers.append(layer)

    def close(self) -> None:
        self.layers.clear()

    def __enter__(self) -> TorchTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @torch.no_grad()
    def capture(self, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int],
                top_k: int) -> list[tuple[np.ndarray, ...]]:
        """One pass over the sequences side by side (padded at the end: causal attention keeps
        each row's result its own): (features, greedy, top_ids, top_logits) each, top_logits less
        the row's largest, or (features, greedy) when top_k is 0."""
        if any(not 0 <= i < self.n_layer for i in layer_ids):
            raise ValueError(f"layer ids must lie in 0..{self.n_layer - 1}, got {list(layer_ids)}")
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) == 0:
            raise ValueError("every sequence needs at least one token")
        S, T = len(sequences), max(lengths)
        tokens = torch.zeros(S, T, dtype=torch.long)
        for i, s in enumerate(sequences):
            tokens[i, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        tokens = tokens.to(self.device)
        if int(tokens.max()) >= self.n_vocab:
            raise ValueError(f"a token id past the vocabulary ({self.n_vocab})")
        pos = torch.arange(T, device=self.device).expand(S, T)
        h, hk, hd = self.hp["n_head"], self.hp["n_head_kv"], self.head_dim
        x = self.embedding[tokens]
        captured = {}
        for il, w in enumerate(self.layers):
            a = _rms_norm(x, w["attn_norm.weight"], self.eps)
            q = (a @ w["attn_q.weight"].T).view(S, T, h, hd)
            k = (a @ w["attn_k.weight"].T).view(S, T, hk, hd)
            v = (a @ w["attn_v.weight"].T).view(S, T, hk, hd)
            if self.arch == "qwen3":
                q = _rms_norm(q, w["attn_q_norm.weight"], self.eps)
                k = _rms_norm(k, w["attn_k_norm.weight"], self.eps)
            q, k = rope(q, pos, self.hp["rope_theta"]), rope(k, pos, self.hp["rope_theta"])
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k.repeat_interleave(h // hk, dim=1),
                                                  v.repeat_interleave(h // hk, dim=1), is_causal=True,
                                                  scale=hd ** -0.5)
            x = x + attn.transpose(1, 2).reshape(S, T, h * hd) @ w["attn_output.weight"].T
            n = _rms_norm(x, w["ffn_norm.weight"], self.eps)
            x = x + (F.silu(n @ w["ffn_gate.weight"].T) * (n @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T
            if il in layer_ids:
                captured[il] = x
        features = torch.cat([captured[i] for i in layer_ids], dim=-1) if layer_ids else x[..., :0]
        rows = _rms_norm(x, self.output_norm, self.eps).reshape(S * T, -1)
        k = max(top_k, 1)
        ids = torch.empty(S * T, k, dtype=torch.long, device=self.device)
        values = torch.empty(S * T, k, device=self.device)
        for r in range(0, S * T, LOGIT_ROWS):
            values[r:r + LOGIT_ROWS], ids[r:r + LOGIT_ROWS] = torch.topk(rows[r:r + LOGIT_ROWS] @ self.head.T, k)
        ids, values = ids.view(S, T, k).cpu().numpy(), (values - values[:, :1]).view(S, T, k).cpu().numpy()
        features = features.cpu().numpy()
        out = []
        for i, n in enumerate(lengths):
            greedy = ids[i, :n, 0].astype(np.int32)
            if top_k:
                out.append((features[i, :n], greedy, ids[i, :n].astype(np.int32), values[i, :n]))
            else:
                out.append((features[i, :n], greedy))
        return out

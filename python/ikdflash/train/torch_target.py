"""The target in PyTorch: the fork's training-data capture (features at the draft's layer ids, the
greedy next token, the top tokens and their logits) for many sequences a pass, on a GPU when torch
has one. It is for a machine where the fork is not built, or a GPU available for minutes: the whole
saved-answer set is seconds of an H200, against ~2 hours of a 2-core CPU.

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
# padded tokens a capture call takes at most, and answers decoded side by side: a GPU wants big
# passes, a CPU's memory small ones
TOKENS_PER_CALL = {"cuda": 65536, "cpu": 4096}
ANSWERS_PER_CALL = {"cuda": 512, "cpu": 8}
# token texts that end a generation whatever the GGUF's ids say (the fork's vocabulary loader keeps such a list)
END_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TorchTarget:
    """capture(sequences, layer_ids, top_k) returns, per sequence, what the fork's
    Model.layer_features returns for it; generate(prompts, ...) answers as the fork's
    Model.generate_many does."""

    def __init__(self, path: str | os.PathLike[str], device: str | None = None) -> None:
        from ikdflash.gguf_files import gguf_field, open_gguf, target_weights

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
        self.answers_per_call = ANSWERS_PER_CALL.get(self.device.type, ANSWERS_PER_CALL["cpu"])
        self.arch, self.hp = arch, hp
        self.n_layer, self.n_vocab, self.n_embd = n_layer, embd.shape[0], embd.shape[1]
        self.head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", self.n_embd // hp["n_head"]))
        texts = gguf_field(reader, "tokenizer.ggml.tokens")
        self.end_ids = sorted({int(i) for i in (gguf_field(reader, f"tokenizer.ggml.{role}_token_id", None)
                                                for role in ("eos", "eot", "eom")) if i is not None}
                              | {i for i, text in enumerate(texts) if text in END_TEXTS})

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

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, keep: Sequence[int] = (),
                cache: list[torch.Tensor] | None = None, at: int = 0) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [S, T, d] at positions pos [S, T] through every layer; mask [S, 1, T, keys] (None:
        causal over x alone); cache: each layer's keys and values [S, hk, cells, hd], x's written
        at cells at..at+T-1 and attention over cells 0..at+T-1. Returns x and the layers in keep."""
        S, T, _ = x.shape
        h, hk, hd = self.hp["n_head"], self.hp["n_head_kv"], self.head_dim
        kept = {}
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
            if cache is not None:
                keys, values = cache[2 * il], cache[2 * il + 1]
                keys[:, :, at:at + T], values[:, :, at:at + T] = k, v
                k, v = keys[:, :, :at + T], values[:, :, :at + T]
            attn = F.scaled_dot_product_attention(q, k.repeat_interleave(h // hk, dim=1),
                                                  v.repeat_interleave(h // hk, dim=1), attn_mask=mask,
                                                  is_causal=mask is None, scale=hd ** -0.5)
            x = x + attn.transpose(1, 2).reshape(S, T, h * hd) @ w["attn_output.weight"].T
            n = _rms_norm(x, w["ffn_norm.weight"], self.eps)
            x = x + (F.silu(n @ w["ffn_gate.weight"].T) * (n @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T
            if il in keep:
                kept[il] = x
        return x, kept

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.output_norm, self.eps) @ self.head.T

    def _batch(self, sequences: Sequence[Sequence[int]], left: bool) -> tuple[torch.Tensor, list[int]]:
        """The sequences padded to one length, at the end (or the start: left) with token 0."""
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) == 0:
            raise ValueError("every sequence needs at least one token")
        tokens = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
        for i, s in enumerate(sequences):
            row = torch.as_tensor(list(s), dtype=torch.long)
            if left:
                tokens[i, tokens.shape[1] - len(s):] = row
            else:
                tokens[i, :len(s)] = row
        if int(tokens.max()) >= self.n_vocab or int(tokens.min()) < 0:
            raise ValueError(f"a token id outside the vocabulary (0..{self.n_vocab - 1})")
        return tokens.to(self.device), lengths

    @torch.no_grad()
    def capture(self, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int],
                top_k: int) -> list[tuple[np.ndarray, ...]]:
        """One pass over the sequences side by side (padded at the end: causal attention keeps
        each row's result its own): (features, greedy, top_ids, top_logits) each, top_logits less
        the row's largest, or (features, greedy) when top_k is 0."""
        if any(not 0 <= i < self.n_layer for i in layer_ids):
            raise ValueError(f"layer ids must lie in 0..{self.n_layer - 1}, got {list(layer_ids)}")
        tokens, lengths = self._batch(sequences, left=False)
        S, T = tokens.shape
        x, kept = self._layers(self.embedding[tokens], torch.arange(T, device=self.device).expand(S, T), None,
                               keep=layer_ids)
        features = torch.cat([kept[i] for i in layer_ids], dim=-1) if layer_ids else x[..., :0]
        rows = x.reshape(S * T, -1)
        k = max(top_k, 1)
        ids = torch.empty(S * T, k, dtype=torch.long, device=self.device)
        values = torch.empty(S * T, k, device=self.device)
        for r in range(0, S * T, LOGIT_ROWS):
            values[r:r + LOGIT_ROWS], ids[r:r + LOGIT_ROWS] = torch.topk(self._logits(rows[r:r + LOGIT_ROWS]), k)
        top_ids = ids.view(S, T, k).cpu().numpy()
        top_logits = (values - values[:, :1]).view(S, T, k).cpu().numpy()
        host_features = features.cpu().numpy()
        out: list[tuple[np.ndarray, ...]] = []
        for i, n in enumerate(lengths):
            greedy = top_ids[i, :n, 0].astype(np.int32)
            if top_k:
                out.append((host_features[i, :n], greedy, top_ids[i, :n].astype(np.int32), top_logits[i, :n]))
            else:
                out.append((host_features[i, :n], greedy))
        return out

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperatures: Sequence[float],
                 seed: int = 0) -> list[list[int]]:
        """Answers to the prompts side by side, each up to max_tokens and stopping before an
        end-of-generation token, as the fork's Model.generate_many: prompt i at temperatures[i %
        len] (0: greedy; else sampled from the softmax at that temperature, a generator seeded
        with seed)."""
        tokens, lengths = self._batch(prompts, left=True)  # every prompt ends in the same column
        S, P = tokens.shape
        pad = torch.tensor([P - n for n in lengths], device=self.device)
        cells = P + max_tokens
        valid = torch.arange(cells, device=self.device)[None, :] >= pad[:, None]   # [S, cells]: not padding
        hk, hd = self.hp["n_head_kv"], self.head_dim
        cache = [torch.zeros(S, hk, cells, hd, device=self.device) for _ in range(2 * self.n_layer)]
        temps = torch.tensor([temperatures[i % len(temperatures)] for i in range(S)], device=self.device)
        ends = torch.tensor(self.end_ids, dtype=torch.long, device=self.device)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        pos = (torch.arange(P, device=self.device)[None, :] - pad[:, None]).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
        mask = (causal[None] & valid[:, None, :P])[:, None]
        mask[..., 0] |= ~mask.any(-1)  # a padding row attends somewhere; its result is never used
        x, _ = self._layers(self.embedding[tokens], pos, mask, cache=cache, at=0)
        answers = torch.zeros(S, max_tokens, dtype=torch.long, device=self.device)
        done = torch.zeros(S, dtype=torch.bool, device=self.device)
        length = torch.full((S,), max_tokens, dtype=torch.long, device=self.device)
        logits = self._logits(x[:, -1])
        for t in range(max_tokens):
            greedy = logits.argmax(-1)
            warm = torch.softmax(logits / temps.clamp(min=1e-6)[:, None], -1)
            sampled = torch.multinomial(warm, 1, generator=rng)[:, 0]
            nxt = torch.where(temps > 0, sampled, greedy)
            stop = ~done & torch.isin(nxt, ends)
            length = torch.where(stop, torch.full_like(length, t), length)
            done |= stop
            answers[:, t] = nxt
            if bool(done.all()) or t + 1 == max_tokens:
                break
            step_mask = valid[:, None, None, :P + t + 1]
            x, _ = self._layers(self.embedding[nxt][:, None], (P + t - pad)[:, None], step_mask, cache=cache, at=P + t)
            logits = self._logits(x[:, -1])
        return [answers[i, :int(length[i])].tolist() for i in range(S)]

"""The DFlash draft in PyTorch, written for training: many blocks of one sequence in one pass.

Semantics as docs/dflash.md states them (and as the fork computes them): context rows are
c_p = RMSNorm(W_fc f_p); each layer's keys and values are the same projections of the context
rows and of the block's own rows, keys RMS-normed per head and rotated (NeoX) at their absolute
positions; one mask rule per layer type. Where the reference feeds one block at a time, training
feeds A blocks of one sequence at once: block i (anchor a_i) sees context rows p < a_i and its own
rows, never another block's.

The checkpoint this writes (config.json + model.safetensors) is a DFlashDraftModel that the
reference package loads and `ikdflash convert` turns into a dflash-draft GGUF.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ikdflash.hf import write_tensors


@dataclass
class DraftConfig:
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    layer_types: list[str]             # "sliding_attention" | "full_attention", per draft layer
    sliding_window: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict)  # notes kept in config.json (how it was made)
    head_token_ids: list[int] | None = None    # the ids the head scores (None: all); set by training

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    def sliding(self, il: int) -> bool:
        return self.layer_types[il] == "sliding_attention"

    def hf_config(self) -> dict:
        """config.json of a DFlashDraftModel (qwen3 layers), as the reference reads it."""
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "attention_bias": False, "tie_word_embeddings": False,
            "rope_theta": self.rope_theta, "layer_types": list(self.layer_types),
            "use_sliding_window": any(self.sliding(i) for i in range(self.n_layer)),
            "sliding_window": self.sliding_window, "max_window_layers": self.n_layer,
            "num_target_layers": self.num_target_layers, "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                              **({"head_token_ids": self.head_token_ids} if self.head_token_ids else {})},
            "ikdflash_train": self.extra,
        }

    def to_json(self) -> dict:
        """The architecture, without the notes (a resumed run must match it exactly)."""
        return {k: v for k, v in asdict(self).items() if k not in ("extra", "head_token_ids")}


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotation of x [..., rows, heads, head_dim] at positions pos [..., rows]."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = pos.to(torch.float32)[..., None] * inv             # [..., rows, half]
    cos, sin = angle.cos()[..., None, :], angle.sin()[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, *, sliding: bool, causal: bool, window: int) -> torch.Tensor:
    """The mask rule of dflash.md for query positions [..., Q, 1] against key positions [..., 1, K]."""
    ok = torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        ok &= k_pos <= q_pos
    if sliding:
        ok &= q_pos - k_pos < window
        if not causal:
            ok &= k_pos - q_pos < window
    return ok


class Layer(nn.Module):
    def __init__(self, cfg: DraftConfig, il: int) -> None:
        super().__init__()
        d, h, hk, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg, self.sliding = cfg, cfg.sliding(il)
        self.causal = self.sliding  # the released drafts: causal exactly where sliding
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, hk * hd, bias=False)
        self.v_proj = nn.Linear(d, hk * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, block_pos: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """x [S, A*B, d] block rows; ctx [S, L, d] context rows at positions 0..L-1;
        block_pos [S, A*B] positions; anchors [S, A] (-1: an unused block)."""
        cfg = self.cfg
        S, QB, _ = x.shape
        L = ctx.shape[1]
        hd, h, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        a = self.input_layernorm(x)
        q = rope(self.q_norm(self.q_proj(a).view(S, QB, h, hd)), block_pos, cfg.rope_theta)
        keys_in = torch.cat([ctx, a], dim=1)
        ctx_pos = torch.arange(L, device=x.device).expand(S, L)
        key_pos = torch.cat([ctx_pos, block_pos], dim=1)
        k = rope(self.k_norm(self.k_proj(keys_in).view(S, L + QB, hk, hd)), key_pos, cfg.rope_theta)
        v = self.v_proj(keys_in).view(S, L + QB, hk, hd)

        rule = visible(block_pos[:, :, None], key_pos[:, None, :], sliding=self.sliding, causal=self.causal,
                       window=cfg.sliding_window)
        B = cfg.block_size
        block_of_query = torch.arange(QB, device=x.device) // B
        anchor_of_query = anchors.repeat_interleave(B, dim=1)                     # [S, QB]
        sees_ctx = ctx_pos[:, None, :] < anchor_of_query[:, :, None]              # context before the anchor
        same_block = block_of_query[:, None] == block_of_query[None, :]           # own block only
        mask = rule & torch.cat([sees_ctx, same_block.expand(S, QB, QB)], dim=2)
        mask[:, :, 0] |= ~mask.any(dim=2)  # an unused block's rows: attend somewhere, loss ignores them

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=hd ** -0.5)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(S, QB, h * hd))
        n = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


class DraftModel(nn.Module):
    """Trainable draft; the target's embedding and head are frozen buffers, borrowed as the fork
    borrows them."""

    def __init__(self, cfg: DraftConfig, embedding: np.ndarray, head: np.ndarray) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg, il) for il in range(cfg.n_layer))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.register_buffer("embedding", torch.tensor(np.asarray(embedding, dtype=np.float32)), persistent=False)
        self.register_buffer("head", torch.tensor(np.asarray(head, dtype=np.float32)), persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def hidden(self, features: torch.Tensor, block_tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states of every block row: [S, A*B, d]."""
        S, A = anchors.shape
        B = self.cfg.block_size
        ctx = self.hidden_norm(self.fc(features.float()))
        block_pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(B, device=anchors.device)).reshape(S, A * B)
        x = F.embedding(block_tokens.reshape(S, A * B), self.embedding)
        for layer in self.layers:
            x = layer(x, ctx, block_pos, anchors)
        return self.norm(x)

    def trainable_tensors(self) -> dict[str, np.ndarray]:
        """The weights under the reference's names (embedding and head excluded: borrowed)."""
        return {reference_name(name): value.detach().cpu().numpy() for name, value in self.state_dict().items()}


def reference_name(name: str) -> str:
    """A weight's name in the reference model: our modules drop its "self_attn." and "mlp." levels."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = name.replace(f".{proj}.", f".mlp.{proj}.")
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        name = name.replace(f".{proj}.", f".self_attn.{proj}.")
    return name


def save_checkpoint(model: DraftModel, folder: Path) -> Path:
    """A Hugging Face DFlash checkpoint: config.json + model.safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.hf_config(), indent=2))
    write_tensors(folder / "model.safetensors", model.trainable_tensors())
    return folder


def layer_types(n_layer: int, layout: str) -> list[str]:
    """'seed': sliding on every layer but the last (the released SWA draft); 'all-sliding'."""
    if layout == "seed":
        return ["sliding_attention"] * (n_layer - 1) + ["full_attention"]
    if layout == "all-sliding":
        return ["sliding_attention"] * n_layer
    raise ValueError(f"layout must be 'seed' or 'all-sliding', got {layout!r}")


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of block positions 1..B-1: early positions matter most (a later draft token
    only counts when every earlier one was accepted)."""
    return torch.tensor([math.exp(-(j - 1) / gamma) for j in range(1, block_size)], dtype=torch.float32)


def unpermute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row order llama GGUFs give Q and K for ggml's interleaved RoPE (back to NeoX halves)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def init_from_target_layers(model: DraftModel, target_layers: Sequence[dict[str, np.ndarray]], arch: str,
                            output_norm: np.ndarray | None = None) -> None:
    """Start draft layer i from target layer weights (dequantized GGUF tensors by short name), and
    the final norm from the target's, whose head the draft borrows."""
    cfg = model.cfg
    with torch.no_grad():
        if output_norm is not None:
            model.norm.weight.copy_(torch.tensor(np.asarray(output_norm, dtype=np.float32)))
        for layer, w in zip(model.layers, target_layers, strict=True):
            q, k = w["attn_q.weight"], w["attn_k.weight"]
            if arch == "llama":
                q = unpermute_llama_qk(q, cfg.num_attention_heads)
                k = unpermute_llama_qk(k, cfg.num_key_value_heads)
            pairs = {"q_proj": q, "k_proj": k, "v_proj": w["attn_v.weight"], "o_proj": w["attn_output.weight"],
                     "gate_proj": w["ffn_gate.weight"], "up_proj": w["ffn_up.weight"],
                     "down_proj": w["ffn_down.weight"], "input_layernorm": w["attn_norm.weight"],
                     "post_attention_layernorm": w["ffn_norm.weight"]}
            for name, value in pairs.items():
                getattr(layer, name).weight.copy_(torch.tensor(np.asarray(value, dtype=np.float32)))


def _spread_columns(fc: np.ndarray, their_ids: list[int], our_ids: list[int]) -> np.ndarray:
    """fc's input columns, one block per target layer in their_ids, moved to where our_ids keeps
    those layers; the other layers' blocks zero."""
    d = fc.shape[1] // len(their_ids)
    spread = np.zeros((fc.shape[0], d * len(our_ids)), dtype=fc.dtype)
    for k, il in enumerate(their_ids):
        j = our_ids.index(il)
        spread[:, j * d:(j + 1) * d] = fc[:, k * d:(k + 1) * d]
    return spread


def init_from_draft(model: DraftModel, path: str | Path) -> None:
    """Start every trainable weight from an existing dflash-draft GGUF of the same configuration: to
    go on training a shipped draft (Q8_0 is close enough to its floats) on a fork whose target
    states changed. A draft with fewer layers grows: its layers become this model's top ones, and
    the layers below keep their weights (e.g. the target's) with their output projections zeroed, so
    the grown draft starts out computing exactly what the smaller one does. ValueError naming what
    differs when the file is not a draft this model can start from. A draft reading some of this
    model's target layers starts it too: the features of the others start with weight 0. Its window
    may differ from this model's (no weight depends on it): a draft widening its window starts out
    seeing context it never learnt from, so expect a dip before training pays. Its head's cut, if
    any, becomes the model's cfg.head_token_ids (training keeps it when asked for as many ids)."""
    from gguf.quants import dequantize

    from ikdflash.convert import DFLASH1_LAYOUT, global_tensors, layer_tensors
    from ikdflash.pair import gguf_field, open_gguf

    arch = DFLASH1_LAYOUT.arch
    reader = open_gguf(path, "draft")
    if gguf_field(reader, "general.architecture", None) != arch:
        raise ValueError(f"draft {path}: not a DFlash draft (architecture "
                         f"{gguf_field(reader, 'general.architecture', None)!r})")
    cfg = model.cfg
    n_theirs = int(gguf_field(reader, f"{arch}.block_count"))
    if n_theirs > cfg.n_layer:
        raise ValueError(f"draft {path}: {n_theirs} layers, more than this run's draft has ({cfg.n_layer})")
    n_new = cfg.n_layer - n_theirs
    their_window = int(gguf_field(reader, f"{arch}.attention.sliding_window", 0))
    # as the fork reads it: no window, no sliding layer; a window without a pattern slides them all
    theirs_sliding = [their_window > 0 and bool(x) for x in
                      gguf_field(reader, f"{arch}.attention.sliding_window_pattern", [True] * n_theirs)]
    ours_sliding = [cfg.sliding(il) for il in range(n_new, cfg.n_layer)]
    their_ids = [int(x) for x in gguf_field(reader, f"{arch}.dflash.target_layer_ids")]
    # a draft reading some of this run's target layers starts it: the others' features weigh 0
    reads_ours = set(their_ids) <= set(cfg.target_layer_ids)
    header = {"target layer ids": (their_ids if not reads_ours else list(cfg.target_layer_ids),
                                   list(cfg.target_layer_ids)),
              "mask token": (int(gguf_field(reader, f"{arch}.dflash.mask_token_id")), cfg.mask_token_id),
              "sliding layers": (theirs_sliding, ours_sliding)}
    for what, (theirs, ours) in header.items():
        if theirs != ours:
            where = f" (its top {n_theirs})" if n_new and what == "sliding layers" else ""
            raise ValueError(f"draft {path}: {what} {theirs}, but this run's draft{where} has {ours}")
    their_head = gguf_field(reader, f"{arch}.dflash.head_token_ids", None)
    cfg.head_token_ids = [int(i) for i in their_head] if their_head is not None else None
    # their layer il is our layer il + n_new
    gguf_names = global_tensors(DFLASH1_LAYOUT) | {
        f"layers.{il + n_new}.{hf}": f"blk.{il}.{gguf_name}"
        for il in range(n_theirs) for hf, gguf_name in layer_tensors(DFLASH1_LAYOUT).items()}
    state = model.state_dict()
    new_layers = tuple(f"layers.{il}." for il in range(n_new))
    ours_by_gguf = {gguf_names[reference_name(name)]: name for name in state if not name.startswith(new_layers)}
    found = {t.name: t for t in reader.tensors}
    missing = sorted(set(ours_by_gguf) - set(found))
    if missing:
        raise ValueError(f"draft {path}: no tensor {', '.join(missing[:3])}")
    with torch.no_grad():
        for gguf_name, name in ours_by_gguf.items():
            t = found[gguf_name]
            value = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
                [int(x) for x in reversed(t.shape)])
            if name == "fc.weight" and their_ids != list(cfg.target_layer_ids):
                value = _spread_columns(value, their_ids, list(cfg.target_layer_ids))
            if tuple(value.shape) != tuple(state[name].shape):
                raise ValueError(f"draft {path}: {gguf_name} has shape {list(value.shape)}, but this run's "
                                 f"draft needs {list(state[name].shape)}")
            state[name].copy_(torch.tensor(value))
        for layer in model.layers[:n_new]:  # a zero residual branch: the new layer passes x through
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()

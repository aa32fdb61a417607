"""The DFlash draft in PyTorch, written for training: many blocks of one sequence in one pass.

Semantics as docs/dflash.md states them (and as the fork computes them): context rows are
c_p = RMSNorm(W_fc f_p); each layer's keys and values are the same projections of the context
rows and of the block's own rows, keys RMS-normed per head and rotated (NeoX) at their absolute
positions; one mask rule per layer type. Where the reference feeds one block at a time, training
feeds A blocks of one sequence at once: block i (anchor a_i) sees context rows p < a_i and its own
rows, never another block's.

A DFlash2 draft (cfg.dflash2) adds, in every layer, a causal convolution over each block's rows
around attention and around the MLP, and the candidate selector after the head (docs/dflash.md).
A DSpark draft (cfg.dspark) adds a confidence head, and a Markov head with a rank.

The checkpoint this writes (config.json + model.safetensors) is a DFlashDraftModel (or
DFlash2DraftModel) that the reference package loads and `ikdflash convert` turns into a GGUF; a
DSpark draft's is in SpecForge's layout, which the converter reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence, cast

import gguf
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ikdflash.convert import DFLASH1_LAYOUT, DFLASH2_LAYOUT, Layout, global_tensors, layer_tensors
from ikdflash.gguf_files import open_gguf, read_draft_header, tensor_values
from ikdflash.sources.dspark_layouts import DSPARK_TENSORS
from ikdflash.sources.hf import write_tensors


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
    # DFlash2: conv_kernel_size, conv_group_size, selector_rank, selector_top_k (None: DFlash1)
    dflash2: dict[str, int] | None = None
    # DSpark: markov_rank (0: no Markov head); it always has a confidence head (None: not DSpark)
    dspark: dict[str, int] | None = None

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    def __post_init__(self) -> None:
        if self.dflash2 and self.dspark:
            raise ValueError("a draft is DFlash2 or DSpark, not both")
        if self.dspark and self.dspark["markov_rank"] < 0:
            raise ValueError(f"--markov-rank must be at least 0, got {self.dspark['markov_rank']}")
        if self.dflash2 and self.hidden_size % self.dflash2["conv_group_size"]:
            raise ValueError(f"--conv-group-size {self.dflash2['conv_group_size']} does not divide the hidden size "
                             f"{self.hidden_size}")

    def sliding(self, il: int) -> bool:
        return self.layer_types[il] == "sliding_attention"

    def hf_config(self) -> dict:
        """config.json of a DFlashDraftModel (qwen3 layers), as the reference reads it; a DSpark
        draft's in SpecForge's layout (DSpark's settings in dflash_config)."""
        arch = "DFlash2DraftModel" if self.dflash2 else "DSparkDraftModel" if self.dspark else "DFlashDraftModel"
        return {
            "architectures": [arch], "model_type": "qwen3",
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
                              **({"head_token_ids": self.head_token_ids} if self.head_token_ids else {}),
                              **(self.dflash2 or {}), **self._dspark_settings()},
            "ikdflash_train": self.extra,
        }

    def _dspark_settings(self) -> dict:
        if not self.dspark:
            return {}
        rank = self.dspark["markov_rank"]
        return {"projector_type": "dspark", "markov_rank": rank, "markov_head_type": "vanilla",
                "enable_confidence_head": True, "confidence_head_with_markov": rank > 0}

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


class BlockConv(nn.Module):
    """DFlash2's convolution around a sublayer: row t of a block becomes the sum over taps j of
    (base_kernel[stage, j] + that row's dynamic tap for j and its channel group) * row t - j, rows
    before the block's first counting as zeros. Stage 0 (prepare) convolves the sublayer's normed
    input and also returns the dynamic taps of stage 1 (finish), which convolves its output; both
    stages' taps are projected from the normed input. It starts as the identity (tap 0 is 1, the
    rest and the projection 0): a DFlash1 draft grown into DFlash2 computes what it did."""

    def __init__(self, hidden: int, taps: int, group: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.group, self.block_size = taps, group, block_size
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        taps = self.kernel_projection(x).unflatten(-1, (2, self.taps, -1))  # [S, A*B, 2, taps, groups]
        return self._convolve(x, taps[:, :, 0], 0), taps[:, :, 1]

    def finish(self, x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, taps, 1)

    def _convolve(self, x: torch.Tensor, taps: torch.Tensor, stage: int) -> torch.Tensor:
        S, QB, d = x.shape
        B, groups = self.block_size, d // self.group
        rows = x.view(S, QB // B, B, groups, self.group)
        taps = taps.reshape(S, QB // B, B, self.taps, groups, 1)
        out = torch.zeros_like(rows)
        for j in range(min(self.taps, B)):
            shifted = rows if j == 0 else F.pad(rows[:, :, :-j], (0, 0, 0, 0, j, 0))
            out = out + self.base_kernel[stage, j].view(groups, self.group) * shifted
            out = out + taps[:, :, :, j] * shifted
        return out.view(S, QB, d)


class CandidateSelector(nn.Module):
    """DFlash2's selector: a candidate's score is its logit plus
    <predecessor_codebook[previous token] * hidden_projection(h), successor_codebook[candidate]>.
    The successor codebook starts at 0, so the selector first keeps each row's best logit, and
    the other two start at random, so that the codebook's first gradients are not 0."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        assert cfg.dflash2 is not None
        rank = cfg.dflash2["selector_rank"]
        self.top_k = cfg.dflash2["selector_top_k"]
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)
        nn.init.normal_(self.predecessor_codebook.weight, std=0.02)
        nn.init.zeros_(self.successor_codebook.weight)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def pair_scores(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The bilinear term for rows hidden [N, d] after tokens previous [N], of candidates [N, K]."""
        query = self.predecessor_codebook(previous) * self.hidden_projection(hidden)
        return torch.einsum("nr,nkr->nk", query, self.successor_codebook(candidates))


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
        self.attention_conv: BlockConv | None = None
        self.mlp_conv: BlockConv | None = None
        if cfg.dflash2:
            taps, group = cfg.dflash2["conv_kernel_size"], cfg.dflash2["conv_group_size"]
            self.attention_conv = BlockConv(d, taps, group, cfg.block_size)
            self.mlp_conv = BlockConv(d, taps, group, cfg.block_size)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, block_pos: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """x [S, A*B, d] block rows; ctx [S, L, d] context rows at positions 0..L-1;
        block_pos [S, A*B] positions; anchors [S, A] (-1: an unused block)."""
        cfg = self.cfg
        S, QB, _ = x.shape
        L = ctx.shape[1]
        hd, h, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        a = self.input_layernorm(x)
        if self.attention_conv is not None:
            a, attention_taps = self.attention_conv.prepare(a)
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
        attn_out = self.o_proj(attn.transpose(1, 2).reshape(S, QB, h * hd))
        if self.attention_conv is not None:
            attn_out = self.attention_conv.finish(attn_out, attention_taps)
        x = x + attn_out
        n = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            n, mlp_taps = self.mlp_conv.prepare(n)
        mlp_out = self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))
        if self.mlp_conv is not None:
            mlp_out = self.mlp_conv.finish(mlp_out, mlp_taps)
        return x + mlp_out


class DraftModel(nn.Module):
    """Trainable draft; the target's embedding and head are frozen buffers, borrowed as the fork
    borrows them."""

    embedding: torch.Tensor
    head: torch.Tensor

    def __init__(self, cfg: DraftConfig, embedding: np.ndarray, head: np.ndarray) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg, il) for il in range(cfg.n_layer))
        self.decoder_layers = cast(list[Layer], list(self.layers))  # typed: ModuleList yields Modules
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.register_buffer("embedding", torch.tensor(np.asarray(embedding, dtype=np.float32)), persistent=False)
        self.register_buffer("head", torch.tensor(np.asarray(head, dtype=np.float32)), persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        for layer in self.decoder_layers:  # the convolutions start as the identity (BlockConv)
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    nn.init.zeros_(conv.kernel_projection.weight)
        # made after the loop above: their own initialisation stands
        self.candidate_selector = CandidateSelector(cfg) if cfg.dflash2 else None
        rank = cfg.dspark["markov_rank"] if cfg.dspark else 0
        self.markov_head = MarkovHead(cfg.vocab_size, rank) if rank else None
        self.confidence_head = ConfidenceHead(d + rank) if cfg.dspark else None

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


class MarkovHead(nn.Module):
    """DSpark's low-rank bias on a row's logits from the token before it: W2 . W1[previous]. W2
    starts at 0, so a grown draft first proposes what it did; W1 at random, so that W2's first
    gradients are not 0."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """DSpark's estimate that the target keeps a row's token: a logit from the row's hidden state
    (and its previous token's W1 row with a Markov head); it starts at 0, a probability of 1/2."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)


def reference_name(name: str) -> str:
    """A weight's name in the reference model: our modules drop its "self_attn." and "mlp." levels,
    and its checkpoints name the selector's codebooks without ".weight"."""
    if name.startswith("candidate_selector.") and name.endswith("_codebook.weight"):
        return name.removesuffix(".weight")
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
    """'last-full': sliding on every layer but the last (as the released SWA draft); 'all-sliding'."""
    if layout == "last-full":
        return ["sliding_attention"] * (n_layer - 1) + ["full_attention"]
    if layout == "all-sliding":
        return ["sliding_attention"] * n_layer
    raise ValueError(f"layout must be 'last-full' or 'all-sliding', got {layout!r}")


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


def is_dflash2_weight(name: str) -> bool:
    return "_conv." in name or name.startswith("candidate_selector.")


def is_dspark_weight(name: str) -> bool:
    return name.startswith(("markov_head.", "confidence_head."))


@dataclass
class DraftFile:
    """What a draft GGUF says of itself, in either layout (as the fork reads it)."""

    reader: gguf.GGUFReader
    layout: Layout
    n_layer: int
    sliding: list[bool]
    target_layer_ids: list[int]
    mask_token_id: int
    head_token_ids: list[int] | None
    dflash2: dict[str, int] | None


def read_draft_file(path: str | Path) -> DraftFile:
    reader = open_gguf(path, "draft")
    header = read_draft_header(reader, path)
    if header.mask_token_id is None:
        raise ValueError(f"draft {path}: no mask token id")
    return DraftFile(reader=reader, layout=DFLASH1_LAYOUT if header.arch == DFLASH1_LAYOUT.arch else DFLASH2_LAYOUT,
                     n_layer=header.n_layer, sliding=header.sliding, target_layer_ids=header.target_layer_ids,
                     mask_token_id=header.mask_token_id, head_token_ids=header.head_token_ids, dflash2=header.dflash2)


def init_from_draft(model: DraftModel, path: str | Path) -> None:
    """Start every trainable weight from an existing draft GGUF of the same configuration: to
    go on training a shipped draft (Q8_0 is close enough to its floats) on a fork whose target
    states changed. A draft with fewer layers grows: its layers become this model's top ones, and
    the layers below keep their weights (e.g. the target's) with their output projections zeroed, so
    the grown draft starts out computing exactly what the smaller one does. ValueError naming what
    differs when the file is not a draft this model can start from. A draft reading some of this
    model's target layers starts it too: the features of the others start with weight 0. Its window
    may differ from this model's (no weight depends on it): a draft widening its window starts out
    seeing context it never learnt from, so expect a dip before training pays. Its head's cut, if
    any, becomes the model's cfg.head_token_ids (training keeps it when asked for as many ids). A
    DFlash1 draft starts a DFlash2 model too: its convolutions and selector keep their neutral
    start (BlockConv, CandidateSelector), so it proposes what the DFlash1 draft did, and a DSpark
    model too: heads the file lacks keep theirs (MarkovHead, ConfidenceHead)."""
    source = read_draft_file(path)
    cfg = model.cfg
    n_theirs = source.n_layer
    if n_theirs > cfg.n_layer:
        raise ValueError(f"draft {path}: {n_theirs} layers, more than this run's draft has ({cfg.n_layer})")
    n_new = cfg.n_layer - n_theirs
    ours_sliding = [cfg.sliding(il) for il in range(n_new, cfg.n_layer)]
    their_ids = source.target_layer_ids
    # a draft reading some of this run's target layers starts it: the others' features weigh 0
    reads_ours = set(their_ids) <= set(cfg.target_layer_ids)
    header = {"target layer ids": (their_ids if not reads_ours else list(cfg.target_layer_ids),
                                   list(cfg.target_layer_ids)),
              "mask token": (source.mask_token_id, cfg.mask_token_id),
              "sliding layers": (source.sliding, ours_sliding),
              # a DFlash1 draft grows into DFlash2 (its convolutions and selector start neutral)
              "DFlash2 settings": (source.dflash2, cfg.dflash2 if source.dflash2 else None)}
    for what, (theirs, ours) in header.items():
        if theirs != ours:
            where = f" (its top {n_theirs})" if n_new and what == "sliding layers" else ""
            raise ValueError(f"draft {path}: {what} {theirs}, but this run's draft{where} has {ours}")
    cfg.head_token_ids = source.head_token_ids
    # their layer il is our layer il + n_new
    layout, dflash2 = source.layout, source.dflash2 is not None
    gguf_names = global_tensors(layout, dflash2) | {
        f"layers.{il + n_new}.{hf}": f"blk.{il}.{gguf_name}"
        for il in range(n_theirs) for hf, gguf_name in layer_tensors(layout, dflash2).items()}
    found = {t.name: t for t in source.reader.tensors}
    # a draft without DSpark's heads (or some of them) grows: those it lacks keep their neutral start
    gguf_names |= {hf: name for hf, name in DSPARK_TENSORS.items() if name in found}
    state = model.state_dict()
    new_layers = tuple(f"layers.{il}." for il in range(n_new))
    ours_by_gguf = {gguf_names[reference_name(name)]: name for name in state
                    if not name.startswith(new_layers) and (dflash2 or not is_dflash2_weight(name))
                    and (not is_dspark_weight(name) or reference_name(name) in gguf_names)}
    missing = sorted(set(ours_by_gguf) - set(found))
    if missing:
        raise ValueError(f"draft {path}: no tensor {', '.join(missing[:3])}")
    with torch.no_grad():
        for gguf_name, name in ours_by_gguf.items():
            value = tensor_values(found[gguf_name])
            if name == "fc.weight" and their_ids != list(cfg.target_layer_ids):
                value = _spread_columns(value, their_ids, list(cfg.target_layer_ids))
            if tuple(value.shape) != tuple(state[name].shape):
                raise ValueError(f"draft {path}: {gguf_name} has shape {list(value.shape)}, but this run's "
                                 f"draft needs {list(state[name].shape)}")
            state[name].copy_(torch.tensor(value))
        for layer in model.decoder_layers[:n_new]:  # a zero residual branch: the new layer passes x through
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()

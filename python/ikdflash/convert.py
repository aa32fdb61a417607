"""Convert a Hugging Face DFlash draft into a GGUF: a DFlash1 draft into ik_llama.cpp's
`dflash-draft` layout, a DFlash2 draft into the flat `dflash` layout that ik_llama.cpp and
llama.cpp read DFlash2 drafts in.

    from ikdflash.convert import convert
    gguf_path = convert("draft-hf/", "target.gguf", outtype="q8_0")   # `ikdflash convert` on the command line

DRAFT_DIR holds config.json (architecture DFlashDraftModel or DFlash2DraftModel, or a DSpark draft
from speculators or SpecForge: sources/dspark_layouts.py) and safetensors weights. TARGET is
the target's Hugging Face folder (config.json + tokenizer.json) or its GGUF file: the draft reads
the target's tokenizer, hidden size and layer count from it.

The file is what ik_llama.cpp itself writes (docs/gguf.md), with two corrections and
four additions:
  * the RoPE base is read wherever the config keeps it (top-level rope_theta or
    rope_parameters.rope_theta; ik's converter silently falls back to 10000 for the latter);
  * sliding layers come from layer_types exactly (ik marks every layer sliding without it);
  * settings the reference honours but ik's format drops go into optional keys, absent when the
    config does not state them, so files without them load with the reference defaults:
    {arch}.dflash.is_causal, .input_embedding_scale, .output_multiplier,
    .final_logit_softcapping.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import gguf

from ikdflash import pausepoint
from ikdflash.sources.hf import CheckpointError, read_config, read_json_object, read_tensors, text_config
from ikdflash.gguf_files import DFLASH2_SETTINGS, gguf_field
from ikdflash.sources import dspark_layouts
from ikdflash.sources.dspark_layouts import DSPARK_TENSORS, DsparkSettings

OUTTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    # a smaller, cheaper draft step; the built-in draft keeps its held-out acceptance in it (docs/benchmarks.md)
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
}
MAX_TARGET_LAYERS = 8  # what ik_llama.cpp's loader accepts

@dataclass(frozen=True)
class Layout:
    """How a GGUF layout names the draft: its architecture and the names that differ."""

    arch: str
    fc: str
    hidden_norm: str
    ffn_norm: str


DFLASH1_LAYOUT = Layout("dflash-draft", "dflash_fc.weight", "dflash_hidden_norm.weight", "post_attention_norm.weight")
DFLASH2_LAYOUT = Layout("dflash", "fc.weight", "enc.output_norm.weight", "ffn_norm.weight")

# Hugging Face name (after dropping a leading "model.") -> GGUF name, per layer and global; the
# names a layout sets are filled in by layer_tensors and global_tensors.
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
DFLASH2_LAYER_TENSORS = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
# the reference's checkpoints name the codebooks without ".weight"; a re-saved model may add it
DFLASH2_TENSORS = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.predecessor_codebook.weight": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.successor_codebook.weight": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
F32_TENSORS = ("attn_conv_base", "ffn_conv_base",  # 3-D, kept F32 as ik_llama.cpp writes them
               "conf_proj.weight")  # one row: DSpark's confidence head
OPTIONAL_TENSORS = {"embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


class ConversionError(ValueError):
    """The checkpoint cannot be expressed as a dflash-draft GGUF; the message says why."""




@dataclass
class Dflash2Settings:
    """A DFlash2 draft's in-block convolutions and candidate selector."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass
class DraftHeader:
    """Every value the GGUF header carries, resolved from the draft's config."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    context_length: int
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    n_target_features: int
    sliding_window: int = 0
    sliding_pattern: list[bool] = field(default_factory=list)
    # Reference-only settings; None = not stated in the config (reference default applies).
    is_causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    # ikdflash's own: the ids the draft's head scores (those it was trained on), None = all
    head_token_ids: list[int] | None = None
    dflash2: Dflash2Settings | None = None
    # a DSpark layout's settings and heads (speculators' or SpecForge's; None: z-lab's DFlash)
    dspark: DsparkSettings | None = None

    @property
    def layout(self) -> Layout:
        return DFLASH2_LAYOUT if self.dflash2 else DFLASH1_LAYOUT


def layer_tensors(layout: Layout, dflash2: bool = False) -> dict[str, str]:
    """A layer's weights (HF name after "layers.N." -> GGUF name after "blk.N.")."""
    names = LAYER_TENSORS | {"post_attention_layernorm.weight": layout.ffn_norm}
    return names | DFLASH2_LAYER_TENSORS if dflash2 else names


def global_tensors(layout: Layout, dflash2: bool = False) -> dict[str, str]:
    """Required weights outside the layers (HF name -> GGUF name)."""
    names = {"fc.weight": layout.fc, "hidden_norm.weight": layout.hidden_norm, "norm.weight": "output_norm.weight"}
    return names | DFLASH2_TENSORS if dflash2 else names

@dataclass
class TargetInfo:
    hidden_size: int
    n_layer: int
    n_vocab: int
    tokenizer: dict[str, Any]  # GGUF tokenizer.* key -> value


# --- reading the draft config ------------------------------------------------------------------

# What the fork's draft loader accepts (cpp/dflash/dflash-draft-load.cpp); a checkpoint outside these
# would convert into a file that cannot load, so it is refused here with the config key named.
MAX_LAYERS = 64
MAX_WIDTH = 1 << 16      # embedding, feed-forward, heads x head size
MAX_HEADS = 1024
MAX_BLOCK = 256
MAX_CONV_TAPS = 16
INT32_MAX = 2**31 - 1


def _draft_value(config: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """The reference's lookup: dflash_config first, then the top level."""
    nested = config.get("dflash_config")
    if isinstance(nested, dict) and name in nested:
        return nested[name]
    return config.get(name, default)


def _integer(value: Any, name: str, where: str, lo: int, hi: int) -> int:
    """A config integer in lo..hi; JSON true/false, strings and fractions are refused."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise ConversionError(f"{where}: '{name}' must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConversionError(f"{where}: '{name}' is {value}, outside {lo}..{hi}")
    return value


FLOAT32_MAX = float(np.finfo(np.float32).max)  # the header stores floats as F32


def _number(value: Any, name: str, where: str, *, positive: bool = False) -> float:
    if (type(value) not in (int, float) or not math.isfinite(value) or abs(value) > FLOAT32_MAX
            or (positive and value <= 0)):
        kind = "a positive 32-bit float" if positive else "a finite 32-bit float"
        raise ConversionError(f"{where}: '{name}' must be {kind}, got {value!r}")
    return float(value)


def _section(config: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    """An optional nested object (rope_scaling, rope_parameters): absent or null is empty."""
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConversionError(f"{where}: '{name}' must be an object, got {value!r}")
    return value


def _head_token_ids(config: Mapping[str, Any], n_vocab: int, where: str) -> list[int] | None:
    """dflash_config.head_token_ids: increasing ids in the target's vocabulary."""
    ids = _draft_value(config, "head_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not 1 <= len(ids) <= n_vocab:
        raise ConversionError(f"{where}: 'head_token_ids' must be a list of 1..{n_vocab} token ids")
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < n_vocab or (i and t <= ids[i - 1]):
            raise ConversionError(f"{where}: 'head_token_ids' entry {i} ({t!r}) is not a token id of the "
                                  f"target ({n_vocab} tokens) above the one before it")
    return ids


def _rope_theta(config: Mapping[str, Any], where: str) -> float:
    if "rope_theta" in config:
        return _number(config["rope_theta"], "rope_theta", where, positive=True)
    params = _section(config, "rope_parameters", where)
    if "rope_theta" in params:
        return _number(params["rope_theta"], "rope_parameters.rope_theta", where, positive=True)
    return 10000.0  # transformers' Qwen3 default when neither is given


def _check_rope_scaling(config: Mapping[str, Any], where: str) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        params = _section(config, key, where)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", None):
            raise ConversionError(f"{where}: {key} type {kind!r} is not supported (only plain RoPE)")
    factor = _number(config.get("partial_rotary_factor", 1.0), "partial_rotary_factor", where)
    if factor != 1.0:
        raise ConversionError(f"{where}: partial_rotary_factor={factor} is not supported")


def _layer_ids(config: Mapping[str, Any], target: TargetInfo, where: str) -> list[int]:
    layer_ids = _draft_value(config, "target_layer_ids")
    if layer_ids is None:
        raise ConversionError(f"{where}: missing required key 'target_layer_ids' (in dflash_config or top level)")
    if not isinstance(layer_ids, list) or not 1 <= len(layer_ids) <= MAX_TARGET_LAYERS:
        raise ConversionError(f"{where}: target_layer_ids must be a list of 1..{MAX_TARGET_LAYERS} layer ids")
    layer_ids = [_integer(i, "target_layer_ids", where, 0, INT32_MAX) for i in layer_ids]
    if len(set(layer_ids)) != len(layer_ids):
        raise ConversionError(f"{where}: target_layer_ids {layer_ids} must be distinct")
    bad = [i for i in layer_ids if i >= target.n_layer]
    if bad:
        raise ConversionError(f"{where}: target_layer_ids {bad} are outside the target's {target.n_layer} layers")
    return layer_ids


def _sliding_layers(config: Mapping[str, Any], n_layer: int, where: str) -> tuple[int, list[bool]]:
    """(window, per-layer sliding flags); (0, []) for a draft without sliding layers."""
    layer_types = config.get("layer_types") or ["full_attention"] * n_layer
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ConversionError(f"{where}: layer_types must be a list of strings")
    if len(layer_types) != n_layer:
        raise ConversionError(f"{where}: layer_types has {len(layer_types)} entries for {n_layer} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConversionError(f"{where}: unsupported layer_types {unknown}")
    pattern = [t == "sliding_attention" for t in layer_types]
    if not any(pattern):
        return 0, []
    window = _integer(config.get("sliding_window") or 0, "sliding_window", where, 0, INT32_MAX)
    if window < 1:
        raise ConversionError(f"{where}: layer_types has sliding layers but sliding_window is not set")
    return window, pattern


def _dflash2_settings(config: Mapping[str, Any], n_embd: int, n_vocab: int, where: str) -> Dflash2Settings:
    def integer(name: str, hi: int) -> int:
        value = _draft_value(config, name)
        if value is None:
            raise ConversionError(f"{where}: missing required key '{name}' (a DFlash2DraftModel has it)")
        return _integer(value, name, where, 1, hi)

    settings = Dflash2Settings(conv_kernel_size=integer("conv_kernel_size", MAX_CONV_TAPS),
                               conv_group_size=integer("conv_group_size", n_embd),
                               selector_rank=integer("selector_rank", MAX_WIDTH),
                               selector_top_k=integer("selector_top_k", n_vocab))
    if n_embd % settings.conv_group_size:
        raise ConversionError(f"{where}: 'conv_group_size' is {settings.conv_group_size}, which does not divide "
                              f"hidden_size {n_embd}")
    return settings


def read_draft_header(config: Mapping[str, Any], target: TargetInfo, where: str) -> DraftHeader:
    config, dspark = dspark_layouts.read(config, where, ConversionError)
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not {"DFlashDraftModel", "DFlash2DraftModel"} & set(archs):
        raise ConversionError(f"{where}: architecture {archs or 'unknown'} is not supported "
                              "(expected DFlashDraftModel or DFlash2DraftModel)")
    if config.get("attention_bias"):
        raise ConversionError(f"{where}: attention_bias=true is not supported by the dflash-draft format")
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    _check_rope_scaling(config, where)

    def integer(name: str, lo: int, hi: int, default: Any = None) -> int:
        value = config.get(name)
        value = default if value is None else value
        if value is None:
            raise ConversionError(f"{where}: missing required key '{name}'")
        return _integer(value, name, where, lo, hi)

    n_layer = integer("num_hidden_layers", 1, MAX_LAYERS)
    n_embd = integer("hidden_size", 1, MAX_WIDTH)
    n_head = integer("num_attention_heads", 1, MAX_HEADS)
    n_head_kv = integer("num_key_value_heads", 1, n_head, default=n_head)
    if n_head % n_head_kv:
        raise ConversionError(f"{where}: num_attention_heads {n_head} is not a multiple of "
                              f"num_key_value_heads {n_head_kv}")
    head_dim = integer("head_dim", 1, MAX_WIDTH, default=max(1, n_embd // n_head))
    if n_head * head_dim > MAX_WIDTH:
        raise ConversionError(f"{where}: {n_head} heads of {head_dim} exceed {MAX_WIDTH}")
    layer_ids = _layer_ids(config, target, where)
    mask_token_id = _draft_value(config, "mask_token_id")
    if mask_token_id is None:
        raise ConversionError(f"{where}: missing required key 'mask_token_id'")
    mask_token_id = _integer(mask_token_id, "mask_token_id", where, 0, INT32_MAX)
    if mask_token_id >= target.n_vocab:
        raise ConversionError(f"{where}: mask_token_id {mask_token_id} is outside the target vocabulary "
                              f"({target.n_vocab} tokens)")
    block_size = _integer(_draft_value(config, "block_size", 16), "block_size", where, 2, MAX_BLOCK)
    window, pattern = _sliding_layers(config, n_layer, where)
    is_causal = config.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise ConversionError(f"{where}: 'is_causal' must be true or false, got {is_causal!r}")

    def optional_float(name: str) -> float | None:
        value = _draft_value(config, name)
        return None if value is None else _number(value, name, where)

    return DraftHeader(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ff=integer("intermediate_size", 1, MAX_WIDTH),
        rms_eps=_number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", where, positive=True),
        context_length=integer("max_position_embeddings", 0, INT32_MAX, default=32768),
        rope_theta=_rope_theta(config, where),
        block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=layer_ids,
        n_target_features=target.hidden_size * len(layer_ids),
        sliding_window=window, sliding_pattern=pattern,
        is_causal=is_causal,
        input_embedding_scale=optional_float("input_embedding_scale"),
        output_multiplier=optional_float("output_multiplier"),
        final_logit_softcapping=optional_float("final_logit_softcapping"),
        head_token_ids=_head_token_ids(config, target.n_vocab, where),
        dflash2=(_dflash2_settings(config, n_embd, target.n_vocab, where)
                 if "DFlash2DraftModel" in archs else None),
        dspark=dspark,
    )


# --- reading the target ------------------------------------------------------------------------

MAX_VOCAB = 1 << 24  # token ids above this are a corrupt tokenizer, not a vocabulary


def _bpe_tokenizer_from_hf(folder: Path, vocab_size: int) -> dict[str, Any]:
    """The target's byte-level BPE tokenizer as GGUF keys; the token list is padded with [PAD]
    entries up to the config's vocab_size, as the target's own GGUF is."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found; the draft takes its tokenizer from the target")
    tok = read_json_object(path)
    model = tok.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConversionError(f"{path}: tokenizer type {kind} is not supported (only byte-level BPE)")
    vocab, special = model.get("vocab"), set()
    added = tok.get("added_tokens", [])
    if not isinstance(vocab, dict) or not isinstance(added, list) or not all(isinstance(a, dict) for a in added):
        raise ConversionError(f"{path}: model.vocab must be an object and added_tokens a list of objects")
    vocab = dict(vocab)
    for token in added:
        vocab[token.get("content")] = token.get("id")
        if token.get("special"):
            special.add(token.get("id"))
    bad = next(((t, i) for t, i in vocab.items()
                if not isinstance(t, str) or type(i) is not int or not 0 <= i < MAX_VOCAB), None)
    if bad or not vocab:
        raise ConversionError(f"{path}: token {bad!r} is not a string with an id in 0..{MAX_VOCAB - 1}"
                              if bad else f"{path}: the vocabulary is empty")
    n_vocab = max(max(vocab.values()) + 1, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, idx in vocab.items():
        tokens[idx] = text
        types[idx] = gguf.TokenType.CONTROL if idx in special else gguf.TokenType.NORMAL
    merges = model.get("merges", [])
    if not isinstance(merges, list):
        raise ConversionError(f"{path}: model.merges must be a list")
    merges = [m if isinstance(m, str) else " ".join(map(str, m)) for m in merges]
    result: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": merges,
    }
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = read_json_object(tok_config_path) if tok_config_path.is_file() else {}
    for role in ("bos", "eos", "pad"):
        name = tok_config.get(f"{role}_token")
        if isinstance(name, dict):
            name = name.get("content")
        if isinstance(name, str) and name in vocab:
            result[f"tokenizer.ggml.{role}_token_id"] = vocab[name]
    if "add_bos_token" in tok_config:
        result["tokenizer.ggml.add_bos_token"] = bool(tok_config["add_bos_token"])
    return result


def _target_from_gguf(target: Path) -> TargetInfo:
    try:
        reader = gguf.GGUFReader(target)
        arch = gguf_field(reader, "general.architecture")
        tokenizer = {k: gguf_field(reader, k) for k in reader.fields if k.startswith("tokenizer.")}
        hidden = gguf_field(reader, f"{arch}.embedding_length")
        n_layer = gguf_field(reader, f"{arch}.block_count")
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ConversionError(f"{target}: not a readable GGUF model: {e}") from None
    tokens = tokenizer.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConversionError(f"{target}: the GGUF has no tokenizer")
    return TargetInfo(hidden_size=_integer(hidden, "embedding_length", str(target), 1, MAX_WIDTH),
                      n_layer=_integer(n_layer, "block_count", str(target), 1, INT32_MAX),
                      n_vocab=len(tokens), tokenizer=tokenizer)


def read_target(target: Path) -> TargetInfo:
    if not target.exists():
        raise ConversionError(f"target {target} does not exist (give the target's HF folder or GGUF file)")
    if target.is_file():
        return _target_from_gguf(target)
    where = f"{target}/config.json"
    try:
        config = text_config(read_config(target))
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if not isinstance(config, dict):
        raise ConversionError(f"{where}: text_config must be an object")
    if config.get("hidden_size") is None:
        raise ConversionError(f"{where}: no hidden_size (needed for the draft's feature width)")
    hidden = _integer(config["hidden_size"], "hidden_size", where, 1, MAX_WIDTH)
    n_layer = _integer(config.get("num_hidden_layers", 0), "num_hidden_layers", where, 0, INT32_MAX)
    vocab_size = _integer(config.get("vocab_size", 0), "vocab_size", where, 0, MAX_VOCAB)
    tokenizer = _bpe_tokenizer_from_hf(target, vocab_size)
    return TargetInfo(hidden_size=hidden, n_layer=n_layer, n_vocab=len(tokenizer["tokenizer.ggml.tokens"]),
                      tokenizer=tokenizer)


# --- tensors -----------------------------------------------------------------------------------

def expected_shapes(header: DraftHeader, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> the Hugging Face shape (rows, cols) every weight must have."""
    q, kv, e, ff = header.n_head * header.head_dim, header.n_head_kv * header.head_dim, header.n_embd, header.n_ff
    per_layer = {
        "attn_norm.weight": (e,),
        "attn_q.weight": (q, e), "attn_k.weight": (kv, e), "attn_v.weight": (kv, e),
        "attn_output.weight": (e, q), "attn_q_norm.weight": (header.head_dim,),
        "attn_k_norm.weight": (header.head_dim,),
        "ffn_gate.weight": (ff, e), "ffn_up.weight": (ff, e), "ffn_down.weight": (e, ff),
    }
    per_layer[header.layout.ffn_norm] = (e,)
    shapes = {header.layout.fc: (e, header.n_target_features), header.layout.hidden_norm: (e,),
              "output_norm.weight": (e,), "token_embd.weight": (n_vocab, e), "output.weight": (n_vocab, e)}
    if header.dflash2:
        taps, rank = header.dflash2.conv_kernel_size, header.dflash2.selector_rank
        n_dynamic = 2 * taps * (e // header.dflash2.conv_group_size)
        for conv in ("attn", "ffn"):
            per_layer |= {f"{conv}_conv_base": (2, taps, e), f"{conv}_conv_proj.weight": (n_dynamic, e)}
        shapes |= {"selector_predecessor.weight": (n_vocab, rank), "selector_successor.weight": (n_vocab, rank),
                   "selector_hidden.weight": (rank, e)}
    if header.dspark:
        shapes |= header.dspark.tensor_shapes(e, n_vocab)
    for il in range(header.n_layer):
        shapes |= {f"blk.{il}.{name}": shape for name, shape in per_layer.items()}
    return shapes


def map_tensors(weights: Mapping[str, np.ndarray], header: DraftHeader, n_vocab: int,
                where: str) -> dict[str, np.ndarray]:
    """HF names -> GGUF names, checking that every expected weight is there with its shape, and
    nothing else."""
    out: dict[str, np.ndarray] = {}
    unknown: list[str] = []
    dflash2 = header.dflash2 is not None
    per_layer, outside = layer_tensors(header.layout, dflash2), global_tensors(header.layout, dflash2)
    if header.dspark:
        heads = header.dspark.tensor_shapes(header.n_embd, n_vocab)
        outside |= {hf: name for hf, name in DSPARK_TENSORS.items() if name in heads}
    for hf_name, array in weights.items():
        name = hf_name.removeprefix("model.")
        layer = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        gguf_name: str | None
        if layer and layer.group(2) in per_layer and int(layer.group(1)) < header.n_layer:
            gguf_name = f"blk.{int(layer.group(1))}.{per_layer[layer.group(2)]}"
        else:
            gguf_name = outside.get(name, OPTIONAL_TENSORS.get(name))
        if gguf_name is None:
            unknown.append(hf_name)
        elif gguf_name in out:
            raise ConversionError(f"{where}: {hf_name} is a second copy of {gguf_name}")
        else:
            out[gguf_name] = array
    if unknown:
        raise ConversionError(f"{where}: weights the {header.layout.arch} format cannot hold: "
                              f"{', '.join(sorted(unknown))}")
    expected = sorted(set(outside.values())) + [f"blk.{i}.{t}" for i in range(header.n_layer)
                                                 for t in per_layer.values()]
    missing = [n for n in expected if n not in out]
    if missing:
        raise ConversionError(f"{where}: missing weights: {', '.join(missing)}")
    if "output.weight" in out and "token_embd.weight" not in out:
        raise ConversionError(f"{where}: lm_head without embed_tokens is not a valid {header.layout.arch} layout")
    shapes = expected_shapes(header, n_vocab)
    for name, array in out.items():
        if array.shape != shapes[name]:
            raise ConversionError(f"{where}: {name} has shape {list(array.shape)}, expected {list(shapes[name])}"
                                  + _fc_hint(header) * (name == header.layout.fc))
        if array.dtype.kind != "f":
            raise ConversionError(f"{where}: {name} holds integers ({array.dtype}), expected floats")
    return out


def _fc_hint(header: DraftHeader) -> str:
    return (f" (hidden_size x target hidden size {header.n_target_features // len(header.target_layer_ids)} x "
            f"{len(header.target_layer_ids)} target layers)")


def encode_tensor(name: str, array: np.ndarray, outtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """1-D tensors (norms) and DFlash2's convolution bases stay F32, as ik's converter keeps them;
    matrices take the outtype."""
    qtype = OUTTYPES[outtype][0]
    if array.ndim <= 1 or name.endswith(F32_TENSORS) or qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), qtype
    if array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] != 0:
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16  # rows of whole blocks only
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


# --- writing -----------------------------------------------------------------------------------

def write_header(writer: gguf.GGUFWriter, header: DraftHeader, outtype: str) -> None:
    a = header.layout.arch
    writer.add_uint32(f"{a}.block_count", header.n_layer)
    writer.add_uint32(f"{a}.context_length", header.context_length)
    writer.add_uint32(f"{a}.embedding_length", header.n_embd)
    writer.add_uint32(f"{a}.feed_forward_length", header.n_ff)
    writer.add_uint32(f"{a}.attention.head_count", header.n_head)
    writer.add_uint32(f"{a}.attention.head_count_kv", header.n_head_kv)
    writer.add_uint32(f"{a}.attention.key_length", header.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", header.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", header.rms_eps)
    writer.add_float32(f"{a}.rope.freq_base", header.rope_theta)
    writer.add_uint32(f"{a}.rope.dimension_count", header.head_dim)
    writer.add_bool(f"{a}.attention.causal", False)  # as ik writes it; see dflash.is_causal
    writer.add_uint32("general.file_type", int(OUTTYPES[outtype][1]))
    if header.dflash2:
        _write_flat_keys(writer, header)
    else:
        writer.add_uint32(f"{a}.dflash.block_size", header.block_size)
        writer.add_uint32(f"{a}.dflash.mask_token_id", header.mask_token_id)
        writer.add_array(f"{a}.dflash.target_layer_ids", header.target_layer_ids)
        writer.add_uint32(f"{a}.dflash.n_target_features", header.n_target_features)
    if header.sliding_window:
        writer.add_uint32(f"{a}.attention.sliding_window", header.sliding_window)
        writer.add_array(f"{a}.attention.sliding_window_pattern", header.sliding_pattern)
    if header.is_causal is not None:
        writer.add_bool(f"{a}.dflash.is_causal", header.is_causal)
    for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        value = getattr(header, name)
        if value is not None:
            writer.add_float32(f"{a}.{_SCALE_KEYS[header.layout.arch][name]}", value)
    if header.head_token_ids is not None:
        writer.add_array(f"{a}.dflash.head_token_ids", header.head_token_ids)
    if header.dspark:
        writer.add_bool(f"{a}.dflash.sample_from_anchor", header.dspark.anchor_first)
        if header.dspark.window_from_block:
            writer.add_bool(f"{a}.dflash.window_from_block", True)


# The reference's settings, as each layout's keys name them (after "<arch>.").
_SCALE_KEYS = {
    "dflash-draft": {name: f"dflash.{name}" for name in
                     ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")},
    "dflash": {"input_embedding_scale": "embedding_scale", "output_multiplier": "logit_scale",
               "final_logit_softcapping": "final_logit_softcapping"},
}


def _write_flat_keys(writer: gguf.GGUFWriter, header: DraftHeader) -> None:
    """The flat layout's own keys: target layers numbered from 1 (the input of the layer after)
    and DFlash2's four settings. Its mask token is the tokenizer's (_write_gguf)."""
    assert header.dflash2 is not None
    writer.add_uint32("dflash.block_size", header.block_size)
    writer.add_array("dflash.target_layers", [i + 1 for i in header.target_layer_ids])
    for name in DFLASH2_SETTINGS:
        writer.add_uint32(f"dflash.{name}", getattr(header.dflash2, name))


def add_tokenizer_fields(writer: gguf.GGUFWriter, tokenizer: Mapping[str, Any]) -> None:
    for key, value in tokenizer.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif key == "tokenizer.ggml.token_type":
            writer.add_array(key, [int(v) for v in value])
        else:
            writer.add_array(key, list(value))


def _check_outfile(outfile: Path, inputs: Iterable[Path]) -> None:
    """The output must not replace what the conversion reads."""
    for path in inputs:
        if path.exists() and outfile.exists() and os.path.samefile(outfile, path):
            raise ConversionError(f"--outfile {outfile} is one of the inputs ({path}); choose another path")
    if outfile.is_dir():
        raise ConversionError(f"--outfile {outfile} is a folder; give a file path")
    if not outfile.parent.is_dir():
        raise ConversionError(f"--outfile {outfile}: folder {outfile.parent} does not exist")


def _write_gguf(outfile: Path, name: str, header: DraftHeader, outtype: str, tokenizer: Mapping[str, Any],
                tensors: Mapping[str, np.ndarray], log) -> None:
    """Written beside outfile under a temporary name and renamed into place, so an interrupted
    conversion never leaves a truncated draft (or a half-overwritten old one) at outfile."""
    fd, partial = tempfile.mkstemp(prefix=f".{outfile.name}.", suffix=".partial", dir=outfile.parent)
    os.close(fd)
    writer = gguf.GGUFWriter(partial, header.layout.arch)
    try:
        writer.add_string("general.name", name)
        write_header(writer, header, outtype)
        if header.dflash2:
            tokenizer = {**tokenizer, "tokenizer.ggml.mask_token_id": header.mask_token_id}
        add_tokenizer_fields(writer, tokenizer)
        writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
        for i, (tensor_name, array) in enumerate(tensors.items(), 1):
            data, qtype = encode_tensor(tensor_name, array, outtype)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
            log(f"[{i}/{len(tensors)}] {tensor_name:36s} {str(list(array.shape)):16s} {qtype.name}")
            pausepoint.reached("convert")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        os.unlink(partial)
        raise
    writer.close()
    os.replace(partial, outfile)


def convert(draft_dir: Path, target: Path, *, outtype: str = "f16", outfile: Path | None = None,
            log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Convert; returns the path written. Raises ConversionError with the reason."""
    draft_dir, target = Path(draft_dir), Path(target)
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype '{outtype}' (choose from {', '.join(OUTTYPES)})")
    if not draft_dir.is_dir():
        raise ConversionError(f"draft folder {draft_dir} does not exist")
    outfile = Path(outfile) if outfile else draft_dir / f"{draft_dir.name}-{outtype.upper()}.gguf"
    inputs = [target, *draft_dir.glob("*.json"), *draft_dir.glob("*.safetensors")]
    _check_outfile(outfile, inputs + ([*target.glob("*")] if target.is_dir() else []))
    try:
        config = read_config(draft_dir)
        target_info = read_target(target)
        header = read_draft_header(config, target_info, f"{draft_dir}/config.json")
        tensors = map_tensors(read_tensors(draft_dir), header, target_info.n_vocab, str(draft_dir))
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    _write_gguf(outfile, draft_dir.name, header, outtype, target_info.tokenizer, tensors, log)
    sliding = sum(header.sliding_pattern)
    log(f"wrote {outfile}: {header.n_layer} layers ({sliding} sliding, window {header.sliding_window}), "
        f"block {header.block_size}, target layers {header.target_layer_ids}")
    return outfile

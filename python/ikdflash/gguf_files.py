"""Reading GGUF files, headers first, in one place: the pair checks, conversion, chat and
training all read targets and drafts through here, so the rules by which the fork reads a file
(a draft's layer numbering, its sliding layers) are written once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

DRAFT_ARCHS = ("dflash-draft", "dflash")  # ik_llama.cpp's DFlash1 layout, llama.cpp's (and DFlash2)
DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_REQUIRED = object()


def open_gguf(path: str | os.PathLike[str], role: str) -> gguf.GGUFReader:
    """A GGUF header reader; FileNotFoundError / ValueError naming the file and its role."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{role} {path}: file not found")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{role} {path}: not a GGUF file (the file does not start with 'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises several kinds on a corrupt file
        raise ValueError(f"{role} {path}: corrupt GGUF: {e}") from None


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value of a GGUF header: default when the key is absent, KeyError without one."""
    field_ = reader.fields.get(key)
    if field_ is None:
        if default is _REQUIRED:
            raise KeyError(f"GGUF key '{key}' is missing")
        return default
    return field_.contents()


def matrix_type(reader: gguf.GGUFReader) -> str | None:
    """What a model is quantised to: the type most of its matrices have (Q4_K_M files mix a few)."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) > 1:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return max(counts, key=lambda name: counts[name]) if counts else None


def tensor_values(tensor: Any) -> Any:
    """A tensor of a GGUFReader as float32 numpy, in the row-major shape PyTorch uses."""
    import numpy as np
    from gguf.quants import dequantize

    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(
        [int(x) for x in reversed(tensor.shape)])


# --- drafts ---------------------------------------------------------------------------------------

@dataclass
class DraftHeader:
    """What a draft GGUF says of itself, in either layout, as the fork reads it."""

    arch: str
    n_layer: int
    block_size: int
    window: int
    sliding: list[bool]             # per layer
    target_layer_ids: list[int]     # counted from 0, whatever the file's own numbering
    mask_token_id: int | None
    n_target_features: int | None
    head_token_ids: list[int] | None
    dflash2: dict[str, int] | None  # DFLASH2_SETTINGS, for a DFlash2 draft
    anchor_first: bool = False      # the anchor's row proposes too (DSpark's default)

    @property
    def n_sliding(self) -> int:
        return sum(self.sliding)

    @property
    def max_proposal(self) -> int:
        """The most tokens one draft pass proposes."""
        return self.block_size - (not self.anchor_first)


MARKOV_W1 = "markov_w1.weight"  # a DSpark draft's Markov head (docs/gguf.md)


def read_draft_header(reader: gguf.GGUFReader, path: str | os.PathLike[str]) -> DraftHeader:
    """ValueError naming the file when it is not a DFlash draft."""
    arch = gguf_field(reader, "general.architecture", None)
    if arch not in DRAFT_ARCHS:
        raise ValueError(f"draft {path}: architecture '{arch}' is not a DFlash draft")

    def field(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    n_layer = int(field("block_count", 0))
    window = int(field("attention.sliding_window", 0))
    # no window, no sliding layer; a window without a pattern slides them all
    sliding = [window > 0 and bool(x) for x in field("attention.sliding_window_pattern", [True] * n_layer)]
    if arch == "dflash-draft":
        ids, mask = list(field("dflash.target_layer_ids", [])), field("dflash.mask_token_id")
        block = int(field("dflash.block_size", 16))
    else:  # llama.cpp's: files with the tokenizer's mask token number target layers from 1
        mask = gguf_field(reader, "tokenizer.ggml.mask_token_id", None)
        ids = [int(i) - (mask is not None) for i in field("target_layers", [])]
        mask = mask if mask is not None else field("mask_token_id")
        block = int(field("block_size", 16))
    head = field("dflash.head_token_ids")
    width = field("dflash.n_target_features")
    anchor_first = field(("dflash." if arch == "dflash-draft" else "") + "sample_from_anchor")
    if anchor_first is None:  # a Markov head without the key: DSpark, anchor-first by default
        anchor_first = any(t.name == MARKOV_W1 for t in reader.tensors)
    return DraftHeader(arch=arch, n_layer=n_layer, block_size=block, window=window, sliding=sliding,
                       target_layer_ids=[int(i) for i in ids], mask_token_id=None if mask is None else int(mask),
                       n_target_features=None if width is None else int(width),
                       head_token_ids=None if head is None else [int(i) for i in head],
                       dflash2={name: int(field(name)) for name in DFLASH2_SETTINGS} if field(DFLASH2_SETTINGS[0])
                       else None, anchor_first=bool(anchor_first))


# --- targets --------------------------------------------------------------------------------------

def target_shape(target: str | os.PathLike[str]) -> tuple[int, int, int]:
    """(layers, hidden size, vocabulary) from a target's header."""
    reader = open_gguf(target, "target")
    arch = gguf_field(reader, "general.architecture")
    return (int(gguf_field(reader, f"{arch}.block_count")), int(gguf_field(reader, f"{arch}.embedding_length")),
            len(gguf_field(reader, "tokenizer.ggml.tokens")))


def default_mask_token(target: str | os.PathLike[str]) -> int:
    """The token a new draft masks with: one named like a mask, else the last control token no
    other role uses."""
    reader = open_gguf(target, "target")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    named = [i for i, t in enumerate(tokens) if "mask" in t.lower() and t.startswith("<")]
    if named:
        return named[0]
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type", [])
    reserved = {int(gguf_field(reader, f"tokenizer.ggml.{role}_token_id", -1))
                for role in ("bos", "eos", "padding", "unknown")}
    control = [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL and i not in reserved]
    if not control:
        raise ValueError(f"{target}: no free control token for the mask; pass --mask-token ID")
    return control[-1]


def target_weights(target: str | os.PathLike[str], layer_ids: list[int]) -> tuple[Any, Any, list[dict], dict]:
    """Embedding, head (output.weight, or the tied embedding) and the named layers, dequantized,
    with the hyperparameters a draft built from them needs."""
    reader = open_gguf(target, "target")
    arch = gguf_field(reader, "general.architecture")
    wanted = {"token_embd.weight", "output.weight", "output_norm.weight"} | {f"blk.{i}." for i in layer_ids}
    tensors = {t.name: tensor_values(t) for t in reader.tensors
               if t.name in wanted or any(t.name.startswith(w) for w in wanted if w.endswith("."))}
    hp = {"arch": arch, "n_layer": int(gguf_field(reader, f"{arch}.block_count")),
          "n_head": int(gguf_field(reader, f"{arch}.attention.head_count")),
          "n_head_kv": int(gguf_field(reader, f"{arch}.attention.head_count_kv")),
          "n_ff": int(gguf_field(reader, f"{arch}.feed_forward_length")),
          "rope_theta": float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
          "context_length": int(gguf_field(reader, f"{arch}.context_length", 8192))}
    embd = tensors["token_embd.weight"]
    layers = [{k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"blk.{i}.")} for i in layer_ids]
    hp["output_norm"] = tensors.get("output_norm.weight")
    return embd, tensors.get("output.weight", embd), layers, hp

"""Check a target GGUF and a DFlash draft GGUF before starting anything: headers only, so it
takes seconds even for a 35B target. The fork checks the same things when it loads the pair;
this is for clear messages up front (`ikdflash serve`, `ikdflash doctor`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

DRAFT_ARCHS = ("dflash-draft", "dflash")


@dataclass
class PairReport:
    problems: list[str] = field(default_factory=list)  # the fork would refuse the pair
    warnings: list[str] = field(default_factory=list)  # it would run, maybe not as meant
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


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


_REQUIRED = object()


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


def check_pair(target: str | os.PathLike[str], draft: str | os.PathLike[str], *,
               cross_ctx: int | None = None, ctx_size: int | None = None) -> PairReport:
    report = PairReport()
    t = open_gguf(target, "target")
    d = open_gguf(draft, "draft")
    report.facts["target_quant"], report.facts["draft_quant"] = matrix_type(t), matrix_type(d)
    t_arch, d_arch = gguf_field(t, "general.architecture", None), gguf_field(d, "general.architecture", None)
    if d_arch not in DRAFT_ARCHS:
        report.problems.append(f"draft {draft}: architecture '{d_arch}' is not a DFlash draft")
        return report
    if t_arch in DRAFT_ARCHS:
        report.problems.append(f"target {target}: this is a DFlash draft, not a target model")
        return report
    p = d_arch + "."
    n_layer_t = int(gguf_field(t, f"{t_arch}.block_count", 0))
    n_embd_t = int(gguf_field(t, f"{t_arch}.embedding_length", 0))
    t_tokens = gguf_field(t, "tokenizer.ggml.tokens", [])
    d_tokens = gguf_field(d, "tokenizer.ggml.tokens", [])
    if d_arch == "dflash-draft":
        ids = list(gguf_field(d, p + "dflash.target_layer_ids", []))
        mask = gguf_field(d, p + "dflash.mask_token_id", None)
        block = int(gguf_field(d, p + "dflash.block_size", 16))
    else:  # upstream llama.cpp: newer files number target layers from 1
        newer = "tokenizer.ggml.mask_token_id" in d.fields
        ids = [i - (1 if newer else 0) for i in gguf_field(d, p + "target_layers", [])]
        mask = gguf_field(d, "tokenizer.ggml.mask_token_id" if newer else p + "mask_token_id", None)
        block = int(gguf_field(d, p + "block_size", 16))
    window = int(gguf_field(d, p + "attention.sliding_window", 0))
    pattern = list(gguf_field(d, p + "attention.sliding_window_pattern", []))
    report.facts |= {"target_arch": t_arch, "target_layers": n_layer_t, "target_hidden": n_embd_t,
                     "vocab": len(t_tokens), "draft_format": d_arch, "block_size": block, "window": window,
                     "sliding_layers": sum(bool(x) for x in pattern) if pattern else 0, "target_layer_ids": ids}

    if len(d_tokens) != len(t_tokens):
        report.problems.append(f"vocabulary: the draft has {len(d_tokens)} tokens, the target {len(t_tokens)}: "
                               "the draft was made for another target")
    else:
        differing = next((i for i, (a, b) in enumerate(zip(d_tokens, t_tokens, strict=True)) if a != b), None)
        if differing is not None:
            report.problems.append(f"vocabulary: token {differing} is '{d_tokens[differing]}' in the draft but "
                                   f"'{t_tokens[differing]}' in the target")
    if mask is None or not 0 <= int(mask) < len(t_tokens):
        report.problems.append(f"mask token {mask} is outside the vocabulary ({len(t_tokens)} tokens)")
    if not ids:
        report.problems.append("the draft names no target layers")
    for i in ids:
        if not 0 <= i < n_layer_t:
            report.problems.append(f"target layer id {i} is outside the target's {n_layer_t} layers")
        elif i == n_layer_t - 1:
            report.problems.append(f"target layer id {i} is the target's last layer, which the fork cannot capture")
    width = gguf_field(d, p + "dflash.n_target_features", None)
    if width is not None and ids and int(width) != n_embd_t * len(ids):
        report.problems.append(f"feature width {width} differs from target hidden size {n_embd_t} x {len(ids)} "
                               f"target layers = {n_embd_t * len(ids)}")

    effective = cross_ctx or ctx_size
    if window and report.facts["sliding_layers"] and effective is not None and effective <= window - block:
        report.warnings.append(f"cross_ctx {effective} <= window {window} - block {block}: the sliding window "
                               f"can never engage (raise --cross-ctx / --ctx-size above {window - block})")
    if cross_ctx and ctx_size and cross_ctx > ctx_size:
        report.warnings.append(f"cross_ctx {cross_ctx} exceeds the context size {ctx_size}: the extra rows are "
                               "never filled")
    return report

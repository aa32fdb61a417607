"""Check a target GGUF and a DFlash draft GGUF before starting anything: headers only, so it
takes seconds even for a 35B target. The fork checks the same things when it loads the pair;
this is for clear messages up front (`ikdflash serve`, `ikdflash doctor`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ikdflash.gguf_files import DRAFT_ARCHS, gguf_field, matrix_type, open_gguf, read_draft_header


@dataclass
class PairReport:
    problems: list[str] = field(default_factory=list)  # the fork would refuse the pair
    warnings: list[str] = field(default_factory=list)  # it would run, maybe not as meant
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_pair(target: str | os.PathLike[str], draft: str | os.PathLike[str], *,
               cross_ctx: int | None = None, ctx_size: int | None = None) -> PairReport:
    report = PairReport()
    t = open_gguf(target, "target")
    d = open_gguf(draft, "draft")
    report.facts["target_quant"], report.facts["draft_quant"] = matrix_type(t), matrix_type(d)
    try:
        header = read_draft_header(d, draft)
    except ValueError as e:
        report.problems.append(str(e))
        return report
    t_arch = gguf_field(t, "general.architecture", None)
    if t_arch in DRAFT_ARCHS:
        report.problems.append(f"target {target}: this is a DFlash draft, not a target model")
        return report
    ids, mask, block, window = header.target_layer_ids, header.mask_token_id, header.block_size, header.window
    n_layer_t = int(gguf_field(t, f"{t_arch}.block_count", 0))
    n_embd_t = int(gguf_field(t, f"{t_arch}.embedding_length", 0))
    t_tokens = gguf_field(t, "tokenizer.ggml.tokens", [])
    d_tokens = gguf_field(d, "tokenizer.ggml.tokens", [])
    report.facts |= {"target_arch": t_arch, "target_layers": n_layer_t, "target_hidden": n_embd_t,
                     "vocab": len(t_tokens), "draft_format": header.arch, "block_size": block,
                     "max_proposal": header.max_proposal, "window": window,
                     "sliding_layers": header.n_sliding, "target_layer_ids": ids}

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
    width = header.n_target_features
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

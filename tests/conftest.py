"""Shared fixtures: tiny random-weight GGUF targets, written once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

import gguf
import numpy as np

from fixtures.tinydraft import converted_tiny_draft, write_hf_target
from fixtures.tinymodels import write_tiny_model
from fixtures.gguf_edit import rewrite

TARGET_ARCHS = ("llama", "qwen3", "qwen35moe")

# Drafting that costs nothing: the adaptive block length (on by default) then verifies every draft
# it may, as the fixed block length does, on any machine. Its choices on this machine's own costs
# depend on the machine's speed; the tests that look at them (test_adaptive.py) set their own.
FREE_DRAFTS = "0.000001:1"


@pytest.fixture(autouse=True)
def fixed_pass_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test, and the servers and commands it starts, sees IKDFLASH_COSTS=FREE_DRAFTS unless
    it sets or deletes the variable itself."""
    monkeypatch.setenv("IKDFLASH_COSTS", FREE_DRAFTS)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(arch, **sizes) -> path of a GGUF written once per distinct request."""
    made: dict[tuple, Path] = {}
    folder = tmp_path_factory.mktemp("models")

    def make(arch: str, **overrides: object) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = write_tiny_model(folder / f"{arch}-{len(made)}.gguf", arch=arch, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_draft(target_gguf, outtype="f32", **write_tiny_draft options) -> draft GGUF path,
    converted by our converter from a random Hugging Face checkpoint made for that target."""
    made: dict[tuple, Path] = {}

    def make(target: Path, *, outtype: str = "f32", **options: object) -> Path:
        key = (str(target), outtype, repr(sorted(options.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp("draft")
            hf = write_hf_target(folder / "target-hf", target)
            made[key] = converted_tiny_draft(folder, hf, outtype=outtype, **options)[1]
        return made[key]

    return make


@pytest.fixture(scope="session")
def swa_pairs(tiny_model, tiny_draft):
    """arch -> (target, random draft): tiny llama and qwen35moe (hybrid) targets, each with a
    3-layer draft, sliding window 8 on two layers, block 16, for the server tests; "ARCH+dflash2"
    -> the same target with a DFlash2 draft of that shape."""
    swa = dict(layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=8, block_size=16)
    dflash2 = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=16, selector_top_k=8)
    pairs = {}
    for arch in ("llama", "qwen35moe"):
        target = tiny_model(arch)
        pairs[arch] = (target, tiny_draft(target, target_layer_ids=[0, 2], seed=5, **swa))
        pairs[f"{arch}+dflash2"] = (target, tiny_draft(target, target_layer_ids=[0, 2], seed=5, dflash2=dflash2, **swa))
    return pairs


@pytest.fixture(scope="session")
def oracle_pair(tiny_model, tiny_draft, tmp_path_factory):
    """A target whose head is all zeros, so it always picks token 0, and two drafts borrowing
    heads: one that agrees (the same zero head) and one that never proposes token 0."""
    folder = tmp_path_factory.mktemp("oracle")
    target = tiny_model("llama", zero_head=True)
    n_vocab = len(gguf.GGUFReader(target).fields["tokenizer.ggml.tokens"].contents())
    n_embd = 64
    right = tiny_draft(target, target_layer_ids=[1], block_size=8, layer_types=["full_attention"])
    # a head with rows u and -u for tokens 1 and 2: one of them is positive, token 0 stays at 0
    u = np.random.default_rng(0).standard_normal(n_embd)
    head = np.zeros((n_vocab, n_embd))
    head[1], head[2] = u, -u
    wrong = rewrite(right, folder / "wrong.gguf", tensors={
        "token_embd.weight": _tensor(target, "token_embd.weight"), "output.weight": head})
    return target, right, wrong


def _tensor(path: Path, name: str) -> np.ndarray:
    for t in gguf.GGUFReader(path).tensors:
        if t.name == name:
            return np.array(t.data, dtype=np.float32)
    raise KeyError(name)

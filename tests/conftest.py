"""Shared fixtures: tiny random-weight GGUF targets, written once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from ikdflash.convert import convert
from ikdflash.tinydraft import write_hf_target, write_tiny_draft
from ikdflash.tinymodels import write_tiny_model

TARGET_ARCHS = ("llama", "qwen3", "qwen35moe")


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
            checkpoint = write_tiny_draft(folder / "draft", hf, **options)
            made[key] = convert(checkpoint, hf, outtype=outtype, outfile=folder / "draft.gguf", log=lambda _: None)
        return made[key]

    return make

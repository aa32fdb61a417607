"""Shared fixtures: tiny random-weight GGUF targets, written once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

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

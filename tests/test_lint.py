"""The package, its tests and benchmarks pass the linters configured in pyproject.toml: ruff over
all three, mypy over the package (its _core stubs included; tests/test_stub.py checks those stubs
against the module)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool", [["ruff", "check", "python", "tests", "benchmarks"], ["mypy"]],
                         ids=["ruff", "mypy"])
def test_the_linters_pass(tool, tmp_path):
    # mypy's cache outside the tree: a clean checkout stays clean
    env_args = ["--cache-dir", str(tmp_path / "cache")] if tool[0] == "mypy" else ["--no-cache"]
    done = subprocess.run([sys.executable, "-m", *tool, *env_args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

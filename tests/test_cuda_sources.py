"""The CUDA sources our patch series changes compile with nvcc for sm_90, without a GPU.

Slow (`python -m pytest -m slow tests/test_cuda_sources.py`): it prepares the patched base tree,
configures a CUDA build of it with CMake alone, and compiles, with the build's own command lines,
the translation units that the patches touch: each patched .cu file, and each .cu file that
includes a patched .cuh header directly. Skipped without nvcc, or without cuBLAS's headers
(cublas_v2.h: in the toolkit, in Python's nvidia-cublas package, or under $CUBLAS_ROOT).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE_DIR = REPO / "third_party" / "ik_llama"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patched_cuda_files() -> list[str]:
    """Paths (relative to ggml/src) of the CUDA sources and headers the series changes."""
    series = (BASE_DIR / "patches" / "series").read_text().split()
    touched = set()
    for name in series:
        for path in re.findall(r"^\+\+\+ b/(\S+)", (BASE_DIR / "patches" / name).read_text(), re.MULTILINE):
            if path.startswith("ggml/src/ggml-cuda") and path.endswith((".cu", ".cuh")):
                touched.add(path.removeprefix("ggml/src/"))
    return sorted(touched)


def test_the_series_touches_cuda_sources():
    """A guard for the slow test below (in the default run): it has something to compile
    (argmax.cu: patch 0026, today)."""
    assert "ggml-cuda/argmax.cu" in patched_cuda_files()


@pytest.mark.slow
def test_patched_cuda_sources_compile_for_sm_90(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    cost = load("cuda_build_cost", REPO / "benchmarks" / "cuda_build_cost.py")
    cublas = cost.find_cublas(os.environ.get("CUBLAS_ROOT"))
    if cublas is None:
        pytest.skip(cost.CUBLAS_HINT)
    basetree = load("basetree_cuda", BASE_DIR / "basetree.py")
    source = os.environ.get("IKDFLASH_BASE_SOURCE") or str(basetree.download_sdist(basetree.read_pin()))
    fork = tmp_path / "fork"
    basetree.prepare(fork, source)
    entries = cost.configure(fork, tmp_path / "build", [], cublas)
    units = {os.path.relpath(e["file"], fork / "ggml" / "src"): e for e in entries if e["file"].endswith(".cu")}

    wanted = set()
    for path in patched_cuda_files():
        if path.endswith(".cu"):
            assert path in units, f"{path} is patched but not compiled by a CUDA build"
            wanted.add(path)
        else:  # a header: the units that include it directly
            header = os.path.basename(path)
            wanted |= {u for u in units
                       if re.search(rf'#include\s+"[^"]*\b{re.escape(header)}"', (fork / "ggml" / "src" / u).read_text())}
    assert wanted
    failures = []
    for unit in sorted(wanted):
        argv = shlex.split(units[unit]["command"])
        argv[argv.index("-o") + 1] = str(tmp_path / "unit.o")
        r = subprocess.run(argv, cwd=units[unit]["directory"], capture_output=True, text=True, timeout=1800,
                           check=False)
        if r.returncode != 0:
            failures.append(f"{unit}:\n{(r.stdout + r.stderr)[-4000:]}")
        elif shutil.which("cuobjdump"):  # machine code for Hopper in the object
            elf = subprocess.run(["cuobjdump", "--list-elf", str(tmp_path / "unit.o")], capture_output=True, text=True,
                                 check=False)
            assert "sm_90" in elf.stdout, f"{unit}: {elf.stdout}{elf.stderr}"
    assert not failures, "\n".join(failures)

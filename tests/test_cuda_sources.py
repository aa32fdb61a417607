"""The CUDA sources our patch series changes compile with nvcc for sm_90, without a GPU.

Slow (`python -m pytest -m slow tests/test_cuda_sources.py`): it prepares the patched base tree,
configures a CUDA build of it with CMake alone, and compiles, with the build's own command lines,
the translation units that the patches touch: each patched .cu file, and each .cu file that
includes a patched .cuh header directly; and a build trimmed to a few MMQ weight types (the
device check's) compiles and dispatches those types only. Skipped without nvcc, or without
cuBLAS's headers (cublas_v2.h: in the toolkit, in Python's nvidia-cublas package, or under
$CUBLAS_ROOT).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
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
    (argmax.cu: patch `ggml-argmax-returns-the-first-maximum-on-the-CPU-and`, today)."""
    assert "ggml-cuda/argmax.cu" in patched_cuda_files()


@pytest.fixture(scope="module")
def cuda_fork(tmp_path_factory):
    """(the patched base tree, benchmarks.passes.cuda_build, cuBLAS's include folder), or a skip."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    if str(REPO) not in sys.path:  # the benchmarks package, from the repository root
        sys.path.insert(0, str(REPO))
    cost = importlib.import_module("benchmarks.passes.cuda_build")
    cublas = cost.find_cublas(os.environ.get("CUBLAS_ROOT"))
    if cublas is None:
        pytest.skip(cost.CUBLAS_HINT)
    basetree = load("basetree_cuda", BASE_DIR / "basetree.py")
    source = os.environ.get("IKDFLASH_BASE_SOURCE") or str(basetree.download_sdist(basetree.read_pin()))
    fork = tmp_path_factory.mktemp("cuda") / "fork"
    basetree.prepare(fork, source)
    return fork, cost, cublas


def cuda_units(fork: Path, entries: list[dict]) -> dict[str, dict]:
    return {os.path.relpath(e["file"], fork / "ggml" / "src"): e for e in entries if e["file"].endswith(".cu")}


def compile_unit(entry: dict, out: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(entry["command"])
    argv[argv.index("-o") + 1] = str(out)
    return subprocess.run(argv, cwd=entry["directory"], capture_output=True, text=True, timeout=1800, check=False)


@pytest.mark.slow
def test_patched_cuda_sources_compile_for_sm_90(cuda_fork, tmp_path):
    fork, cost, cublas = cuda_fork
    units = cuda_units(fork, cost.configure(fork, tmp_path / "build", [], cublas))

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
        r = compile_unit(units[unit], tmp_path / "unit.o")
        if r.returncode != 0:
            failures.append(f"{unit}:\n{(r.stdout + r.stderr)[-4000:]}")
        elif shutil.which("cuobjdump"):  # machine code for Hopper in the object
            elf = subprocess.run(["cuobjdump", "--list-elf", str(tmp_path / "unit.o")], capture_output=True, text=True,
                                 check=False)
            assert "sm_90" in elf.stdout, f"{unit}: {elf.stdout}{elf.stderr}"
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_an_mmq_type_list_builds_and_dispatches_those_types_only(cuda_fork, tmp_path):
    """GGML_CUDA_MMQ_TYPES (patch `cuda-GGML_CUDA_MMQ_TYPES-builds-only-the-listed-MMQ-`, the device check's trimmed build): only
    the listed types' MMQ instance units are compiled, and the dispatchers reference no other type's kernels (else
    the library would not link); an unknown type stops the configure with its name."""
    fork, cost, cublas = cuda_fork
    entries = cost.configure(fork, tmp_path / "build", ["-DGGML_CUDA_MMQ_TYPES=q4_1;Q8_0"], cublas)
    units = cuda_units(fork, entries)
    instances = sorted(os.path.basename(u) for u in units if "mmq-instance" in u)
    assert instances == ["mmq-instance-q4_1.cu", "mmq-instance-q4_1_id.cu",
                         "mmq-instance-q8_0.cu", "mmq-instance-q8_0_id.cu"]
    for unit, case in (("ggml-cuda/mmq.cu", "mul_mat_q_case<"), ("ggml-cuda/mmq_id.cu", "mul_mat_q_case_id<")):
        r = compile_unit(units[unit], tmp_path / "unit.o")
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        undefined = subprocess.run(["nm", "-uC", str(tmp_path / "unit.o")], capture_output=True, text=True,
                                   check=True).stdout
        # GGML_TYPE_Q4_1 = 3, GGML_TYPE_Q8_0 = 8
        assert sorted(re.findall(re.escape(case) + r"\(ggml_type\)(\d+)>", undefined)) == ["3", "8"], unit

    with pytest.raises(RuntimeError, match="no MMQ kernels for type 'q9_9'"):
        cost.configure(fork, tmp_path / "bad", ["-DGGML_CUDA_MMQ_TYPES=q4_1;q9_9"], cublas)

"""The wheel that `python -m build --wheel` makes installs into a fresh virtual environment in
seconds, without compiling, and runs from there: its libraries, server and module find each other
through $ORIGIN run paths, and nothing in them points into the build tree. Slow (it builds the
package, incrementally with ccache): python -m pytest -m slow tests/test_wheel.py"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


FIXTURES = {p.stem for p in (REPO / "tests" / "fixtures").glob("*.py")} - {"__init__"}


def is_test_fixture(name: str) -> bool:
    return Path(name).stem in FIXTURES or "fixtures/" in name or name.startswith("tests/")


def test_the_package_holds_no_test_fixture():
    """The wheel ships python/ikdflash; the tiny models and GGUF rewriters live in tests/fixtures."""
    assert FIXTURES >= {"tinymodels", "tinydraft", "gguf_edit"}
    package = REPO / "python" / "ikdflash"
    shipped = [str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()]
    assert not [name for name in shipped if is_test_fixture(name)], shipped
    imports = [p for p in package.rglob("*.py") if "fixtures" in p.read_text()]
    assert not imports, imports


def elf_files(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF")


@pytest.mark.slow
def test_the_wheel_installs_without_compiling_and_runs_on_its_own(tmp_path, tiny_model):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    env = {**os.environ, "CCACHE_DIR": os.environ.get("CCACHE_DIR", str(Path.home() / ".cache/ccache")),
           "CCACHE_BASEDIR": str(REPO), "CCACHE_NOHASHDIR": "1"}
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    (wheel,) = dist.glob("ikdflash-*.whl")
    shipped = zipfile.ZipFile(wheel).namelist()
    assert not [name for name in shipped if is_test_fixture(name)], shipped

    venv = tmp_path / "venv"
    # the venv sees this interpreter's numpy, gguf, ... but its own site-packages comes first
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    start = time.monotonic()
    # --ignore-installed: the same version in the system site-packages would satisfy pip otherwise
    subprocess.run([venv / "bin/pip", "install", "--quiet", "--no-deps", "--ignore-installed", str(wheel)], check=True)
    install_seconds = time.monotonic() - start
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB, installed in {install_seconds:.1f} s")
    assert install_seconds < 60

    package = Path(subprocess.run([venv / "bin/python", "-c", "import ikdflash; print(ikdflash.__file__)"],
                                  check=True, capture_output=True, text=True, cwd=tmp_path).stdout.strip()).parent
    assert package.is_relative_to(venv), package
    binaries = elf_files(package)
    assert {p.name for p in binaries} >= {"llama-server", "libllama.so", "libikdflash.so", "libggml.so"}
    for binary in binaries:
        dynamic = subprocess.run(["readelf", "-d", binary], check=True, capture_output=True, text=True).stdout
        run_paths = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "RUNPATH" in line
                     or "RPATH" in line]
        assert all(p.startswith("$ORIGIN") for entry in run_paths for p in entry.split(":")), (binary, run_paths)
        linked = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
        assert "not found" not in linked, (binary, linked)
        assert str(REPO) not in linked and "/build/" not in linked, (binary, linked)

    target = tiny_model("llama")
    script = ("from ikdflash import Model, Server; from ikdflash.serving import fork; from ikdflash.serving.client import post_json\n"
              "print(fork.server_binary())\n"
              f"with Model({str(target)!r}, n_ctx=128) as m: print(len(m.tokenize('hello')))\n"
              f"with Server({str(target)!r}, ctx_size=256, n_threads=2) as url:\n"
              "    print(post_json(url + '/completion', {'prompt': 'hi', 'n_predict': 4})['tokens_predicted'])\n")
    server, n_tokens, n_predicted = subprocess.run([venv / "bin/python", "-c", script], check=True,
                                                   capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert Path(server).is_relative_to(package) and int(n_tokens) > 0 and n_predicted == "4"

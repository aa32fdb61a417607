"""The installed package knows what it is built from, and its llama-server runs."""

import json
import subprocess
import sys
from pathlib import Path

import ikdflash
from ikdflash.cli import doctor
from ikdflash.serving import fork

PIN_FILE = Path(__file__).resolve().parents[1] / "third_party" / "ik_llama" / "pin.txt"
# the base commit as pin.txt, the one place for the pin, names it
PINNED_COMMIT = next(line.split("=", 1)[1].strip() for line in PIN_FILE.read_text().splitlines()
                     if line.startswith("commit="))


def test_version_and_backends():
    info = ikdflash.build_info()
    assert info["version"] == ikdflash.__version__
    assert "CPU" in info["backends"]
    assert "AVX" in info["system"] or "NEON" in info["system"]


def test_pin_matches_the_repository():
    installed = fork.base_pin()
    assert f"sha256={installed['sha256']}" in PIN_FILE.read_text()
    assert installed["commit"] == PINNED_COMMIT


def test_packaged_server_reports_the_base_commit():
    server = fork.server_binary()
    assert server.parent.name == "bin" and server.parent.parent == fork.PACKAGE_DIR
    assert PINNED_COMMIT in fork.server_version()


def test_doctor_json_is_complete():
    out = subprocess.run([sys.executable, "-m", "ikdflash.cli", "doctor", "--json"],
                         capture_output=True, text=True, check=True, cwd="/")
    report = json.loads(out.stdout)
    assert report["problems"] == []
    assert report["base_commit"] == PINNED_COMMIT
    assert report["patches"] == fork.patches()
    assert report["llama_server"] == str(fork.server_binary())


def test_doctor_text_names_every_section():
    report = doctor.collect()
    out = subprocess.run(["ikdflash", "doctor"], capture_output=True, text=True, check=True, cwd="/").stdout
    for label in ("ikdflash", "base", "patches", "backends", "llama-server"):
        assert label in out
    assert report["version"] in out


def test_the_package_ships_its_type_hints_and_license():
    """py.typed makes type checkers read the hints (and _core/*.pyi); the license matches pyproject."""
    from importlib import metadata, resources
    assert (resources.files("ikdflash") / "py.typed").is_file()
    assert (resources.files("ikdflash") / "_core" / "__init__.pyi").is_file()
    dist = metadata.distribution("ikdflash")
    assert dist.metadata["License-Expression"] == "MIT"
    licenses = [f for f in dist.files if f.name == "LICENSE"]
    assert licenses and "MIT License" in licenses[0].read_text()


def dynamic_symbols(library: Path) -> set[str]:
    listing = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout
    return {line.split()[-1] for line in listing.splitlines() if line.strip()}


def test_dflash_runtime_is_its_own_library_on_llama():
    lib = fork.PACKAGE_DIR / "lib"
    runtime = dynamic_symbols(lib / "libikdflash.so")
    assert {"dflash_engine_init", "dflash_draft_load", "dflash_capture_features"} <= runtime
    assert not {name for name in dynamic_symbols(lib / "libllama.so") if name.startswith("dflash_")}
    needed = subprocess.run(["readelf", "-d", str(lib / "libikdflash.so")], capture_output=True, text=True,
                            check=True).stdout
    assert "[libllama.so]" in needed

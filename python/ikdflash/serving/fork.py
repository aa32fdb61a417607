"""Where the compiled fork lives inside the installed package, what it was built from, and the
provenance a measurement made with it records."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent
FORK_INFO_DIR = PACKAGE_DIR / "fork"


def server_binary(name: str = "llama-server") -> Path:
    """A packaged program built from the fork (llama-server, rpc-server), with RPATHs into
    ikdflash/lib."""
    path = PACKAGE_DIR / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {name} is missing from the package; reinstall ikdflash")
    return path


def base_pin() -> dict[str, str]:
    """The pinned ik_llama.cpp base (third_party/ik_llama/pin.txt at build time)."""
    pin = {}
    for line in (FORK_INFO_DIR / "pin.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    return pin


def patches() -> list[str]:
    """The patch series compiled into the fork, in order."""
    lines = (FORK_INFO_DIR / "series").read_text().splitlines()
    return [name.strip() for name in lines if name.strip() and not name.startswith("#")]


def server_version() -> str:
    """What the packaged llama-server says of itself (`--version`)."""
    result = subprocess.run([str(server_binary()), "--version"], capture_output=True, text=True, timeout=30)
    return (result.stdout + result.stderr).strip()


def series_fingerprint() -> str:
    """The first 16 hex digits of the SHA-256 of the compiled patch series (the patch files'
    bytes in order, the series file last), written at build time."""
    return (FORK_INFO_DIR / "series.sha256").read_text().strip()[:16]


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def provenance(threads: int, commit: str | None = None) -> dict:
    """Where and from what a measurement was made: the commit (the package's version when the
    caller knows none), the patch series' fingerprint, the build's backends and CPU features, the
    CPU model, the threads and the date."""
    from ikdflash import __version__, build_info

    info = build_info()
    # the build's "AVX = 1 | AVX2 = 1 | NEON = 0 | ..." as the features it has
    features = [f.split("=")[0].strip() for f in info["system"].split("|") if f.strip().endswith("= 1")]
    return {"commit": commit or f"ikdflash {__version__}", "patch_series": series_fingerprint(),
            "backends": list(info["backends"]), "build_features": " ".join(features), "cpu": cpu_model(),
            "threads": threads, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}

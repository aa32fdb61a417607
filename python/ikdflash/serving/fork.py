"""Where the compiled fork lives inside the installed package, and what it was built from."""

from __future__ import annotations

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

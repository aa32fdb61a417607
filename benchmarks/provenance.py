"""Where and from what a benchmark result was measured, for its JSON file: the commit (with
"-dirty" when the tree had changes), a fingerprint of the patch series, the build's backends and
CPU features, the CPU model, the threads and the date."""

from __future__ import annotations

import datetime
import hashlib
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def provenance(threads: int) -> dict:
    import ikdflash

    series = sorted((ROOT / "third_party" / "ik_llama" / "patches").glob("*"))
    fingerprint = hashlib.sha256(b"".join(p.read_bytes() for p in series)).hexdigest()[:16]
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    # the build's "AVX = 1 | AVX2 = 1 | NEON = 0 | ..." as the features it has
    info = ikdflash.build_info()
    features = [f.split("=")[0].strip() for f in info["system"].split("|") if f.strip().endswith("= 1")]
    return {"commit": commit + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""),
            "patch_series": fingerprint, "backends": list(info["backends"]), "build_features": " ".join(features),
            "cpu": cpu_model(), "threads": threads,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}

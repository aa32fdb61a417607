#!/usr/bin/env python3
"""Obtain the pinned ik_llama.cpp base, apply our patch series, and move patches in and out.

The repository never holds upstream source: this script fetches it (or takes a local copy),
checks it against pin.txt, and writes the patched tree somewhere outside the repository.

    # what the CMake build runs (idempotent; reuses the tree while nothing changed)
    python third_party/ik_llama/basetree.py prepare --dest build/ik_llama.cpp

    # C++ developers: a git repository with one commit per patch, to build and hack on
    python third_party/ik_llama/basetree.py export ~/src/ikdflash-fork
    # ... commit changes there, then turn the commits back into patches/
    python third_party/ik_llama/basetree.py refresh ~/src/ikdflash-fork

Where the base comes from, first match wins: --source PATH (a sdist tarball, or a directory
holding an ik_llama.cpp checkout at the pinned commit), the IKDFLASH_BASE_SOURCE environment
variable, the download cache (IKDFLASH_CACHE_DIR, default ~/.cache/ikdflash), and finally
`pip download` into that cache.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIN_FILE = HERE / "pin.txt"
PATCH_DIR = HERE / "patches"
SERIES_FILE = PATCH_DIR / "series"
STAMP_NAME = ".ikdflash-base"
BASE_TAG = "ikdflash-base"
# Fixed identity so that `export` produces the same base commit on every machine.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "ikdflash",
    "GIT_AUTHOR_EMAIL": "ikdflash@localhost",
    "GIT_COMMITTER_NAME": "ikdflash",
    "GIT_COMMITTER_EMAIL": "ikdflash@localhost",
    "GIT_AUTHOR_DATE": "2026-04-13T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-04-13T00:00:00Z",
}


class BaseTreeError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"ikdflash-base: {msg}", file=sys.stderr, flush=True)


def read_pin() -> dict[str, str]:
    pin = {}
    for line in PIN_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    return pin


def patch_series() -> list[Path]:
    names = [n.strip() for n in SERIES_FILE.read_text().splitlines()]
    patches = [PATCH_DIR / n for n in names if n and not n.startswith("#")]
    for p in patches:
        if not p.is_file():
            raise BaseTreeError(f"patch listed in {SERIES_FILE} is missing: {p.name}")
    return patches


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def series_fingerprint(pin: dict[str, str]) -> str:
    """Changes whenever the pin, a patch or this procedure changes: a stale tree is never reused."""
    digest = hashlib.sha256(pin["sha256"].encode())
    for own in ("build-info-gen.cmake", "basetree.py"):
        digest.update((HERE / own).read_bytes())
    for p in patch_series():
        digest.update(p.name.encode())
        digest.update(p.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ikdflash"
    return Path(os.environ.get("IKDFLASH_CACHE_DIR", default)) / "base"


def sdist_name(pin: dict[str, str]) -> str:
    return f"{pin['package'].replace('-', '_')}-{pin['version']}.tar.gz"


def download_sdist(pin: dict[str, str]) -> Path:
    target = cache_dir()
    cached = target / sdist_name(pin)
    if cached.is_file():
        return cached
    target.mkdir(parents=True, exist_ok=True)
    log(f"downloading {pin['package']}=={pin['version']} (source distribution) into {target}")
    # --no-build-isolation: pip would otherwise build cmake from source just to read the sdist's
    # metadata; the sdist's backend (scikit-build-core) is already present wherever we build.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "--dest", str(target), f"{pin['package']}=={pin['version']}"]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0 or not cached.is_file():
        raise BaseTreeError(
            "could not download the ik_llama.cpp base with pip:\n" + result.stdout[-2000:]
            + "\nOffline? Pass a local copy with --source PATH or IKDFLASH_BASE_SOURCE "
              f"(the file {sdist_name(pin)}, or an ik_llama.cpp checkout at {pin['commit']}).")
    return cached


def verify_sdist(path: Path, pin: dict[str, str]) -> None:
    actual = sha256_of(path)
    if actual != pin["sha256"]:
        raise BaseTreeError(f"{path}: sha256 {actual} does not match the pin {pin['sha256']} "
                            f"({PIN_FILE}); delete it if it is a broken download")


def extract_sdist(path: Path, pin: dict[str, str], dest: Path) -> None:
    prefix = f"{sdist_name(pin)[:-len('.tar.gz')]}/{pin['subdir']}/"
    with tarfile.open(path) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and len(member.name) > len(prefix):
                member.name = member.name[len(prefix):]
                members.append(member)
        if not members:
            raise BaseTreeError(f"{path}: no {pin['subdir']} inside; is this the right sdist?")
        tar.extractall(dest, members=members, filter="data")


def copy_checkout(src: Path, dest: Path) -> None:
    if not (src / "src" / "llama.cpp").is_file() or not (src / "ggml").is_dir():
        raise BaseTreeError(f"{src}: not an ik_llama.cpp source tree (no src/llama.cpp or ggml/)")
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".git", "build*"), symlinks=True,
                    dirs_exist_ok=True)


def place_base(pin: dict[str, str], dest: Path, source: str | None) -> str:
    """Write the unpatched base into dest; return a description of where it came from."""
    source = source or os.environ.get("IKDFLASH_BASE_SOURCE")
    if source:
        src = Path(source).expanduser().resolve()
        if src.is_dir():
            copy_checkout(src, dest)
            return f"checkout {src}"
        if not src.is_file():
            raise BaseTreeError(f"base source {src} does not exist")
        verify_sdist(src, pin)
        extract_sdist(src, pin, dest)
        return f"tarball {src}"
    sdist = download_sdist(pin)
    verify_sdist(sdist, pin)
    extract_sdist(sdist, pin, dest)
    return f"sdist {sdist}"


def run_git(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **GIT_IDENTITY}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=check, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def apply_patches(tree: Path) -> None:
    # The tree may sit inside another repository (a build directory in a checkout); git apply
    # would then resolve paths against that repository and silently skip ours, so stop git's
    # repository discovery at the tree.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    for patch in patch_series():
        result = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=tree, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            raise BaseTreeError(f"patch {patch.name} does not apply to the base:\n{result.stdout}")


def supply_build_info(tree: Path) -> None:
    # The sdist lacks the script common/CMakeLists.txt runs to write build-info.cpp; ours
    # stands in for it (it is not upstream code, so it is not kept as a patch).
    target = tree / "common" / "cmake" / "build-info-gen-cpp.cmake"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HERE / "build-info-gen.cmake", target)


def read_stamp(tree: Path) -> dict[str, str]:
    stamp = tree / STAMP_NAME
    if not stamp.is_file():
        return {}
    return dict(line.split("=", 1) for line in stamp.read_text().splitlines() if "=" in line)


def prepare(dest: Path, source: str | None) -> None:
    pin = read_pin()
    fingerprint = series_fingerprint(pin)
    if read_stamp(dest).get("fingerprint") == fingerprint:
        return  # unchanged: keep file times so the build stays incremental
    staging = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent if dest.parent.exists() else None))
    try:
        origin = place_base(pin, staging, source)
        apply_patches(staging)
        supply_build_info(staging)
        (staging / STAMP_NAME).write_text(
            f"fingerprint={fingerprint}\ncommit={pin['commit']}\norigin={origin}\n"
            f"patches={','.join(p.name for p in patch_series())}\n")
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"patched tree ready at {dest} ({len(patch_series())} patches, base from {origin})")


def export(dest: Path, source: str | None) -> None:
    if dest.exists() and any(dest.iterdir()):
        raise BaseTreeError(f"{dest} exists and is not empty; choose a new directory")
    pin = read_pin()
    dest.mkdir(parents=True, exist_ok=True)
    place_base(pin, dest, source)
    supply_build_info(dest)
    run_git(["init", "-q", "-b", "main"], cwd=dest)
    (dest / ".git" / "info" / "exclude").write_text("build*/\ncommon/build-info.cpp\n")
    run_git(["add", "-A", "-f"], cwd=dest)
    run_git(["commit", "-q", "-m", f"ik_llama.cpp {pin['commit']} from {pin['package']} {pin['version']}"],
            cwd=dest)
    run_git(["tag", BASE_TAG], cwd=dest)
    for patch in patch_series():
        result = run_git(["am", "-q", "--keep", "--3way", str(patch)], cwd=dest, check=False)
        if result.returncode != 0:
            raise BaseTreeError(f"patch {patch.name} does not apply:\n{result.stdout}")
    log(f"{dest}: base at tag {BASE_TAG}, {len(patch_series())} patch commits on top")


def refresh(tree: Path) -> None:
    if run_git(["rev-parse", "--verify", "-q", BASE_TAG], cwd=tree, check=False).returncode != 0:
        raise BaseTreeError(f"{tree}: no '{BASE_TAG}' tag; make the tree with `basetree.py export`")
    with tempfile.TemporaryDirectory() as tmp:
        # Stable options so that re-exporting unchanged commits does not churn the files.
        run_git(["format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat",
                 "--keep-subject", "--no-numbered", "-o", tmp, f"{BASE_TAG}..HEAD"], cwd=tree)
        new = sorted(Path(tmp).glob("*.patch"))
        for old in PATCH_DIR.glob("*.patch"):
            old.unlink()
        for p in new:
            shutil.copyfile(p, PATCH_DIR / p.name)
    SERIES_FILE.write_text("".join(p.name + "\n" for p in new))
    log(f"wrote {len(new)} patches to {PATCH_DIR}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write the patched tree for the build (idempotent)")
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--source", help="sdist tarball or ik_llama.cpp checkout to use instead of downloading")
    p = sub.add_parser("export", help="write the patched tree as a git repository, one commit per patch")
    p.add_argument("dest", type=Path)
    p.add_argument("--source", help="sdist tarball or ik_llama.cpp checkout to use instead of downloading")
    p = sub.add_parser("refresh", help="regenerate patches/ from the commits of an exported tree")
    p.add_argument("tree", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.dest.resolve(), args.source)
        elif args.command == "export":
            export(args.dest.resolve(), args.source)
        else:
            refresh(args.tree.resolve())
    except BaseTreeError as e:
        log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

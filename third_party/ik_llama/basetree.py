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

    # how the series would fare on another ik_llama.cpp (a checkout or a tarball of it)
    python third_party/ik_llama/basetree.py check --onto ~/src/ik_llama.cpp [--report table.md]

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
from dataclasses import dataclass
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


@dataclass
class PatchFate:
    """How one patch of the series fares on another base."""
    name: str
    fate: str    # in the replay: "clean" (applies, 3-way merged if need be), "upstream" (already there), "conflict"
    detail: str  # for a conflict: the files and their conflict regions, or git's reason
    alone: str = ""  # the fate of the patch applied by itself to the other base (earlier ones left out)
    regions: int = 0  # conflict regions in the replay
    lines: int = 0    # the patch's lines in them: what a person places again by hand


def place_other(other: Path, dest: Path) -> None:
    """Copy another ik_llama.cpp into dest: a source tree, or a tarball holding one (at its top or
    one folder down, as `git archive` and sdists write them)."""
    if other.is_dir():
        copy_checkout(other, dest)
        return
    if not other.is_file():
        raise BaseTreeError(f"{other}: no such tree or tarball")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tarfile.open(other) as tar:
                tar.extractall(tmp, filter="data")
        except tarfile.TarError as e:
            raise BaseTreeError(f"{other}: not a tarball ({e})") from None
        roots = [Path(tmp), *(p for p in Path(tmp).iterdir() if p.is_dir())]
        root = next((r for r in roots if (r / "src" / "llama.cpp").is_file()), None)
        if root is None:
            raise BaseTreeError(f"{other}: no ik_llama.cpp source tree inside (no src/llama.cpp)")
        copy_checkout(root, dest)


def conflict_segments(text: str) -> list:
    """A 3-way merged file's text in order: plain lines, and for each conflict block a tuple
    (this base's lines, the patch's lines)."""
    segments, side, ours, theirs = [], None, [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("<<<<<<< "):
            side, ours, theirs = "ours", [], []
        elif side == "ours" and line.startswith("======="):
            side = "theirs"
        elif side == "theirs" and line.startswith(">>>>>>> "):
            segments.append((ours, theirs))
            side = None
        elif side is not None:
            (ours if side == "ours" else theirs).append(line)
        else:
            segments.append(line)
    return segments


def conflicted_files(repo: Path) -> list[str]:
    return run_git(["diff", "--name-only", "--diff-filter=U"], cwd=repo, check=False).stdout.split()


def absent_from_base(repo: Path, f: str) -> bool:
    """Whether a conflicted file is one this base lacks (an earlier patch creates it)."""
    return not (repo / f).exists() or run_git(["cat-file", "-e", f"HEAD:{f}"], cwd=repo, check=False).returncode != 0


def conflict_regions(repo: Path) -> tuple[str, int, int]:
    """(the conflicted files with their regions and the patch's lines in them, regions, lines).
    The patch's side is what a person places again by hand; this base's side can be a whole
    rewritten function. A file this base lacks (one an earlier patch creates) has no regions."""
    parts, n_regions, n_lines = [], 0, 0
    for f in conflicted_files(repo):
        if absent_from_base(repo, f):
            parts.append(f"{f} (not on this base)")
            continue
        blocks = [s for s in conflict_segments((repo / f).read_text(errors="replace")) if isinstance(s, tuple)]
        lines = sum(len(theirs) for _, theirs in blocks)
        parts.append(f"{f} ({len(blocks)} region{'s' * (len(blocks) != 1)}, {lines} of its lines)")
        n_regions, n_lines = n_regions + len(blocks), n_lines + lines
    return ", ".join(parts), n_regions, n_lines


def take_the_patchs_side(repo: Path) -> None:
    """Resolve a stopped `git am` as the patch has it: each conflict region becomes the patch's
    lines, a file this base lacks the patch's version; then commit the patch."""
    for f in conflicted_files(repo):
        if absent_from_base(repo, f):
            run_git(["checkout", "--theirs", "--", f], cwd=repo, check=False)
        else:
            segments = conflict_segments((repo / f).read_text(errors="replace"))
            (repo / f).write_text("".join("".join(s[1]) if isinstance(s, tuple) else s for s in segments))
        run_git(["add", "--", f], cwd=repo)
    run_git(["am", "--continue"], cwd=repo, check=False)


def try_patch(repo: Path, patch: Path, carry_on: bool = False) -> tuple[str, str, int, int]:
    """(fate, detail, conflict regions, lines in them) of one patch on the repository's HEAD,
    committed when it applies; with carry_on, a conflicting patch is committed too, as the patch
    has each conflicting region, so the patches after it meet only their own conflicts."""
    if run_git(["apply", "--reverse", "--check", str(patch)], cwd=repo, check=False).returncode == 0:
        return "upstream", "its change is already there (it reverses cleanly)", 0, 0
    result = run_git(["am", "-q", "--keep", "--3way", str(patch)], cwd=repo, check=False)
    if result.returncode == 0:
        return "clean", "", 0, 0
    why, n_regions, n_lines = conflict_regions(repo)
    why = why or next((line for line in result.stdout.splitlines() if line.startswith(("error:", "fatal:"))), "")
    if carry_on and conflicted_files(repo):
        take_the_patchs_side(repo)
    else:
        run_git(["am", "--abort"], cwd=repo, check=False)
    return "conflict", why, n_regions, n_lines


def check_onto(other: Path, source: str | None) -> list[PatchFate]:
    """Replay the series on another base in a scratch repository: each patch is already there (it
    reverses cleanly), applies (with a 3-way merge against the pinned base's files where the
    context moved), or conflicts; a conflicting patch goes in as it has each conflicting region
    (a stand-in for a person's resolution), so the patches after it meet their own conflicts, not
    those of a patch they build on. Each patch is also tried alone on the other base."""
    pin = read_pin()
    with tempfile.TemporaryDirectory(prefix="ikdflash-check-") as tmp:
        repo = Path(tmp)
        # the pinned base and the series first, so that every patch's own before and after are
        # there for the 3-way merges...
        place_base(pin, repo, source)
        run_git(["init", "-q", "-b", "pinned"], cwd=repo)
        run_git(["add", "-A", "-f"], cwd=repo)
        run_git(["commit", "-q", "-m", f"pinned base {pin['commit']}"], cwd=repo)
        for patch in patch_series():
            if run_git(["am", "-q", "--keep", str(patch)], cwd=repo, check=False).returncode != 0:
                raise BaseTreeError(f"patch {patch.name} does not apply to the pinned base")
        # ...then the other base on a branch of its own
        run_git(["checkout", "-q", "--orphan", "onto"], cwd=repo)
        run_git(["rm", "-rq", "--cached", "."], cwd=repo)
        for entry in repo.iterdir():
            if entry.name != ".git":
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        place_other(other, repo)
        run_git(["add", "-A", "-f"], cwd=repo)
        run_git(["commit", "-q", "-m", f"other base {other.name}"], cwd=repo)
        run_git(["tag", "other-base"], cwd=repo)
        alone = {}
        for patch in patch_series():
            alone[patch.name] = try_patch(repo, patch)[0]
            run_git(["reset", "-q", "--hard", "other-base"], cwd=repo)
        fates = []
        for patch in patch_series():
            fate, detail, regions, lines = try_patch(repo, patch, carry_on=True)
            fates.append(PatchFate(patch.name, fate, detail, alone[patch.name], regions, lines))
    return fates


def fate_table(fates: list[PatchFate], other: str) -> str:
    counts = {fate: sum(f.fate == fate for f in fates) for fate in ("clean", "upstream", "conflict")}
    regions, lines = sum(f.regions for f in fates), sum(f.lines for f in fates)
    lines_out = [f"The series ({len(fates)} patches) replayed onto {other}: {counts['clean']} apply, "
                 f"{counts['upstream']} are already there, {counts['conflict']} conflict, in {regions} "
                 f"region{'s' * (regions != 1)} "
                 f"holding {lines} of the patches' lines (each conflicting patch goes in as it has them, so "
                 f"the patches after it meet only their own).", "",
                 "| patch | replayed | alone | conflicts in the replay |", "| --- | --- | --- | --- |"]
    lines_out += [f"| {f.name.removesuffix('.patch')} | {f.fate} | {f.alone} | {f.detail} |" for f in fates]
    return "\n".join(lines_out) + "\n"


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
    p = sub.add_parser("check", help="replay the series onto another ik_llama.cpp and say how each patch fares")
    p.add_argument("--onto", type=Path, required=True, help="the other tree: a checkout or a tarball")
    p.add_argument("--report", type=Path, help="also write the table (Markdown) here")
    p.add_argument("--source", help="sdist tarball or ik_llama.cpp checkout of the pinned base")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.dest.resolve(), args.source)
        elif args.command == "export":
            export(args.dest.resolve(), args.source)
        elif args.command == "check":
            table = fate_table(check_onto(args.onto.resolve(), args.source), str(args.onto))
            print(table, end="")
            if args.report:
                args.report.write_text(table)
        else:
            refresh(args.tree.resolve())
    except BaseTreeError as e:
        log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

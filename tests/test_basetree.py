"""basetree.py: the pinned base is checked, patches apply or fail by name, and the developer
round trip (export a git tree, commit, refresh patches) reproduces the series."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE_DIR = REPO / "third_party" / "ik_llama"


@pytest.fixture
def basetree(tmp_path, monkeypatch):
    """A fresh copy of the module whose patch folder points into tmp_path."""
    spec = importlib.util.spec_from_file_location("basetree_under_test", BASE_DIR / "basetree.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    patches = tmp_path / "patches"
    patches.mkdir()
    for p in (BASE_DIR / "patches").iterdir():
        (patches / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(module, "PATCH_DIR", patches)
    monkeypatch.setattr(module, "SERIES_FILE", patches / "series")
    return module


@pytest.fixture(scope="module")
def sdist() -> Path:
    """The pinned sdist, from IKDFLASH_BASE_SOURCE or the download cache the build filled."""
    spec = importlib.util.spec_from_file_location("basetree_sdist", BASE_DIR / "basetree.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    source = Path(module.os.environ.get("IKDFLASH_BASE_SOURCE", "")) if module.os.environ.get(
        "IKDFLASH_BASE_SOURCE") else None
    return source if source and source.is_file() else module.download_sdist(module.read_pin())


def test_prepare_applies_the_series_and_is_idempotent(basetree, sdist, tmp_path):
    # inside another git repository, as a build directory in a checkout is
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    dest = tmp_path / "build" / "tree"
    basetree.prepare(dest, str(sdist))
    stamp = basetree.read_stamp(dest)
    assert stamp["commit"] == "55d3c05"
    assert "IKDFLASH_SOURCE_DIR" in (dest / "CMakeLists.txt").read_text()  # the hook patch
    assert (dest / "common" / "cmake" / "build-info-gen-cpp.cmake").is_file()
    # the DFlash runtime's public headers are C, on the patched llama.h
    program = tmp_path / "uses_dflash.c"
    program.write_text('#include "dflash.h"\n#include "dflash-measure.h"\nint main(void) { return dflash_fault("none"); }\n')
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-pedantic", "-Werror", "-fsyntax-only",
                    f"-I{REPO / 'cpp' / 'dflash'}", f"-I{dest / 'include'}", f"-I{dest / 'ggml' / 'include'}",
                    str(program)], check=True)
    marker = dest / "untouched"
    marker.write_text("prepare must not rebuild an unchanged tree")
    basetree.prepare(dest, str(sdist))
    assert marker.exists()


def test_wrong_hash_is_refused(basetree, tmp_path):
    fake = tmp_path / "ik_llama_cpp_python-0.1.5.tar.gz"
    fake.write_bytes(b"not the sdist")
    with pytest.raises(basetree.BaseTreeError, match="does not match the pin"):
        basetree.prepare(tmp_path / "tree", str(fake))
    assert not (tmp_path / "tree").exists()


def test_patch_that_does_not_apply_is_named(basetree, sdist, tmp_path):
    bad = basetree.PATCH_DIR / "9999-broken.patch"
    bad.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    with open(basetree.SERIES_FILE, "a") as series:
        series.write(bad.name + "\n")
    with pytest.raises(basetree.BaseTreeError, match="patch 9999-broken.patch does not apply"):
        basetree.prepare(tmp_path / "tree", str(sdist))
    assert not (tmp_path / "tree").exists()


def test_export_then_refresh_round_trip(basetree, sdist, tmp_path):
    tree = tmp_path / "fork"
    basetree.export(tree, str(sdist))
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tree, capture_output=True, text=True).stdout.splitlines()
    assert len(log) == 1 + len(basetree.patch_series())
    # a developer commits a change in the tree...
    readme = tree / "README.md"
    readme.write_text(readme.read_text() + "\nikdflash round-trip test\n")
    subprocess.run(["git", "commit", "-qam", "docs: round-trip test"], cwd=tree, check=True,
                   env={**basetree.os.environ, **basetree.GIT_IDENTITY})
    # ...and refresh turns every commit since the base back into the series
    basetree.refresh(tree)
    names = basetree.SERIES_FILE.read_text().split()
    assert len(names) == len(log)
    newest = (basetree.PATCH_DIR / names[-1]).read_text()
    assert "Subject: docs: round-trip test" in newest and "+ikdflash round-trip test" in newest


def small_tree(folder: Path, files: dict[str, str]) -> Path:
    """An ik_llama.cpp-shaped tree (src/llama.cpp, ggml/) holding files."""
    for name, text in {"src/llama.cpp": "// llama\n", "ggml/ggml.c": "// ggml\n", **files}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_check_onto_says_which_patches_apply_conflict_or_are_there(basetree, tmp_path):
    """Four patches on a small base, checked onto a tree that has the first one's change and a
    change of its own where the second one edits: already there, a conflict, clean, and a second
    edit of the conflicting line, which applies because the conflicting patch went in as it has
    its region (alone it conflicts too)."""
    lines = "".join(f"line {i}\n" for i in range(20))
    base = small_tree(tmp_path / "base", {"a.txt": "one\n" + lines, "b.txt": lines + "two\n"})
    work = tmp_path / "work"
    subprocess.run(["cp", "-r", str(base), str(work)], check=True)
    git = lambda *args: subprocess.run(["git", *args], cwd=work, check=True, capture_output=True,  # noqa: E731
                                       env={**basetree.os.environ, **basetree.GIT_IDENTITY})
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "base")
    (work / "a.txt").write_text((work / "a.txt").read_text().replace("one", "ONE"))
    git("commit", "-qam", "change a.txt")
    (work / "b.txt").write_text((work / "b.txt").read_text().replace("two", "TWO"))
    git("commit", "-qam", "change b.txt")
    (work / "c.txt").write_text("new\n")
    git("add", "c.txt")
    git("commit", "-qm", "add c.txt")
    (work / "b.txt").write_text((work / "b.txt").read_text().replace("TWO", "TWO!"))
    git("commit", "-qam", "change b.txt again")
    for old in basetree.PATCH_DIR.glob("*.patch"):
        old.unlink()
    git("format-patch", "-q", "--zero-commit", "-o", str(basetree.PATCH_DIR), "HEAD~4")
    basetree.SERIES_FILE.write_text("".join(p.name + "\n" for p in sorted(basetree.PATCH_DIR.glob("*.patch"))))
    other = small_tree(tmp_path / "other", {"a.txt": "ONE\n" + lines, "b.txt": lines + "deux\n"})

    fates = basetree.check_onto(other, str(base))
    assert [(f.fate, f.alone) for f in fates] == [("upstream", "upstream"), ("conflict", "conflict"),
                                                  ("clean", "clean"), ("clean", "conflict")]
    assert fates[1].detail == "b.txt (1 region, 1 of its lines)" and (fates[1].regions, fates[1].lines) == (1, 1)
    table = basetree.fate_table(fates, "other")
    assert "2 apply, 1 are already there, 1 conflict, in 1 region holding 1 of the patches' lines" in table
    assert table.count("\n| 000") == 4


def test_cli_reports_errors_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(BASE_DIR / "basetree.py"), "refresh", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "ikdflash-base: error:" in result.stderr and "Traceback" not in result.stderr


def patch_message(path: Path) -> tuple[str, str]:
    """(subject, body) of a patch file as refresh writes it (mail headers, message, diff)."""
    text = path.read_text(errors="replace")
    head, _, rest = text.partition("\n\n")
    subject_lines = head.split("\nSubject: ", 1)[1].split("\n")
    subject = " ".join([subject_lines[0]] + [line.strip() for line in subject_lines[1:] if line.startswith(" ")])
    body = rest.split("\ndiff --git ", 1)[0].split("\n---\n", 1)[0]
    return subject, body.strip()


def test_every_patch_has_a_short_subject_and_a_body():
    """Reviewable headers: a subject of at most 72 characters and a body that says why."""
    series = (BASE_DIR / "patches" / "series").read_text().split()
    assert len(series) >= 50
    bad = {}
    for name in series:
        subject, body = patch_message(BASE_DIR / "patches" / name)
        if len(subject) > 72 or not body:
            bad[name] = (len(subject), len(body))
    assert not bad, bad

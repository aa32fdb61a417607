"""Every document the code, the tests and the README cite exists in the project."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"docs(?:/|: )([\w-]+\.md)")


def test_every_cited_document_exists():
    sources = [ROOT / "README.md", *ROOT.glob(".ci/*")]
    for folder in ("cpp", "python", "tests", "benchmarks"):
        sources += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".pyi", ".h", ".cpp", ".md", ".sh")]
    cited = {(name, source.relative_to(ROOT)) for source in sources if source.is_file()
             for name in CITED.findall(source.read_text(errors="replace"))}
    assert cited, "no citation found: the pattern no longer matches how the code cites docs"
    missing = sorted(f"{source}: docs/{name}" for name, source in cited if not (ROOT / "docs" / name).is_file())
    assert not missing, missing


README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def ci_test_commands() -> list[str]:
    """The commands .ci/run runs in its "tests" step (after `step "tests"`, until the next step)."""
    commands, in_step = [], False
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("step "):
            in_step = stripped.split(None, 1)[1].strip("\"' ") == "tests"
        elif in_step and stripped and not stripped.startswith("#"):
            commands.append(" ".join(stripped.split()))
    return commands


def readme_test_commands() -> list[str]:
    """The code lines of the README's "Tests" section (indented or fenced), in order."""
    section, in_tests, fenced = [], False, False
    for line in README.read_text().splitlines():
        if line.startswith("#") and not fenced:
            in_tests = line.lstrip("#").strip().lower() == "tests"
            continue
        if not in_tests:
            continue
        if line.strip().startswith("```"):
            fenced = not fenced
        elif (fenced or line.startswith("    ")) and line.strip():
            section.append(" ".join(line.split()))
    return section


def test_the_readmes_test_command_is_what_ci_runs():
    ci = ci_test_commands()
    assert ci, ".ci/run has no 'step \"tests\"' with a command after it"
    readme = readme_test_commands()
    assert readme, "README.md has no code block under a 'Tests' heading"
    assert readme[-len(ci):] == ci, f"README's test command {readme[-len(ci):]} is not what .ci/run runs: {ci}"


def test_every_file_the_readme_links_exists():
    links = [target for target in LINK.findall(README.read_text()) if "://" not in target]
    assert any(target.startswith("docs/") for target in links), "the README links no document in docs/"
    missing = [target for target in links if not (ROOT / target.split("#")[0]).exists()]
    assert not missing, missing


def test_every_file_the_docs_link_exists():
    missing = []
    for page in [ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" not in target and not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing

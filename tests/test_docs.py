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

"""The layout the architecture rests on: the package's modules import each other without cycles
(imports inside functions counted), no library module imports the command line
(ikdflash.cli), and no source file in cpp/ or python/ outgrows 800 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "ikdflash"
MOST_LINES = 800


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules this file imports, at any depth of its code: `from a.b import c`
    counts a.b.c where that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_package_imports_without_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_library_module_imports_the_command_line():
    leaning = {name: sorted(other for other in imported if other.startswith("ikdflash.cli"))
               for name, imported in graph().items() if not name.startswith("ikdflash.cli")}
    assert {name: cli for name, cli in leaning.items() if cli} == {}


def test_no_source_file_outgrows_its_limit():
    sources = [*(ROOT / "cpp").rglob("*.cpp"), *(ROOT / "cpp").rglob("*.h"), *PACKAGE.rglob("*.py")]
    assert sources
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert long == {}

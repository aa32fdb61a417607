"""The layout the architecture rests on: the package's modules import each other without cycles
(imports inside functions counted), no library module imports the command line
(ikdflash.cli), no source file in cpp/ or python/ outgrows 800 lines, and llama-server's DFlash
code is this repository's: the patches keep its calls, the engine and the server one step."""

from __future__ import annotations

import ast
import re
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


def server_hook_calls() -> set[str]:
    """The ikdflash functions the DFlash server patch adds calls to."""
    patch = next((ROOT / "third_party" / "ik_llama" / "patches").glob("*-server-DFlash-and-the-n-gram-lookup-*.patch"))
    added = "\n".join(line[1:] for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++"))
    return set(re.findall(r"\b((?:dflash|speculation|with_speculation)_\w+)\(", added))


def test_the_server_patch_calls_functions_of_this_repository():
    calls = server_hook_calls()
    assert {"dflash_slot_draft", "speculation_verified", "dflash_view_decoded"} <= calls
    server = "\n".join(p.read_text() for p in (ROOT / "cpp" / "server").glob("*.cpp"))
    runtime = "\n".join(p.read_text() for p in (ROOT / "cpp" / "dflash").glob("*.cpp"))
    defined = set(re.findall(r"^[\w:<>&* ]+?\b(\w+)\([^;]*\{$", server + "\n" + runtime, flags=re.M))
    assert calls - defined == set()


def test_the_engine_and_the_server_run_one_step():
    for path in ("cpp/dflash/dflash-engine.cpp", "cpp/server/server-dflash.cpp"):
        source = (ROOT / path).read_text()
        assert "dflash_spec_propose(" in source and "dflash_spec_accept(" in source, path
        # the step's parts are dflash_spec's alone
        for part in ("dflash_adapt_plan_step", "dflash_adapt_offer_lookup", "dflash_adapt_proposed"):
            assert part not in source, (path, part)

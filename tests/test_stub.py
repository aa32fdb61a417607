"""The native module's stubs (_core/__init__.pyi and one .pyi per submodule, advertised by
py.typed) say what the module has: every public name, and for each function and method the
parameters in order, with the same ones optional. pybind11 functions carry their signatures in their docstrings only, which is where
mypy.stubtest cannot look, so this compares the stub with those."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from ikdflash import _core

STUBS = Path(_core.__file__).with_name("_core")
SUBMODULES = ("measure", "training")
SIGNATURE = re.compile(r"^(?:\d+\. )?(\w+)\((.*)\) -> ", re.MULTILINE)


def runtime_signatures(obj: object) -> list[list[tuple[str, bool]]]:
    """Each overload's parameters as (name, has a default), `self` left out."""
    signatures = []
    for _, params in SIGNATURE.findall(obj.__doc__ or ""):
        depth, current, parts = 0, "", []
        for ch in params:  # split at top-level commas (types hold brackets with commas)
            depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
            if ch == "," and depth == 0:
                parts.append(current)
                current = ""
            else:
                current += ch
        parts.append(current)
        parsed = [(p.split(":")[0].strip(), "=" in p) for p in parts if p.strip()]
        signatures.append([p for p in parsed if p[0] != "self"])
    return signatures


def stub_signature(fn: ast.FunctionDef) -> list[tuple[str, bool]]:
    args = fn.args.args
    defaults = [False] * (len(args) - len(fn.args.defaults)) + [True] * len(fn.args.defaults)
    return [(a.arg, d) for a, d in zip(args, defaults) if a.arg != "self"]


def public(names) -> set[str]:
    names = set(names)
    return {n for n in names if not n.startswith("_")} | ({"__init__"} & names)


def stub_members(module: str = "") -> dict[str, dict[str, ast.AST]]:
    tree = ast.parse((STUBS / f"{module or '__init__'}.pyi").read_text())
    members: dict[str, dict[str, ast.AST]] = {"": {}}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            members[""][node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[""][node.target.id] = node
        elif isinstance(node, ast.ClassDef):
            members[""][node.name] = node
            members[node.name] = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    return members


def test_the_stub_declares_every_public_name_and_nothing_else():
    stub = stub_members()
    assert public(stub[""]) | set(SUBMODULES) == public(dir(_core)) - {"annotations"}
    for name in SUBMODULES:
        assert public(stub_members(name)[""]) == public(dir(getattr(_core, name))), name
    for cls in (v for v in vars(_core).values() if inspect.isclass(v)):
        runtime = public(n for n in dir(cls) if n not in dir(object) or n == "__init__")
        assert public(stub[cls.__name__]) == runtime, cls.__name__


def test_every_stub_signature_matches_the_module():
    checked = 0
    scopes = [(_core, scope, members) for scope, members in stub_members().items()]
    scopes += [(getattr(_core, name), "", stub_members(name)[""]) for name in SUBMODULES]
    for module, scope, members in scopes:
        owner = getattr(module, scope) if scope else module
        for name, node in members.items():
            if not isinstance(node, ast.FunctionDef) or any(
                    isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
                continue
            runtime = runtime_signatures(getattr(owner, name))
            assert runtime, f"{scope}.{name}: no signature in its docstring"
            assert stub_signature(node) in runtime, f"{scope}.{name}: stub {stub_signature(node)}, module {runtime}"
            checked += 1
    assert checked > 40

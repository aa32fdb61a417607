"""List the known target/draft pairs and what of them is on this machine.

    ikdflash models              # every pair: its references, the local files, and the pair check
    ikdflash models --json       # the same as JSON

Nothing is downloaded: a file that is not in the cache is shown as missing, with the command
that fetches it (`ikdflash download NAME`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ikdflash.sources.references import DEFAULT_PAIR, HubError, known_pairs, resolve
from ikdflash.sources.pair import check_pair


def _file_facts(ref: str, role: str) -> dict[str, Any]:
    try:
        path = resolve(ref, role=role, offline=True)
    except (HubError, FileNotFoundError) as e:
        return {"ref": ref, "path": None, "missing": str(e)}
    return {"ref": ref, "path": str(path), "size_mib": round(path.stat().st_size / 2**20, 1)}


def describe(name: str, entry: dict[str, str]) -> dict[str, Any]:
    """A pair's references, local files and, when both are here, their quants and the pair check."""
    target, draft = _file_facts(entry["target"], "target"), _file_facts(entry["draft"], "draft")
    out: dict[str, Any] = {"name": name, "default": name == DEFAULT_PAIR, "target": target, "draft": draft}
    if target["path"] and draft["path"]:
        try:
            report = check_pair(target["path"], draft["path"])
        except (ValueError, OSError) as e:
            out["check"] = str(e)
            return out
        target["quant"], draft["quant"] = report.facts["target_quant"], report.facts["draft_quant"]
        out["check"] = "ok" if report.ok else "; ".join(report.problems)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    try:
        pairs = [describe(name, entry) for name, entry in sorted(known_pairs().items())]
    except HubError as e:
        print(f"ikdflash models: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(pairs, indent=1))
        return 0
    for pair in pairs:
        print(f"{pair['name']}{' (default)' if pair['default'] else ''}")
        for role in ("target", "draft"):
            facts = pair[role]
            if facts["path"] is None:
                where = f"not on this machine (ikdflash download {pair['name']})"
            else:
                quant = f", {facts['quant']}" if facts.get("quant") else ""
                where = f"{facts['path']} ({facts['size_mib']} MiB{quant})"
            print(f"  {role}: {facts['ref']}\n    {where}")
        if "check" in pair:
            print(f"  pair check: {pair['check']}")
    return 0

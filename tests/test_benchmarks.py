"""A benchmark's result file says where it was measured: one benchmark, run on the tiny always-right
pair, writes the provenance fields every result file carries (benchmarks/harness.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_result_file_records_where_it_was_measured(tmp_path):
    out = tmp_path / "overhead.json"
    subprocess.run([sys.executable, "-m", "benchmarks.server", "overhead", "--tokens", "16", "--repeats", "1", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads(out.read_text())
    where = result["provenance"]
    assert set(where) == {"commit", "patch_series", "backends", "build_features", "cpu", "threads", "date"}
    assert where["commit"] != "unknown" and len(where["patch_series"]) == 16 and "CPU" in where["backends"]
    assert where["threads"] == 2 and where["cpu"] and where["date"].endswith("Z")
    series = sorted((ROOT / "third_party" / "ik_llama" / "patches").glob("*"))  # what the build compiled
    assert where["patch_series"] == hashlib.sha256(b"".join(p.read_bytes() for p in series)).hexdigest()[:16]
    assert result["engine_tps"] > 0


BENCHMARKS = ROOT / "benchmarks"


def test_the_suite_has_six_entry_points_and_every_command_runs_a_main():
    import ast

    groups = sorted(p.parent.name for p in BENCHMARKS.glob("*/__main__.py"))
    single = sorted(p.stem for p in BENCHMARKS.glob("*.py") if '__name__ == "__main__"' in p.read_text())
    assert groups == ["adaptive", "passes", "server", "training"] and single == ["tau"]  # and `ikdflash bench`
    for group in groups:
        table = ast.literal_eval((BENCHMARKS / group / "__main__.py").read_text().split("COMMANDS = ", 1)[1].split("\n\n")[0])
        modules = {p.stem for p in (BENCHMARKS / group).glob("*.py")} - {"__init__", "__main__"}
        assert set(table.values()) == modules, group  # every module is a command, every command a module
        for module in modules:
            assert "\ndef main(" in (BENCHMARKS / group / f"{module}.py").read_text(), f"{group}/{module}"


def test_every_result_is_written_with_its_provenance():
    scripts = [p for p in BENCHMARKS.rglob("*.py") if p.name != "harness.py"]
    for script in scripts:
        text = script.read_text()
        if "--json" in text:
            assert "write_result(" in text and "args.json.write_text" not in text, script


def test_current_results_are_cited_and_the_archive_is_indexed():
    results = BENCHMARKS / "results"
    index = (results / "archive" / "INDEX.md").read_text()
    archived = {p.name for p in (results / "archive").iterdir()} - {"INDEX.md"}
    assert archived and all(f"`{name}`" in index for name in archived)
    docs = "".join(p.read_text() for p in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]
                   if p.name != "history.md")
    code = "".join(p.read_text() for p in BENCHMARKS.rglob("*.py"))
    for current in (p for p in results.glob("*/*") if p.parent.name != "archive"):
        assert current.name in docs or current.name in code, f"{current}: cited nowhere (archive it)"

"""A benchmark's result file says where it was measured: one benchmark, run on the tiny always-right
pair, writes the provenance fields every result file carries (benchmarks/provenance.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_result_file_records_where_it_was_measured(tmp_path):
    out = tmp_path / "overhead.json"
    subprocess.run([sys.executable, "-m", "benchmarks.overhead", "--tokens", "16", "--repeats", "1", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads(out.read_text())
    where = result["provenance"]
    assert set(where) == {"commit", "patch_series", "backends", "build_features", "cpu", "threads", "date"}
    assert where["commit"] != "unknown" and len(where["patch_series"]) == 16 and "CPU" in where["backends"]
    assert where["threads"] == 2 and where["cpu"] and where["date"].endswith("Z")
    assert result["engine_tps"] > 0

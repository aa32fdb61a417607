"""The stage logic of .ci/device-check, on the CPU in seconds: every stage is swapped for a
short shell command (DEVICE_CHECK_CMD_<stage>), so nothing is built and no suite runs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "device-check"
STAGES = ["build", "gpu_tests", "dflash2", "dspark", "lookup", "benchmarks", "adaptive", "suite"]


def run(out: Path, commands: dict[str, str], *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=environment(out, commands, env),
                          capture_output=True, text=True, timeout=60, check=False)


def environment(out: Path, commands: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEVICE_CHECK_", "STOP_AFTER"))}
    env.update({"OUT": str(out), "DEVICE_CHECK_CPU": "1", **extra})
    env.update({f"DEVICE_CHECK_CMD_{name}": cmd for name, cmd in commands.items()})
    return env


def summary(out: Path) -> list[str]:
    return (out / "summary.txt").read_text().splitlines()


def ended(lines: list[str]) -> list[str]:
    """The stages that ended, in order."""
    return [line.split(":")[0] for line in lines
            if line.split(":")[0] in STAGES and (": rc=" in line or ": skipped in" in line)]


def test_a_run_cut_off_in_the_second_stage_keeps_the_first_stages_result(tmp_path):
    out = tmp_path / "out"
    commands = {name: f"echo {name} ran" for name in STAGES}
    commands["gpu_tests"] = "echo placement; sleep 600"  # killed below, once it has started
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=environment(out, commands, {}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not (out / "gpu_tests.txt").is_file() or "placement" not in (out / "gpu_tests.txt").read_text():
            assert proc.poll() is None, "the script ended before its second stage started"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a run cut off at a time limit
        proc.wait()
    lines = summary(out)
    assert ended(lines) == ["build"]
    assert any(line.startswith("build: rc=0 in ") for line in lines)
    assert "gpu_tests: started" in "\n".join(lines)  # what was running when the time ran out
    assert (out / "build.txt").read_text().startswith("build ran")
    assert "placement" in (out / "gpu_tests.txt").read_text()


def test_stop_after_a_stage(tmp_path):
    r = run(tmp_path, {name: f"echo {name}" for name in STAGES}, STOP_AFTER="build")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = summary(tmp_path)
    assert ended(lines) == ["build"]
    assert lines[-1] == "stopped after build (STOP_AFTER)"
    assert not (tmp_path / "gpu_tests.txt").exists()


def test_every_stage_in_order_a_failure_reported_and_the_rest_still_run(tmp_path):
    commands = {name: f"echo {name}" for name in STAGES}
    commands["gpu_tests"] = "echo 1 failed; exit 1"
    commands["adaptive"] = "echo 'skipped: no pair'; exit 77"
    r = run(tmp_path, commands)
    assert r.returncode == 1
    lines = summary(tmp_path)
    assert ended(lines) == STAGES
    assert "gpu_tests: rc=1 in " in "\n".join(lines)
    assert any(line.startswith("adaptive: skipped in ") and line.endswith("skipped: no pair") for line in lines)
    assert lines[-1] == "done: rc=1"
    # a file per stage and the summary: the benchmarks' JSON is the tenth (.ci/device-check)
    assert len(list(tmp_path.iterdir())) <= len(STAGES) + 1


def test_a_failed_build_ends_the_run(tmp_path):
    r = run(tmp_path, {"build": "echo no nvcc; exit 3", "gpu_tests": "echo never"})
    assert r.returncode == 3
    lines = summary(tmp_path)
    assert ended(lines) == ["build"] and "build: rc=3 in " in "\n".join(lines)
    assert lines[-1] == "the build failed: no other stage can run"


def test_named_stages_only(tmp_path):
    r = run(tmp_path, {name: f"echo {name}" for name in STAGES}, "suite", "gpu_tests")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ended(summary(tmp_path)) == ["gpu_tests", "suite"]  # the script's order, not the arguments'
    assert run(tmp_path, {}, "tests").returncode == 2  # an unknown stage

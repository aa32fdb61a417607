""".ci/device-train's second call rehearsed on the CPU (DEVICE_TRAIN_CPU=1): the built-in pair's
saved answers captured and new prompts answered in PyTorch, the shipped draft trained on them,
and the drafts it returns load and speculate losslessly in the fork. ~7 minutes: slow."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ikdflash import Engine
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "device-train"


@pytest.mark.slow
def test_the_second_device_call_rehearses_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    target, _ = resolve_pair(DEFAULT_PAIR)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DEVICE_TRAIN_CPU="1", ANSWER_MINUTES="0.1", TRAIN_MINUTES="1",
               SAVED_LIMIT="4", PROMPTS_LIMIT="8")
    done = subprocess.run(["bash", str(SCRIPT), "train"], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    drafts = sorted(out.glob("draft-*.gguf"))
    assert (out / "report.json").is_file() and (out / "train.txt").is_file() and len(drafts) >= 2
    prompt = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    with Engine(target, n_ctx=512) as alone:
        expected = alone.generate(prompt, max_tokens=24).tokens
    with Engine(target, drafts[0], n_ctx=512) as pair:
        assert pair.speculate(prompt, max_tokens=24, n_max=4, adaptive=False).tokens == expected


def test_usage_names_the_three_commands():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert all(f".ci/device-train {verb}" in done.stderr for verb in ("pack", "stash", "train"))

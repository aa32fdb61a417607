"""The built-in pair: SmolLM2-135M-Instruct (from its PyPI wheel) and the trained sliding-window
draft shipped in ikdflash. Lossless over _core and llama-server, and the draft still predicts
(a floor far below its measured acceptance, so a broken build or a damaged file fails loudly)."""

from __future__ import annotations

import pytest

from ikdflash import Engine, Server
from ikdflash.chat import chat_template, render
from ikdflash.client import complete
from ikdflash.hub import DEFAULT_PAIR, resolve_pair
from ikdflash.pair import check_pair
from ikdflash.spectype import SpecType

QUESTIONS = [
    "What are three good habits for writing maintainable code?",
    "Explain photosynthesis in simple words.",
    "Write a short email asking a colleague to review my report.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
]


@pytest.fixture(scope="module")
def pair():
    return resolve_pair(DEFAULT_PAIR)


@pytest.fixture(scope="module")
def prompts(pair):
    target, _ = pair
    template = chat_template(target)
    return [render(template, [("user", q)], add_generation_prompt=True) for q in QUESTIONS]


def test_the_pair_fits(pair):
    report = check_pair(*pair)
    assert report.ok, report.problems
    assert report.facts["sliding_layers"] >= 1


def test_lossless_and_predicting_over_core(pair, prompts):
    with Engine(*pair, n_ctx=2048, n_threads=2) as engine:
        accepted = steps = 0
        for text in prompts:
            tokens = engine.target.tokenize(text, add_special=False, parse_special=True)
            spec = engine.speculate(tokens, max_tokens=64, n_max=4)
            plain = engine.generate(tokens, max_tokens=64)
            assert spec.tokens == plain.tokens
            assert spec.stats is not None
            accepted += spec.stats.accepted
            steps += spec.stats.steps
    tau = (accepted + steps) / steps
    assert tau >= 1.3, f"mean acceptance length {tau:.2f} over {steps} steps: the shipped draft no longer predicts"


def test_lossless_over_llama_server(pair, prompts, tmp_path):
    target, draft = pair
    with Server(target, ctx_size=2048, n_threads=2, log_file=tmp_path / "plain.log") as url:
        plain = [complete(url, p, max_tokens=48).text for p in prompts[:3]]
    args = ["--model-draft", str(draft), "--spec-type", SpecType(n_max=4).flag()]
    with Server(target, ctx_size=2048, n_threads=2, log_file=tmp_path / "spec.log", extra_args=args) as url:
        replies = [complete(url, p, max_tokens=48) for p in prompts[:3]]
    assert [r.text for r in replies] == plain
    assert sum(r.timings["draft_n_accepted"] for r in replies) > 0


def test_serve_runs_the_pair_with_no_model_arguments(pair):
    import subprocess

    out = subprocess.run(["ikdflash", "serve", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(pair[0]) in out.stdout and f"--model-draft {pair[1]}" in out.stdout

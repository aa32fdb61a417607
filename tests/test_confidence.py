"""Each draft token's confidence, calibrated against what the target keeps, sets how many of a
step's drafts are verified: the controller's cut on scripted confidences and costs (no model),
then the engine and llama-server, where it must never change the output."""

from __future__ import annotations

import numpy as np
import pytest
from ikdflash import Engine, Server
from ikdflash._core import BlockController
from ikdflash.serving.client import post_json
from ikdflash.serving.spectype import SpecType

CHEAP_ROWS = [1.0, 1.09, 1.3, 1.6, 1.9]  # a kept draft pays for its row
DEAR_ROWS = [1.0, 2.5, 3.5, 4.5, 5.5]    # a second row costs more than any draft token brings
DRAFT_MS = 0.2  # a draft token kept 70% of the time pays for the step and its row
TARGET = 1  # the token the scripted target commits at every position
SURE, UNSURE = (0.9, 1.0), (0.0, 0.2)  # the draft's confidence in tokens the target keeps / rejects


def drive(ctl: BlockController, steps: int, seed: int = 0) -> list[tuple[list[bool], int]]:
    """Steps where the draft proposes what the controller plans, each token right 70% of the
    time: a right one with a confidence in SURE, a wrong one in UNSURE. Returns each drafting
    step's (which of its tokens were right, how many were verified)."""
    rng = np.random.default_rng(seed)
    seen = []
    for _ in range(steps):
        n_draft, n_verify = ctl.plan(4)
        right = [bool(r) for r in rng.random(n_draft) < 0.7]
        confidence = [float(rng.uniform(*(SURE if r else UNSURE))) for r in right]
        tokens = [TARGET if r else 2 for r in right]
        if n_draft:
            n_verify = ctl.proposed(tokens, confidence)
            seen.append((right, n_verify))
        kept = 0
        while kept < n_verify and tokens[kept] == TARGET:
            kept += 1
        ctl.committed(n_verify, [TARGET] * (kept + 1))
    return seen


def leading_right(right: list[bool]) -> int:
    return next((i for i, r in enumerate(right) if not r), len(right))


def test_a_step_verifies_the_drafts_before_the_first_unsure_one():
    """Once calibrated, a sure token is kept ~always and an unsure one ~never: on rows that a kept
    token pays for, the step verifies every sure token up to the first unsure one (more than
    planned where the plan's k is shorter) and never a row after it, whose token is priced as
    kept almost never."""
    ctl = BlockController(4, CHEAP_ROWS, DRAFT_MS)
    steps = drive(ctl, 400)
    assert len(steps) > 300
    late = steps[150:]
    assert all(n_verify == leading_right(right) for right, n_verify in late), late[:20]
    assert ctl.stats()["n_confidence_cut"] > 0


def test_no_row_is_verified_where_rows_cost_more_than_they_bring():
    """Where a second row costs 2.5 one-row passes, even a token kept every time does not pay:
    whatever the draft proposes and however sure it is, no step verifies it."""
    ctl = BlockController(4, DEAR_ROWS, DRAFT_MS)
    for _ in range(50):  # the draft proposes whether or not the plan drafts
        ctl.plan(4)
        assert ctl.proposed([TARGET] * 4, [0.99] * 4) == 0
        ctl.committed(0, [TARGET])


def test_leaving_the_passes_shape_for_one_step_pays_both_rebuilds():
    """A token at confidence 0.05 is not worth its row (1.05 tokens for 1.09 passes against 1 for
    1): the step verifies none. But where passes of another shape cost 0.1 more (the target
    rebuilds its graph) and the last pass had 2 rows, a one-row step would rebuild twice, leaving
    that shape and coming back (1 token for 1.2), and the row is verified after all. Priced at a
    quarter of one rebuild, as a plan prices a k (1 for 1.025), it would be cut."""
    def cut(rebuild_ms: float) -> int:
        ctl = BlockController(1, [1.0, 1.09], DRAFT_MS)
        for _ in range(30):  # alternating shapes: every pass rebuilds
            ctl.observe_pass(1, 1.0 + rebuild_ms)
            ctl.observe_pass(2, 1.09 + rebuild_ms)
        assert ctl.plan(1) == (1, 1)
        return ctl.proposed([TARGET], [0.05])

    assert cut(0.0) == 0
    assert cut(0.1) == 1


def test_without_confidences_the_plan_stands():
    ctl = BlockController(4, CHEAP_ROWS, DRAFT_MS, adaptive=False)
    assert ctl.plan(4) == (4, 4)
    assert ctl.proposed([2] * 4, [0.01] * 4) == 4  # a fixed block length verifies n_max
    ctl = BlockController(4, CHEAP_ROWS, DRAFT_MS)
    n_draft, n_verify = ctl.plan(4)
    assert ctl.proposed([TARGET] * n_draft) == n_verify
    with pytest.raises(ValueError, match="confidence has 1 values for 2 tokens"):
        ctl.proposed([1, 2], [0.5])


def test_the_calibration_predicts_what_was_kept():
    """Per tenth of predicted acceptance holding at least 5% of the tokens: the mean prediction is
    within 0.1 of the share kept."""
    ctl = BlockController(4, CHEAP_ROWS, DRAFT_MS)
    drive(ctl, 400, seed=1)
    table = ctl.stats()["calibration"]
    total = sum(n for n, _, _ in table)
    assert total > 500
    for n, kept, predicted in table:
        if n >= 0.05 * total:
            assert abs(predicted / n - kept / n) < 0.1, table


# --- in the engine and llama-server ---------------------------------------------------------------

def test_the_engine_cuts_by_confidence_losslessly(swa_pairs):
    """The cut changes how many drafts are verified, never the tokens; off, the draft computes no
    confidences and the statistics say none were calibrated."""
    target, draft = swa_pairs["llama"]
    with Engine(target, draft, n_ctx=512, n_batch=32) as engine:
        prompt = engine.target.tokenize("one two three four five six seven eight " * 8, add_special=False)
        plain = engine.generate(prompt, max_tokens=64).tokens
        on = engine.speculate(prompt, max_tokens=64, n_max=4, lookup=False, confidence=True)
        off = engine.speculate(prompt, max_tokens=64, n_max=4, lookup=False)
        with pytest.raises(TypeError, match="confidence must be True or False, got 1"):
            engine.speculate(prompt, max_tokens=4, confidence=1)
    assert on.tokens == off.tokens == plain
    drafted_steps = on.stats.steps - on.stats.steps_by_verified[0] + on.stats.probes
    assert drafted_steps == 0 or sum(n for n, _, _ in on.stats.calibration) > 0
    assert off.stats.confidence_cuts == 0 and sum(n for n, _, _ in off.stats.calibration) == 0
    for predicted, kept, n in on.stats.reliability:
        assert 0.0 <= predicted <= 1.0 and 0.0 <= kept <= 1.0 and n > 0


def test_the_server_cuts_by_confidence_losslessly(swa_pairs, tmp_path):
    """confidence=1 and the default (0) give the target's own replies; the key is the fork's."""
    assert SpecType(confidence=True).flag() == "dflash:confidence=1"
    assert SpecType.parse("dflash:confidence=0").confidence is False
    target, draft = swa_pairs["llama"]
    request = {"prompt": "one two three four five six seven eight " * 6, "n_predict": 48, "temperature": 0,
               "ignore_eos": True, "cache_prompt": False}
    with Server(target, ctx_size=1024, n_threads=2) as url:
        plain = post_json(url + "/completion", request)["content"]
    for spec in (SpecType(n_max=4, lookup=False, confidence=True), SpecType(n_max=4, lookup=False)):
        with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "s.log",
                    extra_args=["--model-draft", str(draft), "--spec-type", spec.flag()]) as url:
            assert post_json(url + "/completion", request)["content"] == plain, spec.flag()


@pytest.mark.parametrize("adaptive", [False, True])
def test_conf_min_verifies_nothing_from_the_first_token_below_it(adaptive):
    """llama.cpp's fixed floor, with either kind of controller and without the calibrated cut:
    never more than the plan, and never a token from the first whose confidence is below it."""
    ctl = BlockController(4, CHEAP_ROWS, DRAFT_MS, adaptive=adaptive, confidence_cut=False, conf_min=0.5)
    rng = np.random.default_rng(1)
    for _ in range(200):
        n_draft, n_verify = ctl.plan(4)
        if n_draft == 0:
            ctl.committed(0, [TARGET])
            continue
        confidence = [float(c) for c in rng.uniform(0.0, 1.0, n_draft)]
        below = next((i for i, c in enumerate(confidence) if c < 0.5), n_draft)
        verified = ctl.proposed([TARGET] * n_draft, confidence)
        assert verified == min(n_verify, below)
        ctl.committed(verified, [TARGET] * (verified + 1))
    assert ctl.stats()["n_confidence_cut"] == 0
    with pytest.raises(ValueError, match=r"conf_min must be in \[0, 1\], got 1.5"):
        BlockController(4, CHEAP_ROWS, DRAFT_MS, conf_min=1.5)

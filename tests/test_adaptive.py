"""The adaptive block length: the controller on its own (acceptance patterns and pass costs given,
no model), then in the engine and in llama-server, where it must never change the output.

The controller's choices depend on pass costs; tests that look at its choices fix them through
IKDFLASH_COSTS ("draft_ms:pass_ms_1,pass_ms_2,...") so that they are the same on any machine."""

from __future__ import annotations

import random
import re

import pytest
from ikdflash import Engine
from ikdflash._core import BlockController

# A CPU-like machine: a step of 5 rows costs 1.9 one-row passes, a draft step 0.7.
CPU_PASSES = [1.0, 1.09, 1.3, 1.6, 1.9]
CPU_DRAFT = 0.7
# A GPU-like one: rows are nearly free, the draft is cheap.
GPU_PASSES = [1.0, 1.01, 1.02, 1.03, 1.04]
GPU_DRAFT = 0.1


def run_steps(ctl: BlockController, steps: int, draft_is_right, n_limit: int = 4) -> list[int]:
    """Drive ctl for `steps` steps of a generation whose target commits token 1 at every position
    and whose draft proposes 1 where draft_is_right(step) and 2 elsewhere; returns each step's k."""
    chosen = []
    for step in range(steps):
        n_draft, n_verify = ctl.plan(n_limit)
        assert 0 <= n_verify <= n_draft <= n_limit
        proposal = [1 if draft_is_right(step) else 2] * n_draft
        if n_draft:
            ctl.proposed(proposal)
        accepted = 0
        while accepted < n_verify and proposal[accepted] == 1:
            accepted += 1
        ctl.committed(n_verify, [1] * (accepted + 1))
        chosen.append(n_verify)
    return chosen


def run_coin_flips(ctl: BlockController, steps: int, seed: int) -> list[int]:
    """Drive ctl for `steps` steps where the draft's token 1 is kept at random half the time (a
    seeded coin) and every later one is missed; returns each step's k."""
    coin = random.Random(seed)
    chosen = []
    for _ in range(steps):
        n_draft, n_verify = ctl.plan(4)
        proposal = [1 if coin.random() < 0.5 else 2] + [2] * (n_draft - 1) if n_draft else []
        if n_draft:
            ctl.proposed(proposal)
        ctl.committed(n_verify, [1] * (1 + int(n_verify > 0 and proposal[0] == 1)))
        chosen.append(n_verify)
    return chosen


def test_a_useless_draft_settles_at_zero_and_probes_ever_less():
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = run_steps(ctl, 200, lambda step: False)
    assert max(chosen[5:]) == 0, chosen[:20]  # settled within 5 steps
    probes = ctl.stats()["n_probes"]
    assert probes <= 6, probes  # the first plain step, two more misses, then every 70 steps (1%)
    assert ctl.stats()["steps_by_verified"][0] >= 195


def test_an_always_right_draft_settles_at_n_max():
    for passes, draft in ((CPU_PASSES, CPU_DRAFT), (GPU_PASSES, GPU_DRAFT)):
        ctl = BlockController(4, passes, draft)
        chosen = run_steps(ctl, 60, lambda step: True)
        assert set(chosen[10:]) == {4}, chosen


def test_an_always_right_draft_reaches_n_max_where_one_draft_does_not_pay():
    """A tiny target whose passes cost mostly their overhead (the always-right pair of
    benchmarks/server/overhead.py on this CPU: 2 rows 1.81x one row, 5 rows 3.16x, a draft step 0.5x):
    one draft never pays, four kept ones do. One-token probes only ever measured position 1, so
    the controller stayed at k = 0 and probed every step (0.66x the target alone)."""
    ctl = BlockController(4, [1.0, 1.81, 2.37, 2.93, 3.16], [0.51, 0.53, 0.57, 0.58])
    chosen = run_steps(ctl, 60, lambda step: True)
    assert set(chosen[10:]) == {4}, chosen


def test_it_comes_back_from_zero_when_the_draft_becomes_right():
    """Prose (the draft useless) that turns into copying a quoted passage (the draft right)."""
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = run_steps(ctl, 300, lambda step: step >= 150)
    assert max(chosen[20:150]) == 0
    # a first kept probe within the longest interval (70 steps: probes cost 1%), then probes at
    # ever shorter intervals while they hit raise the estimate to where drafting pays
    back = next(i for i in range(150, 300) if chosen[i] > 0)
    assert back <= 150 + 70 + 20, back
    assert set(chosen[back + 10:]) == {4}


def test_a_draft_kept_as_often_as_expected_is_probed_as_seldom_as_a_useless_one():
    """Token 1 kept at random half the time and the later ones never, short of paying on the
    CPU-like costs (k = 1 needs 0.79): a hit is what the estimate expects, not news that the draft
    turned right, so probes stay near the longest interval (70 steps here). Halving the interval at
    each hit probed 9.5% of the plain steps."""
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = run_coin_flips(ctl, 2000, seed=7)
    assert chosen.count(0) >= 0.97 * 2000  # a run of hits may look like a turn for a few steps
    useless = BlockController(4, CPU_PASSES, CPU_DRAFT)
    run_steps(useless, 2000, lambda step: False)
    probes, floor = ctl.stats()["n_probes"], useless.stats()["n_probes"]
    assert floor <= probes <= 2 * floor, (probes, floor)  # ~2000 / 70 + the first few


def test_a_draft_that_pays_by_a_little_is_not_held_at_zero_by_a_run_of_misses():
    """Token 1 kept at random half the time on costs where one draft pays from 32% (the built-in
    pair's case after patch `iqk-few-row-Q4_1-products-take-8-weight-rows-at-a-ti`: k = 1 runs at ~1.14x a plain step). A few
    misses in a row drop the quick estimate under break-even; at k = 0 it then saw only a probe every ~70 steps, and the
    controller spent 69% of the steps there. Plain steps now return it toward the slow estimate."""
    ctl = BlockController(4, [1.0, 1.14, 1.3, 1.5, 1.7], 0.18)
    chosen = run_coin_flips(ctl, 2000, seed=11)
    assert chosen.count(1) >= 0.8 * 2000, (chosen.count(0), chosen.count(1))


def test_a_middling_draft_verifies_what_pays():
    """Position 1 kept 90% of the time, the later ones never: on the CPU-like costs one draft pays
    (E = 1.9 tokens for 1.79 passes) and more do not."""
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = []
    for step in range(400):
        n_draft, n_verify = ctl.plan(4)
        proposal = [1 if step % 10 else 2] + [2] * (n_draft - 1) if n_draft else []
        if n_draft:
            ctl.proposed(proposal)
        accepted = int(n_verify > 0 and proposal[0] == 1)
        ctl.committed(n_verify, [1] * (accepted + 1))
        chosen.append(n_verify)
    assert chosen[50:].count(1) >= 0.9 * 350, chosen[50:100]
    p = ctl.acceptance()
    assert 0.6 < p[0] < 1.0 and p[1] < 0.3


def test_fixed_mode_always_verifies_the_limit():
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT, adaptive=False)
    assert run_steps(ctl, 20, lambda step: False) == [4] * 20
    assert ctl.plan(2) == (2, 2) and ctl.plan(0) == (0, 0) and ctl.plan(9) == (4, 4)


def test_a_new_request_forgets_its_statistics_but_not_what_it_learnt():
    kept, renewed = BlockController(4, CPU_PASSES, CPU_DRAFT), BlockController(4, CPU_PASSES, CPU_DRAFT)
    for ctl in (kept, renewed):
        run_steps(ctl, 50, lambda step: False)
    before = renewed.acceptance()
    renewed.reset()
    assert renewed.stats() == {"steps_by_verified": [0] * 5, "n_probes": 0, "n_load_plain": 0, "n_lookup_steps": 0,
                               "n_confidence_cut": 0, "calibration": [(0, 0, 0.0)] * 10}
    assert renewed.acceptance() == pytest.approx(before)
    # ... at half weight: the new request's first observation (draft token 1 kept) moves it further
    for ctl in (kept, renewed):
        ctl.proposed([1])
        ctl.committed(0, [1])
    assert renewed.acceptance()[0] > kept.acceptance()[0] > before[0]


def test_a_new_request_is_probed_at_its_first_plain_step():
    """A request after one the draft never got right may be one it does (a listing after a chat
    answer): its first plain step probes, whatever interval the last request had reached."""
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    run_steps(ctl, 200, lambda step: False)
    assert ctl.plan(4) == (0, 0)  # deep into the back-off
    ctl.reset()
    assert ctl.plan(4) == (1, 0)


def test_rebuilding_the_graph_keeps_the_block_length_from_flipping():
    """Where drafting pays about what it costs (n_max 1, the draft right five steps in a row, then
    wrong five), a k whose pass shape differs from the last pass's also pays for the rebuilt graph:
    the more that costs, the less often k changes."""
    def switches(rebuild_ms: float) -> int:
        ctl = BlockController(1, [1.0, 1.3], 0.15)
        chosen = []
        for step in range(400):
            n_draft, k = ctl.plan(1)
            right = (step // 5) % 2 == 0
            if n_draft:
                ctl.proposed([1 if right else 2] * n_draft)
            ctl.observe_pass(k + 1, [1.0, 1.3][k] + (rebuild_ms if chosen and chosen[-1] != k else 0.0))
            ctl.committed(k, [1] * (2 if k and right else 1))
            chosen.append(k)
        return sum(a != b for a, b in zip(chosen, chosen[1:]))

    free, dear, dearer = switches(0.0), switches(0.5), switches(1.0)
    assert free > dear > dearer, (free, dear, dearer)


def test_a_stale_pass_cost_is_measured_again():
    """A 5-row pass calibrated too dear (2.0 one-row passes against a true 1.2) kept an
    always-right draft at k = 3, where it was never measured again; a row count unmeasured for
    256 passes is tried for two steps, and the second one's time replaces its estimate."""
    true = [1.0, 1.05, 1.1, 1.15, 1.2]
    ctl = BlockController(4, [1.0, 1.05, 1.1, 1.15, 2.0], 0.3)
    chosen = []
    for _ in range(1200):
        n_draft, k = ctl.plan(4)
        if n_draft:
            ctl.proposed([1] * n_draft)
        ctl.observe_pass(k + 1, true[k] + (0.1 if chosen and chosen[-1] != k else 0.0))
        ctl.committed(k, [1] * (k + 1))
        chosen.append(k)
    assert set(chosen[:200]) == {3}
    assert set(chosen[-200:]) == {4}, chosen[-200:]


STALE_PASSES = 256  # k_stale_passes in dflash-costs.h


def test_a_start_up_calibration_three_times_too_dear_is_corrected_and_drafting_resumes():
    """A server calibrated its passes on a busy machine: every pass of 2 rows or more measured 3x
    what it costs. At k = 0 no such pass runs again, so drafting stayed off for good. Once the
    2-row cost has gone STALE_PASSES passes unmeasured, the next due probe verifies its draft for
    two steps instead, the second pass's time replaces the estimate, and a draft kept 4 times in
    5 (a seeded coin: misses every fifth step would meet probes 15 steps apart at every one)
    drafts again. The bound: drafting resumes within STALE_PASSES + 2 probe intervals (30 steps
    here) of plain steps."""
    true = [1.0, 1.17, 1.44, 1.95, 2.74]
    ctl = BlockController(4, [true[0]] + [3 * ms for ms in true[1:]], 0.15)
    coin = random.Random(5)
    chosen = []
    for _ in range(STALE_PASSES + 200):
        n_draft, k = ctl.plan(4)
        right = coin.random() < 0.8
        if n_draft:
            ctl.proposed([1] * n_draft)
        ctl.observe_pass(k + 1, true[k])
        ctl.committed(k, [1] * (k + 1) if right else [2])
        chosen.append(k)
    bound = STALE_PASSES + 2 * 30
    assert set(chosen[:STALE_PASSES]) == {0}, chosen[:STALE_PASSES]   # the dear calibration holds it off
    resumed = next(i for i in range(STALE_PASSES, len(chosen) - 10) if min(chosen[i:i + 10]) > 0)
    assert resumed <= bound, chosen[STALE_PASSES:]
    assert sum(k > 0 for k in chosen[-100:]) >= 90, chosen[-100:]


def test_a_useless_draft_does_not_measure_a_stale_pass_again():
    """The same stale 2-row cost under a draft that is never kept: no pass cost could make it pay
    (its draft step alone costs more than its tokens bring), so a due probe stays a probe and no
    step verifies a draft to measure the rows again."""
    true = [1.0, 1.17, 1.44, 1.95, 2.74]
    ctl = BlockController(4, [true[0]] + [3 * ms for ms in true[1:]], 0.15)
    chosen = []
    for _ in range(3 * STALE_PASSES):
        n_draft, k = ctl.plan(4)
        if n_draft:
            ctl.proposed([2] * n_draft)
        ctl.observe_pass(k + 1, true[k])
        ctl.committed(k, [1])
        chosen.append(k)
    assert set(chosen[10:]) == {0}, [i for i, k in enumerate(chosen) if k]
    assert ctl.stats()["n_probes"] >= 3  # it went on probing


def test_an_estimate_reaches_one_for_a_draft_that_is_always_right():
    """The prior is discounted like an observation (down to a hundredth of one): a draft that is
    always right is not held below n_max by a prior that never fades (0.955 per position, 0.83
    over four)."""
    ctl = BlockController(4, GPU_PASSES, GPU_DRAFT)
    run_steps(ctl, 100, lambda step: True)
    assert min(ctl.acceptance()) > 0.999, ctl.acceptance()  # 0.9995 with the prior's floor


def test_a_step_proposes_one_token_past_those_it_verifies_now_and_then_and_a_probe_one():
    """Position k + 1 stays measured (so the controller sees when a longer block pays), by every
    fourth verifying step below n_max, not by every step (a draft step's head runs on every token
    it proposes); a probe only asks whether the first draft token is right, which is what decides
    drafting at all."""
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    plans = []
    for step in range(200):
        n_draft, n_verify = ctl.plan(4)
        plans.append((n_draft, n_verify))
        proposal = [1 if step % 10 else 2] + [2] * (n_draft - 1) if n_draft else []
        if n_draft:
            ctl.proposed(proposal)
        accepted = int(n_verify > 0 and proposal[0] == 1)
        ctl.committed(n_verify, [1] * (accepted + 1))
    assert all(d in (v, min(v + 1, 4)) for d, v in plans if v > 0), plans
    # past the first steps (every step proposes k + 1 until that position has 4 observations)
    steady = [(d, v) for d, v in plans[50:] if 0 < v < 4]
    assert steady and abs(sum(d > v for d, v in steady) - len(steady) / 4) <= 1, plans
    useless = BlockController(4, CPU_PASSES, CPU_DRAFT)
    run_steps(useless, 100, lambda step: False)
    assert useless.plan(4) in ((0, 0), (1, 0))
    assert all(useless.plan(4) in ((0, 0), (1, 0)) for _ in range(100))


def test_the_draft_cost_of_the_tokens_proposed_decides():
    """An always-right draft on cheap passes: at a flat draft cost the controller verifies n_max;
    where each token proposed makes the draft step dearer (its head runs on that many rows) it
    stays at two drafts, the best rate (3 tokens for 1.1 plus a draft step of 0.5, and of 1.5
    every fourth step: 1.85 in all)."""
    passes = [1.0, 1.05, 1.1, 1.15, 1.2]
    flat = BlockController(4, passes, 0.3)
    steep = BlockController(4, passes, [0.3, 0.5, 1.5, 3.0])
    assert set(run_steps(flat, 40, lambda step: True)[10:]) == {4}
    assert set(run_steps(steep, 40, lambda step: True)[10:]) == {2}


def test_a_draft_step_after_plain_passes_prices_probes_not_drafting():
    """A draft step first projects the context rows the target added since the one before: after
    plain passes (a probe, or the first drafting step after them) that is much of its time. Such
    steps leave the price of drafting alone; steps in a run of drafting steps set it."""
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    for _ in range(50):  # a probe every 10 plain passes, each 3 times a drafting step's time
        for _ in range(10):
            ctl.observe_pass(1, 1.0)
        ctl.observe_draft(1, 3 * CPU_DRAFT)
    assert ctl.draft_ms(1) == pytest.approx(CPU_DRAFT)
    for _ in range(50):  # k = 1: a draft step, then its 2-row pass
        ctl.observe_draft(1, 2 * CPU_DRAFT)
        ctl.observe_pass(2, CPU_PASSES[1])
    assert ctl.draft_ms(1) == pytest.approx(2 * CPU_DRAFT, rel=0.02)


# --- beside other sequences (a server's slots) -------------------------------------------------

# passes cost the same up to 6 rows and 100 times as much past them: one slot's block of 5 rows
# fits beside another's one-token decode, not beside its block
ROOMY_THEN_FULL = [1.0] * 6 + [100.0] * 4


def test_alone_it_plans_as_before_beside_others_it_prices_the_shared_pass():
    alone, beside_nothing = BlockController(4, ROOMY_THEN_FULL, 0.1), BlockController(4, ROOMY_THEN_FULL, 0.1)
    assert alone.plan(4) == beside_nothing.plan(4, (0, 0.0, 0.0)) == (4, 4)
    light, heavy = BlockController(4, ROOMY_THEN_FULL, 0.1), BlockController(4, ROOMY_THEN_FULL, 0.1)
    assert light.plan(4, (1, 1.0, 0.0)) == (4, 4)       # 6 rows: as cheap as one
    assert heavy.plan(4, (5, 5.0, 0.1))[1] == 0          # 7 rows and more: a one-token decode
    assert heavy.stats()["n_load_plain"] == 1 and light.stats()["n_load_plain"] == 0


def test_a_draft_step_is_paid_by_every_slot_of_the_step():
    """Free rows, but a draft step (half a pass) runs before the shared pass: alone it pays for
    the draft's expected tokens, beside three slots' tokens it costs them more than it adds."""
    flat = [1.0] * 8
    assert BlockController(4, flat, 0.5).plan(4)[1] == 4
    busy = BlockController(4, flat, 0.5)
    assert busy.plan(4, (3, 3.0, 0.0))[1] == 0 and busy.stats()["n_load_plain"] == 1


def test_rows_that_cost_nothing_are_drafted_beside_any_load():
    ctl = BlockController(4, [1.0] * 20, 0.01)
    assert ctl.plan(4, (15, 15.0, 0.03)) == (4, 4) and ctl.stats()["n_load_plain"] == 0


def test_a_row_count_measured_dearer_than_the_next_does_not_make_that_row_free():
    """A 4-slot server's 3-row passes ran while a slot between requests had the HTTP thread beside
    them, and their estimate rose above the 4-row one: one more row then looked cheaper than none,
    and beside two slots' tokens the draft was verified where it was kept 2-4 times in 10. A row
    count measured cheaper than a smaller one is priced at that one plus the median rise of a row."""
    def plan_beside_two(three_rows_ms: float) -> int:
        ctl = BlockController(4, [1.0, 1.15, 1.3, 1.45, 1.6, 1.75, 1.9, 2.05], 0.15)
        run_steps(ctl, 200, lambda step: step % 10 < 3)  # kept 3 times in 10
        for _ in range(100):  # runs of 4-row passes at their cost, of 3-row passes at three_rows_ms
            for _ in range(4):
                ctl.observe_pass(4, 1.45)
            for _ in range(3):
                ctl.observe_pass(3, three_rows_ms)
        return ctl.plan(4, (2, 2.0, 0.0))[1]

    assert plan_beside_two(1.3) == 0
    assert plan_beside_two(1.3 * 1.4) == 0


def test_one_row_passes_set_the_scale_and_runs_of_two_rows_their_own_shape():
    """A 2-row pass calibrated at 1.1 one-row passes costs 1.6 in the loop (after a draft step).
    Runs of such passes between one-row ones (each run's first rebuilt the graph and does not
    count) must teach the controller that a 2-row step costs 1.6 and a one-row step 1.0, so that a
    draft kept half the time (1.5 tokens for 1.6 + 0.15) is not verified. When every pass moved
    the one-row scale too, the runs raised it to 1.17 and left the shape at 1.29: plain decoding
    looked dearer than drafting."""
    ctl = BlockController(1, [1.0, 1.1], 0.15)
    run_steps(ctl, 200, lambda step: step % 2 == 0)
    assert 0.35 < ctl.acceptance()[0] < 0.65, ctl.acceptance()
    for _ in range(8):
        for _ in range(3):
            ctl.observe_pass(1, 1.0)
        ctl.observe_pass(2, 1.6 + 0.15)  # after one-row passes: rebuilt
        for _ in range(3):
            ctl.observe_pass(2, 1.6)
    assert ctl.plan(1)[1] == 0


# (passes per row count, draft step, the others' rows, tokens and draft ms): probes expected?
PROBE_CASES = {
    # a pass costs the same up to 8 rows, a draft step as much: a draft kept 90% of the time
    # would pay alone and beside one slot's token, not beside three slots' tokens
    "alone": ([1.0] * 8, 1.0, None, True),
    "light": ([1.0] * 8, 1.0, (1, 1.0, 0.0), True),
    "busy": ([1.0] * 8, 1.0, (3, 3.0, 0.0), False),
    # a cheap draft step: the prior alone pays, a block beside three slots' tokens does not
    "held": ([1.0] * 5 + [3.0] * 3, 0.2, (3, 3.0, 0.0), False),
}


@pytest.mark.parametrize("case", PROBE_CASES)
def test_probes_only_where_their_answer_could_change_k(case):
    """A probe asks whether the draft turned right; beside other slots its draft step delays
    their tokens too. A slot probes alone and beside a light load, not where even a draft kept
    90% of the time would not pay, nor where only the load holds it at one token a step. With a
    draft step as dear as a pass, probes cost their 1% share alone every 100 steps, beside one
    slot every 200."""
    passes, draft, others, probes = PROBE_CASES[case]
    ctl = BlockController(4, passes, draft)
    plans = [ctl.plan(4, others) for _ in range(300)]
    assert all(verified == 0 for _, verified in plans)
    probed_at = [step for step, (drafted, _) in enumerate(plans) if drafted > 0]
    assert bool(probed_at) == probes and len(probed_at) == ctl.stats()["n_probes"], ctl.stats()
    assert ctl.stats()["n_load_plain"] == (300 if case == "held" else 0)
    # alone a new request is probed at its first plain step; beside another slot, whose tokens
    # each probe delays too, not before the interval that keeps probes at their share of the time
    if case == "alone":
        assert probed_at[0] == 0
    elif probes:
        assert probed_at[0] >= 100, probed_at


@pytest.mark.parametrize("kwargs, message", [
    ({"n_max": -1, "pass_ms": [1.0], "draft_ms": 1.0}, "n_max must be in 0..63"),
    ({"n_max": 2, "pass_ms": [1.0, 1.0], "draft_ms": 1.0}, "1..3 rows at least"),
    ({"n_max": 1, "pass_ms": [1.0, -1.0], "draft_ms": 1.0}, "must be positive"),
    ({"n_max": 1, "pass_ms": [1.0, 1.0], "draft_ms": 0.0}, "draft_ms must be positive"),
    ({"n_max": 2, "pass_ms": [1.0, 1.0, 1.0], "draft_ms": [1.0, 1.0, 1.0]}, "1..2 tokens, got 3"),
])
def test_bad_controller_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockController(**kwargs)


# --- in the engine ------------------------------------------------------------------------------

def test_the_engine_settles_at_n_max_for_an_always_right_draft(oracle_pair, monkeypatch):
    monkeypatch.setenv("IKDFLASH_COSTS", "0.7:1,1.09,1.3,1.6,1.9")
    target, right, _ = oracle_pair
    with Engine(target, right, n_ctx=256) as engine:
        out = engine.speculate("hello there", max_tokens=61, n_max=4, lookup=False)
    st = out.stats
    assert out.tokens == [0] * 61
    # the prior (every position a coin flip) does not pay on these costs: one probe, then n_max
    assert st.probes == 1 and st.steps_by_verified[4] >= st.steps - 4, st.steps_by_verified
    assert st.drafted == sum(k * n for k, n in enumerate(st.steps_by_verified))
    assert st.acceptance == 1.0


def test_the_engine_settles_at_zero_for_a_useless_draft(oracle_pair, monkeypatch):
    monkeypatch.setenv("IKDFLASH_COSTS", "0.7:1,1.09,1.3,1.6,1.9")
    target, _, wrong = oracle_pair
    with Engine(target, wrong, n_ctx=256) as engine:
        out = engine.speculate("hello there", max_tokens=100, n_max=4, lookup=False)
        fixed = engine.speculate("hello there", max_tokens=100, n_max=4, adaptive=False)
    st = out.stats
    assert out.tokens == fixed.tokens == [0] * 100
    assert sum(st.steps_by_verified[1:]) <= 3, st.steps_by_verified
    assert st.plain_share >= 0.95 and 1 <= st.probes <= 8
    # fixed: n_max every step but the last ones, where the budget leaves room for fewer
    assert fixed.stats.steps_by_verified == [1, 1, 1, 1, 95] and fixed.stats.probes == 0


def test_a_step_at_k_zero_runs_no_draft_graph(oracle_pair, monkeypatch):
    """Where drafting never pays, the draft computes only for probes: each projects the context
    rows that arrived since the draft last ran (one graph, fewer than 256 rows here) and steps
    (one graph). The other steps, 9 in 10 and more, run no draft graph at all."""
    monkeypatch.setenv("IKDFLASH_COSTS", "0.7:1,1.09,1.3,1.6,1.9")
    target, _, wrong = oracle_pair
    with Engine(target, wrong, n_ctx=256) as engine:
        before = engine.draft.info()["graph_computes"]
        out = engine.speculate("hello there", max_tokens=150, n_max=4, lookup=False)
        computes = engine.draft.info()["graph_computes"] - before
    st = out.stats
    plain_steps = st.steps_by_verified[0]
    assert plain_steps >= 0.9 * st.steps and st.probes >= 1, st.steps_by_verified
    drafting_steps = st.steps - plain_steps
    assert computes <= 2 * (st.probes + drafting_steps), (computes, st.probes, drafting_steps)


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_adaptive_speculation_is_lossless_whatever_the_costs(swa_pairs, arch, monkeypatch):
    """Costs that make every k pay, none pay, or some pay: the tokens are the target's."""
    target, draft = swa_pairs[arch]
    with Engine(target, draft, n_ctx=512, n_batch=32) as engine:
        prompt = engine.target.tokenize("the quick brown fox jumps over the lazy dog " * 6, add_special=False)
        plain = engine.generate(prompt, max_tokens=48).tokens
        for costs in ("0.01:1", "5:1,3,6,9,12", "0.7:1,1.09,1.3,1.6,1.9"):
            monkeypatch.setenv("IKDFLASH_COSTS", costs)
            with Engine(target, draft, n_ctx=512, n_batch=32) as fresh:  # costs are read once an engine
                out = fresh.speculate(prompt, max_tokens=48, n_max=4)
            assert out.tokens == plain, costs
            assert sum(out.stats.steps_by_verified) == out.stats.steps
        monkeypatch.delenv("IKDFLASH_COSTS")
        assert engine.speculate(prompt, max_tokens=48, n_max=4).tokens == plain  # timed on this machine


def test_bad_adaptive_values_get_clear_errors(oracle_pair, monkeypatch):
    target, right, _ = oracle_pair
    with Engine(target, right, n_ctx=256) as engine:
        with pytest.raises(TypeError, match="adaptive must be True or False, got 2"):
            engine.speculate("hi", max_tokens=4, adaptive=2)
        with pytest.raises(ValueError, match=re.escape("n_max must be in 1..7 (what one draft pass proposes), got -1")):
            engine.speculate("hi", max_tokens=4, n_max=-1)
        monkeypatch.setenv("IKDFLASH_COSTS", "fast:1,2")
        with pytest.raises(ValueError, match="IKDFLASH_COSTS='fast:1,2' is not draft_ms:pass_ms_1"):
            engine.speculate("hi", max_tokens=4)


# --- in llama-server ----------------------------------------------------------------------------

def completion(url: str, prompt: str, n_predict: int) -> dict:
    from ikdflash.serving.client import post_json
    return post_json(url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                           "ignore_eos": True, "cache_prompt": False})


def test_the_server_times_its_passes_and_stays_lossless(swa_pairs, tmp_path, monkeypatch):
    """On this machine's own costs (whatever they are) the replies are the target's, every step is
    counted once by the drafts it verified, and /metrics and /slots say what the controller did."""
    import json
    import urllib.request

    from ikdflash import Server
    from ikdflash.serving.spectype import SpecType

    monkeypatch.delenv("IKDFLASH_COSTS")
    target, draft = swa_pairs["llama"]
    prompt = "the quick brown fox jumps over the lazy dog, and the cat sat on the mat. " * 3
    with Server(target, ctx_size=1024, n_threads=2) as url:
        plain = [completion(url, prompt, 48)["content"], completion(url, "a cat", 48)["content"]]
    log = tmp_path / "s.log"
    args = ["--model-draft", str(draft), "--spec-type", SpecType(n_max=4).flag(), "--metrics"]
    with Server(target, ctx_size=1024, n_threads=2, log_file=log, extra_args=args) as url:
        replies = [completion(url, prompt, 48), completion(url, "a cat", 48)]
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        slots = json.loads(urllib.request.urlopen(url + "/slots", timeout=30).read())
    assert [r["content"] for r in replies] == plain
    for reply in replies:
        t = reply["timings"]
        by_k = t["draft_steps_by_verified"]
        assert len(by_k) == 5 and sum(by_k) == t["predicted_n"] - 1 - t["draft_n_accepted"]
        assert t["draft_n"] == sum(k * n for k, n in enumerate(by_k))
    assert slots[0]["speculation"]["draft_steps_by_verified"] == replies[-1]["timings"]["draft_steps_by_verified"]
    plain_steps = sum(r["timings"]["draft_steps_by_verified"][0] for r in replies)
    assert f"llamacpp:dflash_plain_steps_total {plain_steps}" in metrics
    text = log.read_text()
    assert re.search(r"dflash: adaptive block length on \(n_max 4 the ceiling\); target pass of 1\.\.5 rows:"
                     r"( \d+\.\d\d){5} ms; a graph rebuild \d+\.\d\d ms\n", text)
    assert "dflash: steps by drafts verified {0: " in text


@pytest.mark.parametrize("which, verified", [("right", 4), ("wrong", 0)])
def test_the_server_settles_like_the_engine(oracle_pair, tmp_path, monkeypatch, which, verified):
    from ikdflash import Server
    from ikdflash.serving.spectype import SpecType

    monkeypatch.setenv("IKDFLASH_COSTS", "0.7:1,1.09,1.3,1.6,1.9")
    target, right, wrong = oracle_pair
    spec = SpecType(n_max=4, lookup=False)  # the target repeats itself: the lookup would win
    args = ["--model-draft", str(right if which == "right" else wrong), "--spec-type", spec.flag()]
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "s.log", extra_args=args) as url:
        t = completion(url, "hello", 80)["timings"]
    by_k = t["draft_steps_by_verified"]
    assert by_k[verified] >= sum(by_k) - 4, by_k
    # the prior does not pay on these costs: one probe starts each request; a useless draft's go on
    assert t["draft_probes"] == 1 if which == "right" else t["draft_probes"] >= 3


def test_under_load_a_slot_decodes_one_token_where_its_block_would_not_pay(oracle_pair, tmp_path, monkeypatch):
    """Two slots of an always-right draft on costs where one block fits beside the other slot's
    one-token decode but two blocks do not: the slots share the pass, so one of them decodes a
    token at a time while the other drafts; each request says how many of its steps the load
    chose, /metrics their sum, and a request alone drafts every step."""
    import urllib.request

    from ikdflash import Server
    from ikdflash.serving.client import post_json_concurrently
    from ikdflash.serving.spectype import SpecType

    monkeypatch.setenv("IKDFLASH_COSTS", "0.1:" + ",".join(f"{ms:g}" for ms in ROOMY_THEN_FULL))
    target, right, _ = oracle_pair
    args = ["--model-draft", str(right), "--spec-type", SpecType(n_max=4).flag(), "--parallel", "2", "--metrics"]
    body = {"prompt": "hello", "n_predict": 256, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "s.log", extra_args=args) as url:
        pair = post_json_concurrently(url + "/completion", [body, body])
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        alone = completion(url, "hello", 64)["timings"]
    held = [r["timings"]["draft_load_plain_steps"] for r in pair]
    assert sum(held) > 0, [r["timings"]["draft_steps_by_verified"] for r in pair]
    assert f"llamacpp:dflash_load_plain_steps_total {sum(held)}" in metrics
    assert pair[0]["content"] == pair[1]["content"]
    assert alone["draft_load_plain_steps"] == 0 and alone["draft_steps_by_verified"][0] <= 1
    assert "target pass of 1..10 rows:" in (tmp_path / "s.log").read_text()

"""The n-gram lookup beside the draft: the controller's choice between the two proposals (costs and
acceptance scripted, no model), then the engine and llama-server, where the lookup must never
change the output.

The controller's choices depend on pass costs: tests that look at them fix the costs through
IKDFLASH_COSTS, so that they are the same on any machine."""

from __future__ import annotations

import urllib.request

import pytest
from ikdflash import Engine, Server
from ikdflash._core import BlockController, NgramLookup
from ikdflash.serving.client import post_json, post_json_concurrently
from ikdflash.serving.spectype import SpecType

CPU_PASSES = [1.0, 1.09, 1.3, 1.6, 1.9]  # a step of 5 rows costs 1.9 one-row passes
CPU_DRAFT = 0.7
TARGET = 1  # the token the scripted target commits at every position


def drive(ctl: BlockController, steps: int, *, draft_right: bool, lookup: list[int] | None) -> list[tuple[int, bool]]:
    """Steps of a generation whose target commits TARGET everywhere. The lookup offers `lookup`
    (None: no offer); the draft proposes TARGET when draft_right, else 2 (beside a looked-up
    proposal, only as a probe). Returns each step's (n_verify, whether it verified the lookup's
    tokens)."""
    chosen = []
    for _ in range(steps):
        n_draft, n_verify, from_lookup = ctl.plan_offered(4, lookup or [])
        drafted = [TARGET if draft_right else 2] * n_draft
        if n_draft:
            ctl.proposed(drafted)
        proposal = lookup[:n_verify] if from_lookup else drafted
        accepted = 0
        while accepted < n_verify and proposal[accepted] == TARGET:
            accepted += 1
        ctl.committed(n_verify, [TARGET] * (accepted + 1))
        chosen.append((n_verify, from_lookup))
    return chosen


def test_the_lookup_proposes_what_followed_its_key_before():
    """The engine's lookup as the bindings give it (the replay offers it): in a passage seen
    twice, the tokens up to the current one are found earlier and what followed them there is
    proposed, at most n_max of it; a text never repeated gets nothing; bad sizes are refused."""
    passage = list(range(100, 120))
    lookup = NgramLookup(4)
    assert lookup.propose(passage * 2 + [100, 101], 102, 4) == [103, 104, 105, 106]
    assert lookup.propose(passage * 2 + [100, 101], 102, 2) == [103, 104]
    assert NgramLookup(4).propose(list(range(200, 240)), 240, 4) == []
    with pytest.raises(ValueError, match="max_run and key_size must be >= 1"):
        NgramLookup(0)


def test_the_lookup_wins_where_it_is_right_and_the_draft_is_not():
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = drive(ctl, 60, draft_right=False, lookup=[TARGET] * 4)
    assert all(c == (4, True) for c in chosen[10:]), chosen[:20]
    assert ctl.acceptance(lookup=True)[3] > 0.99
    assert ctl.stats()["n_lookup_steps"] >= 50


def test_the_draft_wins_where_it_is_right_and_the_lookup_is_not():
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = drive(ctl, 60, draft_right=True, lookup=[2, 2, 2, 2])
    assert all(c == (4, False) for c in chosen[10:]), chosen[:20]
    assert ctl.acceptance(lookup=True)[0] < 0.05
    assert ctl.stats()["n_lookup_steps"] <= 5


def test_equally_right_the_lookup_wins_as_it_costs_no_draft_step():
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = drive(ctl, 40, draft_right=True, lookup=[TARGET] * 4)
    assert all(c == (4, True) for c in chosen[10:]), chosen[:20]


def test_a_short_offer_loses_to_a_draft_that_is_right_for_longer():
    """One looked-up token (2 tokens a step, no draft step) against four drafted ones (5 tokens for
    1.9 passes and a draft step): the draft's step commits more per millisecond."""
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = drive(ctl, 100, draft_right=True, lookup=[TARGET])
    takeover = next(i for i, c in enumerate(chosen) if c == (4, False))
    assert takeover < 20 and all(c == (4, False) for c in chosen[takeover:]), chosen[:40]


def test_a_lone_lookup_step_pays_for_both_graph_rebuilds():
    """Where the text repeats now and then, the lookup offers at one step in ten: verifying its
    token leaves a run of one-row passes for one 2-row pass and comes back, rebuilding the target's
    graph both ways (0.15 of a one-row pass each here). A token kept 45% of the time buys 1.45
    tokens for 1.3 + 0.3 passes: not worth it, though it would be at every step of a run of
    offers, where no rebuild is paid."""
    import random

    coin = random.Random(7)
    ctl = BlockController(1, [1.0, 1.3], 1.0)  # a draft step too dear to draft
    last, verified = 1, []
    for step in range(1000):
        right = coin.random() < 0.45
        offer = [TARGET if right else 2] if step % 10 == 0 else []
        _, n_verify, from_lookup = ctl.plan_offered(1, offer)
        ctl.observe_pass(n_verify + 1, [1.0, 1.3][n_verify] + (0.15 if n_verify + 1 != last else 0.0))
        last = n_verify + 1
        ctl.committed(n_verify, [TARGET] * (1 + (n_verify > 0 and right)))
        verified.append(from_lookup)
    assert 0.3 < ctl.acceptance(lookup=True)[0] < 0.6
    assert sum(verified[-500:]) <= 5, sum(verified[-500:])


def test_neither_right_decodes_one_token_at_a_time():
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT)
    chosen = drive(ctl, 200, draft_right=False, lookup=[2, 2, 2, 2])
    assert sum(k for k, _ in chosen[20:]) <= 3, chosen[:40]


def test_a_fixed_block_length_ignores_the_lookup():
    ctl = BlockController(4, CPU_PASSES, CPU_DRAFT, adaptive=False)
    assert ctl.plan_offered(4, [TARGET] * 4) == (4, 4, False)


# --- in the engine ------------------------------------------------------------------------------

def test_the_engine_verifies_the_lookup_where_the_draft_is_useless(oracle_pair, monkeypatch):
    """The oracle target repeats token 0, which the lookup finds in the reply so far, while the
    wrong draft never proposes it: the steps verify the lookup's tokens, and the draft hardly runs."""
    monkeypatch.setenv("IKDFLASH_COSTS", "0.7:1,1.09,1.3,1.6,1.9")
    target, _, wrong = oracle_pair
    with Engine(target, wrong, n_ctx=256) as engine:
        before = engine.draft.info()["graph_computes"]
        out = engine.speculate("hello there", max_tokens=150, n_max=4)
        computes = engine.draft.info()["graph_computes"] - before
        off = engine.speculate("hello there", max_tokens=150, n_max=4, lookup=False)
    st = out.stats
    assert out.tokens == off.tokens == [0] * 150
    # plain steps until the reply holds a key and its continuation (3 + 4 tokens), then lookups
    assert st.steps_by_verified[0] <= 12 and st.lookup_steps >= st.steps - 12, st.steps_by_verified
    assert st.by_proposer["lookup"]["accepted"] == st.lookup_accepted >= 0.9 * st.lookup_drafted
    assert st.by_proposer["draft"]["accepted"] == 0
    assert computes <= 2 * (st.probes + st.steps - st.lookup_steps), computes
    assert off.stats.lookup_drafted == off.stats.lookup_steps == 0


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_lookup_beside_the_draft_is_lossless(swa_pairs, arch, monkeypatch):
    """A repetitive prompt, on costs where the lookup always pays and on this machine's own: the
    tokens are the target's alone, on a plain and on a hybrid (recurrent) target."""
    target, draft = swa_pairs[arch]
    with Engine(target, draft, n_ctx=512, n_batch=32) as engine:
        prompt = engine.target.tokenize("one two three four five six seven eight " * 8, add_special=False)
        plain = engine.generate(prompt, max_tokens=64).tokens
        assert engine.speculate(prompt, max_tokens=64, n_max=4).tokens == plain  # this machine's costs
    monkeypatch.setenv("IKDFLASH_COSTS", "5:1,1.01,1.02,1.03,1.04")
    with Engine(target, draft, n_ctx=512, n_batch=32) as engine:
        out = engine.speculate(prompt, max_tokens=64, n_max=4)
    assert out.tokens == plain
    assert out.stats.lookup_steps > 0 and sum(out.stats.steps_by_verified) == out.stats.steps


def test_the_lookup_alone_needs_no_draft(swa_pairs, oracle_pair, monkeypatch):
    """An engine without a draft verifies the lookup's tokens where they pay, through the same
    controller: lossless, and fewer passes than tokens on a target that repeats itself."""
    monkeypatch.setenv("IKDFLASH_COSTS", "0.7:" + ",".join(str(1 + r / 10) for r in range(9)))
    target, _, _ = oracle_pair
    with Engine(target, n_ctx=256) as engine:
        out = engine.speculate("hello there", max_tokens=120, n_max=8)
        assert out.tokens == engine.generate("hello there", max_tokens=120).tokens == [0] * 120
        assert out.stats.lookup_steps > 0 and out.stats.steps <= 40 and out.stats.probes == 0
        assert out.stats.by_proposer["draft"] == {"drafted": 0, "accepted": 0}
        with pytest.raises(ValueError, match="needs lookup=True and adaptive=True"):
            engine.speculate("hello there", max_tokens=8, adaptive=False)
        with pytest.raises(ValueError, match=r"n_max must be in 1..15 \(what a step verifies without a draft\)"):
            engine.speculate("hello there", max_tokens=8, n_max=16)
    llama, _ = swa_pairs["llama"]
    monkeypatch.delenv("IKDFLASH_COSTS")
    with Engine(llama, n_ctx=512, n_batch=32) as engine:  # this machine's costs
        prompt = engine.target.tokenize("one two three four five six seven eight " * 8, add_special=False)
        assert engine.speculate(prompt, max_tokens=64).tokens == engine.generate(prompt, max_tokens=64).tokens
    hybrid, _ = swa_pairs["qwen35moe"]  # rejected lookups restore its recurrent state
    monkeypatch.setenv("IKDFLASH_COSTS", "5:1,1.01,1.02,1.03,1.04")
    with Engine(hybrid, n_ctx=512, n_batch=32) as engine:
        prompt = engine.target.tokenize("one two three four five six seven eight " * 8, add_special=False)
        out = engine.speculate(prompt, max_tokens=64)
        assert out.tokens == engine.generate(prompt, max_tokens=64).tokens
        assert out.stats.lookup_drafted > 0


def test_lookup_must_be_a_bool(oracle_pair):
    target, right, _ = oracle_pair
    with Engine(target, right, n_ctx=256) as engine:
        with pytest.raises(TypeError, match="lookup must be True or False, got 3"):
            engine.speculate("hi", max_tokens=4, lookup=3)


# --- in llama-server ----------------------------------------------------------------------------

def serve(target, draft, log, spec: SpecType, *extra: str):
    return Server(target, ctx_size=512, n_threads=2, log_file=log,
                  extra_args=["--model-draft", str(draft), "--spec-type", spec.flag(), "--metrics", *extra])


def test_the_server_verifies_the_lookup_and_counts_it_apart(oracle_pair, tmp_path, monkeypatch):
    """The oracle target repeats token 0 and the wrong draft never proposes it: the slot's steps
    verify the lookup's tokens, and timings, /slots and /metrics count them apart from the draft's."""
    monkeypatch.setenv("IKDFLASH_COSTS", "0.7:1,1.09,1.3,1.6,1.9")
    target, _, wrong = oracle_pair
    request = {"prompt": "hello there", "n_predict": 120, "temperature": 0, "ignore_eos": True}
    with serve(target, wrong, tmp_path / "on.log", SpecType(n_max=4, log_drafts=True)) as url:
        on = post_json(url + "/completion", request)
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    with serve(target, wrong, tmp_path / "off.log", SpecType(n_max=4, lookup=False)) as url:
        off = post_json(url + "/completion", request)
    assert on["content"] == off["content"] and on["tokens_predicted"] == off["tokens_predicted"] == 120
    t = on["timings"]
    assert t["draft_n_lookup"] >= 80 and t["draft_n_accepted_lookup"] >= 0.9 * t["draft_n_lookup"], t
    assert t["draft_n_accepted"] - t["draft_n_accepted_lookup"] == 0  # the draft's own: never right
    assert t["draft_steps"] <= 40, t
    assert off["timings"]["draft_n_lookup"] == off["timings"]["draft_n_accepted_lookup"] == 0
    assert f"llamacpp:draft_lookup_tokens_total {t['draft_n_lookup']}" in metrics
    assert f"llamacpp:draft_lookup_tokens_accepted_total {t['draft_n_accepted_lookup']}" in metrics
    assert f"llamacpp:spec_decode_num_lookup_tokens {t['draft_n_lookup']}" in metrics
    assert "dflash: lookup after 0 at" in (tmp_path / "on.log").read_text()


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
@pytest.mark.parametrize("parallel", [1, 2])
def test_the_server_with_lookup_is_lossless(swa_pairs, tmp_path, arch, parallel, monkeypatch):
    """Repetitive prompts, on costs where the lookup pays: the replies are the target's alone,
    one slot or two side by side (the load-aware controller)."""
    monkeypatch.setenv("IKDFLASH_COSTS", "5:1,1.01,1.02,1.03,1.04,1.05,1.06,1.07,1.08,1.09")
    target, draft = swa_pairs[arch]
    prompts = ["one two three four five six seven eight " * 6, "red green blue, red green blue, " * 6]
    requests = [{"prompt": p, "n_predict": 48, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
                for p in prompts]
    with Server(target, ctx_size=1024, n_threads=2) as url:
        plain = [post_json(url + "/completion", r)["content"] for r in requests]
    with serve(target, draft, tmp_path / "s.log", SpecType(n_max=4), "--parallel", str(parallel)) as url:
        replies = post_json_concurrently(url + "/completion", requests)
    assert [r["content"] for r in replies] == plain
    assert sum(r["timings"]["draft_n_lookup"] for r in replies) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_the_server_runs_the_lookup_alone(swa_pairs, oracle_pair, tmp_path, arch, monkeypatch):
    """--spec-type lookup: the same slots and controller with no draft. On a target that repeats
    itself the steps verify the lookup's tokens; on the tiny targets (a hybrid one among them,
    whose rejected lookups restore its recurrent state) the replies stay the target's."""
    monkeypatch.setenv("IKDFLASH_COSTS", "5:1,1.01,1.02,1.03,1.04,1.05,1.06,1.07,1.08,1.09")
    target, _, _ = oracle_pair
    request = {"prompt": "hello there", "n_predict": 60, "temperature": 0, "ignore_eos": True}
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "oracle.log",
                extra_args=["--spec-type", "lookup:n_max=8"]) as url:
        t = post_json(url + "/completion", request)["timings"]
    assert t["draft_n_lookup"] == t["draft_n"] > 0 and t["draft_n_accepted_lookup"] == t["draft_n_accepted"] > 0
    assert t["draft_steps"] < 20
    assert "the lookup alone" in (tmp_path / "oracle.log").read_text()
    tiny, _ = swa_pairs[arch]
    requests = [{"prompt": p, "n_predict": 48, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
                for p in ("one two three four five six seven eight " * 6, "red green blue, red green blue, " * 6)]
    with Server(tiny, ctx_size=512, n_threads=2) as url:
        plain = [post_json(url + "/completion", r)["content"] for r in requests]
    with Server(tiny, ctx_size=512, n_threads=2, log_file=tmp_path / "tiny.log",
                extra_args=["--spec-type", "lookup", "--parallel", "2"]) as url:
        replies = post_json_concurrently(url + "/completion", requests)
    assert [r["content"] for r in replies] == plain
    assert sum(r["timings"]["draft_n_lookup"] for r in replies) > 0


@pytest.mark.parametrize("flags, message", [
    (["--spec-type", "lookup:lookup=0"], "the lookup alone needs lookup=1 and adaptive=1"),
    (["--spec-type", "lookup:adaptive=0"], "the lookup alone needs lookup=1 and adaptive=1"),
    (["--spec-type", "lookup:bogus=1"], "unknown key 'bogus'"),
])
def test_bad_lookup_flags_exit_with_their_reason(oracle_pair, flags, message):
    from ikdflash import ServerError

    target, _, _ = oracle_pair
    with pytest.raises(ServerError, match=message):
        with Server(target, ctx_size=256, n_threads=2, extra_args=flags):
            pass


def test_the_lookup_alone_takes_no_draft(oracle_pair, tmp_path):
    from ikdflash import ServerError

    target, right, _ = oracle_pair
    log = tmp_path / "s.log"
    with pytest.raises(ServerError, match="exited with code 1 during start-up"):
        Server(target, ctx_size=256, n_threads=2, log_file=log, startup_timeout=60,
               extra_args=["--model-draft", str(right), "--spec-type", "lookup"]).start()
    assert "--spec-type lookup takes no draft: with --model-draft, use --spec-type dflash" in log.read_text()

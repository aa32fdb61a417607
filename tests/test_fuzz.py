"""A slice of the draft GGUF fuzzer (tests/fuzz_draft.py; the full run of 1,000 cases is its own
command, see CONTRIBUTING.md): hostile drafts are refused with a message, never a crash or a hang,
through the bindings and through llama-server. And the specific refusals the loader owes."""

from __future__ import annotations

import re

import pytest

import gguf
import numpy as np

from ikdflash import _core
from fuzz_draft import run
from fuzzing import summary
from fixtures.gguf_edit import DROP, rewrite


@pytest.fixture(scope="module")
def pair(tiny_model, tiny_draft):
    target = tiny_model("llama")
    return target, tiny_draft(target, target_layer_ids=[0, 2], block_size=8,
                              layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=8)


def test_mutated_drafts_never_crash_or_hang(pair):
    target, draft = pair
    results = run(target, draft, cases=60, seed=12345, server_every=20, timeout=20)
    bad = [case for case in results if case.outcome in ("crash", "hang")]
    assert not bad, bad
    counts = summary(results)
    assert counts.get("core:refused", 0) > 30 and counts.get("server:refused", 0) + counts.get("server:loaded", 0) == 3
    assert all(case.detail for case in results if case.outcome == "refused")


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_mutated_dflash2_and_dspark_drafts_never_crash_or_hang(tiny_model, tiny_draft, family):
    """The same with a DFlash2 draft (its four keys, its convolutions' and selector's tensors) and
    a DSpark draft (its Markov and confidence heads, its layout keys)."""
    from fuzz_draft import FAMILIES

    target = tiny_model("llama")
    draft = tiny_draft(target, target_layer_ids=[0, 2], block_size=8, **FAMILIES[family],
                       layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=8)
    results = run(target, draft, cases=60, seed=54321, server_every=20, timeout=20)
    assert not [case for case in results if case.outcome in ("crash", "hang")]
    assert summary(results).get("core:refused", 0) > 30
    assert all(case.detail for case in results if case.outcome == "refused")


@pytest.fixture(scope="module")
def model(pair):
    m = _core.Model(str(pair[0]), n_ctx=256, n_threads=1)
    yield m
    m.close()


def retyped(src, dst, key, value):
    """src with key holding value, typed as Python types map (an int array for a list of ints)."""
    return rewrite(rewrite(src, dst.with_suffix(".tmp"), fields={key: DROP}), dst, fields={key: value})


@pytest.mark.parametrize("key, value, reason", [
    ("dflash-draft.block_count", 100000, "block_count' is 100000, outside 1..64"),
    ("dflash-draft.block_size", 1 << 20, "block_size' is 1048576, outside 2..256"),
    ("dflash-draft.attention.head_count", 2**31 - 1, "head_count' is 2147483647, outside 1..1024"),
    ("dflash-draft.dflash.target_layer_ids", list(range(300)), "300 target layer ids: corrupt"),
    ("dflash-draft.dflash.target_layer_ids", [0, 1 << 30], "target layer id 1073741824 is outside 0..255"),
    ("dflash-draft.dflash.is_causal", 7, "dflash.is_causal' is not a bool"),
    ("tokenizer.ggml.tokens", list(range(10)), "'tokenizer.ggml.tokens' is not an array of strings"),
    ("general.architecture", 3, "'general.architecture' is not a string"),
    # ggml's rms_norm asserts eps > 0: NaN passed a plain "<= 0" check and aborted the first step
    ("dflash-draft.attention.layer_norm_rms_epsilon", float("nan"), "layer_norm_rms_epsilon' is nan, not a finite"),
    ("dflash-draft.attention.layer_norm_rms_epsilon", 0.0, "layer_norm_rms_epsilon' is 0, not above 0"),
    ("dflash-draft.rope.freq_base", float("inf"), "rope.freq_base' is inf, not a finite number"),
    ("dflash-draft.rope.freq_base", -5.0, "rope.freq_base' is -5, not above 0"),
    ("dflash-draft.dflash.output_multiplier", float("-inf"), "output_multiplier' is -inf, not a finite number"),
    ("dflash-draft.dflash.final_logit_softcapping", -1.0, "final_logit_softcapping' is -1, not at least 0"),
])
def test_hostile_metadata_is_refused_by_name(pair, model, tmp_path, key, value, reason):
    """Before, these crashed or hung the process: a graph too small for the layers, a getter of
    the wrong type (an abort, or reads through a wild pointer), an O(n^2) check of a huge list."""
    bad = retyped(pair[1], tmp_path / "bad.gguf", key, value)
    with pytest.raises(ValueError, match=re.escape(reason)):
        _core.Draft(model, str(bad))


def test_a_tensor_of_the_wrong_rank_is_refused(pair, model, tmp_path):
    """Only the listed dimensions were checked: a 3-D attn_q reached a ggml assert at the first step."""
    q = next(t for t in gguf.GGUFReader(pair[1]).tensors if t.name == "blk.0.attn_q.weight")
    shape = [int(n) for n in reversed(q.shape)]
    bad = rewrite(pair[1], tmp_path / "rank.gguf", tensors={q.name: np.ones([2, *shape])})
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' has 3 dimensions, expected 2"):
        _core.Draft(model, str(bad))


def test_mutated_checkpoints_convert_or_are_refused():
    """A slice of tests/fuzz_convert.py: config values of the wrong type or size, safetensors
    headers with bad dtypes, shapes and offsets, hostile shard names. Before, these raised
    TypeError, KeyError, OverflowError... out of `ikdflash convert`, or read /dev/zero."""
    from fuzz_convert import run as run_convert
    results = run_convert(cases=80, seed=4321)
    assert not [case for case in results if case.outcome in ("crash", "hang")]
    counts = summary(results)
    assert counts.get("convert:refused", 0) > 40 and counts.get("convert:converted", 0) > 5
    assert all(case.detail for case in results if case.outcome == "refused")

"""The measurement helpers behind benchmarks/passes/cost.py, on a tiny model: results of the shape
asked for, bad arguments refused with their reason, and a requantized copy that the fork loads."""

from __future__ import annotations

import pytest
from ikdflash import _core


@pytest.fixture()
def model(tiny_model):
    m = _core.Model(str(tiny_model("llama")), n_ctx=64, n_threads=1, n_batch=16)  # the least n_batch
    yield m
    m.close()


def test_time_passes_times_every_row_count_and_leaves_the_context_empty(model):
    before = model.generate_greedy([1, 2, 3], 4)
    times = _core.measure.time_passes(model, [1, 4, 16], 16, 3)
    assert [len(t) for t in times] == [3, 3, 3]
    assert all(ms > 0 for t in times for ms in t)
    assert model.generate_greedy([1, 2, 3], 4) == before


def test_time_pass_ops_splits_each_pass_by_weight_and_operation_then_lets_go(model):
    """Every layer's products with one weight land under its name, the head under "output" (or
    the tied "token_embd"); the callback is removed afterwards, and the output is unchanged."""
    before = model.generate_greedy([1, 2, 3], 4)
    split = _core.measure.time_pass_ops(model, [1, 4], 16, 2)
    assert [len(passes) for passes in split] == [2, 2]
    names = set(split[0][0])
    assert {"mul_mat attn_q", "mul_mat ffn_down", "FLASH_ATTN_EXT"} <= names, names
    assert names & {"mul_mat output", "mul_mat token_embd"}, names
    assert not any(name.startswith("mul_mat blk.") for name in names)
    assert all(ms >= 0 for passes in split for one in passes for ms in one.values())
    assert model.generate_greedy([1, 2, 3], 4) == before
    assert [len(t) for t in _core.measure.time_passes(model, [1], 16, 1)] == [1]  # undivided again


@pytest.mark.parametrize("rows, n_context, repeats, message", [
    ([17], 0, 1, r"row counts must be in 1..16 \(the model's n_batch\), got 17"),
    ([0], 0, 1, "got 0"),
    ([16], -8, 1, "cached tokens and 16 rows do not fit the context of"),  # -8: n_ctx - 8
    ([1], 0, 0, "repeats must be at least 1"),
])
def test_time_passes_refuses_what_does_not_fit(model, rows, n_context, repeats, message):
    if n_context < 0:  # the fork pads the context it was asked for
        n_context += model.n_ctx
    with pytest.raises(ValueError, match=message):
        _core.measure.time_passes(model, rows, n_context, repeats)


def test_quantize_writes_a_model_the_fork_loads(tiny_model, tmp_path):
    out = tmp_path / "q8.gguf"
    _core.measure.quantize(str(tiny_model("llama")), str(out), "Q8_0", 1)
    for repack in (False, True):  # Q8_0 has an interleaved layout the fork repacks into
        m = _core.Model(str(out), n_ctx=64, n_threads=1, repack=repack)
        assert m.meta("general.file_type") == "7"  # LLAMA_FTYPE_MOSTLY_Q8_0
        assert len(m.generate_greedy([1, 2, 3], 4, stop_at_eog=False)) == 4
        m.close()


def test_quantize_refuses_an_unknown_type_and_a_missing_file(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"unknown quantization type 'Q3_X' \(known: .*Q4_0.*\)"):
        _core.measure.quantize(str(tiny_model("llama")), str(tmp_path / "out.gguf"), "Q3_X")
    with pytest.raises(FileNotFoundError, match="model file not found"):
        _core.measure.quantize(str(tmp_path / "missing.gguf"), str(tmp_path / "out.gguf"), "Q8_0")
    assert not (tmp_path / "out.gguf").exists()


def test_memory_read_bandwidth_is_measured_and_checks_its_arguments():
    assert _core.measure.memory_read_bandwidth(1, 16, 1) > 0
    with pytest.raises(ValueError, match="at least 1"):
        _core.measure.memory_read_bandwidth(0)

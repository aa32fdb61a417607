"""The DFlash draft: converted by our converter, loaded by the fork, computing what the reference
computes; and every bad file or mismatched pair refused with its reason."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from ikdflash import _core
from ikdflash.convert import ConversionError, convert
from ikdflash.sources.hf import read_tensors, write_tensors
from fixtures.tinydraft import write_hf_target, write_tiny_draft
from fixtures.gguf_edit import DROP, rewrite

WINDOW = 8
CASES = {
    "all-full": dict(layer_types=["full_attention"] * 2),
    "swa-5+1": dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=WINDOW),
    "causal-override": dict(layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=WINDOW,
                            extra_config={"is_causal": True}),
    "bidirectional-swa": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                              extra_config={"is_causal": False}),
}


@pytest.fixture(scope="module")
def target(tiny_model, tmp_path_factory):
    """A tiny qwen3 target as GGUF (for the fork) and as a HF folder (for the reference)."""
    gguf_path = tiny_model("qwen3")
    hf = write_hf_target(tmp_path_factory.mktemp("hf-target"), gguf_path)
    model = _core.Model(str(gguf_path), n_ctx=256)
    yield gguf_path, hf, model
    model.close()


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    """case -> (checkpoint folder, F32 GGUF, {quantized type: GGUF})."""
    _, hf, _ = target
    out = {}
    for name, kwargs in CASES.items():
        folder = write_tiny_draft(tmp_path_factory.mktemp(name), hf, target_layer_ids=[0, 2], seed=7, **kwargs)
        f32 = convert(folder, hf, outtype="f32", outfile=folder / "draft-f32.gguf", log=lambda _: None)
        quantized = {q: convert(folder, hf, outtype=q, outfile=folder / f"draft-{q}.gguf", log=lambda _: None)
                     for q in ("q8_0", "q4_1")}
        out[name] = (folder, f32, quantized)
    return out


def context(n_rows: int, width: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_rows, width)).astype(np.float32)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n_ctx,start", [(20, 20), (5, 105)])
def test_f32_matches_the_reference(target, drafts, case, n_ctx, start):
    from reference import ReferenceDraft

    _, hf, model = target
    folder, f32, _ = drafts[case]
    draft = _core.Draft(model, str(f32))
    features = context(n_ctx, draft.info()["n_target_features"])
    first = 65
    logits, tokens = draft.forward(features, np.arange(start - n_ctx, start, dtype=np.int32), first, start)
    ref = ReferenceDraft(folder, hf).logits(features, first, start)
    assert logits.shape == ref.shape
    assert relative_error(logits, ref) <= 1e-4
    assert tokens == list(ref[1:].argmax(axis=1))


def quantized_forward(target, drafts, case: str, outtype: str) -> tuple[np.ndarray, list[int], np.ndarray]:
    """The case's draft in outtype and the reference, on 20 context rows: (logits, tokens, reference logits)."""
    from reference import ReferenceDraft

    _, hf, model = target
    folder, _, quantized = drafts[case]
    draft = _core.Draft(model, str(quantized[outtype]))
    features = context(20, draft.info()["n_target_features"])
    logits, tokens = draft.forward(features, np.arange(0, 20, dtype=np.int32), 65, 20)
    return logits, tokens, ReferenceDraft(folder, hf).logits(features, 65, 20)


@pytest.mark.parametrize("case", ["all-full", "swa-5+1"])
def test_q8_0_keeps_the_argmax(target, drafts, case, record_property):
    logits, tokens, ref = quantized_forward(target, drafts, case, "q8_0")
    error = relative_error(logits, ref)
    record_property("q8_0_relative_error", error)
    print(f"{case}: Q8_0 max relative logit error {error:.2e}")
    assert error < 0.05
    assert tokens == list(ref[1:].argmax(axis=1))


@pytest.mark.parametrize("case", ["all-full", "swa-5+1"])
def test_q4_1_follows_the_reference(target, drafts, case):
    """4 bits and an offset a block of 32 round these tiny random weights by up to ~30% of the
    largest logit, but the logits still follow the reference's closely."""
    logits, _, ref = quantized_forward(target, drafts, case, "q4_1")
    correlation = np.corrcoef(logits.ravel(), ref.ravel())[0, 1]
    print(f"{case}: Q4_1 logits' correlation with the reference {correlation:.4f}")
    assert correlation > 0.95


def test_header_carries_the_sliding_pattern(target, drafts):
    _, _, model = target
    info = _core.Draft(model, str(drafts["swa-5+1"][1])).info()
    assert info["format"] == "dflash-draft"
    assert info["sliding"] == [True] * 5 + [False]
    assert info["causal"] == [True] * 5 + [False]
    assert info["sliding_window"] == WINDOW
    assert info["target_layer_ids"] == [0, 2]
    override = _core.Draft(model, str(drafts["causal-override"][1])).info()
    assert override["causal"] == [True, True, True]


def test_sliding_layers_do_not_grow_with_cross_ctx(target, drafts):
    _, _, model = target
    draft = _core.Draft(model, str(drafts["swa-5+1"][1]))
    small, large = draft.cache_layout(64), draft.cache_layout(4096)
    assert small["capacity"] == [WINDOW - 1] * 5 + [64]
    assert large["capacity"] == [WINDOW - 1] * 5 + [4096]
    full = draft.cache_layout(4096, full_attention=True)
    assert full["capacity"] == [4096] * 6


def test_window_changes_the_output_only_past_the_window(target, drafts):
    """The sliding rule bites once context rows fall out of the window, not before."""
    _, _, model = target
    draft = _core.Draft(model, str(drafts["swa-5+1"][1]))
    width = draft.info()["n_target_features"]
    short = context(3, width)
    pos = np.arange(0, 3, dtype=np.int32)
    a, _ = draft.forward(short, pos, 65, 3)
    b, _ = draft.forward(short, pos, 65, 3, full_attention=True)
    assert not np.allclose(a, b)  # causal vs bidirectional block still differs
    long = context(40, width)
    pos = np.arange(0, 40, dtype=np.int32)
    trimmed, _ = draft.forward(long[-(WINDOW - 1):], pos[-(WINDOW - 1):], 65, 40, cross_ctx=40)
    whole, _ = draft.forward(long, pos, 65, 40, cross_ctx=40)
    # the sliding layers see only the last W-1 rows either way; the full layer sees all 40
    assert not np.allclose(trimmed, whole)


@pytest.mark.parametrize("cross_ctx", [12, 40])
def test_truncating_the_cross_context(target, drafts, cross_ctx):
    """A slot whose new request reuses part of the last prompt drops the rows past the reused
    part (dflash_cache_truncate). The sliding layers' rings (window - 1 = 7 rows) have wrapped over
    the 30 rows, and with cross_ctx 12 the full layer's too: the rows they overwrote come back
    from the cache's history, so a step right after the cut (whose window reaches back over them)
    sees what a cache given only the kept rows sees."""
    _, _, model = target
    draft = _core.Draft(model, str(drafts["swa-5+1"][1]))
    rows = context(30, draft.info()["n_target_features"])
    pos = np.arange(30, dtype=np.int32)
    whole, _ = draft.forward(rows, pos, 65, 30, cross_ctx=cross_ctx)
    # dropped and appended again: as if the rows had been appended once
    again, _ = draft.forward(rows, pos, 65, 30, cross_ctx=cross_ctx, truncate_at=26,
                             then_features=rows[26:], then_positions=pos[26:])
    np.testing.assert_allclose(again, whole, rtol=1e-5, atol=1e-5)
    # dropped only: every layer holds what it would hold had the rows stopped at 25. The rows
    # are still pending (appends are projected at the next step), so the cut reaches back to the
    # newest cross_ctx rows before 26; cut after a step, rows older than the newest cross_ctx
    # appended are gone (below)
    oldest_held = max(0, 26 - cross_ctx)
    for start in (26, 30):
        kept, _ = draft.forward(rows[oldest_held:26], pos[oldest_held:26], 65, start, cross_ctx=cross_ctx)
        cut, _ = draft.forward(rows, pos, 65, start, cross_ctx=cross_ctx, truncate_at=26)
        np.testing.assert_allclose(cut, kept, rtol=1e-5, atol=1e-5)
    assert not np.allclose(cut, whole)
    cache = _core.CrossContext(draft, cross_ctx)
    cache.append(rows, pos)
    cache.step(65, 30)  # projects the 30 rows: the history keeps the newest cross_ctx
    cache.truncate(26)
    held = _core.CrossContext(draft, cross_ctx)
    held.append(rows[max(0, 30 - cross_ctx):26], pos[max(0, 30 - cross_ctx):26])
    np.testing.assert_allclose(cache.step(65, 26)[0], held.step(65, 26)[0], rtol=1e-5, atol=1e-5)


def test_a_long_append_keeps_the_newest_rows(target, drafts):
    """600 rows at once (projected 256 a graph): chunks whose rows every ring would overwrite
    before the append ends only feed the history; the step sees the newest rows, as if only those
    had been appended."""
    _, _, model = target
    draft = _core.Draft(model, str(drafts["swa-5+1"][1]))
    rows = context(600, draft.info()["n_target_features"])
    cache = _core.CrossContext(draft, 100)
    cache.append(rows, np.arange(600, dtype=np.int32))
    assert cache.n_rows() == [WINDOW - 1] * 5 + [100]
    newest = _core.CrossContext(draft, 100)
    newest.append(rows[500:], np.arange(500, 600, dtype=np.int32))
    np.testing.assert_allclose(cache.step(65, 600)[0], newest.step(65, 600)[0], rtol=1e-6, atol=1e-6)


def test_shifting_the_cross_context(target, drafts):
    """The server's context shift drops positions [p0, p1) and moves the later rows back: the
    moved rows' keys are re-rotated for their new positions, as a fresh cache would hold them."""
    _, _, model = target
    draft = _core.Draft(model, str(drafts["swa-5+1"][1]))
    rows = context(30, draft.info()["n_target_features"])
    cache = _core.CrossContext(draft, 40)
    cache.append(rows, np.arange(30, dtype=np.int32))
    cache.shift(4, 12, -8)
    shifted, _ = cache.step(65, 22)
    kept = np.concatenate([rows[:4], rows[12:]])
    fresh = _core.CrossContext(draft, 40)
    fresh.append(kept, np.arange(22, dtype=np.int32))
    expected, _ = fresh.step(65, 22)
    np.testing.assert_allclose(shifted, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="context positions must increase"):
        cache.append(rows[:1], np.array([21], dtype=np.int32))
    with pytest.raises(ValueError, match="cannot shift"):
        cache.shift(10, 5, -5)


def test_cross_context_state_round_trip(target, drafts):
    """A slot's rows saved with its prompt (prompt cache, /slots save) and put back into another
    cache: the next step is the same; a state that does not fit is refused, the cache untouched."""
    _, _, model = target
    draft = _core.Draft(model, str(drafts["swa-5+1"][1]))
    rows = context(30, draft.info()["n_target_features"])
    source = _core.CrossContext(draft, 40)
    source.append(rows, np.arange(30, dtype=np.int32))
    state = source.state()
    expected, _ = source.step(65, 30)
    other = _core.CrossContext(draft, 40)
    other.append(rows[:5], np.arange(5, dtype=np.int32))
    other.set_state(state)
    got, _ = other.step(65, 30)
    np.testing.assert_array_equal(got, expected)
    for bad in (state[:-4], b"nonsense" * 4, state[:8] + b"\x00" * (len(state) - 8)):
        with pytest.raises(ValueError, match="cross-context state"):
            other.set_state(bad)
    np.testing.assert_array_equal(other.step(65, 30)[0], expected)
    # a context of fewer rows keeps the newest of them
    small = _core.CrossContext(draft, 12)
    small.set_state(state)
    trimmed = _core.CrossContext(draft, 12)
    trimmed.append(rows[18:], np.arange(18, 30, dtype=np.int32))
    np.testing.assert_allclose(small.step(65, 30)[0], trimmed.step(65, 30)[0], rtol=1e-6, atol=1e-6)


def test_mask_rule_matches_the_reference():
    import torch
    from dflash.model import _attention_mask

    n_ctx, n_q = 12, 8
    for causal in (True, False):
        for window in (None, 5):
            ours = _core.attention_mask(list(range(n_ctx)), n_ctx, n_q, sliding=window is not None,
                                        causal=causal, window=window or 0)
            ref = _attention_mask(torch.zeros(1, 1, n_q, 1), torch.zeros(1, 1, n_ctx + n_q, 1),
                                  is_causal=causal, sliding_window=window)[0, 0].numpy()
            assert ours.shape == (16, n_ctx + n_q)  # rows padded to GGML_KQ_MASK_PAD
            assert ((ours[:n_q] == 0) == ref).all()
            assert np.isinf(ours[n_q:]).all()


def test_mask_padding_for_cuda_flash_attention():
    mask = _core.attention_mask(list(range(300)), 300, 16, sliding=True, causal=True, window=4096, kv_pad=256)
    assert mask.shape == (16, 512)
    assert np.isinf(mask[:, 316:]).all()


def test_upstream_dflash_format_loads_the_same(target, drafts, tmp_path):
    _, _, model = target
    ours = drafts["swa-5+1"][1]
    names = {"dflash_fc.weight": "fc.weight", "dflash_hidden_norm.weight": "enc.output_norm.weight"}
    upstream = rewrite(
        ours, tmp_path / "upstream.gguf", arch="dflash",
        rename_key=lambda k: k.replace("dflash-draft.dflash.", "dflash.").replace("dflash-draft.", "dflash."),
        rename_tensor=lambda n: names.get(n, n.replace("post_attention_norm", "ffn_norm")),
        fields={"dflash.target_layer_ids": DROP, "dflash.target_layers": [1, 3], "dflash.mask_token_id": DROP,
                "tokenizer.ggml.mask_token_id": _core.Draft(model, str(ours)).info()["mask_token"]})
    features = context(12, 128)
    pos = np.arange(0, 12, dtype=np.int32)
    a, _ = _core.Draft(model, str(ours)).forward(features, pos, 65, 12)
    other = _core.Draft(model, str(upstream))
    assert other.info()["format"] == "dflash"
    assert other.info()["target_layer_ids"] == [0, 2]
    b, _ = other.forward(features, pos, 65, 12)
    np.testing.assert_array_equal(a, b)


def softmax_at(logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    """Each row's softmax probability at its token (rows of logits, one token per row)."""
    rows = logits.astype(np.float64)
    rows = np.exp(rows - rows.max(axis=1, keepdims=True))
    return rows[np.arange(len(tokens)), tokens] / rows.sum(axis=1)


def check_proposals(cache, whole_logits: np.ndarray, whole: list[int]) -> None:
    """propose(n) gives the whole step's first n tokens, and propose_with_confidence each one's
    probability under its row's softmax (block rows 1..n of the step's logits)."""
    expected = softmax_at(whole_logits[1:], whole)
    for n in range(1, len(whole) + 1):
        assert cache.propose(65, 20, n) == whole[:n]
        tokens, confidence = cache.propose_with_confidence(65, 20, n)
        assert tokens == whole[:n]
        np.testing.assert_allclose(confidence, expected[:n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["causal-override", "swa-5+1"])
def test_proposals_are_the_whole_steps_first_tokens(target, drafts, case):
    """propose(n) runs the head on rows 1..n only and, where every layer is causal, leaves the
    rows past n out of the layers: its tokens are still the whole step's first n, and their
    confidences the whole step's softmax at them."""
    _, _, model = target
    draft = _core.Draft(model, str(drafts[case][1]))
    cache = _core.CrossContext(draft, 64)
    features = context(20, draft.info()["n_target_features"])
    cache.append(features, np.arange(20, dtype=np.int32))
    assert all(draft.info()["causal"]) == (case == "causal-override")
    check_proposals(cache, *cache.step(65, 20))
    with pytest.raises(ValueError, match="draft length 0 outside"):
        cache.propose(65, 20, 0)


def test_a_head_cut_to_the_trained_ids_scores_only_those(target, drafts, tmp_path):
    """A draft trained over a subset of the vocabulary (dflash.head_token_ids) scores exactly the
    subset's logits of the whole head, proposes the best of them, and leaves the rest at -inf."""
    _, hf, model = target
    folder = drafts["swa-5+1"][0]
    whole = _core.Draft(model, str(drafts["swa-5+1"][1]))
    n_vocab = model.n_vocab
    ids = sorted(np.random.default_rng(3).choice(n_vocab, n_vocab // 3, replace=False).tolist())
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["head_token_ids"] = ids
    cut_folder = tmp_path / "cut"
    cut_folder.mkdir()
    (cut_folder / "config.json").write_text(json.dumps(config))
    (cut_folder / "model.safetensors").symlink_to(folder / "model.safetensors")
    cut = _core.Draft(model, str(convert(cut_folder, hf, outtype="f32", outfile=tmp_path / "cut.gguf",
                                         log=lambda _: None)))
    assert (cut.info()["n_head_tokens"], whole.info()["n_head_tokens"]) == (len(ids), n_vocab)
    features = context(20, whole.info()["n_target_features"])
    pos = np.arange(0, 20, dtype=np.int32)
    full_logits, _ = whole.forward(features, pos, 65, 20)
    logits, tokens = cut.forward(features, pos, 65, 20)
    np.testing.assert_allclose(logits[:, ids], full_logits[:, ids], rtol=1e-5, atol=1e-5)
    others = np.setdiff1d(np.arange(n_vocab), ids)
    assert np.all(np.isneginf(logits[:, others]))
    assert tokens == [ids[i] for i in full_logits[1:, ids].argmax(axis=1)]
    assert tokens != list(full_logits[1:].argmax(axis=1))  # the cut changed at least one proposal
    cache = _core.CrossContext(cut, 64)  # a token's confidence is its share of the cut head's softmax
    cache.append(features, pos)
    check_proposals(cache, *cache.step(65, 20))


@pytest.mark.parametrize("ids,message", [
    ([5, 3], "entry 1 (3) is not a token id of the target"),
    ([0, 10**6], "entry 1 (1000000) is not a token id"),
    ([], "must be a list of 1.."),
])
def test_converter_refuses_bad_head_token_ids(target, tmp_path, ids, message):
    test_converter_errors(target, tmp_path, {"head_token_ids": ids}, message)


def test_loader_refuses_bad_head_token_ids(target, drafts, tmp_path):
    bad = rewrite(drafts["swa-5+1"][1], tmp_path / "bad.gguf", fields={"dflash-draft.dflash.head_token_ids": [7, 7]})
    assert "head_token_ids': entry 1 (7) is outside the vocabulary" in load_error(target[2], bad)


# --- bad input -------------------------------------------------------------------------------

def load_error(model, path) -> str:
    with pytest.raises(ValueError) as info:
        _core.Draft(model, str(path))
    return str(info.value)


def test_missing_draft_file(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf: file not found"):
        _core.Draft(target[2], str(tmp_path / "nope.gguf"))


def test_truncated_and_corrupt_drafts(target, drafts, tmp_path):
    whole = drafts["all-full"][1].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) - 1000])
    assert "truncated" in load_error(target[2], tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(whole[:200])
    assert "more than the file holds: truncated or corrupt" in load_error(target[2], tmp_path / "head.gguf")
    (tmp_path / "noise.gguf").write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))
    assert "is not supported (2 or 3)" in load_error(target[2], tmp_path / "noise.gguf")


def test_target_given_as_draft(target):
    gguf_path, _, model = target
    assert "architecture 'qwen3' is not a DFlash draft" in load_error(model, gguf_path)


@pytest.mark.parametrize("edit,message", [
    ({"dflash-draft.dflash.mask_token_id": 100000}, "mask token 100000 is outside the vocabulary"),
    ({"dflash-draft.dflash.target_layer_ids": [0, 9]}, "target layer id 9 is outside the target's 4 layers"),
    ({"dflash-draft.dflash.target_layer_ids": [0, 3]}, "target layer id 3 is the target's last layer"),
    ({"dflash-draft.dflash.n_target_features": 192}, "feature width 192 differs from target hidden size 64 x 2"),
    ({"dflash-draft.attention.sliding_window_pattern": [True, False, True]},
     "sliding_window_pattern has 3 entries for 6 layers"),
    ({"dflash-draft.attention.layer_norm_rms_epsilon": DROP}, "layer_norm_rms_epsilon"),
])
def test_mismatched_header(target, drafts, tmp_path, edit, message):
    bad = rewrite(drafts["swa-5+1"][1], tmp_path / "bad.gguf", fields=edit)
    assert message in load_error(target[2], bad)


def test_vocabulary_mismatch(target, drafts, tmp_path):
    tokens = list(_field(drafts["all-full"][1], "tokenizer.ggml.tokens"))
    shorter = rewrite(drafts["all-full"][1], tmp_path / "short.gguf",
                      fields={"tokenizer.ggml.tokens": tokens[:-1],
                              "tokenizer.ggml.token_type": list(_field(drafts["all-full"][1],
                                                                       "tokenizer.ggml.token_type"))[:-1]})
    assert "vocabulary size" in load_error(target[2], shorter)
    tokens[70] = "zzz"
    renamed = rewrite(drafts["all-full"][1], tmp_path / "renamed.gguf", fields={"tokenizer.ggml.tokens": tokens})
    assert "token 70 is 'zzz' in the draft" in load_error(target[2], renamed)


def test_extra_tensor_is_refused(target, drafts, tmp_path):
    bad = rewrite(drafts["all-full"][1], tmp_path / "bias.gguf",
                  rename_tensor=lambda n: "blk.0.attn_q.bias" if n == "blk.0.attn_q_norm.weight" else n)
    message = load_error(target[2], bad)
    assert "missing tensor 'blk.0.attn_q_norm.weight'" in message or "unexpected tensor" in message


def _field(path, key):
    import gguf
    return gguf.GGUFReader(path).fields[key].contents()


# --- the converter ---------------------------------------------------------------------------

def test_converter_header_keys(target, drafts):
    import gguf
    _, hf, _ = target
    reader = gguf.GGUFReader(drafts["causal-override"][2]["q8_0"])
    f = lambda k: reader.fields[k].contents()  # noqa: E731
    assert f("general.architecture") == "dflash-draft"
    assert f("dflash-draft.dflash.block_size") == 8
    assert f("dflash-draft.dflash.target_layer_ids") == [0, 2]
    assert f("dflash-draft.dflash.n_target_features") == 128
    assert f("dflash-draft.attention.sliding_window_pattern") == [True, True, False]
    assert f("dflash-draft.dflash.is_causal") is True
    assert "dflash-draft.dflash.output_multiplier" not in reader.fields
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert "token_embd.weight" not in types  # borrowed from the target at run time


def test_rope_base_read_from_rope_parameters(target, tmp_path):
    import gguf
    _, hf, _ = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], rope_theta=1e6, rope_in_parameters=True)
    out = convert(folder, hf, outtype="f16", log=lambda _: None)
    assert gguf.GGUFReader(out).fields["dflash-draft.rope.freq_base"].contents() == pytest.approx(1e6)


def test_converter_takes_the_tokenizer_from_a_gguf_target(target, tmp_path):
    import gguf
    gguf_path, hf, model = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[1])
    out = convert(folder, gguf_path, outtype="f32", log=lambda _: None)
    assert _core.Draft(model, str(out)).info()["target_layer_ids"] == [1]
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == \
        gguf.GGUFReader(gguf_path).fields["tokenizer.ggml.pre"].contents()


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["Eagle3DraftModel"]}, "is not supported (expected DFlashDraftModel or DFlash2DraftModel)"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"dflash_config": {"mask_token_id": 5}}, "missing required key 'target_layer_ids'"),
    ({"dflash_config": {"target_layer_ids": [0, 7], "mask_token_id": 5}}, "outside the target's 4 layers"),
    ({"layer_types": ["sliding_attention"], "sliding_window": None}, "sliding_window is not set"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
])
def test_converter_errors(target, tmp_path, change, message):
    _, hf, _ = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], layer_types=["full_attention"])
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert(folder, hf, log=lambda _: None)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": "64"}, "'hidden_size' must be an integer, got '64'"),
    ({"num_hidden_layers": 10**6}, "'num_hidden_layers' is 1000000, outside 1..64"),
    ({"rope_theta": 1e308}, "'rope_theta' must be a positive 32-bit float"),
    ({"rope_scaling": "yarn"}, "'rope_scaling' must be an object"),
    ({"dflash_config": {"target_layer_ids": list(range(300)), "mask_token_id": 5}}, "a list of 1..8 layer ids"),
    ({"layer_types": "full_attention"}, "layer_types must be a list of strings"),
    ({"is_causal": "yes"}, "'is_causal' must be true or false"),
])
def test_converter_refuses_hostile_config_values(target, tmp_path, change, message):
    """Before, each of these escaped as a TypeError, OverflowError or AttributeError."""
    test_converter_errors(target, tmp_path, change, message)


def _draft_with_index(hf, folder, shard_name):
    folder = write_tiny_draft(folder, hf, target_layer_ids=[0], layer_types=["full_attention"])
    names = list(read_tensors(folder))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "model.safetensors" for name in names} | {names[0]: shard_name}}))
    return folder


@pytest.mark.parametrize("shard", ["/dev/zero", "../hf-target/config.json", "/etc/passwd", "sub/../../x"])
def test_shard_names_must_stay_in_the_checkpoint(target, tmp_path, shard):
    """The index names the shards; before, "/dev/zero" hung the converter reading it whole."""
    _, hf, _ = target
    folder = _draft_with_index(hf, tmp_path / "d", shard)
    with pytest.raises(ConversionError, match="is not a path inside the checkpoint folder"):
        convert(folder, hf, log=lambda _: None)


def test_a_hugging_face_cache_snapshot_of_symlinks_converts(target, tmp_path):
    """Shards may be symlinks out of the folder: the hub cache links snapshots to its blobs."""
    _, hf, model = target
    folder = _draft_with_index(hf, tmp_path / "d", "model.safetensors")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (folder / "model.safetensors").rename(blobs / "abc123")
    (folder / "model.safetensors").symlink_to(blobs / "abc123")
    out = convert(folder, hf, outtype="f32", log=lambda _: None)
    assert _core.Draft(model, str(out)).info()["n_layer"] == 1


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])


@pytest.mark.parametrize("field,value,message", [
    ("data_offsets", [0, 8], "holds 8 bytes, but shape"),
    ("data_offsets", [8, 0], "invalid data_offsets"),
    ("data_offsets", [0, 2**62], "runs past the end of the file"),
    ("shape", [-1, 4], "invalid shape"),
    ("dtype", "F64", "unsupported dtype 'F64'"),
])
def test_safetensors_entries_are_checked_against_their_bytes(target, tmp_path, field, value, message):
    _, hf, _ = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], layer_types=["full_attention"])
    _rewrite_header(folder / "model.safetensors", lambda h: h["fc.weight"].update({field: value}))
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert(folder, hf, log=lambda _: None)


def test_every_weight_is_checked_against_the_config(target, tmp_path):
    """Only fc.weight's shape was checked: a transposed k_proj converted, and failed at load."""
    _, hf, _ = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], layer_types=["full_attention"])
    tensors = read_tensors(folder)
    tensors["layers.0.self_attn.k_proj.weight"] = tensors["layers.0.self_attn.k_proj.weight"].T.copy()
    write_tensors(folder / "model.safetensors", tensors)
    with pytest.raises(ConversionError, match=re.escape("blk.0.attn_k.weight has shape [64, 32], expected [32, 64]")):
        convert(folder, hf, log=lambda _: None)


def test_the_output_never_replaces_an_input(target, tmp_path):
    _, hf, _ = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], layer_types=["full_attention"])
    before = (folder / "model.safetensors").read_bytes()
    with pytest.raises(ConversionError, match="is one of the inputs"):
        convert(folder, hf, outfile=folder / "model.safetensors", log=lambda _: None)
    assert (folder / "model.safetensors").read_bytes() == before


def test_an_interrupted_conversion_keeps_the_old_file(target, tmp_path, monkeypatch):
    """Written to a temporary file and renamed: before, Ctrl-C while the weights were written
    left a truncated GGUF at --outfile in place of the old draft."""
    import gguf
    _, hf, _ = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], layer_types=["full_attention"])
    outfile = convert(folder, hf, outtype="f32", outfile=tmp_path / "draft.gguf", log=lambda _: None)
    before = outfile.read_bytes()

    def ctrl_c(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        convert(folder, hf, outtype="q8_0", outfile=outfile, log=lambda _: None)
    assert outfile.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "draft.gguf"]


def test_converter_missing_inputs(target, tmp_path):
    _, hf, _ = target
    with pytest.raises(ConversionError, match="draft folder .* does not exist"):
        convert(tmp_path / "none", hf)
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], layer_types=["full_attention"])
    with pytest.raises(ConversionError, match="target .* does not exist"):
        convert(folder, tmp_path / "no-target")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="no \\*.safetensors weights found"):
        convert(folder, hf)


def test_convert_command_line(target, tmp_path):
    import subprocess
    import sys
    _, hf, _ = target
    folder = write_tiny_draft(tmp_path / "d", hf, target_layer_ids=[0], layer_types=["full_attention"])
    ok = subprocess.run([sys.executable, "-m", "ikdflash.cli.convert", str(folder), "--target-model-dir", str(hf),
                         "--outtype", "q8_0"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert (folder / "d-Q8_0.gguf").is_file() and "wrote" in ok.stderr
    bad = subprocess.run(["ikdflash", "convert", str(folder)], capture_output=True, text=True)
    assert bad.returncode == 2 and "--target-model-dir" in bad.stderr


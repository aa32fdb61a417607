"""DFlash2 drafts (in-block convolutions and the candidate selector): converted into the flat
`dflash` layout, loaded by the fork, computing the reference's logits and choosing its tokens,
lossless in the engine, and every bad file refused naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from ikdflash import Engine, _core, build_info
from ikdflash.convert import convert
from fixtures.tinydraft import converted_tiny_draft
from fixtures.gguf_edit import DROP, rewrite
from test_draft import check_proposals
from test_draft import target  # noqa: F401  (a tiny qwen3 target: GGUF, HF folder, loaded model)

WINDOW = 8
SWA = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
# kernel sizes 1-4, group sizes from 4 channels to the whole width (64), top-K from 1 (the
# selector keeps the argmax) to past the block (8); sliding and full layers
CASES = {
    "k1-full": dict(settings=(1, 16, 8, 4), layer_types=["full_attention"] * 2),
    "k2-swa": dict(settings=(2, 4, 16, 6), **SWA),
    "k3-swa-top1": dict(settings=(3, 64, 8, 1), **SWA),
    "k4-causal": dict(settings=(4, 8, 32, 20), layer_types=["sliding_attention"] * 3, sliding_window=WINDOW,
                      extra_config={"is_causal": True}),
}


def dflash2(settings: tuple[int, int, int, int]) -> dict[str, int]:
    names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    return dict(zip(names, settings))


def make_draft(folder, hf, case: str, outtype: str = "f32", **extra):
    options = dict(CASES[case])
    settings = options.pop("settings")
    return converted_tiny_draft(folder, hf, outtype=outtype, target_layer_ids=[0, 2], seed=11,
                                dflash2=dflash2(settings), **options, **extra)


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    _, hf, _ = target
    return {case: make_draft(tmp_path_factory.mktemp(case), hf, case) for case in CASES}


def context(n_rows: int, width: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_rows, width)).astype(np.float32)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def step_and_reference(target, folder, gguf, n_ctx: int, start: int, first: int = 65):
    from reference import ReferenceDraft

    _, hf, model = target
    draft = _core.Draft(model, str(gguf))
    features = context(n_ctx, draft.info()["n_target_features"])
    logits, tokens = draft.forward(features, np.arange(start - n_ctx, start, dtype=np.int32), first, start)
    ref = ReferenceDraft(folder, hf)
    return logits, tokens, ref.logits(features, first, start), ref.proposal(features, first, start)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n_ctx,start", [(20, 20), (5, 105)])
def test_matches_the_reference(target, drafts, case, n_ctx, start):
    folder, gguf = drafts[case]
    logits, tokens, ref_logits, ref_tokens = step_and_reference(target, folder, gguf, n_ctx, start)
    assert logits.shape == ref_logits.shape
    assert relative_error(logits, ref_logits) <= 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize("case", list(CASES))
def test_the_cpu_convolution_computes_what_the_standard_ops_compute(target, drafts, case, monkeypatch):
    """On the CPU a convolution is one host node; the standard ggml ops (what an accelerator runs,
    IKDFLASH_DFLASH2_CONV_OPS=1) give the same logits bit for bit."""
    _, _, model = target
    folder, gguf = drafts[case]
    features = context(20, _core.Draft(model, str(gguf)).info()["n_target_features"])
    steps = []
    for ops in ("0", "1"):
        monkeypatch.setenv("IKDFLASH_DFLASH2_CONV_OPS", ops)
        draft = _core.Draft(model, str(gguf))
        steps.append(draft.forward(features, np.arange(80, 100, dtype=np.int32), 65, 100))
    (host_logits, host_tokens), (ops_logits, ops_tokens) = steps
    assert np.array_equal(host_logits, ops_logits)
    assert host_tokens == ops_tokens


def test_the_selector_changes_the_proposal(target, drafts):
    """With top-K 1 the selector keeps each row's argmax; with a wider choice it re-ranks, and on
    these random codebooks at least one row's token is not its argmax."""
    rows_changed = 0
    for case in ("k1-full", "k2-swa", "k4-causal"):
        logits, tokens, _, _ = step_and_reference(target, *drafts[case], 20, 20)
        rows_changed += sum(t != a for t, a in zip(tokens, logits[1:].argmax(axis=1)))
    assert rows_changed > 0
    logits, tokens, _, _ = step_and_reference(target, *drafts["k3-swa-top1"], 20, 20)
    assert tokens == list(logits[1:].argmax(axis=1))


def test_a_cut_head_selects_among_its_ids(target, tmp_path):
    """dflash.head_token_ids: the selector's top-K is taken over the ids the head scores, and the
    logits and tokens are still the reference's restricted to them."""
    from reference import ReferenceDraft

    _, hf, model = target
    ids = sorted(np.random.default_rng(3).choice(model.n_vocab, model.n_vocab // 3, replace=False).tolist())
    folder, _ = make_draft(tmp_path, hf, "k2-swa")
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["head_token_ids"] = ids
    (folder / "config.json").write_text(json.dumps(config))
    cut = convert(folder, hf, outtype="f32", outfile=tmp_path / "cut.gguf", log=lambda _: None)
    draft = _core.Draft(model, str(cut))
    assert draft.info()["n_head_tokens"] == len(ids)
    features = context(20, draft.info()["n_target_features"])
    logits, tokens = draft.forward(features, np.arange(0, 20, dtype=np.int32), 65, 20)
    ref = ReferenceDraft(folder, hf)
    ref_logits = ref.logits(features, 65, 20)
    assert relative_error(logits[:, ids], ref_logits[:, ids]) <= 1e-4
    assert all(t in ids for t in tokens)
    # the reference scoring only those ids: its head cut to their rows
    ref.head.weight.data = ref.head.weight.data.clone()
    others = np.setdiff1d(np.arange(model.n_vocab), ids)
    ref.head.weight.data[others] = 0.0
    restricted = ref.logits(features, 65, 20)
    assert tokens == proposal_over(ref, features, restricted, ids)


def proposal_over(ref, features, logits, ids) -> list[int]:
    """The reference selector's greedy walk, its top-K taken over ids only."""
    import torch

    model = ref.model
    selector = model.candidate_selector
    hidden = ref._hidden(features, 65, 20)[:, 1:]
    masked = torch.full_like(torch.from_numpy(logits[1:]), -float("inf"))
    masked[:, ids] = torch.from_numpy(logits[1:, ids])
    with torch.inference_mode():
        tokens, _, _ = selector.select(hidden, masked[None], torch.tensor([65]), 0.0)
    return [int(t) for t in tokens[0]]


@pytest.mark.parametrize("case", ["k4-causal", "k2-swa"])
def test_proposals_are_the_whole_steps_first_tokens(target, drafts, case):
    _, _, model = target
    draft = _core.Draft(model, str(drafts[case][1]))
    cache = _core.CrossContext(draft, 64)
    cache.append(context(20, draft.info()["n_target_features"]), np.arange(20, dtype=np.int32))
    check_proposals(cache, *cache.step(65, 20))


def test_q8_0_follows_the_reference(target, tmp_path):
    _, hf, _ = target
    folder, gguf = make_draft(tmp_path, hf, "k4-causal", outtype="q8_0")
    logits, _, ref_logits, _ = step_and_reference(target, folder, gguf, 20, 20)
    assert relative_error(logits, ref_logits) < 0.05


@pytest.fixture(scope="module")
def engine_pair(tiny_model, tiny_draft):
    target = tiny_model("qwen3")
    return target, tiny_draft(target, target_layer_ids=[0, 2], seed=3, block_size=16,
                              dflash2=dflash2((3, 16, 16, 8)), **SWA)


PROMPT = "in the beginning the quick brown fox jumped over the lazy dog while the cat sat on the mat " * 3


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_speculation_is_lossless(engine_pair, adaptive):
    target, draft = engine_pair
    with Engine(target, draft, n_ctx=512, n_batch=16, cross_ctx=64, n_threads=2) as engine:
        prompt = engine.target.tokenize(PROMPT, add_special=False)
        plain = engine.generate(prompt, max_tokens=40)
        for n_max in (1, 4, 15):
            spec = engine.speculate(prompt, max_tokens=40, n_max=n_max, adaptive=adaptive)
            assert spec.tokens == plain.tokens, f"n_max={n_max}"
            st = spec.stats
            assert st.generated == len(spec.tokens) == 1 + st.accepted + st.steps


def speculates_where_the_target_keeps_its_head(target, draft, **options) -> None:
    """The target's layers on the CPU, then offloaded: the draft follows its head onto the GPU (a
    CPU build runs both cases on the CPU), and speculating with a fixed block length (and options)
    stays the target alone's, drafting."""
    gpu = "CUDA0" if "CUDA" in build_info()["backends"] else "CPU"
    for n_gpu_layers, expected in ((0, "CPU"), (99, gpu)):
        with Engine(target, draft, n_ctx=256, n_batch=16, n_gpu_layers=n_gpu_layers) as engine:
            assert engine.draft_device == expected
            plain = engine.generate(PROMPT, max_tokens=24)
            spec = engine.speculate(PROMPT, max_tokens=24, adaptive=False, **options)
            assert spec.tokens == plain.tokens and spec.stats.drafted > 0


def test_the_draft_runs_where_the_target_keeps_its_head(engine_pair):
    """The selector's codebooks are read on the host wherever the draft runs."""
    speculates_where_the_target_keeps_its_head(*engine_pair, n_max=4)


@pytest.fixture(scope="module")
def oracle_pair(tiny_model, tiny_draft):
    """A target whose head is all zeros (every token equally likely, greedy always token 0) and a
    DFlash2 draft borrowing that head: every logit ties, so its selector picks among ids 0..3."""
    target = tiny_model("llama", zero_head=True)
    return target, tiny_draft(target, target_layer_ids=[1], block_size=8, layer_types=["full_attention"],
                              dflash2=dflash2((2, 16, 8, 4)))


@pytest.mark.parametrize("options", [dict(temperature=0.8), dict(temperature=1.0, top_k=5),
                                     dict(temperature=0.7, repeat_penalty=1.3)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_seeded_sampling_is_the_target_alones(engine_pair, oracle_pair, options):
    """A draft token is kept only when it equals the target's own sample, whatever chose it: with
    the same seed, speculation returns what the target alone returns."""
    for target_path, draft in (engine_pair, oracle_pair):
        with Engine(target_path, draft, n_ctx=512) as engine:
            for seed in (1, 2):
                spec = engine.speculate(PROMPT, max_tokens=24, n_max=4, seed=seed, **options)
                assert spec.tokens == engine.generate(PROMPT, max_tokens=24, seed=seed, **options).tokens


def sampled_share(target, draft, n_max: int, proposed) -> float:
    """Of 400 tokens sampled speculatively (temperature 1) from an oracle pair whose target's head
    is zero, the share for which proposed(token) holds; the draft must have drafted."""
    with Engine(target, draft, n_ctx=512) as engine:
        out = engine.speculate("hi", max_tokens=400, n_max=n_max, temperature=1.0, seed=1)
        assert out.stats.drafted > 0
    return sum(proposed(t) for t in out.tokens) / len(out.tokens)


def test_sampled_tokens_follow_the_target_distribution(oracle_pair):
    """Under the zero head every token is equally likely; speculation must not bias that towards
    the draft's proposals (ids 0..3)."""
    target, draft = oracle_pair
    assert sampled_share(target, draft, 4, lambda t: t < 4) < 0.06  # uniform over 320 tokens: 1.25%


def test_draft_info_names_the_format(target, drafts):
    _, _, model = target
    info = _core.Draft(model, str(drafts["k2-swa"][1])).info()
    assert info["format"] == "dflash"
    assert info["target_layer_ids"] == [0, 2]
    assert info["sliding"] == [True, False]


def load_error(model, path) -> str:
    with pytest.raises(ValueError) as e:
        _core.Draft(model, str(path))
    return str(e.value)


@pytest.mark.parametrize("fields,message", [
    ({"dflash.selector_top_k": 10**6}, "key 'dflash.selector_top_k' is 1000000, above the vocabulary's 320 tokens"),
    ({"dflash.conv_group_size": 24}, "key 'dflash.conv_group_size' is 24, which does not divide the embedding width 64"),
    ({"dflash.conv_kernel_size": 0}, "key 'dflash.conv_kernel_size' is 0, outside 1..16"),
    ({"dflash.selector_rank": DROP}, "missing required key 'dflash.selector_rank'"),
])
def test_bad_header_values_are_refused_by_name(target, drafts, tmp_path, fields, message):
    _, _, model = target
    bad = rewrite(drafts["k2-swa"][1], tmp_path / "bad.gguf", fields=fields)
    assert message in load_error(model, bad)


@pytest.mark.parametrize("tensor,message", [
    ("selector_successor.weight", "missing tensor 'selector_successor.weight'"),
    ("blk.1.ffn_conv_base", "missing tensor 'blk.1.ffn_conv_base'"),
])
def test_a_missing_tensor_is_refused_by_name(target, drafts, tmp_path, tensor, message):
    _, _, model = target
    bad = rewrite(drafts["k2-swa"][1], tmp_path / "bad.gguf", rename_tensor=lambda n: None if n == tensor else n)
    assert message in load_error(model, bad)


def test_dflash2_tensors_without_its_keys_are_refused(target, drafts, tmp_path):
    _, _, model = target
    keys = {f"dflash.{k}": DROP for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    bad = rewrite(drafts["k2-swa"][1], tmp_path / "bad.gguf", fields=keys)
    assert "unexpected tensor" in load_error(model, bad)


@pytest.mark.parametrize("change,message", [
    ({"conv_group_size": 24}, "'conv_group_size' is 24, which does not divide hidden_size 64"),
    ({"selector_top_k": 0}, "'selector_top_k' is 0, outside 1..320"),
    ({"conv_kernel_size": 17}, "'conv_kernel_size' is 17, outside 1..16"),
    ({"selector_rank": None}, "missing required key 'selector_rank'"),
])
def test_the_converter_refuses_bad_settings(target, tmp_path, change, message):
    from ikdflash.convert import ConversionError

    _, hf, _ = target
    folder, _ = make_draft(tmp_path, hf, "k2-swa")
    config = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            del config["dflash_config"][key]
        else:
            config["dflash_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        convert(folder, hf, outtype="f32", outfile=tmp_path / "x.gguf", log=lambda _: None)


# Upstream's converter for DFlash2 (ik_llama.cpp's convert_hf_to_gguf.py with gguf-py beside it),
# run with its vocabulary taken from our reading of the target: the tiny test tokenizer has no
# pre-tokenizer hash it knows, and the vocabulary is the target's either way.
UPSTREAM_TREE = os.environ.get("IKDFLASH_UPSTREAM_TREE")
UPSTREAM_RUNNER = """
import sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree + "/gguf-py", tree]
import convert_hf_to_gguf as upstream
from ikdflash.convert import add_tokenizer_fields, read_target

def set_vocab(self):
    add_tokenizer_fields(self.gguf_writer, read_target(self._require_target_model_dir()).tokenizer)

upstream.DFlash2DraftModel.set_vocab = set_vocab
sys.exit(upstream.main())
"""


@pytest.mark.skipif(not UPSTREAM_TREE, reason="set IKDFLASH_UPSTREAM_TREE to an ik_llama.cpp tree with DFlash2")
@pytest.mark.parametrize("case", ["k2-swa", "k4-causal"])
def test_upstreams_converter_writes_what_ours_writes(target, drafts, tmp_path, case):
    """The same checkpoint through upstream's converter: the same keys, tensors, shapes and types
    (but the names upstream derives from the folder, and our own dflash.dflash.* settings, such
    as is_causal, which upstream does not write), and the same logits and tokens here."""
    _, hf, model = target
    folder, ours = drafts[case]
    theirs = tmp_path / "upstream.gguf"
    runner = tmp_path / "run_upstream.py"
    runner.write_text(UPSTREAM_RUNNER)
    subprocess.run([sys.executable, str(runner), UPSTREAM_TREE, str(folder), "--target-model-dir",
                    str(hf), "--outtype", "f32", "--outfile", str(theirs)], check=True, capture_output=True)

    def layout(path):
        reader = gguf.GGUFReader(path)
        names = {"general.name", "general.size_label", "general.type", "dflash.rope.dimension_count"}
        keys = {k: f.contents() for k, f in reader.fields.items()
                if not k.startswith(("GGUF.", "dflash.dflash.")) and k not in names}
        return keys, {t.name: (tuple(t.shape), t.tensor_type) for t in reader.tensors}

    assert layout(ours) == layout(theirs)
    features = context(20, 128)
    pos = np.arange(20, dtype=np.int32)
    a, tokens_a = _core.Draft(model, str(ours)).forward(features, pos, 65, 20)
    b, tokens_b = _core.Draft(model, str(theirs)).forward(features, pos, 65, 20)
    np.testing.assert_array_equal(a, b)
    assert tokens_a == tokens_b

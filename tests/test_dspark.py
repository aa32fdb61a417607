"""DSpark drafts (a Markov bias on each row's logits from the token before it, a confidence head,
the anchor-first layout), as speculators 0.9.0 saves them: converted, loaded by the fork and
computing what speculators' DSparkDraftModel computes, lossless in the engine and llama-server,
and every bad file refused naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ikdflash import Engine, Server, _core
from ikdflash.convert import ConversionError, convert
from ikdflash.serving.client import post_json
from ikdflash.serving.spectype import SpecType
from fixtures.gguf_edit import rewrite
from fixtures.tinydraft import converted_tiny_draft
from test_dflash2 import PROMPT, sampled_share, speculates_where_the_target_keeps_its_head
from test_draft import context
from test_draft import target  # noqa: F401  (a tiny qwen3 target: GGUF, HF folder, loaded model)

WINDOW = 8
SWA = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
# rank 1 and larger (4 and 8 are shorter than one SIMD block of the CPU's float kernels), the
# confidence head over the hidden state with and without W1's row, or none; sliding, full and
# bidirectional sliding layers; anchor-first (DSpark's default) and the DFlash layout
CASES = {
    "r8-swa": dict(dspark=dict(markov_rank=8), **SWA),
    "r1-full-dflash-layout": dict(dspark=dict(markov_rank=1, confidence="hidden", anchor_first=False),
                                  layer_types=["full_attention"] * 2),
    "r0-confidence-only": dict(dspark=dict(markov_rank=0, confidence="hidden"), **SWA),
    "r4-bidirectional": dict(dspark=dict(markov_rank=4, confidence=None, non_causal=True),
                             layer_types=["sliding_attention"] * 3, sliding_window=WINDOW),
    "r32-swa-dflash-layout": dict(dspark=dict(markov_rank=32, anchor_first=False), **SWA),
}


def make_draft(folder, hf, case: str, outtype: str = "f32"):
    return converted_tiny_draft(folder, hf, outtype=outtype, target_layer_ids=[0, 2], seed=5, block_size=6,
                                **CASES[case])


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    _, hf, _ = target
    return {case: make_draft(tmp_path_factory.mktemp(case), hf, case) for case in CASES}


def ours_and_reference(target, folder, path, n_ctx: int, start: int, first: int = 65):
    from reference import ReferenceDspark

    _, hf, model = target
    draft = _core.Draft(model, str(path))
    features = context(n_ctx, draft.info()["n_target_features"])
    positions = np.arange(start - n_ctx, start, dtype=np.int32)
    logits, tokens = draft.forward(features, positions, first, start)
    cache = _core.CrossContext(draft, 64)
    cache.append(features, positions)
    proposed = cache.propose_with_confidence(first, start, draft.info()["max_proposal"])
    return (logits, tokens, proposed), ReferenceDspark(folder, hf).draft(features, first, start)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n_ctx,start", [(20, 20), (5, 105)])
def test_matches_the_reference(target, drafts, case, n_ctx, start):
    """Every block row's logits with the Markov bias and the confidences within 1e-4 absolute, and
    the same greedy block, from one step and from a proposal."""
    (logits, tokens, (proposed, confidence)), (ref_logits, ref_tokens, ref_confidence) = \
        ours_and_reference(target, *drafts[case], n_ctx, start)
    assert logits.shape == ref_logits.shape
    assert np.max(np.abs(logits - ref_logits)) <= 1e-4
    assert tokens == proposed == ref_tokens
    if ref_confidence is not None:
        assert np.max(np.abs(np.array(confidence) - ref_confidence)) <= 1e-4
    else:  # without a confidence head: the probability under the biased row's softmax
        rows = ref_logits[len(ref_logits) - len(ref_tokens):]
        softmax = np.exp(rows - rows.max(axis=1, keepdims=True))
        softmax /= softmax.sum(axis=1, keepdims=True)
        assert np.allclose(confidence, softmax[np.arange(len(ref_tokens)), ref_tokens], atol=1e-5)


SPECFORGE = {
    "specforge-r8": dict(markov_rank=8, anchor_first=False, layout="specforge"),
    "specforge-r0-hidden": dict(markov_rank=0, confidence="hidden", anchor_first=False, layout="specforge"),
}


@pytest.mark.parametrize("case", list(SPECFORGE))
def test_specforge_checkpoints_match_specforge(target, tmp_path, case):
    """SpecForge's layout (z-lab's config, DSpark's settings in dflash_config, rows 1.. proposing)
    against its own DSparkDraftModel, on full-attention layers: its generation masks nothing, so
    that is where it defines the step."""
    from reference import ReferenceSpecforge

    _, hf, model = target
    folder, path = converted_tiny_draft(tmp_path, hf, target_layer_ids=[0, 2], seed=5, block_size=6,
                                        layer_types=["full_attention"] * 2, dspark=SPECFORGE[case])
    draft = _core.Draft(model, str(path))
    assert draft.info()["max_proposal"] == 5 and draft.info()["dspark"]["anchor_first"] == 0
    features = context(20, draft.info()["n_target_features"])
    logits, tokens = draft.forward(features, np.arange(20, dtype=np.int32), 65, 20)
    cache = _core.CrossContext(draft, 64)
    cache.append(features, np.arange(20, dtype=np.int32))
    proposed, confidence = cache.propose_with_confidence(65, 20, 5)
    ref_logits, ref_tokens, ref_confidence = ReferenceSpecforge(folder, hf).draft(features, 65, 20)
    assert np.max(np.abs(logits[1:] - ref_logits)) <= 1e-4
    assert tokens == proposed == ref_tokens
    assert np.max(np.abs(np.array(confidence) - ref_confidence)) <= 1e-4


def test_specforges_earliest_head_names_convert(target, tmp_path):
    """SpecForge's first DSpark checkpoints kept the heads under logit_head.: the same file."""
    from ikdflash.sources.hf import read_tensors, write_tensors

    _, hf, _ = target
    folder, path = converted_tiny_draft(tmp_path, hf, target_layer_ids=[0, 2], seed=5, block_size=6,
                                        layer_types=["full_attention"] * 2, dspark=SPECFORGE["specforge-r8"])
    weights = read_tensors(folder)
    renamed = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
               for k, v in weights.items()}
    assert renamed.keys() != weights.keys()
    write_tensors(folder / "model.safetensors", renamed)
    again = convert(folder, hf, outtype="f32", outfile=tmp_path / "again.gguf", log=lambda _: None)
    assert again.read_bytes() == path.read_bytes()


def test_the_markov_chain_changes_the_proposal(target, drafts):
    """The bias is large enough on these random heads that some row's choice is not what the
    unbiased logits pick, and the anchor-first layout proposes the whole block."""
    from reference import ReferenceDspark

    _, hf, model = target
    folder, path = drafts["r8-swa"]
    draft = _core.Draft(model, str(path))
    assert draft.info()["max_proposal"] == draft.info()["block_size"] == 6
    assert draft.info()["dspark"] == {"markov_rank": 8, "confidence_width": 72, "anchor_first": 1,
                                      "window_from_block": 1}
    features = context(20, draft.info()["n_target_features"])
    unbiased = ReferenceDspark(folder, hf)
    unbiased.model.markov_head.markov_w2.weight.data.zero_()
    _, tokens, _ = unbiased.draft(features, 65, 20)
    assert draft.forward(features, np.arange(20, dtype=np.int32), 65, 20)[1] != tokens
    assert _core.Draft(model, str(drafts["r1-full-dflash-layout"][1])).info()["max_proposal"] == 5


def test_a_cut_head_chains_over_its_ids(target, tmp_path):
    """head_token_ids: the Markov chain runs over the ids the head scores, its W1 rows taken for
    them; the logits are the reference's at those ids, the tokens its chain restricted to them."""
    from reference import ReferenceDspark

    _, hf, model = target
    ids = sorted(np.random.default_rng(3).choice(model.n_vocab, model.n_vocab // 3, replace=False).tolist())
    folder, _ = make_draft(tmp_path, hf, "r8-swa")
    config = json.loads((folder / "config.json").read_text())
    config["head_token_ids"] = ids
    (folder / "config.json").write_text(json.dumps(config))
    draft = _core.Draft(model, str(convert(folder, hf, outtype="f32", outfile=tmp_path / "cut.gguf",
                                           log=lambda _: None)))
    features = context(20, draft.info()["n_target_features"])
    logits, tokens = draft.forward(features, np.arange(20, dtype=np.int32), 65, 20)
    ref_logits, ref_tokens, _ = ReferenceDspark(folder, hf).draft(features, 65, 20, head_ids=ids)
    assert tokens == ref_tokens and all(t in ids for t in tokens)
    assert np.max(np.abs(logits[:, ids] - ref_logits[:, ids])) <= 1e-4


def test_q8_0_follows_the_reference(target, tmp_path):
    _, hf, _ = target
    (logits, _, _), (ref_logits, _, _) = ours_and_reference(target, *make_draft(tmp_path, hf, "r32-swa-dflash-layout",
                                                                                 outtype="q8_0"), 20, 20)
    assert np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits)) < 0.05


@pytest.fixture(scope="module")
def engine_pair(tiny_model, tiny_draft):
    target = tiny_model("qwen3")
    return target, tiny_draft(target, target_layer_ids=[0, 2], seed=3, block_size=8, dspark=dict(markov_rank=16),
                              **SWA)




@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_speculation_is_lossless(engine_pair, adaptive):
    """n_max up to the whole block: an anchor-first draft proposes block_size tokens a pass."""
    target, draft = engine_pair
    with Engine(target, draft, n_ctx=512, n_batch=16, cross_ctx=64, n_threads=2) as engine:
        assert engine.max_proposal == engine.block_size == 8
        prompt = engine.target.tokenize(PROMPT, add_special=False)
        plain = engine.generate(prompt, max_tokens=40)
        for n_max in (1, 4, 8):
            spec = engine.speculate(prompt, max_tokens=40, n_max=n_max, adaptive=adaptive, confidence=adaptive)
            assert spec.tokens == plain.tokens, f"n_max={n_max}"
            assert spec.stats.generated == len(spec.tokens) == 1 + spec.stats.accepted + spec.stats.steps
        with pytest.raises(ValueError, match="n_max"):
            engine.speculate(prompt, max_tokens=8, n_max=9)


def test_conf_min_cuts_by_the_confidence_head(engine_pair):
    """llama.cpp's fixed floor on the confidence head's output: lossless at any floor, and a floor
    no confidence reaches verifies no draft at all."""
    target, draft = engine_pair
    with Engine(target, draft, n_ctx=512, n_batch=16, cross_ctx=64, n_threads=2) as engine:
        prompt = engine.target.tokenize(PROMPT, add_special=False)
        plain = engine.generate(prompt, max_tokens=40)
        verified = []
        for conf_min in (0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0):
            spec = engine.speculate(prompt, max_tokens=40, n_max=8, adaptive=False, conf_min=conf_min)
            assert spec.tokens == plain.tokens, f"conf_min={conf_min}"
            verified.append(spec.stats.drafted)
        # some floor cuts part of what none cuts; the top one (the head's sigmoid stays below 1) all
        assert any(0 < n < verified[0] for n in verified) and verified[-1] == 0, verified
        with pytest.raises(ValueError, match="conf_min"):
            engine.speculate(prompt, max_tokens=8, conf_min=-0.1)


def test_the_draft_runs_where_the_target_keeps_its_head(engine_pair):
    """The Markov chain and the confidence head run where the rest of the draft step runs."""
    speculates_where_the_target_keeps_its_head(*engine_pair, n_max=8, conf_min=0.2)


@pytest.fixture(scope="module")
def oracle_pair(tiny_model, tiny_draft):
    """A target whose head is all zeros (every token equally likely, greedy always token 0) and a
    DSpark draft borrowing that head with W2 at 0: every biased logit ties, so the chain proposes
    token 0 at every row, which greedy decoding keeps."""
    target = tiny_model("llama", zero_head=True)
    return target, tiny_draft(target, target_layer_ids=[1], block_size=8, layer_types=["full_attention"],
                              dspark=dict(markov_rank=8, markov_bias=False))


def test_kept_proposals_are_lossless(oracle_pair):
    """The accepting path: the chain's proposals kept, whole blocks at a time (anchor-first: 8)."""
    target, draft = oracle_pair
    with Engine(target, draft, n_ctx=512) as engine:
        plain = engine.generate(PROMPT, max_tokens=40)
        for options in (dict(adaptive=False), dict(confidence=True), dict(adaptive=False, conf_min=0.1)):
            spec = engine.speculate(PROMPT, max_tokens=40, n_max=8, **options)
            assert spec.tokens == plain.tokens
            assert spec.stats.accepted > 20, options


def test_sampled_tokens_follow_the_target_distribution(oracle_pair):
    """Under the zero head every token is equally likely; speculation must not bias that towards
    the draft's proposals (token 0)."""
    target, draft = oracle_pair
    assert sampled_share(target, draft, 8, lambda t: t == 0) < 0.03  # uniform over 320 tokens: 0.3%


@pytest.mark.parametrize("options", [dict(temperature=0.8), dict(temperature=1.0, top_k=5)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_seeded_sampling_is_the_target_alones(engine_pair, options):
    target, draft = engine_pair
    with Engine(target, draft, n_ctx=512) as engine:
        for seed in (1, 2):
            spec = engine.speculate(PROMPT, max_tokens=24, n_max=8, seed=seed, **options)
            assert spec.tokens == engine.generate(PROMPT, max_tokens=24, seed=seed, **options).tokens


def test_llama_server_keeps_the_targets_replies(engine_pair, tmp_path):
    target, draft = engine_pair
    prompts = ["the quick brown fox jumps over the lazy dog", PROMPT]

    def replies(url: str) -> list[dict]:
        return [post_json(url + "/completion", {"prompt": p, "n_predict": 32, "temperature": 0,
                                                "ignore_eos": True}) for p in prompts]

    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "alone.log") as url:
        expected = [reply["content"] for reply in replies(url)]
    # llama.cpp's fixed confidence floor, under its own flag: a floor no confidence reaches
    args = ["--model-draft", str(draft), "--spec-type", SpecType(n_max=8, adaptive=False).flag(),
            "--spec-draft-conf-min", "1"]
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "floor.log", extra_args=args) as url:
        floored = replies(url)
    assert [reply["content"] for reply in floored] == expected
    assert sum(reply["timings"]["draft_n"] for reply in floored) == 0
    # ik_llama.cpp's and llama.cpp's names for it: the same speculation, the file says DSpark
    for name in ("dflash", "dspark", "draft-dspark"):
        args = ["--model-draft", str(draft), "--spec-type", SpecType(n_max=8).flag().replace("dflash", name),
                "--parallel", "2"]
        assert SpecType.parse(args[-3]) == SpecType(n_max=8)
        with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / f"{name}.log", extra_args=args) as url:
            speculated = replies(url)
        assert [reply["content"] for reply in speculated] == expected
        assert sum(reply["timings"]["draft_n"] for reply in speculated) > 0


def load_error(model, path) -> str:
    with pytest.raises(ValueError) as e:
        _core.Draft(model, str(path))
    return str(e.value)


@pytest.mark.parametrize("tensors,message", [
    ({"markov_w2.weight": np.zeros((320, 4), np.float32)},
     "tensor 'markov_w2.weight' has rank 4 but 'markov_w1.weight' has rank 8"),
    ({"conf_proj.weight": np.zeros((1, 70), np.float32)},
     "tensor 'conf_proj.weight' is 70 wide: expected the embedding width 64 or it plus the Markov rank, 72"),
    ({"conf_proj.bias": None}, "missing tensor 'conf_proj.bias'"),
    ({"markov_w1.weight": None}, "tensor 'markov_w2.weight' has no 'markov_w1.weight'"),
])
def test_bad_heads_are_refused_by_name(target, drafts, tmp_path, tensors, message):
    _, _, model = target
    drop = {name for name, data in tensors.items() if data is None}
    bad = rewrite(drafts["r8-swa"][1], tmp_path / "bad.gguf", rename_tensor=lambda n: None if n in drop else n,
                  tensors={name: data for name, data in tensors.items() if data is not None})
    assert message in load_error(model, bad)


@pytest.mark.parametrize("change,message", [
    ({"markov_head_type": "rnn"}, "markov_head_type 'rnn' is not supported"),
    ({"draft_vocab_size": 100}, "draft_vocab_size 100 differs from the target's 320"),
    ({"aux_hidden_state_layer_ids": [0, 3]}, "includes 0, the target's embeddings"),
    ({"markov_rank": 0, "confidence_head_with_markov": True}, "confidence_head_with_markov needs markov_rank > 0"),
])
def test_the_converter_refuses_what_it_cannot_write(target, tmp_path, change, message):
    _, hf, _ = target
    folder, _ = make_draft(tmp_path, hf, "r8-swa")
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        convert(folder, hf, outtype="f32", outfile=tmp_path / "x.gguf", log=lambda _: None)

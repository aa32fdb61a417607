"""The speculative engine: lossless against plain generation, honest statistics, hybrid rollback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ikdflash import Engine, build_info
from conftest import TARGET_ARCHS

WINDOW = 8
SWA = dict(layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=WINDOW, block_size=16)
# ~120 tokens: longer than cross_ctx below and than the n_batch of 16 used here
PROMPT = ("in the beginning the quick brown fox jumped over the lazy dog while the cat sat on the mat "
          "and the dog barked at the moon, then everyone went home to sleep until the morning sun. ") * 2


@pytest.fixture(scope="module")
def pairs(tiny_model, tiny_draft):
    """arch -> (target GGUF, SWA draft GGUF made for it)."""
    out = {}
    for arch in TARGET_ARCHS:
        target = tiny_model(arch)
        out[arch] = (target, tiny_draft(target, target_layer_ids=[0, 2], seed=3, **SWA))
    return out


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("cross_ctx", [4, 64])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_speculation_is_lossless(pairs, arch, cross_ctx, adaptive):
    target, draft = pairs[arch]
    with Engine(target, draft, n_ctx=512, n_batch=16, cross_ctx=cross_ctx, n_threads=2) as engine:
        prompt = engine.target.tokenize(PROMPT, add_special=False)
        assert len(prompt) > max(cross_ctx, 16)
        plain = engine.generate(prompt, max_tokens=40)
        assert len(plain.tokens) == 40
        for n_max in (1, 4, 15):
            spec = engine.speculate(prompt, max_tokens=40, n_max=n_max, adaptive=adaptive)
            assert spec.tokens == plain.tokens, f"n_max={n_max}"
            st = spec.stats
            assert st.drafted <= n_max * st.steps
            # the prompt pass gives one token; every step its accepted drafts plus the target's own
            assert st.generated == len(spec.tokens) == 1 + st.accepted + st.steps


def test_plain_generation_equals_the_model(pairs):
    from ikdflash import Model
    target, draft = pairs["qwen3"]
    with Model(target, n_ctx=512) as model:
        expected = model.generate(PROMPT, max_tokens=30, stop_at_eog=False).tokens
    with Engine(target, draft, n_ctx=512, n_batch=16) as engine:
        assert engine.generate(PROMPT, max_tokens=30).tokens == expected


@pytest.mark.parametrize("n_max", [1, 4, 7])
def test_a_draft_that_is_always_right(oracle_pair, n_max):
    """Both heads are all zeros, so every id ties: the draft's greedy tokens come from the
    backend's argmax, which must pick the first maximum (id 0), as the target's sampler does;
    ggml's CPU argmax picked the last one (patch `ggml-argmax-returns-the-first-maximum-on-the-CPU-and`)."""
    target, right, _ = oracle_pair
    with Engine(target, right, n_ctx=256) as engine:
        out = engine.speculate("hello there", max_tokens=1 + 8 * (n_max + 1), n_max=n_max, adaptive=False)
    st = out.stats
    assert out.tokens == [0] * len(out.tokens)
    assert st.steps == 8 and st.drafted == 8 * n_max
    assert st.acceptance == 1.0
    assert st.mean_acceptance_length == n_max + 1
    assert st.generated == 1 + st.accepted + st.steps


def test_a_draft_that_is_always_wrong(oracle_pair):
    target, _, wrong = oracle_pair
    with Engine(target, wrong, n_ctx=256) as engine:
        out = engine.speculate("hello there", max_tokens=20, n_max=4, adaptive=False)
    st = out.stats
    assert st.drafted >= st.steps and st.accepted == 0
    assert st.generated == 1 + st.steps
    assert st.acceptance == 0.0 and st.mean_acceptance_length == 1.0
    assert out.tokens == [0] * 20


def test_hybrid_target_continues_exactly_after_rejections(pairs):
    """qwen35moe: rejected drafts must leave no trace in the Gated DeltaNet state."""
    target, draft = pairs["qwen35moe"]
    with Engine(target, draft, n_ctx=512, n_batch=16) as engine:
        prompt = engine.target.tokenize(PROMPT, add_special=False)
        plain = engine.generate(prompt, max_tokens=60)
        spec = engine.speculate(prompt, max_tokens=60, n_max=4, adaptive=False)
    assert spec.stats.accepted < spec.stats.drafted  # there were rejections to roll back
    assert spec.tokens == plain.tokens


def test_sampling_is_seeded_and_reproducible(pairs):
    target, draft = pairs["qwen3"]
    with Engine(target, draft, n_ctx=512) as engine:
        a = engine.speculate(PROMPT, max_tokens=30, n_max=4, temperature=0.8, seed=5)
        b = engine.speculate(PROMPT, max_tokens=30, n_max=4, temperature=0.8, seed=5)
        greedy = engine.speculate(PROMPT, max_tokens=30, n_max=4)
    assert a.tokens == b.tokens
    assert a.tokens != greedy.tokens


def test_sampled_tokens_follow_the_target_distribution(oracle_pair):
    """With a zero head every token is equally likely under the target; speculation must not
    bias that towards the draft's (always token 0) proposals."""
    target, right, _ = oracle_pair
    with Engine(target, right, n_ctx=512) as engine:
        out = engine.speculate("hi", max_tokens=400, n_max=4, temperature=1.0, seed=1)
    share_of_zero = out.tokens.count(0) / len(out.tokens)
    assert share_of_zero < 0.05  # uniform over ~300 tokens: about 0.3%


def test_context_limit_and_max_tokens(pairs):
    target, draft = pairs["llama"]
    with Engine(target, draft, n_ctx=64) as engine:
        prompt = engine.target.tokenize("the cat sat on the mat", add_special=False)
        out = engine.speculate(prompt, max_tokens=500, n_max=4)
        assert len(prompt) + len(out.tokens) == engine.target.n_ctx  # the fork may round n_ctx up
        assert out.tokens == engine.generate(prompt, max_tokens=500).tokens
        assert len(engine.speculate(prompt, max_tokens=3, n_max=4).tokens) == 3
        with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
            engine.speculate(prompt, max_tokens=0, n_max=4)


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_the_draft_runs_where_the_target_keeps_its_head(pairs, arch):
    """n_gpu_layers_draft -1 follows the target's output layer, 0 is the CPU, > 0 a GPU. A build
    without GPU backends runs everything on the CPU (as llama.cpp ignores -ngl there); on a GPU
    build the same cases place the draft on CUDA0 and still reproduce plain decoding."""
    target, draft = pairs[arch]
    gpu = "CUDA0" if "CUDA" in build_info()["backends"] else "CPU"
    cases = [(0, -1, "CPU"), (0, 0, "CPU"), (99, -1, gpu), (0, 1, gpu)]
    for n_gpu_layers, n_gpu_layers_draft, expected in cases:
        with Engine(target, draft, n_ctx=256, n_batch=16, n_gpu_layers=n_gpu_layers,
                    n_gpu_layers_draft=n_gpu_layers_draft) as engine:
            assert engine.draft_device == expected, (n_gpu_layers, n_gpu_layers_draft)
            plain = engine.generate(PROMPT, max_tokens=24)
            assert engine.speculate(PROMPT, max_tokens=24, n_max=4).tokens == plain.tokens
    if gpu != "CPU":
        # the target's head in GPU memory, the draft told to stay on the CPU: refused, with the way out
        with pytest.raises(ValueError, match="output.weight is in CUDA0 memory, but the draft runs on CPU"):
            Engine(target, draft, n_ctx=256, n_gpu_layers=99, n_gpu_layers_draft=0)


def test_bad_arguments(pairs):
    target, draft = pairs["llama"]
    with pytest.raises(ValueError, match=re.escape("cross_ctx must be >= 0 (0: the target's context), got -1")):
        Engine(target, draft, cross_ctx=-1)
    with Engine(target, draft, n_ctx=64) as engine:
        with pytest.raises(ValueError, match=re.escape("n_max must be in 1..15 (what one draft pass proposes)")):
            engine.speculate("hi", n_max=0)
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            engine.speculate("hi", temperature=-1)
        too_long = [65] * (engine.target.n_ctx + 1)
        with pytest.raises(ValueError, match=f"prompt has {len(too_long)} tokens but the context holds"):
            engine.speculate(too_long)
    with Engine(target, n_ctx=64) as alone:  # without a draft only the lookup proposes
        with pytest.raises(ValueError, match="without a draft model verifies the n-gram lookup's tokens"):
            alone.speculate("hi", lookup=False)


def test_proposals_match_the_reference_end_to_end(tiny_model, tmp_path, monkeypatch):
    """The whole loop against dflash 0.1.0's dflash_generate on the same tiny qwen3 target (as a
    transformers Qwen3ForCausalLM) and draft: same tokens, and the same number of tokens taken
    from every step, which needs the same proposals, hence the same captured features, positions
    and cross-context as the reference."""
    import time

    import dflash.model
    import torch
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import Qwen3ForCausalLM
    from ikdflash.convert import convert
    from fixtures.tinydraft import write_hf_target, write_tiny_draft

    target = tiny_model("qwen3")
    hf = write_hf_target(tmp_path / "hf", target, full=True)
    checkpoint = write_tiny_draft(tmp_path / "draft", hf, target_layer_ids=[0, 2], seed=11, **SWA)
    draft = convert(checkpoint, hf, outtype="f32", outfile=tmp_path / "draft.gguf", log=lambda _: None)

    with Engine(target, draft, n_ctx=512) as engine:
        prompt = engine.target.tokenize(PROMPT[:120], add_special=False)
        ours = engine.speculate(prompt, max_tokens=48, n_max=15, adaptive=False)  # the reference's fixed block

    ref_target = Qwen3ForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ref_draft = DFlashDraftModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # its timer assumes CUDA
    ref = dflash_generate(ref_draft, ref_target, torch.tensor([prompt]), max_new_tokens=48,
                          stop_token_ids=None, return_stats=True)
    ref_tokens = ref.output_ids[0, len(prompt):].tolist()
    assert ours.tokens == ref_tokens
    # the reference counts its prefill token in no step; the last step may be cut by the budget
    assert ours.stats.step_lengths[:-1] == ref.acceptance_lengths[:len(ours.stats.step_lengths) - 1]
    assert sum(ref.acceptance_lengths) > len(ref.acceptance_lengths)  # some drafts were accepted


def run_with_faults(script: str, pair, faults: str) -> dict[str, str]:
    """Run script (argv: target, draft, prompt) in a process of its own, the fault plan being read
    once per process; returns its output's "name: value" lines."""
    target, draft = pair
    result = subprocess.run([sys.executable, "-c", script, str(target), str(draft), PROMPT],
                            env={**os.environ, "IKDFLASH_FAULTS": faults},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.splitlines())


FAILED_CAPTURE = """
import sys
from ikdflash import Engine
target, draft, prompt = sys.argv[1:]
with Engine(target, draft, n_ctx=512, n_threads=2) as engine:
    try:
        engine.speculate(prompt, max_tokens=24)
    except RuntimeError as e:  # a failure of the run, not of the arguments (those are ValueError)
        print("raised:", e)
    print("then:", engine.speculate(prompt, max_tokens=24).tokens)
    print("alone:", engine.generate(prompt, max_tokens=24).tokens)
"""


def test_a_failed_capture_raises_and_the_engine_goes_on(pairs):
    """A pass whose layer outputs cannot be captured (injected on the 10th captured output, the
    fault plan being read once per process, hence the subprocess) raises with the reason instead
    of drafting from a graph cut short; the next call is exact."""
    lines = run_with_faults(FAILED_CAPTURE, pairs["llama"], "capture@10")
    assert "could not be captured" in lines["raised"]
    assert lines["then"] == lines["alone"]


UNCAPTURED_ALONE = """
import sys
from ikdflash import Engine
target, draft, prompt = sys.argv[1:]
with Engine(target, draft, n_ctx=512, n_threads=2) as engine, Engine(target, n_ctx=512, n_threads=2) as plain:
    print("alone:", engine.generate(prompt, max_tokens=24).tokens)
    print("plain:", plain.generate(prompt, max_tokens=24).tokens)
    try:
        engine.speculate(prompt, max_tokens=24)
        print("drafted: without a capture")
    except RuntimeError as e:
        print("drafted:", e)
"""


def test_the_target_alone_on_a_dflash_engine_captures_nothing(pairs):
    """Engine.generate (n_max 0) on a DFlash engine decodes as the target alone does and hands
    the draft nothing: a capture made to fail at its first call is reached only by the
    speculative run after it."""
    lines = run_with_faults(UNCAPTURED_ALONE, pairs["llama"], "capture@1")
    assert lines["alone"] == lines["plain"]
    assert "could not be captured" in lines["drafted"]


def test_streamed_pieces_make_the_same_text(pairs):
    target, draft = pairs["llama"]
    with Engine(target, draft, n_ctx=512, n_batch=16) as engine:
        whole = engine.speculate(PROMPT, max_tokens=40, adaptive=False)  # the same steps (adaptive: timing's)
        stream = engine.stream(PROMPT, max_tokens=40, adaptive=False)
        pieces = list(stream)
        assert len(pieces) > 1 and "".join(pieces) == whole.text
        assert stream.result.tokens == whole.tokens and stream.result.finish_reason == "length"
        assert stream.result.stats.steps == whole.stats.steps
        assert "".join(engine.generate(PROMPT, max_tokens=40, stream=True)) == whole.text


def test_a_stop_string_ends_the_text_before_it(pairs):
    """The stop string may span tokens and steps; it is not returned, and neither is anything
    generated after it in the same step."""
    target, draft = pairs["qwen3"]
    with Engine(target, draft, n_ctx=512, n_batch=16) as engine:
        plain = engine.generate(PROMPT, max_tokens=60)
        text = plain.text
        start = next(k for k in range(len(text) // 2, len(text) - 6) if text.find(text[k:k + 6]) == k)
        stop = text[start:start + 6]
        for stream in (False, True):
            out = engine.speculate(PROMPT, max_tokens=60, stop=["never there", stop], stream=stream)
            if stream:
                pieces = list(out)
                assert stop not in "".join(pieces)
                out = out.result
            assert out.text == text[:start] and out.finish_reason == "stop"
            assert out.tokens == plain.tokens[:len(out.tokens)] and len(out.tokens) < len(plain.tokens)
            assert stop in engine.target.detokenize(out.tokens).decode("utf-8", errors="replace")
        with pytest.raises(ValueError, match="cannot be empty"):
            engine.speculate(PROMPT, stop=[""])


def test_characters_split_across_tokens_are_held_back(tiny_model):
    """The tiny models' tokens are bytes: é, ö and ✓ each span 2 or 3 tokens."""
    from ikdflash import Model
    from ikdflash.streaming import TextDecoder
    with Model(tiny_model("llama"), n_ctx=128) as model:
        text = "héllo wörld ✓ done"
        tokens = model.tokenize(text, add_special=False)
        lead = [model.detokenize([t]) for t in tokens].index(b"\xc3")  # the first byte of é alone
        decoder = TextDecoder(model.detokenize, stop=["done"])
        pieces = [decoder.feed([t]) for t in tokens]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + decoder.finish() == "héllo wörld ✓ " and decoder.stopped == "done"
        assert pieces[lead] == "" and pieces[lead + 1] == "é"


def test_closing_a_stream_early_ends_the_generation(pairs):
    target, draft = pairs["llama"]
    with Engine(target, draft, n_ctx=512, n_batch=16) as engine:
        stream = engine.stream(PROMPT, max_tokens=200)
        first = next(iter(stream))
        stream.close()
        assert stream.result.text.startswith(first)
        assert stream.result.stats.generated < 200
        # the engine is free again, and exact
        assert engine.speculate(PROMPT, max_tokens=20).tokens == engine.generate(PROMPT, max_tokens=20).tokens


def test_chat_without_a_template_in_the_file_uses_chatml(pairs):
    from ikdflash.chat import CHATML, render
    target, draft = pairs["llama"]
    with Engine(target, draft, n_ctx=512, n_batch=16) as engine:
        with pytest.raises(KeyError):
            engine.target.metadata("tokenizer.chat_template")
        answer = engine.chat([("user", "the river")], max_tokens=12)
        prompt = render(CHATML, [("user", "the river")], add_generation_prompt=True)
        tokens = engine.target.tokenize(prompt, add_special=False, parse_special=True)
        assert answer.tokens == engine.generate(tokens, max_tokens=12).tokens
        with pytest.raises(ValueError, match="needs 'role' and 'content'"):
            engine.chat([{"content": "no role"}])


def test_a_long_chat_template_is_read_whole(pairs, tmp_path):
    """Metadata values were read into 512 bytes: a longer template (most real ones) came back cut."""
    from ikdflash.chat import CHATML
    from fixtures.gguf_edit import rewrite
    target, draft = pairs["llama"]
    template = "{# " + "a long comment, as real templates have; " * 40 + "#}" + CHATML
    with_template = rewrite(target, tmp_path / "templated.gguf", fields={"tokenizer.chat_template": template})
    with Engine(with_template, draft, n_ctx=512, n_batch=16) as engine:
        assert engine.target.metadata("tokenizer.chat_template") == template
        assert engine.chat([("user", "the river")], max_tokens=4).stats.generated == 4


SAMPLING_OPTIONS = [dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(temperature=1.0, top_p=0.6),
                    dict(temperature=1.0, min_p=0.2), dict(temperature=0.7, repeat_penalty=1.3),
                    dict(repeat_penalty=1.5, repeat_last_n=16)]


@pytest.mark.parametrize("options", SAMPLING_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_seeded_sampling_with_each_option_is_the_target_alones(pairs, oracle_pair, options):
    """The target samples every position with one chain and a draft token is kept only when it
    equals that sample: with the same seed, speculation returns what the target alone returns,
    through rejections (a random draft) and acceptances (a draft that always agrees)."""
    target, right, _ = oracle_pair
    for t, d in (pairs["llama"], pairs["qwen35moe"], (target, right)):
        with Engine(t, d, n_ctx=512) as engine:
            for seed in (1, 2):
                spec = engine.speculate(PROMPT, max_tokens=24, n_max=4, seed=seed, **options)
                assert spec.tokens == engine.generate(PROMPT, max_tokens=24, seed=seed, **options).tokens


def test_each_option_changes_what_is_sampled(pairs):
    target, draft = pairs["llama"]
    with Engine(target, draft, n_ctx=512) as engine:
        greedy = engine.speculate(PROMPT, max_tokens=24).tokens
        sampled = engine.speculate(PROMPT, max_tokens=24, temperature=1.5, seed=3).tokens
        assert sampled != greedy
        # filters that leave one candidate make sampling greedy
        for narrow in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
            assert engine.speculate(PROMPT, max_tokens=24, temperature=1.5, seed=3, **narrow).tokens == greedy
        penalized = engine.speculate(PROMPT, max_tokens=24, repeat_penalty=2.0).tokens
        assert penalized != greedy
        assert len(set(penalized)) > len(set(greedy))  # fewer repeats


def test_logprobs_of_every_returned_token(pairs):
    target, draft = pairs["qwen3"]
    with Engine(target, draft, n_ctx=512) as engine:
        spec = engine.speculate(PROMPT, max_tokens=20, n_max=4, logprobs=3)
        plain = engine.generate(PROMPT, max_tokens=20, logprobs=3)
        assert spec.logprobs is not None and len(spec.logprobs) == len(spec.tokens) == 20
        for got, want in zip(spec.logprobs, plain.logprobs, strict=True):
            assert got.token == want.token
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top] and len(got.top) == 3
            assert got.top[0] == (got.token, pytest.approx(got.logprob))  # greedy: the most likely
            assert got.top[0][1] >= got.top[1][1] >= got.top[2][1] and got.top[0][1] <= 0
        text = spec.text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        cut = engine.speculate(PROMPT, max_tokens=20, n_max=4, logprobs=1, stop=[stop])
        assert len(cut.logprobs) == len(cut.tokens) < 20
        assert engine.speculate(PROMPT, max_tokens=4).logprobs is None


def test_bad_sampling_options(pairs):
    target, draft = pairs["llama"]
    with Engine(target, draft, n_ctx=64) as engine:
        for options, message in ((dict(top_k=-1), "top_k must be >= 0"), (dict(top_p=0), r"top_p must be in \(0, 1\]"),
                                 (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
                                 (dict(repeat_penalty=0), "repeat_penalty must be > 0"),
                                 (dict(logprobs=-2), "logprobs must be >= 0")):
            with pytest.raises(ValueError, match=message):
                engine.speculate("hi", **options)
        with pytest.raises(ValueError, match="logprobs must be in 0..320"):
            engine.speculate("hi", logprobs=100000)
        with pytest.raises(TypeError, match="top_q"):
            engine.speculate("hi", top_q=0.5)


def test_a_misspelt_sampling_keyword_is_a_type_error_naming_it():
    """The sampling keywords are spelt out on every generating method, with Sampling's defaults:
    a misspelt one fails as Python fails any call, before the engine does anything (so an
    engine with no models loaded does here)."""
    import dataclasses
    import inspect

    from ikdflash.engine import Sampling

    engine = Engine.__new__(Engine)
    fields = {f.name: f.default for f in dataclasses.fields(Sampling)}
    for name in ("speculate", "generate", "chat", "stream"):
        method = getattr(engine, name)
        with pytest.raises(TypeError, match=rf"Engine\.{name}\(\) got an unexpected keyword argument 'temprature'"):
            method("hi", temprature=0.5)
        parameters = inspect.signature(method).parameters
        assert {p: (parameters[p].kind, parameters[p].default) for p in fields} == {
            p: (inspect.Parameter.KEYWORD_ONLY, default) for p, default in fields.items()}, name
        assert not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()), name


def test_a_moe_targets_first_generation_is_like_the_next(pairs):
    """The base ran a context's first single-token pass of BOS as a warm-up, with every expert
    (patch `llama-a-warm-up-pass-only-when-asked-llama_set_warmu`): here the first sampled token is BOS, so the next one came
    from other logits in the first generation than in every later one."""
    target, _ = pairs["qwen35moe"]
    with Engine(target, n_ctx=512) as engine:
        first, again = (engine.generate(PROMPT, max_tokens=3, temperature=0.8, seed=1, logprobs=1) for _ in range(2))
    assert [t.logprob for t in first.logprobs] == [t.logprob for t in again.logprobs]


@pytest.mark.parametrize(("weight_type", "repack"),
                         [("F32", False), ("Q4_1", False), ("Q8_0", False), ("Q4_1", True), ("Q8_0", True)])
def test_a_one_token_decode_computes_what_a_verification_row_computes(tiny_model, tiny_draft, weight_type, repack):
    """Past 256 cached keys the base's CPU flash attention narrowed a single query row's keys and
    split them over threads, so a one-token decode rounded otherwise than the same row inside a
    verification block (by 1e-6 here; on SmolLM2 by a few percent of probability, enough to turn
    9 of 16 greedy replies). Patch `ggml-one-query-row-s-flash-attention-is-one-row-of-a` computes the row as a block's row, and
    patch `ggml-few-row-CPU-flash-attention-cuts-keys-into-fixe` cuts every row's keys into the same chunks of 256 cells whatever
    the thread count: the target's log-probabilities are then identical, bit for bit, with and without the draft and on 1, 2 or
    3 threads, here across a chunk's edge. Grouped-query heads of 64, as SmolLM2's. In Q4_1 and
    Q8_0 too (the built-in pair's types), whose products over 1-8 rows have a kernel of their own
    (patch `iqk-few-row-legacy-quant-products-convert-scales-onc`), and Q4_1 repacked at load (patch
    `iqk-Q4_1-repacked-at-load-rtr-into-8-interleaved-row`)."""
    target = tiny_model("llama", n_layer=3, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=256,
                        weight_type=weight_type)
    draft = tiny_draft(target, target_layer_ids=[0, 1], block_size=8)
    prompt = [3 + (7 * i) % 240 for i in range(254)]
    runs = {}
    for threads in (1, 2, 3):
        with Engine(target, draft, n_ctx=640, n_threads=threads, repack=repack) as engine:
            alone = engine.generate(prompt, max_tokens=12, logprobs=2)
            # a fixed block length: every step verifies n_max + 1 rows (5, and 2)
            dflash = engine.speculate(prompt, max_tokens=12, logprobs=2, adaptive=False)
            pairs = engine.speculate(prompt, max_tokens=12, logprobs=2, n_max=1, adaptive=False)
            for name, out in (("alone", alone), ("dflash", dflash), ("dflash n_max 1", pairs)):
                runs[(name, threads)] = [(t.token, t.logprob, t.top) for t in out.logprobs]
    assert all(r == runs[("alone", 1)] for r in runs.values()), {k: r[:4] for k, r in runs.items()}

"""Loading targets in the fork, the tokenizer, greedy generation, and the errors bad files get."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ikdflash import Model, _core
from conftest import TARGET_ARCHS

TEXT = "the quick brown fox jumps over the lazy dog, then the cat sat on the mat."


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_loads_with_its_architecture(tiny_model, arch):
    with Model(tiny_model(arch), n_ctx=256) as model:
        assert model.architecture == arch
        assert model.n_layer == 4
        assert model.n_vocab > 256


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_tokenizer_round_trip(tiny_model, arch):
    with Model(tiny_model(arch), n_ctx=256) as model:
        tokens = model.tokenize(TEXT, add_special=False)
        assert 0 < len(tokens) < len(TEXT.encode())  # merges apply: fewer tokens than bytes
        assert model.detokenize(tokens).decode() == TEXT


@pytest.mark.parametrize("arch", TARGET_ARCHS)
def test_greedy_generation_is_deterministic(tiny_model, arch):
    with Model(tiny_model(arch), n_ctx=256) as model:
        first = model.generate(TEXT, max_tokens=24, stop_at_eog=False)
        again = model.generate(TEXT, max_tokens=24, stop_at_eog=False)
        assert len(first.tokens) == 24
        assert first.tokens == again.tokens
        assert len(set(first.tokens)) > 1  # the random model is not stuck on one token
        assert first.text == model.detokenize(first.tokens).decode("utf-8", errors="replace")


def test_prompt_longer_than_a_batch_gives_the_same_tokens(tiny_model):
    path = tiny_model("qwen35moe")
    prompt = (TEXT * 6)
    with Model(path, n_ctx=512, n_batch=512) as whole, Model(path, n_ctx=512, n_batch=16) as chunked:
        assert whole.generate(prompt, max_tokens=12, stop_at_eog=False).tokens == \
            chunked.generate(prompt, max_tokens=12, stop_at_eog=False).tokens


@pytest.mark.parametrize("weight_type", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n_embd", [96, 160, 576])
def test_quantized_rows_not_a_multiple_of_128_give_the_same_states_in_any_batch(tiny_model, n_embd, weight_type):
    """The CPU multiplies Q4_1 (and Q5_1) weights by a batch of 32 or more tokens in another
    kernel, which lost a row's last blocks when its 32-wide block count was not a multiple of 4
    (SmolLM2's 576 = 18 blocks): prompt states then depended on how the prompt was batched, so a
    cached prompt, a second slot or a speculative step changed the reply. Batches of 8 take the
    few-row kernel (patch `iqk-few-row-legacy-quant-products-convert-scales-onc`), so the two kernels check each other here, the
    blocks after the last whole group of 4 included (3, 5 and 18 blocks)."""
    path = tiny_model("llama", n_embd=n_embd, n_head=n_embd // 16, n_head_kv=n_embd // 32, n_ff=256,
                      weight_type=weight_type)
    with Model(path, n_ctx=256) as model:
        tokens = model.tokenize(TEXT * 2, add_special=False)[:48]
        whole, _ = _core.training.layer_features(model._native, tokens, [model.n_layer - 2])
    with Model(path, n_ctx=256, n_batch=8) as model:
        chunked, _ = _core.training.layer_features(model._native, tokens, [model.n_layer - 2])
    error = np.abs(whole - chunked).max() / np.abs(chunked).max()
    assert error < 0.02, f"states differ by {100 * error:.1f}% between a batch of 48 and batches of 8"


def test_q4_1_few_row_products_do_not_depend_on_how_threads_split_the_rows(tiny_model):
    """Q4_1 products over 1-8 rows take 8 weight rows at a time (patch `iqk-few-row-Q4_1-products-take-8-weight-rows-at-a-ti`); a
    thread whose share of rows is not a multiple of 8 finishes with a partial group (the feed-forward's 256 rows are
    86/86/84 on 3 threads). Every row's arithmetic is the same in a whole group, a partial one or
    on another thread count, so the states are identical, bit for bit, on 1 and 3 threads."""
    path = tiny_model("llama", n_layer=3, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=256,
                      weight_type="Q4_1")
    states = []
    for threads in (1, 3):
        with Model(path, n_ctx=256, n_batch=8, n_threads=threads) as model:
            tokens = model.tokenize(TEXT * 2, add_special=False)[:40]
            states.append(_core.training.layer_features(model._native, tokens, [0, 1])[0])
    assert np.array_equal(states[0], states[1]), np.abs(states[0] - states[1]).max()


@pytest.mark.parametrize("n_ff", [256, 4352])
def test_q4_1_weights_repacked_at_load_compute_what_they_compute_as_stored(tiny_model, n_ff):
    """Run-time repacking (llama-server's -rtr) interleaves Q4_1 weights 8 rows at a time (patch
    `iqk-Q4_1-repacked-at-load-rtr-into-8-interleaved-row`), so that a few rows' products need no transpose of the stored rows.
    Each lane computes what the stored layout's few-row kernel computes, and large batches convert the interleaved
    rows into the same 8-bit layout as the stored ones: the states are identical, bit for bit, in
    batches of 8 and of 48 (a prompt). Rows of more than 4,096 weights (the feed-forward's down
    projection at n_ff 4352) take another kernel as stored, so in batches of 8 they are close."""
    path = tiny_model("llama", n_layer=3, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=n_ff,
                      weight_type="Q4_1")
    tokens = [3 + (7 * i) % 240 for i in range(48)]
    for n_batch in (8, 48):
        states = {}
        for repack in (False, True):
            with Model(path, n_ctx=256, n_batch=n_batch, n_threads=2, repack=repack) as model:
                states[repack] = _core.training.layer_features(model._native, tokens, [0, 1])[0]
        if n_ff > 4096 and n_batch == 8:
            error = np.abs(states[True] - states[False]).max() / np.abs(states[False]).max()
            assert error < 0.02, f"repacked states differ by {100 * error:.1f}% from the stored layout's"
        else:
            assert np.array_equal(states[True], states[False]), (n_batch, np.abs(states[True] - states[False]).max())


def test_weights_are_repacked_by_default_only_where_results_stay_exact(tiny_model, tmp_path):
    """repack=None (the default) repacks a CPU target whose repackable weights are all Q4_1 or Q8_0
    (their repacked kernels keep verification rows equal to decodes); other types, offloaded
    targets and targets with nothing to repack load as stored."""
    from ikdflash import _core
    from ikdflash.model import repack_by_default
    from fixtures.gguf_edit import rewrite

    def tied(path):  # the head tied to the embedding table, as SmolLM2's
        return rewrite(path, tmp_path / f"tied-{path.name}",
                       rename_tensor=lambda n: None if n == "output.weight" else n)

    shape = dict(n_layer=3, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=256)
    f32 = tied(tiny_model("llama", **shape))
    untied_q4_1 = tiny_model("llama", **shape, weight_type="Q4_1")
    q4_1 = tied(untied_q4_1)
    q6_k = tmp_path / "q6_k.gguf"
    _core.measure.quantize(str(f32), str(q6_k), "Q6_K", 2)
    assert repack_by_default(q4_1)
    assert not repack_by_default(q4_1, n_gpu_layers=1)
    assert not repack_by_default(untied_q4_1)  # a head of its own: a draft may cut rows out of it
    assert not repack_by_default(f32)          # nothing to repack
    assert not repack_by_default(q6_k)
    with Model(q4_1, n_ctx=64) as default, Model(q4_1, n_ctx=64, repack=False) as stored:
        assert default.repacked and not stored.repacked
        assert default.generate("hello", max_tokens=6, stop_at_eog=False).tokens == \
            stored.generate("hello", max_tokens=6, stop_at_eog=False).tokens
    with Model(q6_k, n_ctx=64) as model:
        assert not model.repacked


REPACKED_STATES = """
import sys
import numpy as np
from ikdflash import _core
path, tokens = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
states = {}
for repack in (False, True):
    model = _core.Model(path, n_ctx=256, n_batch=8, n_threads=2, repack=repack)
    try:
        states[repack] = _core.training.layer_features(model, tokens, [0, 1])[0]
    finally:
        model.close()
print(np.abs(states[True] - states[False]).max() / np.abs(states[False]).max())
"""


def test_iq4_nl_weights_repacked_compute_what_they_compute_as_stored(tiny_model, tmp_path):
    """With run-time repacking (llama-server's -rtr) IQ4_NL weights take a kernel of their own,
    whose blocks after the last whole group of 4 read the activations' block sums (int16) as
    bf16: SmolLM2's rows of 576 weights (18 blocks) came out NaN, and the flash attention aborted
    (patch `iqk-repacked-IQ4_NL-reads-block-sums-as-integers-in-`). IQ4_XS targets took that path too: rows not a multiple of 256
    fall back to IQ4_NL. In a subprocess, since the unfixed kernel aborts."""
    from ikdflash import _core
    f32 = tiny_model("llama", n_layer=3, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=256)
    path = tmp_path / "iq4_nl.gguf"
    _core.measure.quantize(str(f32), str(path), "IQ4_NL", 2)
    tokens = ",".join(str(3 + (7 * i) % 240) for i in range(24))
    run = subprocess.run([sys.executable, "-c", REPACKED_STATES, str(path), tokens], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    error = float(run.stdout.split()[-1])
    assert error < 0.02, f"repacked states differ by {100 * error:.1f}% from the stored layout's"


DECODE_PAST_256_KEYS = """
import json, sys
from ikdflash import Engine
path, threads = sys.argv[1], int(sys.argv[2])
with Engine(path, None, n_ctx=640, n_batch=1, n_threads=threads) as engine:
    for length in (254, 256, 258):
        prompt = [3 + (7 * i) % 240 for i in range(length)]
        out = engine.generate(prompt, max_tokens=6, logprobs=1)
        print(json.dumps([t.logprob for t in out.logprobs]))
"""


def test_a_decode_just_past_256_cached_keys_is_the_same_on_one_or_two_threads(tiny_model):
    """With the base's split of a single query row (IKDFLASH_FA_SPLIT_ROW=1; patch
    `ggml-one-query-row-s-flash-attention-is-one-row-of-a` made the row's default path a block's), its keys are narrowed to the
    span the mask leaves (257-290 keys here, of a cache padded to 512) and split over threads into more chunks than the whole cache's
    split; the scratch was sized for the latter (patch `ggml-CPU-flash-attention-scratch-covers-a-narrowed-k`). Here the CPU
    backend's work buffer, which only grows, usually hides the overrun (it showed once as glibc's "corrupted size vs.
    prev_size"); AddressSanitizer with ggml instrumented (.ci/sanitize) sees it. Prompts go in one
    token at a time so no larger graph grows the buffer first. Grouped-query heads of 64, as
    SmolLM2's; in a subprocess, since heap corruption may abort."""
    path = tiny_model("llama", n_layer=2, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=256)
    split = {**os.environ, "IKDFLASH_FA_SPLIT_ROW": "1"}
    runs = [subprocess.run([sys.executable, "-c", DECODE_PAST_256_KEYS, str(path), str(threads)],
                           capture_output=True, text=True, timeout=120, env=split) for threads in (1, 2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    one, two = ([json.loads(line) for line in run.stdout.splitlines()] for run in runs)
    # the two splits add the same terms in another order: F32 rounding only
    assert np.allclose(one, two, rtol=0, atol=1e-4), (one, two)


def test_many_answers_side_by_side_are_each_answer_alone(tiny_model):
    """generate_many decodes several sequences per pass (the draft's training data): greedy, each
    answer is what the model says to that prompt alone; sampled, the seed decides, not the grouping."""
    with Model(tiny_model("llama"), n_ctx=256) as model:
        prompts = [model.tokenize(t) for t in ("the river", "a town and its", "bridges over the water of the", "x")]
        alone = [model.generate(p, max_tokens=24).tokens for p in prompts]
        assert model.generate_many(prompts, max_tokens=24, n_parallel=3) == alone
        sampled = model.generate_many(prompts, max_tokens=24, temperatures=[0.0, 1.5], seed=5, n_parallel=2)
        assert sampled == model.generate_many(prompts, max_tokens=24, temperatures=[0.0, 1.5], seed=5, n_parallel=4)
        assert sampled[0::2] == alone[0::2] and sampled[1::2] != alone[1::2]
        assert model.generate_many([], max_tokens=4) == []
        with pytest.raises(ValueError, match="a prompt is empty"):
            model.generate_many([[1], []], max_tokens=4)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.generate_many([[10**6]], max_tokens=4)
        with pytest.raises(ValueError, match="temperatures must be"):
            model.generate_many(prompts, max_tokens=4, temperatures=[-1.0])


def test_generation_stops_at_the_context_limit(tiny_model):
    with Model(tiny_model("llama"), n_ctx=64) as model:
        prompt = model.tokenize(TEXT, add_special=False)
        out = model.generate(prompt, max_tokens=500, stop_at_eog=False)
        assert len(prompt) + len(out.tokens) == model.n_ctx  # the fork may round n_ctx up


# Mappings of this process advised MADV_HUGEPAGE ("hg" in their VmFlags) before a model is loaded
# and while it is: in a process of its own, whose allocator has not yet reused freed memory.
HUGE_PAGE_ADVICE = """
import sys
from ikdflash import Model
def advised():
    with open("/proc/self/smaps") as smaps:
        return sum("hg" in line.split()[1:] for line in smaps if line.startswith("VmFlags:"))
before = advised()
with Model(sys.argv[1], n_ctx=16384) as model:
    print(before, advised(), model.n_ctx)
"""


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="the kernel has no transparent huge pages")
def test_large_cpu_buffers_ask_for_huge_pages(tiny_model):
    """Patch `ggml-large-CPU-buffers-ask-for-transparent-huge-page`: the KV cache (here 8 MiB) is
    a CPU buffer of 2 MiB or more, so it is advised MADV_HUGEPAGE."""
    run = subprocess.run([sys.executable, "-c", HUGE_PAGE_ADVICE, str(tiny_model("llama"))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    before, loaded, n_ctx = map(int, run.stdout.split())
    assert n_ctx == 16384
    assert loaded > before, (before, loaded)


# --- bad input -------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        Model(missing)


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    with pytest.raises(ValueError, match=r"weights\.bin: not a GGUF file"):
        Model(bogus)


def test_truncated_gguf(tiny_model, tmp_path):
    whole = tiny_model("llama").read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"truncated\.gguf: failed to load model"):
        Model(cut)


def test_unknown_architecture(tiny_model, tmp_path):
    whole = tiny_model("llama").read_bytes()
    # Same length, so every offset in the file stays valid: only the name changes.
    renamed = whole.replace(b"llama.", b"ll4ma.").replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                           b"\x05\x00\x00\x00\x00\x00\x00\x00ll4ma")
    assert renamed != whole
    path = tmp_path / "alien.gguf"
    path.write_bytes(renamed)
    with pytest.raises(ValueError, match=r"alien\.gguf: .*unknown model architecture: 'll4ma'"):
        Model(path)


@pytest.mark.parametrize("bad", [{"n_ctx": 0}])
def test_bad_parameters(tiny_model, bad):
    with pytest.raises(ValueError, match="n_ctx must be at least 1"):
        Model(tiny_model("llama"), **bad)


def test_out_of_vocabulary_tokens(tiny_model):
    with Model(tiny_model("llama"), n_ctx=64) as model:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.generate([1, 2, model.n_vocab + 5], max_tokens=2)


def test_closed_model_refuses_work(tiny_model):
    model = Model(tiny_model("llama"), n_ctx=64)
    model.close()
    with pytest.raises(RuntimeError, match="closed"):
        model.tokenize("hello")

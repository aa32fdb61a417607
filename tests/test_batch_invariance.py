"""Batch-invariant results (llama-server --batch-invariant, Model/Engine batch_invariant=True): on
the CPU a sequence's logits do not depend on the rest of its batch, on how many rows its pass
holds, or on where its cells sit in the KV cache. Without it they do (docs/dflash.md#batch-invariance),
which the tests that can tell show first, so that each comparison is one that can fail."""

from __future__ import annotations

import numpy as np
import pytest

from ikdflash import Model, Server, ServerError
from ikdflash.serving.client import post_json_concurrently
from ikdflash.serving.spectype import SpecType
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

QUESTIONS = ["Explain rainbows to a child.", "Give me a recipe for a simple tomato soup.",
             "What are three good habits for writing maintainable code?", "Why is the sky blue?",
             "Write a haiku about autumn leaves.", "How do vaccines work?",
             "What is the difference between a list and a tuple in Python?", "Name three uses of copper."]


@pytest.fixture(scope="module")
def pair():
    return resolve_pair(DEFAULT_PAIR)


def prompt_tokens(model: Model, n: int) -> list[int]:
    text = " ".join(QUESTIONS) * 4
    tokens = model.tokenize(text)
    assert len(tokens) >= n
    return tokens[:n]


def prefix_states_match(model: Model, tokens: list[int], prefixes: tuple[int, ...]) -> bool:
    """Whether every prefix read in a pass of its own gives, bit for bit, the last captured layer's states
    and the top logits that the whole prompt's pass gives at the same positions."""
    layer = [model.n_layer - 2]
    whole = model.layer_features(tokens, layer, top_k=8)
    for n in prefixes:
        part = model.layer_features(tokens[:n], layer, top_k=8)
        for a, b in zip(part, whole):
            if not np.array_equal(np.asarray(a), np.asarray(b)[:n]):
                return False
    return True


@pytest.fixture(scope="module")
def targets(pair, tiny_model):
    """The built-in target (Q4_1 layers, a Q8_0 head), the same repacked at load (Q4_1_R8), and a
    tiny qwen35moe target (Q8_0: experts, shared experts, recurrent layers)."""
    return {"smollm2": (pair[0], False), "smollm2-repacked": (pair[0], True),
            "qwen35moe": (tiny_model("qwen35moe", weight_type="Q8_0"), False)}


@pytest.mark.parametrize("name", ["smollm2", "smollm2-repacked", "qwen35moe"])
def test_a_prompts_states_do_not_depend_on_the_passes_row_count(targets, name):
    """A prompt of 64 tokens read in one pass, and 1, 9 and 33 of its tokens in passes of their
    own: the product kernels change at 32 rows."""
    path, repack = targets[name]
    prefixes = (1, 9, 33)
    with Model(path, n_ctx=256, n_threads=2, repack=repack) as model:
        tokens = prompt_tokens(model, 64)
        assert not prefix_states_match(model, tokens, prefixes)
    with Model(path, n_ctx=256, n_threads=2, repack=repack, batch_invariant=True) as model:
        assert prefix_states_match(model, tokens, prefixes)


def test_answers_do_not_depend_on_the_sequences_beside_them(pair):
    """Each of four chat questions answered alone and beside the other three (generate_many's one
    context, one batch a step, the sequences' cells interleaved): the same tokens."""

    def together_and_alone(batch_invariant: bool) -> tuple[list, list]:
        with Model(pair[0], n_ctx=1024, n_threads=2, batch_invariant=batch_invariant) as model:
            prompts = [model.tokenize(q) for q in QUESTIONS[:4]]
            together = model.generate_many(prompts, max_tokens=48, n_parallel=4)
            return together, [model.generate_many([p], max_tokens=48, n_parallel=1)[0] for p in prompts]

    together, alone = together_and_alone(False)
    assert together != alone
    together, alone = together_and_alone(True)
    assert together == alone


def test_batch_invariant_needs_flash_attention(pair, tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(ServerError, match="exited with code 1 during start-up"):
        Server(pair[0], ctx_size=512, log_file=log, extra_args=["--batch-invariant", "-fa", "off"],
               startup_timeout=60).start()
    assert "batch_invariant needs flash_attn" in log.read_text()


def chat(question: str, tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, "temperature": 0,
            "cache_prompt": False, "logprobs": True, "top_logprobs": 2}


def replies(target, slots: int, bodies: list[dict], tmp_path, name: str, extra: list[str]) -> list[dict]:
    """The bodies sent `slots` at a time to llama-server --parallel slots --batch-invariant."""
    args = ["--parallel", str(slots), "--batch-invariant"] + extra
    with Server(target, ctx_size=1024 * slots, n_threads=2, log_file=tmp_path / f"{name}.log",
                extra_args=args) as url:
        route = url + "/v1/chat/completions"
        out: list[dict] = []
        for at in range(0, len(bodies), slots):
            out += post_json_concurrently(route, bodies[at:at + slots])
    return out


def answer_and_logprobs(reply: dict) -> tuple[str, list]:
    choice = reply["choices"][0]
    return choice["message"]["content"], choice["logprobs"]["content"]


def test_replies_under_parallel_slots_are_the_replies_served_alone(pair, tmp_path):
    """The built-in pair, 8 chat questions of different lengths, greedy: --parallel 4 four at a
    time, with and without the draft, against --parallel 1 one at a time; the text and every
    token's top log-probabilities, bit for bit."""
    target, draft = pair
    bodies = [chat(q, 40) for q in QUESTIONS]
    reference = [answer_and_logprobs(r) for r in replies(target, 1, bodies, tmp_path, "alone", [])]
    plain = [answer_and_logprobs(r) for r in replies(target, 4, bodies, tmp_path, "plain4", [])]
    assert plain == reference
    dflash = replies(target, 4, bodies, tmp_path, "dflash4",
                     ["--model-draft", str(draft), "--spec-type", SpecType().flag()])
    assert [answer_and_logprobs(r) for r in dflash] == reference
    assert sum(r["timings"].get("draft_n", 0) for r in dflash) > 0

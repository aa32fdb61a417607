"""A pure recurrent target (Mamba: no attention layers) runs on its own, but DFlash refuses it:
its state cannot be rolled back to the accepted tokens, so no draft can be verified on it.
llama-server exits at start-up with that reason, and the bindings raise it."""

from __future__ import annotations

import re

import pytest

from ikdflash import Engine, Model, Server, ServerError
from ikdflash.serving.client import post_json
from ikdflash.serving.spectype import SpecType

REFUSAL = ("the target is a recurrent model without attention layers (Mamba-style): its state cannot be "
           "rolled back to the accepted tokens, so drafts cannot be verified on it")
PROMPT = "the quick brown fox jumps over the lazy dog"
CTX = 256


@pytest.fixture(scope="module")
def mamba_pair(tiny_model, tiny_draft):
    """A tiny Mamba target (4 layers) and a draft converted for it: its vocabulary, width and
    target layers fit, so only the kind of target stands in the way."""
    target = tiny_model("mamba")
    return target, tiny_draft(target, target_layer_ids=[0, 2])


def test_the_target_alone_generates(mamba_pair, tmp_path):
    """The bindings, the engine without a draft and llama-server all load the target and give
    the same greedy text."""
    target, _ = mamba_pair
    with Model(target, n_ctx=CTX, n_threads=2) as model:
        assert model.architecture == "mamba"
        expected = model.generate(PROMPT, max_tokens=8)
    assert len(set(expected.tokens)) > 1
    with Engine(target, n_ctx=CTX, n_threads=2) as alone:
        assert alone.generate(PROMPT, max_tokens=8).tokens == expected.tokens
    with Server(target, ctx_size=CTX, n_threads=2, log_file=tmp_path / "plain.log") as url:
        reply = post_json(url + "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    assert reply["tokens_predicted"] == len(expected.tokens)
    assert reply["content"] == expected.text


def test_llama_server_refuses_a_dflash_draft(mamba_pair, tmp_path):
    target, draft = mamba_pair
    log = tmp_path / "s.log"
    args = ["--model-draft", str(draft), "--spec-type", SpecType(n_max=4).flag()]
    with pytest.raises(ServerError, match="exited with code 1 during start-up"):
        Server(target, ctx_size=CTX, n_threads=2, log_file=log, extra_args=args, startup_timeout=60).start()
    assert REFUSAL in log.read_text()


def test_the_bindings_refuse_a_dflash_draft(mamba_pair, tiny_model):
    target, draft = mamba_pair
    with pytest.raises(ValueError, match=re.escape(REFUSAL)):
        Engine(target, draft, n_ctx=CTX, n_threads=2)
    # the same draft on an attention target of the same width, vocabulary and depth loads: the
    # refusal is for the target's kind alone
    with Engine(tiny_model("llama"), draft, n_ctx=CTX, n_threads=2) as engine:
        assert engine.block_size == 8

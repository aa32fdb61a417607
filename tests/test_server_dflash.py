"""llama-server with DFlash (--spec-type dflash): the real binary on 127.0.0.1, lossless over
HTTP, draft statistics in every response, and every bad flag refused with its reason."""

from __future__ import annotations

import re
import urllib.request

import gguf
import pytest

from ikdflash import Server, ServerError, build_info
from ikdflash.serving.client import post_json, post_json_concurrently, stream_json
from ikdflash.serving.spectype import SpecType
from fixtures.gguf_edit import rewrite

PROMPT = "the quick brown fox jumps over the lazy dog, and the cat sat on the mat. " * 3
CTX = 1024
N_MAX_4 = SpecType(n_max=4)


def dflash_args(draft, spec: SpecType = N_MAX_4) -> list[str]:
    """The flags for a draft, the --spec-type value built by ikdflash.serving.spectype (bad values are
    written out by hand in test_bad_flags_exit_with_their_reason: SpecType refuses them)."""
    return ["--model-draft", str(draft), "--spec-type", spec.flag()]


def all_outputs(url: str) -> dict[str, tuple[str, dict | None]]:
    """The same greedy request over every endpoint: name -> (text, timings)."""
    completion = {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    out = {}
    reply = post_json(url + "/completion", completion)
    out["completion"] = (reply["content"], reply.get("timings"))
    chunks = list(stream_json(url + "/completion", completion))
    out["completion-stream"] = ("".join(c.get("content", "") for c in chunks), chunks[-1].get("timings"))
    reply = post_json(url + "/v1/chat/completions", chat)
    out["chat"] = (reply["choices"][0]["message"]["content"], reply.get("timings"))
    chunks = list(stream_json(url + "/v1/chat/completions", chat))
    text = "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices"))
    out["chat-stream"] = (text, chunks[-1].get("timings"))
    reply = post_json(url + "/v1/completions", {**completion, "max_tokens": 32})
    out["v1-completions"] = (reply["choices"][0]["text"], reply.get("timings"))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen35moe", "llama+dflash2", "qwen35moe+dflash2"])
def test_lossless_on_every_endpoint(swa_pairs, tmp_path, arch):
    target, draft = swa_pairs[arch]
    with Server(target, ctx_size=CTX, n_threads=2, log_file=tmp_path / "plain.log") as url:
        plain = all_outputs(url)
    log = tmp_path / "dflash.log"
    with Server(target, ctx_size=CTX, n_threads=2, log_file=log, extra_args=dflash_args(draft)) as url:
        spec = all_outputs(url)
    for endpoint, (text, timings) in spec.items():
        assert text == plain[endpoint][0], endpoint
        assert len(text) > 0
        assert timings is not None and timings["draft_n"] > 0, endpoint
        assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert "dflash: cross_ctx = 1024 (the slot context)" in log.read_text()


def test_the_draft_is_placed_like_the_target(swa_pairs, tmp_path):
    """With -ngl 99 the draft follows the target's output layer: onto CUDA0 on a GPU build, the CPU
    otherwise (where -ngl is ignored); -ngld 0 keeps it on the CPU on either."""
    target, draft = swa_pairs["qwen35moe"]
    request = {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "ignore_eos": True}
    with Server(target, ctx_size=CTX, n_threads=2, extra_args=["-ngl", "99"]) as url:
        plain = post_json(url + "/completion", request)["content"]
    follow = "CUDA0" if "CUDA" in build_info()["backends"] else "CPU"
    for ngld, expected in (("-1", follow), ("0", "CPU")):
        log = tmp_path / f"ngld{ngld}.log"
        args = dflash_args(draft) + ["-ngl", "99" if ngld == "-1" else "0", "-ngld", ngld]
        with Server(target, ctx_size=CTX, n_threads=2, log_file=log, extra_args=args) as url:
            reply = post_json(url + "/completion", request)
        assert f"dflash: the draft runs on {expected}" in log.read_text()
        assert reply["timings"]["draft_n"] > 0
        if ngld == "-1":
            assert reply["content"] == plain


def test_relative_paths_in_extra_args(swa_pairs, monkeypatch):
    """The server runs in the temp folder (it writes a llama.log where it runs): a relative path
    given in extra_args still means the caller's file."""
    target, draft = swa_pairs["llama"]
    monkeypatch.chdir(draft.parent)
    server = Server(target, ctx_size=CTX, n_threads=2, extra_args=dflash_args(draft.name))
    assert str(draft) in server.command()
    with server as url:
        assert post_json(url + "/completion", {"prompt": PROMPT, "n_predict": 8})["timings"]["draft_n"] > 0


def test_statistics_add_up_and_reach_metrics(oracle_pair, tmp_path):
    """A target that always picks token 0 and a draft that always agrees (conftest.oracle_pair)."""
    target, draft, _ = oracle_pair
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "s.log",
                extra_args=dflash_args(draft, SpecType(n_max=4, cross_ctx=64)) + ["--metrics"]) as url:
        before = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        reply = post_json(url + "/completion", {"prompt": "hello", "n_predict": 21, "temperature": 0,
                                                "ignore_eos": True})
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    t = reply["timings"]
    assert t["draft_n"] == t["draft_n_accepted"] == 16  # 4 steps of 4, then one token of the target's own
    assert t["draft_steps"] == 4 and t["draft_mean_accept_len"] == 5.0
    assert t["draft_drafted_at"] == t["draft_accepted_at"] == [4, 4, 4, 4]
    # the passes' own times, inside the decoding time they are part of
    assert 0 < t["draft_ms"] and 0 < t["verify_ms"] and t["draft_ms"] + t["verify_ms"] < t["predicted_ms"]
    assert "llamacpp:draft_tokens_total 16" in metrics
    assert "llamacpp:draft_tokens_accepted_total 16" in metrics
    assert "llamacpp:draft_steps_total 4" in metrics
    # the same under vLLM's names, as llama.cpp exports them; per position only once a request drafted
    assert "llamacpp:spec_decode_num_draft_tokens 0" in before and "accepted_tokens_per_pos" not in before
    assert "llamacpp:spec_decode_num_draft_tokens 16" in metrics
    assert "llamacpp:spec_decode_num_accepted_tokens 16" in metrics
    assert "llamacpp:spec_decode_num_drafts 4" in metrics
    assert "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos counter" in metrics
    assert [f'llamacpp:spec_decode_num_accepted_tokens_per_pos{{position="{k}"}} 4' for k in range(4)] == \
        [line for line in metrics.splitlines() if line.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos")]
    assert "dflash: cross_ctx = 64, block = 8" in (tmp_path / "s.log").read_text()


def test_low_acceptance_is_logged_and_min_accept_stops_drafting(swa_pairs, tmp_path):
    """The random draft accepts (almost) nothing: the server says so once per request, and with
    min_accept it stops drafting after 16 steps; the reply stays the target's. /slots shows each
    slot's figures by draft position."""
    import json
    target, draft = swa_pairs["llama"]
    body = {"prompt": PROMPT, "n_predict": 64, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    with Server(target, ctx_size=CTX, n_threads=2, log_file=tmp_path / "plain.log") as url:
        plain = post_json(url + "/completion", body)["content"]
    log = tmp_path / "low.log"
    with Server(target, ctx_size=CTX, n_threads=2, log_file=log, extra_args=dflash_args(draft)) as url:
        drafting = [post_json(url + "/completion", body) for _ in range(2)]
        slots = json.loads(urllib.request.urlopen(url + "/slots", timeout=30).read())
    assert [r["content"] for r in drafting] == [plain, plain]
    t = drafting[-1]["timings"]
    assert t["draft_steps"] > 16 and t["draft_drafted_at"][0] == t["draft_steps"]
    assert sum(t["draft_drafted_at"]) == t["draft_n"] and sum(t["draft_accepted_at"]) == t["draft_n_accepted"]
    assert t["draft_mean_accept_len"] == pytest.approx((t["draft_n_accepted"] + t["draft_steps"]) / t["draft_steps"])
    assert slots[0]["speculation"]["draft_steps"] == t["draft_steps"]
    assert slots[0]["speculation"]["draft_accepted_at"] == t["draft_accepted_at"]
    assert log.read_text().count("low acceptance: ") == 2  # once per request
    log = tmp_path / "min.log"
    args = dflash_args(draft, SpecType(n_max=4, min_accept=0.5))
    with Server(target, ctx_size=CTX, n_threads=2, log_file=log, extra_args=args) as url:
        stopped = post_json(url + "/completion", body)
    assert stopped["content"] == plain
    assert stopped["timings"]["draft_steps"] == 16 and stopped["timings"]["draft_n"] == 64
    assert "is below min_accept 50.0%: drafting stops for this request" in log.read_text()


def test_a_token_with_part_of_a_character_is_escaped_in_n_probs(tmp_path):
    """SmolLM2's vocabulary holds tokens that are part of a UTF-8 character: with every token
    among the n_probs the response failed (HTTP 500, 'incomplete UTF-8 string')."""
    from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
    target, _ = resolve_pair(DEFAULT_PAIR)
    with Server(target, ctx_size=256, n_threads=2, log_file=tmp_path / "s.log") as url:
        reply = post_json(url + "/completion", {"prompt": "Hello", "n_predict": 1, "n_probs": 50000})
    texts = [p["tok_str"] for p in reply["completion_probabilities"][0]["probs"]]
    assert len(texts) == 49152 and any("\\x" in t for t in texts)


def test_drafts_past_a_stop_are_not_counted(oracle_pair, tmp_path):
    """The oracle target always picks token 0 (the byte 0x00) and the draft always agrees: the
    prompt pass gives token 1, the first step tokens 2-6 (4 drafts + the target's own), and a stop
    string of 7 such bytes ends the reply at the first token of the second step, a draft. Only
    the 5 drafts returned count as accepted, not the 3 of the second step past the stop."""
    target, draft, _ = oracle_pair
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "s.log",
                extra_args=dflash_args(draft, SpecType(n_max=4, cross_ctx=64))) as url:
        reply = post_json(url + "/completion", {"prompt": "hello", "n_predict": 30, "temperature": 0,
                                                "ignore_eos": True, "stop": ["\x00" * 7]})
    assert reply["stopped_word"] and reply["tokens_predicted"] == 7
    assert reply["timings"]["draft_n"] == 8
    assert reply["timings"]["draft_n_accepted"] == 5


TWO_PROMPTS = [PROMPT, "once upon a time there was a little server that could. " * 3]


@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen35moe", "qwen35moe+dflash2"])
def test_concurrent_requests_are_lossless(swa_pairs, tmp_path, arch, parallel):
    """Two requests at once: queued on one slot, or on two slots whose drafts are verified in the
    same batches (each rejection then leaves holes in the KV cache under the other slot's cells,
    which the base mishandled: patch `kv-cache-the-last-used-cell-is-found-past-holes`). Every reply equals plain decoding, and
    with --parallel 2 so do the top probabilities it reports (each slot's own logits rows: patch
    `server-n_probs-of-accepted-drafts-from-each-slot-s-o`)."""
    target, draft = swa_pairs[arch]
    bodies = [{"prompt": p, "n_predict": 32, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
               "n_probs": 2} for p in TWO_PROMPTS]
    with Server(target, ctx_size=CTX, n_threads=2, log_file=tmp_path / "plain.log") as url:
        expected = [post_json(url + "/completion", b) for b in bodies]
    args = dflash_args(draft) + ["--parallel", str(parallel)]
    with Server(target, ctx_size=CTX * parallel, n_threads=2, log_file=tmp_path / "spec.log", extra_args=args) as url:
        rounds = [post_json_concurrently(url + "/completion", bodies) for _ in range(3)]
    for replies in rounds:
        for got, want in zip(replies, expected, strict=True):
            assert got["content"] == want["content"]
            assert got["timings"]["draft_n"] > 0
            # the top candidate and its probability (the runner-up can swap with a near-tie, as the
            # batches differ in size and the CPU kernels round differently)
            for g, w in zip(got["completion_probabilities"], want["completion_probabilities"], strict=True):
                assert g["probs"][0]["tok_str"] == w["probs"][0]["tok_str"]
                assert g["probs"][0]["prob"] == pytest.approx(w["probs"][0]["prob"], rel=1e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_a_cached_prompt_prefix_keeps_its_draft_context(swa_pairs, tmp_path, arch):
    """A request that extends the last one's prompt: the server reuses the cached prefix, and the
    draft keeps the context rows of that prefix instead of starting empty (lossless either way)."""
    target, draft = swa_pairs[arch]
    bodies = [{"prompt": p, "n_predict": 16, "temperature": 0, "ignore_eos": True, "cache_prompt": True}
              for p in (PROMPT, PROMPT + "and then the fox ran home. ")]
    with Server(target, ctx_size=CTX, n_threads=2, log_file=tmp_path / "plain.log") as url:
        expected = [post_json(url + "/completion", b)["content"] for b in bodies]
    log = tmp_path / "spec.log"
    with Server(target, ctx_size=CTX, n_threads=2, log_file=log, extra_args=dflash_args(draft)) as url:
        replies = [post_json(url + "/completion", b) for b in bodies]
    assert [r["content"] for r in replies] == expected
    kept = [int(p) for p in re.findall(r"dflash: the draft keeps its context rows before position (\d+)",
                                       log.read_text())]
    assert kept[0] == 0 and kept[1] > 0, kept
    assert replies[1]["tokens_cached"] >= kept[1]


def test_full_attention_switch(swa_pairs, tmp_path):
    target, draft = swa_pairs["llama"]
    log = tmp_path / "s.log"
    with Server(target, ctx_size=CTX, n_threads=2, log_file=log,
                extra_args=dflash_args(draft, SpecType(n_max=4, full_attention=True))) as url:
        reply = post_json(url + "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    assert reply["timings"]["draft_n"] > 0
    assert "(ignored: full_attention): the window can never engage" in log.read_text()


def test_mainline_spellings_are_accepted(swa_pairs, tmp_path):
    """Commands copied from mainline llama.cpp: --spec-type draft-dflash, --spec-draft-model."""
    target, draft = swa_pairs["llama"]
    mainline = ["--spec-draft-model", str(draft), "--spec-type", "draft-dflash:n_max=3,log_drafts=1"]
    with Server(target, ctx_size=CTX, n_threads=2, log_file=tmp_path / "s.log", extra_args=mainline) as url:
        reply = post_json(url + "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0})
    assert reply["timings"]["draft_n"] > 0
    drafts = re.findall(r"dflash: drafts after \d+ at \d+:([\d ]*)", (tmp_path / "s.log").read_text())
    assert drafts and len(drafts[0].split()) == 3  # n_max=3 was read


@pytest.mark.parametrize("flags", [["-cd", "256"], ["--ctx-size-draft", "256", "--spec-type", "dflash:cross_ctx=256"]])
def test_ctx_size_draft_sets_the_history(swa_pairs, tmp_path, flags):
    """-cd/--ctx-size-draft, upstream's flag for a DFlash draft's history, is cross_ctx; both may
    be given when they agree."""
    target, draft = swa_pairs["llama"]
    log = tmp_path / "s.log"
    args = dflash_args(draft) + flags
    with Server(target, ctx_size=CTX, n_threads=2, log_file=log, extra_args=args) as url:
        reply = post_json(url + "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0})
    assert reply["timings"]["draft_n"] > 0
    assert "dflash: cross_ctx = 256, block" in log.read_text()


@pytest.mark.parametrize("spec,extra,message", [
    ("dflash:n_max=4,colour=red", True, "unknown key 'colour'"),
    ("dflash:cross_ctx=-1", True, "cross_ctx must be at least 0, got -1"),
    ("dflash:n_max=four", True, "n_max=four is not an integer"),
    ("dflash:min_accept=2", True, "min_accept must be a number in [0, 1], got '2'"),
    ("dflash:adaptive=2", True, "adaptive must be 0 or 1, got '2'"),
    ("dflash:conf_min=1.5", True, "conf_min must be a number in [0, 1], got '1.5'"),
    ("dflash", ["--spec-draft-conf-min", "-1"], "--spec-draft-conf-min: --spec-type dflash: conf_min must be a number"),
    ("dflash:n_max=-1", True, "n_max must be at least 1, got -1"),
    ("dflash:n_max=4", False, "--spec-type dflash needs the DFlash draft: pass it with --model-draft"),
    # 4 slots x 5 verification rows do not fit a batch of 16: an assert at the first busy step, before
    ("dflash:n_max=4", ["--parallel", "4", "--batch-size", "16", "--ubatch-size", "16"],
     "4 slots x 5 rows (n_max + 1) exceed --batch-size 16"),
    ("dflash:cross_ctx=128", ["-cd", "256"], "--spec-type dflash:cross_ctx=128 and -cd 256 disagree"),
])
def test_bad_flags_exit_with_their_reason(swa_pairs, tmp_path, spec, extra, message):
    target, draft = swa_pairs["llama"]
    args = (["--model-draft", str(draft), *(extra if isinstance(extra, list) else [])] if extra else [])
    args += ["--spec-type", spec]
    log = tmp_path / "s.log"
    with pytest.raises(ServerError, match="exited with code 1 during start-up"):
        Server(target, ctx_size=CTX, log_file=log, extra_args=args, startup_timeout=60).start()
    assert message in log.read_text()


def test_mismatched_draft_is_refused(swa_pairs, tmp_path):
    target, _ = swa_pairs["llama"]
    _, other_draft = swa_pairs["qwen35moe"]  # same vocabulary and width: only the layer ids are wrong
    bad = rewrite(other_draft, tmp_path / "bad.gguf", fields={"dflash-draft.dflash.target_layer_ids": [0, 9]})
    log = tmp_path / "s.log"
    with pytest.raises(ServerError, match="exited with code 1 during start-up"):
        Server(target, ctx_size=CTX, log_file=log, extra_args=dflash_args(bad), startup_timeout=60).start()
    assert "target layer id 9 is outside the target's 4 layers" in log.read_text()


def test_a_huge_n_probs_is_clamped_to_the_vocabulary(swa_pairs, tmp_path):
    """n_probs near 2^31 threw bad_alloc out of the server's main loop, which killed it."""
    target, draft = swa_pairs["llama"]
    with Server(target, ctx_size=CTX, n_threads=2, log_file=tmp_path / "s.log", extra_args=dflash_args(draft)) as url:
        reply = post_json(url + "/completion", {"prompt": PROMPT, "n_predict": 2, "temperature": 0,
                                                "n_probs": 2**31 - 1})
        n_vocab = len(reply["completion_probabilities"][0]["probs"])
        assert post_json(url + "/completion", {"prompt": PROMPT, "n_predict": 2, "temperature": 0})["content"]
    assert n_vocab == len(gguf.GGUFReader(target).fields["tokenizer.ggml.tokens"].contents())

"""llama-server with DFlash on every path that rewrites a slot's cache (issue: exact on every slot
path): a chat continued then edited (hybrid checkpoints), prompts swapped through the RAM cache,
/slots save and restore, context shifts of a long prompt and of a long generation, and two
slots. Each conversation runs on the target alone and with the draft; the replies must match.

Random drafts accept nothing, so whether the draft kept the right context shows here in the
server's log for each path, in test_draft.py's exact checks of truncation, shift and state, and
in the built-in pair's acceptance (benchmarks/server/paths.py)."""

from __future__ import annotations

import itertools
import re

import pytest

from ikdflash import Server, ServerError
from ikdflash.serving.client import post_json, post_json_concurrently, stream_json
from ikdflash.model import Model
from ikdflash.serving.spectype import SpecType

STORY = ("the quick brown fox jumps over the lazy dog, and the cat sat on the mat while the rain fell "
         "on the old town by the river. ")
OTHER = "once upon a time there was a little server that could, and it answered every request. "
# the phrases that end the server's draft context instead of keeping it
DRAFT_RESETS = ("resetting the draft context", "dflash: no draft")


def dflash_args(draft, log_drafts: bool = False) -> list[str]:
    """With log_drafts, the draft alone proposes: the tests compare its proposals."""
    spec = SpecType(n_max=4, log_drafts=log_drafts, lookup=False if log_drafts else None)
    return ["--model-draft", str(draft), "--spec-type", spec.flag()]


def completion(prompt: str | list[int], n_predict: int, **extra) -> dict:
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True, **extra}


def cancel_stream(url: str, body: dict, n_events: int) -> None:
    """A streamed request whose client hangs up after n_events events, as a closed browser tab
    or a Ctrl-C in a client does."""
    events = stream_json(url + "/completion", body)
    for _ in itertools.islice(events, n_events):
        pass
    events.close()


def run(url: str, steps: list) -> list[dict]:
    """Requests in order; a step ("save"|"restore"|"erase", filename) acts on slot 0 instead,
    ("cancel", body) streams body and hangs up early, and a list of bodies is sent concurrently."""
    replies = []
    for step in steps:
        if isinstance(step, tuple) and step[0] == "cancel":
            cancel_stream(url, step[1], n_events=4)
        elif isinstance(step, tuple):
            action, filename = step
            post_json(f"{url}/slots/0?action={action}", {"filename": filename}, timeout=60)
        elif isinstance(step, list):
            replies += post_json_concurrently(url + "/completion", step)
        else:
            replies.append(post_json(url + "/completion", step))
    return replies


def side_by_side(target, draft, tmp_path, steps, ctx=1024, args=(), faults="") -> tuple[list[dict], list[dict], str]:
    """The conversation on the target alone and with the draft (each on a fresh server; faults
    injected into the second: IKDFLASH_FAULTS): (plain replies, DFlash replies, its log)."""
    with Server(target, ctx_size=ctx, n_threads=2, log_file=tmp_path / "plain.log", extra_args=list(args)) as url:
        plain = run(url, steps)
    log = tmp_path / "dflash.log"
    with Server(target, ctx_size=ctx, n_threads=2, log_file=log, extra_args=[*args, *dflash_args(draft)],
                env={"IKDFLASH_FAULTS": faults}) as url:
        spec = run(url, steps)
    return plain, spec, log.read_text()


def assert_same_text(plain: list[dict], spec: list[dict]) -> None:
    assert [r["content"] for r in spec] == [r["content"] for r in plain]
    assert all(r["timings"]["draft_n"] > 0 for r in spec)


def assert_same_top_probabilities(plain: list[dict], spec: list[dict]) -> None:
    """A state that ran over other tokens can keep the argmax of a tiny random model: compare the
    top probability of every token too (within the rounding of batches of other sizes)."""
    for got, want in zip(spec, plain, strict=True):
        for g, w in zip(got["completion_probabilities"], want["completion_probabilities"], strict=True):
            assert g["probs"][0]["prob"] == pytest.approx(w["probs"][0]["prob"], rel=1e-2)


def stop_string(target, tmp_path, prompt: str) -> tuple[str, str]:
    """A stop string the target alone reaches mid-reply: (text before it, the string)."""
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "probe.log") as url:
        text = post_json(url + "/completion", completion(prompt, 24, ignore_eos=True, cache_prompt=False))["content"]
    for k in range(len(text) // 3, len(text) - 6):
        if text.find(text[k:k + 5]) == k and text[k:k + 5].strip():
            return text[:k], text[k:k + 5]
    pytest.fail(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen35moe", "qwen35moe+dflash2"])
def test_chat_continued_then_edited(swa_pairs, tmp_path, arch, parallel):
    """Request 1 ends on a stop string mid-step (rejected drafts: for the hybrid target the final
    checkpoint must hold the state after the replay of the kept tokens); request 2 continues the
    chat, request 3 edits request 2's turn, which restores that checkpoint."""
    target, draft = swa_pairs[arch]
    before, stop = stop_string(target, tmp_path, STORY * 2)
    turn = STORY * 2 + before + stop
    steps = [completion(STORY * 2, 24, stop=[stop], ignore_eos=True),
             completion(turn + " and then the user asked about the river", 16, ignore_eos=True, n_probs=1),
             completion(turn + " but the user asked about the cat instead", 16, ignore_eos=True, n_probs=1)]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps, ctx=1024 * parallel,
                                    args=["--parallel", str(parallel)])
    assert plain[0]["stopped_word"] and spec[0]["stopped_word"]
    assert_same_text(plain, spec)
    assert_same_top_probabilities(plain[1:], spec[1:])
    if arch == "qwen35moe":
        assert "restored context checkpoint" in log
    assert not any(phrase in log for phrase in DRAFT_RESETS)


def token_turn(target, tmp_path, prompt: str) -> tuple[list[int], str, list[int]]:
    """The prompt's token ids, a stop string the target alone reaches mid-reply, and the ids it
    generates up to and including the stop string's token."""
    _, stop = stop_string(target, tmp_path, prompt)
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "ids.log") as url:
        ids = post_json(url + "/tokenize", {"content": prompt})["tokens"]
        reply = post_json(url + "/v1/completions", {"prompt": ids, "max_tokens": 24, "temperature": 0,
                                                     "stop": [stop], "ignore_eos": True, "logprobs": 1})
    return ids, stop, [t["id"] for t in reply["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_chat_continued_token_for_token_then_edited(swa_pairs, tmp_path, arch):
    """As above, in token ids, so that request 2 extends every cached token of request 1 (no
    restore) and request 3, which edits request 2's turn, restores the checkpoint taken when
    request 1 ended. Before, that checkpoint was taken before the replay of the kept tokens, so
    it held the recurrent state after the rejected drafts, and request 3 went on from it."""
    target, draft = swa_pairs[arch]
    ids, stop, generated = token_turn(target, tmp_path, STORY * 2)
    turn = ids + generated
    steps = [completion(ids, 24, stop=[stop], ignore_eos=True),
             completion(turn + [300, 301, 302, 303], 16, ignore_eos=True, n_probs=1),
             completion(turn + [310, 311, 312, 313], 16, ignore_eos=True, n_probs=1)]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps)
    assert plain[0]["stopped_word"] and spec[0]["stopped_word"]
    assert_same_text(plain, spec)
    assert_same_top_probabilities(plain[1:], spec[1:])
    if arch == "qwen35moe":
        # the last cached token of request 1 (its final sampled token is not cached)
        assert "restored context checkpoint took" in log and f"pos_max = {len(turn) - 2}, size" in log
    assert not any(phrase in log for phrase in DRAFT_RESETS)


@pytest.mark.parametrize("arch", ["llama", "qwen35moe", "qwen35moe+dflash2"])
def test_prompts_swapped_through_the_ram_cache(swa_pairs, tmp_path, arch):
    """Conversation A, then B (A goes to the RAM cache), then A continued (A comes back)."""
    target, draft = swa_pairs[arch]
    a, b = STORY * 3, OTHER * 3
    steps = [completion(a, 16, ignore_eos=True), completion(b, 16, ignore_eos=True),
             completion(a + " and so", 16, ignore_eos=True)]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps, args=["--cache-ram", "64"])
    assert_same_text(plain, spec)
    assert "found better prompt" in log
    assert not any(phrase in log for phrase in DRAFT_RESETS)


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_a_prompt_that_fails_to_come_back_from_the_ram_cache_is_evaluated_again(swa_pairs, tmp_path, arch):
    """A goes to the RAM cache when B, which shares its first third, takes the slot; A continued
    brings it back, and the restore fails (injected: a cut state, which the base rejects after
    emptying the slot's cells). The slot kept B's tokens and reused that third from cells that
    were gone: the soak's reply that turned at its first token, where the reference was 84% sure."""
    target, draft = swa_pairs[arch]
    a = STORY * 3
    steps = [completion(a, 16, ignore_eos=True, n_probs=1),
             completion(a[:len(a) // 3] + OTHER * 2, 8, ignore_eos=True, n_probs=1),
             completion(a + " and so", 16, ignore_eos=True, n_probs=1)]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps, args=["--cache-ram", "64"],
                                    faults="prompt_restore@1,prompt_restore@2")  # the restore and its retry
    assert "failed to load prompt from cache; the slot's cached tokens are dropped" in log
    assert_same_text(plain, spec)
    assert_same_top_probabilities(plain, spec)


def test_two_long_replies_side_by_side_fit_the_context(swa_pairs, tmp_path):
    """Two slots verify side by side, so their rows interleave in the KV cache, and each step's
    rejected drafts leave holes of 4 cells that no later view of 10 fits: the replies failed (HTTP
    500, "KV cache is full") with a third of the 1024 cells in use. Now a view that finds no room
    defragments the cache first. Every token stays the target's own choice; the replies match the
    target alone's up to a near-tie that batching with the other slot may turn."""
    from soak import first_difference, not_the_targets_choice

    target, draft = swa_pairs["llama"]
    prompts = [list(range(10, 110)), list(range(110, 210))]
    bodies = [completion(p, n, ignore_eos=True, n_probs=2) for p, n in zip(prompts, (400, 200), strict=True)]
    plain, spec, log = side_by_side(target, draft, tmp_path, [bodies], args=["--parallel", "2"])
    assert [r["tokens_predicted"] for r in spec] == [400, 200]
    assert "defragmenting it" in log
    assert all(not_the_targets_choice(r) is None for r in spec)
    for got, want in zip(spec, plain, strict=True):
        turn = first_difference(got, want)
        assert turn is None or turn[1] < 0.02, turn


def test_the_prefix_is_reused_with_reasoning_tokens_none(swa_pairs, tmp_path):
    """With --reasoning-tokens none, looking for a better cached prompt moved the token lists it
    compared out of the slot and out of every cached prompt: once the RAM cache held a prompt,
    nothing was reused and each request evaluated its whole prompt again."""
    target, draft = swa_pairs["llama"]
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "s.log",
                extra_args=["--reasoning-tokens", "none", *dflash_args(draft)]) as url:
        replies = run(url, [completion(STORY * 2, 4), completion(OTHER * 3, 4), completion(OTHER * 3, 4),
                            completion(STORY * 2, 4)])
    assert [r["timings"]["prompt_n"] for r in replies[2:]] == [1, 1]


@pytest.mark.parametrize("arch", ["llama", "qwen35moe", "qwen35moe+dflash2"])
def test_slot_save_and_restore(swa_pairs, tmp_path, arch):
    target, draft = swa_pairs[arch]
    saved = tmp_path / "slots"
    saved.mkdir()
    a, b = STORY * 3, OTHER * 3
    steps = [completion(a, 16, ignore_eos=True), ("save", "a.bin"), completion(b, 16, ignore_eos=True),
             ("restore", "a.bin"), completion(a + " and so", 16, ignore_eos=True)]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps,
                                    args=["--slot-save-path", str(saved), "--cache-ram", "0"])
    assert_same_text(plain, spec)
    assert (saved / "a.bin.dflash").is_file()
    assert not any(phrase in log for phrase in DRAFT_RESETS + ("no usable draft rows",))


# context shifts: the base refuses them for hybrid targets (a recurrent state cannot be shifted),
# with or without a draft, so they run on llama only

def test_a_prompt_longer_than_the_context(swa_pairs, tmp_path):
    """Request 2 extends request 1's prompt past the context: the server discards part of the
    cached prompt and shifts the rest (context_shift_prompt); the draft's rows move with it."""
    target, draft = swa_pairs["llama"]
    steps = [completion(STORY * 2, 8, ignore_eos=True), completion(STORY * 8, 16, ignore_eos=True, n_keep=4)]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps, ctx=256, args=["--context-shift", "on"])
    assert_same_text(plain, spec)
    assert "dflash: context shift" in log
    assert not any(phrase in log for phrase in DRAFT_RESETS)


@pytest.mark.parametrize("arch", ["llama", "llama+dflash2"])
def test_a_generation_that_shifts_the_context(swa_pairs, tmp_path, arch):
    """Before, the draft kept its rows at the old positions: the next draft failed and the whole
    context was reset with a warning, the valid prefix included."""
    target, draft = swa_pairs[arch]
    steps = [completion(STORY, 300, ignore_eos=True, n_keep=4)]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps, ctx=128, args=["--context-shift", "on"])
    assert_same_text(plain, spec)
    assert spec[0]["truncated"] and spec[0]["tokens_predicted"] == 300
    assert "dflash: context shift" in log
    assert not any(phrase in log for phrase in DRAFT_RESETS)


def test_slot_actions_after_short_requests_never_hang(swa_pairs, tmp_path):
    """A /slots action right after a short completion: the base posted the task before waiting
    for its result, so a result that came first was dropped and the request hung (patch
    `server-register-for-a-task-s-result-before-posting-t`)."""
    target, draft = swa_pairs["llama"]
    saved = tmp_path / "slots"
    saved.mkdir()
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "s.log",
                extra_args=["--slot-save-path", str(saved), *dflash_args(draft)]) as url:
        for i in range(30):
            post_json(url + "/completion", completion(STORY, 2))
            post_json(f"{url}/slots/0?action=save", {"filename": f"s{i}.bin"}, timeout=10)


# --- the draft's context: what it proposes after each path, against a fresh request -----------

def proposals(log: str) -> dict[int, list[tuple[str, ...]]]:
    """The proposals a server logged (log_drafts=1), by task: (after token, at position, ids)."""
    out: dict[int, list[tuple[str, ...]]] = {}
    for m in re.finditer(r"task (\d+) \| dflash: drafts after (\d+) at (\d+):([\d ]*)", log):
        out.setdefault(int(m[1]), []).append(m.group(2, 3, 4))
    return out


@pytest.mark.parametrize("path", ["edit", "ram-cache", "slot-restore", "cancelled-stream"])
@pytest.mark.parametrize("arch", ["llama", "qwen35moe", "qwen35moe+dflash2"])
def test_the_draft_proposes_what_a_fresh_request_proposes(swa_pairs, tmp_path, arch, path):
    """The output is the target's either way; the draft's context shows in its proposals. After
    an edit of a reply (the window-8 rings have wrapped), a prompt swapped through the RAM cache,
    or a slot saved and restored, or a streamed reply whose client hung up mid-generation, the
    last request's proposals equal those of a fresh server given the same tokens (before, the
    draft lost its rows or kept another conversation's)."""
    target, draft = swa_pairs[arch]
    with Model(target, n_ctx=1024) as model:
        first = model.tokenize(STORY * 3)
        reply = model.generate(first, max_tokens=40, stop_at_eog=False).tokens
        other = model.tokenize(OTHER * 3)
        final = first + reply[:24] + (model.tokenize(" and then", add_special=False) if path != "edit" else [])
    saved = tmp_path / "slots"
    saved.mkdir()
    args = ["--slot-save-path", str(saved), "--cache-ram", "0"] if path == "slot-restore" else []
    # the cancelled reply runs on past the 24 tokens the last request keeps (600 asked, hung up
    # after 4 events), so that request reuses a prefix of it
    steps = [("cancel", completion(first, 600, ignore_eos=True)) if path == "cancelled-stream"
             else completion(first, 40, ignore_eos=True)]
    if path == "ram-cache":
        steps += [completion(other, 8, ignore_eos=True)]
    if path == "slot-restore":
        steps += [("save", "a.bin"), completion(other, 8, ignore_eos=True), ("restore", "a.bin")]
    steps += [completion(final, 16, ignore_eos=True)]
    log = tmp_path / "path.log"
    with Server(target, ctx_size=1024, n_threads=2, log_file=log, extra_args=[*args, *dflash_args(draft, True)]) as url:
        reply_on_path = run(url, steps)[-1]
    if path == "cancelled-stream":
        assert "cancel task" in log.read_text()
    fresh_log = tmp_path / "fresh.log"
    with Server(target, ctx_size=1024, n_threads=2, log_file=fresh_log, extra_args=dflash_args(draft, True)) as url:
        fresh = post_json(url + "/completion", completion(final, 16, ignore_eos=True))
    assert reply_on_path["content"] == fresh["content"]
    assert reply_on_path["tokens_cached"] > len(first)  # the path reused the cached cells
    on_path, from_scratch = proposals(log.read_text()), proposals(fresh_log.read_text())
    assert len(from_scratch) == 1
    assert on_path[max(on_path)] == next(iter(from_scratch.values()))


@pytest.mark.parametrize("draft_kind", ["random", "always-right"])
def test_a_banned_string_rewinds_the_reply(swa_pairs, oracle_pair, tmp_path, draft_kind):
    """A banned string the target reaches makes the server rewind the reply and resample there
    (llama only: the base ignores banned strings for hybrid targets). Before, verification sampled
    without the bans, so the banned text came back; a rewind inside a verified step (the
    always-right draft: the oracle target repeats byte 0x00) banned the wrong positions and kept
    the tokens after the ban; and the rewind kept the draft's rows past the cut."""
    if draft_kind == "random":
        target, draft = swa_pairs["llama"]
        prompt, (_, banned) = STORY, stop_string(swa_pairs["llama"][0], tmp_path, STORY)
    else:
        (target, draft, _), prompt, banned = oracle_pair, "hello", "\x00" * 3
    steps = [completion(prompt, 24, ignore_eos=True, banned_strings=[banned])]
    plain, spec, log = side_by_side(target, draft, tmp_path, steps)
    assert_same_text(plain, spec)
    assert banned.lower() not in spec[0]["content"].lower()
    assert not any(phrase in log for phrase in DRAFT_RESETS)
    if draft_kind == "always-right":
        assert spec[0]["timings"]["draft_n_accepted"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_a_full_kv_cache_splits_the_verification_batch(swa_pairs, tmp_path, arch):
    """Two slots verify in one batch of 10 rows (4 drafts + 1 each). When the decode finds no room
    in the KV cache (injected: IKDFLASH_FAULTS), the server retries in halves of the batch size,
    16 -> 8, and a half would cut the second slot's rows. Before, the accept step ran after every
    view for every slot with drafts, sampling rows of a view not yet decoded; now a view never
    cuts a slot's rows, and a slot is accepted after the view that holds them. Each fault is
    injected twice in a row: a view that finds no room first defragments the cache and retries."""
    target, draft = swa_pairs[arch]
    steps = [[completion(STORY, 24, ignore_eos=True), completion(OTHER, 24, ignore_eos=True)]]
    faults = ",".join(f"decode_kv_full@{k},decode_kv_full@{k + 1}" for k in (6, 11, 16, 21, 26))
    plain, spec, log = side_by_side(target, draft, tmp_path, steps, ctx=2048, faults=faults,
                                    args=["--parallel", "2", "--batch-size", "16", "--ubatch-size", "16"])
    assert_same_text(plain, spec)
    assert log.count("retrying with smaller batch size") == 5
    assert log.count("defragmenting it") == 5
    assert not any(phrase in log for phrase in DRAFT_RESETS)


@pytest.mark.parametrize("dflash", [False, True], ids=["plain", "dflash"])
def test_a_second_slot_starts_its_recurrent_state_afresh(swa_pairs, tmp_path, dflash):
    """On a hybrid target with two slots, a request on slot 1 after one on slot 0 answered as it
    does alone only without graph reuse: its prompt's second batch of 16 reused the first one's
    graph, which had reset the recurrent state at position 0 (patch `llama-reuse-the-last-graph-for-a-multi-token-batch-o` reused
    multi-token graphs; the reset is now part of what a reused graph must match). Found by a run under a CPU
    hog, where two concurrent requests happened to be served one after the other."""
    target, draft = swa_pairs["qwen35moe"]
    args = ["--parallel", "2", "--batch-size", "16", "--ubatch-size", "16", *(dflash_args(draft) if dflash else [])]
    second = completion(OTHER, 24, ignore_eos=True, cache_prompt=False, id_slot=1)
    with Server(target, ctx_size=2048, n_threads=2, log_file=tmp_path / "alone.log", extra_args=args) as url:
        alone = post_json(url + "/completion", second)["content"]
    with Server(target, ctx_size=2048, n_threads=2, log_file=tmp_path / "after.log", extra_args=args) as url:
        post_json(url + "/completion", completion(STORY, 24, ignore_eos=True, cache_prompt=False, id_slot=0))
        assert post_json(url + "/completion", second)["content"] == alone


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_a_failed_capture_ends_its_request_and_the_server_goes_on(swa_pairs, tmp_path, arch):
    """A pass whose layer outputs cannot be captured (injected on the 20th captured output: the
    10th pass) stopped the graph early, and the server went on from its garbage logits. Now the
    request fails with the reason, its cells are dropped, and the next request is exact."""
    target, draft = swa_pairs[arch]
    request = completion(STORY, 24, ignore_eos=True)
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "plain.log") as url:
        expected = post_json(url + "/completion", request)["content"]
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "dflash.log",
                extra_args=dflash_args(draft), env={"IKDFLASH_FAULTS": "capture@20"}) as url:
        with pytest.raises(ServerError, match="could not be captured"):
            post_json(url + "/completion", request)
        assert post_json(url + "/completion", request)["content"] == expected


def test_the_reuse_line_is_logged_once_per_request(swa_pairs, tmp_path):
    """A prompt of ~130 tokens in batches of 32: the line saying which context rows the draft
    keeps was logged for every batch; it is logged once per request."""
    target, draft = swa_pairs["llama"]
    steps = [completion(STORY * 2, 4), completion(STORY * 2 + OTHER, 4)]
    _, _, log = side_by_side(target, draft, tmp_path, steps, args=["--batch-size", "32", "--ubatch-size", "32"])
    assert log.count("dflash: the draft keeps its context rows") == 2


@pytest.mark.parametrize("flash_attention", ["on", "off"])
def test_a_second_slot_sees_its_own_keys(tiny_model, tmp_path, flash_attention):
    """Slot 1's prompt sits in cells after slot 0's, inside blocks whose first key is slot 0's:
    the CPU flash attention judged a block of query rows by its last row and each key block by its
    first key, so it skipped slot 1's keys (GGML_ASSERT(S > 0) killed the server). Head size 64
    takes the kernel's blocked path, as SmolLM2's does."""
    target = tiny_model("llama", n_embd=128, n_head=2, n_head_kv=1, head_dim=64)
    steps = [completion(STORY, 8, n_probs=1), completion(OTHER, 8, n_probs=1)]
    args = ["-fa", flash_attention]
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "one.log", extra_args=args) as url:
        alone = [post_json(url + "/completion", {**step, "cache_prompt": False}) for step in steps]
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "two.log",
                extra_args=[*args, "--parallel", "2"]) as url:
        replies = run(url, steps)
    assert [r["id_slot"] for r in replies] == [0, 1]
    assert [r["content"] for r in replies] == [r["content"] for r in alone]
    assert_same_top_probabilities(alone, replies)

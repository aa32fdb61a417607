"""llama-server survives hostile requests (issue 27): seeded slices of the request fuzzer
(tests/fuzz_requests.py; the long run is its own command, see its docstring and CONTRIBUTING.md), with
and without a DFlash draft, and one test per finding with its minimal request.

Every test wants the fixed behaviour: a 4xx whose message names the field (501 for a feature the
model lacks), the server still up, /health answering and the normal request's reply unchanged.
Each finding is fixed by one patch of the series (FIXED_BY, after a patch of shared request
checks); a llama-server built without a finding's patch has that finding, and there its tests are
strict xfails that name it, so the run stays green and a test turns red (XPASS) if a finding goes
away some other way. Which server is tested: the package's (a finding is fixed when its series has
the finding's patch), or IKDFLASH_FUZZ_SERVER=path/to/llama-server; IKDFLASH_FUZZ_EXPECT_FIXED=1
or 0 says whether that one has all the fixes or none.
"""

from __future__ import annotations

import os
import random

import pytest
from fuzz_requests import (
    CUT_ROUTES,
    ENDINGS,
    FINISH_ROUTES,
    FINDINGS,
    Harness,
    Raw,
    Reply,
    Request,
    World,
    describe,
    distinct,
    generate,
    incomplete_text,
    judge,
    nested,
    run,
    run_endings,
)

# finding -> what it is; the ones the packaged llama-server still has are in UNFIXED
NAMES = {
    "F1": "a failed slot save/restore/erase never answers (its error goes to the other result queue)",
    "F2": "a completion for a slot that does not exist waits forever (the task is deferred for good)",
    "F3": "a field of the wrong type or range throws in the main loop and ends the server (std::terminate)",
    "F4": "a prompt token id outside the vocabulary ends the server (out_of_range in the main loop)",
    "F5": "/infill on a model without FIM tokens ends the server (token id -1 in the prompt)",
    "F6": "a corrupt file beside a slot save ends the server on restore",
    "F7": "a deeply nested JSON body overflows an HTTP thread's stack (SIGSEGV)",
    "F8": "bad input gets a 500 (JSON parse and type errors, the OpenAI parsers' refusals, bad token ids)",
    "F9": "/slots/<id> takes '1abc', '+1' and '0x1' for slot ids",
    "F10": "a request's logit_bias, stop words, samplers... stay on its slot for the next requests there",
    "F11": "a grammar, JSON-schema pattern or banned_regex nested or long enough overflows the stack (SIGSEGV)",
    "F12": "a grammar or logit_bias that leaves no token to sample aborts the server ('Failed to sample token')",
    "F13": "a request's system_prompt longer than a slot's context breaks every later request",
    "F14": "every OpenAI-style reply says finish_reason \"stop\", also when max_tokens cut it",
    "F15": "a negative temperature is taken as greedy instead of refused",
}
# finding -> the name of the patch that fixes it, less its number (NNNN-) and .patch
FIXED_BY = {
    "F1": "server-a-failed-slot-save-restore-or-erase-always-an",
    "F2": "server-a-completion-for-a-slot-that-does-not-exist-i",
    "F3": "server-a-field-of-the-wrong-type-or-range-gets-a-400",
    "F4": "server-a-prompt-token-id-outside-the-vocabulary-is-r",
    "F5": "server-infill-on-a-model-without-FIM-tokens-answers-",
    "F6": "server-a-corrupt-file-beside-a-slot-save-fails-only-",
    "F7": "server-request-bodies-nest-at-most-256-levels",
    "F8": "server-bad-input-gets-a-400-not-a-500",
    "F9": "server-slots-id-takes-only-a-plain-slot-number",
    "F10": "server-each-request-starts-its-slot-from-the-server-",
    "F11": "server-deep-grammars-schema-patterns-and-long-regexe",
    "F12": "server-a-request-that-leaves-no-token-to-sample-fail",
    "F13": "server-a-system_prompt-may-take-at-most-half-a-slot-",
    "F14": "server-finish_reason-length-when-a-limit-cuts-the-re",
    "F15": "server-a-negative-temperature-gets-a-400-naming-the-",
}


def unfixed_in_server() -> set[str]:
    """The findings the tested llama-server still has."""
    said = os.environ.get("IKDFLASH_FUZZ_EXPECT_FIXED")
    if said is not None:
        return set() if said == "1" else set(NAMES)
    if os.environ.get("IKDFLASH_FUZZ_SERVER"):
        return set(NAMES)
    from ikdflash.serving.fork import patches
    slugs = {name.split("-", 1)[-1].removesuffix(".patch") for name in patches()}
    return {n for n in NAMES if FIXED_BY[n] not in slugs}


UNFIXED = unfixed_in_server()
TIMEOUT = 15.0  # seconds: a normal request takes well under one on the tiny model


def unfixed(*names: str):
    """The xfail mark for a test of these findings, while any of them is unfixed."""
    open_ = [n for n in names if n in UNFIXED]
    if not open_:
        return []
    return [pytest.mark.xfail(strict=True, reason="; ".join(f"{n}: {NAMES[n]}" for n in open_))]


@pytest.fixture(scope="module")
def servers(swa_pairs, tmp_path_factory):
    """servers(config) -> a started Harness ("plain" or "dflash"), one per module."""
    target, draft = swa_pairs["llama"]
    made: dict[str, Harness] = {}

    def get(config: str) -> Harness:
        if config not in made:
            made[config] = Harness(target, draft if config == "dflash" else None,
                                   tmp_path_factory.mktemp(f"fuzz-requests-{config}"), timeout=TIMEOUT)
            made[config].start()
        return made[config]

    yield get
    for harness in made.values():
        harness.stop()


def send(harness: Harness, method: str, path: str, body, timeout: float | None = None) -> tuple[str, str]:
    """(outcome, detail) of one request; the server is started again when it did not survive."""
    outcome, detail, _ = judge(harness, Request("test", method, path, body, []), timeout)
    if outcome in ("crash", "hang", "unhealthy", "diverged", "dropped"):
        harness.restart()
    harness.restore_slot_files()
    return outcome, detail


# --- seeded slices ---------------------------------------------------------------------------------

# the findings each slice meets on a server without the fixes
SLICES = [
    pytest.param("plain", 27, marks=unfixed("F1", "F3", "F5", "F8", "F10", "F12")),
    pytest.param("dflash", 1027, marks=unfixed("F1", "F3", "F8", "F9")),
]


@pytest.mark.parametrize("config, seed", SLICES)
def test_a_slice_of_hostile_requests(servers, config, seed):
    """40 seeded cases over every route: none may crash or hang the server, get a 5xx, or change
    what it answers to the normal request afterwards. The run stops at the first finding (a build
    with findings fails this in seconds, not after 40 restarts and timeouts)."""
    results = run(servers(config), 40, seed, stop_at_finding=True)
    found = distinct(results)
    assert not found, "\n".join(f"{sig}: {cases[0].request[:200]} -> {cases[0].detail[:200]}"
                                for sig, cases in found.items())
    assert len(results) == 40 and sum(case.outcome == "ok" for case in results) >= 5  # some are valid


# --- one test per finding --------------------------------------------------------------------------
# Each tries its variants in turn and stops at the first that fails: on a build with the finding,
# a test costs one restart of the server (or one timeout), not one per variant.

def refused(harness: Harness, path: str, body, says: str, status: int = 400, timeout: float | None = None) -> None:
    outcome, detail = send(harness, "POST", path, body, timeout)
    assert outcome == "refused" and detail.startswith(f"HTTP {status}") and says in detail, \
        (path, describe(body, 200), outcome, detail)


def test_f1_a_failed_slot_action_answers(servers, request):
    for mark in unfixed("F1"):
        request.applymarker(mark)
    harness = servers("plain")
    refused(harness, "/slots/2?action=erase", {}, "Invalid slot ID", timeout=5)  # slot 2 of 0..1
    for filename in ("no-such-file", "garbage", "fuzz-count"):  # fuzz-count: a token count of 2^31 - 1
        refused(harness, "/slots/0?action=restore", {"filename": filename}, "Unable to restore slot", timeout=5)


def test_f2_a_completion_for_a_missing_slot_is_refused(servers, request):
    for mark in unfixed("F2"):
        request.applymarker(mark)
    for id_slot in (2, -2, 2**31 - 1):
        refused(servers("plain"), "/completion", {"prompt": "hi", "n_predict": 1, "id_slot": id_slot}, "'id_slot'",
                timeout=5)


MAIN_LOOP_FIELDS = [
    ("stop", [1, 2]), ("chat_format", []), ("reasoning_format", ""), ("chat_parser", "none"),
    ("grammar_triggers", [{"type": "word", "value": "a"}]), ("preserved_tokens", [None]), ("samplers", [1, 2]),
    ("repeat_last_n", -5), ("dry_penalty_last_n", -5), ("json_schema", {"type": 5}),
]


def test_f3_a_field_that_threw_in_the_main_loop_is_refused_by_name(servers, request):
    for mark in unfixed("F3"):
        request.applymarker(mark)
    harness = servers("plain")
    for field, value in MAIN_LOOP_FIELDS:
        refused(harness, "/completion", {"prompt": "hi", "n_predict": 1, field: value}, field)
    for body, says in (({}, "'path'"), ({"path": 5}, "'path'"),
                       ({"path": "/nonexistent.gguf", "layer_start": {}}, "'layer_start'")):
        refused(harness, "/control-vectors/load", body, says)


@pytest.mark.parametrize("config", ["plain", "dflash"])
def test_f4_a_prompt_token_outside_the_vocabulary_is_refused(servers, config, request):
    for mark in unfixed("F4"):
        request.applymarker(mark)
    harness = servers(config)
    n = harness.n_vocab
    for prompt in ([1, 2, n + 99], [-5, 2], ["text", n], [[1, 2], [3, 2**31 - 1]]):
        refused(harness, "/completion", {"prompt": prompt, "n_predict": 2}, "outside the vocabulary")


def test_f5_infill_without_fim_tokens_is_not_supported(servers, request):
    for mark in unfixed("F5"):
        request.applymarker(mark)
    refused(servers("plain"), "/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 2}, "FIM",
            status=501)


@pytest.mark.parametrize("config", ["plain", "dflash"])
def test_f6_a_corrupt_slot_file_is_refused_on_restore(servers, config, request):
    """fuzz-ckpt: what a save under the name "fuzz-ckpt.checkpoints" writes (a state file, with the
    magic and version of a checkpoint file), read back by a restore of "fuzz-ckpt"."""
    for mark in unfixed("F6"):
        request.applymarker(mark)
    for filename in ("fuzz-badjson", "fuzz-badtokens", "fuzz-ckpt"):
        refused(servers(config), "/slots/1?action=restore", {"filename": filename}, "Unable to restore slot")


def test_f7_a_deeply_nested_body_is_refused(servers, request):
    for mark in unfixed("F7"):
        request.applymarker(mark)
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "content": "hi", "filename": "x",
            "extra": nested(100_000)}
    for path in ("/v1/chat/completions", "/completion", "/tokenize", "/slots/0?action=save"):
        refused(servers("plain"), path, body, "nests deeper")


def test_f11_deep_grammars_patterns_and_regexes_are_refused(servers, request):
    """The GBNF parser, the JSON-schema converter and std::regex recurse per nested group (std::regex
    per character too)."""
    for mark in unfixed("F11"):
        request.applymarker(mark)
    harness = servers("plain")
    deep = "(" * 100_000 + "a" + ")" * 100_000
    for body, says in (
        ({"grammar": 'root ::= ' + deep.replace("a", '"a"')}, "'grammar'"),
        ({"json_schema": {"type": "string", "pattern": f"^{deep}$"}}, "'pattern'"),
        ({"banned_regex": ["a" * 100_000]}, "'banned_regex'"),
        ({"banned_regex_case_insensitive": [deep]}, "'banned_regex_case_insensitive'"),
    ):
        refused(harness, "/completion", {"prompt": "hi", "n_predict": 1, **body}, says)
    refused(harness, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string",
                                                                                 "pattern": f"^{deep}$"}}}},
            "'pattern'")


def test_f12_nothing_to_sample_fails_the_request_only(servers, request):
    """A JSON schema no integer satisfies, a grammar no token can start (llama.cpp grammars never
    match NUL), a logit_bias of false on every token: at temperature 0.8 the sampler had nothing
    to draw from and aborted (after writing probabilities.txt where the server runs); greedy
    sampling took a token the grammar then refused (an exception out of the main loop)."""
    for mark in unfixed("F12"):
        request.applymarker(mark)
    harness = servers("plain")
    ban_all = {str(i): False for i in range(harness.n_vocab)}
    for body in ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}},
                 {"grammar": "root ::= [\\x00]", "temperature": 0},
                 {"logit_bias": ban_all}, {"logit_bias": ban_all, "temperature": 0}):
        refused(harness, "/completion", {"prompt": "hi", "n_predict": 4, **body}, "no token can be sampled")


def test_f13_a_system_prompt_must_leave_room_in_a_slot(servers, request):
    """A request may set the server-wide system prompt (a documented field: every later reply on
    every slot changes, and running requests are cut; the fuzzer sets it back after such a case).
    One longer than a slot's context left the server unable to answer."""
    for mark in unfixed("F13"):
        request.applymarker(mark)
    refused(servers("plain"), "/completion", {"prompt": "hi", "n_predict": 1, "system_prompt": "a b " * 3000},
            "'system_prompt'")


BAD_INPUT = [
    ("/completion", Raw(b'{"prompt": "hi",', "truncated JSON"), "parse error"),
    ("/completion", Raw(b'{"prompt": "hi", "temperature": NaN}', "NaN"), "parse error"),
    ("/tokenize", Raw(b"\xff\xfe", "invalid UTF-8"), "parse error"),
    ("/slots/0?action=save", {"filename": 5}, "'filename'"),
    ("/slots/0?action=save", {}, "'filename'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "Only one completion choice"),
    ("/v1/chat/completions", {"messages": "hi"}, ""),
    ("/v1/messages", {"max_tokens": 2}, "messages"),
    ("/detokenize", {"tokens": [99999]}, "'tokens'"),
    ("/detokenize", {"tokens": [-1]}, "'tokens'"),
    ("/detokenize", {"tokens": {}}, "'tokens'"),
    ("/lora-adapters", [{"id": 0}], "adapter id"),
    ("/control-vectors/apply", [{"id": 0}], "Invalid control vector id"),
    ("/rename_prompt", {"old_filename": None, "new_filename": "x"}, "strings"),
]


def test_f8_bad_input_is_a_400_not_a_500(servers, request):
    for mark in unfixed("F8"):
        request.applymarker(mark)
    for path, body, says in BAD_INPUT:
        refused(servers("plain"), path, body, says)


def test_f9_a_slot_id_is_a_plain_number(servers, request):
    for mark in unfixed("F9"):
        request.applymarker(mark)
    for slot in ("1abc", "+1", "0x1", "%201", "-0", "1.5", "99999999999"):
        refused(servers("plain"), f"/slots/{slot}?action=erase", {}, "Invalid slot ID")


def test_f10_a_request_leaves_nothing_on_its_slot(servers, request):
    """A request with a strong logit_bias, then one with a stop word from the normal reply, on
    slot 0: the normal request on slot 0 after each (judge's check) must get its own reply."""
    for mark in unfixed("F10"):
        request.applymarker(mark)
    harness = servers("plain")
    reply = harness.baseline[0]
    for field, value in (("logit_bias", [[52, 1e30]]), ("stop", [reply[len(reply) // 2:][:2]])):
        outcome, detail = send(harness, "POST", "/completion", {"prompt": "hi", "n_predict": 2, "id_slot": 0,
                                                                 field: value})
        assert outcome == "ok", (field, outcome, detail)


@pytest.mark.parametrize("config", [pytest.param("plain", marks=unfixed("F14")),
                                    pytest.param("dflash", marks=unfixed("F14"))])
def test_finish_reason_tells_why_the_reply_ended(servers, config):
    """One valid greedy request for each route (/v1/completions, /v1/chat/completions) x streamed
    or not x ending (its length limit, a stop string cut from its own text, EOS): each reply gives
    its ending's finish_reason. `fuzz_requests.py --endings` runs more."""
    results = run_endings(servers(config), range(12), seed=66)
    assert [(c.route, c.mutation, c.detail) for c in results if c.outcome != "ok"] == []
    assert {(c.route, c.mutation) for c in results} == {(route, ending + streamed) for route in FINISH_ROUTES
                                                         for ending in ENDINGS for streamed in ("", ", streamed")}


def test_f15_a_negative_temperature_is_refused(servers, request):
    for mark in unfixed("F15"):
        request.applymarker(mark)
    harness = servers("plain")
    for path, body in [("/completion", {"prompt": "hi", "n_predict": 2}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]:
        refused(harness, path, {**body, "temperature": -0.5}, "'temperature' must be >= 0 (0: greedy), got -0.5")


def test_valid_requests_still_work(servers):
    """The checks refuse only what is wrong: these pass on every build."""
    harness = servers("plain")
    for method, path, body in [
        ("POST", "/completion", {"prompt": [1, 2, 3], "n_predict": 2, "temperature": 0.0, "n_probs": 2**31 - 1,
                                 "stop": ["x"], "logit_bias": [[5, -1.5], ["a", False]], "seed": -1, "top_k": 0}),
        ("POST", "/completion", {"prompt": "hi", "n_predict": 2.0, "id_slot": 1, "cache_prompt": False,
                                 "samplers": "kt", "logit_bias": {"5": 1, "hi": -1}}),
        ("POST", "/completion", {"prompt": "hi", "n_predict": 2, "stop": "x", "system_prompt": "", "n_keep": -1}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                          "stop": "\n", "logprobs": True, "top_logprobs": 2}),
        ("POST", "/tokenize", {"content": ["hi", 5]}),
        ("POST", "/detokenize", {"tokens": [5, 6]}),
        ("POST", "/slots/1?action=save", {"filename": "fine"}),
        ("POST", "/slots/1?action=restore", {"filename": "fuzz-valid"}),
        ("POST", "/slots/1?action=erase", {}),
    ]:
        outcome, detail = send(harness, method, path, body)
        assert outcome == "ok", (path, body, outcome, detail)


def test_findings_are_told_apart():
    """The fuzzer's own bookkeeping: a finding is an outcome in FINDINGS, named by its signature."""
    from fuzz_requests import RequestCase, signature
    a = RequestCase(0, "stop=[1]", "plain", "crash", "SIGABRT: what():  [json.exception.type_error.302] type must be "
                    "string, but is number", route="completion")
    b = RequestCase(1, "samplers=[1]", "plain", "crash", "SIGABRT: what():  [json.exception.type_error.302] type must "
                    "be string, but is null", route="completion")
    for case in (a, b):
        case.signature = signature(case)
    assert a.signature == b.signature and "crash" in FINDINGS and "refused" not in FINDINGS
    assert list(distinct([a, b])) == [a.signature]


def test_a_cut_reply_must_come_whole():
    """The check behind the fuzzer's "cut reply" cases: a 200 with UTF-8 text, no U+FFFD, and a
    stream that ends; a model without infill tokens (501) has nothing to check."""
    whole = [Reply(200, '{"content": "שלום"}'.encode(), "", 0.1),
             Reply(200, b'data: {"choices": [{"delta": {"content": "\xd7\xa9"}}]}\n\ndata: [DONE]\n\n', "", 0.1),
             Reply(200, b'data: {"content": "a", "stop": false}\n\ndata: {"content": "", "stop": true}\n\n', "", 0.1),
             Reply(501, b'{"error": {"message": "this model has no infill (FIM) tokens"}}', "", 0.1)]
    cut = [Reply(400, b'{"error": {"message": "incomplete UTF-8 string"}}', "", 0.1),
           Reply(200, b'{"content": "\xd7"}', "", 0.1),
           Reply(200, '{"content": "a\\ufffd"}'.encode(), "", 0.1),
           Reply(200, b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', "", 0.1)]
    assert [incomplete_text(r) for r in whole] == [""] * 4
    assert all(incomplete_text(r) for r in cut), [incomplete_text(r) for r in cut]


def test_every_text_route_gets_cut_replies():
    world = World(100, 2, slot_dir="/nonexistent")
    drawn = [generate(random.Random(i), world, sorted(CUT_ROUTES), cut_share=1.0) for i in range(200)]
    assert {r.route for r in drawn} == set(CUT_ROUTES) and all(r.whole_text for r in drawn)
    assert {r.value.get("stream") for r in drawn} == {True, False}

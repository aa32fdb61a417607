"""Every reply completes: llama-server with the built-in pair, asked for short answers in scripts
of multi-byte characters, answers every text endpoint with HTTP 200 and valid UTF-8 (no
replacement character for bytes the model has not finished), ends every stream, and stops on
SIGTERM with streams open."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from ikdflash import Server
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.serving.spectype import SpecType

# three scripts of 2-, 3- and 4-byte characters: each reply's first tokens are pieces of characters
QUESTIONS = ["Write one Hebrew word.", "日本語で一言書いてください。", "Reply with three emoji.",
             "Напиши одно слово по-русски."]
MAX_TOKENS = range(1, 9)
REPLY_SECONDS = 120  # far above what a reply of 8 tokens takes: only a stream that never ends reaches it


@pytest.fixture(scope="module")
def pair():
    return resolve_pair(DEFAULT_PAIR)


def dflash_args(draft) -> list[str]:
    return ["--model-draft", str(draft), "--spec-type", SpecType(n_max=4).flag()]


@pytest.fixture(scope="module", params=["plain", "dflash"])
def server(pair, request, tmp_path_factory):
    target, draft = pair
    extra = dflash_args(draft) if request.param == "dflash" else []
    log = tmp_path_factory.mktemp("replies") / "server.log"
    with Server(target, ctx_size=2048, n_threads=2, log_file=log, extra_args=extra) as url:
        yield url


def request_body(endpoint: str, question: str, max_tokens: int) -> dict:
    if endpoint in ("/completion", "/v1/completions"):
        return {"prompt": question, "max_tokens": max_tokens, "n_predict": max_tokens, "temperature": 0}
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}


def text_of(endpoint: str, reply: dict) -> str:
    """A non-streamed reply's text."""
    if endpoint == "/completion":
        return reply["content"]
    if endpoint == "/v1/completions":
        return reply["choices"][0]["text"]
    if endpoint == "/v1/messages":
        return "".join(block.get("text", "") for block in reply["content"])
    return reply["choices"][0]["message"]["content"] or ""


def delta_of(endpoint: str, event: dict) -> str:
    """A streamed event's piece of text."""
    if endpoint == "/completion":
        return event.get("content", "")
    if endpoint == "/v1/completions":
        return "".join(c.get("text") or "" for c in event.get("choices", []))
    if endpoint == "/v1/messages":
        return (event.get("delta") or {}).get("text", "") if event.get("type") == "content_block_delta" else ""
    return "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices", []))


def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REPLY_SECONDS) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stream_events(url: str, body: dict) -> tuple[int, list[dict], bool]:
    """(status, events, ended): ended when the stream's last event says so ([DONE], stop: true,
    message_stop) and the connection then closes."""
    status, raw = post(url, {**body, "stream": True})
    events, ended = [], False
    for line in raw.decode("utf-8").splitlines():
        if line == "data: [DONE]":
            ended = True
        elif line.startswith("data: "):
            event = json.loads(line[len("data: "):])
            events.append(event)
            ended = ended or event.get("stop") is True or event.get("type") == "message_stop"
    return status, events, ended


ENDPOINTS = ["/completion", "/v1/completions", "/v1/chat/completions", "/v1/messages"]


def test_replies_cut_inside_a_character_complete(server):
    """Every text endpoint, four questions in three scripts, max_tokens 1-8, streamed and not:
    200 requests and more, each answered with HTTP 200, valid UTF-8 and no replacement character,
    each stream ended; a streamed reply's text is the non-streamed one's."""
    failures, cut = [], 0
    for endpoint in ENDPOINTS:
        for question in QUESTIONS:
            for max_tokens in MAX_TOKENS:
                body = request_body(endpoint, question, max_tokens)
                where = f"{endpoint} {question!r} max_tokens={max_tokens}"
                status, raw = post(server + endpoint, body)
                if status != 200:
                    failures.append(f"{where}: HTTP {status} {raw[:200]!r}")
                    continue
                text = text_of(endpoint, json.loads(raw.decode("utf-8")))  # strict: invalid UTF-8 raises
                status, events, ended = stream_events(server + endpoint, body)
                streamed = "".join(delta_of(endpoint, e) for e in events)
                if status != 200 or not ended:
                    failures.append(f"{where} (stream): HTTP {status}, ended {ended}")
                elif "\ufffd" in text + streamed:
                    failures.append(f"{where}: a replacement character in {text!r} / {streamed!r}")
                elif streamed != text:
                    failures.append(f"{where}: streamed {streamed!r}, not {text!r}")
                cut += max_tokens == 1 and len(text.encode()) < 3  # a first token short of a character
    assert not failures, failures
    assert cut > 0  # the questions do make the model stop inside a character


def test_an_unknown_response_format_type_is_refused(server):
    body = {**request_body("/v1/chat/completions", "hello", 4), "response_format": {"type": "sound"}}
    status, raw = post(server + "/v1/chat/completions", body)
    assert status == 400
    message = json.loads(raw)["error"]["message"]
    assert "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got \"sound\"" in message
    for kind in ("text", "json_object"):
        body["response_format"] = {"type": kind}
        assert post(server + "/v1/chat/completions", body)[0] == 200


def test_sigterm_stops_the_server_with_streams_open(pair, tmp_path):
    """Four streams that would run for thousands of tokens; SIGTERM once each has its first event:
    the server exits (the old one never did; docs/server.md says how soon, measured) and every
    stream's connection ends."""
    target, _ = pair
    body = {"prompt": "Tell me a very long story.", "n_predict": 100000, "ignore_eos": True, "stream": True}
    server = Server(target, ctx_size=4096, n_threads=2, log_file=tmp_path / "server.log", extra_args=["--parallel", "4"])
    url = server.start()
    started, ended = threading.Semaphore(0), []

    def read_stream() -> None:
        request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                response.readline()
                started.release()
                while response.readline():
                    pass
        except OSError:
            pass  # a connection closed mid-chunk is an ending too
        ended.append(True)

    threads = [threading.Thread(target=read_stream, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert started.acquire(timeout=300)
        process = server.process
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        took = time.monotonic() - signalled
        for t in threads:
            t.join(timeout=60)
    finally:
        server.stop()
    print(f"llama-server exited {took:.2f} s after SIGTERM with 4 streams open")
    assert len(ended) == 4


def test_a_cut_reply_still_counts_every_token(server):
    """Tokens whose text is held back inside a character are still generated: each has its n_probs
    entry and tokens_predicted counts it, while the text ends at the last whole character."""
    cut = 0
    for question in QUESTIONS:
        prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"  # the target's template
        for n_predict in (1, 2, 3):
            body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "n_probs": 2}
            status, raw = post(server + "/completion", body)
            assert status == 200, raw[:200]
            reply = json.loads(raw.decode("utf-8"))
            probs = reply["completion_probabilities"]
            assert reply["tokens_predicted"] == n_predict == len(probs), (question, n_predict, reply)
            assert all(len(entry["probs"]) == 2 for entry in probs)
            cut += any(entry["content"].startswith("byte: ") for entry in probs)  # a piece of a character
    assert cut > 0


LONG_PROMPT = ("The river runs past the old mill and under the stone bridge, where the children of the town "
               "watch the boats go by. In spring the water rises over the banks, and the farmers move their "
               "sheep to the hills. In summer the river is slow and green, and the old men fish from the "
               "bridge. The cat sat on the mat. The cat sat on the")


def test_penalized_replies_are_the_engines(server, pair):
    """With repetition penalties, llama-server's greedy reply is Engine.generate's: both penalize
    the last repeat_last_n tokens, the prompt's among them (the server pushes the prompt into its
    sampler after the reset, and since patch `sampling-the-penalty-window-keeps-its-n_prev-tokens-`
    keeps them), and spare the newline. A window past the server's default n_prev (64) reads that
    many tokens too (patch `server-a-request-s-repeat_last_n-gets-that-many-toke`): on the long
    prompt (74 tokens) windows of 64 and 128 give different replies."""
    from ikdflash import Engine

    with Engine(pair[0], n_ctx=2048, n_threads=2) as engine:
        cases = [("The cat sat on the mat. The cat sat on the", 1.3, 8), ("The cat sat on the mat. The cat sat on the", 1.1, 64),
                 (LONG_PROMPT, 1.5, 128)]
        for text, penalty, window in cases:
            prompt = engine.target.tokenize(text)
            want = engine.generate(prompt, max_tokens=32, repeat_penalty=penalty, repeat_last_n=window).text
            if window > 64:
                assert engine.generate(prompt, max_tokens=32, repeat_penalty=penalty, repeat_last_n=64).text != want
            body = {"prompt": prompt, "n_predict": 32, "temperature": 0, "cache_prompt": False,
                    "repeat_penalty": penalty, "repeat_last_n": window}
            status, raw = post(server + "/completion", body)
            assert status == 200, raw[:200]
            assert json.loads(raw.decode("utf-8"))["content"] == want, (penalty, window)


def test_repetition_penalties_reach_back_a_whole_window(server):
    """A new request resets its sampler, which emptied the tokens the repetition penalties read
    and then kept only the last one, so a reply that repeated its prompt read the same with any
    repeat_penalty. The penalties now read the reply's last repeat_last_n tokens: penalized
    without measure, no token but the newline (spared unless penalize_nl) comes back within them."""
    prompt, window = "The cat sat on the mat. The cat sat on the", 8

    def pieces(penalty: float) -> list[str]:
        body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "n_probs": 1, "cache_prompt": False,
                "repeat_penalty": penalty, "repeat_last_n": window}
        status, raw = post(server + "/completion", body)
        assert status == 200, raw[:200]
        return [entry["content"] for entry in json.loads(raw.decode("utf-8"))["completion_probabilities"]]

    def recurs(tokens: list[str]) -> bool:
        return any(tokens[i] != "\n" and tokens[i] in tokens[max(0, i - window):i] for i in range(len(tokens)))

    assert recurs(pieces(1.0))  # the sentence comes back unpenalized
    assert not recurs(pieces(1e6))

"""Seeded fuzzer for llama-server's HTTP API: hostile requests must get an HTTP status (a 4xx for
bad input), never kill the server, hang it, or change what it answers to a normal request.

Each case is one request to one route of the fork's llama-server (examples/server/server.cpp
registers them): a small valid body for that route with one to three mutations (a field of the
wrong type, an out-of-range or non-finite number, a huge or negative count, invalid UTF-8 or a
lone surrogate, deep nesting, an unknown key, an oversized string or array, token ids outside the
vocabulary, `stop` as numbers, `logit_bias` of odd shapes, a slot file name that leaves
--slot-save-path, a whole body that is not JSON...). Case i of seed s is drawn from its own
random stream, so `--seed s --only i` replays it alone.

After every case the server must still run, answer GET /health with 200, and give each slot
exactly the reply it gave at the start to a fixed greedy request. The outcomes:

    ok, refused          2xx, 4xx: fine
    error                a 5xx for the request
    hang                 no complete reply within --timeout seconds
    dropped              the connection closed without a reply, the server still up
    crash                the server exited (the report quotes the assert or exception from its log)
    unhealthy, diverged  /health failed, or the normal request got another reply afterwards
    garbled              a short reply in a script of multi-byte characters (the "cut reply"
                         case: valid, cut by its length limit) was not a 200 with valid UTF-8,
                         no U+FFFD, and a stream that ends ([DONE], stop: true, message_stop)
    accepted             a value the server must refuse (a negative temperature) got a reply
    untruthful           (--endings) a reply gave another finish_reason than its ending's

The last eight are findings; after a crash, a hang, unhealthy or diverged, the server is started
again. The server runs with --parallel 2, --slot-save-path (a temp folder) and --metrics, with a
DFlash draft (--config dflash) or without (--config plain), or both in turn (--config both).

    python tests/fuzz_requests.py --cases 2000 --seed 0 [--config both] [--report out.json]
    python tests/fuzz_requests.py --seed 0 --only 17 --show        # replay one case, print it
    IKDFLASH_FUZZ_SERVER=~/src/fork-fuzz/build/bin/llama-server python tests/fuzz_requests.py ...

--server-binary (or IKDFLASH_FUZZ_SERVER) runs another llama-server build than the packaged
one, e.g. a fork tree with fixes. --minimize retries each distinct finding with one top-level key
removed at a time and reports the smallest body that still gives it. tests/test_fuzz_requests.py
runs seeded slices of this in the default test run.

--endings sends valid greedy requests instead, to /v1/completions and /v1/chat/completions,
streamed or not, each ending by its length limit, a stop string cut from the reply's own text, or
EOS (forced by a logit bias), in turn; each reply must give its ending's finish_reason ("length"
or "stop"):

    python tests/fuzz_requests.py --endings --cases 240 --seed 0       # 10 cases a cell
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fuzzing import Case

REFERENCE_PROMPT = "the quick brown fox jumps over the lazy dog, and the cat sat on the mat"
FINDINGS = ("error", "hang", "dropped", "crash", "unhealthy", "diverged", "garbled", "untruthful", "accepted")


# --- JSON with raw fragments ---------------------------------------------------------------------

class Raw:
    """A JSON fragment sent exactly as these bytes (NaN, invalid UTF-8, deep nesting...); `label`
    stands for it in reports."""

    def __init__(self, data: bytes, label: str) -> None:
        self.data, self.label = data, label

    def __repr__(self) -> str:
        return f"Raw({self.label})"


def encode(value: Any) -> bytes:
    """value as JSON bytes (UTF-8); Raw fragments go in as they are."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if value is None or isinstance(value, (bool, int)):
        return json.dumps(value).encode()
    if isinstance(value, float):
        return repr(value).encode() if math.isfinite(value) else b"null"
    if isinstance(value, dict):
        return b"{" + b",".join(encode(k) + b":" + encode(v) for k, v in value.items()) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(encode(v) for v in value) + b"]"
    raise TypeError(type(value))


def describe(value: Any, limit: int = 400) -> str:
    """value as short readable JSON-like text: long strings and arrays are abbreviated."""
    def walk(v: Any) -> str:
        if isinstance(v, Raw):
            return f"<{v.label}>"
        if isinstance(v, str):
            if len(v) > 48:
                return f"<{len(v)} chars: {json.dumps(v[:16])[1:-1]}...>"
            return json.dumps(v)
        if isinstance(v, dict):
            return "{" + ", ".join(f"{walk(k)}: {walk(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (list, tuple)):
            if len(v) > 8:
                return f"<{len(v)} items: [{', '.join(walk(x) for x in v[:4])}, ...]>"
            return "[" + ", ".join(walk(x) for x in v) + "]"
        return json.dumps(v)
    text = walk(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- the hostile values ------------------------------------------------------------------------

def nested(depth: int, kind: str = "array") -> Raw:
    if kind == "array":
        return Raw(b"[" * depth + b"]" * depth, f"[ nested {depth} deep ]")
    return Raw(b'{"a":' * depth + b"1" + b"}" * depth, f"{{ nested {depth} deep }}")


NON_FINITE = [Raw(b"NaN", "NaN"), Raw(b"Infinity", "Infinity"), Raw(b"-Infinity", "-Infinity"),
              Raw(b"1e999", "1e999"), Raw(b"-1e999", "-1e999"), Raw(b"nan", "nan"), Raw(b"1e-999", "1e-999")]
INTS = [0, -1, -2, 1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
        2**64, -2**63, -2**63 - 1, 10**30, -10**30]
FLOATS = [0.0, -0.0, 0.5, -0.5, 1.5, 1e-320, 1e-45, 3.5e38, -3.5e38, 1e308, -1e308]
WRONG_TYPES = [None, True, False, "1", "", "abc", [], [1], {}, {"a": 1}, 1.5, 7, [[]], [None]]
INVALID_UTF8 = [Raw(b'"\xff\xfe"', "invalid UTF-8 ff fe"), Raw(b'"a\xc0\xafb"', "overlong UTF-8 c0 af"),
                Raw(b'"abc\xe2\x82"', "truncated UTF-8 e2 82"), Raw(b'"\xed\xa0\x80"', "UTF-8 of a surrogate"),
                Raw(b'"\xf8\x88\x80\x80\x80"', "5-byte UTF-8"), Raw(b'"\\ud800"', "lone surrogate \\ud800"),
                Raw(b'"x\\udfff"', "lone surrogate \\udfff"), Raw(b'"\\udc00\\ud800"', "reversed surrogate pair"),
                Raw(b'"a\\u0000b"', "NUL inside")]


def big_string(rng: random.Random) -> str:
    n = rng.choice([300, 4096, 100_000, 500_000])
    return rng.choice(["a", "ab ", "\u00e9", "\U0001F600", " ", "\n", "<|im_start|>", "%s%n"]) * n


def hostile_strings(rng: random.Random) -> list[Any]:
    return ["", " ", "\x00", "\x01\x7f", "%s%s%s%n", "<s></s><|im_start|><|endoftext|>", "\u202e\u0301" * 50,
            "{\"a\": 1}", "\\", "\r\n\r\n", big_string(rng), *INVALID_UTF8]


def hostile_int(rng: random.Random) -> Any:
    return rng.choice(INTS + INTS + FLOATS + NON_FINITE[:2] + WRONG_TYPES + [rng.randint(-10**6, 10**6)])


def hostile_float(rng: random.Random) -> Any:
    return rng.choice(FLOATS + FLOATS + INTS[:10] + NON_FINITE[:2] + WRONG_TYPES)


def hostile_bool(rng: random.Random) -> Any:
    return rng.choice([0, 1, 2, -1, "true", "false", "", None, [], {}, 1.5, *NON_FINITE[:2]])


def hostile_str(rng: random.Random) -> Any:
    return rng.choice(hostile_strings(rng) + [1, -1, 1.5, True, None, [], ["a"], {}, {"a": "b"}, nested(1000)])


def hostile_array(rng: random.Random, item: Callable[[random.Random], Any]) -> Any:
    choice = rng.randrange(9)
    if choice == 0:
        return []
    if choice == 1:
        return [item(rng) for _ in range(rng.randint(1, 4))]
    if choice == 2:
        return [rng.choice(["a", 1, None, "", -1])] * rng.choice([1000, 100_000])
    if choice == 3:
        return nested(rng.choice([100, 1000, 100_000]))
    if choice == 4:
        return [[item(rng)]]
    if choice == 5:
        return rng.choice(WRONG_TYPES + ["a"])
    if choice == 6:
        return [None, True, 1.5, "x", [], {}]
    if choice == 7:
        return [rng.choice(INTS) for _ in range(3)]
    return [rng.choice(hostile_strings(rng)) for _ in range(2)]


def hostile_object(rng: random.Random) -> Any:
    return rng.choice([{}, {"": None}, {"a" * 1000: 1}, nested(rng.choice([100, 100_000]), "object"), [], "x", 1,
                       None, {"type": 5}, {"__proto__": {}}, {str(i): i for i in range(1000)}])


# --- what each route takes ---------------------------------------------------------------------

@dataclass
class World:
    """What the generator knows about the server under test."""
    n_vocab: int
    n_slots: int
    slot_files: list[str] = field(default_factory=list)   # names the fuzzer put into --slot-save-path
    slot_dir: str = "/tmp"

    def token(self, rng: random.Random) -> int:
        return rng.randrange(self.n_vocab)

    def bad_token(self, rng: random.Random) -> Any:
        return rng.choice([self.n_vocab, self.n_vocab + 1, -1, -2, 2**31 - 1, -2**31, 2**32 + 3, 2**40, 2**63 - 1,
                           1e10, 1.5, -0.5, True, None, "a", [1], {}, *NON_FINITE[:3]])


def token_list(rng: random.Random, world: World) -> Any:
    tokens = [world.token(rng) for _ in range(rng.randint(1, 12))]
    choice = rng.randrange(6)
    if choice == 0:
        tokens[rng.randrange(len(tokens))] = world.bad_token(rng)
    elif choice == 1:
        tokens = [world.bad_token(rng) for _ in range(rng.randint(1, 4))]
    elif choice == 2:
        tokens = [world.token(rng) for _ in range(rng.choice([2000, 20_000, 200_000]))]
    elif choice == 3:
        tokens = tokens + ["a string", [world.token(rng)]]
    elif choice == 4:
        tokens = [world.n_vocab - 1, world.n_vocab, world.n_vocab + 1]
    else:
        tokens = [rng.choice([-1, world.n_vocab + rng.randrange(1000)])] * rng.randint(1, 3)
    return tokens


def hostile_prompt(rng: random.Random, world: World) -> Any:
    choice = rng.randrange(10)
    if choice < 3:
        return token_list(rng, world)
    if choice == 3:
        return [token_list(rng, world) for _ in range(rng.randint(1, 3))]
    if choice == 4:
        return [rng.choice(["a", "b c", ""]) for _ in range(rng.choice([0, 2, 50, 500]))]
    if choice == 5:
        return [[], "", [[]]]
    if choice == 6:
        return ["mixed", world.token(rng), [world.token(rng), "x"], {"prompt_string": "x"}]
    if choice == 7:
        return [{"prompt_string": rng.choice(hostile_strings(rng)), "multimodal_data": rng.choice(
            [[], ["not base64!"], "x", [1], ["aGVsbG8="]])}]
    return hostile_str(rng)


def hostile_stop(rng: random.Random, world: World) -> Any:
    return rng.choice([[1, 2], [0], [None], [1.5], [True], [[]], [{}], [["a"]], ["", ""], ["a", 7], "stop", 5,
                       [rng.choice(hostile_strings(rng))], ["x"] * 10_000, [big_string(rng)], nested(1000), {}])


def hostile_logit_bias(rng: random.Random, world: World) -> Any:
    tok, bad = world.token(rng), world.bad_token(rng)
    return rng.choice([
        [[tok]], [[tok, 1, 2]], [tok, 1], [[bad, 1.0]], [[tok, rng.choice(NON_FINITE)]], [[tok, "x"]],
        [[tok, True]], [[tok, False]], [["", 1]], [[rng.choice(hostile_strings(rng)), -1]], [[[tok], 1]],
        [[tok, 1e308]], [[tok, -3.5e38]], [[2**40 + tok, 5]], [[1e10, 1]], [[-1, -100]],
        {str(bad) if not isinstance(bad, Raw) else "NaN": 1}, {"": 1}, {"abc": 1}, {str(tok): "x"},
        {str(tok): None}, {str(tok): [1]}, {"99999999999999999999": 1}, {"-1": False}, {" 1": 1}, {"1 ": 1},
        {"0x10": 1}, {str(tok): rng.choice(NON_FINITE)}, "x", 5, [[tok, 1]] * 100_000, nested(1000),
        {str(i): -1 for i in range(-5, min(world.n_vocab + 5, 3000))},
        {str(i): False for i in range(world.n_vocab)}, [[i, False] for i in range(world.n_vocab)],
    ])


def hostile_messages(rng: random.Random, world: World) -> Any:
    ok = {"role": "user", "content": "hello"}
    return rng.choice([
        [], [{}], [{"role": "user"}], [{"content": "hi"}], [{"role": 5, "content": "hi"}],
        [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "!!", "format": "mp3"}}]}],
        [{"role": "user", "content": [{"type": "weird"}]}], [{"role": "user", "content": [5]}],
        [{"role": "assistant", "content": "a", "tool_calls": [{"function": {"name": 5, "arguments": "{"}}]}],
        [{"role": "assistant", "content": None, "tool_calls": "x"}], [{"role": "tool", "content": "r"}],
        [{"role": "system", "content": "s"}] * 3, [ok] * rng.choice([1000, 20_000]),
        [{"role": "user", "content": rng.choice(hostile_strings(rng))}], "hello", [ok, 5], {"role": "user"},
        [{"role": rng.choice(hostile_strings(rng)), "content": "x"}], nested(rng.choice([1000, 100_000])),
        [{"role": "user", "content": "hi", "reasoning_content": 5}], [ok, {"role": "assistant", "content": "x",
                                                                        "reasoning_content": "y"}],
        [{"role": "assistant", "content": "prefill"}],
    ])


def hostile_grammar(rng: random.Random, world: World) -> Any:
    return rng.choice([
        "", "root", "root ::=", "root ::= \"", "root ::= [z-a]", "root ::= [^]", "root ::= x", "root ::= root",
        "root ::= root \"a\"", "root ::= \"a\"*" * 3, "root ::= " + "(" * rng.choice([100, 5000, 100_000]) + "\"a\"" + ")" * 5000,
        "root ::= " + "\"a\" " * 50_000, "root ::= \"\\x\"", "root ::= \"\\u12\"", "root ::= [\\", "root ::= \"a\"{99999999}",
        "root ::= \"a\"{5,2}", "root ::= \"a\"{0,0}", "root ::= \"\"", "root ::= [\\x00]", "root ::= (\"\")*", "root ::= (\"a\"?)*",
        "x ::= \"a\"", "root ::= \"a\" | ", "root ::= \"\xff\"", *INVALID_UTF8[:4], 5, ["root ::= \"a\""], {},
    ])


def hostile_schema(rng: random.Random, world: World) -> Any:
    return rng.choice([
        {"type": 5}, {"type": "wizard"}, {"$ref": "#/definitions/missing"}, {"$ref": "#"},
        {"$ref": "http://example.com/schema"}, {"definitions": {"a": {"$ref": "#/definitions/a"}}, "$ref": "#/definitions/a"},
        {"type": "string", "pattern": "((("}, {"type": "string", "pattern": "a{99999999}"},
        {"type": "string", "pattern": "^[\\"},
        {"type": "string", "pattern": "^" + "(" * 100_000 + "a" + ")" * 100_000 + "$"},
        {"type": "string", "pattern": "^" + "a" * 100_000 + "$"}, {"type": "string", "minLength": 2**31, "maxLength": 1},
        {"type": "string", "maxLength": 10**12}, {"type": "array", "minItems": 10**9},
        {"type": "array", "minItems": 5, "maxItems": 1}, {"type": "integer", "minimum": 1e308, "maximum": -1e308},
        {"type": "integer", "minimum": rng.choice(NON_FINITE)}, {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "string", "pattern": "^\\x00$"}, {"enum": []}, {"enum": [{"a": [1, {}]}]},
        {"const": nested(1000)}, {"anyOf": []}, {"oneOf": [{"type": 5}]}, {"allOf": [{"$ref": "#/x"}]},
        {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": 5}}}}},
        {"type": "object", "required": [5]}, {"type": "object", "properties": 5}, {"items": 5},
        {"type": "string", "format": "date-time"}, {"type": ["string", 5]}, "x", 5, [], nested(100_000, "object"),
        {"properties": {"a" * 10_000: {"type": "string"}}, "type": "object"},
    ])


def hostile_samplers(rng: random.Random, world: World) -> Any:
    return rng.choice([[1, 2], ["unknown"], ["top_k"] * 10_000, [None], "", "\xff\x00zz", "kpmt" * 10_000, 5, {},
                       [["top_k"]], [rng.choice(hostile_strings(rng))]])


def hostile_triggers(rng: random.Random, world: World) -> Any:
    return rng.choice([[{}], [{"type": 99, "value": "a"}], [{"type": -1, "value": "a"}], [{"type": 0, "value": 5}],
                       [{"type": "word", "value": "a"}], [5], "x", [{"type": 1, "value": "("}],
                       [{"type": 0, "value": ""}], [{"type": 2, "value": "[[["}]])


def hostile_strlist(rng: random.Random, world: World) -> Any:
    return hostile_array(rng, lambda r: r.choice(hostile_strings(r)))


def hostile_regexes(rng: random.Random, world: World) -> Any:
    return rng.choice([["((("], ["(a+)+$"], ["(" * 20_000 + "a" + ")" * 20_000], ["a" * 100_000], ["a{99999}"], ["[\\"], ["\\"],
                       ["(?<name>x)"], ["a**"], [5], [None], "x", ["(a|aa)*b"], ["[" + "a-" * 10_000 + "]"]])


def hostile_id_slot(rng: random.Random, world: World) -> Any:
    return rng.choice([world.n_slots, world.n_slots + 1, -2, -1, 99, 2**31 - 1, -2**31, 2**40, "0", "1", 0.5, 1e10,
                       True, None, [], *NON_FINITE[:2]])


def hostile_chat_format(rng: random.Random, world: World) -> Any:
    return rng.choice([-1, 99, 2**31 - 1, -2**31, 1000, "generic", "x", None, 1.5, [], True])


def hostile_name_str(rng: random.Random, world: World) -> Any:
    return rng.choice(["", "none", "deepseek", "auto", "wizard", 5, None, [], {}, "\xff", *INVALID_UTF8[:2],
                       big_string(rng)])


def hostile_tools(rng: random.Random, world: World) -> Any:
    return rng.choice([5, "x", [5], [{}], [{"type": "function"}], [{"type": "function", "function": {}}],
                       [{"type": "function", "function": {"name": 5, "parameters": {"type": 5}}}],
                       [{"type": "function", "function": {"name": "f", "parameters": nested(1000, "object")}}],
                       [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}],
                       [{"type": "function", "function": {"name": "f"}}] * 5000])


def hostile_tool_choice(rng: random.Random, world: World) -> Any:
    return rng.choice(["required", "none", "auto", "wizard", 5, {}, {"type": "function"},
                       {"type": "function", "function": {"name": "nope"}}, [], None])


def hostile_response_format(rng: random.Random, world: World) -> Any:
    return rng.choice([{"type": "json_object"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": 5},
                       {"type": "json_schema", "json_schema": {"schema": hostile_schema(rng, world)}},
                       {"type": "wizard"}, {"type": "json_object", "schema": hostile_schema(rng, world)}, "json", 5,
                       {}])


def hostile_filename(rng: random.Random, world: World) -> Any:
    existing = rng.choice(world.slot_files) if world.slot_files else "fuzz-valid"
    return rng.choice([
        "../escape", "../../etc/passwd", "/etc/passwd", "/tmp/ikdflash-fuzz-abs", world.slot_dir + "/abs-inside",
        "a/../../b", "..", ".", "./x", "a/b", "a\\..\\b", "~", "~/x", "%2e%2e%2fx", "..%2f", "x\x00y", "\x00",
        "CON", "nul", ".hidden", "-rf", "a" * 255, "a" * 243, "a" * 256, "a" * 5000, " x", "x ", "x.", "\u2215etc",
        "\uff0e\uff0e", "\u00e9t\u00e9", "slot\nname", "", 5, None, [], {"a": 1}, *INVALID_UTF8, existing,
        existing + ".tokens.json", existing + ".dflash", existing + ".checkpoints",
    ])


FieldGen = Callable[[random.Random, World], Any]
KINDS: dict[str, FieldGen] = {
    "int": lambda r, w: hostile_int(r),
    "float": lambda r, w: hostile_float(r),
    "bool": lambda r, w: hostile_bool(r),
    "str": lambda r, w: hostile_str(r),
    "object": lambda r, w: hostile_object(r),
    "strlist": hostile_strlist,
    "prompt": hostile_prompt,
    "tokens": lambda r, w: token_list(r, w) if r.random() < 0.7 else hostile_array(r, lambda rr: w.bad_token(rr)),
    "stop": hostile_stop,
    "logit_bias": hostile_logit_bias,
    "messages": hostile_messages,
    "grammar": hostile_grammar,
    "schema": hostile_schema,
    "samplers": hostile_samplers,
    "triggers": hostile_triggers,
    "regexes": hostile_regexes,
    "id_slot": hostile_id_slot,
    "chat_format": hostile_chat_format,
    "name": hostile_name_str,
    "tools": hostile_tools,
    "tool_choice": hostile_tool_choice,
    "response_format": hostile_response_format,
    "filename": hostile_filename,
}

# the sampling and slot fields of launch_slot_with_task (server-context.cpp), shared by every
# completion-like route
SAMPLING_FIELDS = {
    "n_predict": "int", "max_tokens": "int", "temperature": "float", "top_k": "int", "top_p": "float",
    "min_p": "float", "tfs_z": "float", "typical_p": "float", "dynatemp_range": "float",
    "dynatemp_exponent": "float", "xtc_probability": "float", "xtc_threshold": "float", "top_n_sigma": "float",
    "repeat_last_n": "int", "repeat_penalty": "float", "frequency_penalty": "float", "presence_penalty": "float",
    "dry_multiplier": "float", "dry_base": "float", "dry_allowed_length": "int", "dry_penalty_last_n": "int",
    "dry_sequence_breakers": "strlist", "mirostat": "int", "mirostat_tau": "float", "mirostat_eta": "float",
    "adaptive_target": "float", "adaptive_decay": "float", "adaptive_updt_w_cur": "bool", "penalize_nl": "bool",
    "n_keep": "int", "n_discard": "int", "seed": "int", "n_probs": "int", "min_keep": "int",
    "post_sampling_probs": "bool", "speculative.n_max": "int", "speculative.n_min": "int",
    "speculative.p_min": "float", "speculative.type": "name", "speculative.ngram_size_n": "int",
    "json_schema": "schema", "grammar": "grammar", "grammar_lazy": "bool", "grammar_triggers": "triggers",
    "preserved_tokens": "strlist", "cache_prompt": "bool", "stream": "bool", "stream_options": "object",
    "timings_per_token": "bool", "saturate_predict": "bool", "penalty_prompt": "tokens",
    "chat_format": "chat_format", "reasoning_format": "name", "parse_tool_calls": "bool", "chat_parser": "name",
    "thinking_forced_open": "bool", "logit_bias": "logit_bias", "ignore_eos": "bool", "banbuffer_size": "int",
    "rewind_count_max": "int", "banned_strings": "strlist", "banned_regex": "regexes",
    "banned_regex_case_insensitive": "regexes", "banned_bias": "float", "banned_n": "int", "stop": "stop",
    "samplers": "samplers", "id_slot": "id_slot", "system_prompt": "str", "model": "str",
    "allowlist_piece_array": "strlist", "input_prefix": "str", "input_suffix": "str",
}
CHAT_FIELDS = {
    **{k: v for k, v in SAMPLING_FIELDS.items() if k not in ("input_prefix", "input_suffix")},
    "messages": "messages", "tools": "tools", "tool_choice": "tool_choice", "response_format": "response_format",
    "logprobs": "bool", "top_logprobs": "int", "n": "int", "chat_template_kwargs": "object",
    "add_generation_prompt": "bool", "parallel_tool_calls": "bool", "echo": "bool", "thinking": "object",
}


@dataclass
class Route:
    method: str
    path: str
    fields: dict[str, str]
    body: Callable[[random.Random, World], Any] | None   # a small valid body; None: no body
    weight: float = 1.0


def completion_body(rng: random.Random, world: World) -> dict:
    return {"prompt": rng.choice(["hello", "once upon a time", [world.token(rng) for _ in range(4)]]),
            "n_predict": rng.randint(1, 4), "temperature": 0}


def chat_body(rng: random.Random, world: World) -> dict:
    return {"messages": [{"role": "user", "content": rng.choice(["hello", "hi there"])}],
            "max_tokens": rng.randint(1, 4), "temperature": 0}


def slot_body(rng: random.Random, world: World) -> dict:
    return {"filename": rng.choice(world.slot_files) if world.slot_files and rng.random() < 0.5 else "fuzz-save"}


ROUTES: dict[str, Route] = {
    "completion": Route("POST", "/completion", SAMPLING_FIELDS, completion_body, 6),
    "completions": Route("POST", "/completions", SAMPLING_FIELDS, completion_body, 0.5),
    "v1-completions": Route("POST", "/v1/completions",
                            {**SAMPLING_FIELDS, "echo": "bool", "logprobs": "int", "n": "int", "best_of": "int"},
                            completion_body, 2),
    "chat": Route("POST", "/v1/chat/completions", CHAT_FIELDS, chat_body, 4),
    "chat-legacy": Route("POST", "/chat/completions", CHAT_FIELDS, chat_body, 0.5),
    "responses": Route("POST", "/v1/responses",
                       {"input": "messages", "instructions": "str", "max_output_tokens": "int", "tools": "tools",
                        "temperature": "float", "stream": "bool", "reasoning": "object", "text": "object"},
                       lambda r, w: {"input": "hello", "max_output_tokens": 2, "temperature": 0}, 1),
    "messages": Route("POST", "/v1/messages",
                      {"messages": "messages", "max_tokens": "int", "system": "str", "stop_sequences": "stop",
                       "thinking": "object", "tools": "tools", "tool_choice": "tool_choice", "metadata": "object",
                       "temperature": "float", "stream": "bool", "model": "str"},
                      lambda r, w: {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, 1),
    "count-tokens": Route("POST", "/v1/messages/count_tokens", {"messages": "messages", "system": "str",
                                                                  "tools": "tools"},
                          lambda r, w: {"model": "x", "messages": [{"role": "user", "content": "hi"}]}, 0.5),
    "infill": Route("POST", "/infill", {**SAMPLING_FIELDS, "input_extra": "object"},
                    lambda r, w: {"input_prefix": "def f(", "input_suffix": "):", "prompt": "", "n_predict": 2}, 1),
    "tokenize": Route("POST", "/tokenize", {"content": "prompt", "add_special": "bool", "with_pieces": "bool"},
                      lambda r, w: {"content": r.choice(["hello world", "x"])}, 3),
    "detokenize": Route("POST", "/detokenize", {"tokens": "tokens"},
                        lambda r, w: {"tokens": [w.token(r) for _ in range(3)]}, 3),
    "apply-template": Route("POST", "/apply-template", CHAT_FIELDS, chat_body, 2),
    "embedding": Route("POST", "/embedding", {"content": "prompt", "input": "prompt"},
                       lambda r, w: {"content": "hello"}, 0.3),
    "v1-embeddings": Route("POST", "/v1/embeddings", {"input": "prompt", "encoding_format": "str"},
                           lambda r, w: {"input": "hello"}, 0.3),
    "slot-save": Route("POST", "/slots/{id}?action=save", {"filename": "filename"}, slot_body, 2),
    "slot-restore": Route("POST", "/slots/{id}?action=restore", {"filename": "filename"}, slot_body, 2.5),
    "slot-erase": Route("POST", "/slots/{id}?action=erase", {}, lambda r, w: {}, 1),
    "slot-action": Route("POST", "/slots/{id}?action={action}", {"filename": "filename"}, slot_body, 1),
    "slots": Route("GET", "/slots", {}, None, 0.5),
    "slots-list": Route("GET", "/slots/list", {}, None, 0.3),
    "list": Route("GET", "/list", {}, None, 0.3),
    "delete-prompt": Route("POST", "/delete_prompt", {"filename": "filename"}, slot_body, 0.7),
    "rename-prompt": Route("POST", "/rename_prompt", {"old_filename": "filename", "new_filename": "filename"},
                           lambda r, w: {"old_filename": "fuzz-nothing", "new_filename": "fuzz-other"}, 0.7),
    "props": Route("GET", "/props", {}, None, 0.3),
    "v1-props": Route("GET", "/v1/props", {}, None, 0.2),
    "models": Route("GET", "/v1/models", {}, None, 0.2),
    "metrics": Route("GET", "/metrics", {}, None, 0.3),
    "health": Route("GET", "/health?{query}", {}, None, 0.3),
    "version": Route("GET", "/version", {}, None, 0.1),
    "lora-list": Route("GET", "/lora-adapters", {}, None, 0.1),
    "lora-apply": Route("POST", "/lora-adapters", {}, lambda r, w: [{"id": r.choice([0, 1, -1]), "scale": 0.5}], 0.7),
    "cv-list": Route("GET", "/control-vectors", {}, None, 0.1),
    "cv-load": Route("POST", "/control-vectors/load",
                     {"path": "filename", "scale": "float", "layer_start": "int", "layer_end": "int"},
                     lambda r, w: {"path": r.choice(["/nonexistent.gguf", w.slot_dir + "/garbage"])}, 0.7),
    "cv-unload": Route("POST", "/control-vectors/unload", {"id": "int"}, lambda r, w: {"id": 0}, 0.5),
    "cv-apply": Route("POST", "/control-vectors/apply", {}, lambda r, w: [{"id": 0, "scale": 1.0}], 0.5),
}


# --- one request ---------------------------------------------------------------------------------

@dataclass
class Request:
    route: str
    method: str
    path: str
    value: Any                      # the body as a Python value (None: no body), or Raw
    mutations: list[str]
    headers: dict[str, str] = field(default_factory=dict)
    whole_text: bool = False        # a valid request whose reply must come whole (a "cut reply")
    must_refuse: bool = False       # a value the server must answer with a 4xx (out of its range)

    @property
    def body(self) -> bytes | None:
        return None if self.value is None else encode(self.value)

    def describe(self) -> str:
        path = self.path if len(self.path) <= 80 else f"{self.path[:60]}...({len(self.path)} chars)"
        text = f"{self.method} {path}"
        if self.value is not None:
            text += " " + describe(self.value)
        if self.headers:
            text += f" (headers {self.headers})"
        return text


def whole_body(rng: random.Random, valid: bytes) -> tuple[str, Raw]:
    choices = [
        ("empty body", b""), ("not JSON", b"hello"), ("truncated JSON", valid[:max(1, len(valid) // 2)]),
        ("JSON null", b"null"), ("JSON array", b"[1, 2]"), ("JSON string", b'"x"'), ("JSON number", b"5"),
        ("trailing garbage", valid + b"}}"), ("BOM", b"\xef\xbb\xbf" + valid), ("NaN", b"NaN"),
        ("invalid UTF-8 bytes", b"\xff\xfe" + valid), ("duplicate keys", valid[:-1] + b', "prompt": 5}' if
                                                        valid.endswith(b"}") and len(valid) > 2 else valid),
        ("deep array", b"[" * 100_000 + b"]" * 100_000), ("deep object", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        ("deep array, unclosed", b"[" * 1_000_000), ("comments", b"/* x */" + valid), ("NUL", b"\x00"),
    ]
    label, data = rng.choice(choices)
    return label, Raw(data, label)


# fields that take token ids, counts, ids or free-form structure: drawn four times as often
HOT_FIELDS = {"prompt", "content", "tokens", "stop", "logit_bias", "n_probs", "n_predict", "max_tokens", "id_slot",
              "messages", "n_keep", "n_discard", "grammar", "json_schema", "samplers", "filename", "path", "input",
              "penalty_prompt", "tools", "response_format", "old_filename", "new_filename", "speculative.n_max"}


def set_field(rng: random.Random, world: World, route: Route, value: dict) -> str:
    keys = list(route.fields)
    key = rng.choices(keys, weights=[4 if k in HOT_FIELDS else 1 for k in keys])[0]
    value[key] = KINDS[route.fields[key]](rng, world)
    return f"{key}={describe(value[key], 60)}"


MUTATIONS = {"field": 12, "out of range": 1.5, "slot id": 3, "action": 1, "query": 1, "unknown key": 1, "drop key": 1,
             "wrong type": 1.5, "body": 1.2, "content type": 0.4, "method": 0.6, "path": 0.4}

# "cut reply": a valid request for a short answer in a script of 2-, 3- or 4-byte characters, so its
# length limit falls inside a character, on every route that returns text
CUT_QUESTIONS = ["Write one Hebrew word.", "日本語で一言書いてください。", "Reply with three emoji.",
                 "Напиши одно слово по-русски.", "用中文写一个词。", "اكتب كلمة عربية واحدة."]
CUT_ROUTES = {"completion": "n_predict", "completions": "n_predict", "v1-completions": "max_tokens",
              "chat": "max_tokens", "chat-legacy": "max_tokens", "messages": "max_tokens", "infill": "n_predict"}
CUT_SHARE = 0.08


# sampling values just outside their documented ranges (a 400 or a reply, never a crash); a
# negative temperature must be refused
OUT_OF_RANGE = {"temperature": [-1, -0.5, -1e-6], "top_p": [0, -0.5, 1.5], "top_k": [-1, -100],
                "min_p": [-0.1, 1.5], "seed": [-2, 2**32], "max_tokens": [0, -2], "n_predict": [-2, 0]}


def out_of_range(rng: random.Random, route: Route, value: dict) -> tuple[str, bool]:
    """Set one sampling field of value outside its range: (the mutation, whether it must be refused)."""
    key = rng.choice([k for k in OUT_OF_RANGE if k in route.fields])
    value[key] = rng.choice(OUT_OF_RANGE[key])
    return f"{key}={value[key]}", key == "temperature"


def cut_reply(rng: random.Random, name: str) -> Request:
    question, limit, stream = rng.choice(CUT_QUESTIONS), rng.randint(1, 8), rng.random() < 0.5
    route = ROUTES[name]
    if name in ("chat", "chat-legacy", "messages"):
        value: dict[str, Any] = {"messages": [{"role": "user", "content": question}], "model": "x"}
    elif name == "infill":
        value = {"input_prefix": question, "input_suffix": "", "prompt": ""}
    else:
        value = {"prompt": question}
    value.update({CUT_ROUTES[name]: limit, "temperature": 0, "stream": stream})
    return Request(name, route.method, route.path, value, [f"cut reply: {limit} tokens{', streamed' if stream else ''}"],
                   whole_text=True)


def generate(rng: random.Random, world: World, routes: Sequence[str] | None = None,
             cut_share: float = CUT_SHARE) -> Request:
    """A request to one of routes (default: all), with one to three mutations, or now and then a
    valid request whose reply is cut inside a character (cut_reply)."""
    names = list(routes or ROUTES)
    name = rng.choices(names, weights=[ROUTES[n].weight for n in names])[0]
    if name in CUT_ROUTES and rng.random() < cut_share:
        return cut_reply(rng, name)
    route = ROUTES[name]
    method, path = route.method, route.path
    mutations: list[str] = []
    value = route.body(rng, world) if route.body else None
    slot_id: Any = rng.randrange(world.n_slots)
    action = rng.choice(["save", "restore", "erase"])
    headers: dict[str, str] = {}
    must_refuse = False
    usable = [m for m in MUTATIONS
              if (m != "field" or (route.fields and isinstance(value, dict)))
              and (m != "slot id" or "{id}" in path)
              and (m != "out of range" or (isinstance(value, dict) and "temperature" in route.fields))
              and (m != "action" or "{action}" in path)
              and (m != "query" or "{query}" in path)
              and (m not in ("unknown key", "drop key") or isinstance(value, dict))
              and (m != "wrong type" or (isinstance(value, (dict, list)) and value))]
    for _ in range(rng.choices([1, 2, 3], weights=[7, 2, 1])[0]):
        kind = rng.choices(usable, weights=[MUTATIONS[m] for m in usable])[0]
        if kind == "field" and isinstance(value, dict):
            mutations.append(set_field(rng, world, route, value))
        elif kind == "out of range" and isinstance(value, dict):
            mutation, refuse = out_of_range(rng, route, value)
            mutations.append(mutation)
            must_refuse = must_refuse or refuse
        elif kind == "slot id":
            slot_id = rng.choice([world.n_slots, -1, -2, 99, 2**31, 2**64, "abc", "1abc", "0x1", " 1", "+1", "",
                                  "%2e%2e", "1.5", "-0", "00000000000000000001"])
            mutations.append(f"slot id={slot_id}")
        elif kind == "action":
            action = rng.choice(["", "SAVE", "delete", "save&action=erase", "save%00", "x" * 5000])
            mutations.append(f"action={action[:20]}")
        elif kind == "query":
            query = rng.choice(["include_slots", "fail_on_no_slot", "include_slots&fail_on_no_slot", "%zz",
                                "a=" + "b" * 10_000])
            path = path.replace("{query}", query)
            mutations.append(f"query={query[:20]}")
        elif kind == "unknown key" and isinstance(value, dict):
            key = rng.choice(["__unknown", "", "n_predict ", "\u00e9", "id", "__oaicompat", "prompt\x00x", "a" * 10_000])
            value[key] = rng.choice([1, "x", None, nested(100_000), {}, [1.5]])
            mutations.append(f"unknown key {describe(key, 30)}")
        elif kind == "drop key" and isinstance(value, dict) and value:
            key = rng.choice(list(value))
            del value[key]
            mutations.append(f"no {key}")
        elif kind == "wrong type" and isinstance(value, dict) and value:
            key = rng.choice(list(value))
            value[key] = rng.choice(WRONG_TYPES + NON_FINITE[:2] + INVALID_UTF8)
            mutations.append(f"{key}={describe(value[key], 40)}")
        elif kind == "wrong type" and isinstance(value, list) and value:
            item = rng.randrange(len(value))
            value[item] = rng.choice([KINDS["object"](rng, world), {"id": hostile_int(rng), "scale": hostile_float(rng)},
                                      {"id": 0}, {"scale": 1}, {"id": 0, "scale": 1, "layer_start": hostile_int(rng),
                                                                "layer_end": hostile_int(rng)}])
            mutations.append(f"item {item}={describe(value[item], 60)}")
        elif kind == "body":
            label, value = whole_body(rng, encode(value) if value is not None else b"{}")
            mutations.append(f"body: {label}")
        elif kind == "content type":
            headers["Content-Type"] = rng.choice(["text/plain", "multipart/form-data; boundary=x",
                                                  "application/x-www-form-urlencoded", "application/json; charset=latin1",
                                                  "\xff"])
            mutations.append(f"content-type={headers['Content-Type'][:20]}")
        elif kind == "method":
            method = rng.choice([m for m in ("GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH") if m != method])
            mutations.append(f"method {method}")
        elif kind == "path":
            suffix = rng.choice(["/", "/x", "?x=" + "y" * 10_000, "%00", "/../health", "//", "?" + "&" * 1000])
            path = path + suffix if "?" not in path else path.replace("?", suffix.rstrip("?") + "?", 1)
            mutations.append(f"path+{suffix[:20]}")
    path = path.replace("{id}", str(slot_id)).replace("{action}", action).replace("{query}", "")
    if not mutations:  # a GET route drew a mutation it has no use for
        mutations.append(f"method {method}")
    return Request(name, method, path, value, mutations, headers, must_refuse=must_refuse and len(mutations) == 1)


# --- talking to the server ---------------------------------------------------------------------

@dataclass
class Reply:
    status: int | None      # None: no status line
    body: bytes
    error: str              # "timeout", "closed", "refused" ... when status is None
    seconds: float


def http(port: int, method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None,
         timeout: float = 60.0, host: str = "127.0.0.1") -> Reply:
    """One HTTP/1.1 request on its own connection (Connection: close), read to the end or to the
    deadline. A raw client: http.client refuses some of the paths and bodies fuzzed here."""
    start = time.monotonic()
    deadline = start + timeout
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    headers = {"Content-Type": "application/json", **(headers or {})}
    if body is not None or method not in ("GET", "HEAD", "OPTIONS", "DELETE"):
        headers["Content-Length"] = str(len(body or b""))
    lines += [f"{k}: {v}" for k, v in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
    data = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(head + (body or b""))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        return Reply(None, data, "timeout" + (" (partial reply)" if data else ""), time.monotonic() - start)
    except ConnectionRefusedError:
        return Reply(None, data, "connection refused", time.monotonic() - start)
    except OSError as e:
        if not data:
            return Reply(None, data, f"{type(e).__name__}: {e}", time.monotonic() - start)
    seconds = time.monotonic() - start
    match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    if not match:
        return Reply(None, data, "closed without a reply" if not data else "no status line", seconds)
    head_end = data.find(b"\r\n\r\n")
    head_text, payload = data[:head_end], data[head_end + 4:] if head_end >= 0 else b""
    if re.search(rb"(?i)transfer-encoding:\s*chunked", head_text):
        payload = dechunk(payload)
    return Reply(int(match.group(1)), payload, "", seconds)


def dechunk(data: bytes) -> bytes:
    out, at = b"", 0
    while at < len(data):
        end = data.find(b"\r\n", at)
        if end < 0:
            break
        try:
            size = int(data[at:end].split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += data[end + 2:end + 2 + size]
        at = end + 2 + size + 2
    return out


def error_message(reply: Reply) -> str:
    """The message of an error reply (JSON {"error": {"message"}} or whatever it sent), or of the
    first error event of a stream."""
    text = reply.body.decode("utf-8", "replace")
    for candidate in [text] + [line[6:] for line in text.splitlines() if line.startswith("data: ")]:
        try:
            data = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(data, dict) and "error" in data:
            error = data["error"]
            return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    return text[:300]


def incomplete_text(reply: Reply) -> str:
    """Why a reply to a valid text request did not come whole ('' if it did): not a 200, bytes
    that are not UTF-8, a U+FFFD in its text, or an event stream without its end. A 501 (a model
    without infill tokens) has no text to check."""
    if reply.status == 501:
        return ""
    if reply.status != 200:
        return f"HTTP {reply.status}: {error_message(reply)}"
    try:
        text = reply.body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 at byte {e.start}"
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    for part in events or [text]:
        try:
            if "\ufffd" in json.dumps(json.loads(part), ensure_ascii=False):
                return f"U+FFFD in {part[:160]}"
        except ValueError:
            if part != "[DONE]":
                return f"not JSON: {part[:160]}"
    if events and not (events[-1] == "[DONE]" or '"stop":true' in events[-1].replace(" ", "")
                       or '"message_stop"' in events[-1]):
        return f"the stream did not end: last event {events[-1][:160]}"
    return ""


def stream_error_code(reply: Reply) -> int | None:
    """The code of an error event inside a 200 event stream (errors after the first chunk)."""
    for line in reply.body.decode("utf-8", "replace").splitlines():
        if line.startswith("data: ") and '"error"' in line:
            try:
                error = json.loads(line[6:]).get("error", {})
            except (ValueError, AttributeError):
                continue
            if isinstance(error, dict):
                return int(error.get("code", 500)) if str(error.get("code", "")).isdigit() else 500
    return None


# --- the server under test ------------------------------------------------------------------------

class Harness:
    """A llama-server for the fuzzer: started, checked after every case, started again when it
    died or went wrong."""

    def __init__(self, target: Path, draft: Path | None, folder: Path, binary: str | None = None,
                 parallel: int = 2, ctx_size: int = 1024, threads: int = 2, timeout: float = 60.0,
                 startup_timeout: float = 120.0) -> None:
        self.target, self.draft, self.folder = target, draft, folder
        self.binary = binary or os.environ.get("IKDFLASH_FUZZ_SERVER") or None
        self.parallel, self.ctx_size, self.threads, self.timeout = parallel, ctx_size, threads, timeout
        self.startup_timeout = startup_timeout
        self.slot_dir = folder / "slots"
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        self.server = None
        self.starts = 0
        self.baseline: list[str] | None = None
        import gguf
        reader = gguf.GGUFReader(target)
        self.n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
        eos = reader.fields.get("tokenizer.ggml.eos_token_id")  # --endings forces it; nothing else needs it
        self.eos = int(eos.contents()) if eos is not None else None
        self.world = World(self.n_vocab, parallel, slot_dir=str(self.slot_dir))

    @property
    def config(self) -> str:
        return "dflash" if self.draft else "plain"

    @property
    def log(self) -> Path:
        return self.folder / f"server-{self.starts}.log"

    def start(self) -> None:
        from ikdflash import Server
        binary = self.binary

        class Custom(Server):
            def command(self) -> list[str]:
                cmd = super().command()
                if binary:
                    cmd[0] = str(Path(binary).expanduser())
                return cmd

        self.starts += 1
        # --n-predict: a request with no limit (or a huge one) ends after 64 tokens, not at the
        # model's training context (4,096 tokens: a minute on a busy machine, with a random draft)
        args = ["--parallel", str(self.parallel), "--slot-save-path", str(self.slot_dir), "--metrics",
                "--n-predict", "64"]
        if self.draft:
            args += ["--model-draft", str(self.draft), "--spec-type", "dflash:n_max=4"]
        # no PATH: ggml's abort handler would spend seconds attaching gdb for a backtrace
        self.server = Custom(self.target, ctx_size=self.ctx_size, n_threads=self.threads, log_file=self.log,
                             extra_args=args, startup_timeout=self.startup_timeout, env={"PATH": ""},
                             stop_grace=3)  # a server with a hung request may not end on SIGTERM
        self.server.start()
        replies = self.reference()
        if self.baseline is None:
            if any(r is None for r in replies):
                raise RuntimeError(f"the reference request failed on a fresh server: {replies}")
            self.baseline = replies
            self.prepare_slot_files()
        elif replies != self.baseline:
            raise RuntimeError(f"a fresh server answers {replies}, not {self.baseline}")

    def stop(self) -> int | None:
        server, self.server = self.server, None
        if server is None:
            return None
        group = server.process.pid if server.process is not None else None
        code = server.stop()
        if group is not None:
            # an abort forks a child to print a backtrace (ggml_print_backtrace); without gdb it
            # calls exit(), which deadlocks in a static destructor: the child outlives the server
            # that Server.stop() found already gone. It is in the server's process group.
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return code

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def port(self) -> int:
        return self.server.port

    def alive(self) -> bool:
        return self.server is not None and self.server.process is not None and self.server.process.poll() is None

    def reference(self) -> list[str | None]:
        """Each slot's reply to the fixed greedy request (None where it failed)."""
        out = []
        for slot in range(self.parallel):
            body = {"prompt": REFERENCE_PROMPT, "n_predict": 8, "temperature": 0, "cache_prompt": False,
                    "ignore_eos": True, "id_slot": slot}
            reply = http(self.port, "POST", "/completion", encode(body), timeout=self.timeout)
            try:
                out.append(json.loads(reply.body)["content"] if reply.status == 200 else None)
            except (ValueError, KeyError, TypeError):
                out.append(None)
        return out

    def prepare_slot_files(self) -> None:
        """Files for restore cases, beside a real save of slot 0 (fuzz-valid): its truncations, a
        token count of 2^31 - 1, a token list that is not JSON or names tokens outside the
        vocabulary, a .checkpoints file that is a state file (what a save under the name
        "x.checkpoints" writes, and a restore of "x" then reads), a .dflash file of garbage or cut
        short, and garbage."""
        reply = http(self.port, "POST", "/slots/0?action=save", encode({"filename": "fuzz-valid"}),
                     timeout=self.timeout)
        names = []
        valid = self.slot_dir / "fuzz-valid"
        if reply.status == 200 and valid.is_file():
            data = valid.read_bytes()
            extras = {suffix: (self.slot_dir / ("fuzz-valid" + suffix)).read_bytes()
                      for suffix in (".tokens.json", ".dflash", ".checkpoints")
                      if (self.slot_dir / ("fuzz-valid" + suffix)).is_file()}

            def write(name: str, state: bytes, **replace: bytes) -> None:
                (self.slot_dir / name).write_bytes(state)
                for suffix, content in {**extras, **replace}.items():
                    (self.slot_dir / (name + suffix)).write_bytes(content)
                names.append(name)

            names.append("fuzz-valid")
            for cut in (0, 4, 12, len(data) // 2, len(data) - 1):
                write(f"fuzz-cut-{cut}", data[:cut])
            write("fuzz-count", data[:8] + (2**31 - 1).to_bytes(4, "little") + data[12:])
            write("fuzz-badjson", data, **{".tokens.json": b"{not json"})
            tokens = json.loads(extras.get(".tokens.json", b"{}") or b"{}")
            tokens["tokens"] = [self.n_vocab + 7, -3, 2**31 - 1]
            write("fuzz-badtokens", data, **{".tokens.json": json.dumps(tokens).encode()})
            write("fuzz-ckpt", data, **{".checkpoints": data})
            if ".dflash" in extras:
                write("fuzz-dflash-cut", data, **{".dflash": extras[".dflash"][:len(extras[".dflash"]) // 3]})
                write("fuzz-dflash-garbage", data, **{".dflash": random.Random(1).randbytes(len(extras[".dflash"]))})
        (self.slot_dir / "garbage").write_bytes(random.Random(0).randbytes(4096))
        names.append("garbage")
        self.world.slot_files = names
        self._slot_snapshot = {p.name: p.read_bytes() for p in self.slot_dir.iterdir() if p.is_file()}

    def restore_slot_files(self) -> None:
        """Put the prepared files back as they were, and remove the files cases saved: each case
        starts from the same folder."""
        for path in self.slot_dir.iterdir():
            if path.name not in self._slot_snapshot and path.is_file():
                path.unlink()
        for name, data in self._slot_snapshot.items():
            path = self.slot_dir / name
            if not path.is_file() or path.read_bytes() != data:
                path.write_bytes(data)

    def health(self) -> tuple[bool, str]:
        reply = http(self.port, "GET", "/health", None, timeout=min(self.timeout, 30))
        if reply.status != 200:
            return False, f"/health: {reply.status or reply.error}: {error_message(reply)[:100]}"
        return True, ""

    def complaint(self) -> str:
        """What the log says went wrong: the uncaught exception, the failed assert, the signal."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()[-80:]
        except OSError:
            return ""
        picked = []
        for line in lines:
            for key in ("what():", "terminate called", "GGML_ASSERT", "GGML_ABORT", "Assertion", "Segmentation fault",
                        "AddressSanitizer", "runtime error:", "fatal error"):
                if key in line:
                    picked.append(line[line.index(key):].strip()[:240])
                    break
        return " | ".join(dict.fromkeys(picked)) if picked else "(no message in the log)"


# --- running cases ---------------------------------------------------------------------------------

@dataclass
class RequestCase(Case):
    request: str = ""
    route: str = ""
    signature: str = ""
    seconds: float = 0.0


def judge(harness: Harness, request: Request, timeout: float | None = None) -> tuple[str, str, float]:
    """Send one request and check the server after it: (outcome, detail, seconds)."""
    reply = http(harness.port, request.method, request.path, request.body, request.headers,
                 timeout=timeout or harness.timeout)
    outcome, detail = "ok", ""
    if reply.status is None:
        outcome = "hang" if reply.error.startswith("timeout") else "dropped"
        detail = f"{reply.error} after {reply.seconds:.1f} s"
    elif reply.status >= 500 and reply.status not in (501, 503):  # not supported, unavailable: fine
        outcome, detail = "error", f"HTTP {reply.status}: {error_message(reply)}"
    elif reply.status >= 400:
        outcome, detail = "refused", f"HTTP {reply.status}: {error_message(reply)}"
    elif (code := stream_error_code(reply)) is not None:
        outcome = "error" if code >= 500 else "refused"
        detail = f"HTTP 200, error event {code}: {error_message(reply)}"
    if request.whole_text and reply.status is not None and (why := incomplete_text(reply)):
        outcome, detail = "garbled", why
    if request.must_refuse and outcome == "ok":
        outcome, detail = "accepted", f"HTTP {reply.status} for a value out of its range"
    # a crash can come after the reply (the main loop runs the task on its own thread): the
    # checks go through the main loop, so they wait for it
    time.sleep(0.02)
    if harness.alive() and isinstance(request.value, dict) and "system_prompt" in request.value:
        # a request may set the server-wide system prompt (documented, finding F13 in
        # tests/test_fuzz_requests.py): set it back, so the check sees the server as it was
        http(harness.port, "POST", "/completion", encode({"prompt": "a", "n_predict": 1, "system_prompt": ""}),
             timeout=harness.timeout)
    if harness.alive():
        ok, why = harness.health()
        if ok:
            replies = harness.reference()
            if replies != harness.baseline:
                return "diverged", f"{detail}; afterwards the normal request got {replies}, not {harness.baseline}" \
                    .lstrip("; "), reply.seconds
            return outcome, detail, reply.seconds
        if harness.alive():
            return "unhealthy", f"{detail}; {why}".lstrip("; "), reply.seconds
    process = harness.server.process
    try:
        code = process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    name = signal.Signals(-code).name if code is not None and code < 0 else f"exit {code}"
    return "crash", f"{name}: {harness.complaint()}", reply.seconds


def signature(case: RequestCase) -> str:
    """What makes two cases the same finding: the outcome, the route, and the message (numbers
    and quoted values normalized) or, for hangs and divergences, the mutated fields."""
    if case.outcome in ("hang", "diverged", "unhealthy", "dropped"):
        fields = sorted({m.split("=")[0].split(":")[0] for m in case.mutation.split("; ")})
        return f"{case.outcome} {case.route}: {','.join(fields)}"
    return f"{case.outcome} {case.route}: {kind(case.detail)}"


def kind(detail: str) -> str:
    """An error message with its specifics (numbers, quoted values, positions) taken out."""
    what = detail.split(" | ")[-1]
    exception = re.search(r"json\.exception\.(\w+)\.(\d+)\]\s*([^:;,']*)", what)
    if exception:
        return f"json {exception.group(1)} {exception.group(2)} {exception.group(3).strip()}"[:100]
    return re.sub(r"'[^']*'|\"[^\"]*\"|\b0x[0-9a-f]+\b|\d+", "N", what)[:100]


def run(harness: Harness, cases: int, seed: int, only: Iterable[int] | None = None, routes: Sequence[str] | None = None,
        progress: Callable[[RequestCase], None] = lambda case: None, stop_at_finding: bool = False,
        cut_share: float = CUT_SHARE) -> list[RequestCase]:
    """Run cases [0, cases) (or those in only) of seed against harness (started if it is not);
    with stop_at_finding, only up to the first finding."""
    if harness.server is None:
        harness.start()
    results = []
    for index in (only if only is not None else range(cases)):
        rng = random.Random(f"{seed}:{index}")
        request = generate(rng, harness.world, routes, cut_share)
        outcome, detail, seconds = judge(harness, request)
        case = RequestCase(index, "; ".join(request.mutations), harness.config, outcome, detail,
                           request=request.describe(), route=request.route, seconds=round(seconds, 3))
        case.signature = signature(case)
        results.append(case)
        progress(case)
        if outcome in ("crash", "hang", "unhealthy", "diverged", "dropped"):
            harness.restart()
        harness.restore_slot_files()
        if stop_at_finding and outcome in FINDINGS:
            break
    return results


# --- why a reply ended: finish_reason on every OpenAI-style route ----------------------------------

# /v1/messages takes neither ignore_eos nor logit_bias, so its endings cannot be chosen: not here
FINISH_ROUTES = ("v1-completions", "chat")
ENDINGS = ("length", "stop string", "eos")
FINISH_PROMPTS = ["Say something.", "Count to ten.", "Name a colour.", "Tell me a story.", "the cat sat on"]


def finish_body(route: str, prompt: str, limit: int, stream: bool, **extra: Any) -> dict:
    body: dict[str, Any] = ({"prompt": prompt} if route == "v1-completions" else
                            {"messages": [{"role": "user", "content": prompt}], "model": "x"})
    return {**body, "max_tokens": limit, "temperature": 0, "stream": stream, **extra}


def reply_finish(reply: Reply) -> tuple[str | None, str]:
    """(its finish_reason, its text) of an OpenAI-style reply, JSON or an event stream."""
    text = reply.body.decode("utf-8", errors="replace")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")] or [text]
    said, pieces = None, []
    for event in events:
        try:
            data = json.loads(event)
        except ValueError:
            continue
        for choice in data.get("choices") or []:
            said = choice.get("finish_reason") or said
            message = choice.get("message") or choice.get("delta") or {}
            pieces.append(choice.get("text") or message.get("content") or "")
    return said, "".join(pieces)


def ending_case(harness: Harness, rng: random.Random, route: str, stream: bool, ending: str
                ) -> tuple[Request | None, str]:
    """A valid greedy request that ends by the given ending, and the finish_reason it must get (a
    stop string is cut from the reply's own text, read from a first request; None when that text
    is empty). EOS is forced by a logit bias on the target's EOS token; the other endings
    run with ignore_eos, so they end by their own cause alone."""
    prompt, limit = rng.choice(FINISH_PROMPTS), rng.randint(1, 8)
    path = ROUTES[route].path
    if ending == "eos":
        if harness.eos is None:
            raise ValueError(f"{harness.target}: no tokenizer.ggml.eos_token_id to end a reply with")
        value = finish_body(route, prompt, limit + 8, stream, logit_bias={str(harness.eos): 100})
    elif ending == "length":
        value = finish_body(route, prompt, limit, stream, ignore_eos=True)
    else:
        probe = http(harness.port, "POST", path, encode(finish_body(route, prompt, 8, False, ignore_eos=True)),
                     timeout=harness.timeout)
        _, text = reply_finish(probe)
        if probe.status != 200 or not text:
            return None, "stop"
        start = rng.randrange(len(text))
        value = finish_body(route, prompt, 16, stream, ignore_eos=True, stop=[text[start:start + rng.randint(1, 3)]])
    expected = "length" if ending == "length" else "stop"
    return Request(route, "POST", path, value, [f"ends by {ending}{', streamed' if stream else ''}"],
                   whole_text=True), expected


def run_endings(harness: Harness, indices: Iterable[int], seed: int,
                progress: Callable[[RequestCase], None] = lambda case: None) -> list[RequestCase]:
    """These cases: case i is cell i mod the cells (route x streamed or not x ending), so a run of
    consecutive cases gives every cell one before any gets a second. A reply that gives another
    reason than its ending's is an "untruthful" finding."""
    if harness.server is None:
        harness.start()
    cells = [(route, stream, ending) for route in FINISH_ROUTES for stream in (False, True) for ending in ENDINGS]
    results = []
    for index in indices:
        route, stream, ending = cells[index % len(cells)]
        request, expected = ending_case(harness, random.Random(f"{seed}:{index}"), route, stream, ending)
        if request is None:
            outcome, detail, seconds = "skipped", "the probe's reply had no text to cut a stop string from", 0.0
        else:
            reply = http(harness.port, request.method, request.path, request.body, timeout=harness.timeout)
            said, _ = reply_finish(reply)
            outcome, detail, seconds = "ok", f"finish_reason {said}", reply.seconds
            if reply.status is None or (why := incomplete_text(reply)):
                outcome, detail = "error", reply.error if reply.status is None else why
            elif said != expected:
                outcome, detail = "untruthful", f"finish_reason {said!r}, expected {expected!r}"
        case = RequestCase(index, f"{ending}{', streamed' if stream else ''}", harness.config, outcome, detail,
                           request=request.describe() if request else route, route=route, seconds=round(seconds, 3))
        case.signature = f"{outcome} {route}: {case.mutation}"
        results.append(case)
        progress(case)
    return results


def minimize(harness: Harness, case: RequestCase, seed: int, routes: Sequence[str] | None = None,
             cut_share: float = CUT_SHARE) -> str:
    """The request of case with every top-level key it can do without removed (each removal kept
    when the same finding still comes): its description."""
    rng = random.Random(f"{seed}:{case.index}")
    request = generate(rng, harness.world, routes, cut_share)
    if not isinstance(request.value, dict):
        return request.describe()
    for key in list(request.value):
        trial = dict(request.value)
        del trial[key]
        candidate = Request(request.route, request.method, request.path, trial, request.mutations, request.headers,
                            request.whole_text, request.must_refuse)
        outcome, detail, _ = judge(harness, candidate)
        again = RequestCase(case.index, case.mutation, case.via, outcome, detail, route=case.route)
        if outcome in ("crash", "hang", "unhealthy", "diverged", "dropped"):
            harness.restart()
        harness.restore_slot_files()
        if signature(again) == case.signature:
            request = candidate
    return request.describe()


def distinct(results: Sequence[RequestCase]) -> dict[str, list[RequestCase]]:
    """Findings by signature, in the order they first came."""
    out: dict[str, list[RequestCase]] = {}
    for case in results:
        if case.outcome in FINDINGS:
            out.setdefault(case.signature, []).append(case)
    return out


def tiny_pair(folder: Path, arch: str = "llama") -> tuple[Path, Path]:
    """A tiny target and a 3-layer sliding-window DFlash draft converted for it."""
    from fixtures.tinydraft import converted_tiny_draft, write_hf_target
    from fixtures.tinymodels import write_tiny_model
    target = write_tiny_model(folder / "target.gguf", arch=arch)
    hf = write_hf_target(folder / "target-hf", target)
    return target, converted_tiny_draft(folder, hf, target_layer_ids=[0, 2], block_size=16,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        sliding_window=8, seed=5)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as a hang")
    parser.add_argument("--report", type=Path, help="write every case as JSON here")
    parser.add_argument("--config", choices=["plain", "dflash", "both"], default="both",
                        help="without a draft, with a DFlash draft, or half the cases each")
    parser.add_argument("--only", type=int, nargs="+", help="run just these case indices")
    parser.add_argument("--routes", nargs="+", choices=sorted(ROUTES), help="fuzz only these routes")
    parser.add_argument("--show", action="store_true", help="print every case's request")
    parser.add_argument("--cut-share", type=float, default=CUT_SHARE,
                        help=f"share of text-route cases that are cut replies (default {CUT_SHARE}; 1: only those)")
    parser.add_argument("--endings", action="store_true",
                        help="instead of hostile requests: valid ones that end by a limit, a stop string or EOS, "
                             "on every OpenAI-style route, streamed or not; the finish_reason each reply gives "
                             "must be its ending's")
    parser.add_argument("--minimize", action="store_true", help="shrink the first case of each distinct finding")
    parser.add_argument("--server-binary", help="llama-server to run (default: $IKDFLASH_FUZZ_SERVER, else the package's)")
    parser.add_argument("--target", type=Path, help="target GGUF (default: a tiny llama made here)")
    parser.add_argument("--draft", type=Path, help="its DFlash draft (default: a tiny draft made here)")
    parser.add_argument("--keep", type=Path, help="keep the server logs and slot files in this folder")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ikdflash-fuzz-requests-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        target, draft = args.target, args.draft
        if target is None or draft is None:
            target, draft = tiny_pair(folder)
        configs = ["plain", "dflash"] if args.config == "both" else [args.config]
        start = time.monotonic()
        results: list[RequestCase] = []

        def progress(case: RequestCase) -> None:
            if args.show or case.outcome in FINDINGS:
                print(f"[{case.via}] case {case.index} {case.outcome} {case.seconds:.1f}s: {case.request[:300]}"
                      + (f"\n    -> {case.detail[:400]}" if case.detail else ""), flush=True)
            if case.index % 100 == 0:
                print(f"[{case.via}] {case.index} cases, {time.monotonic() - start:.0f} s", flush=True)

        for n, config in enumerate(configs):
            harness = Harness(target, draft if config == "dflash" else None, folder / config, args.server_binary,
                              timeout=args.timeout)
            if args.only is not None:
                indices = args.only
            else:
                per = args.cases // len(configs)
                indices = range(n * per, (n + 1) * per if n < len(configs) - 1 else args.cases)
            try:
                if args.endings:
                    got = run_endings(harness, indices, args.seed, progress)
                else:
                    got = run(harness, 0, args.seed, indices, args.routes, progress, cut_share=args.cut_share)
                results += got
                if args.minimize and not args.endings:  # an ending's finding is its valid request itself
                    for sig, cases in distinct(got).items():
                        print(f"minimal [{config}] {sig}:\n    {minimize(harness, cases[0], args.seed, args.routes, args.cut_share)}",
                              flush=True)
            finally:
                harness.stop()

        counts: dict[str, int] = {}
        for case in results:
            counts[f"{case.via}:{case.outcome}"] = counts.get(f"{case.via}:{case.outcome}", 0) + 1
        print(json.dumps(counts, sort_keys=True), f"in {time.monotonic() - start:.0f} s")
        findings = distinct(results)
        print(f"{len(findings)} distinct findings:")
        for sig, cases in findings.items():
            first = cases[0]
            print(f"  {sig}  x{len(cases)} (first: [{first.via}] case {first.index})\n      {first.request[:300]}"
                  f"\n      {first.detail[:300]}")
        if args.report:
            args.report.write_text(json.dumps([asdict(c) for c in results], indent=1))
    return 1 if findings else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

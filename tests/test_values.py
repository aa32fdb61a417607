"""Every value the command line and the Python API take is checked before work starts: its
invalid side gets one message naming the value and its rule (exit code 2 on the command line, a
ValueError in Python; the rules are docs/python.md#value-rules), and nothing waits forever. Each
case runs in a process of its own under a timeout that fails the test rather than waits: a
stream whose worker failed used to wait for ever in its close()."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ikdflash import rules

SWA = dict(layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=8, block_size=8)
MOST = 7  # what one pass of the test draft proposes: block_size - 1
HANG = 300  # seconds: far beyond what any case takes on a loaded machine; a hang fails here


@pytest.fixture(scope="module")
def pair(tiny_model, tiny_draft):
    target = tiny_model("llama")
    return target, tiny_draft(target, target_layer_ids=[0, 2], seed=5, **SWA)


def in_range(name: str, low: int | str, high: int | str, value: object, note: str) -> str:
    return f"{name} must be in {low}..{high} ({note}), got {value}"


N_MAX_NOTE = "what one draft pass proposes"
DECODING = [  # flags of generate and chat, and what each bad value gets
    (["--n-max", "-3"], in_range("--n-max", 1, "N", -3, N_MAX_NOTE)),
    (["--n-max", "0"], in_range("--n-max", 1, "N", 0, N_MAX_NOTE)),
    (["--n-max", "100"], in_range("--n-max", 1, MOST, 100, N_MAX_NOTE)),
    (["--max-tokens", "-1"], "--max-tokens must be at least 1, got -1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--temperature", "-1"], "temperature must be >= 0 (0: greedy), got -1.0"),
    (["--temperature", "nan"], "temperature must be >= 0 (0: greedy), got nan"),
    (["--seed", "-2"], f"seed must be a 32-bit integer, 0..{rules.UINT32_MAX} (-1: random), got -2"),
    (["--seed", str(2**32)], f"seed must be a 32-bit integer, 0..{rules.UINT32_MAX} (-1: random), got {2**32}"),
    (["--repeat-penalty", "0"], "repeat_penalty must be > 0 (1: off), got 0.0"),
    (["-c", "0"], "--ctx-size must be at least 1, got 0"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
]
SERVE = [
    (["--n-max", "0"], in_range("--n-max", 1, "N", 0, N_MAX_NOTE)),
    (["--n-max", "99"], in_range("--n-max", 1, MOST, 99, N_MAX_NOTE)),
    (["--cross-ctx", "-1"], "--cross-ctx must be >= 0 (0: the target's context), got -1"),
    (["--port", "99999"], "--port must be in 0..65535 (0: a free one), got 99999"),
    (["--port", "-1"], "--port must be in 0..65535 (0: a free one), got -1"),
    (["-c", "0"], "--ctx-size must be at least 1, got 0"),
    (["--parallel", "0"], "--parallel must be at least 1, got 0"),
    (["--min-accept", "2"], "min_accept must be a number in [0, 1], got '2.0'"),
    (["--startup-timeout", "0"], "--startup-timeout must be > 0 seconds, got 0.0"),
    (["--", "--port", "70000"], "--port must be in 0..65535 (0: a free one), got '70000'"),
    (["--", "--spec-type", "dflash:bogus=1"], "unknown key 'bogus'"),
    (["--", "--spec-type", "dflash:n_max=-1"], "n_max must be at least 1, got -1"),
]
CLI = ([("generate", args, says) for args, says in DECODING] + [("chat", args, says) for args, says in DECODING]
       + [("serve", args, says) for args, says in SERVE])


@pytest.mark.parametrize("command, args, says", CLI, ids=[f"{c} {' '.join(a)}" for c, a, _ in CLI])
def test_the_command_line_refuses_each_bad_value(pair, command, args, says):
    target, draft = pair
    before, after = (args[:args.index("--")], args[args.index("--"):]) if "--" in args else (args, [])
    prompt = {"generate": ["hi"], "serve": ["--dry-run"]}.get(command, [])  # serve starts nothing either way
    done = subprocess.run([sys.executable, "-m", "ikdflash.cli", command, "--target", str(target), "--draft",
                           str(draft), *before, *prompt, *after], input="hello\n", capture_output=True, text=True,
                          timeout=HANG)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and says in errors[0], done.stderr


PYTHON_CASES = {  # call -> what it is refused with; `engine` has the draft, `alone` has none
    "Engine(target, draft, cross_ctx=-1)": "cross_ctx must be >= 0 (0: the target's context), got -1",
    "Engine(target, draft, n_ctx=0)": "n_ctx must be at least 1, got 0",
    "Engine(target, draft, n_batch=0)": "n_batch must be at least 1, got 0",
    "Engine(target, draft, n_threads=0)": "n_threads must be at least 1, got 0",
    "engine.speculate('hi', n_max=-3)": in_range("n_max", 1, MOST, -3, N_MAX_NOTE),
    "engine.speculate('hi', n_max=0)": in_range("n_max", 1, MOST, 0, N_MAX_NOTE),
    "engine.speculate('hi', n_max=100)": in_range("n_max", 1, MOST, 100, N_MAX_NOTE),
    "engine.speculate('hi', n_max=2.5)": "n_max must be an integer, got 2.5",
    "engine.speculate('hi', max_tokens=0)": "max_tokens must be at least 1, got 0",
    "engine.speculate('hi', max_tokens=-1)": "max_tokens must be at least 1, got -1",
    "engine.speculate('hi', temperature=-1)": "temperature must be >= 0 (0: greedy), got -1",
    "engine.speculate('hi', top_p=0)": "top_p must be in (0, 1] (1: off), got 0",
    "engine.speculate('hi', top_p=1.5)": "top_p must be in (0, 1] (1: off), got 1.5",
    "engine.speculate('hi', top_k=-1)": "top_k must be >= 0 (0: off), got -1",
    "engine.speculate('hi', min_p=-0.1)": "min_p must be in [0, 1] (0: off), got -0.1",
    "engine.speculate('hi', min_p=2)": "min_p must be in [0, 1] (0: off), got 2",
    "engine.speculate('hi', seed=-2)": "seed must be a 32-bit integer",
    "engine.speculate('hi', seed=2**32)": "seed must be a 32-bit integer",
    "engine.speculate('hi', repeat_penalty=0)": "repeat_penalty must be > 0 (1: off), got 0",
    "engine.speculate('hi', repeat_last_n=-1)": "repeat_last_n must be >= 0, got -1",
    "engine.speculate('hi', logprobs=-1)": "logprobs must be >= 0, got -1",
    "engine.stream('hi', n_max=-3)": in_range("n_max", 0, MOST, -3, N_MAX_NOTE + "; 0: the target alone"),
    "engine.stream('hi', max_tokens=-1)": "max_tokens must be at least 1, got -1",
    "engine.generate('hi', max_tokens=0)": "max_tokens must be at least 1, got 0",
    "engine.generate('hi', temperature=-0.5)": "temperature must be >= 0 (0: greedy), got -0.5",
    "engine.chat([('user', 'hi')], n_max=-1)": in_range("n_max", 0, MOST, -1, N_MAX_NOTE + "; 0: the target alone"),
    "alone.stream('hi', n_max=2)": "this engine has no draft: stream with n_max=0",
    "Server(target, port=99999)": "port must be in 0..65535 (0: a free one), got 99999",
}

PYTHON_SCRIPT = """
import sys
from ikdflash import Engine, Server
target, draft = sys.argv[1], sys.argv[2]
engine, alone = Engine(target, draft, n_ctx=256, n_threads=1), Engine(target, n_ctx=256, n_threads=1)
for call in sys.argv[3:]:
    print("case:", call, flush=True)
    try:
        made = eval(call)
        if hasattr(made, "__exit__"):  # a stream: leaving it must not wait either
            with made:
                pass
    except ValueError as e:
        print("refused:", e, flush=True)
    else:
        print("accepted", flush=True)
"""


def test_python_refuses_each_bad_value_at_once(pair):
    done = subprocess.run([sys.executable, "-c", PYTHON_SCRIPT, *map(str, pair), *PYTHON_CASES],
                          capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr[-2000:]
    said = re.findall(r"case: (.*)\n(refused: .*|accepted)", done.stdout)
    assert [call for call, _ in said] == list(PYTHON_CASES), done.stdout
    wrong = {call: answer for call, answer in said if PYTHON_CASES[call] not in answer}
    assert not wrong, wrong


FAILING_STREAM = """
import sys
from ikdflash import Engine
with Engine(sys.argv[1], sys.argv[2], n_ctx=64, n_threads=1) as engine:
    too_long = [65] * (engine.target.n_ctx + 1)   # the worker fails: the prompt does not fit the context
    try:
        with engine.stream(too_long, max_tokens=4) as stream:
            for piece in stream:
                pass
    except ValueError as e:
        print("raised:", e)
    stream = engine.stream(too_long, max_tokens=4)
    try:
        stream.close()      # never iterated: close raises the worker's failure ...
    except ValueError:
        print("close raised")
    stream.close()          # ... once
    print("closed again")
"""


def test_a_failure_in_a_streams_worker_reaches_the_caller(pair):
    done = subprocess.run([sys.executable, "-c", FAILING_STREAM, *map(str, pair)], capture_output=True, text=True,
                          timeout=HANG)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("raised: the prompt has ") and "but the context holds" in lines[0], done.stdout
    assert lines[1:] == ["close raised", "closed again"], done.stdout


def test_integer_rules_take_any_integer_type_but_bools_and_floats():
    import numpy as np

    assert rules.n_max(np.int64(3), MOST) == 3 and rules.seed(np.uint32(5)) == 5
    assert rules.max_tokens(np.int32(8)) == 8
    for bad in (True, 2.0, "2"):
        with pytest.raises(ValueError, match="n_max must be an integer"):
            rules.n_max(bad, MOST)


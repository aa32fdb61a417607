"""Misusing the bindings raises a Python exception and leaves the objects usable; it never
crashes the interpreter. Each case runs in a subprocess, so a segfault fails the test instead of
ending the run: closing a Model or Draft that others still use, two engines on one context,
calls after close, and several threads sharing one model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SETUP = """
import sys, threading
import numpy as np
from ikdflash import _core
target, draft_path = sys.argv[1], sys.argv[2]
model = _core.Model(target, n_ctx=256, n_threads=1)
prompt = model.tokenize("the quick brown fox jumps over the lazy dog", False, False)

def refused(call, kind, text):
    try:
        call()
    except kind as e:
        assert text in str(e), str(e)
        return
    raise AssertionError(f"{call} did not raise {kind.__name__}")
"""


@pytest.fixture(scope="module")
def pair(tiny_model, tiny_draft):
    target = tiny_model("llama")
    return target, tiny_draft(target, target_layer_ids=[0, 2], block_size=8)


def run(pair, body: str) -> str:
    result = subprocess.run([sys.executable, "-c", SETUP + textwrap.dedent(body), str(pair[0]), str(pair[1])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-2000:]}"
    return result.stdout


def test_a_model_in_use_cannot_be_closed(pair):
    """Before: close() freed the model under its draft and engine, and their next call read
    freed memory (a crash, or garbage tokens)."""
    run(pair, """
        draft = _core.Draft(model, draft_path, n_threads=1)
        engine = _core.Engine(model, draft, 64)
        expected = engine.generate(prompt, 12, 4)[0]
        refused(model.close, RuntimeError, "cannot close the model while 2 Draft/Engine object(s) use it")
        refused(draft.close, RuntimeError, "cannot close the draft while 1 CrossContext/Engine object(s) use it")
        assert engine.generate(prompt, 12, 4)[0] == expected   # nothing was freed
        engine.close()
        refused(lambda: engine.generate(prompt, 12, 4), RuntimeError, "the engine is closed")
        refused(model.close, RuntimeError, "1 Draft/Engine object(s)")
        draft.close()
        model.close()
        refused(lambda: model.tokenize("x", False, False), RuntimeError, "model is closed")
        refused(lambda: model.generate_greedy(prompt, 4, False), RuntimeError, "model is closed")
        refused(lambda: _core.Draft(model, draft_path), RuntimeError, "model is closed")
    """)


def test_a_draft_in_use_by_a_cross_context_cannot_be_closed(pair):
    run(pair, """
        draft = _core.Draft(model, draft_path, n_threads=1)
        width = draft.info()["n_target_features"]
        cache = _core.CrossContext(draft, 32)
        cache.append(np.ones((4, width), dtype=np.float32), np.arange(4, dtype=np.int32))
        refused(draft.close, RuntimeError, "cannot close the draft while 1 CrossContext/Engine")
        logits, tokens = cache.step(1, 4)
        assert logits.shape[0] == 8 and len(tokens) == 7
        del cache
        draft.close()
        refused(draft.info, RuntimeError, "draft is closed")
    """)


def test_one_capture_per_context(pair):
    """Before: a second engine chained its capture behind the first; freeing the first then
    reinstalled a freed capture as the context's callback (use after free at the next decode)."""
    run(pair, """
        draft = _core.Draft(model, draft_path, n_threads=1)
        first = _core.Engine(model, draft, 64)
        expected = first.generate(prompt, 12, 4)[0]
        refused(lambda: _core.Engine(model, draft, 64), ValueError, "already has a DFlash capture")
        refused(lambda: _core.training.layer_features(model, prompt, [0]), ValueError, "already has a DFlash capture")
        assert first.generate(prompt, 12, 4)[0] == expected
        first.close()
        second = _core.Engine(model, draft, 64)
        assert second.generate(prompt, 12, 4)[0] == expected
        second.close()
        features, greedy = _core.training.layer_features(model, prompt, [0])
        assert features.shape[0] == len(prompt)
        # a capture that failed to install left nothing behind: plain decoding still works
        refused(lambda: _core.training.layer_features(model, prompt, [99]), ValueError, "target layer id 99")
        assert model.generate_greedy(prompt, 12, False) == expected
    """)


def test_threads_sharing_a_model_take_turns(pair):
    """Calls release the GIL: before, two threads decoded in one context at once and corrupted
    it. Each result must equal the same call made alone."""
    out = run(pair, """
        draft = _core.Draft(model, draft_path, n_threads=1)
        engine = _core.Engine(model, draft, 64)
        width = draft.info()["n_target_features"]
        features = np.random.default_rng(0).standard_normal((6, width)).astype(np.float32)
        positions = np.arange(6, dtype=np.int32)
        calls = {
            "speculate": lambda: engine.generate(prompt, 16, 4)[0],
            "greedy": lambda: model.generate_greedy(prompt, 16, False),
            "draft": lambda: draft.forward(features, positions, 1, 6)[1],
        }
        alone = {name: call() for name, call in calls.items()}
        results, errors = [], []

        def worker(name):
            try:
                for _ in range(5):
                    results.append((name, calls[name]()))
            except BaseException as e:  # noqa: B036 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(name,)) for name in calls for _ in range(2)]
        for t in threads:
            t.start()
        refused(model.close, RuntimeError, "use it")  # while the threads run
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(results) == 30 and all(value == alone[name] for name, value in results)
        print("ok", len(results))
    """)
    assert out.strip() == "ok 30"


def test_a_commit_callback_cannot_reenter_its_model_and_its_errors_propagate(pair):
    """The callback runs while the generation holds the model: a call back into the model would
    deadlock on its lock (or, without one, clear the KV cache mid-generation)."""
    run(pair, """
        draft = _core.Draft(model, draft_path, n_threads=1)
        engine = _core.Engine(model, draft, 64)
        expected = engine.generate(prompt, 12, 4)[0]
        refused(lambda: engine.generate(prompt, 12, 4, on_commit=lambda t: model.generate_greedy(prompt, 2, False)),
                RuntimeError, "cannot use the model from a callback of its own generation")
        refused(lambda: engine.generate(prompt, 12, 4, on_commit=lambda t: model.close()),
                RuntimeError, "cannot close the model from a callback")

        def boom(tokens):
            raise KeyError("from the callback")
        refused(lambda: engine.generate(prompt, 12, 4, on_commit=boom), KeyError, "from the callback")
        seen = []
        tokens, stats, _ = engine.generate(prompt, 12, 4, on_commit=lambda t: seen.extend(t) or len(seen) < 5)
        assert stats["end_reason"] == "caller" and tokens == seen == expected[:len(seen)] and len(seen) >= 5
        assert engine.generate(prompt, 12, 4)[0] == expected
    """)

"""Scale-out on ggml's RPC backend: two `ikdflash rpc-worker`s on loopback hold the target's
layers, llama-server (--rpc) runs DFlash over them, and its replies are the target alone's."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ikdflash import Server
from ikdflash.cli import main
from ikdflash.serving.client import post_json
from ikdflash.serving.server import free_port, port_in_use
from ikdflash.serving.spectype import SpecType

PROMPTS = ["the quick brown fox jumps over the lazy dog", "once upon a time there was a little server"]


@contextlib.contextmanager
def rpc_worker(port: int, log: Path):
    with open(log, "w") as output:
        worker = subprocess.Popen([sys.executable, "-m", "ikdflash.cli", "rpc-worker", "--port", str(port),
                                   "--threads", "1"], stdout=output, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not port_in_use("127.0.0.1", port):
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            yield worker
        finally:
            worker.terminate()
            worker.wait(timeout=15)


def completions(url: str) -> list[str]:
    return [post_json(url + "/completion", {"prompt": p, "n_predict": 24, "temperature": 0, "ignore_eos": True})
            ["content"] for p in PROMPTS]


def test_dflash_over_two_rpc_workers_keeps_the_targets_replies(swa_pairs, tmp_path):
    target, draft = swa_pairs["llama"]
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "alone.log") as url:
        expected = completions(url)
    ports = [free_port(), free_port()]
    with rpc_worker(ports[0], tmp_path / "w0.log") as first, rpc_worker(ports[1], tmp_path / "w1.log") as second:
        workers = ",".join(f"127.0.0.1:{p}" for p in ports)
        # 4 layers on the workers; the output layer (the head the draft borrows) stays here
        args = ["--rpc", workers, "-ngl", "4", "--model-draft", str(draft), "--spec-type", SpecType(n_max=4).flag()]
        with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "rpc.log", extra_args=args) as url:
            replies = completions(url)
        assert first.poll() is None and second.poll() is None
    log = (tmp_path / "rpc.log").read_text()
    assert all(re.search(rf"RPC\d+\[127\.0\.0\.1:{p}\]", log) for p in ports), "the layers did not go to both workers"
    assert replies == expected


def test_rpc_misuse_is_refused(swa_pairs, tmp_path, capsys):
    target, draft = swa_pairs["llama"]
    nobody = free_port()
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--rpc", f"127.0.0.1:{nobody}",
                 "--dry-run"]) == 2
    assert "no RPC worker listens there" in capsys.readouterr().err
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--rpc", "nohost", "--dry-run"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
    port = free_port()
    with rpc_worker(port, tmp_path / "w.log"):
        assert main(["rpc-worker", "--port", str(port)]) == 2
        assert "already in use" in capsys.readouterr().err
        # a worker serving one client, its accept queue full (Linux holds backlog + 1), answers no
        # new connection: it is still found. The clients connect without waiting: however many the
        # queue takes, the others' handshakes stay pending
        with contextlib.ExitStack() as clients:
            for _ in range(4):
                client = clients.enter_context(socket.socket())
                client.setblocking(False)
                client.connect_ex(("127.0.0.1", port))
            assert main(["rpc-worker", "--port", str(port)]) == 2
            assert "already in use" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--port", "0"], ["--threads", "0"]])
def test_rpc_worker_bad_values(argv, capsys):
    assert main(["rpc-worker", *argv]) == 2
    assert "error:" in capsys.readouterr().err

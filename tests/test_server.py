"""The packaged llama-server, started for real on 127.0.0.1, agrees with _core token for token."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ikdflash import Model, Server, ServerError, complete
from ikdflash.serving.server import absolute_paths, port_in_use

PROMPT = "once upon a time there was a little server that could"


@pytest.mark.parametrize("arch", ["llama", "qwen35moe"])
def test_server_greedy_matches_core(tiny_model, tmp_path, arch):
    path = tiny_model(arch)
    with Model(path, n_ctx=512) as model:
        prompt = model.tokenize(PROMPT, add_special=False)
        expected = model.generate(prompt, max_tokens=32, stop_at_eog=False).tokens
        expected_pieces = [model.detokenize([t]).decode("utf-8", errors="replace") for t in expected]

    with Server(path, ctx_size=512, n_threads=2, log_file=tmp_path / "server.log") as url:
        reply = complete(url, prompt, max_tokens=32, temperature=0.0, pieces=True, ignore_eos=True)
    assert reply.raw["tokens_predicted"] == len(expected)
    assert reply.pieces == expected_pieces
    assert reply.text == "".join(expected_pieces)


def test_server_stops_and_is_reaped(tiny_model):
    server = Server(tiny_model("llama"), ctx_size=256, n_threads=1)
    server.start()
    pid = server.process.pid
    assert server.stop() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_port_in_use_is_refused(tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            Server(tiny_model("llama"), port=port).start()


def test_a_port_is_in_use_while_a_server_listens_and_free_after_it_stops(tiny_model):
    """llama-server binds with SO_REUSEPORT: a second server on a listened port would bind too and
    share it, so a listener must count as in use. Before, the port also counted as in use for a
    minute after the server stopped (its connections in TIME_WAIT), though a new server binds it."""
    first = Server(tiny_model("llama"), ctx_size=256, n_threads=1)
    with first as url:
        complete(url, "hello", max_tokens=2)
        with pytest.raises(ServerError, match=f"port {first.port} on 127.0.0.1 is already in use"):
            Server(tiny_model("llama"), port=first.port).start()
    assert not port_in_use("127.0.0.1", first.port)
    with Server(tiny_model("llama"), ctx_size=256, n_threads=1, port=first.port) as url:
        assert complete(url, "hello", max_tokens=2).raw["tokens_predicted"] == 2


def test_a_port_held_without_a_listener_is_reported_as_in_use(tiny_model, tmp_path):
    """Only a listener that answers is refused before the start (port_in_use); a port bound and
    not listening fails llama-server's own bind, and that is reported as the busy port."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        assert not port_in_use("127.0.0.1", port)
        with pytest.raises(ServerError, match=f"^port {port} on 127.0.0.1 is already in use; pick another"):
            Server(tiny_model("llama"), port=port, ctx_size=256, n_threads=1, log_file=tmp_path / "s.log").start()


def test_a_host_that_is_not_this_machines_is_not_a_busy_port(tiny_model):
    """Before, the trial bind's failure on an address of another machine read "port ... is
    already in use". 192.0.2.1 is reserved for documentation (RFC 5737)."""
    assert not port_in_use("192.0.2.1", 8080)
    with pytest.raises(ServerError, match="could not listen on 192.0.2.1:8080: Cannot assign requested address"):
        Server(tiny_model("llama"), host="192.0.2.1", port=8080, ctx_size=256, n_threads=1).start()


def test_server_dying_on_start_is_reported(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ServerError, match="exited with code 1 during start-up"):
        Server(broken, log_file=tmp_path / "server.log").start()


def test_only_path_flags_are_made_absolute(tmp_path, monkeypatch):
    """The server runs in another folder, so relative paths given to path flags become absolute;
    before, any value naming a file here was rewritten, an --alias included."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").write_text("")
    (tmp_path / "d.gguf").write_text("")
    args = ["--alias", "model", "--model-draft", "d.gguf", "--slot-save-path", "slots", "--lora-scaled", "a.gguf",
            "0.5", "--chat-template-file=t.jinja", "--spec-type", "dflash"]
    assert absolute_paths(args) == ["--alias", "model", "--model-draft", str(tmp_path / "d.gguf"), "--slot-save-path",
                                    str(tmp_path / "slots"), "--lora-scaled", str(tmp_path / "a.gguf"), "0.5",
                                    f"--chat-template-file={tmp_path / 't.jinja'}", "--spec-type", "dflash"]


ORPHAN = """
import sys, time
from ikdflash import Server
server = Server(sys.argv[1], ctx_size=256, n_threads=1)
server.start()
print(server.process.pid, server.port, flush=True)
time.sleep(600)
"""


def test_the_server_ends_when_its_python_parent_is_killed(tiny_model):
    """SIGKILL (or the OOM killer) gives Python no chance to stop its llama-server: before, the
    server lived on, holding the port. Now it gets SIGTERM when its parent dies."""
    for _ in range(3):
        parent = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tiny_model("llama"))], stdout=subprocess.PIPE,
                                  text=True)
        pid, port = map(int, parent.stdout.readline().split())
        parent.kill()
        parent.wait()
        parent.stdout.close()
        deadline = time.monotonic() + 15
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), "llama-server outlived its parent"
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, "something still listens on the port"


def test_an_api_key_never_reaches_the_command_line(tiny_model, tmp_path, monkeypatch):
    """Before: `--api-key K` sat in /proc/PID/cmdline, readable by every user, and the client
    could not send a key at all."""
    monkeypatch.delenv("IKDFLASH_API_KEY", raising=False)
    server = Server(tiny_model("llama"), ctx_size=256, n_threads=1, api_key="first-key-0123",
                    extra_args=["--api-key", "second-key-4567"])
    with server as url:
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
        assert "key-0123" not in cmdline and "key-4567" not in cmdline and "--api-key-file" in cmdline
        key_file = cmdline.split("\0")[cmdline.split("\0").index("--api-key-file") + 1]
        assert not os.path.exists(key_file)  # removed once the server had read it
        with pytest.raises(ServerError, match="HTTP 401"):
            complete(url, "hello", max_tokens=2)
        for key in ("first-key-0123", "second-key-4567"):
            assert complete(url, "hello", max_tokens=2, api_key=key).raw["tokens_predicted"] == 2
        monkeypatch.setenv("IKDFLASH_API_KEY", "first-key-0123")
        assert complete(url, "hello", max_tokens=2).raw["tokens_predicted"] == 2
    with pytest.raises(ValueError, match="one non-blank line"):
        Server(tiny_model("llama"), api_key="two\nlines")


def test_a_prompt_of_only_bos_is_not_a_warm_up(tiny_model, tmp_path):
    """The base ran the first single-token pass of BOS after its warm-up as one more warm-up,
    with every expert of a MoE model (patch `llama-a-warm-up-pass-only-when-asked-llama_set_warmu`): the first such request got
    other logits."""
    from ikdflash.serving.client import post_json
    target = tiny_model("qwen35moe")
    with Model(target, n_ctx=64) as model:
        bos = int(model.metadata("tokenizer.ggml.bos_token_id"))
    body = {"prompt": [bos], "n_predict": 1, "n_probs": 3, "temperature": 0, "cache_prompt": False}
    with Server(target, ctx_size=256, n_threads=2, log_file=tmp_path / "s.log") as url:
        first, again = (post_json(url + "/completion", body)["completion_probabilities"][0]["probs"] for _ in range(2))
    assert first == again


def server_environ(server: Server) -> dict[str, str]:
    assert server.process is not None
    raw = Path(f"/proc/{server.process.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_the_server_waits_for_its_openmp_threads_briefly_unless_told_otherwise(tiny_model, monkeypatch):
    # llama-server's OpenMP threads spin 1,000 times at a barrier before they sleep (libgomp's
    # default, 300,000, stalled a server beside a busy process); a caller's own setting wins
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    path = tiny_model("llama")
    for env, want in [({}, "1000"), ({"GOMP_SPINCOUNT": "50"}, "50"), ({"OMP_WAIT_POLICY": "passive"}, None)]:
        server = Server(path, ctx_size=256, n_threads=2, env=env)
        with server:
            assert server_environ(server).get("GOMP_SPINCOUNT") == want
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    server = Server(path, ctx_size=256, n_threads=2)
    with server:
        assert "GOMP_SPINCOUNT" not in server_environ(server)
    assert server.environment_changes() == {}

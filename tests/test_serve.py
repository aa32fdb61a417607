"""`ikdflash serve`: the real llama-server started, used, stopped with SIGTERM and reaped;
every refusal with its message; the --spec-type grammar shared with the fork."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ikdflash import Server, ServerError
from ikdflash.serving.client import post_json
from ikdflash.serving.server import free_port
from ikdflash.serving.spectype import SpecType, SpecTypeError
from fixtures.gguf_edit import rewrite

SWA = dict(layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=8, block_size=16)


@pytest.fixture(scope="module")
def pair(tiny_model, tiny_draft):
    target = tiny_model("llama")
    return target, tiny_draft(target, target_layer_ids=[0, 2], seed=5, **SWA)


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ikdflash.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def children(pid: int) -> list[int]:
    """Processes whose parent is pid, from /proc (the 4th field of stat, after the command's
    parenthesised name)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_end_to_end_and_sigterm_leaves_no_orphan(pair, tmp_path):
    target, draft = pair
    proc = subprocess.Popen([sys.executable, "-m", "ikdflash.cli", "serve", "--target", str(target), "--draft",
                             str(draft), "-c", "1024", "--port", "0", "--log-file", str(tmp_path / "server.log")],
                            stderr=subprocess.PIPE, text=True)
    url = None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "ready at " in line:
            url = line.split("ready at ")[1].split()[0]
            break
    assert url, "".join(lines)
    assert any("command: " in line and "--spec-type dflash:n_max=4" in line for line in lines)
    reply = post_json(url + "/completion", {"prompt": "the cat sat on the mat", "n_predict": 16, "temperature": 0})
    assert reply["timings"]["draft_n"] > 0
    servers = children(proc.pid)
    assert servers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0  # serve reaps its server (Server.stop waits) before it exits
    proc.stderr.close()
    for pid in servers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_dry_run_prints_the_command(pair):
    target, draft = pair
    out = serve("--target", str(target), "--draft", str(draft), "--n-max", "6", "--cross-ctx", "512", "-c", "2048",
                "--gpu-layers", "99", "--gpu-layers-draft", "0", "--dry-run", "--", "--metrics")
    assert out.returncode == 0, out.stderr
    assert "--spec-type dflash:n_max=6,cross_ctx=512" in out.stdout
    assert "-c 2048" in out.stdout and "-ngl 99 -ngld 0" in out.stdout and out.stdout.strip().endswith("--metrics")
    # the environment the server would get over ours comes first, as a shell takes it
    assert out.stdout.startswith("GOMP_SPINCOUNT=1000 ") or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ)
    fixed = serve("--target", str(target), "--draft", str(draft), "--no-adaptive", "--dry-run")
    assert fixed.returncode == 0 and "--spec-type dflash:n_max=4,adaptive=0" in fixed.stdout
    assert "-rtr" not in fixed.stdout.split()  # F32 weights: nothing repacked by default (repack_by_default)
    repacked = serve("--target", str(target), "--draft", str(draft), "--repack", "--dry-run")
    assert repacked.returncode == 0 and "-rtr" in repacked.stdout.split()
    invariant = serve("--target", str(target), "--draft", str(draft), "--parallel", "4", "--batch-invariant",
                      "--dry-run")
    assert invariant.returncode == 0 and "--parallel 4 --batch-invariant" in invariant.stdout


def test_warns_when_the_window_cannot_engage(tiny_model, tiny_draft):
    target = tiny_model("llama")
    draft = tiny_draft(target, target_layer_ids=[0, 2], layer_types=["sliding_attention", "full_attention"],
                       sliding_window=64, block_size=16)
    out = serve("--target", str(target), "--draft", str(draft), "--cross-ctx", "32", "--dry-run")
    assert out.returncode == 0
    assert "warning: cross_ctx 32 <= window 64 - block 16: the sliding window can never engage" in out.stderr


def test_port_in_use(pair):
    target, draft = pair
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = serve("--target", str(target), "--draft", str(draft), "-c", "1024", "--port", str(port))
    assert out.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr


def test_a_port_a_server_just_left_is_usable(pair, tmp_path):
    """serve, stopped with a client's keep-alive connection still open (the port's connections
    left closing and in TIME_WAIT), then serve again on the same port at once: it starts."""
    import http.client
    target, draft = pair
    port = free_port()
    command = [sys.executable, "-m", "ikdflash.cli", "serve", "--target", str(target), "--draft", str(draft),
               "-c", "512", "--port", str(port), "--log-file", str(tmp_path / "s.log")]
    for _ in range(2):
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            while "ready at" not in (line := process.stderr.readline()):
                lines.append(line)
                assert line, "serve did not start: " + "".join(lines)
            client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            client.request("GET", "/health")
            assert client.getresponse().read()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            client.close()
        finally:
            process.kill()
            process.wait()
            process.stderr.close()


def test_server_dying_on_start(pair, tmp_path):
    target, draft = pair
    out = serve("--target", str(target), "--draft", str(draft), "-c", "1024", "--port", "0",
                "--log-file", str(tmp_path / "s.log"), "--", "--no-such-flag")
    assert out.returncode == 1
    assert "exited with code" in out.stderr


def test_missing_and_wrong_files(pair, tmp_path):
    target, draft = pair
    out = serve("--target", str(tmp_path / "none.gguf"), "--draft", str(draft))
    assert out.returncode == 2 and "target" in out.stderr and "file not found" in out.stderr
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    out = serve("--target", str(target), "--draft", str(tmp_path / "junk.gguf"))
    assert out.returncode == 2 and "not a GGUF file" in out.stderr
    out = serve("--target", str(draft), "--draft", str(target))
    assert out.returncode == 2 and "is not a DFlash draft" in out.stderr


def test_mismatched_pair(pair, tmp_path):
    target, draft = pair
    bad = rewrite(draft, tmp_path / "bad.gguf", fields={"dflash-draft.dflash.target_layer_ids": [0, 3]})
    out = serve("--target", str(target), "--draft", str(bad), "--dry-run")
    assert out.returncode == 2
    assert "target layer id 3 is the target's last layer" in out.stderr


def test_spec_type_grammar_round_trip():
    spec = SpecType(n_max=4, cross_ctx=8192)
    assert spec.flag() == "dflash:n_max=4,cross_ctx=8192"
    assert SpecType.parse(spec.flag()) == spec
    assert SpecType.parse("dflash:dflash_cross_ctx=64,full_attention=1") == SpecType(cross_ctx=64, full_attention=True)
    assert SpecType().flag() == "dflash"
    with pytest.raises(SpecTypeError, match="unknown key 'colour'"):
        SpecType.parse("dflash:colour=red")
    with pytest.raises(SpecTypeError, match="p_min must be a number in"):
        SpecType(p_min=2.0)
    assert SpecType.parse("dflash:min_accept=0.25") == SpecType(min_accept=0.25)
    assert SpecType.parse("dflash:adaptive=0") == SpecType(adaptive=False)
    assert SpecType(n_max=4, adaptive=False).flag() == "dflash:n_max=4,adaptive=0"
    with pytest.raises(SpecTypeError, match="adaptive must be 0 or 1, got '2'"):
        SpecType.parse("dflash:adaptive=2")
    with pytest.raises(SpecTypeError, match="min_accept must be a number in"):
        SpecType(min_accept=-0.5)
    with pytest.raises(SpecTypeError, match="n_max must be at most 2147483647, got 2147483648"):
        SpecType.parse("dflash:n_max=2147483648")  # it wrapped to -2^31
    with pytest.raises(SpecTypeError, match="cross_ctx must be at most 2147483647, got 4294967296"):
        SpecType(cross_ctx=2**32)  # it wrapped to 0: the slot's context


def test_spec_type_names_are_the_servers():
    """The type's name is read by the fork's parser too (dflash_parse_spec_type), as llama-server reads it."""
    for name in ("dflash", "draft-dflash", "dspark", "draft-dspark"):
        assert SpecType.parse(f"{name}:n_max=3") == SpecType(n_max=3)
    for text in ("ngram-map-k", "dflashy:n_max=3", "lookup:n_max=3"):  # the last: no draft, not built here
        with pytest.raises(SpecTypeError, match="only 'dflash"):
            SpecType.parse(text)
    with pytest.raises(SpecTypeError, match="the lookup alone needs lookup=1 and adaptive=1"):
        SpecType.parse("lookup:adaptive=0")


def test_doctor_checks_a_pair(pair, tmp_path):
    target, draft = pair
    ok = subprocess.run(["ikdflash", "doctor", "--target", str(target), "--draft", str(draft)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    assert "pair            dflash-draft draft, block 16, window 8 on 2 layers, target layers [0, 2] of 4" in ok.stdout
    bad = rewrite(draft, tmp_path / "bad.gguf", fields={"dflash-draft.dflash.mask_token_id": 9999})
    out = subprocess.run(["ikdflash", "doctor", "--target", str(target), "--draft", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "problem: pair: mask token 9999 is outside the vocabulary (320 tokens)" in out.stdout


def test_bench_writes_a_complete_table(pair, tmp_path):
    import csv
    import json
    target, draft = pair
    out = subprocess.run(["ikdflash", "bench", "--target", str(target), "--draft", str(draft), "--lengths", "16", "64",
                          "--max-tokens", "24", "--csv", str(tmp_path / "b.csv"), "--json", str(tmp_path / "b.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "window 8" in out.stdout and "speed-up" in out.stdout
    with open(tmp_path / "b.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["length"]) for r in rows] == [16, 64]
    assert float(rows[1]["clip"]) == pytest.approx((64 - 8) / 64)
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["window"] == 8 and len(data["rows"]) == 2
    for r in data["rows"]:
        assert 0.0 <= r["sliding_acceptance"] <= 1.0 and r["no_draft_tps"] > 0 and r["sliding_tau"] >= 1.0
        assert r["sliding_spread"] == 0.0  # one round
        assert r["adaptive_tps"] > 0 and 0.0 <= r["adaptive_plain_share"] <= 1.0
        assert r["adaptive_speedup"] == pytest.approx(r["adaptive_tps"] / r["no_draft_tps"])
    assert "8/8" in out.stderr  # the progress bar reached the end: 4 modes x 2 lengths
    where = data["provenance"]  # the package's own build, outside any checkout
    assert where["commit"].startswith("ikdflash ") and len(where["patch_series"]) == 16
    assert "CPU" in where["backends"] and where["cpu"] and where["threads"] >= 1


def test_bench_repeats_and_checks_every_output(pair, tmp_path, monkeypatch, capsys):
    from ikdflash.cli import bench
    from ikdflash.cli import main
    from ikdflash.engine import Engine
    target, draft = pair
    argv = ["bench", "--target", str(target), "--draft", str(draft), "--lengths", "16", "--max-tokens", "12",
            "--repeat", "3", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "tok/s: the median of 3 rounds ± half their range" in out.out and "not lossless" not in out.err
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert row["sliding_spread"] >= 0 and 0 < row["steps"] <= 3 * 11  # 3 rounds of at most 11 verification steps

    # an engine that keeps a token the target did not choose must fail the bench, saying where
    speculate, generate = Engine.speculate, Engine.generate

    def lossy(self, prompt, **options):
        out = speculate(self, prompt, **options)
        out.tokens[5] = (out.tokens[5] + 1) % 256
        return out

    monkeypatch.setattr(Engine, "speculate", lossy)
    assert bench.run(bench_args(argv[1:-2])) == 1
    err = capsys.readouterr().err
    assert "not lossless: the sliding output for prompt 1 of length 16 kept a token at 5 that was not the " \
           "target's top choice there" in err
    assert "the full attention output for prompt 1 of length 16 kept a token at 5" in err

    # one that turns from the target alone's while keeping the target's choices is noted, not failed
    def turned(self, prompt, **options):
        out = generate(self, prompt, **options)
        out.tokens[3] = (out.tokens[3] + 1) % 256
        return out

    monkeypatch.setattr(Engine, "speculate", speculate)
    monkeypatch.setattr(Engine, "generate", turned)
    assert bench.run(bench_args(argv[1:-2])) == 0
    err = capsys.readouterr().err
    assert "note: the sliding output for prompt 1 of length 16 turns from the target alone's at token 3" in err


def test_bench_runs_the_target_alone_beside_the_draft(pair, monkeypatch):
    """The speed-ups' two sides take turns request by request (the machine's drift cancels); the
    every-layer-full draft runs after them."""
    from ikdflash.cli import bench
    from ikdflash.engine import Engine
    target, draft = pair
    init, speculate, generate = Engine.__init__, Engine.speculate, Engine.generate
    order = []

    def recording_init(self, *args, full_attention=False, **kwargs):
        self.full = full_attention
        init(self, *args, full_attention=full_attention, **kwargs)

    def recording_speculate(self, prompt, **options):
        order.append("full" if self.full else "adaptive" if options["adaptive"] else "fixed")
        return speculate(self, prompt, **options)

    def recording_generate(self, prompt, **options):
        order.append("alone")
        return generate(self, prompt, **options)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    monkeypatch.setattr(Engine, "speculate", recording_speculate)
    monkeypatch.setattr(Engine, "generate", recording_generate)
    assert bench.run(bench_args(["--target", str(target), "--draft", str(draft), "--lengths", "16", "--prompts", "2",
                                 "--max-tokens", "4"])) == 0
    assert order == ["fixed", "adaptive", "alone"] * 2 + ["full"] * 2


def bench_args(argv: list[str]):
    import argparse
    from ikdflash.cli import bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_measures_a_running_server(pair, tmp_path):
    target, draft = pair
    args = ["--model-draft", str(draft), "--spec-type", "dflash:n_max=4"]
    with Server(target, ctx_size=512, n_threads=2, log_file=tmp_path / "s.log", extra_args=args) as url:
        out = subprocess.run(["ikdflash", "bench", "--server", url, "--lengths", "16", "32", "--max-tokens", "8",
                              "--repeat", "2", "--json", str(tmp_path / "s.json")],
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"server {url}" in out.stdout
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["length"] for r in rows] == [16, 32]
    assert all(r["generated"] == 2 * 8 and r["drafted"] > 0 and r["tps"] > 0 for r in rows)
    refused = subprocess.run(["ikdflash", "bench", "--server", url, "--lengths", "16"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and f"ikdflash bench: error: {url}" in refused.stderr


@pytest.fixture
def hub_cache(pair, tmp_path, monkeypatch):
    """A Hugging Face cache prepared on disk (layout: models--owner--repo/{refs,snapshots}), with
    the hub offline: what a machine without network sees after an earlier download."""
    import json
    import shutil
    target, draft = pair
    cache = tmp_path / "hub"
    repos = {"tiny/target-GGUF": {"mmproj-target-Q8_0.gguf": draft, "target-F32.gguf": target,
                                  "target-Q8_0.gguf": target},
             "tiny/draft": {"draft-SWA-F32.gguf": draft},
             # quants that share words, shards, a draft and a projector beside the target
             "tiny/many-GGUF": {"m-Q4_K_M.gguf": target, "m-UD-Q4_K_M.gguf": target,
                                "m-Q8_0-00001-of-00002.gguf": target, "m-Q8_0-00002-of-00002.gguf": target,
                                "m-DFlash-draft-Q6_K.gguf": draft, "mmproj-m-Q6_K.gguf": draft,
                                "m-Q6_K.gguf": target},
             # the built-in pair's repositories, as their pages list them, holding the tiny models
             "unsloth/Qwen3.5-35B-A3B-GGUF": {"Qwen3.5-35B-A3B-Q4_K_M.gguf": target},
             "ji-farthing/Qwen3.5-35B-A3B-DFlash-SWA-ik-llama-GGUF": {
                 "Qwen3.5-35B-A3B-DFlash-SWA-ik_llama-Q8_0.gguf": draft}}
    for repo, files in repos.items():
        folder = cache / ("models--" + repo.replace("/", "--"))
        commit = "0123456789abcdef0123456789abcdef01234567"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(commit)
        snapshot = folder / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name, source in files.items():
            shutil.copyfile(source, snapshot / name)
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"tiny-pair": {"target": "tiny/target-GGUF:F32",
                                                  "draft": "tiny/draft/draft-SWA-F32.gguf"},
                                    "swapped-pair": {"target": "tiny/draft/draft-SWA-F32.gguf",
                                                     "draft": "tiny/target-GGUF:F32"}}))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("IKDFLASH_REGISTRY", str(registry))
    return cache


def test_download_from_the_cache_offline(hub_cache):
    out = subprocess.run(["ikdflash", "download", "tiny/target-GGUF:Q8_0", "tiny/draft/draft-SWA-F32.gguf",
                          "tiny-pair"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert lines["tiny/target-GGUF:Q8_0"].endswith("/target-Q8_0.gguf")  # not the projector
    assert lines["tiny-pair target"].endswith("target-F32.gguf")
    assert lines["tiny-pair draft"].endswith("draft-SWA-F32.gguf")
    assert all(os.path.isfile(p) for p in lines.values())


def test_download_errors_offline(hub_cache):
    out = subprocess.run(["ikdflash", "download", "tiny/draft/missing.gguf"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "not in the local Hugging Face cache, and offline" in out.stderr
    out = subprocess.run(["ikdflash", "download", "no-such-pair"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "known pairs: qwen3.5-35b-a3b-swa, smollm2-135m-swa, swapped-pair, tiny-pair" in out.stderr
    out = subprocess.run(["ikdflash", "download", "swapped-pair"], capture_output=True, text=True)
    assert out.returncode == 1
    assert "swapped-pair: " in out.stderr and "not a DFlash draft" in out.stderr


def download(*refs):
    return subprocess.run(["ikdflash", "download", *refs], capture_output=True, text=True)


@pytest.mark.parametrize("ref, expected", [
    ("tiny/many-GGUF:UD-Q4_K_M", "m-UD-Q4_K_M.gguf"),
    ("tiny/many-GGUF:q8_0", "m-Q8_0-00001-of-00002.gguf"),      # the first shard
])
def test_a_quant_names_exactly_one_model(hub_cache, ref, expected):
    out = download(ref)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("/" + expected)


@pytest.mark.parametrize("ref, message", [
    # before, these picked whichever file sorted first
    ("tiny/many-GGUF:Q4_K_M", "quant Q4_K_M matches 2 models (m-Q4_K_M.gguf, m-UD-Q4_K_M.gguf)"),
    ("tiny/many-GGUF:Q6_K", "quant Q6_K matches 2 models (m-DFlash-draft-Q6_K.gguf, m-Q6_K.gguf)"),
    ("tiny/many-GGUF:Q4", "no GGUF for quant Q4 (the repository has: m-DFlash-draft-Q6_K.gguf, m-Q4_K_M.gguf"),
    ("tiny/many-GGUF:Q8_0@../../etc", "revision '../../etc' is not a branch, tag or commit name"),
])
def test_an_ambiguous_or_unknown_quant_says_what_the_repository_has(hub_cache, ref, message):
    out = download(ref)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_target_quant_skips_drafts_and_projectors(hub_cache):
    out = serve("--target", "tiny/many-GGUF:Q6_K", "--draft", "tiny/draft/draft-SWA-F32.gguf", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "/m-Q6_K.gguf" in out.stdout and "m-DFlash-draft-Q6_K" not in out.stdout


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "expected a JSON object"),
    ('{"p": {"target": "a.gguf"}}', "entry 'p' must be {\"target\": REF, \"draft\": REF}"),
    ('{"p": "a.gguf"}', "entry 'p' must be"),
    ('{"smollm2-135m-swa": {"target": "a.gguf", "draft": "b.gguf"}}', "'smollm2-135m-swa' is a built-in pair"),
    ("{", "cannot read it"),
])
def test_a_bad_registry_is_refused_with_its_reason(hub_cache, tmp_path, monkeypatch, content, message):
    """Before: a traceback (a list or a string entry), or a built-in silently replaced."""
    registry = tmp_path / "bad-registry.json"
    registry.write_text(content)
    monkeypatch.setenv("IKDFLASH_REGISTRY", str(registry))
    out = download("tiny-pair")
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_models_lists_the_pairs_and_what_is_local(hub_cache, monkeypatch):
    import json
    out = subprocess.run(["ikdflash", "models", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pairs = {p["name"]: p for p in json.loads(out.stdout)}
    assert pairs["tiny-pair"]["check"] == "ok" and pairs["tiny-pair"]["target"]["quant"] == "F32"
    assert pairs["tiny-pair"]["draft"]["path"].endswith("draft-SWA-F32.gguf")
    assert "not a DFlash draft" in pairs["swapped-pair"]["check"]
    assert pairs["smollm2-135m-swa"]["default"]
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache.parent / "empty"))
    text = subprocess.run(["ikdflash", "models"], capture_output=True, text=True, timeout=120).stdout
    assert "not on this machine (ikdflash download tiny-pair)" in text


def test_an_engine_from_hub_references(hub_cache):
    code = """
import os
from ikdflash import Engine
with Engine.from_pretrained("tiny/target-GGUF:F32", draft="tiny/draft/draft-SWA-F32.gguf", n_ctx=256) as e:
    print(os.path.basename(e.target.path), e.draft_device, len(e.speculate("the river", max_tokens=4).tokens))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["target-F32.gguf", "CPU", "4"]


def test_the_built_in_pair_resolves_and_is_checked(hub_cache, monkeypatch):
    out = subprocess.run(["ikdflash", "download", "qwen3.5-35b-a3b-swa"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert lines["qwen3.5-35b-a3b-swa target"].endswith("/Qwen3.5-35B-A3B-Q4_K_M.gguf")
    assert lines["qwen3.5-35b-a3b-swa draft"].endswith("/Qwen3.5-35B-A3B-DFlash-SWA-ik_llama-Q8_0.gguf")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache.parent / "empty"))
    out = subprocess.run(["ikdflash", "download", "qwen3.5-35b-a3b-swa"], capture_output=True, text=True)
    assert out.returncode == 2
    assert ("unsloth/Qwen3.5-35B-A3B-GGUF/Qwen3.5-35B-A3B-Q4_K_M.gguf: not in the local Hugging Face cache, "
            "and offline") in out.stderr


def test_serve_takes_hub_references(hub_cache):
    out = serve("--target", "tiny/target-GGUF:F32", "--draft", "tiny/draft/draft-SWA-F32.gguf", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert str(hub_cache) in out.stdout and "draft-SWA-F32.gguf" in out.stdout
    out = serve("--pair", "tiny-pair", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "target-F32.gguf" in out.stdout and "--model-draft" in out.stdout
    assert "--pair names both models" in serve("--pair", "tiny-pair", "--target", "x.gguf", "--dry-run").stderr
    assert "give --target and --draft together, or --pair" in serve("--target", "x.gguf", "--dry-run").stderr


def test_bench_takes_a_pair(hub_cache):
    out = subprocess.run(["ikdflash", "bench", "--pair", "tiny-pair", "--lengths", "16", "--max-tokens", "4",
                          "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "window 8" in out.stdout
    out = subprocess.run(["ikdflash", "bench", "--draft", "d.gguf", "--lengths", "16"], capture_output=True, text=True)
    assert out.returncode == 2 and "give --target and --draft together, or --pair" in out.stderr


def test_serve_keeps_the_api_key_off_the_command_line(pair, tmp_path, monkeypatch):
    target, draft = pair
    monkeypatch.setenv("IKDFLASH_API_KEY", "env-key-0123")
    out = serve("--target", str(target), "--draft", str(draft), "--host", "0.0.0.0", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "env-key-0123" not in out.stdout + out.stderr and "--api-key-file" in out.stdout
    assert "without an API key" not in out.stderr
    monkeypatch.delenv("IKDFLASH_API_KEY")
    out = serve("--target", str(target), "--draft", str(draft), "--host", "0.0.0.0", "--dry-run")
    assert "warning: serving on 0.0.0.0 without an API key" in out.stderr
    keys = tmp_path / "keys"
    keys.write_text("file-key-4567\n")
    out = serve("--target", str(target), "--draft", str(draft), "--host", "0.0.0.0", "--api-key-file", str(keys),
                "--dry-run")
    assert out.returncode == 0 and "without an API key" not in out.stderr
    assert f"--api-key-file {keys}" in out.stdout and "file-key-4567" not in out.stdout
    keys.write_text("\n")
    out = serve("--target", str(target), "--draft", str(draft), "--api-key-file", str(keys), "--dry-run")
    assert out.returncode == 2 and "the file holds no key" in out.stderr
    out = serve("--target", str(target), "--draft", str(draft), "--api-key-file", str(tmp_path / "none"), "--dry-run")
    assert out.returncode == 2 and "cannot read it" in out.stderr


def test_serve_passes_parallel_and_alias(pair, tmp_path):
    """Two slots under a name of our choosing (the OpenAI model list says the alias)."""
    import json
    import urllib.request
    from ikdflash.serving.client import post_json_concurrently
    target, draft = pair
    port = str(free_port())
    process = subprocess.Popen([sys.executable, "-m", "ikdflash.cli", "serve", "--target", str(target), "--draft",
                                str(draft), "-c", "1024", "--port", port, "--parallel", "2", "--alias", "tiny-dflash",
                                "--log-file", str(tmp_path / "s.log")], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        line = ""
        while "ready at" not in line:
            line = process.stderr.readline()
            assert line, "serve exited before it was ready"
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())
        assert [m["id"] for m in models["data"]] == ["tiny-dflash"]
        assert json.loads(urllib.request.urlopen(url + "/props", timeout=10).read())["total_slots"] == 2
        body = {"prompt": "the river", "n_predict": 8, "temperature": 0}
        replies = post_json_concurrently(url + "/completion", [body, body])
        assert replies[0]["content"] == replies[1]["content"] and replies[0]["timings"]["draft_n"] > 0
    finally:
        process.terminate()
        process.wait(timeout=30)
        process.stderr.close()


def test_sigint_stops_serve_even_when_inherited_ignored(pair, tmp_path):
    """A script's background job inherits SIGINT ignored, and Python then installs no handler:
    before, `kill -INT` (or the soak's SIGINT) left serve and its server running."""
    target, draft = pair
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "ikdflash.cli", "serve", "--target", str(target), "--draft",
                                str(draft), "-c", "512", "--port", str(port), "--log-file", str(tmp_path / "s.log")],
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        while "ready at" not in (line := process.stderr.readline()):
            assert line, "serve exited before it was ready"
        servers = children(process.pid)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        for pid in servers:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        process.kill()
        process.wait()
        process.stderr.close()


def test_doctor_probe_says_whether_dflash_pays(pair):
    target, draft = pair
    out = subprocess.run(["ikdflash", "doctor", "--probe", "--probe-tokens", "16", "--target", str(target),
                          "--draft", str(draft), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    probe = json.loads(out.stdout)["probe"]
    assert probe["identical"] and probe["replies"] == 3 and 3 <= probe["tokens"] <= 48
    assert probe["speedup"] == pytest.approx(probe["dflash_tokens_per_second"] / probe["target_tokens_per_second"])
    assert probe["verdict"] == ("pays" if probe["speedup"] >= 1.05 else
                                "costs time" if probe["speedup"] <= 1 / 1.05 else "about breaks even")
    text = subprocess.run(["ikdflash", "doctor", "--probe", "--probe-tokens", "8", "--target", str(target),
                           "--draft", str(draft)], capture_output=True, text=True, timeout=300).stdout
    assert "probe           3 chat replies" in text and "verdict         DFlash " in text


def test_doctor_without_a_pair_loads_no_model():
    out = subprocess.run(["ikdflash", "doctor", "--json"], capture_output=True, text=True, timeout=60)
    assert "pair" not in json.loads(out.stdout) and "probe" not in json.loads(out.stdout)


def test_a_refused_start_says_why_in_a_few_lines(pair, tmp_path):
    """llama-server's own reason, never its usage text: from the command line (whose checks refuse
    a bad DFlash key before starting anything), and from Server, with no log file to look in."""
    target, draft = pair
    out = serve("--target", str(target), "--draft", str(draft), "--port", "0", "--", "--spec-type", "dflash:bogus=1")
    said = (out.stdout + out.stderr).splitlines()
    assert out.returncode == 2 and len(said) <= 5 and any("unknown key 'bogus'" in line for line in said), said

    out = serve("--target", str(target), "--draft", str(draft), "-c", "512", "--port", "0", "--", "--no-such-flag")
    said = (out.stdout + out.stderr).splitlines()
    assert out.returncode == 1 and len(said) <= 5, said
    assert "no-such-flag" in said[-1] and "log_file=" not in out.stderr and "usage" not in out.stdout, said

    with pytest.raises(ServerError) as refused:
        Server(target, ctx_size=512, startup_timeout=60,
               extra_args=["--model-draft", str(draft), "--spec-type", "dflash:bogus=1"]).start()
    assert "exited with code 1 during start-up" in str(refused.value)
    assert "unknown key 'bogus'" in str(refused.value) and "unknown key 'bogus'" in refused.value.reason
    assert len(refused.value.reason.splitlines()) <= 5


def test_a_server_leaves_no_file_behind(pair, tmp_path, monkeypatch):
    """Nothing in the working directory but the log asked for; and the folder a server ran in is
    removed, at its stop or, when the process that started it was killed outright, at the next
    server's start."""
    import tempfile

    from ikdflash.serving.server import WORKDIR_PREFIX
    target, _ = pair
    monkeypatch.chdir(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{gone.stdout.strip()}-"))
    (orphan / "llama.log").write_text("a killed process's server wrote this")
    with Server(target, ctx_size=512, n_threads=2, log_file="server.log") as url:
        post_json(url + "/completion", {"prompt": "hi", "n_predict": 2})
        assert not orphan.exists()
        ours = list(Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}{os.getpid()}-*"))
        assert ours
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.log"] and not any(p.exists() for p in ours)


def started(command: list[str]) -> tuple[subprocess.Popen, str]:
    """An `ikdflash serve` process and its URL, once it says it is ready."""
    process = subprocess.Popen([sys.executable, "-m", "ikdflash.cli", "serve", *command], stderr=subprocess.PIPE,
                               text=True)
    lines = []
    for line in process.stderr:
        lines.append(line)
        if "ready at " in line:
            return process, line.split("ready at ")[1].split()[0]
    process.wait()
    raise AssertionError("serve did not start: " + "".join(lines))


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat_with_tools(url: str, stream: bool) -> dict:
    """The reply's message (content and tool calls) and finish_reason, streamed deltas put together."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 24, "temperature": 0, "stream": stream}
    if not stream:
        choice = post_json(url + "/v1/chat/completions", body)["choices"][0]
        message = choice["message"]
        return {"content": message.get("content"), "tool_calls": message.get("tool_calls"),
                "finish_reason": choice["finish_reason"]}
    import urllib.request
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    content, calls, finish = "", [], None
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice.get("delta") or {}
                content += delta.get("content") or ""
                calls += delta.get("tool_calls") or []
                finish = choice.get("finish_reason") or finish
    return {"content": content or None, "tool_calls": calls or None, "finish_reason": finish}


def test_serve_answers_tool_calls_and_metrics_as_without_a_draft(pair, tmp_path):
    """`ikdflash serve` turns on Jinja templates (which `tools` needs) and /metrics by default; a
    tools request, streamed or not, gets with the draft what the target alone gives (greedy)."""
    target, draft = pair
    process, url = started(["--target", str(target), "--draft", str(draft), "-c", "1024", "--port", "0",
                            "--log-file", str(tmp_path / "dflash.log")])
    try:
        drafted = [chat_with_tools(url, stream) for stream in (False, True)]
        import urllib.request
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        drafted_tokens = re.search(r"^\S*spec_decode_num_draft_tokens\S* (\S+)", metrics, re.M)
        assert drafted_tokens and float(drafted_tokens.group(1)) > 0, metrics  # the draft proposed
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        process.stderr.close()
    with Server(target, ctx_size=1024, log_file=tmp_path / "plain.log", extra_args=["--jinja"]) as plain_url:
        plain = [chat_with_tools(plain_url, stream) for stream in (False, True)]
    assert drafted == plain
    assert drafted[0]["content"] == drafted[1]["content"] and drafted[0]["finish_reason"] == "length"

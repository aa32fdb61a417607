"""Soak llama-server with DFlash, and `ikdflash serve`'s start and stop, for leaks, errors and
orphans.

    python tests/soak.py requests --requests 200 --seed 0    # 2 slots, mixed lengths, cancels
    python tests/soak.py cycles --cycles 100 --seed 0         # serve started and stopped, or killed
    python tests/soak.py all                                  # both, with the defaults above

requests: the built-in pair (or --tiny: a tiny random pair) on a server with 2 slots, fed from 3
client threads with prompts of mixed lengths (a question to ~700 tokens) and replies of 8 to 96
tokens; every 10th request is streamed and hung up on after a few events. No request may fail;
every token of a completed reply must be the target's own top choice in the pass that produced
it (the draft never puts in a token the target did not pick); and the server's RSS after the
run may exceed its RSS after warm-up (every prompt twice with the longest reply, counted in the
requests) by less than 5%. Each reply is also compared with the target alone's (a server without
the draft, one request at a time): a reply that differs there is reported with the gap between
the reference's top two probabilities where it turned, but does not fail the soak, because rows
batched with another slot's round differently and the quantized activations of a real model
make that a few percent of probability (the same with no draft at all).

cycles: `ikdflash serve` on the tiny pair, started, then stopped by SIGTERM, SIGINT or SIGHUP,
or its Python process SIGKILLed (the server must follow it by itself). After each cycle no
llama-server may be left and the port must be free.

tests/test_soak.py runs a short slice of each in the default test run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ikdflash import Server, ServerError
from ikdflash.serving.client import post_json, stream_json
from ikdflash.serving.server import free_port, port_in_use

QUESTIONS = ["Explain rainbows to a child.", "Give me a recipe for a simple tomato soup.",
             "What are three good habits for writing maintainable code?", "Why is the sky blue?"]
PARAGRAPH = ("The river ran past the old mill, where the miller's children played every summer. In the "
             "evenings the town gathered on the bridge to watch the boats come home with the day's catch. ")
REPLY_LENGTHS = [8, 16, 32, 64, 96]


def prompts() -> list[str]:
    """Questions, and passages of 1 to 16 paragraphs (about 45 to 700 tokens) to continue."""
    passages = [PARAGRAPH * n + "Then" for n in (1, 2, 4, 8, 16)]
    return QUESTIONS + passages


@dataclass
class RequestSoak:
    requests: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)   # a token that was not the target's top choice
    # replies unlike the one-at-a-time reference: (what, gap between the reference's top two
    # probabilities where the reply turned)
    diverged: list[tuple[str, float]] = field(default_factory=list)
    rss_warm_kib: int = 0
    rss_end_kib: int = 0
    rss_kib_by_request: list[tuple[int, int]] = field(default_factory=list)  # (requests done, RSS) after each
    seconds: float = 0.0

    @property
    def rss_growth(self) -> float:
        return self.rss_end_kib / self.rss_warm_kib - 1.0 if self.rss_warm_kib else 0.0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.mismatches and self.rss_growth < 0.05


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def body(prompt: str, n_predict: int) -> dict:
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": True,
            "n_probs": 2}


def not_the_targets_choice(reply: dict) -> int | None:
    """The first position whose token is not the top of the target's probabilities there, as
    the pass that produced it computed them; None when there is none."""
    for i, token in enumerate(reply["completion_probabilities"]):
        if token["content"] != token["probs"][0]["tok_str"]:
            return i
    return None


def first_difference(got: dict, want: dict) -> tuple[int, float] | None:
    """None when the replies are equal; else (position, relative gap of the reference's top two
    probabilities there)."""
    for i, (g, w) in enumerate(zip(got["completion_probabilities"], want["completion_probabilities"], strict=True)):
        if g["content"] != w["content"]:
            top = w["probs"]
            return i, (top[0]["prob"] - top[1]["prob"]) / top[0]["prob"] if len(top) > 1 else 1.0
    return None


def soak_requests(target: Path, draft: Path, n_requests: int, seed: int, folder: Path,
                  cancel_every: int = 10, clients: int = 3, server_args: tuple[str, ...] = ()) -> RequestSoak:
    rng = random.Random(seed)
    texts = prompts()
    # warm-up: every prompt with the longest reply, so both slots have touched the KV cells,
    # buffers and prompt cache that the rest of the run reuses
    warm = [(p, max(REPLY_LENGTHS), False) for p in range(len(texts))] * 2
    jobs = warm + [(rng.randrange(len(texts)), rng.choice(REPLY_LENGTHS), i % cancel_every == cancel_every - 1)
                   for i in range(max(0, n_requests - len(warm)))]
    # the reference runs with the same slots and KV cache as the soak, one request at a time
    slots = ["--parallel", "2", *server_args]
    with Server(target, ctx_size=4096, n_threads=2, log_file=folder / "plain.log", extra_args=slots) as url:
        expected = {(p, n): post_json(url + "/completion", body(texts[p], n))
                    for p, n in sorted({(p, n) for p, n, cancel in jobs if not cancel})}
    result = RequestSoak()
    server = Server(target, ctx_size=4096, n_threads=2, log_file=folder / "dflash.log",
                    extra_args=[*slots, "--model-draft", str(draft), "--spec-type", "dflash:n_max=4"])

    def one(job: tuple[int, int, bool]) -> None:
        p, n, cancel = job
        try:
            if cancel:
                events = stream_json(url + "/completion", body(texts[p], 600))
                for _ in zip(range(3), events, strict=False):
                    pass
                events.close()
                result.cancelled += 1
                return
            reply = post_json(url + "/completion", body(texts[p], n))
            wrong = not_the_targets_choice(reply)
            if wrong is not None:
                result.mismatches.append(f"prompt {p}, {n} tokens: token {wrong} is not the target's top choice")
            difference = first_difference(reply, expected[(p, n)])
            if difference is not None:
                at, gap = difference
                result.diverged.append((f"prompt {p}, {n} tokens: turns at token {at}, where the reference's top two "
                                        f"probabilities are {100 * gap:.2f}% apart", gap))
        except (ServerError, OSError) as e:
            result.errors.append(f"prompt {p}, {n} tokens: {e}")
        finally:
            result.requests += 1
            result.rss_kib_by_request.append((result.requests, rss_kib(server.process.pid)))

    start = time.monotonic()
    with server as url, ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, jobs[:len(warm)]))
        result.rss_warm_kib = rss_kib(server.process.pid)
        list(pool.map(one, jobs[len(warm):]))
        result.rss_end_kib = rss_kib(server.process.pid)
        if server.process.poll() is not None:
            result.errors.append(f"llama-server exited with code {server.process.returncode}")
    result.seconds = time.monotonic() - start
    return result


@dataclass
class CycleSoak:
    cycles: int = 0
    by_stop: dict[str, int] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)
    ports_left_busy: list[str] = field(default_factory=list)
    failed_starts: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.orphans and not self.ports_left_busy and not self.failed_starts


def servers_on(port: int) -> list[int]:
    """Pids of llama-server processes started with --port PORT."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"llama-server") and b"--port" in argv and \
                argv[argv.index(b"--port") + 1:][:1] == [str(port).encode()]:
            found.append(int(entry.name))
    return found


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


STOPS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP,
         "SIGKILL of serve": signal.SIGKILL}


def soak_cycles(target: Path, draft: Path, n_cycles: int, seed: int, folder: Path) -> CycleSoak:
    rng = random.Random(seed)
    result = CycleSoak()
    start = time.monotonic()
    for cycle in range(n_cycles):
        stop = rng.choice(sorted(STOPS))
        problem = serve_once(target, draft, free_port(), stop, folder)
        if problem:
            kind, text = problem
            getattr(result, kind).append(f"cycle {cycle} ({stop}): {text}")
        result.by_stop[stop] = result.by_stop.get(stop, 0) + 1
        result.cycles += 1
    result.seconds = time.monotonic() - start
    return result


def serve_once(target: Path, draft: Path, port: int, stop: str, folder: Path) -> tuple[str, str] | None:
    """Start `ikdflash serve`, wait for /health, stop it that way: None, or (what failed, detail)."""
    serve = subprocess.Popen([sys.executable, "-m", "ikdflash.cli", "serve", "--target", str(target),
                              "--draft", str(draft), "-c", "512", "--port", str(port),
                              "--log-file", str(folder / "serve.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    if not wait_until(lambda: healthy(port) or serve.poll() is not None, 60) or serve.poll() is not None:
        serve.kill()
        return "failed_starts", serve.communicate()[1].decode()[-300:]
    serve.send_signal(STOPS[stop])
    serve.wait(timeout=30)
    serve.stderr.close()
    if not wait_until(lambda: not servers_on(port), 15):
        left = servers_on(port)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return "orphans", f"llama-server {left} still running"
    if not wait_until(lambda: not port_in_use("127.0.0.1", port), 5):
        return "ports_left_busy", f"port {port}"
    return None


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    from fuzz_draft import tiny_pair as make
    return make(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["requests", "cycles", "all"])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="requests on a tiny random pair, not the built-in one")
    parser.add_argument("--report", type=Path, help="write the figures as JSON here")
    parser.add_argument("--server-args", default="", help="more llama-server options for the requests soak, "
                        "e.g. '--cache-ram 0' (no RAM prompt cache)")
    args = parser.parse_args()
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="ikdflash-soak-") as tmp:
        folder = Path(tmp)
        tiny = tiny_pair(folder)
        ok = True
        if args.what in ("requests", "all"):
            if args.tiny:
                pair = tiny
            else:
                from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
                pair = resolve_pair(DEFAULT_PAIR)
            soak = soak_requests(*pair, args.requests, args.seed, folder, server_args=tuple(args.server_args.split()))
            report["requests"] = {**soak.__dict__, "rss_growth": soak.rss_growth}
            print(f"requests: {soak.requests} ({soak.cancelled} cancelled) in {soak.seconds:.0f} s, "
                  f"{len(soak.errors)} errors, {len(soak.mismatches)} not lossless; {len(soak.diverged)} of "
                  f"{soak.requests - soak.cancelled} replies unlike the one-at-a-time reference; RSS "
                  f"{soak.rss_warm_kib} -> {soak.rss_end_kib} KiB ({100 * soak.rss_growth:+.2f}%)")
            samples = soak.rss_kib_by_request
            print("  RSS (KiB) after " + ", ".join(f"{samples[k][0]} requests: {samples[k][1]}"
                                                 for k in (len(samples) // 4, len(samples) // 2, 3 * len(samples) // 4,
                                                           len(samples) - 1)))
            for line in soak.errors[:5] + soak.mismatches[:5] + [what for what, _ in soak.diverged[:3]]:
                print("  " + line[:300])
            ok &= soak.ok
        if args.what in ("cycles", "all"):
            cycles = soak_cycles(*tiny, args.cycles, args.seed, folder)
            report["cycles"] = cycles.__dict__
            print(f"cycles: {cycles.cycles} in {cycles.seconds:.0f} s {json.dumps(cycles.by_stop, sort_keys=True)}, "
                  f"{len(cycles.orphans)} orphans, {len(cycles.ports_left_busy)} ports left busy, "
                  f"{len(cycles.failed_starts)} failed starts")
            for line in cycles.orphans[:5] + cycles.failed_starts[:5]:
                print("  " + line[:300])
            ok &= cycles.ok
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

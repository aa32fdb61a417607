"""llama-server beside a busy process: a reply's time alone and beside one CPU-bound process, with
the server's OpenMP threads waiting as `Server` starts them (GOMP_SPINCOUNT=1000) and as libgomp
would by default.

    python -m benchmarks.server busy [--rounds 3] [--tokens 256] [--busy-tokens 64] [--json out.json]

Each round starts a server per setting, in an order that alternates by round (a process's speed
follows where its memory lands, so no server serves two rounds): one warm-up reply, three timed
--tokens replies alone, then one --busy-tokens reply while a CPU-bound Python loop runs beside it
(started just before, stopped after; --busy-tokens 0: none). The built-in target alone, greedy, no draft: the waiting is
the threads', with or without one. Reported: each setting's median reply time alone and beside the
busy process, per round, and the median ratio of the reply times alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ikdflash import Server
from ikdflash.serving.client import post_json
from ikdflash.serving.server import OPENMP_SPIN_COUNT
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

from benchmarks.harness import write_result

# libgomp's own default: what a server gets when its environment says nothing of OpenMP
SETTINGS = {"Server's": {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}, "libgomp's": {"GOMP_SPINCOUNT": "300000"}}
BUSY_LOOP = "import time\nend = time.time() + 600\nwhile time.time() < end: sum(range(10000))"


def reply_seconds(url: str, tokens: int) -> float:
    body = {"prompt": "Once upon a time", "n_predict": tokens, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    post_json(url + "/completion", body)
    return time.monotonic() - start


def one_server(target: Path, env: dict[str, str], tokens: int, busy_tokens: int) -> dict:
    with Server(target, ctx_size=2048, env=env) as url:
        reply_seconds(url, tokens)
        alone = [reply_seconds(url, tokens) for _ in range(3)]
        if not busy_tokens:
            return {"alone_s": statistics.median(alone)}
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        try:
            time.sleep(0.3)
            beside = reply_seconds(url, busy_tokens)
        finally:
            busy.kill()
            busy.wait()
    return {"alone_s": statistics.median(alone), "beside_busy_s": beside}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--busy-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, _ = resolve_pair(DEFAULT_PAIR)
    rounds = []
    for r in range(args.rounds):
        names = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        runs = {name: one_server(target, SETTINGS[name], args.tokens, args.busy_tokens) for name in names}
        rounds.append(runs)
        print(f"round {r + 1}: " + ", ".join(
            f"{name} spin count: {args.tokens} tokens alone {run['alone_s']:.2f} s" +
            (f", {args.busy_tokens} beside a busy process {run['beside_busy_s']:.2f} s" if args.busy_tokens else "")
            for name, run in runs.items()), flush=True)
    alone = [r["Server's"]["alone_s"] / r["libgomp's"]["alone_s"] for r in rounds]
    print(f"alone, the Server's spin count against libgomp's: {statistics.median(alone):.3f}x the time (median of "
          f"{len(alone)} rounds)")
    if args.json:
        write_result(args.json, {"tokens": args.tokens, "busy_tokens": args.busy_tokens, "settings": SETTINGS,
                                 "rounds": rounds}, os.cpu_count() or 1)

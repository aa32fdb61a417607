"""The built-in draft's step timed back to back, and after what runs between two steps in a loop.

    python -m benchmarks.passes draft-in-loop [--steps 200] [--tokens 1 4] [--other NAME=PATH | --other-threads N]
                                            [--json out.json]

Timed back to back, a draft step finds its weights in the caches. In the engine and llama-server
a target pass runs between two draft steps and streams the target's weights through them. For
each --tokens n, the steps rotate through what comes before them, in one process: nothing, a 5 ms
sleep, a read of 256 MiB (a cache sweep), or a one-row target pass at 256 cached tokens. The
cross-context holds 300 rows of random features (a step's cost does not depend on their values).
The target loads as the engine loads it (repacked where the fork would repack it). Reported: each
mode's median step time. --other adds another draft of the same pair (another weight type, say),
its step after a target pass, alternating with the shipped draft's, and the median of the paired
ratios; --other-threads N the shipped draft again on N threads instead (the target keeps
--threads).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from ikdflash import _core
from ikdflash.model import repack_by_default
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

from benchmarks.harness import write_result

ROWS = 300
SWEEP = np.ones(256 * 2**20 // 8)


def before(mode: str, model: _core.Model) -> None:
    if mode == "sleep":
        time.sleep(0.005)
    elif mode == "sweep":
        SWEEP.sum()
    elif mode == "target pass":
        _core.measure.time_passes(model, [1], 256, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=2)
    others = parser.add_mutually_exclusive_group()
    others.add_argument("--other", metavar="NAME=PATH", help="another draft for the built-in target")
    others.add_argument("--other-threads", type=int, metavar="N", help="the shipped draft on N threads")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    target, shipped = resolve_pair(DEFAULT_PAIR)
    model = _core.Model(str(target), n_ctx=1024, n_threads=args.threads, repack=repack_by_default(target))
    named = {"shipped": (shipped, args.threads)}
    if args.other:
        name, _, path = args.other.partition("=")
        named[name] = (Path(path), args.threads)
    elif args.other_threads:
        named[f"{args.other_threads} thread(s)"] = (shipped, args.other_threads)
    drafts = {name: _core.Draft(model, str(path), n_threads=threads) for name, (path, threads) in named.items()}
    features = np.random.default_rng(0).standard_normal((ROWS, drafts["shipped"].info()["n_target_features"]))
    contexts = {}
    for name, draft in drafts.items():
        contexts[name] = _core.CrossContext(draft, 1024)
        contexts[name].append(features.astype(np.float32), np.arange(ROWS, dtype=np.int32))
    modes = ["back to back", "sleep", "sweep", "target pass"]
    results = {}
    for n in args.tokens:
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        paired: list[float] = []
        for step in range(args.steps):
            for mode in modes[step % len(modes):] + modes[:step % len(modes)]:
                before(mode, model)
                t0 = time.perf_counter()
                contexts["shipped"].propose(42, ROWS, n)
                times[mode].append(1e3 * (time.perf_counter() - t0))
            if len(named) > 1:
                other = {}
                for name in (list(named) if step % 2 == 0 else list(reversed(named))):
                    before("target pass", model)
                    t0 = time.perf_counter()
                    contexts[name].propose(42, ROWS, n)
                    other[name] = time.perf_counter() - t0
                paired.append(other[list(named)[1]] / other["shipped"])
        medians = {mode: statistics.median(t[len(modes):]) for mode, t in times.items()}
        results[str(n)] = {"median_ms": medians}
        print(f"{n} token(s): " + ", ".join(f"{mode} {ms:.3f} ms" for mode, ms in medians.items()) +
              f"; after a target pass {medians['target pass'] / medians['back to back']:.2f}x back to back")
        if paired:
            results[str(n)]["other_over_shipped"] = statistics.median(paired)
            print(f"  {list(named)[1]} after a target pass: {statistics.median(paired):.3f}x the shipped draft's step (paired)")
    contexts.clear()
    for draft in drafts.values():
        draft.close()
    model.close()
    if args.json:
        write_result(args.json, {"steps": args.steps, "other": args.other, "other_threads": args.other_threads,
                                 "results": results}, args.threads)
    return 0

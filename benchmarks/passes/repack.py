"""What run-time repacking (llama-server's -rtr) does to the built-in pair, side by side: the
target's passes of 1-5 rows, and the target alone, DFlash and prefill with the weights as stored
and repacked.

    python -m benchmarks.passes repack [--pass-rounds 30] [--tokens 128] [--repeats 3] [--prompt-tokens 1024]
                                [--json out.json]

The built-in target is Q4_1, which the fork repacks into 8 interleaved rows (patch
`iqk-Q4_1-repacked-at-load-rtr-into-8-interleaved-row`) whose few-row kernel needs no transpose; the results are the same bit for
bit. Repacking also loads the weights into memory of their own instead of mapping the file's pages, so the passes are timed in
three loads in one process: as stored and mapped (the fork's default), as stored in memory of
their own (--no-mmap), and repacked; each round times every load's passes of 1, 2, 3 and 5 rows
after the same 160 cached tokens (`_core.measure.time_passes`, 5 passes a load, the loads taking turns),
and each load's medians over rounds are reported against its own one-row pass and against the
mapped load's one-row pass.

Then, per round, for each layout (the mapped stored one and the repacked one): the chat questions
of adaptive.py decoded by the target alone, by DFlash with a fixed block of one draft, and with
the adaptive block length (n_max 4), each mode in an engine of its own; and a prompt of
--prompt-tokens tokens prefilled. Every output must equal the stored layout's target alone
(exit 1 otherwise). Reported: medians over rounds of tokens/s, each layout's DFlash modes against
its own target alone in the same round, and the repacked layout's speeds against the stored one's.
Engines of one process differ by a few percent in speed from where their weights landed; the pass
timings are the steadier figure.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

from ikdflash import Engine, _core
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

from benchmarks.harness import QUESTIONS, chat_prompts
from benchmarks.harness import write_result

LAYOUTS = {"stored": False, "repacked": True}
MODES = ("alone", "fixed 1", "adaptive")


PASS_LOADS = {"stored, mapped": {"repack": False, "mmap": True},
              "stored, own memory": {"repack": False, "mmap": False},
              "repacked": {"repack": True, "mmap": True}}  # repacking reads the weights into memory of its own
PASS_ROWS = [1, 2, 3, 5]


def pass_costs(target: Path, rounds: int) -> dict:
    """Per load: median ms of a pass of each row count, the loads taking turns each round."""
    times: dict[str, list[list[float]]] = {name: [[] for _ in PASS_ROWS] for name in PASS_LOADS}
    with contextlib.ExitStack() as stack:
        models = {}
        for name, options in PASS_LOADS.items():
            model = _core.Model(str(target), n_ctx=256, n_threads=2, n_batch=8, **options)
            stack.callback(model.close)
            models[name] = model
            _core.measure.time_passes(model, PASS_ROWS, 160, 2)  # warm-up: pages weights in, plans buffers
        for _ in range(rounds):
            for name, model in models.items():
                for k, passes in enumerate(_core.measure.time_passes(model, PASS_ROWS, 160, 5)):
                    times[name][k] += passes
    return {name: {str(n): statistics.median(t) for n, t in zip(PASS_ROWS, rows, strict=True)}
            for name, rows in times.items()}


def one_round(engines: dict[str, dict[str, Engine]], prompts: list[list[int]], long_prompt: list[int],
              tokens: int, reference: list[list[int]] | None) -> tuple[dict, list[list[int]]]:
    """tokens/s of every (layout, mode), and of each layout's prefill of long_prompt."""
    speed: dict[str, dict[str, float]] = {}
    for layout, modes in engines.items():
        generated, seconds = dict.fromkeys(MODES, 0), dict.fromkeys(MODES, 0.0)
        alone_tokens = []
        for i, prompt in enumerate(prompts):
            outs = {"alone": modes["alone"].generate(prompt, max_tokens=tokens),
                    "fixed 1": modes["fixed 1"].speculate(prompt, max_tokens=tokens, n_max=1, adaptive=False),
                    "adaptive": modes["adaptive"].speculate(prompt, max_tokens=tokens, n_max=4)}
            alone_tokens.append(outs["alone"].tokens)
            expected = reference[i] if reference is not None else outs["alone"].tokens
            for mode, out in outs.items():
                if out.tokens != expected:
                    sys.exit(f"{layout} {mode}: the output turned from the stored layout's target alone")
                generated[mode] += out.stats.generated
                seconds[mode] += out.stats.draft_time + out.stats.verify_time
        reference = reference or alone_tokens  # the first layout's (stored) target alone
        prefill = modes["alone"].generate(long_prompt, max_tokens=1).stats
        speed[layout] = {**{m: generated[m] / seconds[m] for m in MODES},
                         "prefill": prefill.prompt_tokens / prefill.prompt_time}
    return speed, reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pass-rounds", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target, draft = resolve_pair(DEFAULT_PAIR)
    passes = pass_costs(target, args.pass_rounds)
    mapped_one_row = passes["stored, mapped"]["1"]
    print(f"{'load':>18} | {'1 row':>7} | " + " ".join(f"{n:>2} rows" for n in PASS_ROWS[1:])
          + " | each row count's time against the mapped stored one-row pass")
    for name, ms in passes.items():
        print(f"{name:>18} | {ms['1']:>5.2f}ms | " + " ".join(f"{ms[str(n)] / ms['1']:>6.2f}x" for n in PASS_ROWS[1:])
              + " | " + " ".join(f"{ms[str(n)] / mapped_one_row:.2f}x" for n in PASS_ROWS))
    rounds = []
    # DFlash's modes have an engine each: the adaptive controller carries what it learnt from one
    # request to the next, as in a server's slot, which a fixed run in between would reset
    with contextlib.ExitStack() as stack:
        engines = {layout: {mode: stack.enter_context(Engine(target, None if mode == "alone" else draft, n_ctx=2048,
                                                             n_threads=2, repack=repack))
                            for mode in MODES}
                   for layout, repack in LAYOUTS.items()}
        prompts = chat_prompts(engines["stored"]["alone"], QUESTIONS)
        long_prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt_tokens)]
        one_round(engines, prompts[:1], long_prompt[:64], 16, None)  # warm-up: pages weights in
        reference = None
        for r in range(args.repeats):
            speed, reference = one_round(engines, prompts, long_prompt, args.tokens, reference)
            rounds.append(speed)
            print(f"  round {r + 1}/{args.repeats} done", file=sys.stderr)

    def median(f) -> float:
        return statistics.median(f(s) for s in rounds)

    result = {"pass_ms_160_cached": passes, "tokens": args.tokens, "repeats": args.repeats,
              "prompt_tokens": args.prompt_tokens,
              "tokens_per_second": {lay: {m: median(lambda s, lay=lay, m=m: s[lay][m]) for m in (*MODES, "prefill")}
                                    for lay in LAYOUTS},
              "ratio_to_alone": {lay: {m: median(lambda s, lay=lay, m=m: s[lay][m] / s[lay]["alone"]) for m in MODES}
                                 for lay in LAYOUTS},
              "repacked_to_stored": {m: median(lambda s, m=m: s["repacked"][m] / s["stored"][m])
                                     for m in (*MODES, "prefill")}}
    print(f"{'layout':>9} | " + " ".join(f"{m:>9}" for m in MODES) + " | prefill tok/s | to its target alone: "
          + ", ".join(MODES[1:]))
    for lay in LAYOUTS:
        t, r = result["tokens_per_second"][lay], result["ratio_to_alone"][lay]
        print(f"{lay:>9} | " + " ".join(f"{t[m]:>9.1f}" for m in MODES) + f" | {t['prefill']:>13.0f} | "
              + ", ".join(f"{r[m]:.2f}x" for m in MODES[1:]))
    print("repacked / stored, same round: "
          + ", ".join(f"{m} {v:.3f}x" for m, v in result["repacked_to_stored"].items()))
    if args.json:
        write_result(args.json, result, args.threads)

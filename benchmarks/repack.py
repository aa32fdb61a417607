"""What run-time repacking (llama-server's -rtr) does to the built-in pair: the target alone's
prompt and decoding speed, and DFlash against the target alone, with the weights as stored and
repacked, side by side.

    python benchmarks/repack.py [--tokens 128] [--repeats 3] [--prompt-tokens 1024] [--json out.json]

The built-in target is Q4_1, which the fork repacks into 8 interleaved rows (patch 0043) whose
few-row kernel needs no transpose; its results are the same bit for bit, so each mode's output must
equal the stored layout's target alone (exit 1 otherwise). Per round, for each layout: the chat
questions of adaptive.py decoded by the target alone, by DFlash with a fixed block of one draft,
and with the adaptive block length (n_max 4); and a prompt of --prompt-tokens tokens prefilled.
Reported: medians over rounds of tokens/s, each layout's DFlash modes as a ratio to its own target
alone in the same round, and the repacked layout's speeds as a ratio to the stored layout's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

from ikdflash import Engine
from ikdflash.hub import DEFAULT_PAIR, resolve_pair

from adaptive import QUESTIONS, chat_prompts  # beside this script

LAYOUTS = {"stored": False, "repacked": True}
MODES = ("alone", "fixed 1", "adaptive")


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
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target, draft = resolve_pair(DEFAULT_PAIR)
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

    result = {"tokens": args.tokens, "repeats": args.repeats, "prompt_tokens": args.prompt_tokens,
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
    print("repacked / stored, same round: " + ", ".join(f"{m} {v:.3f}x" for m, v in result["repacked_to_stored"].items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

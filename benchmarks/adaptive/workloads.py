"""The adaptive block length against every fixed n_max and the target alone, side by side.

    python -m benchmarks.adaptive run [--tokens 128] [--repeats 3] [--draft D.gguf] [--json out.json]

Workloads, each generated greedily by one engine per pair, on 2 threads:

    useless       the built-in SmolLM2 target with its draft reading the target's layers in
                  reverse order (same cost, acceptance near 0): DFlash must not cost much here
    built-in      the built-in pair (shipped draft) on chat questions
    mixed         the built-in pair on requests that alternate between a chat question and a
                  listing (counting, the alphabet), where the shipped draft is often right
    alternating   the built-in pair on requests that alternate between random numbers, where the
                  shipped draft is useless (its first token kept ~10% of the time), and a listing:
                  since the stage-9 draft keeps ~40% on chat, mixed no longer has a stretch where
                  k = 0 is the best choice, and this workload does
    always-right  the tiny pair of benchmarks/server/overhead.py (every draft accepted)

For each workload: tokens/s of the target alone, of fixed n_max 1, 2, 3, 4, of the adaptive
block length with n_max 4 (which may choose any k in 0..4 each step) and the n-gram lookup off,
so that the draft's own gain is measured, of the same with the confidence cut ("+confidence":
each draft token's confidence sets how many are verified), and of the same with the lookup on ("+lookup",
as served by default), each over a whole round of
the workload's requests and as a ratio to the target alone in the same round, and the adaptive
mode's ratio to the best fixed choice of its round (k = 0, the target alone, included): medians
over --repeats rounds. Every output must equal the target alone's (exit 1 otherwise). Also, per
mode, what its steps cost in the engine (a pass with its layer tap and the draft's row commits,
and a draft step) as a share of the target alone's one-token pass in the same round (medians):
the costs controller_replay.py models. And the controller's own cost per step, through Python (an
upper bound of its C++ cost), against a one-row target pass. And the +confidence mode's draft
tokens by tenth of their calibrated acceptance, predicted against kept (docs/design.md, "Confidence").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gguf
from ikdflash import Engine
from ikdflash._core import BlockController
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

from tests.fixtures.gguf_edit import rewrite
from benchmarks.server.overhead import always_right_pair
from benchmarks.harness import QUESTIONS, chat_prompts, write_result

# requests whose answers the shipped draft predicts well (fixed n_max 4: tau ~2.1 and ~1.6)
LISTINGS = ["Count from 1 to 60, separated by commas.",
            "Write the English alphabet from A to Z, with a space between letters."]
# requests whose answers the shipped draft cannot predict (its first token kept 8% and 10%)
RANDOM_NUMBERS = ["Write 30 random six-digit numbers, separated by commas.",
                  "Write 30 random four-digit numbers, separated by spaces."]
# the questions of each workload on the built-in target (useless: built-in's, with the scrambled draft)
WORKLOAD_QUESTIONS = {"useless": QUESTIONS, "built-in": QUESTIONS,
                      "mixed": [QUESTIONS[0], LISTINGS[0], QUESTIONS[3], LISTINGS[1]],
                      "alternating": [RANDOM_NUMBERS[0], LISTINGS[0], RANDOM_NUMBERS[1], LISTINGS[1]]}
FIXED = (1, 2, 3, 4)


def scrambled_draft(like: Path, out: Path) -> Path:
    """The draft like, reading its target layers in reverse order: the same weights and cost, and
    a context it was never trained on, so it proposes next to nothing the target keeps."""
    key = next(k for k in gguf.GGUFReader(like).fields if k.endswith((".target_layer_ids", "dflash.target_layers")))
    layers = gguf.GGUFReader(like).fields[key].contents()
    return rewrite(like, out, fields={key: list(reversed(layers))})


def run_workload(name: str, target: Path, draft: Path, prompts_of, tokens: int, repeats: int,
                 repack: bool | None) -> dict:
    """Each mode's tokens/s over a whole round of the workload's requests, its ratio to the target
    alone in the same round, and the adaptive mode's ratio to the best fixed choice of that round
    (the target alone, k = 0, included): medians over rounds. Within a round every request runs in
    every mode back to back, so the machine's drift cancels in the ratios; a mixed workload's
    worth is the whole round's, not a typical request's."""
    modes = ["alone"] + [f"fixed {k}" for k in FIXED] + ["adaptive", "+confidence", "+lookup"]
    speeds: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    vs_best_fixed: list[float] = []
    lookup_vs_adaptive: list[float] = []  # the lookup's worth: +lookup over adaptive, per round
    cut_vs_plan: list[float] = []  # the confidence cut's worth: +confidence over adaptive, per round
    calibration = [[0, 0, 0.0] for _ in range(10)]  # the +confidence mode's, summed over its requests
    plain_share, by_k, probes = [], [0] * 5, 0
    pass_share: dict[str, list[float]] = {m: [] for m in modes}   # a step's target pass / alone's
    draft_share: dict[str, list[float]] = {m: [] for m in modes}  # a step's draft step / alone's pass
    # the adaptive mode has an engine of its own: its controller carries what it learnt from one
    # request to the next, as in a server's slot, which a fixed run in between would reset. The
    # target alone runs on that engine (Engine.generate leaves the controller be), in its memory:
    # two engines decode at speeds that follow their load order (docs/benchmarks.md)
    with Engine(target, draft, n_ctx=2048, n_threads=2, repack=repack) as fixed, \
            Engine(target, draft, n_ctx=2048, n_threads=2, repack=repack) as adaptive, \
            Engine(target, draft, n_ctx=2048, n_threads=2, repack=repack) as cut, \
            Engine(target, draft, n_ctx=2048, n_threads=2, repack=repack) as lookup:
        prompts = prompts_of(fixed)
        repacked = adaptive.target.repacked
        for prompt in prompts[:1]:  # warm-up: first passes page weights in and plan buffers
            adaptive.generate(prompt, max_tokens=tokens)
            fixed.speculate(prompt, max_tokens=tokens, n_max=4, adaptive=False)
            adaptive.speculate(prompt, max_tokens=tokens, n_max=4, lookup=False)
            cut.speculate(prompt, max_tokens=tokens, n_max=4, lookup=False, confidence=True)
            lookup.speculate(prompt, max_tokens=tokens, n_max=4)
        for r in range(repeats):
            generated = dict.fromkeys(modes, 0)
            seconds = dict.fromkeys(modes, 0.0)
            steps, verify_s, draft_s = dict.fromkeys(modes, 0), dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0.0)
            for prompt in prompts:
                alone = adaptive.generate(prompt, max_tokens=tokens)
                outs = {"alone": alone,
                        **{f"fixed {k}": fixed.speculate(prompt, max_tokens=tokens, n_max=k, adaptive=False)
                           for k in FIXED},
                        "adaptive": adaptive.speculate(prompt, max_tokens=tokens, n_max=4, lookup=False),
                        "+confidence": cut.speculate(prompt, max_tokens=tokens, n_max=4, lookup=False,
                                                     confidence=True),
                        "+lookup": lookup.speculate(prompt, max_tokens=tokens, n_max=4)}
                for mode, out in outs.items():
                    if out.tokens != alone.tokens:
                        sys.exit(f"{name}: {mode} turned from the target alone's output")
                    generated[mode] += out.stats.generated
                    seconds[mode] += out.stats.draft_time + out.stats.verify_time
                    steps[mode] += out.stats.steps
                    verify_s[mode] += out.stats.verify_time
                    draft_s[mode] += out.stats.draft_time
                st = outs["adaptive"].stats
                by_k = [a + b for a, b in zip(by_k, st.steps_by_verified, strict=True)]
                plain_share.append(st.plain_share)
                probes += st.probes
                for tenth, counts in zip(calibration, outs["+confidence"].stats.calibration, strict=True):
                    for i, value in enumerate(counts):
                        tenth[i] += value
            speed = {m: generated[m] / seconds[m] for m in modes}
            one_row = verify_s["alone"] / steps["alone"]
            for m in modes:
                speeds[m].append(speed[m])
                ratios[m].append(speed[m] / speed["alone"])
                pass_share[m].append(verify_s[m] / steps[m] / one_row)
                draft_share[m].append(draft_s[m] / steps[m] / one_row)
            vs_best_fixed.append(speed["adaptive"] / max(speed[m] for m in modes if m.startswith(("alone", "fixed"))))
            lookup_vs_adaptive.append(speed["+lookup"] / speed["adaptive"])
            cut_vs_plan.append(speed["+confidence"] / speed["adaptive"])
            print(f"  {name}: round {r + 1}/{repeats} done", file=sys.stderr)
    return {"tokens_per_second": {m: statistics.median(v) for m, v in speeds.items()},
            "ratio_to_alone": {m: statistics.median(v) for m, v in ratios.items()},
            "adaptive_to_best_fixed": statistics.median(vs_best_fixed),
            "lookup_to_adaptive": statistics.median(lookup_vs_adaptive), "lookup_to_adaptive_rounds": lookup_vs_adaptive,
            "cut_to_plan": statistics.median(cut_vs_plan), "cut_to_plan_rounds": cut_vs_plan,
            "calibration": [{"tokens": n, "kept": kept / n, "predicted": predicted / n}
                            for n, kept, predicted in calibration if n],
            "pass_per_step_vs_alone": {m: statistics.median(v) for m, v in pass_share.items()},
            "draft_per_step_vs_alone": {m: statistics.median(v) for m, v in draft_share.items()},
            "adaptive_steps_by_verified": by_k, "adaptive_plain_share": statistics.mean(plain_share),
            "adaptive_probes": probes, "repacked": repacked}


WORKLOADS = ("useless", "built-in", "mixed", "alternating", "always-right")


def controller_cost(pass_ms: float) -> dict:
    ctl = BlockController(4, [1.0, 1.09, 1.3, 1.6, 1.9], 0.7)
    steps = 20000
    t0 = time.perf_counter()
    for i in range(steps):
        n_draft, n_verify = ctl.plan(4)
        if n_draft:
            ctl.proposed([1, 2, 1, 2][:n_draft])
        ctl.committed(n_verify, [1] if i % 3 else [1, 1])
    us = 1e6 * (time.perf_counter() - t0) / steps
    return {"us_per_step_through_python": us, "share_of_a_one_row_pass": us / 1e3 / pass_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--repack", action=argparse.BooleanOptionalAction,
                        help="repack weights at load (llama-server's -rtr); default: where it keeps results exact, "
                             "as Engine does")
    parser.add_argument("--draft", type=Path,
                        help="a draft for the built-in target instead of the shipped one (the chat workloads; "
                             "useless scrambles it)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target, draft = resolve_pair(DEFAULT_PAIR)
    draft = args.draft or draft
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        useless = scrambled_draft(draft, folder / "scrambled.gguf")
        tiny_target, tiny_draft = always_right_pair(folder)
        workloads = {name: (target, useless if name == "useless" else draft,
                            lambda e, questions=questions: chat_prompts(e, questions))
                     for name, questions in WORKLOAD_QUESTIONS.items()}
        workloads["always-right"] = (tiny_target, tiny_draft,
                                     lambda e: [[(i * 7919 + s) % 250 for i in range(64)] for s in range(4)])
        for name in args.workloads:
            t, d, prompts_of = workloads[name]
            results[name] = run_workload(name, t, d, prompts_of, args.tokens, args.repeats, args.repack)
    alone = results[args.workloads[0]]["tokens_per_second"]["alone"]
    results["controller"] = controller_cost(1e3 / alone)
    modes = list(results[args.workloads[0]]["ratio_to_alone"])
    print(f"{'workload':>13} | " + " ".join(f"{m:>9}" for m in modes)
          + " | adaptive: to best fixed, k=0 share, steps by k, probes | +lookup / adaptive (rounds)")
    for name in args.workloads:
        r = results[name]
        print(f"{name:>13} | " + " ".join(f"{r['ratio_to_alone'][m]:>8.2f}x" for m in modes)
              + f" | {r['adaptive_to_best_fixed']:.2f}x, {r['adaptive_plain_share']:.0%}, "
              f"{r['adaptive_steps_by_verified']}, {r['adaptive_probes']} | {r['lookup_to_adaptive']:.3f}x "
              f"({', '.join(f'{x:.3f}' for x in r['lookup_to_adaptive_rounds'])})")
    print("a step's target pass and draft step against the target alone's pass, in the engine:")
    for name in args.workloads:
        r = results[name]
        print(f"{name:>13} | " + " ".join(f"{r['pass_per_step_vs_alone'][m]:>4.2f}+{r['draft_per_step_vs_alone'][m]:.2f}"
                                          for m in modes))
    print("+confidence / adaptive (rounds); the +confidence mode's draft tokens by predicted acceptance: "
          "predicted -> kept (share of tokens)")
    for name in args.workloads:
        r = results[name]
        total = sum(t["tokens"] for t in r["calibration"]) or 1
        print(f"{name:>13} | {r['cut_to_plan']:.3f}x ({', '.join(f'{x:.3f}' for x in r['cut_to_plan_rounds'])}) | "
              + ", ".join(f"{t['predicted']:.2f}->{t['kept']:.2f} ({t['tokens'] / total:.0%})" for t in r["calibration"]))
    c = results["controller"]
    print(f"controller: {c['us_per_step_through_python']:.1f} us a step through Python, "
          f"{c['share_of_a_one_row_pass']:.2%} of a one-row SmolLM2 pass")
    if args.json:
        write_result(args.json, {"tokens": args.tokens, "repeats": args.repeats,
                                 "draft": str(args.draft or "shipped"), **results}, threads=2)

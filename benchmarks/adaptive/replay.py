"""The adaptive block length replayed on recorded drafts at given costs: the controller against
every fixed n_max and the target alone, without the machine's noise.

    python -m benchmarks.adaptive replay [--tokens 128] [--workloads useless built-in mixed alternating [held-out]]
        [--pass-ms 4.0 4.85 6.4 7.5 9.1] [--draft-ms 0.74 0.9 1.1 1.27] [--switch-ms 0.56]
        [--catch-up-ms 0.019] [--json out.json]
        [--recordings recordings.json]   # recorded once (~3 min), replayed in seconds after
        [--draft D.gguf]                 # another draft for the built-in target

adaptive.py measures each mode on this machine, where rounds differ by +-5%: too noisy to rank
modes a few percent apart, or to tell one controller rule from another. Here each request of
adaptive.py's workloads is recorded once: the target's greedy answer, and the draft's proposals at
every answer position (teacher-forced on the target's own features, which is what the engine's
draft reads on the greedy path). The real controller (`_core.BlockController`) is then driven
through each answer as the engine drives it, and every mode's time is the sum of modelled costs:

    a pass of r rows      --pass-ms[r - 1], plus --switch-ms where the pass before had another
                          row count (the target rebuilds its graph)
    a draft step          --draft-ms[n - 1] for n tokens proposed, plus --catch-up-ms for each
                          context row past 2 added since the draft step before (a probe after a
                          run of plain steps projects all of them)

The `+lookup` mode is the adaptive one with the engine's n-gram lookup offering beside the draft
(`_core.NgramLookup` over the prompt and the answer so far; recordings made before the prompt's
tokens were kept have no such mode). `+confidence` gives the adaptive mode's controller the
draft's recorded confidence in each token it proposes, and its calibrated cut decides how many the
step verifies (design.md, "Confidence"); `+perfect` gives it a confidence that knows the outcome
(1 for each token the target will keep, 0 from the first it will not): what the cut could make of
any confidence, a DSpark draft's head included, once the draft has run. The controller sees these times as it sees the engine's (its
estimates follow them). Defaults:
the built-in pair, repacked, on a 2-core AMD EPYC with AVX-512 VNNI, 2026-12-06
(`_core.measure.time_passes` at 200 cached tokens; the draft's steps and a probe's catch-up per
context row timed after a target pass; docs/benchmarks.md, "The adaptive block length").
Quoted: tokens per millisecond of each mode as a ratio to the target alone, per workload and per
request, the adaptive mode's steps by k, and an oracle that knows each step's outcome (the bound
for any block length rule with these drafts at these costs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ikdflash import Engine
from ikdflash._core import BlockController, NgramLookup
from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair
from ikdflash.train.evaluate import held_out_prompts

from benchmarks.adaptive.workloads import WORKLOAD_QUESTIONS, chat_prompts, scrambled_draft
from benchmarks.adaptive.draft_confidence import draft_steps
from benchmarks.harness import SYSTEM, write_result

N_MAX = 4
# the adaptive mode with the draft's confidences given to its controller, by the replay's
# confidence argument: the draft's own, and the perfect one that bounds any (a DSpark head's too)
CONFIDENCE_MODES = {"+confidence": "draft", "+perfect": "perfect"}
# beside adaptive.py's workloads: the held-out chat prompts of benchmarks/tau.py, enough answer
# positions (~3,000) that rules a few percent apart are told apart on chat
HELD_OUT, HELD_OUT_PROMPTS = "held-out", 24


@dataclass
class Recording:
    """One request: the target's answer after the prompt, and at each answer position s the
    draft's N_MAX proposals for positions s + 1.. (given answer[s] as the block's first token) with
    the draft's confidence in each. The prompt's tokens, which the n-gram lookup searches, and the
    confidences are missing from older recordings."""
    n_prompt: int
    answer: list[int]
    proposals: list[list[int]]
    prompt: list[int] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)


def record(target: Path, draft_path: Path, prompts: list[list[int]], tokens: int) -> list[Recording]:
    recordings = [Recording(len(p), [], [], list(p)) for p in prompts]
    for i, seq, _, best, confidence, _ in draft_steps(target, draft_path, prompts, tokens):
        recordings[i].answer = seq[len(prompts[i]):]
        recordings[i].proposals.append(list(best[:N_MAX]))
        recordings[i].confidences.append([float(c) for c in confidence[:N_MAX]])
    return recordings


@dataclass
class Costs:
    pass_ms: list[float]  # rows 1..N_MAX + 1
    draft_ms: list[float]  # tokens 1..N_MAX
    switch_ms: float
    catch_up_ms: float  # a context row the draft projects past the 2 of a step in a run of them


def replay(rec: Recording, ctl: BlockController, costs: Costs, n_max: int,
           lookup: NgramLookup | None = None, confidence: str | None = None) -> tuple[float, int, list[int]]:
    """Milliseconds and tokens of one request with ctl choosing (n_max 0: the target alone), as
    the engine's loop runs it: the answer's first token comes from the prompt's pass; each step
    then proposes and verifies after the last token committed, the lookup's offer (when given)
    beside the draft's. confidence: the draft's tokens go to the controller with the draft's
    recorded confidences ("draft") or with a perfect one ("perfect": 1 for each token the target
    will keep, 0 from the first it will not), and the step verifies as many as it then says.
    Returns (ms, tokens, steps by k)."""
    answer, ms, by_k = rec.answer, 0.0, [0] * (N_MAX + 1)
    s, last_rows, since_draft = 0, 0, rec.n_prompt
    ctl.reset()
    while s < len(answer) - 1:
        n_limit = min(n_max, len(answer) - 2 - s)  # room for the target's own token
        offer = lookup.propose(rec.prompt + answer[:s], answer[s], n_limit) if lookup and n_limit else []
        from_lookup = False
        if offer:
            n_draft, n_verify, from_lookup = ctl.plan_offered(n_limit, offer)
        elif n_max:
            n_draft, n_verify = ctl.plan(n_limit)
        else:
            n_draft, n_verify = 0, 0
        proposal = rec.proposals[s][:n_draft]
        if n_draft:
            t = costs.draft_ms[n_draft - 1] + costs.catch_up_ms * max(0, since_draft - 2)
            ctl.observe_draft(n_draft, t)
            ms += t
            since_draft = 0
            n_verify = ctl.proposed(proposal, proposal_confidence(rec, s, proposal, confidence))
        verified = offer if from_lookup else proposal
        acc = leading_kept(verified[:n_verify], answer, s)
        rows = n_verify + 1
        t = costs.pass_ms[rows - 1] + (costs.switch_ms if rows != last_rows else 0.0)
        ctl.observe_pass(rows, t)
        ms += t
        last_rows, since_draft = rows, since_draft + acc + 1
        ctl.committed(n_verify, answer[s + 1:s + 2 + acc])
        by_k[n_verify] += 1
        s += acc + 1
    return ms, len(answer) - 1, by_k


def leading_kept(tokens: list[int], answer: list[int], s: int) -> int:
    """How many of tokens, proposed after answer[s], the target keeps: the leading ones that are
    its answer's next tokens."""
    kept = 0
    while kept < len(tokens) and s + 1 + kept < len(answer) and tokens[kept] == answer[s + 1 + kept]:
        kept += 1
    return kept


def proposal_confidence(rec: Recording, s: int, proposal: list[int], confidence: str | None) -> list[float] | None:
    """The confidences replay gives the controller with the draft's proposal at answer position s."""
    if confidence == "draft":
        return rec.confidences[s][:len(proposal)]
    if confidence == "perfect":
        kept = leading_kept(proposal, rec.answer, s)
        return [1.0] * kept + [0.0] * (len(proposal) - kept)
    return None


def oracle(rec: Recording, costs: Costs, n_max: int) -> tuple[float, int]:
    """The bound for any block length rule with these drafts and costs: every step knows how many
    of the draft's tokens the target will keep; it drafts n_max and verifies exactly those when
    there are any, and decodes one token without drafting otherwise (graph switches and the
    draft's catch-up charged as in replay). Returns (ms, tokens)."""
    answer, ms, s, last_rows, since_draft = rec.answer, 0.0, 0, 0, rec.n_prompt
    while s < len(answer) - 1:
        n_limit = min(n_max, len(answer) - 2 - s)
        kept = leading_kept(rec.proposals[s][:n_limit], answer, s)
        if kept:
            ms += costs.draft_ms[n_limit - 1] + costs.catch_up_ms * max(0, since_draft - 2)
            since_draft = 0
        rows = kept + 1
        ms += costs.pass_ms[rows - 1] + (costs.switch_ms if rows != last_rows else 0.0)
        last_rows, since_draft, s = rows, since_draft + rows, s + rows
    return ms, len(answer) - 1


def run_workload(recordings: list[Recording], costs: Costs) -> dict:
    controllers = {"alone": (BlockController(N_MAX, costs.pass_ms, costs.draft_ms, adaptive=False), 0),
                   **{f"fixed {k}": (BlockController(N_MAX, costs.pass_ms, costs.draft_ms, adaptive=False), k)
                      for k in range(1, N_MAX + 1)},
                   "adaptive": (BlockController(N_MAX, costs.pass_ms, costs.draft_ms), N_MAX)}
    if all(rec.prompt for rec in recordings):
        controllers["+lookup"] = (BlockController(N_MAX, costs.pass_ms, costs.draft_ms), N_MAX)
    if all(rec.confidences for rec in recordings):
        for mode in CONFIDENCE_MODES:
            controllers[mode] = (BlockController(N_MAX, costs.pass_ms, costs.draft_ms), N_MAX)
    per_request, total, by_k = [], {m: [0.0, 0] for m in controllers}, [0] * (N_MAX + 1)
    for rec in recordings:
        rates = {}
        for mode, (ctl, n_max) in controllers.items():
            lookup = NgramLookup(N_MAX) if mode == "+lookup" else None  # the engine's: runs of up to n_max
            ms, tokens, steps = replay(rec, ctl, costs, n_max, lookup, CONFIDENCE_MODES.get(mode))
            total[mode][0] += ms
            total[mode][1] += tokens
            rates[mode] = tokens / ms
            if mode == "adaptive":
                by_k = [a + b for a, b in zip(by_k, steps, strict=True)]
        ms, tokens = oracle(rec, costs, N_MAX)
        total.setdefault("oracle", [0.0, 0])
        total["oracle"][0] += ms
        total["oracle"][1] += tokens
        rates["oracle"] = tokens / ms
        per_request.append({m: rates[m] / rates["alone"] for m in rates})
    speed = {m: tokens / ms for m, (ms, tokens) in total.items()}
    ratio = {m: speed[m] / speed["alone"] for m in speed}
    return {"ratio_to_alone": ratio, "per_request": per_request, "adaptive_steps_by_verified": by_k,
            "adaptive_to_best_fixed": ratio["adaptive"] / max(ratio[m] for m in ratio if m.startswith(("alone", "fixed")))}


def record_workloads(names: list[str], tokens: int, draft: Path | None) -> dict[str, list[Recording]]:
    target, shipped = resolve_pair(DEFAULT_PAIR)
    draft = draft or shipped
    with Engine(target, n_ctx=256, n_threads=1) as engine:  # the chat template, for the prompts
        prompts = {name: chat_prompts(engine, WORKLOAD_QUESTIONS[name]) for name in names if name != HELD_OUT}
    if HELD_OUT in names:
        prompts[HELD_OUT] = held_out_prompts(target, None, HELD_OUT_PROMPTS, system=SYSTEM)
    recordings = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            d = scrambled_draft(draft, Path(tmp) / "scrambled.gguf") if name == "useless" else draft
            recordings[name] = record(target, d, prompts[name], tokens)
            print(f"  {name}: recorded", file=sys.stderr)
    return recordings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOAD_QUESTIONS),
                        choices=[*WORKLOAD_QUESTIONS, HELD_OUT])
    parser.add_argument("--pass-ms", type=float, nargs=N_MAX + 1, default=[4.0, 4.85, 6.4, 7.5, 9.1])
    parser.add_argument("--draft-ms", type=float, nargs=N_MAX, default=[0.74, 0.9, 1.1, 1.27])
    parser.add_argument("--switch-ms", type=float, default=0.56)
    parser.add_argument("--catch-up-ms", type=float, default=0.019)
    parser.add_argument("--draft", type=Path, help="another draft for the built-in target (default: the shipped one)")
    parser.add_argument("--recordings", type=Path,
                        help="a file of recordings: the workloads it holds are read, the others recorded into it")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    costs = Costs(args.pass_ms, args.draft_ms, args.switch_ms, args.catch_up_ms)
    saved = json.loads(args.recordings.read_text()) if args.recordings and args.recordings.exists() else {}
    recordings = {name: [Recording(**r) for r in saved[name]] for name in args.workloads if name in saved}
    missing = [name for name in args.workloads if name not in recordings]
    if missing:
        recordings.update(record_workloads(missing, args.tokens, args.draft))
        if args.recordings:
            saved.update({name: [vars(r) for r in recordings[name]] for name in missing})
            args.recordings.write_text(json.dumps(saved))
    results = {name: run_workload(recordings[name], costs) for name in args.workloads}
    modes = list(results[args.workloads[0]]["ratio_to_alone"])
    print(f"{'workload':>9} | " + " ".join(f"{m:>9}" for m in modes) + " | adaptive: to best fixed, steps by k")
    for name, r in results.items():
        print(f"{name:>9} | " + " ".join(f"{r['ratio_to_alone'][m]:>8.3f}x" for m in modes)
              + f" | {r['adaptive_to_best_fixed']:.3f}x, {r['adaptive_steps_by_verified']}")
        for i, req in enumerate(r["per_request"]):
            print(f"{'#' + str(i + 1):>9} | " + " ".join(f"{req[m]:>8.3f}x" for m in modes))
    if args.json:
        write_result(args.json, {"tokens": args.tokens, "costs": vars(costs), **results}, threads=2)

"""Report what this installation is made of, and whether its pieces work.

    ikdflash doctor                                   # version, fork base and patches, backends, llama-server
    ikdflash doctor --json                            # the same, machine-readable
    ikdflash doctor --target T.gguf --draft D.gguf    # also: does this draft fit this target, and why not
    ikdflash doctor --probe [--pair NAME]             # also: does DFlash pay on this machine (a short run)

--probe generates a few chat replies with the draft and with the target alone, alternating, and
says with figures whether the draft pays here: acceptance, mean acceptance length, tokens/s both
ways and their ratio, and whether the replies were identical (they must be at temperature 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ikdflash import _core
from ikdflash.serving import fork
from ikdflash.cli.stats import Cell
from ikdflash.engine import Engine, SpeculationStats
from ikdflash.sources.references import HubError, add_model_arguments, resolve_models
from ikdflash.sources.pair import check_pair

PROBE_QUESTIONS = ("Explain rainbows to a child.", "Give me a recipe for a simple tomato soup.",
                   "What are three good habits for writing maintainable code?")
PAYS = 1.05  # a speed-up above this pays; below 1 / PAYS the draft costs time


def collect() -> dict[str, Any]:
    """Everything `doctor` reports, as a dict; problems go into "problems"."""
    info = _core.build_info()
    pin = fork.base_pin()
    report: dict[str, Any] = {
        "version": info["version"],
        "base": f"ik_llama.cpp {pin['commit']} ({pin['package']} {pin['version']})",
        "base_commit": pin["commit"],
        "patches": fork.patches(),
        "backends": list(info["backends"]),
        "gpu_offload": bool(info["gpu_offload"]),
        "cpu_features": info["system"].strip(),
        "problems": [],
    }
    try:
        report["llama_server"] = str(fork.server_binary())
        report["llama_server_version"] = fork.server_version()
    except (OSError, FileNotFoundError) as e:
        report["llama_server"] = None
        report["problems"].append(f"llama-server: {e}")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_model_arguments(parser)
    parser.add_argument("--cross-ctx", type=int, help="the cross_ctx you plan to serve with")
    parser.add_argument("--probe", action="store_true", help="run a short speculation (the built-in pair unless "
                        "--pair or --target/--draft) and say whether DFlash pays on this machine")
    parser.add_argument("--probe-tokens", type=int, default=128, help="tokens per probe reply (default 128)")
    parser.add_argument("--threads", type=int)


def check_files(args: argparse.Namespace, report: dict[str, Any]) -> tuple[Path, Path] | None:
    """The pair's files when the command names one (or --probe wants the default), checked."""
    if not (args.target or args.draft or args.pair or args.probe):
        return None
    try:
        target, draft = resolve_models(args)
        pair = check_pair(target, draft, cross_ctx=args.cross_ctx)
    except (HubError, FileNotFoundError, ValueError) as e:
        report["problems"].append(f"pair: {e}")
        return None
    report["pair"] = {"target": str(target), "draft": str(draft), "facts": pair.facts, "warnings": pair.warnings}
    report["problems"] += [f"pair: {p}" for p in pair.problems]
    return None if pair.problems else (target, draft)


def probe(target: Path, draft: Path, max_tokens: int, n_threads: int | None) -> dict[str, Any]:
    """Chat replies with the draft and with the target alone, alternating so that both see the
    same machine load; the figures summed over the replies."""
    totals: dict[str, list[SpeculationStats]] = {"dflash": [], "target": []}
    identical = True
    with Engine(target, draft, n_ctx=1024 + max_tokens, n_threads=n_threads) as engine:
        for question in PROBE_QUESTIONS:
            tokens = engine.chat_tokens([("user", question)])
            spec = engine.speculate(tokens, max_tokens=max_tokens)
            plain = engine.generate(tokens, max_tokens=max_tokens)
            assert spec.stats is not None and plain.stats is not None
            totals["dflash"].append(spec.stats)
            totals["target"].append(plain.stats)
            identical &= spec.tokens == plain.tokens

    dflash, alone = Cell([totals["dflash"]]), Cell([totals["target"]])  # summed over the replies
    speedup = dflash.tokens_per_second / alone.tokens_per_second if alone.tokens_per_second else 0.0
    verdict = ("pays" if speedup >= PAYS else "costs time" if speedup <= 1 / PAYS else "about breaks even")
    return {"replies": len(PROBE_QUESTIONS), "tokens": int(dflash.total("generated")), "acceptance": dflash.acceptance,
            "mean_acceptance_length": dflash.tau, "dflash_tokens_per_second": dflash.tokens_per_second,
            "target_tokens_per_second": alone.tokens_per_second, "speedup": speedup, "verdict": verdict,
            "identical": identical}


def run(args: argparse.Namespace) -> int:
    if args.probe_tokens < 1:
        print("ikdflash doctor: error: --probe-tokens must be at least 1", file=sys.stderr)
        return 2
    report = collect()
    pair = check_files(args, report)
    if args.probe and pair:
        report["probe"] = probe(*pair, args.probe_tokens, args.threads)
        if not report["probe"]["identical"]:
            report["problems"].append("probe: the replies with the draft differ from the target's own at temperature 0")
    if args.json:
        print(json.dumps(report, indent=2))
        return 1 if report["problems"] else 0
    print(f"ikdflash        {report['version']}")
    print(f"base            {report['base']}")
    print(f"patches         {len(report['patches'])}" + "".join(f"\n  {p}" for p in report["patches"]))
    print(f"backends        {', '.join(report['backends'])}")
    print(f"cpu features    {report['cpu_features']}")
    print(f"llama-server    {report['llama_server']}")
    if report.get("llama_server_version"):
        print("                " + report["llama_server_version"].replace("\n", "\n                "))
    if "pair" in report:
        facts = report["pair"]["facts"]
        print(f"pair            {facts['draft_format']} draft, block {facts['block_size']}, window {facts['window']} "
              f"on {facts['sliding_layers']} layers, target layers {facts['target_layer_ids']} of "
              f"{facts['target_layers']} ({facts['target_arch']}, hidden {facts['target_hidden']})")
        for warning in report["pair"]["warnings"]:
            print(f"warning: {warning}")
    if "probe" in report:
        p = report["probe"]
        print(f"probe           {p['replies']} chat replies, {p['tokens']} tokens: acceptance {p['acceptance']:.1%}, "
              f"tau {p['mean_acceptance_length']:.2f}; {p['dflash_tokens_per_second']:.1f} tok/s with the draft, "
              f"{p['target_tokens_per_second']:.1f} without")
        print(f"verdict         DFlash {p['verdict']} on this machine: {p['speedup']:.2f}x")
    for problem in report["problems"]:
        print(f"problem: {problem}")
    return 1 if report["problems"] else 0

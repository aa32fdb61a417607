"""Report what this installation is made of, and whether its pieces work.

    ikdflash doctor                                   # version, fork base and patches, backends, llama-server
    ikdflash doctor --json                            # the same, machine-readable
    ikdflash doctor --target T.gguf --draft D.gguf    # also: does this draft fit this target, and why not
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ikdflash import _core, fork
from ikdflash.pair import check_pair


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
    parser.add_argument("--target", help="a target GGUF to check against --draft")
    parser.add_argument("--draft", help="a DFlash draft GGUF to check against --target")
    parser.add_argument("--cross-ctx", type=int, help="the cross_ctx you plan to serve with")


def check_files(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if not (args.target or args.draft):
        return
    if not (args.target and args.draft):
        report["problems"].append("pair: give both --target and --draft")
        return
    try:
        pair = check_pair(args.target, args.draft, cross_ctx=args.cross_ctx)
    except (FileNotFoundError, ValueError) as e:
        report["problems"].append(f"pair: {e}")
        return
    report["pair"] = {"facts": pair.facts, "warnings": pair.warnings}
    report["problems"] += [f"pair: {p}" for p in pair.problems]


def run(args: argparse.Namespace) -> int:
    report = collect()
    check_files(args, report)
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
    for problem in report["problems"]:
        print(f"problem: {problem}")
    return 1 if report["problems"] else 0

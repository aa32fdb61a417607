"""Fetch target and draft GGUFs from the Hugging Face hub into its cache, and print their paths.

    ikdflash download owner/repo:Q4_K_M                   # the Q4_K_M GGUF of a repository
    ikdflash download owner/repo/draft-Q8_0.gguf@v1.0     # one file, at a pinned revision
    ikdflash download NAME                                # both files of a known pair, checked
    HF_HUB_OFFLINE=1 ikdflash download ...                # from the cache only

References are described in ikdflash.sources.references; `ikdflash serve` accepts the same ones.
"""

from __future__ import annotations

import argparse
import sys

from ikdflash.sources.references import HubError, known_pairs, resolve, resolve_pair
from ikdflash.sources.pair import check_pair


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("refs", nargs="+", metavar="REF", help="owner/repo:QUANT, owner/repo/file.gguf, or a pair name")
    parser.add_argument("--offline", action="store_true", help="use the local cache only")


def run(args: argparse.Namespace) -> int:
    try:
        for ref in args.refs:
            if ref in known_pairs():
                target, draft = resolve_pair(ref, offline=args.offline)
                print(f"{ref} target: {target}")
                print(f"{ref} draft: {draft}")
                report = check_pair(target, draft)
                for problem in report.problems:
                    print(f"ikdflash download: error: {ref}: {problem}", file=sys.stderr)
                if not report.ok:
                    return 1
            else:
                print(f"{ref}: {resolve(ref, offline=args.offline)}")
    except (HubError, FileNotFoundError, ValueError) as e:
        print(f"ikdflash download: error: {e}", file=sys.stderr)
        return 2
    return 0

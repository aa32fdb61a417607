"""Convert a Hugging Face DFlash draft (DFlash1 or DFlash2) into a GGUF the fork loads.

    ikdflash convert DRAFT_DIR --target-model-dir TARGET [--outtype f32|f16|bf16|q8_0|q4_1] [--outfile PATH]
    python -m ikdflash.cli.convert ...        # the same, where the compiled fork is not built

DRAFT_DIR holds config.json (architecture DFlashDraftModel or DFlash2DraftModel) and safetensors
weights. TARGET is the target's Hugging Face folder (config.json + tokenizer.json) or its GGUF
file: the draft reads the target's tokenizer, hidden size and layer count from it. The format
written is in docs/gguf.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

from ikdflash.convert import OUTTYPES, ConversionError, convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("draft_dir", type=Path, help="Hugging Face DFlash draft folder")
    parser.add_argument("--target-model-dir", type=Path, required=True,
                        help="the target's Hugging Face folder or GGUF file (tokenizer, hidden size)")
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default="f16",
                        help="type of the weight matrices; norms stay F32 (default: f16)")
    parser.add_argument("--outfile", type=Path, help="output path (default: DRAFT_DIR/<name>-<TYPE>.gguf)")


def run(args: argparse.Namespace) -> int:
    try:
        convert(args.draft_dir, args.target_model_dir, outtype=args.outtype, outfile=args.outfile)
    except ConversionError as e:
        print(f"ikdflash convert: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ikdflash.cli.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

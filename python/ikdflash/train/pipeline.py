"""`ikdflash train`'s pipeline: data from the target, the draft, its training, export and
measurement, for arguments as ikdflash.cli.train parses them (docs/training.md)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ikdflash.gguf_files import default_mask_token, target_shape, target_weights

DEFAULTS = {"layers": 2, "layout": "last-full", "window": 128, "block_size": 8, "head_vocab": 16384}
# DFlash2's settings as the published drafts have them
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def run_training(args: argparse.Namespace) -> int:
    """`ikdflash train`'s stages for parsed arguments (ikdflash.cli.train's); raises ValueError,
    FileNotFoundError or ImportError on bad input before anything is made."""
    if args.corpus_rows and args.kind != "generated":
        raise ValueError("--corpus-rows adds corpus rows to --kind generated data; with --kind corpus use --data-rows")
    if args.answers and args.kind != "generated":
        raise ValueError("--answers starts --kind generated data from saved answers; add --kind generated")
    if args.answers and not args.answers.is_file():
        raise FileNotFoundError(f"--answers {args.answers}: no such file")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ImportError("ikdflash train needs torch: python -m pip install 'ikdflash[train]'") from None
    from ikdflash.convert import convert
    from ikdflash.sources.references import resolve
    from ikdflash.train import corpus, data, draft, loop

    # checked before anything is made
    settings = loop.TrainSettings(minutes=args.minutes, seed=args.seed, lr=args.lr, labels=args.labels,
                                  off_path_weight=args.off_path_weight, first_share=args.data_share, gamma=args.gamma,
                                  soft_labels=args.soft_labels, confidence_weight=args.confidence_weight,
                                  head_vocab=args.head_vocab, max_steps=args.max_steps, n_threads=args.threads,
                                  sequences_per_step=args.batch_sequences,
                                  snapshot_minutes=args.snapshot_minutes, total_minutes=args.total_minutes)
    args.target = str(resolve(args.target, role="target"))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    n_target_layers, n_embd, n_vocab = target_shape(args.target)
    layer_ids = args.target_layers or data.default_layer_ids(n_target_layers)
    mask = args.mask_token if args.mask_token is not None else default_mask_token(args.target)
    top = list(range(n_target_layers - args.layers, n_target_layers))  # the draft's layers start as these
    embd, head, top_layers, hp = target_weights(args.target, top)
    started = time.time()

    # --- data: the target over training conversations ------------------------------------------
    data_folder = args.data or out / "data"
    if args.answers:
        saved_layers = data.open_tokens(args.answers).meta["layer_ids"]
        if saved_layers != layer_ids:
            raise ValueError(f"--answers {args.answers}: saved for target layers {saved_layers}, not {layer_ids}; "
                             f"pass --target-layers {','.join(map(str, saved_layers))}")
        # resumes, and leaves a folder already grown past the saved answers as it is
        data.refresh(args.target, args.answers, data_folder, n_threads=args.threads)
    training = corpus.training_conversations(args.corpus)
    dataset = data.build(args.target, training, data_folder, layer_ids=layer_ids, kind=args.kind,
                         max_rows=args.data_rows, seq_len=args.seq_len, seed=args.seed, n_threads=args.threads,
                         system=args.system)
    print(f"data: {dataset.n_rows} rows in {dataset.meta['n_sequences']} sequences "
          f"({dataset.meta['seconds'] / 60:.1f} min to make)", file=sys.stderr)
    built = [dataset]
    if args.corpus_rows:
        training = corpus.training_conversations(args.corpus)
        built.append(data.build(args.target, training, out / "data-corpus", layer_ids=layer_ids, kind="corpus",
                                max_rows=args.corpus_rows, seq_len=args.corpus_seq_len or args.seq_len,
                                n_threads=args.threads, system=args.system))
        print(f"data: {built[1].n_rows} corpus rows ({built[1].meta['seconds'] / 60:.1f} min to make)",
              file=sys.stderr)

    # --- the draft and its training -------------------------------------------------------------
    cfg = draft.DraftConfig(
        hidden_size=n_embd, vocab_size=n_vocab, num_target_layers=n_target_layers, target_layer_ids=layer_ids,
        layer_types=draft.layer_types(args.layers, args.layout), sliding_window=args.window,
        num_attention_heads=hp["n_head"], num_key_value_heads=hp["n_head_kv"], head_dim=n_embd // hp["n_head"],
        intermediate_size=hp["n_ff"], block_size=args.block_size, mask_token_id=mask,
        rope_theta=hp["rope_theta"], max_position_embeddings=hp["context_length"],
        dflash2={name: getattr(args, name) for name in DFLASH2_DEFAULTS} if args.arch == "dflash2" else None,
        dspark={"markov_rank": args.markov_rank} if args.arch == "dspark" else None)
    model = draft.DraftModel(cfg, embd, head)
    checkpoint = out / "checkpoint.pt"
    if not checkpoint.exists():
        if args.init != "random":
            draft.init_from_target_layers(model, top_layers, hp["arch"], hp["output_norm"])
        if args.init not in ("target", "random"):  # a smaller draft keeps the target's layers below its own
            draft.init_from_draft(model, resolve(args.init, role="draft"))

    def snapshot(state: loop.TrainState) -> None:
        cfg.extra = {"steps": state.step, "train_seconds": round(state.seconds)}
        draft.save_checkpoint(model, out / "snapshots" / f"step-{state.step:06d}")

    datasets = built + [data.open_dataset(folder) for folder in args.extra_data]
    for extra in datasets[1:]:
        if (extra.meta["target"], extra.meta["layer_ids"]) != (dataset.meta["target"], dataset.meta["layer_ids"]):
            raise ValueError(f"{extra.folder}: made for {extra.meta['target']} layers {extra.meta['layer_ids']}, "
                             f"not {dataset.meta['target']} layers {dataset.meta['layer_ids']}")
    # every run of this folder is one stage of the draft's making: what it ran, from which step
    stages_path = out / "stages.json"
    stages = json.loads(stages_path.read_text()) if stages_path.is_file() else []
    stage: dict[str, Any] = {"command": shlex.join(["ikdflash", *args.argv]), "labels": args.labels,
                             "off_path_weight": args.off_path_weight, "gamma": args.gamma, "seed": args.seed,
                             "soft_labels": args.soft_labels, "arch": args.arch,
                             "init": args.init,
                             "data_rows": sum(d.n_rows for d in datasets),
                             "data_kinds": sorted({d.meta["kind"] for d in datasets})}
    state = loop.train(model, datasets, settings, checkpoint, on_snapshot=snapshot)
    stages.append(stage | {"to_step": state.step, "train_seconds": round(state.seconds)})
    stages_path.write_text(json.dumps(stages, indent=2))

    # --- export and measure ---------------------------------------------------------------------
    cfg.extra = {"steps": state.step, "train_seconds": round(state.seconds), "stages": stages}
    hf_dir = draft.save_checkpoint(model, out / "draft-hf")
    gguf_path = convert(hf_dir, Path(args.target), outtype=args.outtype, outfile=out / "draft.gguf")
    report: dict[str, Any] = {"target": os.path.basename(args.target), "draft": str(gguf_path),
                              "config": cfg.hf_config(), "history": state.history,
                              "draft_bytes": gguf_path.stat().st_size, "wall_seconds": round(time.time() - started)}
    if args.eval_prompts > 0:
        from ikdflash.train import evaluate  # the fork's own loop: the only step that needs it built

        prompts = evaluate.held_out_prompts(args.target, args.corpus, args.eval_prompts, system=args.system)
        result = evaluate.measure_acceptance(args.target, gguf_path, prompts, max_tokens=args.eval_tokens,
                                             n_threads=args.threads)
        report["held_out"] = result.as_dict()
        print(f"held-out: {result.prompts} prompts, {result.steps} steps: acceptance {result.acceptance:.1%}, "
              f"tau {result.tau:.2f}, per position "
              + " ".join(f"{p:.2f}" for p in result.per_position), file=sys.stderr)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(gguf_path)
    return 0

"""Training DFlash drafts for a GGUF target by self-distillation (needs `ikdflash[train]`: torch).

The command is `ikdflash train` (ikdflash.cli.train; docs/training.md). Its modules, in the
order the pipeline (pipeline) runs them: the corpus (corpus), the target's features (data, with
torch_target for a GPU without the fork), the draft (draft), the training loop (loop) and the
held-out measurement (evaluate).
"""

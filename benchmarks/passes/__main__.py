import sys

from benchmarks import passes
from benchmarks.harness import run_command

COMMANDS = {
    "cost": "cost",
    "ops": "ops",
    "kernel-ab": "kernel_ab",
    "repack": "repack",
    "graph-reuse": "graph_reuse",
    "one-token": "one_token",
    "capture": "capture",
    "draft-step": "draft_step",
    "draft-head": "draft_head",
    "draft-in-loop": "draft_in_loop",
    "cross-ctx-memory": "cross_ctx_memory",
    "cuda-build": "cuda_build",
}

sys.exit(run_command("benchmarks.passes", passes.__doc__ or "", COMMANDS))

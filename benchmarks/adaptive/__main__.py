import sys

from benchmarks import adaptive
from benchmarks.harness import run_command

COMMANDS = {
    "run": "workloads",
    "replay": "replay",
    "draft-confidence": "draft_confidence",
    "target-confidence": "target_confidence",
    "free-signals": "free_signals",
    "lookup-keys": "lookup_keys",
    "load-order": "load_order",
}

sys.exit(run_command("benchmarks.adaptive", adaptive.__doc__ or "", COMMANDS))

import sys

from benchmarks import server
from benchmarks.harness import run_command

COMMANDS = {
    "overhead": "overhead",
    "ab": "ab",
    "load": "load",
    "paths": "paths",
    "parallel-slots": "parallel_slots",
    "first-command": "first_command",
    "batch-variance": "batch_variance",
    "copy-heavy": "copy_heavy",
    "busy": "busy",
}

sys.exit(run_command("benchmarks.server", server.__doc__ or "", COMMANDS))

import sys

from benchmarks import training
from benchmarks.harness import run_command

COMMANDS = {
    "curve": "curve",
    "answer-rate": "answer_rate",
}

sys.exit(run_command("benchmarks.training", training.__doc__ or "", COMMANDS))

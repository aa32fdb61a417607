"""python -m ikdflash.train ...: `ikdflash train` without the rest of the command line tool, whose
other commands load the compiled fork (a lent GPU machine trains on data captured there by
`data refresh --capture torch`, with --eval-prompts 0, and needs no build)."""

import argparse
import sys

from ikdflash.cli import train

parser = argparse.ArgumentParser(prog="python -m ikdflash.train", description=train.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
train.add_arguments(parser)
args = parser.parse_args()
args.argv = ["train", *sys.argv[1:]]
sys.exit(train.run(args))

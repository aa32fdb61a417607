"""python -m ikdflash.cli: the `ikdflash` command."""

import sys

from ikdflash.cli import main

sys.exit(main())

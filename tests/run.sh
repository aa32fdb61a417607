#!/usr/bin/env bash
# Install what the tests need and run them, in the active Python environment: PyTorch's CPU
# build (unless a torch is already installed; the tests need no CUDA), the DFlash and DSpark
# references (dflash 0.1.0, speculators 0.9.0 and SpecForge 0.2.0, without the dependencies of
# their scripts and their pins; what their models import is in the test extra), ikdflash itself with its
# test and training extras (the first install builds the fork), and the built-in pair's target.
# Arguments go to pytest: bash tests/run.sh -m slow, bash tests/run.sh tests/test_engine.py
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import torch" 2>/dev/null; then
    python -m pip install --quiet torch --index-url "${IKDFLASH_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
fi
python -m pip install --quiet "transformers==5.15.0"
python -m pip install --quiet --no-deps "dflash==0.1.0" "speculators==0.9.0" "specforge==0.2.0"
python -m pip install --quiet ".[test,train]"
ikdflash download smollm2-135m-swa >/dev/null
python -m pytest "$@"

"""ikdflash: DFlash speculative decoding with sliding-window drafts on an ik_llama.cpp fork.

    from ikdflash import Model
    with Model("target.gguf", n_ctx=2048) as model:
        print(model.generate("The capital of France is", max_tokens=16).text)
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name loads its module on first use, so that the pure-Python tools (convert, the training
# data and loop) import where the compiled fork is not built, e.g. on a GPU machine without a build.
_EXPORTS = {
    "__version__": "ikdflash._core", "build_info": "ikdflash._core",
    "Generation": "ikdflash.model", "Model": "ikdflash.model",
    "Engine": "ikdflash.engine", "SpeculationResult": "ikdflash.engine",
    "SpeculationStats": "ikdflash.engine", "TokenLogprobs": "ikdflash.engine",
    "Completion": "ikdflash.serving.client", "complete": "ikdflash.serving.client",
    "Server": "ikdflash.serving.server", "ServerError": "ikdflash.serving.server",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ikdflash' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

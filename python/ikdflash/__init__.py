"""ikdflash: DFlash speculative decoding with sliding-window drafts on an ik_llama.cpp fork.

    from ikdflash import Model
    with Model("target.gguf", n_ctx=2048) as model:
        print(model.generate("The capital of France is", max_tokens=16).text)
"""

from ikdflash._core import __version__, build_info
from ikdflash.model import Generation, Model
from ikdflash.engine import Engine, Sampling, SpeculationResult, SpeculationStats, TokenLogprobs
from ikdflash.client import Completion, complete
from ikdflash.server import Server, ServerError

__all__ = ["Completion", "Engine", "Generation", "Model", "Sampling", "Server", "ServerError", "SpeculationResult",
           "SpeculationStats", "TokenLogprobs", "__version__", "build_info", "complete"]

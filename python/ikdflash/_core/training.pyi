"""ikdflash._core.training: the target's layer outputs and answers, a draft's training data."""

from typing import Any

import numpy.typing as npt

from . import Model

def layer_features(model: Model, tokens: list[int], layer_ids: list[int], top_k: int = 0
                   ) -> tuple[npt.NDArray[Any], ...]:
    """One pass over tokens (KV cache cleared): the outputs of the target layers layer_ids,
    concatenated per position ([n, len(layer_ids) * n_embd]), the greedy next token at each
    position ([n]), and with top_k > 0 each position's top_k next-token ids and their logits
    less the largest ([n, top_k] each; [n, 0] without). The last layer is refused (the fork
    keeps only its logit rows). No layer ids: nothing is captured and the features are [n, 0]."""
def generate_answers(model: Model, prompts: list[list[int]], max_tokens: int, temperatures: list[float] = ...,
                     seed: int = 0, n_parallel: int = 4, n_threads: int = 0) -> list[list[int]]:
    """The target's answers to prompts, n_parallel decoded side by side in a context of their own
    (prompt i at temperatures[i % len], seed + i; each stops before an end-of-generation token)."""

"""A target model loaded in the fork: tokenizer and plain greedy generation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from ikdflash import _core, rules


def repack_by_default(path: str | os.PathLike[str], n_gpu_layers: int = 0) -> bool:
    """Whether a model loads repacked when ``repack`` is left to None: on the CPU only (offloaded
    weights are not repacked), and where the fork would repack some weights, all Q4_1 or Q8_0, whose
    repacked kernels compute what a one-token decode computes on every row count (Q4_1's even the
    stored layout's results, bit for bit), with the head tied to the embedding table (never
    repacked; a draft cuts rows out of it). There, repacking makes decoding faster (the weights sit
    in memory of their own, not the file's pages) and verification rows cheaper."""
    return n_gpu_layers == 0 and _core.repack_keeps_results(os.fspath(path))


@dataclass
class Generation:
    """What a generation call produced."""

    text: str
    tokens: list[int] = field(default_factory=list)


class Model:
    """A GGUF model with its context, loaded by the ik_llama.cpp fork.

    Model parameters: ``n_gpu_layers`` (layers offloaded to the GPU; 0 = CPU only).
    Context parameters: ``n_ctx`` (tokens of context), ``n_batch`` (prompt tokens per
    forward pass), ``n_threads`` (CPU threads; None = up to 8, one per core). ``repack``: the
    fork's run-time repacking of CPU weights into row-interleaved layouts (llama-server's
    ``-rtr``); None: where it keeps results exact (``repack_by_default``). ``batch_invariant``:
    each position's logits do not depend on how many positions a forward pass holds, so a prompt
    read in one pass gives the logits it gives token by token (llama-server's
    ``--batch-invariant``; CPU only, prompts read slower: docs/dflash.md#batch-invariance).

    Raises FileNotFoundError for a missing file and ValueError, naming the file and the
    loader's reason, for anything the fork cannot load. Close it with ``close()``, ``with``,
    or by dropping the last reference.
    """

    def __init__(self, path: str | os.PathLike[str], *, n_ctx: int = 512, n_batch: int = 512,
                 n_threads: int | None = None, n_gpu_layers: int = 0, repack: bool | None = None,
                 batch_invariant: bool = False, verbose: bool = False) -> None:
        _core.set_verbose(verbose)
        rules.at_least_one(n_batch, "n_batch")
        if n_threads is not None:
            rules.at_least_one(n_threads, "n_threads")
        if repack is None:
            repack = repack_by_default(path, n_gpu_layers)
        self._native = _core.Model(os.fspath(path), n_ctx=n_ctx, n_threads=n_threads or 0,
                                   n_gpu_layers=n_gpu_layers, n_batch=n_batch, repack=repack,
                                   batch_invariant=batch_invariant)
        self.repacked = repack
        """Whether the weights were repacked at load."""
        self._n_threads = n_threads or 0

    # --- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- properties ------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._native.path

    @property
    def architecture(self) -> str:
        return self._native.meta("general.architecture")

    @property
    def n_vocab(self) -> int:
        return self._native.n_vocab

    @property
    def n_embd(self) -> int:
        return self._native.n_embd

    @property
    def n_layer(self) -> int:
        return self._native.n_layer

    @property
    def n_ctx(self) -> int:
        return self._native.n_ctx

    def metadata(self, key: str) -> str:
        """A GGUF metadata value as text; KeyError when the file has no such key."""
        return self._native.meta(key)

    # --- tokenizer -------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self._native.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int], *, render_special: bool = False) -> bytes:
        return self._native.detokenize(list(tokens), render_special=render_special)

    # --- generation ------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 64, stop_at_eog: bool = True) -> Generation:
        """Greedy decoding with this model alone, the reference speculation must reproduce."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        prompt_tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        tokens = self._native.generate_greedy(prompt_tokens, max_tokens, stop_at_eog=stop_at_eog)
        return Generation(text=self.detokenize(tokens).decode("utf-8", errors="replace"), tokens=tokens)

    def generate_many(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 64,
                      temperatures: Sequence[float] = (0.0,), seed: int = 0, n_parallel: int = 4) -> list[list[int]]:
        """Answers to many prompts (token lists), decoded n_parallel side by side in a context of
        their own, each up to max_tokens and stopping before an end-of-generation token. Prompt i
        is decoded at temperatures[i % len(temperatures)] (0: greedy) and, when sampled, with the
        seed seed + i. A pass over a few rows costs little more than one on a CPU, so the target's
        own answers (a draft's training data) cost less; but every row's attention reads every
        sequence's cache cells, so beyond a few sequences the gain falls (benchmarks/training/answer_rate.py)."""
        if max_tokens < 1 or n_parallel < 1:
            raise ValueError(f"max_tokens and n_parallel must be at least 1, got {max_tokens}, {n_parallel}")
        if not temperatures or any(t < 0 for t in temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {list(temperatures)}")
        if not prompts:
            return []
        return _core.training.generate_answers(self._native, [list(p) for p in prompts], max_tokens,
                                               temperatures=[float(t) for t in temperatures], seed=seed,
                                               n_parallel=min(n_parallel, len(prompts)), n_threads=self._n_threads)

    def layer_features(self, tokens: Sequence[int], layer_ids: Sequence[int], top_k: int = 0) -> tuple[Any, ...]:
        """The target's outputs at layer_ids and its greedy next token at every position of tokens
        (one pass, through the capture DFlash uses): (features, greedy); top_k > 0 adds each
        position's top_k next-token ids and logits less the largest: (features, greedy, top_ids,
        top_logits). A draft's training data."""
        return _core.training.layer_features(self._native, list(tokens), list(layer_ids), top_k)

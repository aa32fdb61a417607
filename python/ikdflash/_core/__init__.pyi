"""Types of the native module (cpp/bindings). Use the wrappers in ikdflash; these are their engine."""

from typing import Any, Callable

import numpy as np
import numpy.typing as npt

from . import measure as measure
from . import training as training

__version__: str

def set_verbose(verbose: bool) -> None:
    """Print the fork's log to stderr (off by default)."""

def build_info() -> dict[str, Any]:
    """version, backends (list), gpu_offload (bool), system (CPU features)."""

def attention_mask(key_positions: list[int], start: int, n_query: int, sliding: bool, causal: bool,
                   window: int, kv_pad: int = 1) -> npt.NDArray[np.float32]:
    """The draft's mask rule: rows = queries padded to 16, 0 = visible, -inf = hidden."""

def repack_keeps_results(path: str) -> bool: ...

LOOKUP_MAX_RUN: int  # without a draft, the most looked-up tokens a step verifies
LOOKUP_KEY_SIZE: int  # the n-gram lookup's key: the tokens it matches earlier in the sequence

def parse_spec_type(text: str) -> dict[str, Any] | None:
    """What a --spec-type value names, as llama-server parses it: None unless DFlash's; else
    draftless (the lookup alone) and the keys it names, with their values."""


class Model:
    """A GGUF model and its context. Raises FileNotFoundError / ValueError naming the file."""

    def __init__(self, path: str, n_ctx: int = 512, n_threads: int = 0, n_gpu_layers: int = 0,
                 n_batch: int = 512, repack: bool = False, mmap: bool = True,
                 batch_invariant: bool = False) -> None: ...
    def close(self) -> None: ...
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def detokenize(self, tokens: list[int], render_special: bool = False) -> bytes: ...
    def generate_greedy(self, prompt: list[int], max_tokens: int, stop_at_eog: bool = True) -> list[int]: ...
    def meta(self, key: str) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_ctx(self) -> int: ...

class Draft:
    """A DFlash draft GGUF bound to (and checked against) a target Model."""

    def __init__(self, target: Model, path: str, n_threads: int = 0, n_gpu_layers: int = -1) -> None:
        """n_gpu_layers < 0: run where the target keeps its output layer; 0: CPU; > 0: a GPU."""
    def close(self) -> None: ...
    def info(self) -> dict[str, Any]:
        """format, device, n_layer, block_size, max_proposal (tokens one pass proposes),
        mask_token, sliding_window, sliding, causal, target_layer_ids, n_target_features,
        n_head_tokens, graph_computes (graphs computed since loading: context rows projected, draft
        steps); dflash2: a DFlash2 draft's conv_kernel_size, conv_group_size, selector_rank and
        selector_top_k; dspark: a DSpark draft's markov_rank, confidence_width, anchor_first and
        window_from_block (each None for other drafts)."""
    def cache_layout(self, cross_ctx: int, full_attention: bool = False) -> dict[str, Any]:
        """capacity (rows per layer) and bytes of a cross-context, from its allocation."""
    def forward(self, features: npt.ArrayLike, positions: npt.ArrayLike, first_token: int, start: int,
                cross_ctx: int = 0, full_attention: bool = False, truncate_at: int = -1,
                then_features: npt.ArrayLike | None = None,
                then_positions: npt.ArrayLike | None = None) -> tuple[npt.NDArray[np.float32], list[int]]:
        """One draft step over these context rows: (logits [block, vocab], the proposals: the
        argmax of rows 1.., or a DFlash2 selector's or a DSpark chain's choices, from row 0 when
        anchor-first).
        truncate_at >= 0 drops the rows at positions >= it first; then_* rows are appended after."""

class CrossContext:
    """One sequence's cross-context for a Draft, driven by hand as a server slot drives it."""

    def __init__(self, draft: Draft, cross_ctx: int, full_attention: bool = False) -> None: ...
    def append(self, features: npt.ArrayLike, positions: npt.ArrayLike) -> None:
        """Feature rows (rows, n_target_features) at increasing positions after the last."""
    def truncate(self, pos: int) -> None:
        """Drop the rows at positions >= pos."""
    def shift(self, p0: int, p1: int, delta: int) -> None:
        """A context shift: drop positions [p0, p1), move the rows at >= p1 by delta."""
    def state(self) -> bytes:
        """The rows and their positions, for set_state on a context of the same draft."""
    def set_state(self, state: bytes) -> None: ...
    def n_rows(self) -> list[int]:
        """Rows held per layer."""
    def step(self, first_token: int, start: int) -> tuple[npt.NDArray[np.float32], list[int]]:
        """One draft step: (logits [block, vocab], the proposals, as forward's)."""
    def propose(self, first_token: int, start: int, n: int) -> list[int]:
        """The speculative loop's step: the first n proposals (the head on their rows only; an
        all-causal draft computes no row past them)."""
    def propose_with_confidence(self, first_token: int, start: int, n: int) -> tuple[list[int], list[float]]:
        """The same, and each token's probability under its row's softmax."""

class NgramLookup:
    """The n-gram lookup the engine and llama-server's slots offer their controller: the last
    key_size tokens found earlier in the sequence propose up to max_run tokens that followed them."""
    def __init__(self, max_run: int, key_size: int = ...) -> None: ...
    def propose(self, tokens: list[int], current: int, n_max: int) -> list[int]:
        """Up to n_max tokens after tokens and the current token (a sequence that does not extend
        the last one starts the lookup anew)."""

class BlockController:
    """The adaptive block length's controller (dflash_adapt) on pass costs given, with no model:
    pass_ms[r - 1] is a target pass over r rows (r = 1..n_max + 1 at least; more for passes shared
    with other sequences), draft_ms a draft step: one time for any number of tokens proposed, or
    draft_ms[n - 1] for n = 1..n_max tokens. confidence_cut and conf_min: how it uses the
    confidences proposed() is given (the calibrated cut, adaptive only; the fixed floor)."""

    def __init__(self, n_max: int, pass_ms: list[float], draft_ms: float | list[float],
                 adaptive: bool = True, confidence_cut: bool = True, conf_min: float = 0.0) -> None: ...
    def plan(self, n_limit: int, others: tuple[int, float, float] | None = None) -> tuple[int, int]:
        """(tokens the draft proposes, of which verified) for the next step; others: the (rows,
        expected tokens, draft ms) other sequences add to the same pass (dflash_adapt_plan_step_in)."""
    def plan_offered(self, n_limit: int, lookup: list[int],
                     others: tuple[int, float, float] | None = None) -> tuple[int, int, bool]:
        """The same with the lookup's offer for the step (dflash_adapt_offer_lookup): (tokens the
        draft proposes, of which verified, whether the step verifies the lookup's tokens instead)."""
    def proposed(self, tokens: list[int], confidence: list[float] | None = None) -> int:
        """The draft's tokens for the planned step, with their confidences or None: how many of
        them the step verifies (dflash_adapt_proposed)."""
    def committed(self, n_verified: int, tokens: list[int]) -> None: ...
    def reset(self) -> None: ...
    def observe_pass(self, n_rows: int, ms: float) -> None:
        """A target pass's time, as the engine reports each one: its cost if it had as many rows
        as the pass before, else what rebuilding the target's graph costs more."""
    def observe_draft(self, n_tokens: int, ms: float) -> None:
        """A draft step's time when it proposed n_tokens, as the engine reports each one."""
    def draft_ms(self, n_tokens: int) -> float:
        """The controller's estimate of a draft step proposing n_tokens."""
    def acceptance(self, lookup: bool = False) -> list[float]:
        """The estimate of p_j (draft token j kept, given the ones before it were), j = 1..n_max;
        lookup: of the lookup's token j."""
    def stats(self) -> dict[str, Any]:
        """steps_by_verified (0..n_max), n_probes, n_load_plain (one-token decodes that alone
        would have drafted), n_lookup_steps, n_confidence_cut and calibration (per tenth of
        predicted acceptance: compared, kept, sum of predictions) since the last reset."""

class Engine:
    """The speculative loop on a target Model (draft None: the target alone)."""

    def __init__(self, target: Model, draft: Draft | None, cross_ctx: int, full_attention: bool = False) -> None: ...
    def generate(self, prompt: list[int], max_tokens: int, n_max: int, adaptive: bool = True, lookup: int = 0,
                 confidence: bool = False, conf_min: float = 0.0, temperature: float = 0.0, seed: int = 0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, logprobs: int = 0,
                 on_commit: Callable[[list[int]], bool | None] | None = None,
                 ) -> tuple[list[int], dict[str, Any], list[tuple[float, list[tuple[int, float]]]]]:
        """Tokens, statistics (end_reason: "length", "eog", "context" or "caller") and, with
        logprobs > 0, each token's (log-probability, [(token, log-probability)] of the logprobs
        most likely). lookup: the n-gram lookup's key length (0: no lookup); confidence: draft
        tokens' confidences set how many are verified (adaptive only). on_commit gets each
        step's committed tokens; a falsy result other than None stops the generation."""
    def close(self) -> None: ...

"""DFlash speculative decoding from Python: a target, a draft, and one generation loop.

    from ikdflash import Engine
    with Engine("target.gguf", "draft.gguf", n_ctx=8192) as engine:
        out = engine.speculate("Write a haiku about rain.", max_tokens=128, n_max=4)
        print(out.text, out.stats.acceptance, out.stats.mean_acceptance_length)
        plain = engine.generate("Write a haiku about rain.", max_tokens=128)   # target alone
        for piece in engine.stream("Tell me a story.", max_tokens=128, stop=["THE END"]):
            print(piece, end="", flush=True)

Greedy speculation returns exactly the tokens plain greedy generation returns. Sampling
(temperature, top_k, top_p, min_p, repeat_penalty, seed) keeps the output the target's: the
target samples every position with the same chain, and a draft token is kept while it equals the
target's sample, so with the same seed speculation returns what generate() returns.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence, overload

from ikdflash import _core, rules
from ikdflash.chat import CHATML, messages_of, render
from ikdflash.model import Model
from ikdflash.streaming import TextDecoder, TextStream


@dataclass
class SpeculationStats:
    """Per-call statistics, as the DFlash model cards report them."""

    prompt_tokens: int
    generated: int
    drafted: int
    accepted: int
    steps: int           # target passes after the prompt (each returns accepted drafts + 1 token)
    prompt_time: float   # seconds
    draft_time: float
    verify_time: float
    step_lengths: list[int] = field(default_factory=list)  # tokens returned by each step
    steps_by_verified: list[int] = field(default_factory=list)
    """Steps by how many drafts they verified, 0..n_max: the block length's choices ([0]: steps
    that decoded one token without verifying drafts)."""
    probes: int = 0  # draft steps whose tokens were compared with the target's, not verified
    lookup_drafted: int = 0   # of drafted, the n-gram lookup's tokens (the rest are the draft's)
    lookup_accepted: int = 0  # of accepted, the lookup's
    lookup_steps: int = 0     # steps that verified the lookup's tokens instead of the draft's
    confidence_cuts: int = 0  # draft steps whose tokens' confidence changed how many were verified
    calibration: list[tuple[int, int, float]] = field(default_factory=list)
    """The draft's tokens compared with the target's, by tenth of their calibrated acceptance
    (0-0.1, ..., 0.9-1): (compared, kept, sum of the predicted acceptance)."""

    @property
    def by_proposer(self) -> dict[str, dict[str, int]]:
        """Tokens offered for verification and accepted, by who proposed them."""
        return {"draft": {"drafted": self.drafted - self.lookup_drafted, "accepted": self.accepted - self.lookup_accepted},
                "lookup": {"drafted": self.lookup_drafted, "accepted": self.lookup_accepted}}

    @property
    def reliability(self) -> list[tuple[float, float, int]]:
        """Per tenth of predicted acceptance holding tokens: (mean predicted, share kept, tokens)."""
        return [(predicted / n, kept / n, n) for n, kept, predicted in self.calibration if n]

    @property
    def acceptance(self) -> float:
        """Accepted / drafted draft tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification pass (accepted + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def plain_share(self) -> float:
        """The share of generated tokens decoded one at a time (steps that verified no drafts)."""
        plain = self.steps_by_verified[0] if self.steps_by_verified else 0
        return plain / self.generated if self.generated else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generation speed, prompt processing excluded."""
        busy = self.draft_time + self.verify_time
        return self.generated / busy if busy > 0 else 0.0


@dataclass(frozen=True)
class Sampling:
    """How the target picks each token, in this order (as llama.cpp's common sampler): the
    repetition penalty over the last ``repeat_last_n`` tokens (prompt included, the newline spared
    as llama-server spares it; 1 = off), then greedy at ``temperature`` 0, else ``top_k`` (0 = off),
    ``top_p`` (1 = off) and ``min_p`` (0 = off) on the probabilities at temperature 1, the
    temperature, and a draw seeded by ``seed``. ``logprobs`` > 0: each returned token's
    log-probability and the ``logprobs`` most likely tokens' (log-softmax of the target's raw
    logits)."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logprobs: int = 0

    def __post_init__(self) -> None:
        for check in (rules.temperature, rules.top_k, rules.top_p, rules.min_p):
            check(getattr(self, check.__name__))
        object.__setattr__(self, "seed", rules.seed(self.seed))  # -1: a random one, drawn here
        checks = [("repeat_penalty", self.repeat_penalty > 0, "> 0 (1: off)"),
                  ("repeat_last_n", self.repeat_last_n >= 0, ">= 0"), ("logprobs", self.logprobs >= 0, ">= 0")]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Sampling:
        """The Sampling named by a call's arguments (an Engine method's ``locals()``)."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})


_S = Sampling()
"""The defaults, as the C library's dflash_sampling_default() has them; the Engine methods'
sampling keywords take theirs from here."""


@dataclass
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), most likely first


@dataclass
class SpeculationResult:
    text: str
    tokens: list[int] = field(default_factory=list)
    stats: SpeculationStats | None = None
    finish_reason: str = "length"
    """"stop" (a stop string), "eos" (the target's end-of-generation token), or "length"
    (max_tokens, or the context is full)."""
    logprobs: list[TokenLogprobs] | None = None
    """With ``logprobs=N``: one entry per token in ``tokens``."""


class Engine:
    """A target GGUF and, optionally, a DFlash draft GGUF, loaded in the fork.

    Model parameters: ``n_gpu_layers``, ``repack`` (see Model). Context parameters: ``n_ctx``
    (target context), ``n_batch``, ``n_threads``, ``batch_invariant`` (see Model). DFlash parameters: ``cross_ctx`` (context
    rows the draft's full-attention layers keep; default: follow ``n_ctx``, so a sliding window
    can engage), ``full_attention`` (run every draft layer as full attention, for validation),
    ``n_gpu_layers_draft`` (where the draft runs: -1 follows the target's output layer, 0 the
    CPU, > 0 a GPU; ``draft_device`` says where it went).
    """

    def __init__(self, target: str | os.PathLike[str], draft: str | os.PathLike[str] | None = None, *,
                 n_ctx: int = 4096, cross_ctx: int | None = None, n_gpu_layers: int = 0,
                 n_threads: int | None = None, n_batch: int = 512, full_attention: bool = False,
                 n_gpu_layers_draft: int = -1, repack: bool | None = None, batch_invariant: bool = False,
                 verbose: bool = False) -> None:
        rules.cross_ctx(cross_ctx)
        self.target = Model(target, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                            n_gpu_layers=n_gpu_layers, repack=repack, batch_invariant=batch_invariant,
                            verbose=verbose)
        self.draft = self._native = None
        try:
            if draft:
                self.draft = _core.Draft(self.target._native, os.fspath(draft), n_threads or 0, n_gpu_layers_draft)
            self.cross_ctx = cross_ctx or n_ctx
            self._native = _core.Engine(self.target._native, self.draft, self.cross_ctx, full_attention)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, **kwargs: Any) -> Engine:
        """Models by reference, as `ikdflash download` takes them (a path, owner/repo:QUANT,
        owner/repo/file.gguf[@rev], a packaged file), fetched into the cache the first time."""
        from ikdflash.sources.references import resolve

        return cls(resolve(target, role="target"), resolve(draft, role="draft") if draft else None, **kwargs)

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs: Any) -> Engine:
        """A known target/draft pair by name (default: the built-in SmolLM2 pair, which needs no
        hub), fetched into the cache the first time; keyword arguments as for Engine()."""
        from ikdflash.sources.references import DEFAULT_PAIR, resolve_pair

        target, draft = resolve_pair(name or DEFAULT_PAIR)
        return cls(target, draft, **kwargs)

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
            self._native = None
        if self.draft is not None:
            self.draft.close()
        self.target.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def draft_device(self) -> str | None:
        """The backend the draft runs on ("CPU", "CUDA0", ...), None without a draft."""
        return self.draft.info()["device"] if self.draft else None

    @property
    def block_size(self) -> int:
        return self.draft.info()["block_size"] if self.draft else 1

    @property
    def max_proposal(self) -> int:
        """The most tokens one draft pass proposes: block_size - 1, or block_size for an
        anchor-first DSpark draft; 0 without a draft."""
        return self.draft.info()["max_proposal"] if self.draft else 0

    # Every generating method takes the sampling keywords of Sampling (its docstring says what
    # each does), spelt out so that a misspelt one is Python's own TypeError; Sampling.of(locals())
    # collects them, and their defaults are _S's.

    @overload
    def speculate(self, prompt: str | Sequence[int], *, stream: Literal[False] = ..., max_tokens: int = ..., n_max: int = ...,
                  adaptive: bool = ..., lookup: bool = ..., confidence: bool = ..., conf_min: float = ...,
                  stop: Sequence[str] = ...,
                  temperature: float = ..., top_k: int = ..., top_p: float = ..., min_p: float = ...,
                  repeat_penalty: float = ..., repeat_last_n: int = ..., seed: int = ..., logprobs: int = ...,
                  ) -> SpeculationResult: ...

    @overload
    def speculate(self, prompt: str | Sequence[int], *, stream: Literal[True], max_tokens: int = ..., n_max: int = ...,
                  adaptive: bool = ..., lookup: bool = ..., confidence: bool = ..., conf_min: float = ...,
                  stop: Sequence[str] = ...,
                  temperature: float = ..., top_k: int = ..., top_p: float = ..., min_p: float = ...,
                  repeat_penalty: float = ..., repeat_last_n: int = ..., seed: int = ..., logprobs: int = ...,
                  ) -> TextStream[SpeculationResult]: ...

    def speculate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, n_max: int | None = None,
                  adaptive: bool = True, lookup: bool = True, confidence: bool = False, conf_min: float = 0.0,
                  stop: Sequence[str] = (),
                  stream: bool = False,
                  temperature: float = _S.temperature, top_k: int = _S.top_k, top_p: float = _S.top_p,
                  min_p: float = _S.min_p, repeat_penalty: float = _S.repeat_penalty,
                  repeat_last_n: int = _S.repeat_last_n, seed: int = _S.seed,
                  logprobs: int = _S.logprobs) -> SpeculationResult | TextStream[SpeculationResult]:
        """Generate with DFlash: draft up to n_max tokens per step, 1 up to what one draft pass
        proposes (max_proposal; default 4, or that when fewer). Without a draft model, the
        n-gram lookup's tokens alone, where they pay (n_max up to _core.LOOKUP_MAX_RUN, 15).
        ``adaptive``: each step verifies as many of them as pay, from the acceptance measured per
        draft position and this machine's pass costs (none when drafting does not pay); False:
        every step verifies n_max. ``lookup``: an n-gram lookup over the prompt and the reply so far
        proposes beside the draft, and a step verifies its tokens instead of drafting when they
        are expected to pay more (adaptive only; docs/design.md, "N-gram lookup"). ``confidence``:
        each draft token's confidence, calibrated as the run goes, sets how many of a step's drafts
        are verified (adaptive only; off by default, as it has not paid on a CPU yet;
        docs/design.md, "Confidence"). ``conf_min``: no draft token from the first whose
        confidence is below it is verified (llama.cpp's --spec-draft-conf-min; 0: none).
        ``stop``: strings that end the text (not included).
        ``stream=True``: a TextStream of text pieces instead, as stream() returns. The sampling
        keywords are Sampling's."""
        if self.draft is None:
            if not (lookup and adaptive):
                raise ValueError("speculate() without a draft model verifies the n-gram lookup's tokens, which "
                                 "needs lookup=True and adaptive=True; generate() runs the target alone")
            n_max = rules.n_max(n_max, _core.LOOKUP_MAX_RUN, most_is="what a step verifies without a draft")
        else:
            n_max = rules.n_max(n_max, self.max_proposal)
        return self._run(prompt, max_tokens, n_max, Sampling.of(locals()), stop, stream, adaptive, lookup, confidence,
                         conf_min)

    @overload
    def generate(self, prompt: str | Sequence[int], *, stream: Literal[False] = ..., max_tokens: int = ..., stop: Sequence[str] = ...,
                  temperature: float = ..., top_k: int = ..., top_p: float = ..., min_p: float = ...,
                  repeat_penalty: float = ..., repeat_last_n: int = ..., seed: int = ..., logprobs: int = ...,
                  ) -> SpeculationResult: ...

    @overload
    def generate(self, prompt: str | Sequence[int], *, stream: Literal[True], max_tokens: int = ..., stop: Sequence[str] = ...,
                  temperature: float = ..., top_k: int = ..., top_p: float = ..., min_p: float = ...,
                  repeat_penalty: float = ..., repeat_last_n: int = ..., seed: int = ..., logprobs: int = ...,
                  ) -> TextStream[SpeculationResult]: ...

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, stop: Sequence[str] = (),
                 stream: bool = False,
                 temperature: float = _S.temperature, top_k: int = _S.top_k, top_p: float = _S.top_p,
                 min_p: float = _S.min_p, repeat_penalty: float = _S.repeat_penalty,
                 repeat_last_n: int = _S.repeat_last_n, seed: int = _S.seed,
                 logprobs: int = _S.logprobs) -> SpeculationResult | TextStream[SpeculationResult]:
        """Generate with the target alone, through the same loop and on the same memory (the
        baseline); a DFlash engine's draft is not fed, which costs nothing."""
        return self._run(prompt, max_tokens, 0, Sampling.of(locals()), stop, stream)

    @overload
    def chat(self, messages: Sequence[Mapping[str, str] | tuple[str, str]], *, stream: Literal[False] = ...,
                  max_tokens: int = ..., n_max: int = ...,
                  adaptive: bool = ..., lookup: bool = ..., confidence: bool = ..., conf_min: float = ...,
                  stop: Sequence[str] = ...,
                  temperature: float = ..., top_k: int = ..., top_p: float = ..., min_p: float = ...,
                  repeat_penalty: float = ..., repeat_last_n: int = ..., seed: int = ..., logprobs: int = ...,
                  ) -> SpeculationResult: ...

    @overload
    def chat(self, messages: Sequence[Mapping[str, str] | tuple[str, str]], *, stream: Literal[True],
                  max_tokens: int = ..., n_max: int = ...,
                  adaptive: bool = ..., lookup: bool = ..., confidence: bool = ..., conf_min: float = ...,
                  stop: Sequence[str] = ...,
                  temperature: float = ..., top_k: int = ..., top_p: float = ..., min_p: float = ...,
                  repeat_penalty: float = ..., repeat_last_n: int = ..., seed: int = ..., logprobs: int = ...,
                  ) -> TextStream[SpeculationResult]: ...

    def chat(self, messages: Sequence[Mapping[str, str] | tuple[str, str]], *, max_tokens: int = 256,
             n_max: int | None = None, adaptive: bool = True, lookup: bool = True, confidence: bool = False,
             conf_min: float = 0.0, stop: Sequence[str] = (), stream: bool = False,
             temperature: float = _S.temperature, top_k: int = _S.top_k, top_p: float = _S.top_p,
             min_p: float = _S.min_p, repeat_penalty: float = _S.repeat_penalty,
             repeat_last_n: int = _S.repeat_last_n, seed: int = _S.seed,
             logprobs: int = _S.logprobs) -> SpeculationResult | TextStream[SpeculationResult]:
        """Answer a conversation ({"role", "content"} dicts or (role, content) pairs) in the
        target's own chat template (ChatML when the GGUF has none), as llama-server's Jinja path
        renders it. With the target alone when the engine has no draft, or with n_max 0; n_max
        as for stream()."""
        sampling = Sampling.of(locals())
        n_max = rules.n_max(n_max, self.max_proposal, zero_is_target_alone=True) if self.draft else 0
        return self._run(self.chat_tokens(messages), max_tokens, n_max, sampling, stop, stream, adaptive, lookup,
                         confidence, conf_min)

    def chat_tokens(self, messages: Sequence[Mapping[str, str] | tuple[str, str]]) -> list[int]:
        """The prompt chat() sends: the conversation in the target's template, ready for its reply."""
        try:
            template = self.target.metadata("tokenizer.chat_template")
        except KeyError:
            template = CHATML
        text = render(template, messages_of(messages), add_generation_prompt=True)
        return self.target.tokenize(text, add_special=False, parse_special=True)

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128, n_max: int | None = None,
               adaptive: bool = True, lookup: bool = True, confidence: bool = False, conf_min: float = 0.0,
                  stop: Sequence[str] = (),
               temperature: float = _S.temperature, top_k: int = _S.top_k, top_p: float = _S.top_p,
               min_p: float = _S.min_p, repeat_penalty: float = _S.repeat_penalty,
               repeat_last_n: int = _S.repeat_last_n, seed: int = _S.seed,
               logprobs: int = _S.logprobs) -> TextStream[SpeculationResult]:
        """Text pieces as each step commits them; n_max as for speculate(), or 0: the target
        alone (the default without a draft). The stream's ``result`` has the tokens, statistics
        and finish_reason once it is exhausted."""
        if self.draft is None:
            if n_max:
                raise ValueError("this engine has no draft: stream with n_max=0")
            n_max = 0
        n_max = rules.n_max(n_max, self.max_proposal, zero_is_target_alone=True)
        stream = self._run(prompt, max_tokens, n_max, Sampling.of(locals()), stop, True, adaptive, lookup, confidence,
                           conf_min)
        assert isinstance(stream, TextStream)
        return stream

    def _run(self, prompt: str | Sequence[int], max_tokens: int, n_max: int, sampling: Sampling,
             stop: Sequence[str], stream: bool, adaptive: bool = False, lookup: bool = False,
             confidence: bool = False, conf_min: float = 0.0) -> SpeculationResult | TextStream[SpeculationResult]:
        if self._native is None:
            raise ValueError("the engine is closed")
        for name, flag in (("adaptive", adaptive), ("lookup", lookup), ("confidence", confidence)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        rules.conf_min(conf_min)
        key_size = _core.LOOKUP_KEY_SIZE if lookup and adaptive else 0
        rules.max_tokens(max_tokens)
        tokens = self.target.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        decoder = TextDecoder(self.target.detokenize, [stop] if isinstance(stop, str) else stop)
        options = dataclasses.asdict(sampling)

        def run(on_commit):
            return self._native.generate(tokens, max_tokens, n_max, adaptive, key_size, confidence, conf_min,
                                         on_commit=on_commit, **options)

        finish = functools.partial(_result, with_logprobs=sampling.logprobs > 0)
        if stream:
            return TextStream(run, decoder, finish)

        def on_commit(step: list[int]) -> bool:
            decoder.feed(step)
            return decoder.stopped is None  # a stop string ends the generation after this step

        return finish(run(on_commit), decoder)


def _result(native: tuple[list[int], dict[str, Any], list], decoder: TextDecoder, *,
            with_logprobs: bool) -> SpeculationResult:
    _, raw, per_token = native
    decoder.finish()
    stats = SpeculationStats(
        prompt_tokens=raw["n_prompt"], generated=raw["n_generated"], drafted=raw["n_drafted"],
        accepted=raw["n_accepted"], steps=raw["n_steps"], prompt_time=raw["t_prompt_ms"] / 1e3,
        draft_time=raw["t_draft_ms"] / 1e3, verify_time=raw["t_verify_ms"] / 1e3,
        step_lengths=list(raw["step_lengths"]), steps_by_verified=list(raw["steps_by_verified"]),
        probes=raw["n_probes"], lookup_drafted=raw["n_lookup_drafted"], lookup_accepted=raw["n_lookup_accepted"],
        lookup_steps=raw["n_lookup_steps"], confidence_cuts=raw["n_confidence_cut"],
        calibration=[tuple(tenth) for tenth in raw["calibration"]])
    reason = "stop" if decoder.stopped is not None else "eos" if raw["end_reason"] == "eog" else "length"
    kept = decoder.kept_tokens
    logprobs = None
    if with_logprobs:  # a stop string may have cut tokens off the end
        logprobs = [TokenLogprobs(token, logprob, list(top))
                    for token, (logprob, top) in zip(kept, per_token, strict=False)]
    return SpeculationResult(text=decoder.text, tokens=kept, stats=stats, finish_reason=reason, logprobs=logprobs)

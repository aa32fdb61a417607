"""Held-out acceptance of a draft GGUF, measured in the fork's own speculative loop, on the
first user turns of the corpus's held-out conversations."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ikdflash.chat import chat_template
from ikdflash.engine import Engine
from ikdflash.model import Model
from ikdflash.train.corpus import read_conversations
from ikdflash.train.data import first_turn_tokens


@dataclass
class Acceptance:
    prompts: int
    steps: int
    drafted: int
    accepted: int
    generated: int
    tokens_per_second: float
    per_position: list[float] = field(default_factory=list)  # P(draft token j accepted), j = 1..n_max

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens committed per verification."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"acceptance": self.acceptance, "tau": self.tau}


def measure_acceptance(target: str | os.PathLike[str], draft: str | os.PathLike[str], prompts: Sequence[Sequence[int]],
                       *, n_max: int = 4, max_tokens: int = 128, n_ctx: int = 4096,
                       n_threads: int | None = None) -> Acceptance:
    """Greedy speculation over each prompt, n_max drafts verified every step (the fixed block
    length: the draft's own acceptance); per-position acceptance from each step's length."""
    hits = [0] * n_max
    steps = drafted = accepted = generated = 0
    busy = 0.0
    with Engine(target, draft, n_ctx=n_ctx, n_threads=n_threads) as engine:
        for prompt in prompts:
            stats = engine.speculate(list(prompt), max_tokens=max_tokens, n_max=n_max, adaptive=False).stats
            assert stats is not None
            steps += stats.steps
            drafted += stats.drafted
            accepted += stats.accepted
            generated += stats.generated
            busy += stats.draft_time + stats.verify_time
            for length in stats.step_lengths:
                for j in range(min(length - 1, n_max)):
                    hits[j] += 1
    return Acceptance(prompts=len(prompts), steps=steps, drafted=drafted, accepted=accepted, generated=generated,
                      tokens_per_second=generated / busy if busy else 0.0,
                      per_position=[h / steps if steps else 0.0 for h in hits])


def held_out_prompts(target: str | os.PathLike[str], corpus_path: Path | None, count: int,
                     max_tokens: int = 1024, system: str | None = None) -> list[list[int]]:
    """The first user turns of held-out conversations, in the target's chat format, as tokens."""
    template = chat_template(target)
    preamble = [("system", system)] if system else []
    prompts = []
    with Model(target, n_ctx=64) as model:
        for conv in read_conversations(corpus_path):
            if not conv.held_out:
                continue
            tokens = first_turn_tokens(model, template, preamble, conv)
            if len(tokens) <= max_tokens:
                prompts.append(tokens)
            if len(prompts) == count:
                break
    if not prompts:
        raise ValueError("the corpus has no held-out conversation to measure on")
    return prompts

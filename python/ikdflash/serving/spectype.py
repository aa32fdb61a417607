"""The `--spec-type dflash[:k=v,...]` flag, on the Python side: one place that builds it for
`ikdflash serve`, the tests and anything else that starts llama-server. Its keys and values are
checked by the fork's own parser (cpp/dflash/dflash-args.cpp, bound as
_core.parse_spec_type), the one llama-server runs:

    >>> SpecType(n_max=4, cross_ctx=8192).flag()
    'dflash:n_max=4,cross_ctx=8192'
    >>> SpecType.parse("dflash:n_max=4,dflash_cross_ctx=8192").cross_ctx
    8192
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ikdflash import _core

SWITCHES = ("full_attention", "log_drafts", "confidence", "adaptive", "lookup")  # 0/1 on the command line
OFF_BY_DEFAULT = ("full_attention", "log_drafts", "confidence")  # in the server: said only when on


class SpecTypeError(ValueError):
    """A --spec-type value that llama-server would refuse; the message says why."""


@dataclass(frozen=True)
class SpecType:
    """DFlash options; None leaves the server's default (cross_ctx: the slot's context)."""

    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    cross_ctx: int | None = None
    full_attention: bool = False
    log_drafts: bool = False  # the server logs every proposal (for comparing runs)
    min_accept: float | None = None  # stop drafting for a request whose last 16 steps accept less
    adaptive: bool | None = None  # verify as many drafts as pay each step (None: the server's default, on)
    lookup: bool | None = None  # an n-gram lookup proposes beside the draft (None: the server's default, on)
    confidence: bool = False  # each draft token's confidence sets how many are verified
    conf_min: float | None = None  # no draft token from the first below this confidence is verified

    def __post_init__(self) -> None:
        _parsed(self.flag())  # the server's parser checks every value

    def flag(self) -> str:
        """The value of --spec-type."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name not in SWITCHES and getattr(self, f.name) is not None]
        parts += [f"{name}=1" for name in OFF_BY_DEFAULT if getattr(self, name)]
        for name in ("adaptive", "lookup"):  # on by default in the server: said only when asked for
            if getattr(self, name) is not None:
                parts.append(f"{name}={int(getattr(self, name))}")
        return "dflash" + (":" + ",".join(parts) if parts else "")

    @classmethod
    def parse(cls, text: str) -> SpecType:
        return cls(**_parsed(text))


def _parsed(text: str) -> dict[str, Any]:
    """The keys a --spec-type value names, parsed by the fork's parser; SpecTypeError if it refuses."""
    try:
        named = _core.parse_spec_type(text)
    except ValueError as e:
        raise SpecTypeError(str(e)) from None
    if named is None or named.pop("draftless"):
        raise SpecTypeError(f"--spec-type {text}: only 'dflash[:k=v,...]' is built here (alias "
                            "draft-dflash, dspark, draft-dspark)")
    # the parser keeps fractions as 32-bit floats: 7 significant digits give back what was written
    return {key: float(f"{value:.7g}") if isinstance(value, float) else value for key, value in named.items()}

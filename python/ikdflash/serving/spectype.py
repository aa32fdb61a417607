"""The `--spec-type dflash[:k=v,...]` grammar, on the Python side: one place that builds and
checks the flag for `ikdflash serve`, the tests and anything else that starts llama-server.

The fork parses the same grammar (cpp/dflash/dflash-args.cpp); keys and limits agree:

    >>> SpecType(n_max=4, cross_ctx=8192).flag()
    'dflash:n_max=4,cross_ctx=8192'
    >>> SpecType.parse("dflash:n_max=4,dflash_cross_ctx=8192").cross_ctx
    8192
"""

from __future__ import annotations

from dataclasses import dataclass, fields

KEYS = ("n_max", "n_min", "p_min", "cross_ctx", "full_attention", "log_drafts", "min_accept", "adaptive")
SWITCHES = ("full_attention", "log_drafts", "adaptive")  # 0/1 on the command line
FRACTIONS = ("p_min", "min_accept")
ALIASES = {"dflash_cross_ctx": "cross_ctx"}


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

    def __post_init__(self) -> None:
        for name, low in (("n_max", 1), ("n_min", 0), ("cross_ctx", 0)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                raise SpecTypeError(f"--spec-type dflash: {name} must be at least {low}, got {value}")
        for name in FRACTIONS:
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise SpecTypeError(f"--spec-type dflash: {name} must be a number in [0, 1], got {value}")

    def flag(self) -> str:
        """The value of --spec-type."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name not in SWITCHES and getattr(self, f.name) is not None]
        parts += [f"{name}=1" for name in ("full_attention", "log_drafts") if getattr(self, name)]
        if self.adaptive is not None:  # on by default in the server: said only when asked for
            parts.append(f"adaptive={int(self.adaptive)}")
        return "dflash" + (":" + ",".join(parts) if parts else "")

    @classmethod
    def parse(cls, text: str) -> SpecType:
        kind, _, rest = text.partition(":")
        if kind != "dflash":
            raise SpecTypeError(f"--spec-type {text}: only 'dflash[:k=v,...]' is built here")
        values: dict[str, object] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise SpecTypeError(f"--spec-type dflash: '{item}' is not key=value")
            key = ALIASES.get(key, key)
            if key not in KEYS:
                raise SpecTypeError(f"--spec-type dflash: unknown key '{key}' (known: {', '.join(KEYS)}, "
                                    "dflash_cross_ctx)")
            if key in SWITCHES:
                if value not in ("0", "1"):
                    raise SpecTypeError(f"--spec-type dflash: {key} must be 0 or 1, got '{value}'")
                values[key] = value == "1"
                continue
            try:
                values[key] = float(value) if key in FRACTIONS else int(value)
            except ValueError:
                raise SpecTypeError(f"--spec-type dflash: {key}={value} is not a number") from None
        return cls(**values)  # type: ignore[arg-type]

"""The value rules that every entry point applies before any work starts, so that the command
line, the Python API and `ikdflash serve` refuse the same mistake with the same message (the
table in docs/python.md#value-rules). Each check raises ValueError naming the value and its
rule, and returns the value it accepted.
"""

from __future__ import annotations

import operator
import random
from typing import NoReturn, overload

DEFAULT_N_MAX = 4
SEED_RANDOM = -1
UINT32_MAX = 2**32 - 1


def _refuse(name: str, rule: str, value: object) -> NoReturn:
    raise ValueError(f"{name} must be {rule}, got {value!r}")


def _integer(name: str, value: object) -> int:
    """value as an int: any integer type (numpy's too), not a bool or a float."""
    if isinstance(value, bool):
        _refuse(name, "an integer", value)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        _refuse(name, "an integer", value)


@overload
def n_max(value: int | None, most: int, *, zero_is_target_alone: bool = ..., name: str = ...,
          most_is: str = ...) -> int: ...
@overload
def n_max(value: int | None, most: None, *, zero_is_target_alone: bool = ..., name: str = ...,
          most_is: str = ...) -> int | None: ...


def n_max(value: int | None, most: int | None, *, zero_is_target_alone: bool = False,
          name: str = "n_max", most_is: str = "what one draft pass proposes") -> int | None:
    """Drafts verified per step: 1 up to ``most``, what one draft pass proposes (0 too, where the
    API documents it as the target alone; ``most`` None: not known yet, checked again once the
    draft is loaded). None: the default, 4 or ``most`` when fewer."""
    if value is None:
        return None if most is None else min(DEFAULT_N_MAX, most)
    low = 0 if zero_is_target_alone else 1
    if _integer(name, value) < low or (most is not None and value > most):
        rule = f"in {low}..{'N' if most is None else most} ({most_is}"
        _refuse(name, rule + ("; 0: the target alone)" if low == 0 else ")"), value)
    return value


def max_tokens(value: int, *, until_the_end: bool = False, name: str = "max_tokens") -> int:
    """Tokens to generate: at least 1; -1 where the API documents it as until EOS or the context."""
    if _integer(name, value) < 1 and not (until_the_end and value == -1):
        _refuse(name, "at least 1" + (" (-1: until EOS or the context is full)" if until_the_end else ""), value)
    return value


def temperature(value: float, name: str = "temperature") -> float:
    if not value >= 0:  # NaN too
        _refuse(name, ">= 0 (0: greedy)", value)
    return value


def top_p(value: float, name: str = "top_p") -> float:
    if not 0 < value <= 1:
        _refuse(name, "in (0, 1] (1: off)", value)
    return value


def top_k(value: int, name: str = "top_k") -> int:
    if _integer(name, value) < 0:
        _refuse(name, ">= 0 (0: off)", value)
    return value


def min_p(value: float, name: str = "min_p") -> float:
    if not 0 <= value <= 1:
        _refuse(name, "in [0, 1] (0: off)", value)
    return value


def conf_min(value: float, name: str = "conf_min") -> float:
    if not 0 <= value <= 1:
        _refuse(name, "in [0, 1] (0: off)", value)
    return value


def seed(value: int, name: str = "seed") -> int:
    """A 32-bit seed; -1 draws a random one (returned)."""
    if not SEED_RANDOM <= _integer(name, value) <= UINT32_MAX:
        _refuse(name, f"a 32-bit integer, 0..{UINT32_MAX} (-1: random)", value)
    return random.SystemRandom().getrandbits(32) if value == SEED_RANDOM else value


def cross_ctx(value: int | None, name: str = "cross_ctx") -> int | None:
    """Context rows the draft keeps; 0 (or None) follows the target's context."""
    if value is not None and _integer(name, value) < 0:
        _refuse(name, ">= 0 (0: the target's context)", value)
    return value


def port(value: int, name: str = "port") -> int:
    if not 0 <= _integer(name, value) <= 65535:
        _refuse(name, "in 0..65535 (0: a free one)", value)
    return value


def at_least_one(value: int, name: str) -> int:
    """Counts such as the context size or the number of slots."""
    if _integer(name, value) < 1:
        _refuse(name, "at least 1", value)
    return value

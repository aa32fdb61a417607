"""Statistics of generations as the commands print them: one line per generation (generate,
chat), and a mode's statistics over prompts and rounds (bench, doctor --probe)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ikdflash.engine import SpeculationStats


def summary(label: str, stats: SpeculationStats, finish_reason: str) -> str:
    line = f"{label}: {stats.generated} tokens ({finish_reason}), {stats.tokens_per_second:.1f} tok/s"
    if stats.drafted:
        line += (f", acceptance {stats.acceptance:.1%}, tau {stats.mean_acceptance_length:.2f} "
                 f"({stats.accepted}/{stats.drafted} drafts accepted in {stats.steps} steps")
        if stats.lookup_drafted:
            line += f"; the n-gram lookup's {stats.lookup_accepted}/{stats.lookup_drafted} in {stats.lookup_steps}"
        line += ")"
    if stats.steps_by_verified and stats.steps_by_verified[0]:
        line += (f"; {stats.steps_by_verified[0]} of {stats.generated} tokens decoded one at a time "
                 f"({stats.probes} probe{'' if stats.probes == 1 else 's'})")
    return line


def median_and_spread(speeds: list[float]) -> tuple[float, float]:
    """The median of rounds' speeds and half their range (0, 0 without rounds)."""
    return (statistics.median(speeds), (max(speeds) - min(speeds)) / 2) if speeds else (0.0, 0.0)


@dataclass
class Cell:
    """One mode at one length: its prompts' statistics, round by round (--repeat)."""

    rounds: list[list[SpeculationStats]] = field(default_factory=list)

    @property
    def stats(self) -> list[SpeculationStats]:
        return [s for round_ in self.rounds for s in round_]

    def total(self, name: str) -> float:
        return sum(getattr(s, name) for s in self.stats)

    @property
    def acceptance(self) -> float:
        drafted = self.total("drafted")
        return self.total("accepted") / drafted if drafted else 0.0

    @property
    def standard_error(self) -> float:
        """Of the acceptance, treating each step's accepted share of n_max as one sample."""
        n_max = max((max(s.step_lengths, default=1) for s in self.stats), default=1) - 1
        shares = [(length - 1) / n_max for s in self.stats for length in s.step_lengths] if n_max > 0 else []
        if len(shares) < 2:
            return 0.0
        mean = sum(shares) / len(shares)
        return (sum((x - mean) ** 2 for x in shares) / (len(shares) - 1) / len(shares)) ** 0.5

    @property
    def tau(self) -> float:
        steps = self.total("steps")
        return (self.total("accepted") + steps) / steps if steps else 0.0

    def round_speeds(self) -> list[float]:
        speeds = []
        for round_ in self.rounds:
            busy = sum(s.draft_time + s.verify_time for s in round_)
            speeds.append(sum(s.generated for s in round_) / busy if busy else 0.0)
        return speeds

    @property
    def tokens_per_second(self) -> float:
        """The median round's generation speed."""
        return median_and_spread(self.round_speeds())[0]

    @property
    def spread(self) -> float:
        """Half the range of the rounds' speeds (0 with one round)."""
        return median_and_spread(self.round_speeds())[1]

    @property
    def plain_share(self) -> float:
        generated = self.total("generated")
        return sum(s.steps_by_verified[0] for s in self.stats if s.steps_by_verified) / generated if generated else 0.0

    def ms_per_step(self, name: str) -> float:
        steps = self.total("steps")
        return 1e3 * self.total(name) / steps if steps else 0.0

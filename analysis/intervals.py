"""95 % intervals for the accuracies headscope shows: Wilson score intervals and seed bands.

Every accuracy on a page, in a CSV or in ``summary.json`` is a proportion of prompts answered, so it
carries its ``n`` and a Wilson score interval (Wilson 1927, "Probable Inference, the Law of Succession,
and Statistical Inference", JASA 22:209), the interval Brown, Cai & DasGupta 2001 ("Interval Estimation
for a Binomial Proportion", Statistical Science 16:101) recommend for small n: for k successes in n
trials, p̂ = k/n and z = Φ⁻¹(0.975),

    centre = (p̂ + z²/2n) / (1 + z²/n),   half-width = z/(1 + z²/n) · √(p̂(1 − p̂)/n + z²/4n²).

It never leaves [0, 1] and is not empty at p̂ = 0 or 1 (the Wald interval p̂ ± z√(p̂(1−p̂)/n) collapses
to a point there). Computed by scipy's ``binomtest(k, n).proportion_ci(method="wilson")``.

A ranking drawn at random (the random control of an ablation curve, a random KV policy) has a second
source of spread, the draw: its :func:`seed_band` is the mean over seeds with the lowest and highest
seed's value, shown beside the pooled Wilson interval of all the seeds' prompts.

Decisions made on an accuracy ("the smallest KV fraction within tolerance") compare intervals, not
points (:func:`overlaps`, :func:`reaches`, :func:`smallest_passing`), and say how many prompts they rest on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Proportion:
    """``successes`` of ``n`` with its Wilson interval ``[low, high]``; ``n = 0`` gives nan throughout."""

    successes: int
    n: int
    low: float
    high: float

    @property
    def value(self) -> float:
        return self.successes / self.n if self.n else math.nan

    def columns(self, name: str) -> dict[str, float | int]:
        """The CSV/JSON columns of this proportion under ``name``: value, n, low and high."""
        return {name: self.value, f"{name}_n": self.n, f"{name}_low": self.low, f"{name}_high": self.high}

    def text(self, digits: int = 2) -> str:
        """``0.50 [0.15, 0.85] n=4``: what a table cell or hover label shows."""
        if not self.n:
            return "n=0"
        return f"{self.value:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}] n={self.n}"


def wilson(successes: int, n: int, confidence: float = CONFIDENCE) -> Proportion:
    """The Wilson score interval of ``successes`` out of ``n`` (module docstring)."""
    from scipy.stats import binomtest

    k, n = int(successes), int(n)
    if n < 0 or not 0 <= k <= max(n, 0):
        raise ValueError(f"A proportion needs 0 <= successes <= n; got {k} of {n}.")
    if n == 0:
        return Proportion(0, 0, math.nan, math.nan)
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return Proportion(k, n, float(ci.low), float(ci.high))


def proportion_of(outcomes: Sequence[bool] | np.ndarray, confidence: float = CONFIDENCE) -> Proportion:
    """:func:`wilson` of a list of per-prompt outcomes (True = answered)."""
    values = np.asarray(outcomes, dtype=bool).reshape(-1)
    return wilson(int(values.sum()), int(values.size), confidence)


def from_accuracy(accuracy: float, n: int, confidence: float = CONFIDENCE) -> Proportion:
    """:func:`wilson` of an accuracy measured on ``n`` prompts (``accuracy · n`` is rounded to the count it
    was computed from); nan or ``n = 0`` gives the empty proportion."""
    if not n or accuracy is None or not math.isfinite(accuracy):
        return Proportion(0, 0, math.nan, math.nan)
    return wilson(int(round(float(accuracy) * n)), n, confidence)


@dataclass(frozen=True)
class SeedBand:
    """A random ranking's value over seeds: the mean and the lowest and highest seed's value."""

    mean: float
    low: float
    high: float
    n_seeds: int


def seed_band(values: Sequence[float] | np.ndarray) -> SeedBand:
    """:class:`SeedBand` of the finite ``values`` (one per seed); nan throughout when there are none."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    if not v.size:
        return SeedBand(math.nan, math.nan, math.nan, 0)
    return SeedBand(float(v.mean()), float(v.min()), float(v.max()), int(v.size))


def overlaps(a: Proportion, b: Proportion) -> bool:
    """Whether the two intervals share a point (False when either is empty)."""
    if not a.n or not b.n:
        return False
    return a.low <= b.high and b.low <= a.high


def reaches(mine: Proportion, base: Proportion, tolerance: float = 0.0) -> bool:
    """Whether the accuracy ``mine`` is within ``tolerance`` of ``base`` on their intervals: its upper bound
    reaches base's lower bound less the tolerance, high(mine) ≥ low(base) − tolerance (it overlaps
    ``[low(base) − tolerance, 1]``). Two accuracies whose intervals overlap are not told apart, and one
    above ``base`` passes; False when either has no prompts."""
    return bool(base.n and mine.n and mine.high >= base.low - tolerance - 1e-12)


T = TypeVar("T")


def smallest_passing(groups: Iterable[Sequence[T]], kv: Callable[[T], float], passes: Callable[[T], bool]) -> T | None:
    """Of ``groups`` (the policies at one fraction: one, or one per random seed), those whose every member
    passes; of them the group with the smallest mean ``kv``, and of its members the one with the largest
    (a random fraction is only as good as its worst-placed seed). None when no group passes."""
    passing = [g for g in groups if g and all(passes(x) for x in g)]
    if not passing:
        return None
    best = min(passing, key=lambda g: sum(kv(x) for x in g) / len(g))
    return max(best, key=kv)

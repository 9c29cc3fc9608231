"""Timing several variants so that a change of machine load hits all of them alike.

- :class:`Turns`: variants take turns, one denoising step each, round-robin (each variant runs in its own
  thread and waits for its turn before every step), so step ``k`` of every variant is measured within one
  round, seconds apart: a slow minute on a shared machine slows all variants' steps of that round.
- :func:`paired_speedup`: the speedup of a variant over the reference from those paired steps: the median
  of the per-round ratios with a distribution-free 95% confidence interval (order statistics), and whether
  that interval is too wide to trust (:data:`NOISY`). The median, not the mean: on a shared machine a few
  rounds are hit by a burst of load that one variant's step catches and the other's does not; three
  identical requests gave MHLA 2.09x, 2.03x, 2.12x by the median of ratios against 2.01x, 2.16x, 2.44x by
  their geometric mean (benchmarks/app_compare.py, load 5-6 on 2 cores).
- :class:`Countdown`: a time-left estimate that never rises.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

# a speedup whose 95% interval reaches further than this from its estimate (relative) is called noisy
NOISY = 0.10
COVERAGE = 0.95


def median_rank(n: int, coverage: float = COVERAGE) -> int:
    """The rank ``k`` (1-based) for which the order statistics ``[x_(k), x_(n+1-k)]`` of ``n`` samples cover
    their population's median with at least ``coverage`` (the number of samples below the median is
    Binomial(n, 1/2)); 0 when even ``[min, max]`` covers less (fewer than 6 samples at 95%)."""
    tail, k = 0.0, 0
    for i in range(n + 1):
        p = math.comb(n, i) / 2**n
        if 2 * (tail + p) > 1 - coverage:
            break
        tail += p
        k = i + 1
    return k


@dataclass(frozen=True)
class PairedSpeedup:
    """``reference / variant`` time over paired measurements: ``estimate`` (the median of the ratios), its 95%
    interval ``[low, high]`` (with fewer than 6 pairs: the smallest and largest ratio, which covers less),
    ``n`` pairs, and ``ratio_spread``: half the interquartile range of the ratios over their median."""

    estimate: float
    low: float
    high: float
    n: int
    ratio_spread: float

    @property
    def half_width(self) -> float:
        """How far the interval reaches from the estimate, relative to it (0.1: +-10%)."""
        return max(self.high / self.estimate - 1, 1 - self.low / self.estimate)

    @property
    def noisy(self) -> bool:
        """True when the interval is wider than +-:data:`NOISY`, or too few pairs make a 95% one."""
        return median_rank(self.n) == 0 or self.half_width > NOISY

    def text(self) -> str:
        """E.g. ``2.31x (2.20-2.43)``; one pair has no interval."""
        if self.n < 2:
            return f"{self.estimate:.2f}x (1 pair, no interval)"
        return f"{self.estimate:.2f}x ({self.low:.2f}-{self.high:.2f})"


def paired_speedup(reference: Sequence[float], variant: Sequence[float]) -> PairedSpeedup:
    """Speedup of ``variant`` over ``reference`` from paired times (``reference[i]`` and ``variant[i]``
    measured in the same round). ``ValueError`` for unequal lengths, no pairs or a non-positive time."""
    if len(reference) != len(variant):
        raise ValueError(f"paired times must have equal lengths, got {len(reference)} and {len(variant)}")
    if not reference:
        raise ValueError("paired_speedup() needs at least one pair")
    if min(reference) <= 0 or min(variant) <= 0:
        raise ValueError("times must be positive")
    ratios = sorted(a / b for a, b in zip(reference, variant, strict=True))
    n = len(ratios)
    median = statistics.median(ratios)
    k = median_rank(n)
    low, high = (ratios[k - 1], ratios[n - k]) if k else (ratios[0], ratios[-1])
    if n == 1:
        return PairedSpeedup(median, low, high, 1, 0.0)
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return PairedSpeedup(median, low, high, n, (q3 - q1) / 2 / median)


class Turns:
    """Round-robin turns among named workers (threads): one holds the turn at a time, in the order given.

    A worker calls :meth:`wait` before its share of work, :meth:`done` after it (the next worker in order
    gets the turn), and :meth:`leave` when it has no more work (it is skipped from then on). Only the
    holder runs, so two variants never compete for the CPU, and no worker waits for one that has left.
    """

    def __init__(self, names: Sequence[str]):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"Turns needs distinct names, got {list(names)}")
        self._order = list(names)
        self._active = set(names)
        self._holder = self._order[0]
        self._cond = threading.Condition()

    @property
    def holder(self) -> str | None:
        return self._holder

    def wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == name)

    def _pass(self, name: str) -> None:
        if not self._active:
            self._holder = None
        else:
            i = self._order.index(name)
            for k in range(1, len(self._order) + 1):
                nxt = self._order[(i + k) % len(self._order)]
                if nxt in self._active:
                    self._holder = nxt
                    break
        self._cond.notify_all()

    def done(self, name: str) -> None:
        """Ends ``name``'s turn (it must hold it): the next active worker in order gets the turn."""
        with self._cond:
            if self._holder != name:
                raise RuntimeError(f"{name!r} ended a turn it does not hold (holder: {self._holder!r})")
            self._pass(name)

    def leave(self, name: str) -> None:
        """``name`` has no more work; if it holds the turn, the next active worker gets it."""
        with self._cond:
            self._active.discard(name)
            if self._holder == name:
                self._pass(name)


class Countdown:
    """Seconds left, shown so that it counts down: a new estimate a little above the last one minus the time since
    (within 15%, or 2 s) is capped by it, so the figure does not jitter up and down from step to step; one well
    above it is shown, because the run did slow down (a loaded machine) and saying less would be wrong."""

    RISE = 0.15  # a rise by more than this share (and more than RISE_S) is real, not jitter
    RISE_S = 2.0

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._left: float | None = None
        self._at = 0.0

    def update(self, estimate: float | None) -> float | None:
        """The figure to show for ``estimate`` (None: no estimate yet, and none shown)."""
        now = self._clock()
        if estimate is None:
            return None if self._left is None else max(0.0, self._left - (now - self._at))
        estimate = max(0.0, estimate)
        if self._left is not None:
            counted = max(0.0, self._left - (now - self._at))
            if estimate <= counted * (1 + self.RISE) or estimate <= counted + self.RISE_S:
                estimate = min(estimate, counted)
        self._left, self._at = estimate, now
        return estimate


def seconds_left(
    elapsed: float,
    fraction: float,
    tails_left: int,
    tail_seconds: float | None,
    tail_elapsed: float = 0.0,
    origin: tuple[float, float] = (0.0, 0.0),
) -> float | None:
    """The run's seconds left: the denoising still to come at the rate measured since ``origin`` (``(seconds,
    fraction)`` when the first step was done: the set-up before it, text encoding and thread starts, and the
    first step's cold caches are not a rate, and extrapolating them from 10% of the steps overstated a 44 s run
    by 13 s), ``(elapsed - seconds) * (1 - fraction) / (fraction - origin fraction)`` once a tenth of the steps
    more is done (before that, no estimate), plus the variants' tails still to come (decode, video writing,
    checks), ``tail_seconds`` each, less ``tail_elapsed``: the seconds already spent on them since the last step
    (interleaved variants all decode after the last round, so leaving the tails out would say "30 s left" with 46 s
    to go and "finishing" for 18 s). With ``tail_seconds`` unknown (None) the tails are left out."""
    t0, f0 = origin
    if fraction - f0 < 0.1:
        return None
    denoising = (elapsed - t0) * (1 - fraction) / (fraction - f0) if fraction < 1 else 0.0
    return denoising + max(0.0, max(0, tails_left) * (tail_seconds or 0.0) - tail_elapsed)

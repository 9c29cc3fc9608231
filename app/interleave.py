"""The page's timing helpers beside the shared rule.

The rule itself (variants taking turns step by step, paired per-step speedups with a 95% interval, the noisy
flag) is :mod:`common.interleave`, shared with the generation CLI's ``--variant all``; its names are re-exported
here. This module adds what only the page needs:

- :class:`Countdown`: a time-left estimate that never rises.
- :func:`seconds_left`: the run's seconds left from the steps done and the tails to come.
"""

from __future__ import annotations

import time

from common.interleave import (  # noqa: F401 - the page's names for the shared rule
    COVERAGE,
    NOISY,
    PairedSpeedup,
    Turns,
    median_rank,
    paired_speedup,
)


class Countdown:
    """Seconds left, shown so that it counts down: a new estimate a little above the last one minus the time since
    (within 10%, or 1 s) is capped by it, so the figure does not jitter up and down from step to step; one well
    above it is shown, because the run did slow down (a loaded machine) and saying less would be wrong."""

    # a rise by more than this share (and more than RISE_S) is real, not jitter. 15% and 2 s capped real rises on a
    # 12 s run: the figure counted down faster than the run and said "4 s" with 8 s to go (-49%, issue 52 (4))
    RISE = 0.10
    RISE_S = 1.0

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

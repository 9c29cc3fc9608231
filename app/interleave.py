"""The page's timing helpers beside the shared rule.

The rule itself (variants taking turns step by step, paired per-step speedups with a 95% interval, the noisy
flag) is :mod:`common.interleave`, shared with the generation CLI's ``--variant all``; its names are re-exported
here. This module adds what only the page needs:

- :class:`Countdown`: a time-left estimate that never rises.
- :class:`RunEstimate`: the run's seconds left from each variant's own steps, the tails (decode, video, checks) and
  the run's end (side-by-side video, tables), measured in the run where it can be, else carried from earlier runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

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


# a stage not yet measured in this run: one step's seconds (this run's mean, None before one is measured) -> the
# stage's seconds as earlier runs on this server had it (None: unknown); a tail's prior may give one per variant, in
# the order their videos come
Prior = Callable[[float | None], float | Sequence[float] | None]


class RunEstimate:
    """The seconds a compare run has left, from what the run itself measured (issue 52 (4)).

    Fed with the moments each variant's denoising step ended (:meth:`steps`, from the page's step counts, each with
    the second it was counted) and each variant's video was done (:meth:`finished`). The estimate
    (:meth:`seconds_left`) adds up, for every variant not yet done:

    - its steps still to come at its own rate: the mean of its last :data:`WINDOW` step intervals (the seconds from the
      step before it, of whichever variant, to its end: in turns, a variant's interval is its own step and the hand-
      over; all of a round adds up to the round). A run's first step per variant is cold (text encoding, threads,
      first-call caches) and left out, as is each variant's last (the tails of the variants before it may sit inside);
      a variant not started yet (one after another) pays the cold step's extra as measured on those that did;
    - each repeat still to start: the extra seconds of a repeat's first step over a step (the last repeat's decode
      and the next one's text encoding), as measured, else one tail;
    - its tail: its decode, video and checks (a tail is measured from its last step's start to its video, less one
      step). ``tail_prior`` gives one tail for every variant, or one for each in the order their videos come (the
      page's: the last run's tails, whose first is short, with no agreement with flash to compute, and whose later
      ones are longer); once some of this run's tails are measured, those still to come are their priors scaled by
      this run's measured tails over their priors, one tail at its prior added to both (one video's tail is one
      sample); without a prior, the mean of the measured. The tail under way counts what is left of it;

    and the run's end once (the side-by-side video, the tables and the chart: ``finish_prior``; from the last video on,
    what is left of it). No estimate (None) until every variant still stepping has :data:`MIN_STEPS` step intervals
    measured, or, for variants that run one after another, the running one has (those not started take the mean
    rate). Times are seconds on one clock (``time.monotonic`` on the page), given by the caller: replayable."""

    WINDOW = 8
    MIN_STEPS = 2

    def __init__(
        self,
        variants: Sequence[str],
        steps_each: int,
        repeats: int = 1,
        interleaved: bool = True,
        tail_prior: Prior | None = None,
        finish_prior: Prior | None = None,
        start: float = 0.0,
        finish_like_tails: bool = False,
    ):
        if steps_each < 1 or repeats < 1 or not variants:
            raise ValueError(
                f"RunEstimate needs variants, steps_each >= 1 and repeats >= 1; got {list(variants)}, {steps_each}, "
                f"{repeats}"
            )
        self.variants, self.steps_each, self.repeats, self.interleaved = (
            list(variants),
            steps_each,
            repeats,
            interleaved,
        )
        self.total = steps_each * repeats
        self._tail_prior, self._finish_prior = tail_prior, finish_prior
        # the end's prior is a tail's (no run's end measured yet): corrected by this run's tails as they are
        self._finish_like_tails = finish_like_tails
        self.done = dict.fromkeys(self.variants, 0)
        self.intervals: dict[str, list[float]] = {v: [] for v in self.variants}  # warm step intervals
        self.extras: list[float] = []  # a repeat's first step beyond a step
        self.firsts: dict[str, float] = {}  # each variant's first (cold) step interval
        self.tails: list[float] = []  # this run's measured tails
        self.finish_times: dict[str, float] = {}
        self._mark = start  # the last step end or video, whichever was later: the next interval starts here
        self._last_start: dict[str, float] = {}  # when each variant's last step began (its tail's segment)
        self._step_end: dict[str, float] = {}  # when each variant's last step ended
        self._last_name: str | None = None  # the variant that ended the last step

    def steps(self, now: float, counts: Mapping[str, tuple[int, int]]) -> None:
        """The page's step counts ``{variant: (done, in all)}`` as counted at ``now``: a count that grew ended a step."""
        for name, (done, _total) in counts.items():
            if name not in self.done or done <= self.done[name]:
                continue
            for k in range(self.done[name] + 1, done + 1):  # normally one step; a missed count spreads evenly
                self._step(name, k, now)
            self.done[name] = done

    def _step(self, name: str, k: int, now: float) -> None:
        interval = now - self._mark
        if k == self.total:
            self._last_start[name] = self._mark
        elif k % self.steps_each == 1 or self.steps_each == 1:  # a repeat's first step: cold, or after a decode
            if k == 1:
                self.firsts[name] = interval
            else:
                rate = self.rate(name)
                if rate is not None:
                    self.extras.append(max(0.0, interval - rate))
        else:
            self.intervals[name] = (self.intervals[name] + [interval])[-self.WINDOW :]
        self._step_end[name] = now
        self._last_name = name
        self._mark = max(self._mark, now)

    def finished(self, now: float, name: str) -> None:
        """``name``'s video (its run) was done at ``now``."""
        if name in self.finish_times or name not in self.done:
            return
        before = max(self.finish_times.values(), default=None)
        self.finish_times[name] = now
        if self.done[name] >= self.total and name in self._last_start:
            began = self._last_start[name] if before is None else max(self._last_start[name], before)
            rate = self.rate(name)
            if rate is not None:
                self.tails.append(max(0.0, now - began - rate))
        self._mark = max(self._mark, now)

    def rate(self, name: str) -> float | None:
        """One step's seconds for ``name``: the mean of its measured intervals, else of the others' means."""
        own = self.intervals[name]
        if own:
            return statistics.fmean(own)
        others = [statistics.fmean(x) for x in self.intervals.values() if x]
        return statistics.fmean(others) if others else None

    @property
    def step_seconds(self) -> float | None:
        """This run's mean step seconds over its variants (the unit earlier runs' stages are carried in)."""
        rates = [statistics.fmean(x) for x in self.intervals.values() if x]
        return statistics.fmean(rates) if rates else None

    def cold_seconds(self) -> float:
        """A variant's first step beyond a step (its text encoding, the first call's caches), as measured."""
        extra = [
            max(0.0, t - r) for n, t in self.firsts.items() if (r := self.rate(n)) is not None and self.intervals[n]
        ]
        return statistics.fmean(extra) if extra else 0.0

    def tail_seconds(self, position: int | None = None) -> float | None:
        """The tail of the variant whose video comes ``position``-th (0-based; default the next to come)."""
        position = len(self.tails) if position is None else position
        priors = self._tail_priors()
        if priors is None:
            return statistics.fmean(self.tails) if self.tails else None
        return priors[min(position, len(priors) - 1)] * self._tail_scale(priors)

    def _tail_priors(self) -> list[float] | None:
        """One prior tail per variant, in the order the videos come (None: no prior)."""
        prior = self._tail_prior(self.step_seconds) if self._tail_prior is not None else None
        if prior is None:
            return None
        priors = [float(prior)] * len(self.variants) if isinstance(prior, (int, float)) else [float(p) for p in prior]
        if len(priors) != len(self.variants):  # another run's number of variants: its mean for each
            priors = [statistics.fmean(priors)] * len(self.variants)
        return priors

    def _tail_scale(self, priors: list[float]) -> float:
        """This run's tails so far over their priors, with one tail at its prior besides: the first video's tail
        alone is one sample (and in the built-in model's runs the shortest, flash computing no agreement)."""
        measured, pseudo = len(self.tails), statistics.fmean(priors)
        return (sum(self.tails) + pseudo) / (sum(priors[:measured]) + pseudo) if pseudo > 0 else 1.0

    def finish_seconds(self) -> float | None:
        """The run's end (side-by-side video, tables, chart): its prior; with ``finish_like_tails`` (the prior is a
        tail's, no run's end having been measured: the warm-up's small decode scaled by pixels for the first run at
        a larger size) scaled as the tails are, by what this run's tails took against theirs."""
        prior = self._finish_prior(self.step_seconds) if self._finish_prior is not None else None
        priors = self._tail_priors() if prior is not None and self._finish_like_tails and self.tails else None
        return prior if priors is None else float(prior) * self._tail_scale(priors)

    def ready(self) -> bool:
        """Enough is measured to say (see the class)."""
        stepping = [v for v in self.variants if self.done[v] < self.total]
        measured = [v for v in stepping if len(self.intervals[v]) >= self.MIN_STEPS]
        if not stepping:
            return self.step_seconds is not None or bool(self.tails)
        if self.interleaved:
            return len(measured) == len(stepping)
        return bool(measured) or any(len(x) >= self.MIN_STEPS for x in self.intervals.values())

    def holder(self) -> str | None:
        """The variant whose step is under way (None: a tail is, or nothing): one after another, the first not done;
        in turns, the next one still stepping after the one that ended the last step."""
        stepping = [v for v in self.variants if self.done[v] < self.total]
        if not stepping or any(self.done[v] >= self.total and v not in self.finish_times for v in self.variants):
            return None
        if not self.interleaved or self._last_name is None:
            return stepping[0]
        i = self.variants.index(self._last_name)
        return next(v for v in self.variants[i + 1 :] + self.variants[: i + 1] if v in stepping)

    def seconds_left(self, now: float) -> float | None:
        """The run's seconds left at ``now`` (None: too early to say)."""
        if not self.ready():
            return None
        extra = statistics.fmean(self.extras) if self.extras else (self.tail_seconds() or 0.0)
        holder = self.holder()
        left = 0.0
        position = len(self.finish_times)  # the videos still to come, in the variants' order
        for name in self.variants:
            if name in self.finish_times:
                continue
            tail = self.tail_seconds(position) or 0.0
            position += 1
            done, rate = self.done[name], self.rate(name) or 0.0
            first = self.cold_seconds() if done == 0 else 0.0
            # repeats still to begin: repeat r (1-based past the first) begins with step r * steps_each + 1
            repeats = sum(1 for r in range(1, self.repeats) if done < r * self.steps_each + 1)
            left += (self.total - done) * rate + first + repeats * extra
            if name == holder:  # its next step is under way: what it has spent of it is not left
                nxt = rate + first + (extra if done and done % self.steps_each == 0 else 0.0)
                left -= min(max(0.0, now - self._mark), nxt)
            if done >= self.total:  # in its tail (or waiting for its turn to decode): what is left of it
                since = now - max(self._step_end.get(name, now), max(self.finish_times.values(), default=0.0))
                left += max(0.0, tail - max(0.0, since))
            else:
                left += tail
        finish = self.finish_seconds() or 0.0
        if len(self.finish_times) == len(self.variants):
            finish = max(0.0, finish - (now - max(self.finish_times.values())))
        return left + finish

    def videos_left(self) -> int:
        """Variants whose video is still to come."""
        return len(self.variants) - len(self.finish_times)

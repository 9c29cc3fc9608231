"""The page's timing helpers beside the shared rule.

The rule itself (variants taking turns step by step, paired per-step speedups with a 95% interval, the noisy
flag) is :mod:`common.interleave`, shared with the generation CLI's ``--variant all``; its names are re-exported
here. This module adds what only the page needs:

- :class:`Countdown`: a time-left figure that counts down without jitter (it holds for a small rise).
- :class:`RunEstimate`: the run's seconds left from each variant's own steps, the tails (decode, video, checks) and
  the run's end (side-by-side video, tables), measured in the run where it can be, else carried from earlier runs.
- :class:`SizeCost`: a stage's seconds at a size not yet measured, from a fixed part and a part per pixel.
"""

from __future__ import annotations

import math
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
    """Seconds left, shown so that it counts down: a new estimate a little above the count (the last figure less the
    time since; within 10%, or 1 s) does not raise the figure, the figure holds instead (it stops counting down until
    the count meets the estimate), so it does not jitter up and down from step to step and does not stay below the
    estimate either; one well above the count is shown, because the run did slow down (a loaded machine) and saying
    less would be wrong; a lower one is shown at once.

    Holding, not capping at the count: a figure capped at the count kept whatever it was below the estimate when a
    small rise came, for the rest of the run: the estimate itself within 0.1 s of the time left for the last 11 s of
    a recorded 41 s run, the figure 0.8 s below it throughout, "about 3 s left" with 4.1 s to go (-22%; replayed,
    -3% holding; issue 52 (4), ``benchmarks/results/app_eta_cpu.md``)."""

    # a rise by more than this share (and more than RISE_S) is real, not jitter. 15% and 2 s capped real rises on a
    # 12 s run: the figure counted down faster than the run and said "4 s" with 8 s to go (-49%, issue 52 (4))
    RISE = 0.10
    RISE_S = 1.0

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._left: float | None = None  # the last estimate taken, at self._at
        self._at = 0.0
        self._shown = 0.0  # the last figure returned

    def update(self, estimate: float | None) -> float | None:
        """The figure to show for ``estimate`` (None: no estimate yet, and none shown)."""
        now = self._clock()
        counted = None if self._left is None else max(0.0, self._left - (now - self._at))
        if estimate is None:
            if counted is not None:
                self._shown = counted
            return counted
        estimate = max(0.0, estimate)
        if counted is not None and (estimate <= counted * (1 + self.RISE) or estimate <= counted + self.RISE_S):
            estimate = min(estimate, self._shown)  # a small rise: the figure holds
        self._left, self._at, self._shown = estimate, now, estimate
        return estimate


class SizeCost:
    """A stage's seconds against its size (pixels: frames x height x width) as a fixed part and a part per pixel
    (issue 52 (4)): on a quiet CPU a VAE decode and a video's writing and checks cost less per pixel at a larger size
    (each call's own costs), so one size's seconds scaled by pixels overstated the first run at 17x128x160 from the
    warm-up's 9x64x80 (+77% near its end).

    One value per size measured: a run's measure replaces a first guess (:meth:`add` with ``guess``: the warm-up's)
    and is averaged with an earlier run's (one run is one sample); a guess never replaces a run's measure. A size not
    measured takes the line through the two measured sizes nearest it in log size (those either side of it when it
    lies between two): ``fixed + per_pixel * size``. A line that needs a negative fixed part (the seconds per pixel
    rising with size) is replaced by the nearer size's seconds per pixel; one that needs a negative per-pixel part
    (the smaller size measured slower: on a loaded CPU one measure can be 10-30x another of the same work) by half
    the nearer size's seconds fixed and half per pixel (the warm-up's two sizes on this CPU: a third to a half
    fixed at 9x64x80, the default). With one size measured: its seconds per pixel (nothing known of a fixed part).

    Above every size measured :meth:`seconds` is the geometric mean of the line's and of the largest size's seconds
    per pixel scaled: on a loaded CPU (2-3.5 per core) the cost per pixel rose with size instead. Four first runs at
    17x128x160 after a start there had tails of 1.2-2.5 s where the line through the warm-up's two sizes said
    0.8-1.1 s and the seconds per pixel 1.4-2.2 s (replayed from a quarter on, mean |error| 17-29% with the line,
    9-17% with the seconds per pixel): at that size the decode's and the checks' tensor operations run on both
    threads, which other jobs slow many-fold (an SSIM at 17x128x160, 0.02 s on one thread, took 2-3 s on two at a
    load of 5), at the warm-up's sizes they do not. Which of the two holds past the sizes measured is not known
    there; the geometric mean errs by at most the square root of either's factor."""

    def __init__(self):
        self._at: dict[int, tuple[float, bool]] = {}  # size -> (seconds, measured by a run)

    def add(self, seconds: float, size: int, guess: bool = False) -> None:
        """``seconds`` measured at ``size`` pixels; ``guess``: a first guess (the warm-up's), not a run's measure.
        A measure that is not a positive time at a positive size is not one (ignored)."""
        if not (seconds > 0 and size > 0 and math.isfinite(seconds)):
            return
        old = self._at.get(size)
        if old is not None and old[1]:
            if guess:
                return
            seconds = (seconds + old[0]) / 2
        self._at[size] = (float(seconds), not guess)

    def __bool__(self) -> bool:
        return bool(self._at)

    def sizes(self) -> list[int]:
        return sorted(self._at)

    def fit(self, size: int) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per pixel)`` used at ``size`` (None: nothing measured)."""
        if not self._at:
            return None
        if size in self._at:
            return self._at[size][0], 0.0
        sizes = sorted(self._at)
        below, above = [s for s in sizes if s < size], [s for s in sizes if s > size]
        if below and above:
            pair = (below[-1], above[0])
        else:
            pair = tuple(sorted(sizes, key=lambda s: abs(math.log(s / size)))[:2])  # type: ignore[assignment]
        nearest = min(pair, key=lambda s: abs(math.log(s / size)))
        at = self._at[nearest][0]
        if len(pair) < 2:
            return 0.0, at / nearest
        (x1, y1), (x2, y2) = ((s, self._at[s][0]) for s in sorted(pair))
        per_pixel = (y2 - y1) / (x2 - x1)
        fixed = y1 - per_pixel * x1
        if fixed < 0:  # the seconds per pixel rise with size: the nearer size's, no fixed part
            return 0.0, at / nearest
        if per_pixel < 0:  # the larger size measured faster (noise): the nearer size's, half of it fixed
            return at / 2, at / 2 / nearest
        return fixed, per_pixel

    def seconds(self, size: int) -> float | None:
        """The stage's seconds at ``size`` pixels (None: nothing measured): :meth:`fit`'s line, above every size
        measured its geometric mean with the largest size's seconds per pixel (see the class)."""
        fit = self.fit(size)
        if fit is None:
            return None
        line = fit[0] + fit[1] * size
        largest = max(self._at)
        if size > largest and len(self._at) > 1:
            return math.sqrt(line * self._at[largest][0] * size / largest)
        return line


# a stage not yet measured in this run: one step's seconds (this run's first steps' mean, RunEstimate.step_seconds;
# None before one is measured) -> the stage's seconds as earlier runs on this server had it (None: unknown); a tail's
# prior may give one per variant, in the order their videos come
Prior = Callable[[float | None], float | Sequence[float] | None]


class RunEstimate:
    """The seconds a compare run has left, from what the run itself measured (issue 52 (4)).

    Fed with the moments each variant's denoising step ended (:meth:`steps`, from the page's step counts, each with
    the second it was counted) and each variant's video was done (:meth:`finished`). The estimate
    (:meth:`seconds_left`) adds up, for every variant not yet done:

    - its steps still to come at its own rate: the mean of its last :data:`WINDOW` step intervals (the seconds from the
      step before it, of whichever variant, to its end: in turns, a variant's interval is its own step and the hand-
      over; all of a round adds up to the round), times the machine's pace now (:meth:`pace`: the last
      :data:`RECENT_ROUNDS` rounds' intervals against what those means say, so that a load that changes mid-run is
      followed within two rounds, not a window of eight). A run's first step per variant is cold (text encoding,
      threads, first-call caches) and left out, as is each variant's last (the tails of the variants before it may
      sit inside); a variant not started yet (one after another) pays the cold step's extra as measured on those
      that did;
    - each repeat still to start: the extra seconds of a repeat's first step over a step (the last repeat's decode
      and the next one's text encoding), as measured, else one tail;
    - its tail: its decode, video and checks (a tail is measured from its last step's start to its video, less one
      step). ``tail_prior`` gives one tail for every variant, or one for each in the order their videos come (the
      page's: the last run's tails, whose first is short, with no agreement with flash to compute, and whose later
      ones are longer); once some of this run's tails are measured, those still to come are their priors scaled by
      this run's measured tails over their priors, one tail at its prior added to both (one video's tail is one
      sample); without a prior, the mean of the measured. A busier machine slows a tail too, if less than a step:
      the priors are taken at the run's first step seconds (:attr:`step_seconds`), each measured tail at the pace of
      when it was measured, and every tail to come at the pace now (:meth:`tail_slowdown`, from the steps now
      against the first). The tail under way counts what is left of it;

    and the run's end once (the side-by-side video, the tables and the chart: ``finish_prior``, at the tails' pace now;
    from the last video on, what is left of it). No estimate (None) until every variant still stepping has
    :data:`MIN_STEPS` step intervals measured, or, for variants that run one after another, the running one has (those
    not started take the mean rate). Times are seconds on one clock (``time.monotonic`` on the page), given by the
    caller: replayable."""

    WINDOW = 8
    MIN_STEPS = 2
    # the pace (:meth:`pace`): the step intervals of this many rounds (each variant's once; at least 4 intervals).
    # Five runs recorded on a loaded CPU (2-3.5 per core, the load changing) replayed, from a quarter on while a tenth
    # or more was left, the mean |error| over the five: without each quarter's extremes, 1 round 17.9%, 2: 17.5%,
    # 3: 17.7%, 4: 18.1%, 8 (about the windows alone) 18.9%; a plain mean, 2: 18.5%, 8: 21.0% (as before the pace)
    RECENT_ROUNDS = 2

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
        self._tail_slowdowns: list[float] = []  # the slowdown each was measured at
        self.firsts_window: dict[str, list[float]] = {v: [] for v in self.variants}  # the first WINDOW warm intervals
        self._recent: list[tuple[str, float]] = []  # the last warm step intervals of any variant, in order
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
            if len(self.firsts_window[name]) < self.WINDOW:
                self.firsts_window[name].append(interval)
            recent = max(4, self.RECENT_ROUNDS * len(self.variants))
            self._recent = (self._recent + [(name, interval)])[-recent:]
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
                self._tail_slowdowns.append(self.tail_slowdown())
        self._mark = max(self._mark, now)

    def rate(self, name: str) -> float | None:
        """One step's seconds for ``name`` now: :meth:`mean_rate` at the machine's :meth:`pace`."""
        mean = self.mean_rate(name)
        return None if mean is None else mean * self.pace()

    def mean_rate(self, name: str) -> float | None:
        """One step's seconds for ``name`` over its window: the mean of its measured intervals, else of the others'."""
        own = self.intervals[name]
        if own:
            return statistics.fmean(own)
        others = [statistics.fmean(x) for x in self.intervals.values() if x]
        return statistics.fmean(others) if others else None

    def pace(self) -> float:
        """The machine's pace now against the variants' window means: over the step intervals of the last
        :data:`RECENT_ROUNDS` rounds, each interval over its variant's mean, the mean of those ratios without the
        highest and lowest quarter (1: as over the windows; 0.75: the steps now take a quarter less, the other jobs'
        load fell). The pace is the machine's, common to all variants (one variant's intervals alone would be as
        noisy as the few it has); without its extremes, because on a loaded CPU one round in twenty can take 2-3x the
        others (another job's burst): a plain mean over three rounds took such a round for their pace, +63% for 10 s
        in a recorded run (+31% without the extremes)."""
        ratios = sorted(t / m for n, t in self._recent if (m := statistics.fmean(self.intervals[n])) > 0)
        if not ratios:
            return 1.0
        cut = len(ratios) // 4
        return statistics.fmean(ratios[cut : len(ratios) - cut])

    @property
    def step_seconds(self) -> float | None:
        """This run's first step seconds: the mean over its variants of their first :data:`WINDOW` warm intervals
        (what the priors are taken at; a load that changes later is :meth:`slowdown`)."""
        rates = [statistics.fmean(x) for x in self.firsts_window.values() if x]
        return statistics.fmean(rates) if rates else None

    @property
    def step_seconds_now(self) -> float | None:
        """This run's step seconds now: the mean over its variants of :meth:`rate` (the unit a stage measured now is
        carried to later runs in)."""
        rates = [r for v in self.variants if self.intervals[v] and (r := self.rate(v)) is not None]
        return statistics.fmean(rates) if rates else None

    def slowdown(self) -> float:
        """The steps now against the run's first (:attr:`step_seconds_now` over :attr:`step_seconds`; 1.5: half as
        long again, the other jobs' load rose)."""
        first, now = self.step_seconds, self.step_seconds_now
        return now / first if first and now else 1.0

    def tail_slowdown(self) -> float:
        """What the tails and the end still to come are slowed by: the square root of :meth:`slowdown`. Two recorded
        runs on a loaded CPU (2.4-2.8 per core) whose steps sped up by a fifth to a third while their tails did not
        (the steps' two threads suffer more from other jobs than a decode and a video's writing): replayed from a
        quarter on, the tails slowed as the steps were said -38% and -20% at worst, not slowed -24% and -1%, but a
        busier machine does slow a decode; the square root (-30%, -11%) errs by at most the square root of either's
        factor, as :class:`app.compare_tab._DecodeClock`'s geometric mean does."""
        return math.sqrt(self.slowdown())

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
            return statistics.fmean(self.first_pace_tails()) * self.tail_slowdown() if self.tails else None
        return priors[min(position, len(priors) - 1)] * self._tail_scale(priors) * self.tail_slowdown()

    def first_pace_tails(self) -> list[float]:
        """This run's measured tails at its first steps' pace: each over the slowdown it was measured at."""
        return [t / p for t, p in zip(self.tails, self._tail_slowdowns, strict=True)]

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
        return (sum(self.first_pace_tails()) + pseudo) / (sum(priors[:measured]) + pseudo) if pseudo > 0 else 1.0

    def finish_seconds(self) -> float | None:
        """The run's end (side-by-side video, tables, chart): its prior, slowed as the tails are; with
        ``finish_like_tails`` (the prior is a tail's, no run's end having been measured: for the first run, the
        warm-up's decodes) scaled as the tails are, by what this run's tails took against theirs."""
        prior = self._finish_prior(self.step_seconds) if self._finish_prior is not None else None
        if prior is None:
            return None
        priors = self._tail_priors() if self._finish_like_tails and self.tails else None
        return float(prior) * (1.0 if priors is None else self._tail_scale(priors)) * self.tail_slowdown()

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

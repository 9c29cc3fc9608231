"""One timing rule for every comparison of variants (the generation CLI's ``--variant all`` and the app's Compare
tab): the variants take turns, one denoising step each, and a speedup is read from the paired steps.

- :class:`Turns`: round-robin turns among named workers (threads), so that step ``k`` of every variant runs
  within one round, seconds apart: a slow minute on a shared machine slows all variants' steps of that round.
- :class:`StepClock`: times one variant's denoising steps from its transformer's calls (forward hooks) and takes
  its turn between steps; :func:`take_turns` runs one worker per variant under it and reports each as it ends.
- :func:`paired_speedup`: the speedup of a variant over the reference from those paired steps: the median of the
  per-round ratios with a distribution-free 95% confidence interval (order statistics), and whether that interval
  is too wide to trust (:data:`NOISY`). The median, not the mean: on a shared machine a few rounds are hit by a
  burst of load that one variant's step catches and the other's does not; three identical requests gave MHLA
  2.09x, 2.03x, 2.12x by the median of ratios against 2.01x, 2.16x, 2.44x by their geometric mean
  (benchmarks/app_compare.py, load 5-6 on 2 cores). :func:`step_speedup` pairs two variants' runs by this rule.

Nothing here knows a model: the transformers are ``torch.nn.Module``\\ s, the work is the caller's.
"""

from __future__ import annotations

import math
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .timing import Timing, sync

# a speedup whose 95% interval reaches further than this from its estimate (relative) is called noisy
NOISY = 0.10
COVERAGE = 0.95
MAX_REPEATS = 10  # timed runs per variant, the page's Repeats and the CLI's --repeats


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
    def width_text(self) -> str:
        """The half-width in whole percent, rounded up (``±11%`` for 10.04%: one past the noisy line never reads
        as on it)."""
        return f"±{math.ceil(round(self.half_width * 100, 6))}%"

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


def paired_steps(timings: Sequence[Timing]) -> list[float]:
    """The steps of a variant's runs that enter the paired speedups: each run's first step is a warm-up (new
    shapes, cold caches, a compile) and is left out, unless it is the only one (:attr:`Timing.warm_steps`)."""
    return [s for t in timings for s in t.warm_steps]


def step_speedup(reference: Sequence[Timing], variant: Sequence[Timing]) -> PairedSpeedup | None:
    """Per denoising step, ``variant``'s runs over ``reference``'s: step ``k`` of each run pairs with the
    reference's step ``k`` (:func:`paired_steps`, as many pairs as both have); None without a pair."""
    a, b = paired_steps(reference), paired_steps(variant)
    n = min(len(a), len(b))
    return paired_speedup(a[:n], b[:n]) if n else None


def speedup_text(s: PairedSpeedup | None) -> str:
    """A table cell: ``2.31x (2.20-2.43)``, then ``noisy ±14%`` when the interval is wider than +-10% (or says that
    too few pairs make a 95% interval: fewer than 6)."""
    if s is None:
        return "-"
    if not s.noisy:
        return s.text()
    if s.n > 1 and median_rank(s.n) == 0:
        return s.text() + f" noisy: {s.n} pairs, too few for a 95% interval"
    return s.text() + (f" noisy {s.width_text}" if s.n > 1 else " noisy")


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
        self._holder: str | None = self._order[0]
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


class RunCancelled(Exception):
    """The run was stopped (the page's Stop, the CLI's Ctrl-C): a variant ends before its next transformer call."""


# on_step(variant, steps done in this run, finished): a step begins (finished False) or ends (True)
StepCallback = Callable[[str, int, bool], None]


class StepClock:
    """Times one variant's denoising steps from its transformers' calls, and takes turns with the other variants
    between steps (:class:`Turns`).

    Forward hooks on the transformers (public torch API; two for a two-expert model, which calls one or the other
    per step): diffusers' pipeline calls them ``per_step`` times a step (twice with classifier-free guidance). A
    step is timed from its first call's start to its last call's end, the device synchronised before each clock
    read (GPU work is counted where it runs), so waiting for the turn is never counted. Hooks count only calls
    from the thread that entered the clock (variants sharing one transformer run one after another, each in its
    thread). ``interleaved`` False: no turns between steps (the variants run one after another).
    """

    def __init__(
        self,
        name: str,
        modules: torch.nn.Module | Sequence[torch.nn.Module],
        turns: Turns,
        per_step: int,
        interleaved: bool = True,
        cancel: threading.Event | None = None,
        on_step: StepCallback | None = None,
        device: torch.device | str | None = None,
    ):
        if per_step < 1:
            raise ValueError(f"per_step must be >= 1 transformer call per step, got {per_step}")
        self.name, self.turns, self.per_step, self.interleaved = name, turns, per_step, interleaved
        self.modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        self.cancel, self.on_step, self.device = cancel, on_step, device
        self.thread = threading.get_ident()
        self._hooks: list[Any] = []
        self.begin()

    def begin(self) -> None:
        """A new run (a repeat) of this variant: its step count and times start afresh."""
        self.calls, self.first, self.last, self._t = 0, 0.0, 0.0, 0.0
        self.steps: list[float] = []

    def __enter__(self) -> StepClock:
        self.thread = threading.get_ident()
        seen: set[int] = set()
        for m in self.modules:
            if id(m) in seen:
                continue
            seen.add(id(m))
            self._hooks += [m.register_forward_pre_hook(self._before), m.register_forward_hook(self._after)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def check(self) -> None:
        """Raises :class:`RunCancelled` once the run's cancel event is set."""
        if self.cancel is not None and self.cancel.is_set():
            raise RunCancelled

    def _now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def _before(self, _module: torch.nn.Module, _args: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        if self.calls % self.per_step == 0:
            if self.calls and self.interleaved:  # a step is done: the next variant's turn
                self.turns.done(self.name)
                self.turns.wait(self.name)
            self.check()
            self._t = self._now()
            if not self.calls:
                self.first = self._t
            if self.on_step is not None:
                self.on_step(self.name, len(self.steps), False)
        else:
            self.check()

    def _after(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        self.calls += 1
        if self.calls % self.per_step == 0:
            self.last = self._now()
            self.steps.append(self.last - self._t)
            if self.on_step is not None:
                self.on_step(self.name, len(self.steps), True)

    def timing(self, t: Timing, start: float, end: float) -> Timing:
        """A generation's timing with the stages as this variant's own compute: its steps as timed here, text
        encoding up to its first step, VAE decoding after its last (no time spent waiting for its turn)."""
        from dataclasses import replace

        t = replace(t, steps=list(self.steps))
        t.denoising = sum(self.steps)
        t.text_encoding = self.first - start
        t.vae_decode = end - self.last
        t.total = t.text_encoding + t.denoising + t.vae_decode
        return t


@dataclass
class Outcome:
    """How one variant's worker ended: ``value`` (what ``work`` returned), or ``error`` (what it raised;
    :class:`RunCancelled` when the run was stopped)."""

    name: str
    value: Any = None
    error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return isinstance(self.error, RunCancelled)


Modules = torch.nn.Module | Sequence[torch.nn.Module]


def take_turns(
    names: Sequence[str],
    modules: Callable[[str], Modules],
    work: Callable[[str, StepClock], Any],
    per_step: int,
    interleaved: bool = True,
    cancel: threading.Event | None = None,
    on_step: StepCallback | None = None,
    device: torch.device | str | None = None,
    thread_name: str = "turns",
) -> Iterator[Outcome]:
    """Runs ``work(name, clock)`` for every variant ``name`` in its own thread under a :class:`StepClock` on
    ``modules(name)`` (its transformers; called in the variant's first turn, so a transformer may be loaded there
    when the variants run one after another), the variants taking turns one denoising step each in the order of
    ``names`` (``interleaved`` False: one after another, each whole run in its turn; variants that share a
    transformer must). ``work`` runs its generations (the clock's :meth:`StepClock.begin` and
    :meth:`StepClock.timing` per run) and whatever follows them, all inside the variant's turn. Yields each
    variant's :class:`Outcome` as it ends. Closing the generator early (the consumer went away, Ctrl-C) sets
    ``cancel`` (one is made when none is given): every variant stops before its next transformer call, and the
    threads are joined before it returns."""
    turns = Turns(names)
    stop = cancel if cancel is not None else threading.Event()
    events: queue.Queue[Outcome] = queue.Queue()

    def run(name: str) -> None:
        outcome = Outcome(name)
        try:
            turns.wait(name)
            clock = StepClock(name, modules(name), turns, per_step, interleaved, stop, on_step, device)
            with clock:
                clock.check()
                outcome.value = work(name, clock)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, who decides
            outcome.error = e
        finally:
            turns.leave(name)
            events.put(outcome)

    threads = [threading.Thread(target=run, args=(n,), name=f"{thread_name}-{n}", daemon=True) for n in names]
    for t in threads:
        t.start()
    finished = 0
    try:
        while finished < len(names):
            try:
                outcome = events.get(timeout=0.5)  # a timeout: Ctrl-C reaches the main thread while it waits
            except queue.Empty:
                continue
            finished += 1
            yield outcome
    finally:
        if any(t.is_alive() for t in threads):
            stop.set()  # the consumer went away: end the variants' threads too
        for t in threads:
            t.join()


def machine_load() -> str:
    """The 1-minute load average against the cores, e.g. ``load 1.9 on 2 cores`` ('' where unknown)."""
    import os

    try:
        return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except (OSError, AttributeError):
        return ""


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def format_paired_comparison(timings: dict[str, list[Timing]], interleaved: bool = True, repeats: int = 1) -> str:
    """Several variants' runs side by side (``timings``: each variant's runs, in the order they took turns), one row
    per variant, and the lines that say how to read it. Stage columns are medians over the runs; "step s" is the
    median of the paired steps (each run's first left out, as "first s" shows it); "vs flash per step" is
    :func:`step_speedup` over flash (the first variant without flash) with its 95% interval, "noisy" past
    +-:data:`NOISY`, and every speedup is noisy when the variants did not take turns (``interleaved`` False)."""
    names = list(timings)
    if not names:
        raise ValueError("format_paired_comparison() needs at least one variant's timings")
    reference = "flash" if "flash" in timings else names[0]
    speedups = {n: None if n == reference else step_speedup(timings[reference], timings[n]) for n in names}

    def cell(name: str) -> str:
        if name == reference:
            return "reference"
        text = speedup_text(speedups[name])
        if not interleaved and speedups[name] is not None and "noisy" not in text:
            text += " noisy"
        return text

    head = (
        "variant",
        "tokens",
        "M",
        "total s",
        "text s",
        "denoise s",
        "first s",
        "step s",
        f"vs {reference} per step (95% interval)",
        "pairs",
        "attn s",
        "VAE s",
        "peak",
        "softmax",
    )
    rows = [head]
    for name in names:
        runs = timings[name]
        last = runs[-1]
        s = speedups[name]
        peak = max((t.peak_memory_bytes or 0) for t in runs)
        rows.append(
            (
                name,
                str(last.num_tokens),
                "-" if last.num_blocks is None else str(last.num_blocks),
                f"{_median([t.total for t in runs]):.3f}",
                f"{_median([t.text_encoding for t in runs]):.3f}",
                f"{_median([t.denoising for t in runs]):.3f}",
                f"{_median([t.steps[0] for t in runs if t.steps]):.3f}",
                f"{_median(paired_steps(runs)):.3f}",
                cell(name),
                "-" if s is None else str(s.n),
                f"{_median([t.self_attention for t in runs]):.3f}",
                f"{_median([t.vae_decode for t in runs]):.3f}",
                "-" if last.peak_memory_bytes is None else f"{peak / 2**30:.2f}G",
                last.softmax_backend or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    runs_text = f"{repeats} runs per variant" if repeats > 1 else "one run per variant"
    if interleaved:
        how = (
            f"the variants took turns, one denoising step each ({runs_text}), so a change of machine load hits all "
            "alike"
        )
    else:
        how = (
            f"the variants ran one after another ({runs_text}), so a change of machine load between them shows up "
            "as a speedup: every speedup is marked noisy"
        )
    lines += [
        "",
        f"vs {reference} per step: the median of the paired ratios {reference}/variant (step k of each run with "
        f"{reference}'s step k; each run's first step is a warm-up, left out) with a distribution-free 95% interval; "
        f"{how}.",
    ]
    noisy = [n for n, s in speedups.items() if s is not None and (s.noisy or not interleaved)]
    if noisy:
        wide = ", ".join(
            f"{n} ({s.width_text})" if median_rank(s.n) else f"{n} ({s.n} pair{'s' if s.n > 1 else ''})"
            for n in noisy
            if (s := speedups[n]) is not None
        )
        load = machine_load()
        lines.append(
            f"noisy: {wide}: the interval reaches past ±{NOISY:.0%}"
            + ("" if interleaved else " or the variants did not interleave")
            + "; raise --repeats or --steps, or run on a quieter machine"
            + (f" ({load} now)." if load else ".")
        )
    return "\n".join(lines)

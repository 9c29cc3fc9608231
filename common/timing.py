"""Timers for generation and a printable timing table.

GPU work is asynchronous, so wall-clock stages synchronise the device before reading the clock
(:func:`sync`), and time inside self-attention is measured with CUDA events, which cost no sync per call.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device | str | None) -> None:
    """Waits for queued GPU work on ``device`` (no-op on CPU), so a wall clock read after it is honest."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device | str) -> str:
    """What a person calls the device: the GPU's name, or the CPU model with the threads torch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # /proc/cpuinfo names the CPU model on Linux; platform.processor() is often empty there
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


@dataclass(frozen=True)
class Spread:
    """Median of timing samples and their interquartile range ``[low, high]`` (both quartiles equal the
    median for one sample). The quartiles, not min/max: one preempted step on a shared machine should
    not make the spread look huge, but a noisy machine should."""

    median: float
    low: float
    high: float
    n: int

    @property
    def relative(self) -> float:
        """Half the interquartile range over the median (0.1: about +-10 %)."""
        return (self.high - self.low) / 2 / self.median if self.median > 0 else 0.0

    def overlaps(self, other: Spread) -> bool:
        """True when the two ranges overlap: a ratio of the medians is then within the noise."""
        return self.low <= other.high and other.low <= self.high


def spread(samples: Iterable[float]) -> Spread:
    """:class:`Spread` of ``samples`` (seconds, or any unit); ``ValueError`` when there are none."""
    values = sorted(float(s) for s in samples)
    if not values:
        raise ValueError("spread() needs at least one sample")
    if len(values) == 1:
        return Spread(values[0], values[0], values[0], 1)
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(statistics.median(values), low, high, len(values))


def time_call(fn: Callable[[], object], device: torch.device | str, warmup: int = 1, repeats: int = 3) -> Spread:
    """Seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones: the wall clock around each
    call, the device synchronised before reading it (so GPU work is counted where it runs)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return spread(times)


class AttentionTimer:
    """Accumulates time spent inside self-attention while :attr:`enabled`.

    On CPU: wall clock (``time.perf_counter``) around each call. On CUDA: a pair of events per call,
    summed by :meth:`seconds` after one synchronisation.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.calls = 0
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def reset(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.calls = 0
        self._cpu_seconds = 0.0
        self._events = []

    @contextmanager
    def measure(self, device: torch.device) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self.calls += 1
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._cpu_seconds += time.perf_counter() - t0

    def seconds(self) -> float:
        """Total measured seconds (synchronises the GPU when CUDA events were recorded)."""
        if self._events:
            self._events[-1][1].synchronize()
        return self._cpu_seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1000.0


@dataclass
class Timing:
    """Where the time of one generation went. Seconds unless named otherwise."""

    variant: str
    device: str
    dtype: str
    total: float = 0.0
    text_encoding: float = 0.0
    denoising: float = 0.0
    steps: list[float] = field(default_factory=list)
    vae_decode: float = 0.0
    self_attention: float = 0.0
    self_attention_calls: int = 0
    peak_memory_bytes: int | None = None
    num_tokens: int = 0
    grid: tuple[int, int, int] = (0, 0, 0)
    layout: str = "-"
    num_blocks: int | None = None
    softmax_backend: str | None = None
    random_weights: bool = False

    @property
    def per_step(self) -> float:
        """Mean seconds per denoising step, the first (cold) step included."""
        return sum(self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def warm_steps(self) -> list[float]:
        """The steps that say how fast a step is: the first is a warm-up (new shapes, cold caches, kernel
        compiles) and is left out, unless it is the only one. The CLI and the app both time by this rule."""
        return self.steps[1:] if len(self.steps) > 1 else list(self.steps)

    @property
    def step(self) -> float:
        """Median seconds of the warm steps (0.0 without steps)."""
        return statistics.median(self.warm_steps) if self.steps else 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Timing:
        """The inverse of :meth:`as_dict`: its derived keys (``per_step``, ``step``) are left out."""
        names = {f.name for f in fields(cls)}
        kept: dict[str, Any] = {k: tuple(v) if k == "grid" else v for k, v in d.items() if k in names}
        return cls(**kept)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["per_step"] = self.per_step
        d["step"] = self.step
        return d


def _peak(b: int | None) -> str:
    return "n/a (CPU)" if b is None else f"{b / 2**30:.2f} GiB"


def _step_text(timing: Timing) -> str:
    if len(timing.steps) < 2:
        return f"{timing.step:.3f} s (one step: no warm-up left out)"
    return f"{timing.step:.3f} s (median of steps 2-{len(timing.steps)}; the first, a warm-up: {timing.steps[0]:.3f} s)"


def format_timing(timing: Timing) -> str:
    """One generation's timing as a two-column table."""
    f, h, w = timing.grid
    rows = [
        ("variant", timing.variant + ("  (RANDOM WEIGHTS: output is noise)" if timing.random_weights else "")),
        ("device / dtype", f"{timing.device} / {timing.dtype}"),
        ("tokens (F x H x W)", f"{timing.num_tokens} ({f}x{h}x{w})"),
        ("MHLA layout", timing.layout),
        ("softmax backend", timing.softmax_backend or "-"),
        ("total", f"{timing.total:.3f} s"),
        ("text encoding", f"{timing.text_encoding:.3f} s"),
        ("denoising", f"{timing.denoising:.3f} s ({len(timing.steps)} steps)"),
        ("per step", _step_text(timing)),
        ("inside self-attention", f"{timing.self_attention:.3f} s ({timing.self_attention_calls} calls)"),
        ("VAE decode", f"{timing.vae_decode:.3f} s"),
        ("peak GPU memory", _peak(timing.peak_memory_bytes)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def format_comparison(timings: list[Timing]) -> str:
    """Several generations side by side, one row per variant (for READMEs and benchmarks). "step s" is the
    median warm step (:attr:`Timing.step`, the first step left out as the app does), "first s" the first step;
    "vs <first variant>" is the first row's warm step over this row's (flash, when flash ran)."""
    head = (
        "variant",
        "tokens",
        "M",
        "total s",
        "text s",
        "denoise s",
        "first s",
        "step s",
        f"vs {timings[0].variant}" if timings else "vs first",
        "attn s",
        "VAE s",
        "peak",
        "softmax",
    )
    rows = [head]
    base = timings[0].step if timings else 0.0
    for t in timings:
        rows.append(
            (
                t.variant,
                str(t.num_tokens),
                "-" if t.num_blocks is None else str(t.num_blocks),
                f"{t.total:.3f}",
                f"{t.text_encoding:.3f}",
                f"{t.denoising:.3f}",
                f"{t.steps[0]:.3f}" if t.steps else "-",
                f"{t.step:.3f}",
                f"{base / t.step:.2f}x" if base > 0 and t.step > 0 else "-",
                f"{t.self_attention:.3f}",
                f"{t.vae_decode:.3f}",
                "-" if t.peak_memory_bytes is None else f"{t.peak_memory_bytes / 2**30:.2f}G",
                t.softmax_backend or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)

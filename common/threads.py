"""How many threads torch's CPU ops use on a machine other work shares.

torch splits each CPU op over its intra-op threads and waits for all of them at the op's end. On a machine of few
cores that other processes also use, one of those threads is often off its core, and every op then waits for the
scheduler to give it back: the built-in model's 20 steps took 20-46 s with two threads on this 2-core CPU at load
~5, and 1.0 s with one (0.05 s a step either way when the machine was quiet). So the CLI and the app, when the user
has not fixed a thread count (``OMP_NUM_THREADS``), measure how many cores other work keeps busy and give torch
the rest (at least one): all cores on a quiet machine, one when another job holds a core. The app asks again before
each request. Nothing here changes a thread count unless an entry point has switched the policy on
(:func:`enable_auto`), so library use and tests keep the process's setting.
"""

from __future__ import annotations

import os
import time

__all__ = ["choose_threads", "others_busy", "usable_cores", "pick", "enable_auto", "adjust", "auto_enabled"]

WINDOW_S = 0.2  # how long the other work's CPU use is sampled for
_state: dict[str, int | bool] = {"auto": False, "cores": 1}


def choose_threads(cores: int, others: float) -> int:
    """The intra-op threads for ``cores`` usable cores when other work keeps ``others`` cores busy: the cores
    left, rounded to the nearest whole one, at least 1 and at most ``cores`` (2 cores: others < 0.5 -> 2,
    else 1)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return max(1, min(cores, int(cores - max(0.0, others) + 0.5)))


def _busy_seconds() -> float | None:
    """Seconds every core has spent busy since boot (``/proc/stat``: user, nice, system, irq, softirq, steal);
    None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others_busy(window_s: float = WINDOW_S) -> float | None:
    """Cores that work other than this process kept busy over the next ``window_s`` seconds (the machine's busy
    time less this process's own CPU time, over the wall time); None where the machine does not say."""
    start = _busy_seconds()
    if start is None:
        return None
    own, wall = time.process_time(), time.perf_counter()
    time.sleep(window_s)
    end = _busy_seconds()
    if end is None:
        return None
    elapsed = time.perf_counter() - wall
    return max(0.0, (end - start) - (time.process_time() - own)) / max(elapsed, 1e-6)


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pick(cores: int | None = None) -> int | None:
    """The threads :func:`choose_threads` gives for ``cores`` (default: the cores this process may use) and the
    other work measured now (:func:`others_busy`); None where the machine does not say."""
    others = others_busy()
    return None if others is None else choose_threads(cores or usable_cores(), others)


def enable_auto() -> bool:
    """Switch the policy on for this process (an entry point: the CLI, the app) unless the user fixed the thread
    count with ``OMP_NUM_THREADS``; sets the count once now. Returns whether it is on."""
    if os.environ.get("OMP_NUM_THREADS"):
        _state["auto"] = False
        return False
    _state.update(auto=True, cores=usable_cores())
    adjust()
    return True


def auto_enabled() -> bool:
    return bool(_state["auto"])


def adjust() -> int | None:
    """With the policy on: measure the other work, set torch's intra-op threads to what :func:`choose_threads`
    gives, and return it; off (or where the machine says nothing): None, nothing changed."""
    if not _state["auto"]:
        return None
    threads = pick(int(_state["cores"]))
    if threads is None:
        return None
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads

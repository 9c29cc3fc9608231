"""common/threads.py: torch's intra-op threads from the cores other work leaves."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common import threads


@pytest.mark.parametrize(
    ("cores", "others", "want"),
    [
        (2, 0.0, 2),
        (2, 0.4, 2),
        (2, 0.6, 1),
        (2, 1.0, 1),
        (2, 5.0, 1),
        (4, 1.2, 3),
        (4, 2.6, 1),
        (1, 0.0, 1),
        (2, -1, 2),
    ],
)
def test_choose_threads_gives_the_cores_left_at_least_one(cores, others, want):
    assert threads.choose_threads(cores, others) == want


def test_choose_threads_refuses_no_cores():
    with pytest.raises(ValueError, match="cores must be >= 1, got 0"):
        threads.choose_threads(0, 0.0)


def test_others_busy_is_the_machines_busy_time_less_this_process(monkeypatch):
    busy = iter([100.0, 100.9])  # the machine: 0.9 core-seconds busy over the window
    own = iter([5.0, 5.3])  # of which this process: 0.3
    wall = iter([10.0, 10.5])  # over 0.5 s
    monkeypatch.setattr(threads, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(threads.time, "process_time", lambda: next(own))
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    assert threads.others_busy(0.5) == pytest.approx((0.9 - 0.3) / 0.5)


def test_others_busy_sees_a_busy_process_beside_it():
    if threads._busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        seen = threads.others_busy(0.5)
    finally:
        child.kill()
        child.wait()
    assert seen is not None and seen >= 0.5  # the child alone keeps one core busy (more load only adds)


def test_the_policy_is_off_until_an_entry_point_switches_it_on(monkeypatch):
    monkeypatch.setattr(threads, "_state", {"auto": False, "cores": 2})
    monkeypatch.setattr(threads, "others_busy", lambda window_s=0.2: 5.0)
    before = torch.get_num_threads()
    assert threads.adjust() is None and torch.get_num_threads() == before


def test_auto_follows_the_other_work_and_leaves_a_fixed_count_alone(monkeypatch):
    before = torch.get_num_threads()
    seen = iter([5.0, 0.0])
    monkeypatch.setattr(threads, "_state", {"auto": False, "cores": 1})
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "others_busy", lambda window_s=0.2: next(seen))
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user fixed it: nothing changes
        assert threads.enable_auto() is False and not threads.auto_enabled() and threads.adjust() is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert threads.enable_auto() is True and threads.auto_enabled()
        assert torch.get_num_threads() == 1  # another job holds the cores
        assert threads.adjust() == 2 and torch.get_num_threads() == 2  # the machine went quiet
    finally:
        torch.set_num_threads(before)

"""Issue 52 (4): the time-left estimate. A run's tails (decode, video, checks) are learnt from the run itself once
one is done, and carried to the next run as a number of denoising steps (a busier machine slows both alike); the
warm-up's decode is only the first guess, never a replacement for a run's measure; "finishing" only once no
variant's video is still to come."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app import compare, ui
from app.interleave import Countdown

SMALLEST = compare.preset_key(compare.PRESETS[0])


def test_a_tail_carries_to_the_next_run_as_steps_averaged_over_runs():
    clock = ui._DecodeClock()
    assert clock.seconds(1000) is None
    clock.add(2.0, 1000)  # the warm-up: seconds only
    assert clock.seconds(1000, step_seconds=0.25) == 2.0 and not clock.in_steps(1000)
    clock.add(4.0, 1000, step_seconds=0.5)  # a run: its tail took 8 of its steps
    assert clock.in_steps(1000) and clock.seconds(1000, step_seconds=0.25) == pytest.approx(2.0)  # 8 steps now
    clock.add(2.0, 1000, step_seconds=0.5)  # 4 steps: one run is one sample, averaged with the last
    assert clock.seconds(1000, step_seconds=0.25) == pytest.approx(1.5)
    assert clock.seconds(2000, step_seconds=0.25) == pytest.approx(4.0)  # another size: seconds per pixel
    assert clock.seconds(1000) == pytest.approx(2.0)  # no step measured yet in this run: the last seconds


def test_finishing_only_once_no_video_is_still_to_come(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ui.time, "monotonic", lambda: now[0])
    # the steps are done (fraction 1); the tails took longer than their estimate: the count is at 0
    args = dict(decode_seconds=0.5, tail_since=90.0, origin=(1.0, 0.1), tails_clock=95.0)
    line = ui._status("mhla: writing video", 80.0, 1.0, Countdown(clock=lambda: now[0]), decodes_left=2, **args)
    assert line.endswith("about 1 s left") and "finishing" not in line
    line = ui._status("writing the side-by-side video", 80.0, 1.0, Countdown(), decodes_left=0, **args)
    assert line.endswith("finishing")
    # with 2 tails of 3 s to come, begun 1 s ago: 5 s
    args.update(decode_seconds=3.0, tails_clock=99.0)
    line = ui._status("linear: writing video", 80.0, 1.0, Countdown(clock=lambda: now[0]), decodes_left=2, **args)
    assert line.endswith("about 5 s left")


def test_the_countdown_shows_a_rise_of_more_than_ten_percent_and_a_second():
    now = [0.0]
    c = Countdown(clock=lambda: now[0])
    assert c.update(10.0) == 10.0
    now[0] = 4.0
    assert c.update(6.5) == 6.0  # +8%, 0.5 s: jitter, the count goes on
    now[0] = 6.0
    assert c.update(6.0) == 6.0  # +50% and 2 s over the count (4 s): the run is slower than said; saying 4 s is wrong


@pytest.mark.slow  # two runs of the tiny model through the page's handler
def test_the_warm_ups_decode_is_the_first_guess_only(tmp_path, monkeypatch):
    from app.models import load_app_models

    added = []

    class Clock(ui._DecodeClock):
        def add(self, seconds, pixels, step_seconds=None):
            added.append((seconds, step_seconds))
            super().add(seconds, pixels, step_seconds)

    monkeypatch.setattr(ui, "_DecodeClock", Clock)
    models = load_app_models("tiny-random")
    warmup = compare.Warmup(models)
    warmup.decodes.append((123.0, 5 * 32 * 48))  # a planted warm-up measure
    warmup._done.set()
    demo = ui.build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path, warmup=warmup)
    on_compare = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_compare")
    for i in range(2):
        request = SimpleNamespace(session_hash=f"eta{i}", query_params={})
        statuses = [v[0] for v in on_compare("a fox", "", i, 2, 5.0, SMALLEST, ["flash", "linear"], 1, request=request)]
        assert statuses[-1].startswith("Done"), statuses[-1]
    assert [s for s, _ in added].count(123.0) == 1  # once, before the first run; each run's own measure after it
    assert len(added) > 1 and added[-1][0] != 123.0

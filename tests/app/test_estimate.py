"""Issue 52 (4): the time-left estimate. A run's tails (decode, video, checks) are learnt from the run itself once
one is done, and carried to the next run as a number of denoising steps (a busier machine slows both alike); the
warm-up's decodes (two sizes: a fixed part and a part per pixel) are only the first guess, never a replacement for a
run's measure; the steps and the tails still to come follow the machine's pace over the last rounds; "finishing"
only once no variant's video is still to come."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from app import compare, compare_tab, ui
from app.interleave import Countdown, RunEstimate, SizeCost

SMALLEST = compare.preset_key(compare.PRESETS[0])
RECORDED = Path(__file__).parents[1] / "data" / "app_eta_run_builtin.json"


def test_a_tail_carries_to_the_next_run_as_steps_averaged_over_runs():
    clock = compare_tab._DecodeClock()
    assert clock.seconds(1000) is None and clock.empty
    clock.add(2.0, 1000, guess=True)  # the warm-up: seconds only, a first guess
    assert clock.seconds(1000, step_seconds=0.25) == 2.0 and not clock.in_steps(1000) and not clock.empty
    clock.add(4.0, 1000, step_seconds=0.5)  # a run: its tail took 8 of its steps, 4 s
    # 8 steps now (2 s) or 4 s: their geometric mean
    assert clock.in_steps(1000) and clock.seconds(1000, step_seconds=0.25) == pytest.approx((2.0 * 4.0) ** 0.5)
    assert clock.seconds(1000, step_seconds=0.5) == pytest.approx(4.0)  # the same step: the same seconds
    assert clock.seconds(1000) == pytest.approx(4.0)  # the run's measure replaced the warm-up's guess
    clock.add(2.0, 1000, step_seconds=0.5)  # 4 steps, 2 s: one run is one sample, averaged with the last
    assert clock.seconds(1000, step_seconds=0.25) == pytest.approx((1.5 * 3.0) ** 0.5)
    # another size, one size measured: its seconds per pixel (the runs' 3 s, averaged)
    assert clock.seconds(2000, step_seconds=0.25) == pytest.approx(6.0)
    assert clock.seconds(1000) == pytest.approx(3.0)  # no step measured yet in this run: the runs' seconds
    clock.add(9.0, 1000, guess=True)  # a later guess never replaces a run's measure
    assert clock.seconds(1000) == pytest.approx(3.0)


def test_finishing_only_once_no_video_is_still_to_come(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(compare_tab.time, "monotonic", lambda: now[0])
    # two variants, 2 steps each, done by second 84; one video done at 90 s, its tail taken as 0.5 s: past it
    estimate = RunEstimate(["flash", "mhla"], 2, tail_prior=lambda step: 0.5, start=80.0)
    for t, counts in ((81.0, (1, 0)), (82.0, (1, 1)), (83.0, (2, 1)), (84.0, (2, 2))):
        estimate.steps(t, {"flash": (counts[0], 2), "mhla": (counts[1], 2)})
    estimate.intervals = {"flash": [1.0], "mhla": [1.0]}  # a rate for each (a 2-step run measures no warm step)
    estimate.finished(90.0, "flash")
    line = compare_tab._status("mhla: writing video", 80.0, Countdown(clock=lambda: now[0]), estimate)
    assert line.endswith("about 1 s left") and "finishing" not in line
    estimate.finished(99.5, "mhla")  # the run's end (its prior: one tail, 0.5 s) is left
    line = compare_tab._status("writing the side-by-side video", 80.0, Countdown(clock=lambda: now[0]), estimate)
    assert line.endswith("finishing")
    line = compare_tab._status("flash: step 1", 80.0, Countdown(), RunEstimate(["flash"], 20))
    assert "left" not in line and "finishing" not in line  # nothing measured: no estimate


def test_the_countdown_shows_a_rise_of_more_than_ten_percent_and_a_second():
    now = [0.0]
    c = Countdown(clock=lambda: now[0])
    assert c.update(10.0) == 10.0
    now[0] = 4.0
    assert c.update(6.5) == 6.5  # +8%, 0.5 s over the count (6 s), under the last figure: taken, no rise shown
    now[0] = 6.0
    assert c.update(6.0) == 6.0  # +33% and 1.5 s over the count (4.5 s): the run is slower than said; 4.5 s is wrong


def test_the_countdown_holds_for_a_small_rise_and_does_not_stay_below_the_estimate():
    """The estimate right, the figure once 0.8 s below it (a run recorded at load ~2, issue 52 (4)): the figure holds
    until the count meets the estimate, then follows it; it never rises for a small rise. Capped at the count (the
    rule before), it stayed 0.8 s low to the run's end."""
    now = [0.0]
    c = Countdown(clock=lambda: now[0])
    assert c.update(5.0) == 5.0
    now[0] = 0.5
    assert c.update(3.7) == 3.7  # lower: taken at once
    shown = []
    for k in range(1, 9):  # the estimate 0.8 s above the figure, falling with the time
        now[0] = 0.5 + k / 4
        shown.append(c.update(4.5 - k / 4))
    assert all(b <= a for a, b in zip([3.7, *shown], shown, strict=False))  # never rises
    assert shown[:3] == [3.7, 3.7, 3.7] and shown[3] == pytest.approx(3.5)  # held, then met (0.8 s later)
    assert shown[-1] == pytest.approx(4.5 - 8 / 4)  # and it follows the estimate from then on


@pytest.mark.slow  # two runs of the tiny model through the page's handler
def test_the_warm_ups_decode_is_the_first_guess_only(tmp_path, monkeypatch):
    from app.models import load_app_models

    added = []

    class Clock(compare_tab._DecodeClock):
        def add(self, seconds, pixels, step_seconds=None, guess=False):
            added.append((seconds, step_seconds))
            super().add(seconds, pixels, step_seconds, guess)

    monkeypatch.setattr(compare_tab, "_DecodeClock", Clock)
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


@pytest.mark.slow  # one run of the tiny model through the page's handler
def test_the_first_runs_end_is_the_warm_ups_end_over_its_tail_times_a_tail(tmp_path, monkeypatch):
    """Before any run's end is measured, the end's prior is a tail's prior times what the warm-up measured a run's
    end at over its tail at the same size (one more tail, as before, said 1.1 s for a 0.3-0.5 s end)."""
    from app.models import load_app_models

    priors = []

    class Recording(RunEstimate):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            priors.append((self._tail_prior(None), self._finish_prior(None), self._finish_like_tails))

    monkeypatch.setattr(compare_tab, "RunEstimate", Recording)
    models = load_app_models("tiny-random")
    warmup = compare.Warmup(models)
    size = 5 * 32 * 48
    warmup.decodes.append((10.0, size))  # planted: a tail of 10 s and an end of 2.5 s at one size
    warmup.ends.append((2.5, size))
    warmup._done.set()
    demo = ui.build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path, warmup=warmup)
    on_compare = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_compare")
    request = SimpleNamespace(session_hash="end", query_params={})
    statuses = [v[0] for v in on_compare("a fox", "", 0, 2, 5.0, SMALLEST, ["flash", "linear"], 1, request=request)]
    assert statuses[-1].startswith("Done"), statuses[-1]
    ((tail, end, like_tails),) = priors
    assert tail > 0 and end == pytest.approx(0.25 * tail) and like_tails  # and corrected by the run's tails


# ---- the estimator on synthetic and recorded step timings (issue 52 (4)) -------------------------------------------
# a run as this CPU has the built-in model at 17x128x160: four variants' steps (s), a cold first step, tails, the end
RATES = {"flash": 0.40, "linear": 0.15, "mhla": 0.16, "mhla-hybrid": 0.25}
TAIL, FINISH = 3.0, 1.0


def simulate(rates=RATES, steps=20, tail=TAIL, finish=FINISH, interleaved=True, repeats=1, extra=0.0, slower=None):
    """The estimator's inputs for a run: ``[(kind, second, argument)]`` and the second it ends. The run's set-up
    0.2 s; each variant's first step 3x its rate and 0.8 s more (its text encoding, in its turn); ``repeats``: each
    later repeat's first step costs ``extra`` more (a decode and the text encoding); ``slower = (k, factor)``: steps
    after the k-th are ``factor`` slower (a busier machine)."""
    names, total = list(rates), steps * repeats
    counts = {n: (0, total) for n in names}
    calls, t = [], 0.2

    def step(name: str, k: int) -> None:
        nonlocal t
        t += rates[name] * (3.0 if k == 1 else 1.0) * (slower[1] if slower and k > slower[0] else 1.0)
        t += 0.8 if k == 1 else 0.0
        t += extra if k > 1 and k % steps == 1 else 0.0
        counts[name] = (k, total)
        calls.append(("steps", t, dict(counts)))
        if k == total:
            t += tail[names.index(name)] if isinstance(tail, list) else tail
            calls.append(("finished", t, name))

    order = (
        [(n, k) for k in range(1, total + 1) for n in names]
        if interleaved
        else [(n, k) for n in names for k in range(1, total + 1)]
    )
    for name, k in order:
        step(name, k)
    return calls, t + finish


def replay(calls, end, estimate, countdown_kind: type[Countdown] = Countdown) -> list[tuple[float, float, float]]:
    """``(second, shown, truly left)`` every 0.1 s and at each input, shown as the page shows it (:class:`Countdown`)."""
    now = [0.0]
    countdown = countdown_kind(clock=lambda: now[0])
    ticks = sorted({c[1] for c in calls} | {i / 10 for i in range(int(end * 10))})
    out, i = [], 0
    for t in ticks:
        while i < len(calls) and calls[i][1] <= t:
            kind, at, arg = calls[i]
            estimate.steps(at, arg) if kind == "steps" else estimate.finished(at, arg)
            i += 1
        now[0] = t
        shown = countdown.update(estimate.seconds_left(t))
        if shown is not None:
            out.append((t, shown, end - t))
    return out


def worst(points, end, since=0.25) -> float:
    """The largest relative error from ``since`` of the run on, while a tenth of it or more was left."""
    errors = [abs(shown - left) / left for t, shown, left in points if t >= since * end and left >= 0.1 * end]
    assert errors, "no estimate in that part of the run"
    return max(errors)


def test_with_right_priors_the_estimate_is_right_from_its_first_on():
    calls, end = simulate()
    points = replay(calls, end, RunEstimate(list(RATES), 20, tail_prior=lambda s: TAIL, finish_prior=lambda s: FINISH))
    assert points[0][0] < 0.25 * end  # it speaks early: after two warm steps of each variant
    assert worst(points, end, since=0.0) < 0.03


def test_priors_a_fifth_off_stay_within_a_quarter_and_the_run_corrects_them():
    calls, end = simulate()
    estimate = RunEstimate(list(RATES), 20, tail_prior=lambda s: 1.2 * TAIL, finish_prior=lambda s: 1.2 * FINISH)
    points = replay(calls, end, estimate)
    # after the last round the tails are nearly all that is left: a prior's error is the estimate's there
    assert worst(points, end) < 0.25
    first_video = next(t for kind, t, _ in calls if kind == "finished")
    after = [abs(s - left) / left for t, s, left in points if t > first_video and left > 0.1 * end]
    assert after and max(after) < 0.15  # its own tails measured (each weighed against one at the prior)
    assert estimate.tails == pytest.approx([TAIL] * 4)  # each tail measured as it was (its last step taken out)


def test_without_priors_the_tails_are_learnt_from_the_run():
    calls, end = simulate(finish=0.2)
    points = replay(calls, end, RunEstimate(list(RATES), 20))
    first_video = next(t for kind, t, _ in calls if kind == "finished")
    before = [s / left for t, s, left in points if 0.25 * end < t < first_video]
    assert before and max(before) < 0.75  # the tails unknown: too short (the reason for the priors)
    assert worst(points, end, since=first_video / end) < 0.10


def test_tails_that_grow_video_by_video_are_read_in_the_last_run_s_shape():
    """The built-in model's runs (app_eta, 17x128x160): the first video's tail (flash: no agreement with flash to
    compute) is short, the later ones longer. The last run's shape, scaled by this run's tails, follows them; one mean
    tail for all, scaled the same way, is short by a third of the time left in the middle of the tails."""
    tails = [1.8, 2.3, 3.3, 3.1]
    calls, end = simulate(tail=tails)
    mean = sum(tails) / 4
    shaped = RunEstimate(
        list(RATES), 20, tail_prior=lambda s: [1.1 * t for t in tails], finish_prior=lambda s: FINISH
    )  # the last run's tails, 10% longer
    flat = RunEstimate(list(RATES), 20, tail_prior=lambda s: 1.1 * mean, finish_prior=lambda s: FINISH)
    first_video = next(t for kind, t, _ in calls if kind == "finished")
    assert worst(replay(calls, end, shaped), end, since=first_video / end) < 0.10
    assert worst(replay(calls, end, flat), end, since=first_video / end) > 0.15


def test_variants_one_after_another_take_the_rate_of_those_measured():
    rates = {"flash": 0.3, "mhla": 0.3}
    calls, end = simulate(rates, interleaved=False)
    estimate = RunEstimate(list(rates), 20, interleaved=False, tail_prior=lambda s: TAIL, finish_prior=lambda s: 1.0)
    points = replay(calls, end, estimate)
    assert worst(points, end, since=0.0) < 0.05


def test_repeats_count_each_repeat_s_decode():
    calls, end = simulate(repeats=2, extra=2.0)
    estimate = RunEstimate(list(RATES), 20, 2, tail_prior=lambda s: TAIL, finish_prior=lambda s: FINISH)
    points = replay(calls, end, estimate)
    assert worst(points, end) < 0.15  # a repeat's decode taken as a tail (3 s) until measured (2 s)
    assert estimate.extras == pytest.approx([2.0] * 4)


def test_priors_carried_from_an_earlier_run_follow_this_run_s_steps():
    clock = compare_tab._DecodeClock()
    clock.add(3.0, 1000, step_seconds=0.25)  # 12 steps
    estimate = RunEstimate(["flash"], 20, tail_prior=lambda s: clock.seconds(1000, s))
    calls, _ = simulate({"flash": 0.5}, tail=6.0)
    for _kind, t, arg in calls[:5]:
        estimate.steps(t, arg)
    # steps twice as long here: 12 of them (6 s) against the 3 s measured there, halfway (geometrically)
    assert estimate.step_seconds == pytest.approx(0.5) and estimate.tail_seconds() == pytest.approx(18**0.5)


def _prior_table(p):
    """A prior recorded as a table over a step's seconds (a list per step: a tail per variant): interpolated."""
    if p is None:
        return None
    table = np.asarray(p["seconds"], dtype=float).reshape(len(p["steps"]), -1)

    def at(s):
        if s is None:
            return p["none"]
        got = [float(np.interp(np.log(s), np.log(p["steps"]), column)) for column in table.T]
        return got if isinstance(p["none"], list) else got[0]

    return at


def replay_record(path: Path, kind: type[RunEstimate] = RunEstimate, countdown: type[Countdown] = Countdown):
    """A run recorded by benchmarks/app_eta.py --record, replayed: ``(points, its seconds, the estimator)``."""
    record = json.loads(path.read_text())
    estimate = kind(
        record["variants"],
        record["steps_each"],
        record["repeats"],
        record["interleaved"],
        _prior_table(record["tail_prior"]),
        _prior_table(record["finish_prior"]),
        finish_like_tails=record.get("finish_like_tails", False),
    )
    end = record["seconds"]
    return replay([tuple(c) for c in record["calls"]], end, estimate, countdown), end, estimate


def _errors(points, end) -> list[float]:
    """Relative errors from a quarter of the run on while a tenth or more was left."""
    return [(shown - left) / left for t, shown, left in points if t >= 0.25 * end and left >= 0.1 * end]


def _finishing_seconds(points, end, estimate) -> float:
    """How long "finishing" (under a second shown, every video done) was shown before the run's end."""
    last_video = max(estimate.finish_times.values())
    finishing = [t for t, shown, _ in points if shown < 1 and t >= last_video]
    return end - min(finishing) if finishing else 0.0


def test_a_recorded_run_replays_as_it_was_measured():
    """The estimator's inputs during a real run (benchmarks/app_eta.py --record: the built-in model at 17x128x160,
    four variants, live previews on, 60.6 s on this CPU at a load of 2.4-2.6 per core from other jobs), replayed as
    the page shows them. Its rounds took 2.9-3.5 s (3.4-3.5 s in rounds 5-6), then 2.0-2.3 s from round 11 on, which
    no rate measured so far foresees: the estimate is up to 43% high around rounds 5-7 (the windows' means alone:
    31%, but more often wrong, see the next test). Asserted: within +-45% from a quarter of the run on while a tenth
    or more is left, within +-25% for more than two thirds of that time, and "finishing" (under a second shown with
    every video done) for at most 2 s."""
    points, end, estimate = replay_record(RECORDED)
    errors = _errors(points, end)
    assert max(abs(e) for e in errors) <= 0.45
    assert sum(abs(e) <= 0.25 for e in errors) > 2 / 3 * len(errors)
    assert _finishing_seconds(points, end, estimate) <= 2.0


# the other recorded runs on a loaded CPU (their "conditions" say which; the first: the estimator's inputs before
# issue 52 (4)'s fitted tails, its priors the warm-up's one size scaled by pixels)
RECORDED_LOADED = [
    RECORDED.with_name(f"app_eta_run_builtin_{n}.json") for n in ("first", "burst", "loaded2", "loaded3")
]


def test_recorded_loaded_runs_the_pace_errs_less_than_the_windows_alone():
    """Five recorded runs on a loaded CPU (2-3.5 per core), replayed: from a quarter on (while a tenth or more is
    left) the estimate errs by 17.5% on average over them, the windows' means alone (no pace; the tails never slowed)
    by 21%. On such a machine one round can take 2-3x the others and a run's tails 2x the last run's at the same load
    (the third request), which no estimate foresees: the largest errors stay 23-52% either way. "finishing" for at
    most 2 s in each."""

    class Windows(RunEstimate):
        def pace(self) -> float:
            return 1.0

        def tail_slowdown(self) -> float:
            return 1.0

    means = {}
    for kind in (RunEstimate, Windows):
        runs = []
        for path in [RECORDED, *RECORDED_LOADED]:
            points, end, estimate = replay_record(path, kind)
            runs.append(statistics.fmean(abs(e) for e in _errors(points, end)))
            assert _finishing_seconds(points, end, estimate) <= 2.0, path.name
        means[kind] = statistics.fmean(runs)
    assert means[RunEstimate] < 0.19 and means[Windows] > 0.2, means


def test_a_recorded_run_whose_estimate_was_right_is_shown_right_to_its_end():
    """A run recorded at a load of ~2 (the background training beside it; 41.3 s): the estimate itself was within
    0.15 s of the time left for its last 11 s, and the figure shown (the countdown) was 0.8 s below it from 30 s on:
    capped at the count after a small rise, it said "about 3 s left" with 4.1 s to go (-22%). The countdown holds
    for a small rise instead: within 10% from a quarter of the run on while a tenth or more is left. The capped rule
    replayed beside it, as it was, errs by more than 15%."""

    class Capped(Countdown):
        def update(self, estimate):
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

    path = RECORDED.with_name("app_eta_run_builtin_held.json")
    points, end, _ = replay_record(path)
    assert max(abs(e) for e in _errors(points, end)) <= 0.10
    capped, _, _ = replay_record(path, countdown=Capped)
    assert max(abs(e) for e in _errors(capped, end)) > 0.15


def test_an_end_prior_from_the_same_clocks_as_the_tails_is_corrected_by_the_run_s_tails():
    """The first run at a larger size than the warm-up's: its tails' and its end's priors both come from the
    warm-up's small decode scaled by pixels (here 3x too long); once its tails are measured the end is scaled by
    what they took against their priors, not left at 3x (a quiet CPU showed +149% near that run's end)."""
    calls, end = simulate(finish=FINISH)
    estimate = RunEstimate(
        list(RATES), 20, tail_prior=lambda s: 3 * TAIL, finish_prior=lambda s: 3 * FINISH, finish_like_tails=True
    )
    points = replay(calls, end, estimate)
    last_video = max(t for kind, t, _ in calls if kind == "finished")
    assert estimate.finish_seconds() == pytest.approx(FINISH * 3 * (4 * TAIL + 3 * TAIL) / (4 * 3 * TAIL + 3 * TAIL))
    # left alone the end's prior would say 3 s for the run's last second (2 s too many); scaled, 1.4 s (0.4 s)
    after = [abs(s - left) for t, s, left in points if t >= last_video - 1e-9]
    assert after and max(after) < 0.5, after
    # an end measured by an earlier run is that run's measure: not scaled by this run's tails
    measured = RunEstimate(list(RATES), 20, tail_prior=lambda s: 3 * TAIL, finish_prior=lambda s: 3 * FINISH)
    replay(calls, end, measured)
    assert measured.finish_seconds() == pytest.approx(3 * FINISH)


# ---- a tail's seconds by size: a fixed part and a part per pixel (issue 52 (4)) ----------------------------------


def test_two_sizes_give_a_fixed_part_and_a_part_per_pixel():
    cost = SizeCost()
    assert cost.seconds(1000) is None and cost.fit(1000) is None
    cost.add(3.5, 5000, guess=True)
    assert cost.seconds(10000) == pytest.approx(7.0)  # one size: its seconds per pixel, nothing known of a fixed part
    cost.add(1.5, 1000, guess=True)
    # (1000, 1.5 s) and (5000, 3.5 s): 2 s per 4000 pixels, 0.5 ms each; 1.5 - 0.5 = 1 s fixed
    assert cost.fit(9000) == pytest.approx((1.0, 5e-4))
    # above both: the line's 1 + 4.5 s and the larger size's seconds per pixel's 6.3 s, their geometric mean
    assert cost.seconds(9000) == pytest.approx((5.5 * 6.3) ** 0.5)
    assert cost.seconds(3000) == pytest.approx(2.5)  # between the two: the line
    assert cost.seconds(500) == pytest.approx(1.25)  # below both
    assert cost.seconds(5000) == 3.5 and cost.seconds(1000) == 1.5  # a size measured: its own seconds
    # a third size: the two nearest (either side where it lies between) make the line
    cost.add(8.0, 20000)  # (20000, 8 s): from 5000, 4.5 s per 15000 pixels, 0.3 ms each, 3.5 - 1.5 = 2 s fixed
    assert cost.fit(10000) == pytest.approx((2.0, 3e-4)) and cost.seconds(10000) == pytest.approx(5.0)
    assert cost.fit(40000) == pytest.approx((2.0, 3e-4))  # above all: the two largest, 14 s; 16 s per pixel
    assert cost.seconds(40000) == pytest.approx((14.0 * 16.0) ** 0.5)
    assert cost.seconds(3000) == pytest.approx(2.5)  # between the two smallest: their line still


def test_a_size_cost_that_needs_a_negative_part_takes_the_nearer_size_s():
    rising = SizeCost()  # (1000, 1 s), (2000, 3 s): a line would need -1 s fixed
    rising.add(1.0, 1000)
    rising.add(3.0, 2000)
    assert rising.fit(4000) == pytest.approx((0.0, 1.5e-3)) and rising.seconds(4000) == pytest.approx(6.0)  # both 6 s
    assert rising.seconds(500) == pytest.approx(0.5)  # the nearer is 1000: its seconds per pixel
    falling = SizeCost()  # the larger size measured faster (noise): a line would need a negative per-pixel part
    falling.add(2.0, 1000)
    falling.add(1.5, 2000)
    # the nearer size's seconds, half fixed: 0.75 s + 0.75 s per 2000 pixels at 4000 (2.25 s; per pixel 3 s: their
    # geometric mean); 1 s + 1 s per 1000 at 500 (below both: the line)
    assert falling.fit(4000) == pytest.approx((0.75, 0.75 / 2000))
    assert falling.seconds(4000) == pytest.approx((2.25 * 3.0) ** 0.5)
    assert falling.seconds(500) == pytest.approx(1.5)


def test_a_run_s_measure_replaces_a_guess_and_averages_with_a_run_s():
    cost = SizeCost()
    cost.add(1.0, 1000, guess=True)
    cost.add(2.0, 1000, guess=True)  # a later guess replaces a guess
    assert cost.seconds(1000) == 2.0
    cost.add(3.0, 1000)
    assert cost.seconds(1000) == 3.0
    cost.add(1.0, 1000)
    cost.add(9.0, 1000, guess=True)
    assert cost.seconds(1000) == 2.0  # (3 + 1) / 2; the guess after them ignored
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        cost.add(bad, 1000)
    cost.add(1.0, 0)
    assert cost.seconds(1000) == 2.0 and cost.sizes() == [1000]


def test_the_first_run_at_a_larger_size_than_the_warm_up_s():
    """The warm-up times a tail at 9x64x80 and at 5x32x40 (half of each latent dimension); the first request is at
    17x128x160, 7.6x the pixels. On a quiet CPU a tail has a fixed part (0.5 s + 2.5 s per 348,160 pixels: 3 s
    there); on a loaded one its cost per pixel rose past the warm-up's sizes (the same small sizes, 6.3 s there:
    the default size's seconds per pixel). The warm-up's one size scaled by pixels is right only in the second, the
    line through its two sizes only in the first; the page's clock (their geometric mean above the sizes measured)
    errs less at worst than either. Fed as the page feeds them: the warm-up's tails as first guesses of
    the tails' and (no run's end measured yet) of the end's clock."""
    big, default, small = 17 * 128 * 160, 9 * 64 * 80, 5 * 32 * 40

    def quiet(px: int) -> float:
        return 0.5 + 2.5 * px / big

    loaded = quiet(default) * big / default
    clock, one = compare_tab._DecodeClock(), compare_tab._DecodeClock()
    for px in (default, small):
        clock.add(quiet(px), px, guess=True)
    one.add(quiet(default), default, guess=True)  # the earlier warm-up: one size
    line = SizeCost()
    for px in (default, small):
        line.add(quiet(px), px)
    fixed, per_pixel = line.fit(big)
    priors = {"page": clock.seconds(big), "one size": one.seconds(big), "line": fixed + per_pixel * big}
    assert priors["line"] == pytest.approx(3.0) and priors["one size"] == pytest.approx(loaded)
    assert priors["page"] == pytest.approx((3.0 * loaded) ** 0.5)
    worst_of = {}
    for name, prior in priors.items():
        errors = []
        for truth in (3.0, loaded):
            calls, end = simulate(tail=truth, finish=truth)  # the end as long as a tail: what its prior says
            estimate = RunEstimate(
                list(RATES),
                20,
                tail_prior=lambda s, p=prior: p,
                finish_prior=lambda s, p=prior: p,
                finish_like_tails=True,
            )
            errors.append(worst(replay(calls, end, estimate), end))
        worst_of[name] = max(errors)
    # from a quarter on: the page's at worst 53% (4.3 s a tail: +45% where it is 3 s, -31% where it is 6.3 s), the
    # line's 59% (loaded), the one size's 130% (quiet); no prior from these two sizes is within 25% in both
    assert worst_of["page"] < min(worst_of["one size"], worst_of["line"]), worst_of
    assert worst_of["page"] < 0.55 and worst_of["one size"] > 1.0


def test_the_pace_is_the_last_rounds_against_the_windows():
    """Two variants in turns, 1 s and 0.5 s a step for 8 rounds, then both twice as slow for 3 rounds: the windows'
    means (the last 8 intervals each) are 1.375 s and 0.6875 s; each of the last 2 rounds' intervals is 16/11 of its
    variant's mean: the pace is 16/11, and each variant's rate now is its mean at that pace, its step now exactly.
    Then one round where b's step takes 3 s (another job's burst): its window mean takes it in, the pace leaves it
    out with the lowest quarter."""
    estimate = RunEstimate(["a", "b"], 20, tail_prior=lambda s: 3.0)
    t, counts = 0.0, {"a": (0, 20), "b": (0, 20)}

    def round_(k: int, a: float, b: float) -> None:
        nonlocal t
        for name, seconds in (("a", a), ("b", b)):
            t += seconds + (1.0 if k == 1 else 0.0)  # round 1: cold
            counts[name] = (k, 20)
            estimate.steps(t, dict(counts))

    for k in range(1, 13):  # rounds 2-9 at 1x; 10-12 at 2x
        round_(k, *((2.0, 1.0) if k >= 10 else (1.0, 0.5)))
    assert statistics.fmean(estimate.intervals["a"]) == pytest.approx(1.375)
    assert estimate.pace() == pytest.approx(16 / 11)
    assert estimate.rate("a") == pytest.approx(2.0) and estimate.rate("b") == pytest.approx(1.0)
    # the steps 2x slower than the run's first 8 (1 s and 0.5 s): the tails to come by its square root (a machine
    # that slows the steps slows the decodes too, if less)
    assert estimate.step_seconds == pytest.approx(0.75) and estimate.step_seconds_now == pytest.approx(1.5)
    assert estimate.slowdown() == pytest.approx(2.0) and estimate.tail_seconds() == pytest.approx(3.0 * 2**0.5)
    # 8 steps each still to come at their rates now, a tail each, nothing of the next step spent
    assert estimate.seconds_left(t) == pytest.approx(8 * (2.0 + 1.0) + 2 * 3.0 * 2**0.5)
    round_(13, 2.0, 3.0)
    # windows: a 4 x 1 s + 4 x 2 s = 1.5 s, b 4 x 0.5 + 3 x 1 + 3 = 1.0 s; the last 2 rounds' ratios 2/1.5, 1/1,
    # 2/1.5 and 3/1: without the lowest and the highest, 4/3 (their plain sum 8 s over 5 s said 1.6)
    assert estimate.pace() == pytest.approx(4 / 3) and estimate.rate("a") == pytest.approx(2.0)


def test_a_load_that_changes_mid_run_is_followed_within_two_rounds():
    """Steps 1.5x slower from round 10 on (the other jobs' load rose), the priors right for the run's first steps:
    two rounds later each variant's rate is its new step (the windows' means alone took eight rounds). The tails
    to come are slowed by the square root (:meth:`RunEstimate.tail_slowdown`): whether the machine slowed the tails
    as much as the steps or not at all, the estimate errs by less than a quarter from then on (their square root),
    both ways."""

    class Windows(RunEstimate):  # the pace over as many rounds as the windows hold: the windows' means alone
        RECENT_ROUNDS = RunEstimate.WINDOW

    for tails in (1.0, 1.5):  # the tails and the end not slowed, or as much as the steps
        calls, end = simulate(slower=(9, 1.5), tail=tails * TAIL, finish=tails * FINISH)
        settled = next(i for i, (kind, _, arg) in enumerate(calls) if kind == "steps" and min(arg.values())[0] >= 11)
        estimate, windows = (
            k(list(RATES), 20, tail_prior=lambda s: TAIL, finish_prior=lambda s: FINISH) for k in (RunEstimate, Windows)
        )
        for _kind, at, arg in calls[: settled + 1]:
            for e in (estimate, windows):
                e.steps(at, arg)
        for name, rate in RATES.items():
            assert estimate.rate(name) == pytest.approx(1.5 * rate)
            assert windows.rate(name) < 1.35 * rate  # 3 of its 8 intervals slower
        assert estimate.tail_seconds() == pytest.approx(TAIL * 1.5**0.5, rel=0.03)  # slowed from its first 8 steps
        points = replay(
            calls, end, RunEstimate(list(RATES), 20, tail_prior=lambda s: TAIL, finish_prior=lambda s: FINISH)
        )
        late = [(shown - left) / left for t, shown, left in points if t >= calls[settled][1] and left >= 0.1 * end]
        assert late and max(abs(e) for e in late) < 0.3
        # too long where the tails were not slowed, too short where they were as much as the steps
        assert (min(late) > 0) if tails == 1.0 else (max(late) < 0)

"""Issue 52 (5, 9): no sentence on the page that is not true. Stop names which variants finished and where each
other one was stopped; the warm-up line never shows a "0 s so far" baked into the page and then jumps; the chart's
title fits its figure."""

from __future__ import annotations

import threading

import pytest

from app import compare
from app.compare import engine
from app.compare_tab import stopped_line
from app.models import describe_app_models
from app.ui import build_demo
from common.timing import Timing
from pipelines import VARIANTS

SMALLEST = compare.preset_key(compare.PRESETS[0])


def test_stop_names_what_finished_and_where_the_others_were_stopped():
    # the case: Stop pressed right after flash's video, the others at 19 of their 20 steps
    counts = {"flash": (20, 20), "linear": (19, 20), "mhla": (19, 20), "mhla-hybrid": (18, 20)}
    line = stopped_line(["flash"], counts, list(VARIANTS))
    assert line == (
        "**Stopped** by you: flash finished and is shown; stopped: linear at step 19 of 20; mhla at step 19 of 20; "
        "mhla-hybrid at step 18 of 20 (not shown: a video needs every step)."
    )
    assert "did not run" not in line
    # one after another (a shared transformer): the later variants had not begun; one was decoding
    line = stopped_line(["flash", "linear"], {"flash": (4, 4), "linear": (4, 4), "mhla": (4, 4), "mhla-hybrid": (0, 4)})
    assert "flash, linear finished and are shown" in line
    assert "mhla after all 4 steps, while decoding its video" in line and "mhla-hybrid before its first step" in line
    assert "nothing to show" in stopped_line([], {})


def _warmup(monkeypatch, now):
    monkeypatch.setattr(engine.time, "monotonic", lambda: now[0])
    warmup = compare.Warmup.loading(lambda: None)
    return warmup


def test_the_warm_up_line_has_no_seconds_before_it_starts_then_counts_them(monkeypatch, tmp_path):
    now = [100.0]
    warmup = _warmup(monkeypatch, now)
    # the page is built before the warm-up starts and served seconds later: what is baked into it names no seconds
    demo = build_demo(describe_app_models("tiny-random"), out_root=tmp_path, warmup=warmup)
    props = {c.get("props", {}).get("elem_id"): c.get("props", {}) for c in demo.config["components"]}
    assert "Loading the model" in props["warmup-note"]["value"] and "so far" not in props["warmup-note"]["value"]
    release = threading.Event()
    warmup._load = lambda: release.wait(10) and None  # a load that takes its time
    warmup.start()
    try:
        fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
        seen = []
        for t in (100.0, 101.0, 102.0, 107.4):  # each tick of the page's timer: the line says the seconds as they are
            now[0] = t
            note, timer = fns["on_warm_tick"]()
            seen.append(note)
            assert timer.active
        assert [n.split("(")[1].split(" s so far")[0] for n in seen] == ["0", "1", "2", "7"]
    finally:
        release.set()
        warmup.wait(10)


def _noisy_result(models_facts) -> compare.CompareResult:
    flash = compare.VariantRun("flash", "", timings=[Timing("flash", "cpu", "float32", total=3, steps=[1.0] * 7)])
    wide = [1.0, 0.3, 1.6, 0.5, 1.4, 0.4, 1.2]
    runs = [flash] + [
        compare.VariantRun(v, "", timings=[Timing(v, "cpu", "float32", total=3, steps=wide)]) for v in VARIANTS[1:]
    ]
    req = compare.CompareRequest("a red square", "", 0, 7, 5.0, compare.PRESETS[0], list(VARIANTS))
    return compare.CompareResult(req, runs, "cpu")


def test_the_charts_title_fits_its_figure_when_a_speedup_is_noisy():
    result = _noisy_result(None)
    assert any(result.speedups(r)[0].noisy for r in result.runs[1:])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = compare.speedup_figure(result)
    canvas = FigureCanvasAgg(fig)  # as the page's PNG is drawn (the figure leaves pyplot's registry when made)
    canvas.draw()
    title = fig.axes[0].title
    box = title.get_window_extent(canvas.get_renderer())
    assert "noisy" in title.get_text() and "±10%" in title.get_text()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height  # nothing cut at an edge


@pytest.mark.parametrize("noisy", [False, True])
def test_the_chart_title_says_noisy_only_when_it_is(noisy):
    result = _noisy_result(None)
    if not noisy:
        for r in result.runs:
            r.timings = [Timing(r.variant, "cpu", "float32", total=3, steps=[1.0] * 7)]
    title = compare.speedup_figure(result).axes[0].title.get_text()
    assert ("noisy" in title) == noisy

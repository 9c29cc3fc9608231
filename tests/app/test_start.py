"""Issue 38 (3): the page answers before the warm-up is done (it runs in the background and the page says so);
a run waits for it rather than paying the cold caches."""

import threading
import time
from types import SimpleNamespace

import pytest

from app import compare
from app.models import describe_app_models, load_app_models

SMALLEST = compare.preset_key(compare.PRESETS[0])


@pytest.fixture(scope="module")
def models():
    return load_app_models("tiny-random")


def test_the_warm_up_runs_in_the_background(models, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(compare.engine, "warm_up", lambda m, decodes=None, ends=None: release.wait(10) and 1.5)
    started = time.monotonic()
    warmup = compare.Warmup(models).start()
    assert time.monotonic() - started < 1.0 and not warmup.done  # start() returns at once
    assert "Warming up" in warmup.note() and "Generate waits" in warmup.note()
    release.set()
    assert warmup.wait(10) and warmup.done and warmup.seconds == 1.5 and warmup.note() == ""


def test_a_failed_warm_up_counts_as_done(models, monkeypatch):
    def broken(m, decodes=None, ends=None):
        raise RuntimeError("no")

    monkeypatch.setattr(compare.engine, "warm_up", broken)
    warmup = compare.Warmup(models).start()
    assert warmup.wait(10) and warmup.seconds is None and warmup.note() == ""


def test_a_run_waits_for_the_warm_up_and_says_so(models, tmp_path, monkeypatch):
    from app.ui import build_demo

    release = threading.Event()
    monkeypatch.setattr(compare.engine, "warm_up", lambda m, decodes=None, ends=None: release.wait(30) and 0.1)
    warmup = compare.Warmup(models).start()
    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path, warmup=warmup)
    props = {c.get("props", {}).get("elem_id"): c.get("props", {}) for c in demo.config["components"]}
    assert "Warming up" in props["warmup-note"]["value"]  # visible on the page from the start
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    request = SimpleNamespace(session_hash="warm", query_params={})
    run = fns["on_compare"]("a red fox", "", 0, 1, 5.0, SMALLEST, ["flash"], 1, request=request)
    assert "Warming up" in next(run)[0] and "Warming up" in next(run)[0]  # still waiting, no run started
    note, timer = fns["on_warm_tick"]()
    assert "Warming up" in note and timer.active
    release.set()
    statuses = [values[0] for values in run]
    assert statuses[-1].startswith("Done: 1 variant(s)")
    note, timer = fns["on_warm_tick"]()
    assert note == "" and not timer.active


def test_the_warm_up_measures_a_tail_at_two_sizes_and_a_warm_end(models, monkeypatch):
    """The default size's tail and a smaller one's (the time-left estimate's fixed part and part per pixel), and a
    run's end at the default size, its chart drawn once before it is timed (issue 52 (4): the first run's end paid the
    chart library's import and took twice the next runs')."""
    from app.compare import engine

    decodes, ends, timed = [], [], []
    real_write, real_draw = engine.write_mp4, engine._draw_chart

    def write(path, frames, **kwargs):
        timed.append(("video", frames.shape))
        return real_write(path, frames, **kwargs)

    def draw():
        timed.append(("chart", None))
        real_draw()

    monkeypatch.setattr(engine, "write_mp4", write)
    monkeypatch.setattr(engine, "_draw_chart", draw)
    compare.warm_up(models, decodes, ends)
    (seconds, pixels), (small_seconds, small_pixels) = decodes
    d = models.components.defaults
    assert seconds > 0 and pixels == d["num_frames"] * d["height"] * d["width"]
    # the second: the first half of the default size's latents in every dimension, decoded
    st, sh, sw = models.components.vae_stride
    latent = ((d["num_frames"] - 1) // st + 1, d["height"] // sh, d["width"] // sw)
    f, h, w = ((n + 1) // 2 for n in latent)
    assert small_seconds > 0 and small_pixels == (1 + st * (f - 1)) * h * sh * w * sw
    ((end_seconds, end_pixels),) = ends
    assert end_seconds > 0 and end_pixels == pixels
    # the end: a chart drawn untimed, then the side-by-side video (four variants side by side) and the chart again
    (at,) = [i for i, (kind, shape) in enumerate(timed) if kind == "video" and shape[2] >= 4 * d["width"]]
    assert [k for k, _ in timed[at - 1 : at + 2]] == ["chart", "video", "chart"]
    frames, height, _, _ = timed[at][1]
    assert frames == d["num_frames"] and height > d["height"]


@pytest.mark.slow  # starts the launcher
def test_the_launcher_serves_before_the_warm_up_and_stops_cleanly(tmp_path):
    """The page answers before the models load (and while they load or warm up); SIGTERM then exits 143 (not an
    abort from the teardown under the loading thread), and the log names --share, not gradio's share=True."""
    import os
    import socket
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "GRADIO_TEMP_DIR": str(tmp_path / "gradio")}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "run_app.py", "--model", "tiny-random", "--port", str(port)],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        while time.monotonic() < deadline and "model loaded in" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            time.sleep(0.3)
        proc.terminate()
        assert proc.wait(timeout=60) == 143, log.read_text()
        text = log.read_text()
        # the page is served first, from the model's files; the models load after it started serving (issue 38 (3))
        assert text.index("serving on") < text.index("model loaded in"), text
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "--share" in text and "share=True" not in text


def test_a_permalink_opens_with_the_results_of_the_same_request_run_here(models, tmp_path):
    """Issue 38 (6): the link of a finished run opens with its results on this server; another seed, only the
    form."""
    from urllib.parse import parse_qsl, urlsplit

    from app.ui import build_demo

    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    request = SimpleNamespace(session_hash="link", query_params={})
    *_, last = fns["on_compare"]("a red fox", "", 3, 1, 5.0, SMALLEST, ["flash"], 1, request=request)
    assert last[0].startswith("Done: 1 variant(s)")
    link = dict(parse_qsl(urlsplit(last[0].split("](")[1].rstrip(")")).query))
    opened = fns["on_load"](SimpleNamespace(session_hash="other", query_params=link))
    status, video = opened[6], opened[6 + 3]  # the 6 fields, then status, headline, (column, video, details)
    assert "as run on this server" in status and isinstance(video, str) and video.endswith("flash.mp4")
    other = fns["on_load"](SimpleNamespace(session_hash="other", query_params={**link, "seed": "4"}))
    assert "press **Generate** to run it" in other[6] and not isinstance(other[6 + 3], str)


def _page_answers(m, max_tokens=compare.CPU_MAX_TOKENS) -> dict:
    """Everything the page is built from: what a model's facts must say as the loaded models do."""
    return {
        "source": m.source,
        "device": m.device,
        "dtype": m.dtype,
        "defaults": m.defaults,
        "patch": m.patch,
        "vae_stride": m.vae_stride,
        "index": m.index,
        "notes": m.notes,
        "random_note": m.random_note,
        "variant notes": m.variant_notes,
        "examples": m.example_prompts,
        "builtin": m.builtin,
        "stored": m.stored_dir,
        "memory": m.memory,
        "image": (m.needs_image, m.takes_image),
        "presets": compare.preset_choices(m, max_tokens),
        "every preset's label": [compare.preset_label(m, p) for p in compare.PRESETS if m.fits(p[1], p[2])],
        "left out": compare.presets_left_out(m, max_tokens),
    }


@pytest.mark.parametrize(
    "model, options",
    [
        ("tiny-random", {}),
        (None, {}),  # the built-in model: fine-tuned variants with their own MHLA layouts
        ("tiny-random", {"offload": "sequential", "vae_tiling": True}),
    ],
    ids=["tiny-random", "built-in", "tiny-random offloaded"],
)
def test_the_page_built_before_loading_shows_what_the_loaded_models_would(model, options):
    """Issue 38 (3): the launcher builds the page from the model's files (no diffusers import, no weights) and
    loads the models after it is served; every value the page shows is the loaded models' (the labels' M too)."""
    facts = describe_app_models(model, device="cpu", **options)
    loaded = load_app_models(model, device="cpu", **options)
    assert _page_answers(facts) == _page_answers(loaded)
    assert len(_page_answers(facts)["presets"]) >= 3


def test_the_page_is_served_while_the_models_load_and_a_run_waits_for_them(models, tmp_path, monkeypatch):
    from app.ui import build_demo

    release = threading.Event()
    monkeypatch.setattr(compare.engine, "warm_up", lambda m, decodes=None, ends=None: 0.1)
    warmup = compare.Warmup.loading(lambda: release.wait(30) and models).start()
    demo = build_demo(
        describe_app_models("tiny-random"), max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path, warmup=warmup
    )
    props = {c.get("props", {}).get("elem_id"): c.get("props", {}) for c in demo.config["components"]}
    assert "Loading the model" in props["warmup-note"]["value"] and "Generate waits" in props["warmup-note"]["value"]
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    assert fns["prompt_note"]("a red fox") == "9 / 2,000 characters"  # no tokenizer yet: no vocabulary note
    request = SimpleNamespace(session_hash="load", query_params={})
    run = fns["on_compare"]("a red fox", "", 0, 1, 5.0, SMALLEST, ["flash"], 1, request=request)
    assert "Loading the model" in next(run)[0] and "Loading the model" in next(run)[0]  # waiting, nothing run
    assert not warmup.loaded and warmup.models is None
    release.set()
    statuses = [values[0] for values in run]
    assert statuses[-1].startswith("Done: 1 variant(s)") and warmup.models is models and warmup.load_seconds > 0
    note, timer = fns["on_warm_tick"]()
    assert note == "" and not timer.active


def test_a_model_that_fails_to_load_is_named_and_runs_are_refused(tmp_path):
    import gradio as gr

    from app.ui import build_demo

    def broken():
        raise FileNotFoundError("/secret/place/transformer/diffusion_pytorch_model.safetensors is truncated")

    warmup = compare.Warmup.loading(broken).start()
    assert warmup.wait(10) and warmup.loaded and warmup.models is None
    note = warmup.note()
    assert "could not be loaded" in note and "FileNotFoundError" in note and "/secret" not in note
    demo = build_demo(describe_app_models("tiny-random"), out_root=tmp_path, warmup=warmup)
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    run = fns["on_compare"](
        "a red fox", "", 0, 1, 5.0, SMALLEST, ["flash"], 1, request=SimpleNamespace(session_hash="x")
    )
    with pytest.raises(gr.Error, match="could not be loaded"):
        next(run)


def test_each_variant_reports_its_own_steps_done(models, tmp_path):
    """Issue 38 (3): during a run every variant's steps done of its steps, from iter_compare to the column."""
    from app.compare_tab import progress_markdown

    req = compare.check_request(models, "a red fox", "", 0, 3, 5.0, SMALLEST, ["flash", "mhla"])
    seen: list[dict] = []
    list(compare.iter_compare(models, req, tmp_path, variant_steps=lambda c: seen.append(dict(c))))
    for name in ("flash", "mhla"):
        done = [c[name] for c in seen]
        assert all(total == 3 for _, total in done) and done[-1] == (3, 3)
        assert [d for d, _ in done] == sorted(d for d, _ in done)  # never goes back
        assert {d for d, _ in done} == {0, 1, 2, 3}  # every step is seen
    text = progress_markdown("mhla", "fine-tuned", 7, 20)
    assert text.startswith("### mhla\n_fine-tuned_") and "`███████░░░░░░░░░░░░░` 7/20 steps · denoising" in text
    assert "20/20 steps · decoding its video" in progress_markdown("mhla", "x", 20, 20)


def test_the_columns_show_each_variants_bar_while_it_runs(models, tmp_path, monkeypatch):
    from app import compare_tab, ui

    # a refresh at every event the loop waits for (its floor, compare_tab.MIN_WAIT_SECONDS: a tiny run is quick);
    # the pages are counted and only the bars kept, so a loop that yields too often is a failed assertion, not a machine out
    # of memory
    monkeypatch.setattr(compare_tab, "POLL_SECONDS", 0.0)
    demo = ui.build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    request = SimpleNamespace(session_hash="bars", query_params={})
    # status, headline, then (column, video, details, preview) per variant
    flash_md, mhla_md = 2 + 2, 2 + compare_tab.PER_VARIANT * 2 + 2
    bars, count, last, started = [], 0, None, time.monotonic()
    for page in fns["on_compare"]("a red fox", "", 0, 3, 5.0, SMALLEST, ["flash", "mhla"], 1, request=request):
        count, last = count + 1, page
        if isinstance(page[mhla_md], str) and "steps ·" in page[mhla_md]:
            bars.append(page[mhla_md])
    # at most one page per wait, plus one per variant's result
    assert count <= (time.monotonic() - started) / compare_tab.MIN_WAIT_SECONDS + 10, count
    assert any("0/3 steps" in b for b in bars) and any("3/3 steps · decoding its video" in b for b in bars)
    assert "steps ·" not in last[flash_md] and "steps ·" not in last[mhla_md]  # the results replace them

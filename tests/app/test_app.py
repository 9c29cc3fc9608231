"""The app's logic, called directly (no server): presets, request checks, compare runs, benchmark."""

import math
import re
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from app import bench, compare, quality
from app.models import CONVERTED_NOTE, load_app_models, parse_variant_dirs
from common.timing import spread
from common.video import read_video
from pipelines import VARIANTS
from pipelines.loading import build_random_wan

SMALLEST = compare.preset_key(compare.PRESETS[0])


@pytest.fixture(scope="module")
def models():
    return load_app_models("tiny-random")


@pytest.mark.slow  # generates with the tiny model
def test_presets_name_the_tokens_and_the_m_that_runs(models, tmp_path):
    labels = dict((v, k) for k, v in compare.preset_choices(models))
    assert labels["81x480x800"].startswith("81x480x800: 31,500 tokens (21x30x50), M=")
    for p in compare.PRESETS:
        assert compare.parse_preset(compare.preset_key(p)) == p
    # the M in a label is the M generate() runs (the tiny model's layout, shrunk to the grid)
    req = compare.check_request(models, "a fox", "", 0, 1, 5.0, "9x64x96", ["mhla"])
    run = compare.run_compare(models, req, tmp_path).runs[0]
    assert labels["9x64x96"] == f"9x64x96: 72 tokens (3x4x6), M={run.timing.num_blocks}"


def test_only_presets_within_the_token_limit_are_offered(models):
    keys = [k for _, k in compare.preset_choices(models, max_tokens=compare.CPU_MAX_TOKENS)]
    assert "5x32x48" in keys and "81x480x800" not in keys and "81x480x832" not in keys
    why = compare.presets_left_out(models, compare.CPU_MAX_TOKENS)
    assert "81x480x800 (31,500 tokens)" in why and "--max-tokens" in why
    assert compare.presets_left_out(models, None) is None


@pytest.mark.parametrize("bad", ["../../etc/passwd", "81x480x801", "", None, 5])
def test_unknown_presets_are_refused(bad):
    with pytest.raises(ValueError, match="unknown resolution preset"):
        compare.parse_preset(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(prompt="   "), "prompt is empty: describe the video to generate, e.g. 'a red fox"),
        (dict(variants=[]), "no variant chosen"),
        (dict(variants=["flash", "softmax"]), "unknown variant"),
        (dict(preset="81x480x800"), r"too large for this device.*31,500 tokens.*at most 8,192"),
        (dict(steps=2.5), "steps must be a whole number, got 2.5"),
        (dict(steps=0), "steps must be between 1 and"),
        (dict(guidance=-1), "guidance must be a number between 0 and"),
        (dict(seed=float("nan")), "seed must be a whole number"),
        # refused, never clamped or rounded
        (dict(steps=1000), "steps must be between 1 and 100, got 1,000"),
        (dict(guidance=-3), "guidance must be a number between 0 and 30, got -3"),
        (dict(seed=1.5), "seed must be a whole number, got 1.5"),
        (dict(repeats=0), "repeats must be between 1 and 10, got 0"),
    ],
)
def test_bad_requests_name_the_bad_value(models, change, message):
    args = dict(
        prompt="a fox",
        negative_prompt="",
        seed=0,
        steps=2,
        guidance=5.0,
        preset=SMALLEST,
        variants=["flash"],
        repeats=1,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        compare.check_request(models, max_tokens=compare.CPU_MAX_TOKENS, **args)


def test_request_keeps_canonical_variant_order(models):
    req = compare.check_request(models, " a fox ", None, 3.0, 2, 5, SMALLEST, ["mhla", "flash", "mhla"])
    assert req.variants == ["flash", "mhla"] and req.prompt == "a fox" and req.seed == 3 and req.negative_prompt == ""


def test_variant_notes(models):
    assert models.random_note and "RANDOM weights" in models.random_note
    assert models.variants["flash"].note == "RANDOM weights: the video is noise"
    for name in ("linear", "mhla", "mhla-hybrid"):
        assert models.variants[name].note == CONVERTED_NOTE + "; RANDOM weights: the video is noise"
        assert models.variants[name].kind == "converted, random"
        assert models.variants[name].transformer is models.components.transformer  # shared, not copied


def _ssim_reference(x: np.ndarray, y: np.ndarray) -> float:
    """SSIM written independently of app.quality: a whole-video float64 2D convolution with the full 11x11
    Gaussian window (sigma 1.5), luma 0.299 R + 0.587 G + 0.114 B, valid positions, mean over everything."""
    r = np.arange(11) - 5.0
    w1 = np.exp(-(r**2) / (2 * 1.5**2))
    w = torch.from_numpy(np.outer(w1, w1) / np.outer(w1, w1).sum())[None, None]

    def luma(v):
        v = v.astype(np.float64) / (255.0 if v.dtype == np.uint8 else 1.0)
        return torch.from_numpy(0.299 * v[..., 0] + 0.587 * v[..., 1] + 0.114 * v[..., 2])[:, None]

    a, b = luma(x), luma(y)
    f = lambda t: torch.nn.functional.conv2d(t, w)  # noqa: E731
    ma, mb = f(a), f(b)
    va, vb, c = f(a * a) - ma**2, f(b * b) - mb**2, f(a * b) - ma * mb
    c1, c2 = 0.01**2, 0.03**2
    return float((((2 * ma * mb + c1) * (2 * c + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2))).mean())


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_quality_measures_streamed_in_chunks_equal_whole_video_formulas(monkeypatch, dtype):
    """PSNR, SSIM and the degenerate checks stream over a few frames at a time (a 81x480x832 video's SSIM
    once wanted ~30 GB); with chunks of 1-2 frames forced they must give the whole-video numbers."""
    rng = np.random.default_rng()
    smooth = rng.random((7, 20, 24, 3)).cumsum(axis=2) / 24  # some structure for SSIM to see
    noisy = np.clip(smooth + rng.normal(0, 0.05, smooth.shape), 0, 1)
    if dtype == np.uint8:
        smooth, noisy = (np.round(v * 255).astype(np.uint8) for v in (smooth, noisy))
    else:
        smooth, noisy = smooth.astype(np.float32), noisy.astype(np.float32)
    scale = 255.0 if dtype == np.uint8 else 1.0
    mse = np.mean((smooth.astype(np.float64) / scale - noisy.astype(np.float64) / scale) ** 2)
    for chunk in (1 << 22, 20 * 24 * 3, 2 * 20 * 24 * 3 + 5):  # whole video, one frame, two frames
        monkeypatch.setattr(quality, "CHUNK_VALUES", chunk)
        assert quality.psnr(noisy, smooth) == pytest.approx(10 * math.log10(1 / mse), rel=1e-12)
        assert quality.ssim(noisy, smooth) == pytest.approx(_ssim_reference(noisy, smooth), abs=2e-6)
        assert quality.degenerate(noisy) is None
        assert quality.degenerate(np.repeat(noisy[:1], 5, axis=0)) == "frozen"
        black = np.zeros_like(noisy)
        black[3, 5, 5] = 100 if dtype == np.uint8 else 100 / 255  # one grey pixel of 480: spread 0.018, blank
        assert quality.degenerate(black) == "blank"


@pytest.mark.slow  # generates every variant
def test_compare_streams_every_variant_with_consistent_latency_and_quality(models, tmp_path):
    req = compare.check_request(models, "a red fox", "", 0, 2, 5.0, SMALLEST, list(VARIANTS), repeats=2)
    stages = []
    snapshots = list(compare.iter_compare(models, req, tmp_path, progress=lambda t, f: stages.append((t, f))))
    # one snapshot per finished variant, growing, then the final one (with the side-by-side video)
    assert [[r.variant for r in s.runs] for s in snapshots] == [list(VARIANTS[: i + 1]) for i in range(4)] + [
        list(VARIANTS)
    ]
    # the tiny model's variants share one transformer (converted in place): they cannot take turns step by step
    assert not snapshots[-1].interleaved
    texts = [t for t, _ in stages]
    assert "mhla (repeat 2/2): denoising step 2/2 · variant 3/4" in texts
    assert "mhla-hybrid: decoding video" in texts
    fractions = [f for _, f in stages]
    assert fractions == sorted(fractions) and 0 <= fractions[0] and fractions[-1] <= 1  # never goes back
    result = snapshots[-1]
    side = read_video(result.side_by_side)
    assert side.shape == (5, 32 + 16, 4 * 48 + 3 * 2, 3)  # a label strip over four videos, 2-pixel gaps
    for run in result.runs:
        assert run.error is None and len(run.timings) == 2  # no warm-up generation per request
        frames = read_video(run.video)
        assert frames.shape == (5, 32, 48, 3)
        t = run.timing
        assert t.variant == run.variant and t.num_tokens == 12 and len(t.steps) == 2
        assert t.denoising == pytest.approx(sum(t.steps)) and t.denoising < t.total
        assert t.total == pytest.approx(t.text_encoding + t.denoising + t.vae_decode)
        assert 0 < t.self_attention < t.denoising and t.text_encoding > 0 and t.vae_decode > 0
        s = run.steps
        assert s.n == 4 and s.low <= s.median <= s.high
        assert len(run.paired_steps) == 2  # each run's first step is a warm-up, left out of the speedups
        md = compare.variant_markdown(run, result)
        assert "denoising step:" in md and run.note in md and "VAE decoding" in md
        if run.variant == "flash":
            assert run.psnr is None
        else:
            assert 0 < run.psnr < math.inf and -1 <= run.ssim <= 1 and "agreement with flash" in md
            assert "per denoising step (95% interval" in md
    assert all(r.attributes is None for r in result.runs)  # the analyser is for the built-in model only
    rows = compare.table_rows(result)
    col = {h: i for i, h in enumerate(compare.TABLE_HEADERS)}
    by = {row[0]: row for row in rows}
    speed = col["speedup per step vs flash (95% interval)"]
    assert by["flash"][speed] == "reference" and by["flash"][col["end-to-end speedup"]] == "reference"
    den, e2e = result.speedups(result.run("mhla"))
    assert den.n == 2 and by["mhla"][speed].startswith(f"{den.estimate:.2f}x ({den.low:.2f}-{den.high:.2f})")
    assert by["mhla"][col["end-to-end speedup"]] == f"{e2e:.2f}x"
    psnr = result.run("mhla").psnr
    assert by["mhla"][col["agreement with flash (PSNR / SSIM)"]].startswith(f"{psnr:.1f} dB / ")
    details = compare.detail_rows(result)
    assert [row[0] for row in details] == [row[0] for row in rows] and len(details[0]) == len(compare.ALL_HEADERS)
    assert details[0][: len(compare.TABLE_HEADERS)] == rows[0]  # the table's columns first, then the details
    md = compare.table_markdown(result).splitlines()
    assert md[0] == "| " + " | ".join(compare.TABLE_HEADERS) + " |" and len(md) == 2 + len(rows)
    summary = compare.summary_markdown(result)
    assert "RANDOM weights" in summary and result.device in summary and "sdpa" in result.softmax_backend
    assert "seed used: 0" in summary and "ran one after another" in summary
    # the headline names the interleaving problem: these speedups are exposed to load drift
    assert "ran one after another" in compare.noise_warning(result)
    assert compare.speedup_figure(result) is not None


def _timed(name, *runs_steps):
    from common.timing import Timing

    timings = [Timing(name, "cpu", "float32", total=sum(s) + 1, steps=list(s), denoising=sum(s)) for s in runs_steps]
    return compare.VariantRun(name, "", timings=timings)


def test_speedups_come_from_paired_steps_with_an_interval(models):
    # planted: flash's steps drift (load), mhla's drift alike at half the time: a clean 2x, interval of width 0
    drift = [1.0, 1.0, 1.5, 2.0, 1.2, 0.8, 1.0]
    req = compare.check_request(models, "a fox", "", 0, 7, 5.0, SMALLEST, ["flash", "mhla", "linear"])
    result = compare.CompareResult(
        req,
        [
            _timed("flash", drift),
            _timed("mhla", [x / 2 for x in drift]),
            # linear: about 1.1x with ratios all over the place
            _timed("linear", [1.0, 0.5, 1.8, 1.2, 1.6, 0.5, 1.0]),
        ],
        "cpu",
    )
    den, e2e = result.speedups(result.run("mhla"))
    # the first step is a warm-up: 6 pairs; every ratio exactly 2, so the interval is 2-2 despite the drift
    assert den.n == 6 and den.estimate == pytest.approx(2.0) and den.low == pytest.approx(2.0)
    assert not den.noisy and e2e == pytest.approx((sum(drift) + 1) / (sum(drift) / 2 + 1))
    lin, _ = result.speedups(result.run("linear"))
    assert lin.noisy and lin.half_width > 0.1
    warning = compare.noise_warning(result)
    assert "linear (±" in warning and "mhla" not in warning
    head = compare.headline_markdown(result)
    assert "mhla 2.00x** (2.00-2.00)" in head and "linear" in head and "⚠ noisy" in head.split("linear")[1]
    assert compare.noise_warning(compare.CompareResult(req, result.runs[:2], "cpu")) is None
    assert result.speedups(result.run("flash")) == (None, None)


def test_a_degenerate_video_is_labelled_and_never_ranks_first(models):
    req = compare.check_request(models, "a fox", "", 0, 2, 5.0, SMALLEST, ["flash", "mhla", "linear"])
    flash, mhla, linear = _timed("flash", [1, 1]), _timed("mhla", [1, 1]), _timed("linear", [1, 1])
    flash.attributes = {"count": True, "colour": True, "shape": False, "motion": False}
    linear.attributes = {"count": True, "colour": True, "shape": True, "motion": False}
    # mhla: blank, yet the best agreement with flash and an analyser verdict that claims everything
    mhla.attributes = {"count": True, "colour": True, "shape": True, "motion": True}
    mhla.degenerate, mhla.psnr, mhla.ssim = "blank", 30.0, 0.95
    result = compare.CompareResult(req, [flash, mhla, linear], "cpu")
    assert [r.variant for r in result.ranking()] == ["linear", "flash", "mhla"]
    rows = compare.table_rows(result)
    assert [r[0] for r in rows] == ["linear", "flash", "mhla"]
    assert rows[0][1] == "misses: motion" and rows[2][1] == "⚠ blank video"
    assert "degenerate: blank video" in compare.variant_markdown(mhla, result)
    assert "mhla: ⚠ blank video" in compare.headline_markdown(result).split("best first")[1]


@pytest.mark.slow  # generates with the tiny model
def test_stop_ends_the_run_after_the_finished_variants(models, tmp_path):
    req = compare.check_request(models, "a fox", "", 0, 2, 5.0, SMALLEST, ["flash", "linear", "mhla"])
    cancel = threading.Event()
    snapshots = []
    for snap in compare.iter_compare(models, req, tmp_path, cancel=cancel):
        snapshots.append(snap)
        cancel.set()  # Stop pressed while linear is about to run
    assert [r.variant for r in snapshots[-1].runs] == ["flash"] and snapshots[-1].stopped
    assert "Stopped" in compare.summary_markdown(snapshots[-1])


def test_psnr_and_ssim_against_hand_computed_values():
    a = np.zeros((2, 16, 16, 3), np.float32)
    b = a + 0.1  # MSE 0.01 -> PSNR = 10 log10(1 / 0.01) = 20 dB
    assert quality.psnr(b, a) == pytest.approx(20.0)
    assert quality.psnr(a, a) == math.inf and quality.ssim(a, a) == pytest.approx(1.0)
    # constant frames x = 0.5, y = 0.25: variances and covariance are 0, so
    # SSIM = (2 * 0.5 * 0.25 + C1) / (0.5^2 + 0.25^2 + C1) * (C2 / C2)
    x, y = np.full((1, 12, 12, 3), 0.5), np.full((1, 12, 12, 3), 0.25)
    c1 = 0.01**2
    assert quality.ssim(x, y) == pytest.approx((0.25 + c1) / (0.3125 + c1), rel=1e-6)  # float32 blurs
    # uint8 frames are read as value / 255: 255 vs 0 is the largest error, PSNR 0 dB
    assert quality.psnr(np.full((1, 4, 4, 3), 255, np.uint8), np.zeros((1, 4, 4, 3), np.uint8)) == 0.0
    # a pattern against its negative: structure reversed, SSIM negative
    rng = np.random.default_rng(0)
    p = rng.random((1, 16, 16, 1)).repeat(3, -1)
    assert quality.ssim(p, 1 - p) < 0
    with pytest.raises(ValueError, match="same shape"):
        quality.psnr(a, a[:1])


def test_ssim_against_a_plain_float64_two_dimensional_window():
    """The shipped SSIM (float32 separable passes in numpy) against Wang et al.'s formula written out here:
    float64 luma, the 11x11 Gaussian window as a 2D array, every valid position's weighted sums."""
    rng = np.random.default_rng(1)
    video = rng.integers(0, 256, (3, 20, 24, 3), dtype=np.uint8)
    reference = np.clip(video.astype(int) + rng.integers(-40, 41, video.shape), 0, 255).astype(np.uint8)

    def plain(x, y):
        x = x.astype(np.float64) / 255 @ np.array([0.299, 0.587, 0.114])
        y = y.astype(np.float64) / 255 @ np.array([0.299, 0.587, 0.114])
        t = np.arange(11) - 5.0
        g1 = np.exp(-(t**2) / (2 * 1.5**2))
        w = np.outer(g1, g1) / np.outer(g1, g1).sum()
        win = np.lib.stride_tricks.sliding_window_view

        def blur(a):  # (T, H, W) -> (T, H - 10, W - 10)
            return np.einsum("thwij,ij->thw", win(a, (11, 11), axis=(1, 2)), w)

        mx, my = blur(x), blur(y)
        vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
        c1, c2 = 0.01**2, 0.03**2
        s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
        return s.mean(axis=(1, 2)).mean()

    want = plain(video, reference)
    assert 0.2 < want < 0.95  # a real difference, not a trivial 1 or 0
    assert quality.ssim(video, reference) == pytest.approx(want, rel=1e-5)
    floats = video.astype(np.float32) / 255  # float frames in [0, 1] read as they are
    assert quality.ssim(floats, reference.astype(np.float32) / 255) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow  # generates every variant
def test_compare_asks_the_models_judge_about_each_video(models, tmp_path):
    calls = []

    def judge(frames, prompt):  # what a model's analyser gets: the decoded frames and the prompt
        calls.append((np.asarray(frames).shape, prompt))
        return {"count": True, "colour": False, "motion": True}

    judged = replace(models, judge=judge)
    req = compare.check_request(judged, "a red fox", "", 0, 1, 5.0, SMALLEST, ["flash", "mhla"])
    result = list(compare.iter_compare(judged, req, tmp_path))[-1]
    assert [r.attributes for r in result.runs] == [{"count": True, "colour": False, "motion": True}] * 2
    assert calls == [((5, 32, 48, 3), "a red fox")] * 2
    col = compare.TABLE_HEADERS.index("against the prompt")
    assert [row[col] for row in compare.table_rows(result)] == ["misses: colour"] * 2
    assert "against the prompt: **misses: colour** (count ✓ colour ✗ motion ✓)" in compare.variant_markdown(
        result.runs[1], result
    )


@pytest.mark.slow  # loads the built-in model's variants
def test_the_launcher_gives_the_builtin_model_its_analyser():
    import run_app
    from world.analyse import strict_verdicts

    assert run_app.compose(None, {}, None, "cpu", "auto").judge is strict_verdicts
    assert run_app.compose("tiny-random", {}, None, "cpu", "auto").judge is None


def test_spread_is_median_and_quartiles():
    s = spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s.median, s.low, s.high, s.n) == (3.0, 2.0, 4.0, 5)
    assert s.relative == pytest.approx(1 / 3)
    assert spread([2.0]).relative == 0 and spread([1.0]).overlaps(spread([1.0]))
    assert not spread([1.0, 1.1]).overlaps(spread([2.0, 2.1]))
    with pytest.raises(ValueError, match="at least one sample"):
        spread([])


@pytest.mark.slow  # generates every variant
def test_compare_reports_a_failing_variant_and_goes_on(models, tmp_path, monkeypatch):
    real = compare.engine.generate

    def failing(components, request, **kw):
        if request.variant == "linear":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return real(components, request, **kw)

    monkeypatch.setattr(compare.engine, "generate", failing)
    req = compare.check_request(models, "a fox", "", 1, 1, 5.0, SMALLEST, ["flash", "linear", "mhla"])
    result = compare.run_compare(models, req, tmp_path)
    by = {r.variant: r for r in result.runs}
    assert by["linear"].video is None and "out of memory" in by["linear"].error and "12 tokens" in by["linear"].error
    assert by["flash"].video.is_file() and by["mhla"].video.is_file()
    assert "linear failed:** out of memory" in compare.variant_markdown(by["linear"])
    assert "Failed:** linear" in compare.summary_markdown(result)
    assert compare.table_rows(result)[-1][:2] == ["linear", f"error: {by['linear'].error}"]  # failed ones last


def test_old_runs_are_cleaned_up(tmp_path):
    for _ in range(compare.KEEP_RUNS + 5):
        compare.new_run_dir(tmp_path)
    assert len(list(tmp_path.iterdir())) == compare.KEEP_RUNS


def test_variant_dirs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="expects NAME=DIR"):
        parse_variant_dirs(["mhla"])
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        parse_variant_dirs([f"fast={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        parse_variant_dirs([f"mhla={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    assert parse_variant_dirs([f"mhla={tmp_path}"]) == {"mhla": tmp_path}


def test_model_choices_exclude_each_other():
    with pytest.raises(ValueError, match="exclude each other"):
        load_app_models("/nowhere", random_weights="1.3b")
    with pytest.raises(ValueError, match="size must be one of 1.3b, 14b, got '7b'"):
        build_random_wan("7b")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no token grids"),
        ("1x16", "a grid looks like"),
        ("1x0x4", "a grid looks like"),
        ("4x64x64", "at most 4,096"),
    ],
)
def test_bench_grids_are_checked(text, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_grids(text, max_tokens=4096)


def test_bench_grids_sorted_by_tokens():
    assert bench.parse_grids("2x4x4, 1x4x4,2x4x4") == [(1, 4, 4), (2, 4, 4)]


@pytest.mark.slow  # runs the benchmark
def test_benchmark_measures_both_levels(models, tmp_path):
    result = bench.run_benchmark(models, "1x4x4,1x8x8", variants=["flash", "mhla"], repeats=1)
    rows = result["rows"]
    ops = [r for r in rows if r["level"] == "operator"]
    fwd = [r for r in rows if r["level"] == "transformer forward"]
    assert [(r["variant"], r["tokens"]) for r in ops] == [(v, n) for n in (16, 64) for v in bench.OPERATORS]
    assert [(r["variant"], r["tokens"]) for r in fwd] == [(v, n) for n in (16, 64) for v in ("flash", "mhla")]
    assert all(r["ms"] > 0 for r in rows)
    assert ops[0]["backend"].startswith("sdpa")
    assert result["meta"]["heads"] == models.components.transformer.config.num_attention_heads
    js, cs = bench.save(result, tmp_path)
    assert (
        cs.read_text().splitlines()[0] == ",".join(bench.FIELDS) and len(cs.read_text().splitlines()) == len(rows) + 1
    )
    assert js.is_file() and len(bench.table(result)) == len(rows)
    assert bench.figure(result) is not None


def test_benchmark_refuses_bad_choices(models):
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run_benchmark(models, "1x4x4", variants=["nope"])
    with pytest.raises(ValueError, match="levels must be some of"):
        bench.run_benchmark(models, "1x4x4", levels=["kernel"])


@pytest.mark.slow  # builds the Gradio page
def test_page_api_has_named_outputs_and_an_optional_negative_prompt(models, tmp_path):
    from app.ui import build_demo

    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    api = demo.get_api_info()["named_endpoints"]
    assert set(api) == {"/compare", "/benchmark"}  # the page's helper events are private
    params = {p["parameter_name"]: p for p in api["/compare"]["parameters"]}
    assert list(params) == [
        "prompt",
        "negative_prompt",
        "seed",
        "num_inference_steps",
        "guidance_scale",
        "preset",
        "variants",
        "repeats",
    ]
    assert not params["prompt"]["parameter_has_default"] and params["negative_prompt"]["parameter_default"] == ""
    assert "81x480x800" not in params["preset"]["type"]["enum"]  # not offered on this device
    names = [r["label"] for r in api["/compare"]["returns"]]
    assert names == [
        "status",
        "headline",
        *(f"{v} {what}" for v in VARIANTS for what in ("video", "details", "preview")),
        "summary",
        "By variant, best against the prompt first",
        "All measurements by variant",
        "denoising step latency",
        "Side-by-side video (every variant, labelled)",
    ]
    assert not any(n.startswith("value_") for n in names)


@pytest.mark.gpu
def test_random_weights_at_true_size_on_gpu(tmp_path):
    m = load_app_models(random_weights="1.3b")
    assert m.components.transformer.config.num_attention_heads == 12 and "RANDOM" in m.random_note
    req = compare.check_request(m, "a fox", "", 0, 2, 5.0, compare.preset_key((17, 128, 192)), ["flash", "mhla"])
    result = compare.run_compare(m, req, tmp_path)
    assert all(r.error is None and r.timing.peak_memory_bytes > 0 for r in result.runs)
    assert result.runs[0].timing.num_tokens == 5 * 8 * 12 and read_video(result.runs[0].video).shape == (
        17,
        128,
        192,
        3,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "mhla"], "--variant expects NAME=DIR"),
        (["--variant", "fast=ckpt"], "unknown variant 'fast'"),
        (["--model", "/nowhere/wan"], "'/nowhere/wan' does not exist"),
        (["--model", "/nowhere/wan", "--random-weights", "1.3b"], "exclude each other"),
    ],
)
def test_launcher_refuses_bad_arguments_before_loading(argv, message, capsys):
    import run_app

    assert run_app.main(argv) == 2
    assert message in capsys.readouterr().err


def test_huge_prompts_are_refused_with_the_limit(models):
    with pytest.raises(ValueError, match=r"the prompt has 131,073 characters; at most 2,000 are accepted"):
        compare.check_request(models, "a" * 131_073, "", 1, 1, 5.0, SMALLEST, ["flash"])
    with pytest.raises(ValueError, match=r"the negative prompt has 5,000 characters"):
        compare.check_request(models, "a fox", "b" * 5000, 1, 1, 5.0, SMALLEST, ["flash"])


@pytest.mark.slow  # generates with the tiny model
def test_a_variant_failing_unexpectedly_keeps_the_others_and_shows_no_server_path(models, tmp_path, monkeypatch):
    real = compare.engine.generate
    secret = str(tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "x.py")

    def failing(components, request, **kw):
        if request.variant == "flash":
            raise OSError(7, f"Argument list too long: {secret}")
        if request.variant == "linear":
            raise ValueError(f"weights in {secret} are bad")
        return real(components, request, **kw)

    monkeypatch.setattr(compare.engine, "generate", failing)
    req = compare.check_request(models, "a fox " * 300, "", 1, 1, 5.0, SMALLEST, ["flash", "linear", "mhla"])
    result = compare.run_compare(models, req, tmp_path / "out")
    by = {r.variant: r for r in result.runs}
    assert by["mhla"].video.is_file()  # the long (1,800-character) prompt goes into its metadata safely
    assert by["flash"].error == "internal error (OSError); the details are in the server's log"
    assert by["linear"].error == "ValueError: weights in .../x.py are bad"
    page = compare.summary_markdown(result) + "".join(compare.variant_markdown(r) for r in result.runs)
    assert str(tmp_path) not in page


def test_time_call_and_device_name():
    from common.timing import device_name, time_call

    calls = []
    s = time_call(lambda: calls.append(1), "cpu", warmup=2, repeats=3)
    assert len(calls) == 5 and s.n == 3 and 0 <= s.low <= s.median <= s.high
    assert device_name(torch.device("cpu")).startswith("CPU: ")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_call(lambda: None, "cpu", repeats=0)


def test_random_wan_architectures_have_one_config_table():
    from benchmarks.wan_step import CONFIGS
    from pipelines.loading import WAN_CONFIGS

    assert {k: CONFIGS[k] for k in WAN_CONFIGS} == WAN_CONFIGS and set(CONFIGS) == {"1.3b", "14b", "tiny", "builtin"}


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
def test_stored_example_results_round_trip(models, tmp_path):
    """What ``run_app.py --store-examples`` writes, the page reads back: the same table, small videos."""
    folder = tmp_path / "examples"
    path = compare.store_examples(models, folder, ["a red fox"])
    stored = compare.load_stored(folder)
    assert list(stored) == ["a red fox"] and path == folder / compare.STORED_FILE
    result = stored["a red fox"]
    assert result.measured.startswith("measured on ") and "UTC" in result.measured
    assert [r.variant for r in result.runs] == list(VARIANTS) and result.side_by_side is None
    for run in result.runs:
        assert run.video.parent == folder and read_video(run.video).shape[0] == result.request.num_frames
    again = compare.result_from_dict(compare.result_to_dict(result), folder)
    assert compare.table_rows(again) == compare.table_rows(result)
    assert "**Precomputed result** (measured on" in compare.summary_markdown(result)
    # a stored video that went missing: that result is not offered (the page would show an empty column)
    result.runs[0].video.unlink()
    assert compare.load_stored(folder) == {}
    assert compare.load_stored(None) == {} and compare.load_stored(tmp_path / "nothing") == {}


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
def test_storing_examples_that_fails_part_way_keeps_the_stored_results(models, tmp_path, monkeypatch):
    """``--store-examples`` stopped or failing on its second prompt: the earlier store, its videos and a file of
    one's own stay as they were; a complete run replaces the store and keeps that file."""
    folder = tmp_path / "examples"
    compare.store_examples(models, folder, ["a red fox"])
    (folder / "NOTES.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real = compare.run_compare
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second example
        return real(*args, **kwargs)

    monkeypatch.setattr(compare.store, "run_compare", failing)
    with pytest.raises(KeyboardInterrupt):
        compare.store_examples(models, folder, ["a blue square", "a green circle"])
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert list(compare.load_stored(folder)) == ["a red fox"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "examples"
    ]
    monkeypatch.setattr(compare.store, "run_compare", real)
    compare.store_examples(models, folder, ["a blue square"])
    assert list(compare.load_stored(folder)) == ["a blue square"] and (folder / "NOTES.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples"]  # no staging or old folder left


@pytest.mark.slow  # generates with the tiny model
def test_after_stop_the_run_streams_nothing_that_could_overwrite_the_stopped_line(models, tmp_path):
    """Stop's status line is the last word on the page: once Stop is pressed the compare generator yields no
    more stage lines or snapshots (a tick already on its way overwrote "Stopped" in a browser under load), only
    its own closing "Stopped" line when it is not cancelled first."""
    from types import SimpleNamespace

    from app.ui import build_demo

    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    request = SimpleNamespace(session_hash="stop-test", query_params={})
    run = fns["on_compare"]("a red fox", "", 0, 30, 5.0, SMALLEST, ["flash", "linear"], 1, request=request)
    first = next(run)  # the run is going: its first streamed line
    assert "Stopped" not in first[0]
    line = fns["on_stop"](request)[1]
    assert "Stopped" in line
    after = list(run)  # the worker ends before its next transformer call; the generator then returns
    assert len(after) == 1 and "Stopped" in after[0][0], [a[0] for a in after]
    assert not isinstance(fns["on_stop"](request)[1], str)  # nothing running any more: the line is left as it is


def _page(demo, values) -> dict:
    """The compare outputs by label (``values`` in the order of the compare event's outputs)."""
    event = next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_compare")
    labels = [getattr(c, "label", None) or getattr(c, "elem_id", None) or type(c).__name__ for c in event.outputs]
    return dict(zip(labels, values))


def test_a_new_run_starts_from_an_empty_page_and_stop_keeps_only_what_it_finished(models, tmp_path):
    """Issue 38 (1): a stored example or an earlier run never stays beside a new run's results; Stop before any
    variant finished leaves nothing on the page, not "the variants that finished are shown"."""
    from types import SimpleNamespace

    from app.ui import build_demo

    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    request = SimpleNamespace(session_hash="clear-test", query_params={})
    run = fns["on_compare"]("a red fox", "", 0, 30, 5.0, SMALLEST, ["flash", "linear"], 1, request=request)
    page = _page(demo, next(run))  # the first thing a run shows: the page without anything from before
    assert page["status"].startswith("**Running:**")
    assert page["flash video"] is None and page["linear video"] is None and page["denoising step latency"] is None
    assert page["headline"] == "" and page["summary"] == "" and page["All measurements by variant"]["data"] == []
    assert page["Side-by-side video (every variant, labelled)"] is None
    stopped = fns["on_stop"](request)
    page = _page(demo, stopped[1:])
    assert "before any variant finished" in page["status"] and "are shown" not in page["status"]
    assert page["flash video"] is None and page["denoising step latency"] is None
    list(run)


def test_stop_after_one_variant_keeps_that_variant_only(models, tmp_path):
    from types import SimpleNamespace

    from app.ui import build_demo

    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    request = SimpleNamespace(session_hash="stop-one", query_params={})
    # flash's column fills first (flash alone in that snapshot)
    run = fns["on_compare"]("a red fox", "", 0, 2, 5.0, SMALLEST, ["flash", "linear"], 1, request=request)
    for values in run:
        page = _page(demo, values)
        if isinstance(page["flash video"], str):  # flash's column filled (other values: None or gr.skip())
            break
    stopped = _page(demo, fns["on_stop"](request)[1:])
    # which finished, and where the other one was stopped (issue 52: "the others did not run" while they had)
    assert "flash finished and is shown" in stopped["status"]
    assert re.search(r"stopped: linear (before its first step|at step 1 of 2|after all 2 steps)", stopped["status"])
    assert isinstance(stopped["flash video"], str) and stopped["linear video"] is None
    list(run)


def test_a_stored_example_says_it_is_stored(models, tmp_path):
    from app.compare_tab import stored_label

    result = compare.CompareResult(
        compare.check_request(models, "a fox", "", 0, 2, 5.0, SMALLEST, ["flash"]), runs=[], device="cpu"
    )
    assert stored_label(result) == ""  # a fresh run carries no label
    result.measured = "measured on cpu (2 cores), load 6.1, 2026-11-25"
    label = stored_label(result)
    assert "Stored example, not a run of yours" in label and "2026-11-25" in label and '"a fox"' in label


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
def test_a_stored_example_opens_with_its_side_by_side_video(models, tmp_path):
    """Issue 38 (6): the stored examples' side-by-side panel was empty (the store keeps only each variant's
    video); the page makes it from them the first time the example is shown."""
    from types import SimpleNamespace

    from app.ui import build_demo

    folder = tmp_path / "examples"
    compare.store_examples(models, folder, models.example_prompts[:1])  # the one the page opens with
    demo = build_demo(replace(models, stored_dir=folder), max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path / "o")
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    page = _page(demo, fns["on_load"](SimpleNamespace(session_hash="s", query_params={}))[6:-1])
    assert page["status"].startswith("Showing the stored result")
    side = read_video(page["Side-by-side video (every variant, labelled)"])
    width = models.defaults["width"]
    assert side.shape[2] == len(VARIANTS) * width + 2 * (len(VARIANTS) - 1)  # every variant, with its gaps
    flash = read_video(page["flash video"])
    assert side.shape[0] == flash.shape[0] and side.shape[1] > flash.shape[1]  # a label strip above the videos
    assert not str(page["Side-by-side video (every variant, labelled)"]).startswith(str(folder))  # a copy's


def test_the_committed_examples_name_the_softmax_backend_as_a_fresh_run_here_does():
    """Issue 38 (6): the stored results said "sdpa_flash" (an older dispatch), fresh runs "sdpa"."""
    from pipelines.model_dir import BUILTIN_DIR

    stored = compare.load_stored(BUILTIN_DIR / "examples")
    assert stored, "the built-in model's examples are committed"
    fresh = load_app_models("tiny-random")
    d = fresh.defaults
    request = compare.CompareRequest("a fox", "", 0, 1, 5.0, (d["num_frames"], d["height"], d["width"]), ["flash"])
    backend = compare.engine._generate(fresh, request, "flash", 1).timing.softmax_backend
    assert backend and {r.softmax_backend for r in stored.values()} == {backend}


def test_the_third_design_opens_at_its_own_size_and_its_long_preset_has_2880_tokens(tmp_path):
    """The built-in model's third design (factory.v3: VAE 2x4x4, patch 1x2x2): its native 9x64x80 clip is a
    preset and the page's default, 400 tokens in 20 MHLA blocks; 17x128x160 is its long preset, 2,880 tokens."""
    from app.compare_tab import _default_preset
    from factory import v3

    folder = v3.init(tmp_path / "model", next_dir=tmp_path / "next")
    models = load_app_models(folder)
    assert _default_preset(models, compare.CPU_MAX_TOKENS) == "9x64x80"
    labels = dict((v, k) for k, v in compare.preset_choices(models))
    t, h, w = 9 // 2 + 1, 64 // 8, 80 // 8  # latent frames (1 + 8 / 2), tokens across (pixels / (4 * 2))
    assert (
        labels["9x64x80"] == f"9x64x80: {t * h * w} tokens ({t}x{h}x{w}), M=20" == "9x64x80: 400 tokens (5x8x10), M=20"
    )
    assert labels["17x128x160"].startswith("17x128x160: 2,880 tokens (9x16x20), M=")

"""benchmarks.whole_video on a CPU, tiny: every variant and mode runs end to end through generate(), the table
has its fields, the cached run's PSNR is computed from the decoded frames of the cached and the uncached runs
(same seed, same compile), and the cache computed the calls its schedule says. Nothing about time is asserted
(a CPU's times say nothing about a GPU's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import whole_video
from pipelines.caching import CacheSpec

pytestmark = pytest.mark.slow


def test_tiny_whole_video_every_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("MHLA_COMPILE_BACKEND", "aot_eager")  # the same graphs, no C++ compiler
    torch._dynamo.reset()
    out, frames = tmp_path / "wv", tmp_path / "frames"
    steps = 3
    args = ["--model", "tiny-random", "--steps", str(steps), "--size", "9x64x96", "--variants", "flash,mhla"]
    # MagCache with Wan2.1's ratios and a threshold that skips: steps 1 and 2 reuse step 0's residual
    args += ["--modes", "eager,compiled,cached", "--cache", "mag-wan2.1:10", "--decode", "fp32-compiled"]
    args += ["--decode-levers", "fp32,bf16", "--decode-rounds", "1", "--warmup-steps", "1"]
    record = whole_video.main([*args, "--out", str(out), "--frames-dir", str(frames)])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["meta"]["complete"] and saved["meta"]["steps"] == steps and saved["meta"]["size"] == "9x64x96"
    runs = {(r["mode"], r["variant"]): r for r in saved["runs"]}
    assert set(runs) == {(m, v) for m in ("eager", "compiled", "cached") for v in ("flash", "mhla")}
    for r in runs.values():
        assert "skipped" not in r, r
        for field in ("text_s", "denoise_s", "decode_s", "total_s"):
            assert r[field] > 0, (field, r)
        assert r["total_s"] == pytest.approx(r["text_s"] + r["denoise_s"] + r["decode_s"])
        assert r["vs_flash"] == pytest.approx(runs[(r["mode"], "flash")]["total_s"] / r["total_s"])
        assert not r["projected"] and r["steps_timed"] == steps and r["calls"] == 2 * steps  # CFG: 2 a step
        assert r["graphs_compiled_while_timed"] == 0, r  # warmed up: nothing compiled while timed
    assert runs[("eager", "flash")]["decode"] == "fp32" and runs[("cached", "mhla")]["decode"] == "fp32-compiled"
    schedule = whole_video.mag_schedule(whole_video.parse_cache_arg("mag-wan2.1:10"), steps)
    assert schedule == [True, False, False]
    for v in ("flash", "mhla"):
        cached, compiled = runs[("cached", v)], runs[("compiled", v)]
        assert cached["computed_calls"] == 2 * sum(schedule) < cached["calls"]
        assert compiled["computed_calls"] == compiled["calls"]
        # the PSNR of the frames each run decoded, against the uncached compiled run of the same seed
        a, b = np.load(frames / f"{v}_cached.npy"), np.load(frames / f"{v}_compiled.npy")
        assert a.shape == (9, 64, 96, 3) and not np.array_equal(a, b)
        assert cached["psnr_vs"] == "compiled" and cached["psnr_db"] == pytest.approx(whole_video.psnr(a, b))
        assert 0 < cached["psnr_db"] < 100
        assert compiled["psnr_vs"] == "eager"  # compile alone: the eager numbers (aot_eager: identical)
    table = out.with_suffix(".md").read_text()
    assert "| variant | mode | text s | denoise s | decode s | total s | vs flash |" in table
    assert "| mhla | cached |" in table and "CPU run" in table and "apply at 81x480x832" in table
    levers = saved["decode_levers"]["settings"]
    assert levers["fp32"]["s"] > 0 and levers["bf16"]["psnr_vs_fp32_db"] > 20
    assert record["meta"]["cache_schedule_computed_steps"] == 1


def test_eager_steps_project_the_denoising(tmp_path):
    out = tmp_path / "wv"
    args = ["--model", "tiny-random", "--steps", "4", "--eager-steps", "2", "--size", "9x64x96"]
    args += ["--variants", "mhla", "--modes", "eager", "--decode-levers", "none", "--warmup-steps", "1"]
    record = whole_video.main([*args, "--out", str(out)])
    (r,) = record["runs"]
    assert r["projected"] and r["steps_timed"] == 2 and r["calls"] == 4 and r["vs_flash"] is None
    assert "projected from 2 steps" in out.with_suffix(".md").read_text()
    assert record["decode_levers"] is None


def test_wan_magcache_schedule_and_arguments():
    """The default cache: MagCache with the ratios the MagCache authors calibrated on Wan2.1-T2V-1.3B; at
    diffusers' threshold 0.06 its schedule computes 25 of 50 steps, whatever the weights."""
    spec = whole_video.parse_cache_arg(whole_video.DEFAULT_CACHE)
    assert isinstance(spec, CacheSpec) and spec.kind == "mag" and len(spec.mag_ratios or ()) == 50
    assert sum(whole_video.mag_schedule(spec, 50)) == 25
    assert whole_video.mag_schedule(CacheSpec("mag", 0.0, (1.0,) + (0.5,) * 9), 10) == [True] * 10
    a = whole_video.parse_args(["--variants", "all", "--modes", "cached,eager", "--size", "81x480x832"])
    assert a.variants == ["flash", "linear", "mhla", "mhla-hybrid"]
    assert a.modes == ["cached", "eager"] and a.size == (81, 480, 832)
    for bad in (["--modes", "fast"], ["--size", "81x480"], ["--cache", "mag-wan2.1:x"], ["--decode", "fp8"]):
        with pytest.raises(SystemExit):
            whole_video.parse_args(bad)


def test_builds_the_random_folder_when_missing_then_reuses_it(tmp_path):
    """--build-if-missing: benchmarks.random_model's folder (shrunk here) is built, then read as any Wan folder
    (the path the device takes); a second run finds it complete and builds nothing."""
    folder = tmp_path / "model"
    args = ["--model", str(folder), "--build-if-missing", "--shrink-model", "--text-encoder-layers", "1"]
    args += ["--steps", "2", "--size", "5x32x32", "--variants", "mhla", "--modes", "eager"]
    args += ["--decode-levers", "none", "--warmup-steps", "1", "--out", str(tmp_path / "wv")]
    record = whole_video.main(args)
    assert (folder / "RANDOM_WEIGHTS.txt").is_file() and (folder / "model_index.json").is_file()
    meta = record["meta"]
    assert (
        meta["model_built_s"] is not None and meta["random_weights"] and meta["scheduler"] == "UniPCMultistepScheduler"
    )
    assert meta["flow_shift"] == 3.0 and meta["guidance"] == 5.0  # the folder's: Wan's defaults
    (r,) = record["runs"]
    assert "skipped" not in r and r["total_s"] > 0
    assert whole_video.main(args)["meta"]["model_built_s"] is None

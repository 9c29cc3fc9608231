"""Issue 40 (3, 5) in the app: ``run_app.py --cache ...`` and ``--compile blocks|full``, the generation CLI's
options (its definitions and checks), applied to every run of the app's engine, and said on the page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import run_app
from app import compare
from app.models import load_app_models
from pipelines import VARIANTS
from pipelines.caching import parse_cache

STEPS = 3


@pytest.fixture(scope="module")
def models():
    return load_app_models("tiny-random")


def _frames(models, variant: str, cache=None, compile="none") -> np.ndarray:
    d = models.defaults
    request = compare.CompareRequest(
        "a red fox", "", 0, STEPS, 5.0, (d["num_frames"], d["height"], d["width"]), [variant]
    )
    models.cache, models.compile = cache, compile
    try:
        return compare.engine._generate(models, request, variant, STEPS).frames  # the app's one call of generate()
    finally:
        models.cache, models.compile = None, "none"


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_apps_cache_gives_the_uncached_video_until_it_triggers(models, variant):
    plain = _frames(models, variant)
    # threshold 0: block 0 always moves more than that, so nothing is skipped: the very same video
    np.testing.assert_array_equal(_frames(models, variant, parse_cache("first-block:0")), plain)
    # a huge threshold: every step after the first reuses the cached blocks: another video (the cache is on)
    assert not np.array_equal(_frames(models, variant, parse_cache("first-block:1e9")), plain)
    np.testing.assert_array_equal(_frames(models, variant), plain)  # and off again for the next run


def test_the_page_says_a_cached_step_is_approximate(models, tmp_path):
    from app.compare_tab import table_device
    from app.ui import build_demo, header_markdown

    models.cache = parse_cache("first-block:0.05")
    try:
        assert "step cache: FirstBlockCache, threshold 0.05" in header_markdown(models)
        d = models.defaults
        request = compare.CompareRequest(
            "a red fox", "", 0, 2, 5.0, (d["num_frames"], d["height"], d["width"]), ["flash"]
        )
        result = compare.run_compare(models, request, tmp_path)
        line = table_device(result)  # next to the timings
        assert "FirstBlockCache" in line and "approximate" in line
        again = compare.result_from_dict(compare.result_to_dict(result), tmp_path)
        assert again.speed == result.speed
        build_demo(models, out_root=tmp_path / "page")  # the page builds with it
    finally:
        models.cache = None
    assert "cache" not in header_markdown(models) and "compile" not in header_markdown(models)


def test_the_launcher_takes_the_clis_options_and_names_a_bad_value(capsys):
    args = run_app.parse_args(["--cache", "first-block:0.1", "--compile", "blocks"])
    assert args.cache.kind == "first-block" and args.cache.threshold == 0.1 and args.compile == "blocks"
    assert run_app.parse_args([]).cache is None and run_app.parse_args([]).compile == "none"
    for bad, named in [
        (["--cache", "fastest"], "--cache 'fastest'"),
        (["--cache", "first-block:-1"], "threshold must be a finite number >= 0, got -1"),
        (["--compile", "everything"], "invalid choice: 'everything'"),
    ]:
        with pytest.raises(SystemExit):
            run_app.parse_args(bad)
        assert named in capsys.readouterr().err


@pytest.mark.slow  # torch.compile of every variant's blocks
@pytest.mark.parametrize("mode", ["blocks", "full"])
def test_the_apps_compiled_runs_give_the_eager_videos(models, mode, monkeypatch):
    """On a CPU with the aot_eager backend (the same graphs, no C++ compiler)."""
    monkeypatch.setenv("MHLA_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    compiled = load_app_models("tiny-random")  # its own transformer: compiling is in place
    for variant in ("flash", "mhla"):
        want = _frames(models, variant)
        got = _frames(compiled, variant, compile=mode)
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert compiled.components.transformer._mhla_compiled == (mode, "aot_eager", False)


def test_auto_decodes_in_bfloat16_only_where_the_cpu_runs_it_natively(monkeypatch):
    """An AVX2-only CPU emulates bfloat16: the VAE decoded 16x slower than in float32 there, so ``auto`` picks
    float32; a CPU with native bfloat16 (oneDNN's AVX512-BF16/AMX) gets bfloat16; a GPU keeps the model's dtype."""
    from app import models as app_models

    assert isinstance(app_models.cpu_has_native_bf16(), bool)  # this machine's answer, whichever it is
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(app_models, "cpu_has_native_bf16", lambda: False)
    assert app_models.decode_dtype_for(cpu, torch.float32) == torch.float32
    monkeypatch.setattr(app_models, "cpu_has_native_bf16", lambda: True)
    assert app_models.decode_dtype_for(cpu, torch.float32) == torch.bfloat16
    assert app_models.decode_dtype_for(gpu, torch.bfloat16) == torch.bfloat16
    assert app_models.decode_dtype_for(cpu, torch.float32, "bfloat16") == torch.bfloat16  # asked for: given

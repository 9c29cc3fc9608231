"""Issue 32: the app's launch options --offload and --vae-tiling, applied once after loading and shown in the
page's model line."""

from __future__ import annotations

import pytest

import run_app
from app.models import load_app_models
from app.ui import header_markdown


def test_offload_and_tiling_are_applied_once_and_shown():
    models = load_app_models("tiny-random", device="cpu", offload="sequential", vae_tiling=True)
    c = models.components
    assert models.memory == "offload sequential · VAE tiling (256 px tiles)"
    assert "memory: offload sequential · VAE tiling" in header_markdown(models)
    assert c.vae.use_tiling
    # every transformer a variant runs on is hooked (its weights wait on meta), the converted parameters too
    for variant in models.variants.values():
        params = list(variant.transformer.parameters())
        assert params and all(p.device.type == "meta" for p in params)
    assert any(".attn1.mhla." in n for n, _ in c.transformer.named_parameters())


def test_without_options_the_model_line_is_unchanged():
    models = load_app_models("tiny-random", device="cpu")
    assert models.memory == "" and "memory:" not in header_markdown(models)


def test_an_unknown_offload_mode_is_refused_by_the_launcher(capsys):
    with pytest.raises(SystemExit):
        run_app.parse_args(["--offload", "disk"])
    assert "invalid choice: 'disk'" in capsys.readouterr().err


def test_the_apps_offload_choices_are_the_generation_clis():
    """run_app keeps its argument parser free of torch imports, so it lists the modes itself: the same ones."""
    from pipelines.memory import OFFLOAD_MODES

    for mode in OFFLOAD_MODES:
        assert run_app.parse_args(["--offload", mode]).offload == mode

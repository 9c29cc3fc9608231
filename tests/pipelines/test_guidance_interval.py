"""Classifier-free guidance on part of the schedule (``guidance_max_sigma``): generate() against a denoising
loop written here, step by step, on the tiny random model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from diffusers import WanPipeline

from pipelines.cli import main, validate_request
from pipelines.model import set_variant
from pipelines.pipeline import generate
from pipelines.request import GenerationRequest

PROMPT = "a red square moves to the right"
SIZE = dict(height=64, width=96, num_frames=9, num_inference_steps=4)


@pytest.fixture
def components(tiny_components):
    """The session's tiny model (tests/conftest.py), back to softmax attention; conversions made by earlier
    tests stay in it as parameters, as in one app session."""
    set_variant(tiny_components.transformer, "flash")
    return tiny_components


def reference_latents(components, prompt: str, guidance: float, max_sigma: float, seed: int = 0) -> torch.Tensor:
    """Flow-matching sampling with the conditional prediction alone while sigma > max_sigma and
    uncond + g * (cond - uncond) after; its own loop, scheduler and noise."""
    tr = components.transformer
    scheduler = type(components.scheduler).from_config(components.scheduler.config)
    pipe = WanPipeline(
        tokenizer=components.tokenizer,
        text_encoder=components.text_encoder,
        vae=components.vae,
        scheduler=scheduler,
        transformer=tr,
    )
    cond_embeds, uncond_embeds = pipe.encode_prompt(
        prompt=prompt, negative_prompt="", max_sequence_length=512, device=torch.device("cpu")
    )
    shape = (1, tr.config.in_channels, (SIZE["num_frames"] - 1) // 4 + 1, SIZE["height"] // 8, SIZE["width"] // 8)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    scheduler.set_timesteps(SIZE["num_inference_steps"])
    guided = 0
    for i, t in enumerate(scheduler.timesteps):
        ts = t.expand(1)
        pred = tr(hidden_states=x, timestep=ts, encoder_hidden_states=cond_embeds, return_dict=False)[0]
        if scheduler.sigmas[i] <= max_sigma:
            guided += 1
            uncond = tr(hidden_states=x, timestep=ts, encoder_hidden_states=uncond_embeds, return_dict=False)[0]
            pred = uncond + guidance * (pred - uncond)
        x = scheduler.step(pred, t, x, return_dict=False)[0]
    assert 0 < guided < SIZE["num_inference_steps"] or max_sigma in (0.0, 1.0)
    return x


def latents(components, **kw) -> torch.Tensor:
    request = GenerationRequest(prompt=PROMPT, seed=0, output_type="latent", **{**SIZE, **kw})
    out = generate(components, request, show_progress=False)
    return torch.as_tensor(out.frames)


@torch.no_grad()
@pytest.mark.slow  # generates with the tiny model
def test_interval_matches_a_plain_loop(components):
    # tiny model, 4 steps: sigmas 1.0, 0.90, 0.75, 0.50 -> 0.8 guides the last two steps only
    got = latents(components, guidance_scale=5.0, guidance_max_sigma=0.8)
    want = reference_latents(components, PROMPT, 5.0, 0.8)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # and it is neither full guidance nor none
    full = latents(components, guidance_scale=5.0)
    none = latents(components, guidance_scale=1.0)
    assert (got - full).abs().max() > 1e-3 and (got - none).abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.slow  # generates with the tiny model
def test_interval_ends(components):
    full = latents(components, guidance_scale=5.0)
    torch.testing.assert_close(latents(components, guidance_scale=5.0, guidance_max_sigma=1.0), full)
    torch.testing.assert_close(full, reference_latents(components, PROMPT, 5.0, 1.0), rtol=1e-4, atol=1e-5)
    # no step guided: the conditional prediction alone, as CFG 1
    unguided = latents(components, guidance_scale=5.0, guidance_max_sigma=0.0)
    torch.testing.assert_close(unguided, latents(components, guidance_scale=1.0), rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.slow  # generates with the tiny model
def test_model_default_applies_and_an_argument_overrides_it(components):
    with_default = replace(components, defaults={**components.defaults, "guidance_max_sigma": 0.8})
    explicit = latents(components, guidance_scale=5.0, guidance_max_sigma=0.8)
    torch.testing.assert_close(latents(with_default, guidance_scale=5.0), explicit)
    torch.testing.assert_close(
        latents(with_default, guidance_scale=5.0, guidance_max_sigma=1.0), latents(components, guidance_scale=5.0)
    )


@pytest.mark.parametrize("bad", [1.5, -0.1, True, "0.5"])
def test_bad_interval_is_named(bad):
    with pytest.raises(ValueError, match=r"guidance_max_sigma must be a noise level in \[0, 1\]"):
        validate_request("a cat", 64, 96, 9, 2, 5.0, "flash", guidance_max_sigma=bad)


def test_cli_refuses_bad_interval(capsys):
    argv = ["--prompt", "x", "--model", "tiny-random", "--guidance-max-sigma", "2"]
    assert main(argv) == 2
    assert "guidance_max_sigma must be a noise level in [0, 1]" in capsys.readouterr().err

"""Every variant runs in every Wan architecture diffusers offers (tiny random models built here): Wan2.2-TI2V's
48-channel VAE with per-token timesteps, Wan2.2-A14B's two experts, the image-to-video pipeline of Wan2.2 and of
Wan2.1 (with its CLIP image encoder). The
converted layers are the ones the variant names, in each expert; the output is finite and differs from softmax's."""

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.attention import LinearSelfAttnProcessor
from pipelines.model import convert_self_attention
from pipelines.tiny import TINY_ARCHITECTURES, build_tiny_pipeline


def _run(pipe, architecture):
    kwargs = dict(height=64, width=96, num_frames=5, num_inference_steps=2, output_type="np", max_sequence_length=16)
    if architecture.endswith("-i2v"):
        pytest.importorskip("ftfy")  # WanImageToVideoPipeline needs it at call time
        kwargs["image"] = Image.fromarray(np.full((64, 96, 3), 128, np.uint8))
    if architecture == "wan2.1-i2v":  # its cross-attention takes all but the last 512 tokens as the image's
        kwargs["max_sequence_length"] = 512
    kwargs["prompt"] = "a red square moves to the right"
    return pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames


def _linear_layers(transformer):
    return [i for i, b in enumerate(transformer.blocks) if isinstance(b.attn1.processor, LinearSelfAttnProcessor)]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_every_variant_runs_in_every_architecture(architecture):
    pipe = build_tiny_pipeline(architecture, num_layers=6)
    experts = [t for t in (pipe.transformer, getattr(pipe, "transformer_2", None)) if t is not None]
    calls = [0] * len(experts)
    for i, t in enumerate(experts):
        t.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    baseline = _run(pipe, architecture)
    assert all(calls), calls  # every expert denoises some of the steps
    for variant, layers in (("linear", list(range(6))), ("mhla", list(range(6))), ("mhla-hybrid", [1, 2, 4, 5])):
        for t in experts:
            convert_self_attention(t, variant)
            assert _linear_layers(t) == layers, (architecture, variant)
        frames = _run(pipe, architecture)
        assert np.isfinite(frames).all() and frames.shape == baseline.shape
        assert np.abs(frames - baseline).max() > 0, (architecture, variant)
        for t in experts:
            convert_self_attention(t, "flash")
    np.testing.assert_array_equal(_run(pipe, architecture), baseline)


def test_unknown_architecture_is_named():
    with pytest.raises(ValueError, match="architecture must be one of"):
        build_tiny_pipeline("wan3")

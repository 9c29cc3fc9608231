"""Wan2.1-I2V end to end with its CLIP image encoder (issue 32): the tiny random-weight model
(``python -m pipelines.tiny --architecture wan2.1-i2v``, nothing downloaded) through ``load_components``,
``generate()``, the CLI and diffusers' own loaders. The first frame reaches the transformer twice: VAE-encoded as
the condition latents, and through the CLIP encoder's penultimate hidden state, which every cross-attention reads
with its own image key/value projections (``attn2.add_k_proj``/``add_v_proj``). Conversion touches only ``attn1``;
these tests hold that every variant still reads the image through ``attn2``."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from common.video import read_video
from pipelines.attention import LinearSelfAttnProcessor
from pipelines.loading import load_components
from pipelines.model import convert_self_attention, current_variant
from pipelines.pipeline import generate
from pipelines.request import GenerationRequest
from pipelines.tiny import TINY_IMAGE_ENCODER, TINY_TRANSFORMER, save_tiny_model
from tests.pipelines.cli_spy import run_cli

pytestmark = pytest.mark.usefixtures("ftfy")
LAYERS = 3  # mhla-hybrid's default split converts 1 and 2, layer 0 stays softmax
VARIANTS = ("flash", "linear", "mhla", "mhla-hybrid")
LINEAR_LAYERS = {"flash": [], "linear": [0, 1, 2], "mhla": [0, 1, 2], "mhla-hybrid": [1, 2]}
# 32 px in 8 px patches: 4 x 4 patches and the class token
IMAGE_TOKENS = (TINY_IMAGE_ENCODER["image_size"] // TINY_IMAGE_ENCODER["patch_size"]) ** 2 + 1


@pytest.fixture(scope="module")
def ftfy():
    pytest.importorskip("ftfy")  # WanImageToVideoPipeline needs it at call time


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model("wan2.1-i2v", tmp_path_factory.mktemp("tiny") / "wan21-i2v", num_layers=LAYERS)


@pytest.fixture(scope="module")
def components(folder):
    return load_components(folder, dtype="float32", device="cpu")


@pytest.fixture
def c(components):
    yield components
    convert_self_attention(components.transformer, "flash")


def _image(seed, size=(40, 56)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def _request(**kw):
    small = dict(height=32, width=48, num_frames=5, num_inference_steps=1, output_type="latent", seed=3)
    small["guidance_scale"] = 1.0  # one transformer pass per step: the image path is the same with or without CFG
    return GenerationRequest(prompt="a red square moves to the right", image=_image(1), **{**small, **kw})


def _linear_layers(transformer):
    return [i for i, b in enumerate(transformer.blocks) if isinstance(b.attn1.processor, LinearSelfAttnProcessor)]


# ---- the tiny folder: the parts and the dims that must match


def test_folder_names_the_clip_encoder_and_its_dims_match(folder):
    from diffusers import DiffusionPipeline
    from transformers import CLIPVisionModel

    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    assert index["image_processor"][0] == "transformers" and "CLIPImageProcessor" in index["image_processor"][1]
    config = json.loads((folder / "transformer" / "config.json").read_text())
    encoder = json.loads((folder / "image_encoder" / "config.json").read_text())
    processor = json.loads((folder / "image_processor" / "preprocessor_config.json").read_text())
    inner = TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"]
    assert config["in_channels"] == 36 and config["image_dim"] == encoder["hidden_size"] == 32
    assert config["added_kv_proj_dim"] == inner  # as diffusers' Wan2.1-I2V configs: the transformer's width
    assert processor["crop_size"] == {"height": encoder["image_size"], "width": encoder["image_size"]}
    pipe = DiffusionPipeline.from_pretrained(folder)  # diffusers' own loader agrees
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and isinstance(pipe.image_encoder, CLIPVisionModel)
    assert pipe.transformer.blocks[0].attn2.add_k_proj is not None


def test_components_load_the_encoder_in_float32(folder, components):
    from transformers import CLIPVisionModel

    assert isinstance(components.image_encoder, CLIPVisionModel) and not components.image_encoder.training
    assert components.image_processor is not None and components.index.image_encoder
    assert "CLIP image encoder" in components.index.describe()
    half = load_components(folder, dtype="bfloat16", device="cpu")
    # the transformer and text encoder take the dtype; the image encoder stays float32, like the VAE (the
    # pipeline casts its output to the transformer's dtype)
    assert half.transformer.dtype == torch.bfloat16 and half.text_encoder.dtype == torch.bfloat16
    assert half.image_encoder.dtype == torch.float32 and half.vae.dtype == torch.float32


def test_a_folder_naming_the_release_processor_class_loads(folder, tmp_path):
    """The released Wan2.1-I2V-Diffusers folders name ``CLIPImageProcessor`` (the tiny one names whichever class
    transformers builds here); both load, to the same pixels."""
    copy = tmp_path / "release-like"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(
        json.dumps({**index, "image_processor": ["transformers", "CLIPImageProcessor"]})
    )
    ours, theirs = (load_components(f, dtype="float32", device="cpu").image_processor for f in (folder, copy))
    a, b = (p(images=_image(5), return_tensors="pt")["pixel_values"] for p in (ours, theirs))
    size = TINY_IMAGE_ENCODER["image_size"]
    assert a.shape == (1, 3, size, size)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- generate(): the image goes through the encoder into every cross-attention, in every variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_video_follows_the_image_through_every_cross_attention(c, variant):
    request = _request(variant=variant)
    encoder_calls, image_tokens, added = [], [], dict.fromkeys(range(LAYERS), 0)
    handles = [
        c.image_encoder.register_forward_hook(lambda *_: encoder_calls.append(1)),
        c.transformer.register_forward_pre_hook(
            lambda _m, _a, kw: image_tokens.append(tuple(kw["encoder_hidden_states_image"].shape)), with_kwargs=True
        ),
    ]
    for i, block in enumerate(c.transformer.blocks):
        handles.append(block.attn2.add_k_proj.register_forward_hook(lambda *_, i=i: added.__setitem__(i, 1)))
    try:
        first = generate(c, request, show_progress=False).frames
    finally:
        for h in handles:
            h.remove()
    assert torch.isfinite(first).all() and _linear_layers(c.transformer) == LINEAR_LAYERS[variant]
    assert len(encoder_calls) == 1  # the image is encoded once per video
    # the encoder's penultimate hidden state: 16 patches + the class token, of its width 32 (the image_dim)
    assert set(image_tokens) == {(1, IMAGE_TOKENS, TINY_IMAGE_ENCODER["hidden_size"])}
    assert all(added.values()), added  # every layer's attn2 projected the image tokens, converted or not
    again = generate(c, request, show_progress=False).frames
    other = generate(c, replace(request, image=_image(2)), show_progress=False).frames
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # same seed and image: the same latents
    assert (first - other).abs().max() > 1e-4  # another image: other latents
    # the same image with the cross-attention's image values scaled: the CLIP path, not only the VAE-encoded
    # first frame, moves the output
    with torch.no_grad():
        for block in c.transformer.blocks:
            block.attn2.add_v_proj.weight.mul_(2.0)
        try:
            scaled = generate(c, request, show_progress=False).frames
        finally:
            for block in c.transformer.blocks:
                block.attn2.add_v_proj.weight.mul_(0.5)
    assert (first - scaled).abs().max() > 1e-4


def test_a_text_length_other_than_512_is_refused_before_conversion(c):
    # diffusers' Wan cross-attention takes all but the last 512 tokens as the image's
    with pytest.raises(ValueError, match="max_sequence_length=16.*assuming 512 text tokens"):
        generate(c, _request(variant="mhla"), max_sequence_length=16, show_progress=False)
    assert current_variant(c.transformer) == "flash"  # nothing converted


# ---- a converted folder, saved and reloaded by diffusers' own loaders and by the product


def test_converted_folder_reloads_with_its_encoder_and_variant(folder, tmp_path):
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    from pipelines.model import MHLAWanTransformer3DModel

    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    convert_self_attention(pipe.transformer, "mhla-hybrid", [0, 2])
    with torch.no_grad():  # a fine-tuned stand-in: the mixing differs from the locality init
        for name, p in pipe.transformer.named_parameters():
            if ".mhla." in name:
                p.mul_(0.8)
    pipe.transformer = pipe.transformer  # re-registered: model_index.json names the class that restores the variant
    pipe.save_pretrained(tmp_path / "mhla")
    index = json.loads((tmp_path / "mhla" / "model_index.json").read_text())
    assert index["transformer"] == ["pipelines.model", "MHLAWanTransformer3DModel"]
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    again = DiffusionPipeline.from_pretrained(tmp_path / "mhla")
    assert isinstance(again, WanImageToVideoPipeline) and isinstance(again.transformer, MHLAWanTransformer3DModel)
    assert current_variant(again.transformer) == "mhla-hybrid" and _linear_layers(again.transformer) == [0, 2]
    for before, after in ((pipe.transformer, again.transformer), (pipe.image_encoder, again.image_encoder)):
        a, b = before.state_dict(), after.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(".attn2.add_k_proj." in k for k in again.transformer.state_dict())
    # and the product loads it as the same variant, with the encoder, and generates from an image
    loaded = load_components(tmp_path / "mhla", dtype="float32", device="cpu")
    assert current_variant(loaded.transformer) == "mhla-hybrid" and loaded.image_encoder is not None
    result = generate(loaded, _request(variant="mhla-hybrid"), show_progress=False)
    assert torch.isfinite(result.frames).all() and _linear_layers(loaded.transformer) == [0, 2]


# ---- the command line


def _argv(folder, out, image, *extra):
    argv = ["--prompt", "a fox", "--model", str(folder), "--out", str(out), "--image", str(image)]
    return [*argv, "--frames", "5", "--steps", "1", "--height", "64", "--width", "96", "--no-progress", *extra]


def test_cli_runs_the_hybrid_on_its_layers(folder, tmp_path, monkeypatch, capsys):
    _image(1).save(tmp_path / "first.png")
    components = run_cli(
        monkeypatch, _argv(folder, tmp_path / "fox.mp4", tmp_path / "first.png", "--variant", "mhla-hybrid")
    )
    printed = capsys.readouterr().out
    assert "(WanImageToVideoPipeline, CLIP image encoder)" in printed and "RANDOM" in printed
    assert "64x96, WanImageToVideoPipeline)" in printed
    video = read_video(tmp_path / "fox.mp4")
    assert video.shape == (5, 64, 96, 3)
    assert components.image_encoder is not None and _linear_layers(components.transformer) == [1, 2]


@pytest.mark.slow  # 12 videos through the CLI: ~30-60 s on a shared 2-core CPU
def test_cli_every_variant_follows_the_seed_and_the_image(folder, tmp_path, monkeypatch, capsys):
    for name, seed in (("a", 1), ("b", 2)):
        _image(seed).save(tmp_path / f"{name}.png")
    runs = {
        "first": ("a", "v1"),
        "again": ("a", "v2"),
        "other": ("b", "v3"),
    }
    videos = {}
    for run, (image, out) in runs.items():
        components = run_cli(
            monkeypatch, _argv(folder, tmp_path / out / "fox.mp4", tmp_path / f"{image}.png", "--variant", "all")
        )
        printed = capsys.readouterr().out
        assert printed.count("64x96, WanImageToVideoPipeline)") == len(VARIANTS)
        for variant in VARIANTS:
            videos[run, variant] = read_video(tmp_path / out / f"fox_{variant}.mp4")
            assert videos[run, variant].shape == (5, 64, 96, 3)
        assert _linear_layers(components.transformer) == LINEAR_LAYERS["mhla-hybrid"]  # the last variant run
    for variant in VARIANTS:
        np.testing.assert_array_equal(videos["first", variant], videos["again", variant])
        assert np.abs(videos["first", variant].astype(int) - videos["other", variant]).max() > 0, variant
    assert any(np.abs(videos["first", v].astype(int) - videos["first", "flash"]).max() > 0 for v in VARIANTS[1:])

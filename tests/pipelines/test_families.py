"""Wan2.2 and image-to-video through the product (issue 32): tiny random-weight model folders of each architecture
(``python -m pipelines.tiny``) run through ``load_components``, ``generate()`` and the CLI. The pipeline class comes
from the folder's ``model_index.json``, every variant generates, the hybrid split lands on the intended layers of
each expert, ``--image`` is required by an image-to-video model and refused by a text-to-video one."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

import mhla
from common.video import read_video
from pipelines import cli
from pipelines.attention import LinearSelfAttnProcessor, hybrid_layers
from pipelines.loading import load_components
from pipelines.model import convert_self_attention, current_variant
from pipelines.model_dir import ModelDir, check_model_dir
from pipelines.pipeline import fit_image, generate
from pipelines.request import GenerationRequest, latent_grid
from pipelines.tiny import TINY_ARCHITECTURES, TINY_INFO, save_tiny_model
from pipelines.tiny import main as tiny_main
from tests.pipelines.cli_spy import run_cli

LAYERS = 6  # each expert of the tiny folders
SMALL = dict(height=64, width=96, num_frames=5, num_inference_steps=2)
# what each tiny folder's model_index.json must make of it
EXPECTED = {
    "wan2.1-t2v": dict(pipeline_class="WanPipeline", transformer_2=False, expand_timesteps=False, channels=16),
    "wan2.2-ti2v": dict(pipeline_class="WanPipeline", transformer_2=False, expand_timesteps=True, channels=48),
    "wan2.2-t2v-a14b": dict(pipeline_class="WanPipeline", transformer_2=True, expand_timesteps=False, channels=16),
    "wan2.2-i2v": dict(
        pipeline_class="WanImageToVideoPipeline", transformer_2=False, expand_timesteps=False, channels=16
    ),
    "wan2.1-i2v": dict(
        pipeline_class="WanImageToVideoPipeline",
        transformer_2=False,
        expand_timesteps=False,
        channels=16,
        image_encoder=True,
    ),
}
needs_ftfy = pytest.mark.usefixtures("ftfy")


@pytest.fixture
def ftfy():
    pytest.importorskip("ftfy")  # WanImageToVideoPipeline needs it at call time


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {a: save_tiny_model(a, root / a, seed=0, num_layers=LAYERS) for a in TINY_ARCHITECTURES}


@pytest.fixture(scope="module")
def loaded(folders):
    cache = {}

    def get(architecture):
        if architecture not in cache:
            cache[architecture] = load_components(folders[architecture], dtype="float32", device="cpu")
        for t in _experts(cache[architecture]):
            convert_self_attention(t, "flash")  # conversions add parameters; put each expert back to softmax
        return cache[architecture]

    return get


@pytest.fixture
def picture(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "first.png"
    Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(path)
    return path


def _experts(components):
    return [t for t in (components.transformer, components.transformer_2) if t is not None]


def _linear_layers(transformer):
    return [i for i, b in enumerate(transformer.blocks) if isinstance(b.attn1.processor, LinearSelfAttnProcessor)]


def _image(seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8))


def _request(architecture, **kw):
    image = _image(1) if EXPECTED[architecture]["pipeline_class"] == "WanImageToVideoPipeline" else None
    return GenerationRequest(prompt="a red square moves to the right", image=image, seed=3, **{**SMALL, **kw})


# ---- model directories: the architecture is read from model_index.json, before anything loads


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_folders_name_their_architecture(folders, architecture):
    from diffusers import DiffusionPipeline

    expected = EXPECTED[architecture]
    index = ModelDir(folders[architecture]).index
    assert index.pipeline_class == expected["pipeline_class"]
    assert index.transformer_2 == expected["transformer_2"]
    assert index.expand_timesteps == expected["expand_timesteps"]
    assert (index.boundary_ratio is not None) == expected["transformer_2"]
    assert index.image_encoder == expected.get("image_encoder", False)
    assert json.loads((folders[architecture] / TINY_INFO).read_text())["architecture"] == architecture
    # diffusers' own loader agrees with what the product reads
    pipe = DiffusionPipeline.from_pretrained(folders[architecture])
    assert type(pipe).__name__ == expected["pipeline_class"]
    assert (getattr(pipe, "transformer_2", None) is not None) == expected["transformer_2"]
    assert (getattr(pipe, "image_encoder", None) is not None) == expected.get("image_encoder", False)


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_components_carry_every_part(loaded, architecture):
    c = loaded(architecture)
    expected = EXPECTED[architecture]
    assert c.pipeline_class == expected["pipeline_class"] and c.random_weights and "RANDOM" in c.source
    assert (c.transformer_2 is not None) == expected["transformer_2"]
    assert c.latent_channels == expected["channels"] == c.vae.config.z_dim
    assert (c.image_encoder is not None) == (c.image_processor is not None) == expected.get("image_encoder", False)
    if expected["transformer_2"]:  # two experts with their own weights
        a, b = c.transformer.state_dict(), c.transformer_2.state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in a)
        assert c.index.boundary_ratio == pytest.approx(0.875)


def test_an_unsupported_pipeline_class_is_named_before_loading(folders, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "sd"
    shutil.copytree(folders["wan2.1-t2v"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ValueError, match="'StableDiffusionPipeline'.*supported: WanPipeline, WanImageToVideoPipeline"):
        check_model_dir(folder)

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("pipelines.loading.load_components", no_loading)
    assert cli.main(["--prompt", "x", "--model", str(folder), "--out", str(tmp_path / "x.mp4")]) == 2
    assert "StableDiffusionPipeline" in capsys.readouterr().err


def test_a_missing_second_expert_is_named(folders, tmp_path):
    folder = tmp_path / "a14b"
    shutil.copytree(folders["wan2.2-t2v-a14b"], folder)
    shutil.rmtree(folder / "transformer_2")
    with pytest.raises(FileNotFoundError, match="missing: transformer_2/config.json"):
        check_model_dir(folder)


def test_tiny_command_writes_a_folder_and_refuses_others(tmp_path, capsys):
    out = tmp_path / "ti2v"
    assert tiny_main(["--architecture", "wan2.2-ti2v", "--out", str(out), "--layers", "2"]) == 0
    assert ModelDir(out).index.expand_timesteps and check_model_dir(out) == out
    assert json.loads((out / "transformer" / "config.json").read_text())["num_layers"] == 2
    assert tiny_main(["--architecture", "wan2.2-ti2v", "--out", str(out), "--layers", "3"]) == 0  # replaces its own
    assert json.loads((out / "transformer" / "config.json").read_text())["num_layers"] == 3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert tiny_main(["--architecture", "wan2.2-i2v", "--out", str(tmp_path / "mine")]) == 2
    assert "is not an earlier tiny model" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert tiny_main(["--architecture", "wan3", "--out", str(tmp_path / "x")]) == 2


# ---- the block layout of Wan2.2-TI2V-5B


def test_ti2v_5b_block_layout_the_papers_way(tmp_path):
    # the 5B's VAE config says 16x spatial (diffusers' AutoencoderKLWan of Wan2.2), read without loading
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"scale_factor_spatial": 16, "scale_factor_temporal": 4}))
    stride = ModelDir(tmp_path).vae_stride
    grid = latent_grid(704, 1280, 121, (1, 2, 2), stride)
    assert stride == (4, 16, 16) and grid == (31, 22, 40)  # 31x44x80 latents, patched 1x2x2
    blocks = mhla.resolve_blocks(grid).blocks  # the default rule, aiming at the paper's 3x10x10-token blocks
    n, m = math.prod(grid), math.prod(blocks)
    assert m * m <= n  # the mixing's M^2 d^2 stays below the summaries' N d^2
    shape = [size / b for size, b in zip(grid, blocks, strict=True)]
    assert all(abs(s - t) / t <= 0.15 for s, t in zip(shape, mhla.PAPER_BLOCK_SHAPE, strict=True)), shape
    assert blocks == (10, 2, 4) and m == 80  # what README's issue-32 section states
    # and the request checks the 5B's sizes on that grid (multiples of 16 x 2 = 32)
    request = GenerationRequest(prompt="x", height=704, width=1280, num_frames=121, num_inference_steps=1)
    assert request.with_defaults({"guidance_scale": 5.0}).check((1, 2, 2), stride).grid == grid
    with pytest.raises(ValueError, match="multiple of 32"):
        replace(request, height=720, guidance_scale=5.0).check((1, 2, 2), stride)


# ---- generate(): the right pipeline, both experts, the image


@pytest.mark.slow  # 2-15 s each on a shared 2-core CPU; the CLI test below runs each architecture fast
@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_each_architecture_generates_with_its_pipeline(loaded, architecture):
    if architecture.endswith("-i2v"):
        pytest.importorskip("ftfy")
    c = loaded(architecture)
    calls = [0] * len(_experts(c))
    handles = [
        t.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)) for i, t in enumerate(_experts(c))
    ]
    try:
        result = generate(c, _request(architecture, variant="mhla-hybrid", num_inference_steps=4), show_progress=False)
    finally:
        for h in handles:
            h.remove()
    assert result.pipeline_class == EXPECTED[architecture]["pipeline_class"]
    assert result.frames.shape == (5, 64, 96, 3) and np.isfinite(result.frames).all()
    assert all(calls), calls  # with two experts, each denoises some of the steps
    stride = c.vae.config.scale_factor_spatial
    assert result.initial_noise.shape == (1, c.latent_channels, 2, 64 // stride, 96 // stride)
    for t in _experts(c):
        assert _linear_layers(t) == hybrid_layers(LAYERS) == [1, 2, 4, 5]


def test_each_expert_gets_its_own_hybrid_split_and_keeps_its_parameters(loaded):
    c = loaded("wan2.2-t2v-a14b")
    request = _request("wan2.2-t2v-a14b", variant="mhla-hybrid", layers=[0, 1], layers_2=[3, 4, 5])
    generate(c, request, show_progress=False)
    assert _linear_layers(c.transformer) == [0, 1] and _linear_layers(c.transformer_2) == [3, 4, 5]
    assert c.transformer_2.conversion.to_config()["linear_layers"] == [3, 4, 5]
    # each expert's MHLA parameters are its own: changing one expert's leaves the other's, and a rerun keeps both
    with torch.no_grad():
        for p in c.transformer_2.blocks[3].attn1.mhla.parameters():
            p.mul_(0.5)
    before = [{k: v.clone() for k, v in t.state_dict().items()} for t in _experts(c)]
    generate(c, replace(request, layers=None, layers_2=None), show_progress=False)  # their own splits, kept
    assert _linear_layers(c.transformer) == [0, 1] and _linear_layers(c.transformer_2) == [3, 4, 5]
    for t, saved in zip(_experts(c), before, strict=True):
        assert all(torch.equal(t.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(ValueError, match="layers_2 apply to 'mhla-hybrid' only"):
        generate(c, replace(request, variant="mhla", layers=None), show_progress=False)
    with pytest.raises(ValueError, match="has one transformer"):
        generate(loaded("wan2.2-ti2v"), _request("wan2.2-ti2v", variant="mhla-hybrid", layers_2=[1]))


@needs_ftfy
def test_image_to_video_follows_the_image_and_the_seed(loaded):
    c = loaded("wan2.2-i2v")
    request = _request("wan2.2-i2v", variant="mhla", output_type="latent", num_inference_steps=1)
    first = generate(c, request, show_progress=False)
    again = generate(c, request, show_progress=False)
    other_image = generate(c, replace(request, image=_image(2)), show_progress=False)
    other_seed = generate(c, replace(request, seed=4), show_progress=False)
    assert first.frames.shape[1] == c.latent_channels == 16  # the noise has the VAE's channels, not the 36 in
    torch.testing.assert_close(first.frames, again.frames, rtol=0, atol=0)
    torch.testing.assert_close(first.initial_noise, other_image.initial_noise, rtol=0, atol=0)
    assert (first.frames - other_image.frames).abs().max() > 0
    assert (first.frames - other_seed.frames).abs().max() > 0


@needs_ftfy
def test_ti2v_image_mode_starts_from_the_image(loaded):
    # Wan2.2-TI2V takes an image through WanImageToVideoPipeline(expand_timesteps=True): its first latent frame
    # is the image's own latent, never denoised
    c = loaded("wan2.2-ti2v")
    image = _image(5)
    result = generate(c, replace(_request("wan2.2-ti2v"), image=image, output_type="latent"), show_progress=False)
    assert result.pipeline_class == "WanImageToVideoPipeline"
    from diffusers.video_processor import VideoProcessor

    pixels = VideoProcessor(vae_scale_factor=16).preprocess(fit_image(image, 96, 64), height=64, width=96)
    with torch.no_grad():
        encoded = c.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    mean = torch.tensor(c.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(result.frames[:, :, :1], (encoded - mean) / std, rtol=1e-4, atol=1e-4)
    assert (result.frames[:, :, 1:] - result.initial_noise[:, :, 1:]).abs().max() > 0  # the rest is denoised


def test_image_is_required_or_refused_before_any_model_work(loaded, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("text encoder ran")

    i2v, a14b = loaded("wan2.2-i2v"), loaded("wan2.2-t2v-a14b")
    for c in (i2v, a14b):
        monkeypatch.setattr(c.text_encoder, "forward", boom)
    with pytest.raises(ValueError, match=r"is image-to-video \(WanImageToVideoPipeline\): it needs image"):
        generate(i2v, replace(_request("wan2.2-i2v"), image=None))
    with pytest.raises(ValueError, match="image was given, but model .* is text-to-video"):
        generate(a14b, replace(_request("wan2.2-t2v-a14b"), image=_image(0)))
    with pytest.raises(ValueError, match="image must be a PIL image"):
        generate(i2v, replace(_request("wan2.2-i2v"), image="first.png"))


def test_fit_image_keeps_the_aspect_ratio():
    wide = Image.new("RGB", (200, 50), (255, 0, 0))
    wide.paste((0, 0, 255), (0, 0, 50, 50))  # a blue left quarter: cropped away when fitted to 64x96
    fitted = fit_image(wide.convert("RGBA"), 96, 64)
    assert fitted.size == (96, 64) and fitted.mode == "RGB"
    assert np.asarray(fitted)[..., 2].max() < 50  # centre kept, the sides cropped (no squeezing)


# ---- a converted Wan2.2-A14B folder, saved and loaded by diffusers' own loaders


def test_converted_a14b_folder_reloads_as_its_variant(folders, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline

    from pipelines.model import MHLAWanTransformer3DModel

    pipe = WanPipeline.from_pretrained(folders["wan2.2-t2v-a14b"])
    convert_self_attention(pipe.transformer, "mhla-hybrid", [1, 2, 4])
    convert_self_attention(pipe.transformer_2, "mhla", options=None)
    with torch.no_grad():  # fine-tuned stand-ins: each expert's mixing differs from the locality init
        for t, scale in ((pipe.transformer, 0.9), (pipe.transformer_2, 0.7)):
            for name, p in t.named_parameters():
                if ".mhla." in name:
                    p.mul_(scale)
    pipe.transformer, pipe.transformer_2 = pipe.transformer, pipe.transformer_2  # model_index names the class
    pipe.save_pretrained(tmp_path / "a14b-mhla")
    index = json.loads((tmp_path / "a14b-mhla" / "model_index.json").read_text())
    assert index["transformer"] == index["transformer_2"] == ["pipelines.model", "MHLAWanTransformer3DModel"]
    for loader in (DiffusionPipeline, WanPipeline):
        again = loader.from_pretrained(tmp_path / "a14b-mhla")
        assert isinstance(again.transformer, MHLAWanTransformer3DModel)
        assert isinstance(again.transformer_2, MHLAWanTransformer3DModel)
        assert current_variant(again.transformer) == "mhla-hybrid" and _linear_layers(again.transformer) == [1, 2, 4]
        assert current_variant(again.transformer_2) == "mhla" and _linear_layers(again.transformer_2) == list(range(6))
        for before, after in ((pipe.transformer, again.transformer), (pipe.transformer_2, again.transformer_2)):
            a, b = before.state_dict(), after.state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the product loads it as the same two experts
    c = load_components(tmp_path / "a14b-mhla", dtype="float32", device="cpu")
    assert current_variant(c.transformer) == "mhla-hybrid" and current_variant(c.transformer_2) == "mhla"
    assert _linear_layers(c.transformer) == [1, 2, 4] and c.index.transformer_2


# ---- the command line


def _argv(folder, out, *extra):
    argv = ["--prompt", "a fox", "--model", str(folder), "--out", str(out), "--frames", "5", "--steps", "2"]
    return [*argv, "--height", "64", "--width", "96", "--no-progress", *extra]


def test_cli_refuses_image_for_text_to_video_and_needs_it_for_image_to_video(folders, picture, tmp_path, capsys):
    out = tmp_path / "v.mp4"
    assert cli.main(_argv(folders["wan2.2-t2v-a14b"], out, "--image", str(picture))) == 2
    err = capsys.readouterr().err
    assert "--image was given" in err and "text-to-video (WanPipeline, two experts" in err
    assert cli.main(_argv(folders["wan2.2-i2v"], out)) == 2
    assert "needs --image" in capsys.readouterr().err
    (tmp_path / "broken.png").write_bytes(picture.read_bytes()[:200])
    for bad, message in (
        (tmp_path / "nope.png", "does not exist"),
        (tmp_path / "broken.png", "is not a readable image"),
    ):
        assert cli.main(_argv(folders["wan2.2-i2v"], out, "--image", str(bad))) == 2
        assert f"--image {str(bad)!r} {message}" in capsys.readouterr().err
    assert cli.main(_argv(folders["wan2.2-i2v"], out, "--image", str(picture), "--layers-2", "1")) == 2
    assert "--layers-2 '1': model" in capsys.readouterr().err
    assert cli.main(_argv(folders["wan2.2-t2v-a14b"], out, "--variant", "mhla-hybrid", "--layers-2", "7")) == 2
    assert "--layers-2 '7' (the second expert's)" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_cli_runs_each_architecture(folders, picture, tmp_path, monkeypatch, capsys, architecture):
    expected = EXPECTED[architecture]
    extra = ["--variant", "mhla-hybrid", "--layers", "0,5"]
    if expected["pipeline_class"] == "WanImageToVideoPipeline":
        pytest.importorskip("ftfy")
        extra += ["--image", str(picture)]
    if expected["transformer_2"]:
        extra += ["--layers-2", "2-4"]
    out = tmp_path / "fox.mp4"
    components = run_cli(monkeypatch, _argv(folders[architecture], out, *extra))
    printed = capsys.readouterr().out
    assert f"64x96, {expected['pipeline_class']})" in printed and "RANDOM" in printed
    assert read_video(out).shape == (5, 64, 96, 3)
    assert _linear_layers(components.transformer) == [0, 5]
    if expected["transformer_2"]:
        assert _linear_layers(components.transformer_2) == [2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_cli_every_variant_in_each_architecture(folders, picture, tmp_path, monkeypatch, capsys, architecture):
    expected = EXPECTED[architecture]
    extra = ["--variant", "all"]
    if expected["pipeline_class"] == "WanImageToVideoPipeline":
        pytest.importorskip("ftfy")
        extra += ["--image", str(picture)]
    components = run_cli(monkeypatch, _argv(folders[architecture], tmp_path / "fox.mp4", *extra))
    printed = capsys.readouterr().out
    videos = {}
    for variant in ("flash", "linear", "mhla", "mhla-hybrid"):
        videos[variant] = read_video(tmp_path / f"fox_{variant}.mp4")
        assert videos[variant].shape == (5, 64, 96, 3)
    assert printed.count(f"64x96, {expected['pipeline_class']})") == 4
    assert any(np.abs(videos[v].astype(int) - videos["flash"]).max() > 0 for v in ("linear", "mhla", "mhla-hybrid"))
    for t in _experts(components):  # the last variant, the hybrid, on the default split in every expert
        assert _linear_layers(t) == [1, 2, 4, 5]

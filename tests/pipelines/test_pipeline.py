"""End to end on the tiny random-weight model: generation, videos, save/load, local directories, bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from common.video import read_video, write_frame_grid, write_gif, write_mp4
from pipelines.attention import AttentionOptions
from pipelines.cli import main, validate_request
from pipelines.loading import load_components, load_transformer, save_transformer
from pipelines.model import convert_self_attention, current_variant, set_variant
from pipelines.model_dir import check_model_dir
from pipelines.pipeline import generate
from pipelines.request import GenerationRequest
from pipelines.tiny import build_tiny_components, build_tiny_transformer

SMALL = dict(height=64, width=96, num_frames=9, num_inference_steps=2, guidance_scale=4.0)


@pytest.fixture
def components(tiny_components):
    """The session's tiny model (tests/conftest.py), back to softmax attention; conversions made by earlier
    tests stay in it as parameters, as in one app session."""
    set_variant(tiny_components.transformer, "flash")
    return tiny_components


@pytest.mark.slow  # generates videos with the tiny model
def test_tiny_model_is_deterministic():
    a, b = build_tiny_components(seed=1), build_tiny_components(seed=1)
    for part in ("transformer", "vae", "text_encoder"):
        sa, sb = a[part].state_dict(), b[part].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), part
    c = build_tiny_components(seed=2)["transformer"].state_dict()
    assert not torch.equal(c["proj_out.weight"], a["transformer"].state_dict()["proj_out.weight"])


@pytest.mark.slow  # generates videos with the tiny model
def test_all_variants_generate_playable_mp4(components, tmp_path):
    first_inputs = {}

    def record(module, args, kwargs):
        first_inputs.setdefault(current_variant(module), kwargs["hidden_states"].clone())

    hook = components.transformer.register_forward_pre_hook(record, with_kwargs=True)
    results = {}
    try:
        for variant in ("flash", "linear", "mhla", "mhla-hybrid"):
            request = GenerationRequest(prompt="a red fox in snow", seed=11, variant=variant, **SMALL)
            results[variant] = generate(components, request, show_progress=False)
    finally:
        hook.remove()

    noise = results["flash"].initial_noise
    for variant, result in results.items():
        # same seed -> the very same starting latents reach the transformer for every variant
        assert torch.equal(result.initial_noise, noise)
        assert torch.equal(first_inputs[variant], noise)
        frames = result.frames
        assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.float32
        assert np.isfinite(frames).all() and 0.0 <= frames.min() and frames.max() <= 1.0

        t = result.timing
        assert t.variant == variant and t.random_weights
        assert len(t.steps) == 2 and all(s > 0 for s in t.steps)
        assert t.total >= t.text_encoding + t.denoising + t.vae_decode - 1e-6
        assert 0 < t.self_attention < t.denoising
        assert t.self_attention_calls == 2 * 2 * 30  # steps x (cond, uncond) x layers
        assert t.grid == (3, 4, 6) and t.num_tokens == 72
        assert t.peak_memory_bytes is None  # CPU

        out = write_mp4(tmp_path / f"{variant}.mp4", frames, fps=8)
        video = read_video(out)
        assert video.shape == (9, 64, 96, 3)
        # lossy codec, but the decoded video is still this video
        assert np.abs(video.astype(np.float32) / 255 - frames).mean() < 0.1

    assert results["flash"].timing.softmax_backend is not None and results["flash"].timing.num_blocks is None
    assert results["mhla-hybrid"].timing.softmax_backend is not None
    assert results["mhla"].timing.softmax_backend is None and results["linear"].timing.softmax_backend is None
    assert results["mhla"].timing.num_blocks == 6 and "M=6" in results["mhla"].timing.layout
    assert results["linear"].timing.num_blocks == 1
    # the variants really compute differently
    assert not np.allclose(results["flash"].frames, results["mhla"].frames)
    assert not np.allclose(results["mhla"].frames, results["linear"].frames)


@pytest.mark.slow  # generates videos with the tiny model
def test_same_seed_same_video_and_other_seed_differs(components):
    kw = dict(prompt="waves", variant="mhla", output_type="latent", **SMALL)
    a = generate(components, GenerationRequest(seed=3, **kw), show_progress=False)
    b = generate(components, GenerationRequest(seed=3, **kw), show_progress=False)
    c = generate(components, GenerationRequest(seed=4, **kw), show_progress=False)
    assert torch.equal(a.frames, b.frames)
    assert not torch.equal(a.initial_noise, c.initial_noise)


@pytest.mark.slow  # generates a video with the tiny model
def test_uneven_grid_runs(components):
    # tiny analogue of 480x832 (21x30x52 tokens): 3x5x13 tokens, blocks that split 5 and 13 unevenly
    small = {**SMALL, "height": 80, "width": 208}
    model = build_tiny_transformer(seed=2)
    request = GenerationRequest(prompt="a city", variant="mhla", blocks="2x2x5", **small)
    result = generate(components, request, transformer=model, show_progress=False)
    assert result.frames.shape == (9, 80, 208, 3)
    assert result.timing.grid == (3, 5, 13)
    assert "2x2x5 blocks (M=20) over a 3x5x13 grid" in result.timing.layout


@pytest.mark.slow  # generates a video with the tiny model
def test_few_frames_shrink_the_layout(components):
    model = build_tiny_transformer(seed=2)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(3, 2, 2)))
    request = GenerationRequest(prompt="a bird", variant="mhla", **{**SMALL, "num_frames": 1})
    result = generate(components, request, transformer=model, show_progress=False)
    assert result.frames.shape == (1, 64, 96, 3)
    assert result.timing.num_blocks == 4
    assert "1x2x2 blocks (M=4)" in result.timing.layout and "shrunk from 3x2x2" in result.timing.layout


@pytest.mark.parametrize("variant", ["flash", "linear", "mhla", "mhla-hybrid"])
def test_save_load_round_trip(variant, tmp_path):
    model = build_tiny_transformer(seed=9, num_layers=6)
    layers = [0, 4] if variant == "mhla-hybrid" else None
    convert_self_attention(model, variant, layers, AttentionOptions(blocks=(3, 2, 3), output_gate=True))
    with torch.no_grad():  # make the new parameters differ from their init, so loading has to restore them
        for name, p in model.named_parameters():
            if ".attn1.mhla." in name or ".attn1.linear_attn." in name:
                p.add_(0.1 * torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))))
    inputs = dict(
        hidden_states=torch.randn(1, 16, 3, 8, 12, generator=torch.Generator().manual_seed(0)),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1)),
        return_dict=False,
    )
    with torch.no_grad():
        before = model(**inputs)[0]
    save_transformer(model, tmp_path / "t")
    saved = json.loads((tmp_path / "t" / "config.json").read_text())["self_attention"]
    assert saved["variant"] == variant
    assert list((tmp_path / "t").glob("*.safetensors"))

    loaded = load_transformer(tmp_path / "t")
    assert current_variant(loaded) == variant
    assert loaded.conversion.to_config() == model.conversion.to_config()
    sa, sb = model.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():
        after = loaded(**inputs)[0]
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_load_rejects_checkpoint_missing_parameters(tmp_path):
    model = convert_self_attention(
        build_tiny_transformer(seed=9, num_layers=3), "mhla", options=AttentionOptions(blocks=(1, 2, 2))
    )
    save_transformer(model, tmp_path / "t")
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    config["self_attention"]["parameters"]["linear"] = [0]  # promises parameters the weights do not have
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks 1 attention parameters"):
        load_transformer(tmp_path / "t")


@pytest.mark.slow  # writes and reads back a whole model directory
def test_local_model_dir_round_trip(components, tmp_path):
    from diffusers import WanPipeline

    parts = build_tiny_components(seed=0)
    layers = [2, 5, 7, 29]
    convert_self_attention(parts["transformer"], "mhla-hybrid", layers, AttentionOptions(blocks=(2, 1, 3)))
    WanPipeline(**parts).save_pretrained(tmp_path / "wan")
    assert check_model_dir(tmp_path / "wan")
    local = load_components(tmp_path / "wan", dtype="float32", device="cpu")
    assert not local.random_weights and local.source == str(tmp_path / "wan")
    assert current_variant(local.transformer) == "mhla-hybrid"
    hybrid = GenerationRequest(prompt="a boat", variant="mhla-hybrid", seed=5, output_type="latent", **SMALL)
    from_dir = generate(local, hybrid, show_progress=False).frames  # keeps the checkpoint's own hybrid layers
    assert local.transformer.conversion.to_config()["linear_layers"] == layers
    generate(local, replace(hybrid, variant="flash"), show_progress=False)
    generate(local, hybrid, show_progress=False)  # back to hybrid: still the checkpoint's split, not the default one
    assert local.transformer.conversion.to_config()["linear_layers"] == layers
    # same tiny weights, converted the same way
    built = generate(components, replace(hybrid, layers=layers), show_progress=False).frames
    # identical weights; outputs agree to float32 noise (tensors loaded from safetensors can take other CPU kernels)
    sa, sb = local.transformer.state_dict(), components.transformer.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.testing.assert_close(from_dir, built, rtol=1e-4, atol=1e-4)
    # a real (non-random) model asked for layers it has no MHLA parameters for says they are untrained
    with pytest.warns(UserWarning, match=r"untrained.*\[0, 1, 3"):
        generate(local, replace(hybrid, variant="mhla"), show_progress=False)


def test_incomplete_model_dir_names_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    (tmp_path / "wan" / "transformer").mkdir(parents=True)
    (tmp_path / "wan" / "model_index.json").write_text("{}")
    (tmp_path / "wan" / "transformer" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as err:
        check_model_dir(tmp_path / "wan")
    msg = str(err.value)
    assert "incomplete" in msg and "transformer/config.json + diffusion_pytorch_model.safetensors" in msg
    assert "vae/config.json" in msg and "tokenizer/tokenizer_config.json" in msg
    assert "model_index.json;" not in msg  # present, so not listed


GOOD = dict(
    prompt="a cat", height=64, width=96, num_frames=9, num_inference_steps=2, guidance_scale=5.0, variant="mhla"
)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(height=100), "height must be a positive multiple of 16 .* got 100"),
        (dict(width=90), "width must be a positive multiple of 16 .* got 90"),
        (dict(num_frames=8), r"num_frames must be of the form 4k\+1 .* got 8"),
        (dict(variant="flashy"), "unknown variant 'flashy'; expected one of flash, linear, mhla, mhla-hybrid"),
        (dict(prompt="   "), "prompt must be a non-empty string"),
        (dict(prompt=""), "prompt must be a non-empty string"),
        (dict(num_inference_steps=0), "num_inference_steps must be an integer >= 1, got 0"),
        (dict(guidance_scale=-1.0), "guidance_scale must be a finite number >= 0, got -1.0"),
        (dict(blocks="7x3x5"), "blocks '7x3x5' do not fit 9 frames at 64x96: .* 7 blocks along frames"),
        (dict(blocks="7x3"), "blocks must look like '7x3x5'"),
        (dict(blocks="1x1x1", variant="flash"), "blocks apply to the 'mhla' and 'mhla-hybrid' variants only"),
    ],
)
def test_bad_requests_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        validate_request(**{**GOOD, **change})


def test_requests_are_checked_on_the_models_own_patch_grid():
    # patch 1x1x1 (the built-in model): 64x96 at 9 frames is a 3x8x12 token grid, twice Wan's 3x4x6 per axis
    fine = dict(GOOD, blocks="1x8x12")
    assert validate_request(**fine, patch_size=(1, 1, 1)) == (3, 8, 12)
    with pytest.raises(ValueError, match="blocks '1x8x12' do not fit"):
        validate_request(**fine)  # Wan's 1x2x2 patch: a 3x4x6 grid
    with pytest.raises(ValueError, match=r"height must be a positive multiple of 8 \(VAE stride 8 x patch 1\), got 60"):
        validate_request(**dict(GOOD, height=60), patch_size=(1, 1, 1))


def test_generate_rejects_before_heavy_work(components, monkeypatch):
    # validation must run before the text encoder is touched
    def boom(*a, **k):
        raise AssertionError("text encoder ran")

    monkeypatch.setattr(components.text_encoder, "forward", boom)
    with pytest.raises(ValueError, match="num_frames must be of the form"):
        generate(components, GenerationRequest(prompt="a cat", num_frames=10))
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        generate(components, GenerationRequest(prompt="", variant="mhla"))
    with pytest.raises(TypeError, match="generate\\(\\) takes a GenerationRequest"):
        generate(components, "a cat")  # one calling convention: a prompt alone is not a request


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prompt", "x", "--height", "65", "--model", "tiny-random"], "height must be a positive multiple of 16"),
        (["--prompt", "x", "--height", "65"], "height must be a positive multiple of 8 (VAE stride 4 x patch 2)"),
        (["--prompt", "x", "--frames", "10"], "num_frames must be of the form 2k+1 (1, 3, 5, ..."),
        (
            ["--prompt", "x", "--frames", "10", "--model", "tiny-random"],
            "num_frames must be of the form 4k+1 (1, 5, 9,",
        ),
        (["--prompt", "x", "--variant", "sparse"], "unknown variant 'sparse'"),
        (["--prompt", ""], "prompt must be a non-empty string"),
        (["--prompt", "x", "--blocks", "9x1x1"], "blocks '9x1x1' do not fit"),
        (["--prompt", "x", "--model", "/no/such/dir"], "model directory '/no/such/dir' does not exist"),
        (["--prompt", "x", "--layers", "1,2", "--variant", "mhla"], "--layers applies to --variant mhla-hybrid only"),
        (["--prompt", "x", "--out", "x.avi"], "--out must end in .mp4"),
        (["--prompt", "x", "--variant", "flash", "--blocks", "1x2x2"], "--blocks applies to the mhla"),
        (["--prompt", "x", "--dtype", "float8"], "dtype must be one of"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # starts the CLI
def test_cli_writes_video_and_prints_timing(tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    argv = [
        "--prompt",
        "a fox",
        "--model",
        "tiny-random",
        "--variant",
        "mhla-hybrid",
        "--out",
        str(out),
        "--steps",
        "2",
    ]
    argv += ["--no-progress"]
    argv += ["--gif", str(tmp_path / "fox.gif"), "--grid-png", str(tmp_path / "fox.png"), "--blocks", "3x2x2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "RANDOM weights" in printed and "RANDOM WEIGHTS" in printed
    for row in ("total", "text encoding", "denoising", "per step", "inside self-attention", "VAE decode"):
        assert row in printed
    assert "3x2x2 blocks (M=12) over a 3x4x6 grid" in printed
    assert read_video(out).shape == (9, 64, 96, 3)
    from PIL import Image

    with Image.open(tmp_path / "fox.gif") as gif:
        assert gif.n_frames == 9 and b"RANDOM weights" in gif.info["comment"]
    with Image.open(tmp_path / "fox.png") as png:
        assert "RANDOM weights" in png.text["Comment"] and png.size == (3 * 96, 3 * 64)


def test_gif_and_frame_grid(tmp_path):
    frames = np.random.default_rng(0).random((5, 32, 48, 3), dtype=np.float32)
    import imageio.v2 as imageio

    grid = imageio.imread(write_frame_grid(tmp_path / "g.png", frames))
    assert grid.shape == (2 * 32, 3 * 48, 3)
    assert np.array_equal(grid[:32, :48], (frames[0] * 255 + 0.5).astype(np.uint8))
    gif = imageio.mimread(write_gif(tmp_path / "a.gif", frames))
    assert len(gif) == 5
    with pytest.raises(ValueError, match=r"frames must be \(num_frames, height, width, 3\)"):
        write_mp4(tmp_path / "x.mp4", frames[..., 0])

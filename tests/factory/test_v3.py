"""The built-in model's third design (issue 37): its world, its context-free text encoder, the VAE's latent noise,
the gate's latent geometry and the working model directory."""

import json

import numpy as np
import pytest
import torch

from factory import v3
from world.synthetic import caption_for, render_video, sample_attributes, world_named


def test_third_world_draws_one_large_object_at_64x80():
    world = world_named("v3")
    for i in range(20):
        a = sample_attributes(0, i, "train", world, aspect=80 / 64)
        assert a["num_objects"] == 1 and a["objects"][0]["size"] == "huge"
        frames = render_video(a, 9, 64, 80)
        # the object: saturated pixels (backgrounds are grey-toned); a square of radius 16 px covers 32x32 = 1024,
        # a triangle (circumradius 1.25 x 16 px) about 0.41 * 40^2 = 660: well above the second world's 14 px
        saturated = (frames.max(-1).astype(int) - frames.min(-1).astype(int)) > 60
        assert saturated.shape == (9, 64, 80)
        assert 400 < saturated[0].sum() < 1400, (a["objects"][0], saturated[0].sum())
    captions = [
        caption_for(sample_attributes(0, i, "train", world, 80 / 64), sizes=world.size_words) for i in range(20)
    ]
    assert not any(size in c.split() for c in captions for size in ("huge", "big"))  # one size: never named


def test_context_free_text_encoder_keeps_each_word_to_its_row():
    """Each output row is the token's own embedding, RMS-normalised (the reference here is that formula, written
    from the embedding table alone); swapping one word changes one row; the rows are orthonormal."""
    vocab = 40
    te = v3.context_free_text_encoder(vocab, seed=0)
    ids = torch.tensor([[3, 17, 25, 8, 1, 0, 0]])
    with torch.no_grad():
        out = te(input_ids=ids, attention_mask=(ids > 0).long() | (ids == 0).long()).last_hidden_state[0]
        emb = te.shared.weight[ids[0]]
    rms = emb.square().mean(-1, keepdim=True).add(te.config.layer_norm_epsilon).rsqrt()
    expected = emb * rms * te.encoder.final_layer_norm.weight
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    gram = te.shared.weight @ te.shared.weight.T
    torch.testing.assert_close(gram, torch.eye(vocab), rtol=0, atol=1e-5)
    swapped = ids.clone()
    swapped[0, 2] = 30
    with torch.no_grad():
        out2 = te(input_ids=swapped).last_hidden_state[0]
    changed = (out2 - out).norm(dim=-1) > 1e-4
    assert changed.tolist() == [False, False, True, False, False, False, False]


def _tiny_vae():
    from diffusers import AutoencoderKLWan

    from factory.build import vae_settings

    torch.manual_seed(0)
    return AutoencoderKLWan(**vae_settings(base_dim=4, dim_mult=[1, 2, 4], temperal_downsample=[True, True])).eval()


def test_vae_loss_latent_noise_changes_the_decoded_latent_reproducibly():
    from training.vae import vae_loss

    vae = _tiny_vae()
    video = torch.rand(2, 3, 5, 16, 16) * 2 - 1
    with torch.no_grad():
        clean, _ = vae_loss(vae, video, 1e-6, 2.0)
        again, _ = vae_loss(vae, video, 1e-6, 2.0, latent_noise=0.0, generator=torch.Generator().manual_seed(1))
        noisy1, _ = vae_loss(vae, video, 1e-6, 2.0, latent_noise=0.5, generator=torch.Generator().manual_seed(1))
        noisy2, _ = vae_loss(vae, video, 1e-6, 2.0, latent_noise=0.5, generator=torch.Generator().manual_seed(1))
    assert float(clean) == float(again)
    assert float(noisy1) == float(noisy2)
    assert float(noisy1) != float(clean)


def test_vae_loss_edge_term_is_the_weighted_l1_of_neighbour_differences():
    """Written apart from training.vae: finite differences of the reconstruction and of the video along width
    and height, weighted by the larger object weight of the two pixels, averaged, summed, times edge_weight."""
    from training.vae import decode_unclamped, vae_loss

    vae = _tiny_vae()
    video = torch.rand(2, 3, 5, 16, 16) * 2 - 1
    video[:, 0, :, 4:9, 4:9] = 1.0  # a saturated square: object pixels weigh 1 + 2
    video[:, 1:, :, 4:9, 4:9] = -1.0
    with torch.no_grad():
        base, _ = vae_loss(vae, video, 1e-6, 2.0)
        with_edges, _ = vae_loss(vae, video, 1e-6, 2.0, edge_weight=0.7)
        recon = decode_unclamped(vae, vae.encode(video).latent_dist.mean)
    w = 1.0 + 2.0 * ((video.max(1, keepdim=True).values - video.min(1, keepdim=True).values) > 0.5).float()
    term = 0.0
    for axis in (-1, -2):
        n = video.shape[axis]
        a, b = (t.narrow(axis, 1, n - 1) for t in (recon, video))
        c, d = (t.narrow(axis, 0, n - 1) for t in (recon, video))
        pair = torch.max(w.narrow(axis, 1, n - 1), w.narrow(axis, 0, n - 1))
        term += float((((a - c) - (b - d)).abs() * pair).mean())
    assert float(with_edges) == pytest.approx(float(base) + 0.7 * term, rel=1e-5)
    assert term > 0


def test_vae_latent_noise_is_a_checked_config_key():
    from training.config import load_config

    with pytest.raises(ValueError, match="vae.latent_noise"):
        load_config(None, ["task=vae", "model.path=.", "vae.latent_noise=-0.1"])


def test_latent_geometry_measures_every_attribute():
    vae = _tiny_vae()
    geometry = v3.latent_geometry(vae, num_clips=3)
    assert set(geometry["latent_mse"]) == set(v3.GEOMETRY_ATTRIBUTES)
    # every swap changes the pixels (motion: the reversed path, where the clip moves at all)
    assert all(v > 0 for k, v in geometry["pixel_mse"].items() if k != "motion")
    ratio = geometry["latent_mse"]["colour"] / geometry["latent_mse"]["shape"]
    assert geometry["colour_shape_ratio_latent"] == pytest.approx(ratio, rel=1e-2, abs=1e-3)


def test_init_writes_a_model_directory_of_this_design(tmp_path):
    model = v3.init(tmp_path / "model", next_dir=tmp_path / "next")
    info = json.loads((model / "builtin.json").read_text())
    assert info["defaults"] == v3.DEFAULTS and info["block_shape"] == list(v3.BLOCK_SHAPE)
    assert json.loads((model / "transformer" / "config.json").read_text())["patch_size"] == [1, 2, 2]
    vae = json.loads((model / "vae" / "config.json").read_text())
    assert vae["dim_mult"] == [1, 2, 4] and vae["scale_factor_spatial"] == 4
    # the text encoder is kept in next_dir (the transformer is trained against it) and reused by a second init
    first = (tmp_path / "next" / "text_encoder" / "model.safetensors").read_bytes()
    v3.init(tmp_path / "model", next_dir=tmp_path / "next")
    assert (tmp_path / "next" / "text_encoder" / "model.safetensors").read_bytes() == first
    assert np.array_equal(
        np.frombuffer((model / "text_encoder" / "model.safetensors").read_bytes(), np.uint8),
        np.frombuffer(first, np.uint8),
    )


def test_init_lays_a_committed_conversion_as_the_models_variant(tmp_path):
    """A conversion saved with ``factory.next save-variant --into`` the design's folder becomes the working
    model's ``variants/VARIANT`` (what the evaluation and the app read)."""
    from safetensors.torch import save_file

    nxt = tmp_path / "next"
    v3.init(tmp_path / "model", next_dir=nxt)
    conv = tmp_path / "conv"
    conv.mkdir()
    config = json.loads((tmp_path / "model" / "transformer" / "config.json").read_text())
    (conv / "config.json").write_text(json.dumps({**config, "self_attention": {"variant": "mhla"}}))
    save_file({"w": torch.randn(8)}, str(conv / "diffusion_pytorch_model.safetensors"))
    from factory import next as factory_next

    factory_next.save_variant("mhla", conv, next_dir=nxt)
    model = v3.init(tmp_path / "model", next_dir=nxt)
    assert sorted(p.name for p in (model / "variants").iterdir()) == ["mhla"]
    got = json.loads((model / "variants" / "mhla" / "config.json").read_text())
    assert got["self_attention"]["variant"] == "mhla" and got["patch_size"] == [1, 2, 2]


def test_ship_makes_the_design_the_builtin_model_with_its_ema_and_conversions(tmp_path):
    """``factory.v3 ship`` lays the committed parts as a complete model folder: the base's EMA as the softmax
    transformer, the conversions moved into variants/ (one copy in the tree), files readable by everyone; a missing
    part is refused and the shipped folder stays as it was."""
    import shutil

    from factory import next as factory_next
    from pipelines import load_components

    nxt, out = tmp_path / "next", tmp_path / "builtin"
    model = v3.init(tmp_path / "model", next_dir=nxt)
    shutil.copytree(model / "transformer", nxt / "transformer-ema")
    shutil.copytree(model / "vae", nxt / "vae")  # a fresh VAE: init keeps it in the model folder only
    out.mkdir()
    (out / "old.txt").write_text("the shipped model before")
    with pytest.raises(FileNotFoundError, match="variants/linear"):
        v3.ship(nxt, out)
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    for variant in ("linear", "mhla", "mhla-hybrid"):
        conv = tmp_path / f"conv-{variant}"
        shutil.copytree(model / "transformer", conv)
        config = json.loads((conv / "config.json").read_text())
        (conv / "config.json").write_text(json.dumps({**config, "self_attention": {"variant": variant}}))
        factory_next.save_variant(variant, conv, next_dir=nxt)
    v3.ship(nxt, out, evaluation=tmp_path / "eval.json")
    info = json.loads((out / "builtin.json").read_text())
    assert info["world"] == "v3" and info["evaluation"].endswith("eval.json") and info["defaults"] == v3.DEFAULTS
    ema = (nxt / "transformer-ema" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == ema
    assert sorted(p.name for p in (out / "variants").iterdir()) == ["linear", "mhla", "mhla-hybrid"]
    assert not (nxt / "variants").exists() and not (out / "old.txt").exists()
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.rglob("*") if p.is_file())
    components = load_components(str(out), dtype="float32", device="cpu")
    assert sorted(components.variant_dirs) == ["linear", "mhla", "mhla-hybrid"]
    assert components.defaults["num_frames"] == 9 and components.block_shape == v3.BLOCK_SHAPE


def test_an_init_that_fails_leaves_the_model_folder_as_it_was(tmp_path, monkeypatch):
    model = v3.init(tmp_path / "model", next_dir=tmp_path / "next")
    before = {p.relative_to(model): p.read_bytes() for p in model.rglob("*") if p.is_file()}

    def half_written(tmp, *args):
        (tmp / "builtin.json").write_text("{")  # a part written, then the failure
        raise RuntimeError("stopped half-way")

    monkeypatch.setattr(v3, "_lay_out", half_written)
    with pytest.raises(RuntimeError, match="half-way"):
        v3.init(model, next_dir=tmp_path / "next")
    after = {p.relative_to(model): p.read_bytes() for p in model.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "next"]  # no temporary folder left


def test_word_attention_splits_every_layers_weights_over_the_caption_roles(tmp_path):
    model = v3.init(tmp_path / "model", next_dir=tmp_path / "next")
    result = v3.word_attention(model, num_clips=2)
    assert len(result["by_layer"]) == v3.TRANSFORMER_V3["num_layers"]
    for layer in result["by_layer"]:
        assert sum(layer.values()) == pytest.approx(1.0, abs=1e-3)  # a softmax over the 16 positions
    per = result["words_per_caption"]
    assert sum(per.values()) == result["max_sequence_length"] == 16
    assert per["shape"] == per["colour"] == per["end"] == 1.0 and per["padding"] > 0
    assert result["mean"]["padding"] > 0.01

    # a model that masks its caption's padding gives it no weight, as its cross-attention does
    from pipelines import load_transformer

    masked = load_transformer(model / "transformer", dtype=torch.float32, device="cpu").set_text_padding_mask(True)
    masked.save_pretrained(tmp_path / "masked")
    result = v3.word_attention(model, tmp_path / "masked", num_clips=2)
    for layer in result["by_layer"]:
        assert layer["padding"] == 0.0 and sum(layer.values()) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
def test_save_vae_keeps_float16_weights_measured_statistics_and_its_step(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    vae = _tiny_vae()
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000300"
    vae.save_pretrained(str(ckpt / "vae"))
    monkeypatch.setattr(v3, "WORK", tmp_path / "work")
    monkeypatch.setattr(v3, "NEXT_DIR", tmp_path / "next")
    dst = v3.save_vae(ckpt, next_dir=tmp_path / "next" / "v3")
    weights = load_file(str(dst / "diffusion_pytorch_model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float16}
    config = json.loads((dst / "config.json").read_text())
    assert config["latents_mean"] != list(vae.config.latents_mean)  # measured on this design's clips
    assert json.loads((dst / "trained.json").read_text())["steps"] == 300
    assert not (tmp_path / "work" / ".vae-save").exists()


def test_retime_vae_keeps_every_weight_but_the_dropped_time_convolutions(tmp_path):
    from diffusers import AutoencoderKLWan

    model = tmp_path / "model"
    model.mkdir()
    (model / "builtin.json").write_text(json.dumps({"vae": {"temperal_downsample": [True, True]}}))
    (model / "tokenizer").mkdir()
    (model / "tokenizer" / "vocab.txt").write_text("red\n")
    old = _tiny_vae()
    old.save_pretrained(str(model / "vae"))
    dropped = v3.retime_vae(model / "vae", [False, True], tmp_path / "out", model=model)
    assert dropped and all("time_conv" in k for k in dropped)
    new = AutoencoderKLWan.from_pretrained(str(tmp_path / "out" / "vae")).eval()
    assert new.config.temperal_downsample == [False, True] and new.config.scale_factor_temporal == 2
    old_sd, new_sd = old.state_dict(), new.state_dict()
    assert set(old_sd) - set(new_sd) == set(dropped)
    assert all(torch.equal(new_sd[k], old_sd[k]) for k in new_sd)
    with torch.no_grad():
        z = new.encode(torch.rand(1, 3, 9, 16, 16) * 2 - 1).latent_dist.mean
        assert z.shape[2] == 5 and new.decode(z).sample.shape[2] == 9  # 1 + 8/2 latent frames, 9 decoded
    info = json.loads((tmp_path / "out" / "builtin.json").read_text())
    assert info["vae"]["temperal_downsample"] == [False, True]
    assert (tmp_path / "out" / "tokenizer" / "vocab.txt").read_text() == "red\n"
    with pytest.raises(ValueError, match="only be taken away"):  # a stride added has no trained weights
        v3.retime_vae(tmp_path / "out" / "vae", [True, True], tmp_path / "again", model=model)
    with pytest.raises(ValueError, match="one flag each"):
        v3.retime_vae(model / "vae", [True], tmp_path / "again", model=model)
    assert not (tmp_path / "again").exists()


def test_failure_sheet_draws_each_misread_clip_and_its_masks(tmp_path):
    from PIL import Image

    _tiny_vae().save_pretrained(str(tmp_path / "vae"))  # random weights: every reconstruction is misread
    rows = v3.failure_sheet(tmp_path / "vae", tmp_path / "sheet.png", num_clips=3, rows=2)
    assert [r["clip"] for r in rows] == [0, 1] and all(r["missed"] for r in rows)
    assert all(0.3 < r["fill_real"] <= 1.0 for r in rows)  # the real clip's mask is one shape
    d = v3.DEFAULTS
    assert Image.open(tmp_path / "sheet.png").size == (4 * d["width"] * 3, 2 * d["height"] * 3)

"""The built-in model: how it is built (tokenizer, model directory, VAE training task) and what ships.

The shipped model (``assets/builtin``) is loaded offline by default, runs each variant from its own
fine-tuned transformer, and makes the video its prompt asks for (checked by the analyser).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines import BUILTIN_DIR, load_components
from pipelines.model_dir import builtin_available
from world.analyse import analyse

pytestmark = pytest.mark.slow  # loads the built-in model

needs_builtin = pytest.mark.skipif(
    not builtin_available(), reason="assets/builtin is missing (python -m factory build)"
)


def test_tokenizer_reads_world_words_and_marks_unknown_ones():
    from factory.build import build_tokenizer, world_vocabulary

    tok = build_tokenizer()
    ids = tok("A red Square moves to the right").input_ids
    assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
    assert tok.convert_ids_to_tokens(ids[:3]) == ["a", "red", "square"]
    assert tok("a red fox").input_ids[2] == tok.unk_token_id
    padded = tok("a red square", padding="max_length", max_length=8).input_ids
    assert padded[4:] == [tok.pad_token_id] * 4 and tok.pad_token_id == 0
    assert {"diagonally", "checkered", "bounces", "grows"} <= set(world_vocabulary())


@pytest.fixture(scope="module")
def fresh_model_dir(tmp_path_factory):
    from factory.build import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("builtin") / "model", seed=3)


def test_init_writes_a_loadable_model_dir(fresh_model_dir):
    c = load_components(fresh_model_dir, dtype="float32", device="cpu")
    assert tuple(c.transformer.config.patch_size) == (1, 1, 1)
    assert c.vae.config.z_dim == 16 and not c.random_weights


def test_vae_task_trains_installs_with_statistics_and_resumes(fresh_model_dir, tmp_path):
    from training.finetune import main

    run = tmp_path / "vae"
    export = tmp_path / "installed_vae"
    args = [
        "--config",
        "factory/configs/vae.yaml",
        f"run_dir={run}",
        f"model.path={fresh_model_dir}",
        f"vae.export={export}",
        "data.num_samples=4",
        "data.height=32",
        "data.width=48",
        "train.batch_size=1",
        "vae.crop=32",
        "vae.stats_samples=2",
        "checkpoint.every=2",
        "train.warmup_steps=1",
    ]
    assert main([*args, "train.steps=2"]) == 0
    before = json.loads((export / "config.json").read_text())
    assert len(before["latents_mean"]) == 16 and all(s > 0 for s in before["latents_std"])
    assert before["latents_std"] != json.loads((fresh_model_dir / "vae" / "config.json").read_text())["latents_std"]
    assert json.loads((export / "trained.json").read_text())["steps"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    # continues from the step-2 checkpoint, now under bf16 autocast (master weights stay float32)
    assert main([*args, "train.steps=3", "resume=latest", "train.precision=bf16"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the run lists what it wrote: overwrite=true replaces those and keeps a file of one's own
    listed = set(json.loads((run / "run_files.json").read_text())["written"])
    assert {"config.yaml", "metrics.jsonl", "final/vae"} <= listed and any(n.startswith("checkpoints/") for n in listed)
    (run / "notes.txt").write_text("mine")
    assert main([*args, "train.steps=1", "resume=null", "overwrite=true"]) == 0
    assert (run / "notes.txt").read_text() == "mine"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


def test_vae_decoder_task_keeps_the_encoder_and_latent_statistics(fresh_model_dir, tmp_path):
    """``vae.trainable=decoder``: the latents a transformer was trained on stay bit for bit; the decoder learns."""
    from safetensors.torch import load_file

    from training.finetune import main
    from training.vae import vae_runs

    model = tmp_path / "model"
    (model / "vae").mkdir(parents=True)
    for f in ("config.json", "diffusion_pytorch_model.safetensors"):
        (model / "vae" / f).write_bytes((fresh_model_dir / "vae" / f).read_bytes())
    cfg = json.loads((model / "vae" / "config.json").read_text())
    cfg.update(latents_mean=[0.5] * 16, latents_std=[2.0] * 16)  # as a trained VAE's would be
    (model / "vae" / "config.json").write_text(json.dumps(cfg))
    (model / "vae" / "trained.json").write_text(json.dumps({"steps": 7, "psnr_db": 20.0, "run": "runs/x/vae"}))
    export = tmp_path / "installed"
    args = [
        "--config",
        "factory/configs/vae-decoder.yaml",
        f"run_dir={tmp_path / 'dec'}",
        f"model.path={model}",
        f"vae.export={export}",
        "data.num_samples=4",
        "data.num_frames=5",
        "data.height=32",
        "data.width=48",
        "train.batch_size=1",
        "vae.crop=32",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.lr=1e-3",
    ]
    assert main(args) == 0
    before = load_file(model / "vae" / "diffusion_pytorch_model.safetensors")
    after = load_file(export / "diffusion_pytorch_model.safetensors")
    frozen = [k for k in before if k.startswith(("encoder.", "quant_conv."))]
    trained = [k for k in before if k.startswith(("decoder.", "post_quant_conv."))]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(not torch.equal(before[k], after[k]) for k in trained)
    out_cfg = json.loads((export / "config.json").read_text())
    assert out_cfg["latents_mean"] == [0.5] * 16 and out_cfg["latents_std"] == [2.0] * 16
    record = json.loads((export / "trained.json").read_text())
    assert record["trainable"] == "decoder" and record["steps"] == 2
    assert record["history"] == [{"steps": 7, "psnr_db": 20.0, "run": "runs/x/vae"}]
    assert vae_runs(export / "trained.json") == {"runs/x/vae": 7, str(tmp_path / "dec"): 2}


def test_vae_runs_voids_a_decoder_run_once_the_encoder_is_retrained(tmp_path):
    from training.vae import vae_runs

    history = [{"run": "a", "steps": 5}, {"run": "dec", "steps": 3, "trainable": "decoder"}]
    path = tmp_path / "trained.json"
    path.write_text(json.dumps({"run": "a", "steps": 9, "trainable": "all", "history": history}))
    assert vae_runs(path) == {"a": 9}
    path.write_text(json.dumps({"run": "dec", "steps": 4, "trainable": "decoder", "history": history[:1]}))
    assert vae_runs(path) == {"a": 5, "dec": 4}
    assert vae_runs(tmp_path / "missing.json") == {}


def test_build_runs_the_decoder_stage_after_the_vae_stages(fresh_model_dir, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from factory import build as builtin
    from training.config import load_config

    configs = tmp_path / "configs"
    configs.mkdir()
    for stage in builtin.VAE_STAGES:  # runs/builtin/model is a build product, absent on a clean clone
        cfg = load_config(f"factory/configs/{stage}.yaml", [f"model.path={fresh_model_dir}"])
        (configs / f"{stage}.yaml").write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setattr(builtin, "CONFIGS", configs)
    monkeypatch.setattr(builtin, "MODEL", tmp_path)
    (tmp_path / "vae").mkdir()
    record = tmp_path / "vae" / "trained.json"
    record.write_text(json.dumps({"run": "runs/builtin/vae", "steps": 2800}))  # what vae-17f leaves
    assert builtin.stage_done("vae") and builtin.stage_done("vae-17f") and not builtin.stage_done("vae-decoder")
    history = [{"run": "runs/builtin/vae", "steps": 2800}]
    record.write_text(
        json.dumps({"run": "runs/builtin/vae-decoder", "steps": 5, "trainable": "decoder", "history": history})
    )
    assert builtin.stage_done("vae-17f") and not builtin.stage_done("vae-decoder")  # 5 of its steps
    record.write_text(
        json.dumps({"run": "runs/builtin/vae-decoder", "steps": 10**6, "trainable": "decoder", "history": history})
    )
    assert builtin.stage_done("vae-17f") and builtin.stage_done("vae-decoder")
    assert builtin.STAGES.index("vae-decoder") > builtin.STAGES.index("base")


def test_init_vae_with_4x4x4_strides_keeps_the_latent_grid_at_half_the_resolution(tmp_path):
    from diffusers import AutoencoderKLWan

    from factory.build import init_vae

    folder = init_vae(tmp_path / "m", dim_mult=[1, 2, 4], temperal_downsample=[True, True])
    vae = AutoencoderKLWan.from_pretrained(folder)
    assert (vae.config.scale_factor_temporal, vae.config.scale_factor_spatial) == (4, 4)
    with torch.no_grad():
        z = vae.encode(torch.zeros(1, 3, 17, 64, 80)).latent_dist.mean
    assert z.shape == (1, 16, 5, 16, 20)  # the shipped model's grid (17x128x160 at 4x8x8)
    with pytest.raises(ValueError, match=r"one entry per downsampling \(2 for dim_mult \[1, 2, 4\]\)"):
        init_vae(tmp_path / "bad", dim_mult=[1, 2, 4], temperal_downsample=[False, True, True])
    with pytest.raises(ValueError, match=r"has no argument \['base_channels'\]"):
        init_vae(tmp_path / "bad", base_channels=24)


def test_init_vae_with_a_wider_decoder_keeps_the_trained_encoder_and_its_latents(tmp_path):
    from diffusers import AutoencoderKLWan

    from factory.build import init_vae

    trained = init_vae(tmp_path / "trained", seed=int(np.random.default_rng().integers(1 << 30)))
    source = AutoencoderKLWan.from_pretrained(trained)
    source.register_to_config(latents_mean=[0.5] * 16, latents_std=[2.0] * 16)  # stands in for measured ones
    source.save_pretrained(trained)
    runs = [{"steps": 2800, "run": "runs/a/vae"}, {"steps": 1200, "run": "runs/a/vae-decoder", "trainable": "decoder"}]
    (trained / "trained.json").write_text(json.dumps({**runs[1], "history": runs[:1]}))
    folder = init_vae(tmp_path / "wide", encoder_from=trained, decoder_base_dim=16)
    wide = AutoencoderKLWan.from_pretrained(folder)
    # the encoder's training is on record; the old decoder's run is not (the new decoder is untrained)
    record = json.loads((folder / "trained.json").read_text())
    assert record["run"] == "runs/a/vae" and record["history"] == [] and "untrained" in record["decoder"]
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad():
        assert torch.equal(wide.encode(video).latent_dist.mean, source.encode(video).latent_dist.mean)
        assert wide.decode(source.encode(video).latent_dist.mean).sample.shape == video.shape
    assert wide.config.latents_mean == [0.5] * 16 and wide.config.latents_std == [2.0] * 16
    assert wide.decoder.conv_in.out_channels == 4 * 16 != source.decoder.conv_in.out_channels  # 4 = dim_mult[-1]
    with pytest.raises(ValueError, match=r"other settings \(theirs, these\): \{'base_dim': \(12, 16\)\}"):
        init_vae(tmp_path / "bad", encoder_from=trained, base_dim=16)
    with pytest.raises(ValueError, match="has no config.json"):
        init_vae(tmp_path / "bad", encoder_from=tmp_path / "nowhere")


def test_init_vae_with_more_latent_channels_gives_the_transformer_as_many(fresh_model_dir, tmp_path):
    import shutil

    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from factory.build import init_vae

    model = tmp_path / "model"
    shutil.copytree(fresh_model_dir, model)
    init_vae(model, z_dim=64)
    vae = AutoencoderKLWan.from_pretrained(model / "vae")
    transformer = WanTransformer3DModel.from_pretrained(model / "transformer")
    assert vae.config.z_dim == 64 and len(vae.config.latents_mean) == 64
    assert transformer.config.in_channels == transformer.config.out_channels == 64
    with torch.no_grad():
        z = vae.encode(torch.zeros(1, 3, 5, 32, 32)).latent_dist.mean
        out = transformer(
            hidden_states=z,
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.zeros(1, 4, 64),
            return_dict=False,
        )[0]
    assert z.shape == out.shape == (1, 64, 2, 4, 4)


def test_vae_task_needs_a_model_dir(capsys):
    from training.finetune import main

    assert main(["--config", "factory/configs/vae.yaml", "model.path=null"]) == 2
    assert "model.path=None: expected a model directory whose vae/ to train" in capsys.readouterr().err
    assert main(["--config", "factory/configs/vae.yaml", "task=gan"]) == 2
    assert "task='gan': expected one of" in capsys.readouterr().err
    assert main(["--config", "factory/configs/vae-decoder.yaml", "vae.trainable=encoder"]) == 2
    assert "vae.trainable='encoder': expected one of ('all', 'decoder')" in capsys.readouterr().err
    assert main(["--config", "factory/configs/vae.yaml", "train.precision=fp16"]) == 2
    assert "train.precision='fp16': expected 'no' or 'bf16' for task=vae" in capsys.readouterr().err


def test_vae_precision_runs_the_convolutions_in_bfloat16_and_keeps_float32_weights(fresh_model_dir, monkeypatch):
    """``train.precision: bf16`` autocasts the VAE's forward pass (its convolutions produce bfloat16) while
    the loss, the parameters and their gradients stay float32; ``no`` is float32 throughout."""
    from diffusers import AutoencoderKLWan

    from training.vae import autocast_for, vae_loss

    vae = AutoencoderKLWan.from_pretrained(fresh_model_dir / "vae", dtype=torch.float32).train()
    seen: list[torch.dtype] = []
    vae.encoder.conv_in.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    losses = {}
    for precision in ("no", "bf16"):
        seen.clear()
        vae.zero_grad(set_to_none=True)
        with autocast_for(precision):
            loss, _ = vae_loss(vae, video, 1e-6, 10.0)
        assert loss.dtype == torch.float32  # the loss is summed in float32 either way
        loss.backward()
        assert seen and set(seen) == {torch.float32 if precision == "no" else torch.bfloat16}
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in vae.parameters())
        losses[precision] = loss.item()
    # the same computation at lower precision: close, not identical
    assert losses["no"] != losses["bf16"] and abs(losses["no"] - losses["bf16"]) < 0.05 * losses["no"]
    with pytest.raises(ValueError, match="expected 'no' or 'bf16'"):
        autocast_for("fp16")


# --------------------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def builtin():
    return load_components(None, dtype="float32", device="cpu")


@needs_builtin
def test_builtin_is_the_default_and_ships_every_variant(builtin):
    assert builtin.source.startswith("built-in model") and not builtin.random_weights
    assert sorted(builtin.variant_dirs) == ["linear", "mhla", "mhla-hybrid"]
    info = json.loads((BUILTIN_DIR / "builtin.json").read_text())
    assert builtin.defaults == info["defaults"] and builtin.defaults["max_sequence_length"] == 16  # v3's captions
    size = sum(f.stat().st_size for f in BUILTIN_DIR.rglob("*.safetensors"))
    assert size < 100e6, f"built-in weights take {size / 1e6:.0f} MB"


@needs_builtin
def test_the_default_settings_draw_colour_motion_and_shape_of_most_prompts(builtin):
    """The built-in model's defaults give the right colour in every one of the first 12 validation captions (seed 0)
    and the right colour and motion in most (the third design's first ship: 10 of 12; the third ship's 48 x 3
    evaluation: motion 0.99), judged by the analyser; and the shape asked for in most (the ninth ship: 10 of 12;
    its 48 x 3 evaluation: shape 0.90 with softmax attention)."""
    from pipelines.cli import GenerationRequest, generate
    from pipelines.model_dir import builtin_info
    from world.synthetic import SyntheticVideoDataset, world_named

    d, world = builtin.defaults, world_named(builtin_info().get("world", "v1"))
    data = SyntheticVideoDataset(
        12, seed=0, split="validation", num_frames=d["num_frames"], height=d["height"], width=d["width"], world=world
    )
    captions = [data[i]["caption"] for i in range(12)]
    frames = [generate(builtin, GenerationRequest(prompt=c, seed=0), show_progress=False).frames for c in captions]
    verdicts = [analyse(f, c, colours=world.colours) for f, c in zip(frames, captions)]
    assert all(v["colour"] for v in verdicts), [v["found"] for v in verdicts]
    assert sum(bool(v["colour"] and v["motion"]) for v in verdicts) >= 8, [v["found"] for v in verdicts]
    assert sum(bool(v["shape"]) for v in verdicts) >= 8, [v["found"] for v in verdicts]


@needs_builtin
def test_held_out_combination_gets_an_object_of_its_colour(builtin):
    """Green objects never move right in training (``DEFAULT_HELD_OUT``); the prompt still gets a green
    object (a region of at most a third of the frame, not a green wash) for most seeds.

    Only colour is asserted: the shipped base does not yet follow motion words on held-out or on
    seen combinations other than the red square's (issue 17's pilots, session 5), so asserting the
    motion here would fail on the model as it ships.
    """
    from pipelines.cli import GenerationRequest, generate
    from world.synthetic import SyntheticWorld

    assert SyntheticWorld().is_held_out({"colour": "green", "shape": "square", "motion": "right"})
    prompt = "a green square moves to the right"
    requests = [GenerationRequest(prompt=prompt, seed=s) for s in range(3)]
    verdicts = [analyse(generate(builtin, r, show_progress=False).frames, prompt) for r in requests]
    passed = [bool(v["colour"] and v["found"]["objects"]["green"]["max_area"] <= 1 / 3) for v in verdicts]
    assert sum(passed) >= 2, [v["found"] for v in verdicts]


@needs_builtin
def test_cli_runs_each_variant_from_its_fine_tuned_transformer(tmp_path, capsys):
    from common.video import read_video
    from pipelines.cli import main

    out = tmp_path / "v.mp4"
    argv = ["--prompt", "a blue circle moves up", "--variant", "all", "--steps", "2", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "built-in model" in printed and "RANDOM" not in printed
    for v in ("linear", "mhla", "mhla-hybrid"):
        assert f"{v}: fine-tuned transformer" in printed
        d = json.loads((BUILTIN_DIR / "builtin.json").read_text())["defaults"]
        assert read_video(tmp_path / f"v_{v}.mp4").shape == (d["num_frames"], d["height"], d["width"], 3)


@needs_builtin
def test_cli_checks_blocks_on_the_builtin_models_token_grid(tmp_path, capsys):
    from pipelines.cli import main
    from pipelines.model_dir import ModelDir

    assert ModelDir(None).shape().patch == (1, 2, 2)  # the third design: 9x64x80 -> 5x8x10 tokens
    assert ModelDir("tiny-random").shape(BUILTIN_DIR / "variants" / "mhla").patch == (1, 2, 2)
    base = ["--prompt", "a red square", "--variant", "mhla", "--out", str(tmp_path / "v.mp4"), "--no-progress"]
    assert main([*base, "--blocks", "1x9x1"]) == 2  # the built-in grid is 5x8x10 tokens (patch 1x2x2)
    assert "blocks '1x9x1' do not fit 9 frames at 64x80" in capsys.readouterr().err
    assert main([*base, "--blocks", "1x8x1"]) == 2  # the shipped mhla was fine-tuned with 5x2x2 blocks
    assert "was fine-tuned with 5x2x2 blocks (its mixing coefficients are 20x20)" in capsys.readouterr().err
    fresh = ["--transformer", str(BUILTIN_DIR / "transformer"), "--blocks", "1x8x1", "--steps", "1"]
    assert main([*base, *fresh]) == 0  # the softmax base converted afresh with other blocks
    assert "1x8x1 blocks (M=8) over a 5x8x10 grid" in capsys.readouterr().out


@needs_builtin
def test_app_loads_each_fine_tuned_variant_and_shows_no_server_paths():
    from app.models import load_app_models

    m = load_app_models(None, device="cpu")
    assert m.variants["flash"].kind == "base" and m.random_note is None
    for v in ("linear", "mhla", "mhla-hybrid"):
        assert m.variants[v].kind == "fine-tuned" and m.variants[v].transformer is not m.components.transformer
        assert m.variants[v].note.endswith(f"variants/{v}") and str(BUILTIN_DIR.resolve()) not in m.variants[v].note


@needs_builtin
def test_evaluate_writes_its_table(tmp_path, monkeypatch):
    from factory import evaluate
    from factory.evaluate import main

    monkeypatch.setattr(evaluate, "VIDEOS_DIR", tmp_path / "videos")
    from world.analyse import ANALYSER_VERSION
    from world.synthetic import SyntheticVideoDataset

    out = tmp_path / "eval"
    argv = [
        "--num-prompts",
        "1",
        "--steps",
        "2",
        "--loss-batches",
        "1",
        "--batch-size",
        "1",
        "--variants",
        "flash,mhla",
        "--seeds",
        "0",
        "1",
        "--noise-draws",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert list(res["variants"]) == ["flash", "mhla"] and res["num_prompts"] == 1 and res["noise_draws"] == 2
    assert res["analyser_version"] == ANALYSER_VERSION  # scores compare only within one analyser version
    assert res["grid_prompts"] == [SyntheticVideoDataset(1, seed=0, split="validation")[0]["caption"]]
    assert not any(k.startswith("_") for k in res)  # the frames behind the PNG stay out of the JSON
    ceiling = res["vae_ceiling"]  # the VAE's reconstructions of the prompts' real clips: scores and PSNR
    frames = json.loads((BUILTIN_DIR / "builtin.json").read_text())["defaults"]["num_frames"]
    assert 0 <= ceiling["overall"] <= 1 and 5 < ceiling["psnr_db"] < 60 and len(ceiling["psnr_by_frame_db"]) == frames
    for r in res["variants"].values():
        assert np.isfinite(r["flow_loss"]) and 0 <= r["overall"] <= 1 and r["total_s"] > 0
        draws = r["flow_loss_draws"]
        assert len(draws) == 2 and draws[0] != draws[1]  # independent noise: two different losses
        assert r["flow_loss"] == pytest.approx(sum(draws) / 2)
        assert r["flow_loss_std"] == pytest.approx(abs(draws[0] - draws[1]) / 2**0.5)  # sample std of two values
        assert len(r["overall_by_seed"]) == 2 and r["overall"] == pytest.approx(sum(r["overall_by_seed"]) / 2)
        videos = r["per_video"]  # one verdict per prompt and seed, from which the scores follow
        assert [(x["prompt"], x["seed"]) for x in videos] == [(0, 0), (0, 1)]
        right = [all(x[a] in (True, None) for a in ("count", "colour", "shape", "motion")) for x in videos]
        assert r["overall"] == pytest.approx(sum(right) / 2) and r["colour"] == pytest.approx(
            sum(x["colour"] for x in videos) / 2
        )
    md = out.with_suffix(".md").read_text()
    assert "| MHLA |" in md and " ± " in md and out.with_suffix(".png").stat().st_size > 1000
    # every video kept for re-judging, in per_video's order: the analyser reads them to the same verdicts
    from world.analyse import analyse

    kept = np.load(tmp_path / "videos" / "eval.npz")
    order = json.loads(str(kept["order"]))
    for v in ("flash", "mhla"):
        frames, listed = kept[f"{v}@4"], order[f"{v}@4"]
        d = json.loads((BUILTIN_DIR / "builtin.json").read_text())["defaults"]
        assert frames.dtype == np.uint8 and frames.shape == (2, d["num_frames"], d["height"], d["width"], 3)
        for video, item, verdict in zip(frames, listed, res["variants"][v]["per_video"]):
            assert (item["caption"], item["seed"]) == (verdict["caption"], verdict["seed"])
            again = analyse(video, item["caption"])
            assert all(again[a] == verdict[a] for a in ("count", "colour", "shape", "motion"))
            # and what each named colour's object was read as, for the table of shapes
            assert verdict["read"] == {c: o["shape"] for c, o in again["found"]["objects"].items()}
    # --rejudge reads them back: the same analyser gives the same verdicts and scores, the settings are kept
    assert main(["--rejudge", "--out", str(out)]) == 0
    again = json.loads(out.with_suffix(".json").read_text())
    for v in ("flash", "mhla"):
        assert again["variants"][v]["per_video"] == res["variants"][v]["per_video"]
        assert again["variants"][v]["overall"] == res["variants"][v]["overall"]
        assert again["variants"][v]["flow_loss"] == res["variants"][v]["flow_loss"]
    assert "rejudged" in again and again["num_prompts"] == 1


@needs_builtin
def test_evaluate_sweeps_guidance_and_marks_the_best(tmp_path):
    from factory.evaluate import main

    out = tmp_path / "sweep"
    argv = [
        "--num-prompts",
        "1",
        "--steps",
        "2",
        "--loss-batches",
        "0",
        "--variants",
        "flash",
        "--data-seed",
        "1",
        "--guidance",
        "1",
        "3",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    row = res["variants"]["flash"]
    assert res["guidance_scale"] == [1.0, 3.0] and res["data_seed"] == 1 and row["flow_loss"] is None
    assert res["vae_ceiling"] is None  # not computed for a sweep: its table does not show it
    assert set(row["by_guidance"]) == {"1", "3"} and row["best_guidance"] in (1.0, 3.0)
    best = row["by_guidance"][f"{row['best_guidance']:g}"]
    assert all(best["overall"] >= r["overall"] for r in row["by_guidance"].values())
    table = out.with_suffix(".md").read_text()
    assert table.count("| softmax (FA) |") == 2 and table.count("(best)") == 1


def test_sweep_table_puts_each_attribute_under_its_own_header():
    from factory.evaluate import sweep_markdown

    row = {"colour": 0.1, "shape": 0.2, "count": 0.3, "motion": 0.4, "overall": 0.0, "total_s": 1.0}
    res = {
        "num_prompts": 1,
        "data_seed": 1,
        "seeds": [0],
        "num_inference_steps": 2,
        "device": "cpu",
        "machine": "m",
        "date": "d",
        "variants": {"flash": {"best_guidance": 2.0, "by_guidance": {"2": row}}},
    }
    header, _, line = sweep_markdown(res).splitlines()[2:5]
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert [cells[a] for a in ("colour", "shape", "count", "motion")] == ["0.10", "0.20", "0.30", "0.40"]


def test_the_shape_table_counts_each_asked_shape_and_what_it_was_read_as():
    from factory.evaluate import markdown, shape_readings

    def video(caption, read, shape=None):
        return {
            "caption": caption,
            "read": read,
            "shape": shape,
            "seed": 0,
            "colour": True,
            "count": True,
            "motion": True,
        }

    videos = [
        video("a red triangle moves up on a grey background", {"red": "triangle"}, True),
        video("a red triangle moves up on a grey background", {"red": "circle"}, False),
        video("a blue triangle stays still", {"blue": "other"}, False),
        video("a green square moves down", {"green": None}, False),
        video("a red circle moves to the left and a blue square stays still", {"red": "circle", "blue": "other"}),
    ]
    table = shape_readings(videos)
    assert list(table) == ["circle", "square", "triangle"]  # the world's order, shapes asked only
    assert table["triangle"] == {"asked": 3, "right": 1, "read_as": {"circle": 1, "other": 1}}
    assert table["square"] == {"asked": 2, "right": 0, "read_as": {"none": 1, "other": 1}}
    assert table["circle"] == {"asked": 1, "right": 1, "read_as": {}}
    # an evaluation written before "read": single-shape videos by their shape verdict
    old = [{k: v for k, v in x.items() if k != "read"} for x in videos]
    assert shape_readings(old)["triangle"] == {"asked": 3, "right": 1, "read_as": {}}
    row = {"flow_loss": 0.1, "colour": 1.0, "shape": 0.4, "count": 1.0, "motion": 1.0, "overall": 0.4,
           "overall_held_out": None, "total_s": 1.0, "denoise_s": 0.5, "per_video": videos}  # fmt: skip
    res = {"guidance_scale": 4.0, "num_prompts": 5, "seeds": [0], "num_inference_steps": 2, "device": "cpu",
           "machine": "m", "date": "d", "loss_clips": 0, "variants": {"mhla": row},
           "vae_ceiling": {"colour": 1.0, "shape": 1.0, "count": 1.0, "motion": 1.0, "overall": 1.0}}  # fmt: skip
    md = markdown(res)
    assert "| variant | circle | square | triangle |" in md
    assert "| MHLA | 1/1 | 0/2 (none 1, other 1) | 1/3 (circle 1, other 1) |" in md


def test_the_table_shows_each_attributes_spread_over_seeds():
    from factory.evaluate import markdown, seed_spread

    # colour right in 2 of 2 videos for seed 0, 1 of 2 for seed 1, 0 of 2 for seed 2: per seed 1, 0.5, 0;
    # motion is named in one video per seed only, and shape in seed 0 only (one seed: no spread to show)
    def video(seed, colour, motion, shape=None):
        return {"seed": seed, "colour": colour, "motion": motion, "shape": shape, "count": True}

    videos = [video(0, True, True, False), video(0, True, None, True), video(1, True, False), video(1, False, None)]
    videos += [video(2, False, True), video(2, False, None)]
    assert seed_spread(videos, "colour") == pytest.approx(0.5)  # sample std of 1, 0.5, 0
    assert seed_spread(videos, "motion") == pytest.approx(np.std([1, 0, 1], ddof=1))
    assert seed_spread(videos, "shape") is None and seed_spread(videos, "count") == 0.0
    row = {"flow_loss": None, "colour": 0.5, "shape": 0.5, "count": 1.0, "motion": 2 / 3, "overall": 0.0,
           "overall_std": 0.0, "overall_held_out": None, "total_s": 1.0, "denoise_s": 0.5, "per_video": videos}  # fmt: skip
    res = {"guidance_scale": 4.0, "num_prompts": 2, "seeds": [0, 1, 2], "num_inference_steps": 2, "device": "cpu",
           "machine": "m", "date": "d", "loss_clips": 0, "variants": {"flash": row},
           "vae_ceiling": {"colour": 1.0, "shape": 1.0, "count": 1.0, "motion": 1.0, "overall": 1.0}}  # fmt: skip
    line = markdown(res).splitlines()[4]
    assert "| 0.50 ± 0.50 | 0.50 | 1.00 | 0.67 ± 0.58 |" in line, line


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--guidance", "-1"], "--guidance takes distinct finite scales >= 0, got [-1.0]"),
        (["--guidance", "2", "2"], "--guidance takes distinct finite scales >= 0, got [2.0, 2.0]"),
        (["--loss-batches", "-1"], "--loss-batches must be >= 0 (0 = skip the held-out loss), got -1"),
        (["--noise-draws", "0"], "--noise-draws must be >= 1, got 0"),
    ],
)
def test_evaluate_refuses_bad_sweep_arguments(bad, message, capsys):
    from factory.evaluate import main

    assert main(["--num-prompts", "1", *bad]) == 2  # the error boundary: an exit code, not SystemExit
    assert message in capsys.readouterr().err


@needs_builtin
def test_evaluate_judges_a_stages_transformer_in_place_of_the_models(tmp_path):
    """--transformer: a stage's checkpoint is judged with the model directory's VAE and text encoder; the
    held-out loss is its own (a perturbed copy of the shipped transformer scores another loss)."""
    import torch
    from diffusers import WanTransformer3DModel

    from factory.evaluate import main

    t = WanTransformer3DModel.from_pretrained(str(BUILTIN_DIR / "transformer"))
    with torch.no_grad():
        t.proj_out.weight.mul_(0.5)
    t.save_pretrained(str(tmp_path / "stage"))
    argv = ["--num-prompts", "1", "--steps", "2", "--loss-batches", "1", "--batch-size", "1", "--variants", "flash"]
    losses = []
    for extra, name in (([], "plain"), (["--transformer", str(tmp_path / "stage")], "stage")):
        assert main([*argv, *extra, "--out", str(tmp_path / name)]) == 0
        res = json.loads((tmp_path / f"{name}.json").read_text())
        losses.append(res["variants"]["flash"]["flow_loss"])
    assert np.isfinite(losses).all() and losses[0] != pytest.approx(losses[1], rel=1e-3)


def test_evaluate_refuses_a_stages_transformer_with_other_variants(capsys):
    from factory.evaluate import main

    assert main(["--transformer", "somewhere", "--variants", "flash,mhla"]) == 2
    assert "--transformer is evaluated as flash only" in capsys.readouterr().err


def test_evaluate_refuses_random_weights(capsys):
    from factory.evaluate import main

    assert main(["--model", "tiny-random", "--num-prompts", "1"]) == 2
    assert "error: the model has random weights" in capsys.readouterr().err


def test_every_builtin_config_loads(tmp_path):
    """Every recipe under factory/configs/ (shipped stages, pilots, the next runs) parses and validates: a
    misspelt key or a bad value fails here, not an hour into a background run. Only the folders they
    read (build products, absent on a clean clone) are pointed at an existing one."""
    from omegaconf import OmegaConf

    from training.config import load_config

    root = Path(__file__).resolve().parents[2] / "factory" / "configs"
    paths = sorted(root.rglob("*.yaml"))
    assert len(paths) >= 9 and {"base.yaml", "vae.yaml", "mhla.yaml"} <= {p.name for p in paths}
    for path in paths:
        raw = OmegaConf.load(path)
        keys = ("model.path", "data.path", "data.image_path")
        overrides = [f"{key}={tmp_path}" for key in keys if OmegaConf.select(raw, key)]
        if OmegaConf.select(raw, "model.transformer"):
            overrides.append("model.transformer=null")
        cfg = load_config(path, overrides)
        assert str(cfg.run_dir).startswith("runs/"), f"{path.name}: run_dir {cfg.run_dir!r} outside runs/"
        if cfg.task == "vae" and cfg.vae.export:
            assert str(cfg.vae.export).startswith("runs/"), f"{path.name}: exports into {cfg.vae.export!r}"


def test_vae_speed_times_both_precisions(tmp_path, capsys):
    from factory.vae_speed import main

    out = tmp_path / "speed"
    argv = ["--set", "base_dim=4", "--batch", "1", "--frames", "5", "--crop", "16", "--repeats", "1"]
    assert main([*argv, "--trainable", "decoder", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert set(res["precision"]) == {"no", "bf16"} and all(r["median_s"] > 0 for r in res["precision"].values())
    assert res["vae"]["base_dim"] == 4 and res["trainable"] == "decoder" and res["batch"] == [1, 3, 5, 16, 16]
    assert "bf16 / float32" in capsys.readouterr().out
    assert main(["--frames", "4"]) == 2  # the error boundary: an exit code, not SystemExit
    # --encode: the encoder alone on whole clips of the given size (a training cache's cost)
    assert main([*argv, "--encode", "--height", "16", "--width", "24", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["timed"] == "encode" and res["batch"] == [1, 3, 5, 16, 24] and res["trainable"] is None
    assert 0 < res["encoder_parameters_m"] < res["parameters_m"]
    assert "VAE encode" in capsys.readouterr().out
    assert main([*argv, "--height", "16"]) == 2  # --height without --encode

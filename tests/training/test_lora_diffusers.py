"""Issue 54 (3): a LoRA run's adapters in the format diffusers' ``WanPipeline.load_lora_weights`` reads, loaded into
a plain ``WanPipeline`` with the frames of the run's own merged model; read back by the recipe (``model.lora``) and
by ``pipelines.cli --lora``; what a plain pipeline cannot load of an MHLA run said in the file and its README."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pipelines.lora import ATTENTION_NAME, INFO_KEY, README_NAME, WEIGHT_NAME, read_lora, save_lora
from tests.training.test_training import TINY, finetune, in_process
from training import checkpoint as ckpt
from training.config import load_config

PROMPT = "a red circle moves to the right"
# the tiny model's size and steps (its defaults), the seed both sides draw the noise from
SIZE = dict(height=64, width=96, num_frames=9, num_inference_steps=4, guidance_scale=5.0)
# a rate that moves the adapters (their B starts at zero) far enough in two steps to change the video
TRAIN = ["train.trainable=lora", "train.steps=2", "train.lr=0.05", "train.warmup_steps=1", "checkpoint.every=2"]


def tiny_lora_transformer(seed: int = 0, rank: int = 4, alpha: float = 8):
    """A tiny transformer (2 layers) with a peft adapter whose B is random (so the adapter changes the output)."""
    from peft import LoraConfig

    from pipelines.tiny import build_tiny_transformer

    model = build_tiny_transformer(seed, num_layers=2)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=True))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def forward(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return model(
            hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g),
            timestep=torch.tensor([700]),
            encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
            return_dict=False,
        )[0]


def cli(*argv):
    from pipelines.cli import main

    return in_process(main, [*argv, "--no-progress"])


# --------------------------------------------------------------------------- the format, without training


def test_saved_adapters_load_through_diffusers_own_loader_with_rank_alpha_and_the_same_output(tmp_path):
    from diffusers import WanPipeline

    from pipelines.tiny import build_tiny_transformer

    model = tiny_lora_transformer(rank=4, alpha=8)  # alpha != rank: the scale must travel in the file
    folder = save_lora(model, tmp_path / "lora", {"variant": "flash", "base_model": "tiny", "step": 3})
    assert sorted(p.name for p in folder.iterdir()) == [README_NAME, WEIGHT_NAME]
    state, metadata = WanPipeline.lora_state_dict(str(folder / WEIGHT_NAME), return_lora_metadata=True)
    assert all(k.startswith("transformer.blocks.") and ".lora_" in k for k in state)
    assert metadata["transformer.r"] == 4 and metadata["transformer.lora_alpha"] == 8

    plain = build_tiny_transformer(0, num_layers=2)  # the same base weights, no adapter
    before = forward(plain)
    plain.load_lora_adapter(str(folder), prefix="transformer", weight_name=WEIGHT_NAME)  # what load_lora_weights calls
    torch.testing.assert_close(forward(plain), forward(model), rtol=1e-5, atol=1e-5)
    assert (forward(plain) - before).abs().max() > 1e-3  # the adapter does change the output

    adapters = read_lora(folder)
    assert (adapters.rank, adapters.alpha, adapters.variant, adapters.attention) == (4, 8.0, "flash", None)
    with safe_open(str(folder / WEIGHT_NAME), framework="pt") as f:
        info = json.loads(f.metadata()[INFO_KEY])
    assert info["step"] == 3 and info["diffusers"].startswith("loads fully")


def test_bad_lora_paths_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    from pipelines import loading

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(loading, "load_components", boom)
    base = ["--model", "tiny-random", "--prompt", PROMPT, "--out", str(tmp_path / "x.mp4")]
    gone = cli(*base, "--lora", str(tmp_path / "nowhere"))
    assert gone.returncode == 2 and "--lora" in gone.stderr and "does not exist" in gone.stderr
    assert "pytorch_lora_weights.safetensors" in gone.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    folder = cli(*base, "--lora", str(empty))
    assert folder.returncode == 2 and "is a folder without pytorch_lora_weights.safetensors" in folder.stderr
    # a full transformer's weights are not LoRA adapters
    from safetensors.torch import save_file

    full = tmp_path / "full.safetensors"
    save_file({"blocks.0.attn1.to_q.weight": torch.zeros(2, 2)}, str(full))
    whole = cli(*base, "--lora", str(full))
    assert whole.returncode == 2 and "not LoRA adapters" in whole.stderr and "--transformer" in whole.stderr
    # a LoRA of another model size: named from the config, before the model loads
    wide = save_lora(tiny_lora_transformer(), tmp_path / "wide", {"variant": "flash"})
    big = tmp_path / "big"
    from pipelines.tiny import save_tiny_model

    save_tiny_model("wan2.1-t2v", big, num_layers=1)
    monkeypatch.undo()
    layers = cli("--model", str(big), "--prompt", PROMPT, "--out", str(tmp_path / "y.mp4"), "--lora", str(wide))
    assert layers.returncode == 2 and "but the transformer has 1 layers" in layers.stderr, layers.stderr


def test_model_lora_is_checked_before_the_model_loads(tmp_path):
    from training.finetune import check_start_lora

    with pytest.raises(ValueError, match=r"model.lora='.*': expected null with train.trainable='all'"):
        load_config(TINY, [f"model.lora={tmp_path}"])
    with pytest.raises(ValueError, match=r"model.lora='.*nowhere': expected an existing LoRA folder"):
        load_config(TINY, [f"model.lora={tmp_path / 'nowhere'}", "train.trainable=lora"])
    folder = save_lora(tiny_lora_transformer(rank=4, alpha=8), tmp_path / "lora", {"variant": "flash"})
    lora = ["train.trainable=lora", f"model.lora={folder}", "model.variant=flash"]
    with pytest.raises(ValueError, match=r"holds adapters of rank 4, alpha 8; .* expected train.lora.rank=4"):
        start = load_config(TINY, lora)
        check_start_lora(start.model, start.train.lora)
    fits = load_config(TINY, [*lora, "train.lora.rank=4", "train.lora.alpha=8"])
    assert check_start_lora(fits.model, fits.train.lora).rank == 4
    narrow = load_config(TINY, [*lora, "train.lora.rank=4", "train.lora.alpha=8", "train.lora.target_modules=[to_q]"])
    with pytest.raises(ValueError, match=r"adapts modules .* \(attn1.to_k, .*train.lora.target_modules=\["):
        check_start_lora(narrow.model, narrow.train.lora)


# --------------------------------------------------------------------------- trained runs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pipelines.tiny import save_tiny_model

    return save_tiny_model("wan2.1-t2v", tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def flash_run(tiny_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("flash") / "run"
    finetune(run, f"model.path={tiny_model}", "model.variant=flash", *TRAIN)
    return run


def cli_frames(tmp_path, name, model, *extra):
    out = tmp_path / f"{name}.mp4"
    proc = cli(
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--seed",
        "0",
        "--out",
        str(out),
        *extra,
        "--frames-npy",
        str(tmp_path / f"{name}.npy"),
    )
    assert proc.returncode == 0, proc.stderr
    return np.load(tmp_path / f"{name}.npy"), proc


@pytest.mark.slow
def test_a_flash_lora_run_loads_in_plain_diffusers_with_the_frames_of_its_merged_model(flash_run, tiny_model, tmp_path):
    from diffusers import WanPipeline

    final = flash_run / "final" / "lora"
    assert sorted(p.name for p in final.iterdir()) == [README_NAME, WEIGHT_NAME]  # flash: nothing but adapters
    saved = ckpt.checkpoint_dir(flash_run, 2) / ckpt.LORA  # each checkpoint has them too
    assert (saved / WEIGHT_NAME).is_file()
    assert "lora/pytorch_lora_weights.safetensors" in (saved.parent / "manifest.json").read_text()  # checked on resume

    # plain diffusers: the tiny model folder and its LoRA, nothing of this product
    pipe = WanPipeline.from_pretrained(str(tiny_model))
    base = pipe(PROMPT, **SIZE, generator=torch.Generator("cpu").manual_seed(0), output_type="np").frames[0]
    pipe.load_lora_weights(str(final))
    lora = pipe(PROMPT, **SIZE, generator=torch.Generator("cpu").manual_seed(0), output_type="np").frames[0]
    # the issue's own call, on a checkpoint's folder
    again = WanPipeline.from_pretrained(str(tiny_model))
    again.load_lora_weights(str(saved), weight_name=WEIGHT_NAME)

    # the recipe's merged model through the product's CLI, and the CLI with --lora
    merged, _ = cli_frames(tmp_path, "merged", tiny_model, "--transformer", str(flash_run / "final" / "transformer"))
    with_lora, proc = cli_frames(tmp_path, "lora", tiny_model, "--lora", str(final))
    assert "variant                flash" in proc.stdout and "+ LoRA" in proc.stdout
    np.testing.assert_allclose(lora, merged, rtol=0, atol=1e-4)
    np.testing.assert_allclose(with_lora, merged, rtol=0, atol=1e-4)
    assert np.abs(lora - base).max() > 0.01  # the adapters trained: the video is not the base model's


@pytest.mark.slow
def test_model_lora_starts_a_run_from_the_saved_adapters(flash_run, tiny_model, tmp_path):
    end = [
        r["eval_loss"]
        for r in map(json.loads, (flash_run / "metrics.jsonl").read_text().splitlines())
        if "eval_loss" in r
    ]
    run = tmp_path / "on"
    proc = finetune(
        run,
        f"model.path={tiny_model}",
        "model.variant=flash",
        *TRAIN,
        "train.steps=1",
        f"model.lora={flash_run / 'final' / 'lora'}",
    )
    assert "adapters from model.lora=" in proc.stdout
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and start["eval_loss"] == pytest.approx(end[-1], rel=1e-5)  # the trained model again


@pytest.mark.slow
def test_an_mhla_lora_saves_its_attention_parameters_and_says_what_diffusers_cannot_load(tiny_model, tmp_path):
    from diffusers import WanPipeline

    run = tmp_path / "mhla"
    finetune(run, f"model.path={tiny_model}", "model.variant=mhla", *TRAIN)
    final = run / "final" / "lora"
    assert sorted(p.name for p in final.iterdir()) == [README_NAME, ATTENTION_NAME, WEIGHT_NAME]
    with safe_open(str(final / WEIGHT_NAME), framework="pt") as f:
        info = json.loads(f.metadata()[INFO_KEY])
    assert info["variant"] == "mhla" and info["attention_parameters"] is True
    assert "loads the adapters only" in info["diffusers"] and "product's processors" in info["diffusers"]
    readme = (final / README_NAME).read_text()
    assert "loads the adapters only" in readme and ATTENTION_NAME in readme and "load_lora_weights" in readme
    with safe_open(str(final / ATTENTION_NAME), framework="pt") as f:
        assert all(".attn1.mhla." in k for k in f.keys())
        assert json.loads(f.metadata()["self_attention"])["variant"] == "mhla"

    WanPipeline.from_pretrained(str(tiny_model)).load_lora_weights(str(final))  # the adapters do load
    # the product runs it as trained: --lora gives the merged model's frames, as MHLA
    merged, _ = cli_frames(tmp_path, "merged", tiny_model, "--transformer", str(run / "final" / "transformer"))
    with_lora, proc = cli_frames(tmp_path, "lora", tiny_model, "--lora", str(final))
    assert "variant                mhla" in proc.stdout
    np.testing.assert_allclose(with_lora, merged, rtol=0, atol=1e-4)
    other = cli(
        "--model",
        str(tiny_model),
        "--prompt",
        PROMPT,
        "--out",
        str(tmp_path / "x.mp4"),
        "--lora",
        str(final),
        "--variant",
        "flash",
    )
    assert other.returncode == 2 and "was trained as variant 'mhla'" in other.stderr
    # a flash run cannot start from MHLA attention parameters
    refused = finetune(
        tmp_path / "flash",
        f"model.path={tiny_model}",
        "model.variant=flash",
        *TRAIN,
        f"model.lora={final}",
        check=False,
    )
    assert refused.returncode == 2 and "expected model.variant=mhla" in refused.stderr


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_and_its_adapters_match_the_uninterrupted_runs(tiny_model, tmp_path):
    steps = [f"model.path={tiny_model}", "model.variant=mhla", *TRAIN, "train.steps=4", "log.param_digest=true"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    finetune(straight, *steps)
    finetune(resumed, *steps, "train.steps=2")
    finetune(resumed, *steps, "resume=latest")
    assert (resumed / "param_digest" / "rank0.txt").read_text() == (straight / "param_digest" / "rank0.txt").read_text()
    from safetensors.torch import load_file

    for name in (WEIGHT_NAME, ATTENTION_NAME):
        a, b = (load_file(run / "final" / "lora" / name) for run in (straight, resumed))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_final_model_copied_from_the_last_checkpoint_brings_its_adapters(tmp_path):
    """A LoRA run stopped between its last checkpoint and its final save: resume=latest copies both."""
    run = tmp_path / "run"
    checkpoint = ckpt.checkpoint_dir(run, 4)
    (checkpoint / "transformer").mkdir(parents=True)
    (checkpoint / "transformer" / "config.json").write_text("{}")
    save_lora(tiny_lora_transformer(), checkpoint / ckpt.LORA, {"variant": "flash", "step": 4})
    ckpt.final_from_checkpoint(run, checkpoint)
    assert (run / "final" / "lora" / WEIGHT_NAME).read_bytes() == (checkpoint / "lora" / WEIGHT_NAME).read_bytes()
    assert "final/lora" in (run / "run_files.json").read_text()  # overwrite=true removes it with the run

"""Bad input and faults at the pipeline's entry points: each is refused with a message that names the value
or file and what was expected, before heavy work where it can be known then (issue 15's probes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import pipelines.cli as gen
from common.video import MAX_COMMENT_CHARS, check_output_path, read_video, write_mp4
from pipelines.attention import AttentionOptions, parse_layers
from pipelines.loading import load_transformer, save_transformer
from pipelines.model import convert_self_attention
from pipelines.model_dir import BUILTIN_DIR
from pipelines.tiny import build_tiny_transformer

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load a model fails the test: checks must come first."""

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("pipelines.loading.load_components", boom)
    monkeypatch.setattr("pipelines.loading.load_transformer", boom)


def run_cli(argv, capsys) -> tuple[int, str]:
    rc = gen.main(["--model", "tiny-random", "--prompt", "a fox", "--no-progress", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "spec,message",
    [
        ("5-2", "the range '5-2' runs backwards"),
        ("", "names no layer"),
        (" , ", "names no layer"),
        ("-1", "non-negative indices"),
        ("99", "layer indices [99] are out of range for a transformer with 30 layers"),
    ],
)
def test_hybrid_layers_are_never_empty_reversed_or_out_of_range(spec, message, capsys, no_model_load, tmp_path):
    with pytest.raises(ValueError, match=None) as e:
        parse_layers(spec, 30)
    assert message in str(e.value)
    rc, err = run_cli(["--variant", "mhla-hybrid", "--layers", spec, "--out", str(tmp_path / "a.mp4")], capsys)
    assert rc == 2 and message in err


def test_unwritable_outputs_are_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me")
    cases = [
        (["--out", str(a_file / "a.mp4")], f"{str(a_file)!r} is a file, not a folder"),
        (["--out", str(tmp_path / "dir.mp4")], "is a folder; expected a file name"),
        (["--out", str(tmp_path / "ok.mp4"), "--gif", str(a_file / "x.gif")], "is a file, not a folder"),
        (["--out", str(tmp_path / "ok.mp4"), "--grid-png", str(tmp_path / "x.jpg")], "must end in .png"),
    ]
    (tmp_path / "dir.mp4").mkdir()
    for argv, message in cases:
        rc, err = run_cli(argv, capsys)
        assert rc == 2 and message in err, (argv, err)
    assert a_file.read_text() == "keep me"
    assert check_output_path(tmp_path / "new" / "deeper" / "a.mp4")  # folders that do not exist yet are made


def test_model_and_config_files_that_are_not_what_they_should_be_are_named(tmp_path, capsys, no_model_load):
    (tmp_path / "file").write_text("x")
    rc, err = run_cli(["--model", str(tmp_path / "file"), "--out", str(tmp_path / "a.mp4")], capsys)
    assert rc == 2 and "is a file; expected a local diffusers-format" in err

    model = tmp_path / "builtin"
    shutil.copytree(BUILTIN_DIR, model)
    (model / "builtin.json").write_text('{"defaults":\n')
    rc, err = run_cli(["--model", str(model), "--out", str(tmp_path / "a.mp4")], capsys)
    assert rc == 2 and f"model description {str(model / 'builtin.json')!r} is not valid JSON" in err

    shutil.copy(BUILTIN_DIR / "builtin.json", model / "builtin.json")
    config = model / "transformer" / "config.json"
    data = json.loads(config.read_text())
    del data["patch_size"]
    config.write_text(json.dumps(data))
    rc, err = run_cli(["--model", str(model), "--out", str(tmp_path / "a.mp4")], capsys)
    assert rc == 2 and f"{str(config)!r} has no 'patch_size'" in err

    config.write_text("not json")
    rc, err = run_cli(["--model", str(model), "--out", str(tmp_path / "a.mp4")], capsys)
    assert rc == 2 and f"transformer config {str(config)!r} is not valid JSON" in err


@pytest.fixture(scope="module")
def saved_mhla(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t") / "mhla"
    model = convert_self_attention(
        build_tiny_transformer(seed=3, num_layers=2), "mhla", options=AttentionOptions(blocks=(1, 2, 2))
    )
    save_transformer(model, folder)
    return folder


def _damaged_copy(saved, tmp_path, change):
    folder = tmp_path / "damaged"
    shutil.copytree(saved, folder)
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS)
    return folder


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t["blocks.1.attn1.mhla.mhla.mixing.weight"].fill_(float("nan")), "hold NaN or inf"),
        (lambda t: t["blocks.0.attn1.to_q.weight"].view(-1)[7:9].fill_(float("inf")), "hold NaN or inf"),
        (lambda t: t.update({"blocks.0.attn1.to_q.bias": t["blocks.0.attn1.to_q.bias"].long()}), "non-float"),
    ],
)
def test_non_finite_or_integer_weights_are_refused_at_load(saved_mhla, tmp_path, change, message, capsys):
    folder = _damaged_copy(saved_mhla, tmp_path, change)
    with pytest.raises(ValueError, match=message):
        load_transformer(folder, dtype="float32", device="cpu")
    out = tmp_path / "a.mp4"
    rc, err = run_cli(["--transformer", str(folder), "--out", str(out)], capsys)
    assert rc == 2 and message in err and not out.exists()


@pytest.mark.parametrize("damage", ["empty", "text", "truncated"])
def test_unreadable_weight_files_are_named(saved_mhla, tmp_path, damage):
    folder = tmp_path / "bad"
    shutil.copytree(saved_mhla, folder)
    file = folder / WEIGHTS
    if damage == "empty":
        file.write_bytes(b"")
    elif damage == "text":
        file.write_text("this is not a safetensors file")
    else:
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{str(file)!r}.*is not a readable safetensors file"):
        load_transformer(folder, dtype="float32", device="cpu")


@pytest.mark.slow  # generates with the tiny model
def test_latents_that_turn_non_finite_stop_generation_without_a_video(
    saved_mhla, tmp_path, capsys, monkeypatch, tiny_components
):
    components = tiny_components
    original = components.transformer.forward

    def overflowing(*args, **kwargs):
        out = original(*args, **kwargs)
        out[0].fill_(float("inf"))  # as an overflowing layer would
        return out

    monkeypatch.setattr(components.transformer, "forward", overflowing)
    with pytest.raises(gen.NonFiniteLatentsError, match="NaN or inf at denoising step 1 of 2"):
        request = gen.GenerationRequest(prompt="a fox", height=64, width=96, num_frames=9, num_inference_steps=2)
        gen.generate(components, request, show_progress=False)
    monkeypatch.setattr(gen, "load_components", lambda *a, **k: components, raising=False)
    monkeypatch.setattr("pipelines.loading.load_components", lambda *a, **k: components)
    out = tmp_path / "black.mp4"
    rc, err = run_cli(["--variant", "flash", "--steps", "2", "--out", str(out)], capsys)
    assert rc == 3 and "no video is written" in err and not out.exists()


def test_video_metadata_is_bounded(tmp_path):
    frames = torch.rand(5, 16, 16, 3).numpy()
    out = write_mp4(tmp_path / "long.mp4", frames, comment="word " * 40_000)  # 200k characters: no E2BIG
    assert read_video(out).shape == (5, 16, 16, 3)
    assert MAX_COMMENT_CHARS <= 2000

"""Issue 30: each command of pipelines/ behind one error boundary. A table of malformed values per entry point
(property-style: non-zero exit, a message, no traceback, pre-existing outputs byte-identical), and the
classes' failing cases: weights that do not match their config, the importer's duplicated weights, a failed
or refused video writer."""

from __future__ import annotations

import json
import re

import pytest

import pipelines.cli as gen
import pipelines.import_official as imp
from tests.boundary import assert_refused


@pytest.fixture(autouse=True)
def quiet_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))


@pytest.fixture
def outputs(tmp_path):
    """An output folder holding a good earlier video, a symlink loop beside it, and a VAE folder."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "video.mp4").write_bytes(b"an earlier, good video")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    vae = tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 16, "patch_size": None}))
    return tmp_path


GENERATE_TABLE = [
    ["--seed", str(2**64)],  # overflowed torch's generator
    ["--seed", "-1"],
    ["--fps", "-8"],  # ffmpeg failed, yet "wrote"
    ["--fps", "0"],  # silently 16 fps
    ["--prompt", "bad \udcff byte"],  # not valid UTF-8 on the command line
    ["--prompt", "a NUL \x00 byte"],
    ["--negative-prompt", "escape \x1b[2J"],
    ["--transformer", "{root}/vae"],  # a VAE folder as a transformer
    ["--out", "{root}/loop_a/x.mp4"],  # inside a symlink loop
    ["--out", "{root}/out/video.txt"],
    ["--variant", "mhla", "--blocks", "9x9x9"],
    ["--variant", "mhla-hybrid", "--layers", "99"],
    ["--variant", "nope"],
    ["--steps", "0"],
    ["--frames", "6"],
    ["--height", "-16"],
    ["--guidance", "nan"],
    ["--model", "/no/such/model"],
    ["--model", "{root}/out/video.mp4"],
    ["--steps", "two"],
    ["--device", "bogus"],
    ["--device", "meta"],  # issue 39: an "unexpected failure"
    ["--dtype", "float8"],
]


@pytest.mark.parametrize("extra", GENERATE_TABLE, ids=[" ".join(a)[:40] for a in GENERATE_TABLE])
def test_generate_refuses_malformed_values(extra, outputs, capsys):
    argv = ["--model", "tiny-random", "--prompt", "a fox", "--no-progress", "--out", f"{outputs}/out/video.mp4"]
    argv += [a.replace("{root}", str(outputs)) for a in extra]
    assert_refused(gen.main, argv, capsys, outputs)


IMPORT_TABLE = [
    ["--checkpoint", "/no/such.safetensors"],
    ["--grid", "1.5x2x3"],
    ["--grid", "21x30"],
    ["--components", "move"],
    ["--checkpoint", "{root}/out/video.mp4"],  # not a checkpoint
]


@pytest.mark.parametrize("extra", IMPORT_TABLE, ids=[" ".join(a)[:40] for a in IMPORT_TABLE])
def test_import_official_refuses_malformed_values(extra, outputs, capsys):
    argv = ["--checkpoint", f"{outputs}/out/video.mp4", "--base", f"{outputs}/vae", "--out", f"{outputs}/out"]
    extra = [a.replace("{root}", str(outputs)) for a in extra]
    for i in range(0, len(extra), 2):
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i : i + 2]
    assert_refused(imp.main, argv, capsys, outputs)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    from pipelines.loading import save_transformer
    from pipelines.model import convert_self_attention
    from pipelines.tiny import build_tiny_transformer

    folder = tmp_path_factory.mktemp("tiny") / "transformer"
    save_transformer(convert_self_attention(build_tiny_transformer(num_layers=2), "flash"), folder)
    return folder


@pytest.mark.parametrize(
    "change,message",
    [
        (
            -1,
            r"the number of layers differs: 1 in config.json \(num_layers\), 2 in the weights \(blocks.0 to blocks.1\)",
        ),
        (+1, r"the number of layers differs: 3 in config.json \(num_layers\), 2 in the weights"),
    ],
)
def test_a_config_that_does_not_match_its_weights_is_refused_naming_keys(saved_tiny, tmp_path, change, message, capsys):
    """Class 4: a config.json saying fewer layers than its weights loaded with layers silently dropped; more
    layers ended in NotImplementedError from meta tensors. Issue 39: the message listed missing keys without
    saying that the layer count is what differs; it says "layers", N in config vs M in the weights."""
    import shutil

    folder = tmp_path / "t"
    shutil.copytree(saved_tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_layers"] += change
    (folder / "config.json").write_text(json.dumps(config))
    from pipelines.loading import load_transformer

    with pytest.raises(ValueError, match=message):
        load_transformer(folder)
    out = tmp_path / "x.mp4"
    argv = ["--model", "tiny-random", "--transformer", str(folder), "--prompt", "a fox", "--out", str(out)]
    err = assert_refused(gen.main, ["--no-progress", *argv], capsys, tmp_path)
    assert re.search(message, err) and not out.exists()


def test_a_weight_missing_in_a_layer_is_named_by_its_key(saved_tiny, tmp_path):
    """The same layer count with one weight gone: the key-level message names it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipelines.loading import load_transformer

    folder = tmp_path / "t"
    shutil.copytree(saved_tiny, folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    gone = next(k for k in sorted(tensors) if k.startswith("blocks.1.ffn"))
    del tensors[gone]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"promises are missing: {re.escape(gone)}"):
        load_transformer(folder)


@pytest.mark.parametrize(
    "config",
    [
        {"_class_name": "AutoencoderKLWan", "z_dim": 16, "base_dim": 96},  # Wan2.1's VAE
        {"_class_name": "AutoencoderKLWan", "z_dim": 48, "patch_size": 2, "in_channels": 12},  # Wan2.2's
    ],
)
def test_a_vae_folder_as_transformer_says_patch_size_and_attention_are_missing(config, tmp_path, capsys):
    """Issue 39, class 4: the refusal did not say what a transformer's config has that a VAE's lacks."""
    vae = tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps(config))
    argv = ["--model", "tiny-random", "--transformer", str(vae), "--prompt", "a fox", "--out", str(tmp_path / "x.mp4")]
    err = assert_refused(gen.main, ["--no-progress", *argv], capsys, tmp_path)
    assert "a VAE's config" in err and "patch_size" in err and "attention config" in err, err


def test_weights_stored_twice_in_shards_are_refused(saved_tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from pipelines.loading import load_transformer

    folder = tmp_path / "t"
    shutil.copytree(saved_tiny, folder)
    weights = load_file(folder / "diffusion_pytorch_model.safetensors")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    keys = sorted(weights)
    shards = {"a.safetensors": dict(weights), "b.safetensors": {keys[0]: weights[keys[0]]}}
    for name, tensors in shards.items():
        save_file(tensors, folder / name)
    weight_map = {**{k: "a.safetensors" for k in keys}, "x": "b.safetensors"}  # b: the second copy of keys[0]
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"stored twice: {keys[0]}"):
        load_transformer(folder)


def test_the_importer_refuses_a_weight_stored_with_and_without_a_wrapper_prefix():
    """Class 4: ``module.x`` beside ``x`` (two different copies): the importer took one without a word."""
    with pytest.raises(ValueError, match=r"stores 1 weight\(s\) twice .*'module.blocks.0.self_attn.q.weight'"):
        imp._strip_wrappers(["blocks.0.self_attn.q.weight", "module.blocks.0.self_attn.q.weight", "head.weight"])
    assert imp._strip_wrappers(["module.a", "b"]) == {"a": "module.a", "b": "b"}


@pytest.mark.slow  # starts the CLI
def test_a_failing_video_writer_is_an_error_never_wrote(tmp_path, monkeypatch, capsys):
    """Class 2: ffmpeg failing (here: producing no file) printed 'wrote x.mp4' and exited 0."""
    import imageio.v2 as imageio

    class Silent:  # a writer that fails without raising, as ffmpeg did at --fps -8
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def append_data(self, frame):
            pass

    monkeypatch.setattr(imageio, "get_writer", Silent)
    out = tmp_path / "x.mp4"
    argv = ["--model", "tiny-random", "--prompt", "a fox", "--no-progress", "--variant", "flash", "--out", str(out)]
    argv += ["--steps", "1", "--frames", "5", "--height", "32", "--width", "32"]
    rc = gen.main(argv)
    captured = capsys.readouterr()
    assert rc == 4 and "produced no file" in captured.err and "wrote" not in captured.out
    assert not out.exists() and not list(tmp_path.glob(".*"))  # no temporary left either


@pytest.mark.slow  # generates a video through the CLI
def test_a_full_disk_fails_generate_with_exit_4_and_keeps_the_earlier_video(tmp_path, capsys):
    """Issue 39, class 1: on a full disk (a small tmpfs) the CLI printed "wrote" with exit 0 and the earlier
    mp4 was replaced by an unreadable 12 KB file."""
    from common.video import read_video, write_mp4
    from tests.fulldisk import full_disk

    with full_disk(tmp_path / "disk") as disk:
        out = disk.root / "x.mp4"
        write_mp4(out, [[[[0, 0, 0]] * 32] * 32] * 5)
        before = out.read_bytes()
        disk.fill(free=12_000)  # about half of what this video needs (23 KB): ffmpeg starts, then runs out
        argv = ["--model", "tiny-random", "--prompt", "a fox", "--no-progress", "--variant", "flash"]
        argv += ["--out", str(out), "--steps", "1", "--frames", "9", "--height", "64", "--width", "64"]
        rc = gen.main(argv)
        captured = capsys.readouterr()
        assert rc == 4, captured.err
        assert "wrote" not in captured.out and "unexpected failure" not in captured.err
        last = captured.err.strip().splitlines()[-1]
        assert last.startswith("error: ") and str(out) in last
        assert out.read_bytes() == before and disk.files() == ["x.mp4"]
        assert len(read_video(out)) == 5

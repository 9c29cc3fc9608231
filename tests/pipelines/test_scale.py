"""Issue 32: the generation CLI's ``--offload``, ``--vae-tiling``, ``--context-parallel`` and ``--cp-degree``
(pipelines/scale.py): refused before any model loads when they cannot run, and run end to end (tiny model):
offloaded and context-parallel videos equal the plain single-process video."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pipelines.cli as gen
import pipelines.loading
from pipelines.request import GenerationRequest
from pipelines.scale import Scale, check_scale
from tests.boundary import assert_refused

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-random", "--prompt", "a red fox", "--no-progress", "--steps", "2"]


@pytest.fixture(autouse=True)
def quiet_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))


@pytest.fixture
def no_loading(monkeypatch):
    """A refusal must come before any model loads: loading fails the test."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the bad flag was refused")

    monkeypatch.setattr(pipelines.loading, "load_components", refuse)


CLI_TABLE = [
    (["--offload", "disk"], "invalid choice: 'disk'"),
    (["--cp-degree", "2"], "--cp-degree 2: applies with --context-parallel"),
    (["--context-parallel", "zigzag"], "invalid choice: 'zigzag'"),
]


@pytest.mark.parametrize("extra,message", CLI_TABLE, ids=[" ".join(a) for a, _ in CLI_TABLE])
def test_scale_flags_are_refused_before_loading(extra, message, tmp_path, capsys, no_loading):
    err = assert_refused(gen.main, [*TINY, "--out", f"{tmp_path}/v.mp4", *extra], capsys, tmp_path)
    assert message in err


@pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="this process was started by torchrun")
def test_context_parallel_without_torchrun_is_refused_before_loading(tmp_path, capsys, no_loading):
    argv = [*TINY, "--variant", "mhla", "--out", f"{tmp_path}/v.mp4", "--context-parallel", "ring"]
    err = assert_refused(gen.main, argv, capsys, tmp_path)
    assert "started by torchrun (torchrun --nproc-per-node N -m pipelines.cli" in err
    assert "single process" in err


def _args(**kw) -> argparse.Namespace:
    base = dict(offload="none", vae_tiling=False, context_parallel="ring", cp_degree=None)
    return argparse.Namespace(**{**base, **kw})


def _requests(*variants: str, grid=(3, 4, 6)) -> list[GenerationRequest]:
    return [GenerationRequest(prompt="a fox", variant=v, grid=grid) for v in variants]


ENV2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
SCALE_TABLE = [
    # (args, variants, env, grid, heads, message)
    (dict(), ("flash",), ENV2, (3, 4, 6), 2, "variant 'flash' has softmax self-attention layers"),
    (dict(), ("mhla", "mhla-hybrid"), ENV2, (3, 4, 6), 2, "variant 'mhla-hybrid' has softmax"),
    (dict(context_parallel="ulysses"), ("mhla",), {**ENV2, "WORLD_SIZE": "4"}, (3, 4, 6), 2, "2 attention heads"),
    (dict(), ("mhla",), ENV2, (3, 3, 5), 2, "the video's 45 tokens (3x3x5) do not divide by 2"),
    (dict(cp_degree=4), ("mhla",), ENV2, (3, 4, 6), 2, "--cp-degree 4: expected the number of processes"),
    (dict(offload="group"), ("mhla",), ENV2, (3, 4, 6), 2, "--offload group with --context-parallel ring"),
    (dict(), ("mhla",), {"WORLD_SIZE": "1", "RANK": "0"}, (3, 4, 6), 2, "torchrun started 1 process"),
    (dict(), ("mhla",), {"WORLD_SIZE": "two", "RANK": "0"}, (3, 4, 6), 2, "WORLD_SIZE='two'"),
]


@pytest.mark.parametrize("kw,variants,env,grid,heads,message", SCALE_TABLE)
def test_context_parallel_settings_that_cannot_run_are_named(kw, variants, env, grid, heads, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_scale(_args(**kw), _requests(*variants, grid=grid), torch.device("cpu"), heads, env)


def test_context_parallel_settings_that_can_run_pass():
    scale = check_scale(_args(), _requests("linear", "mhla"), torch.device("cpu"), 2, ENV2)
    assert (scale.context_parallel, scale.degree, scale.rank, scale.world, scale.main) == ("ring", 2, 1, 2, False)
    # softmax layers ring on a GPU (diffusers' backends that return the log-sum-exp); Ulysses runs them anywhere
    check_scale(_args(), _requests("flash"), torch.device("cuda"), 2, ENV2)
    check_scale(_args(context_parallel="ulysses"), _requests("flash", "mhla-hybrid"), torch.device("cpu"), 2, ENV2)
    assert check_scale(_args(context_parallel=None, offload="group"), [], torch.device("cpu"), 2, {}).offload == "group"


def _frames(path: Path) -> np.ndarray:
    return np.load(path)


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
@pytest.mark.parametrize("mode", ["group", "sequential"])
def test_the_cli_offloads_and_tiles_and_gives_the_plain_video(mode, tmp_path, capsys):
    """Two variants in one call (the second conversion adds MHLA's parameters under the hooks)."""
    small = ["--frames", "5", "--height", "32", "--width", "32", "--variant", "linear,mhla"]
    assert gen.main([*TINY, *small, "--out", f"{tmp_path}/a.mp4", "--frames-npy", f"{tmp_path}/a.npy"]) == 0
    argv = [*TINY, *small, "--out", f"{tmp_path}/b.mp4", "--frames-npy", f"{tmp_path}/b.npy", "--offload", mode]
    assert gen.main([*argv, "--vae-tiling"]) == 0
    out = capsys.readouterr().out
    assert f"offload {mode}" in out and "VAE tiling" in out
    for v in ("linear", "mhla"):
        a, b = _frames(tmp_path / f"a_{v}.npy"), _frames(tmp_path / f"b_{v}.npy")
        assert a.shape == (5, 32, 32, 3) and a.dtype == np.float32
        np.testing.assert_array_equal(b, a)  # 32 px: within one 256 px tile, tiling changes nothing


@pytest.mark.slow  # three CLI runs of two generations each, about 30 s; the meta check below is the fast guard
@pytest.mark.parametrize("mode", ["model", "group", "sequential"])
def test_both_experts_of_a_two_expert_model_run_under_the_hooks(mode, tmp_path, capsys):
    """Wan2.2-A14B: the low-noise expert is hooked and converted under the hooks like the first (sequential
    offloading keeps weights on meta, so a conversion there outside the hooks would build meta parameters), with
    its own hybrid split; the video equals the un-hooked one."""
    from pipelines.tiny import save_tiny_model

    model = save_tiny_model("wan2.2-t2v-a14b", tmp_path / "a14b", seed=0, num_layers=3)
    small = ["--model", str(model), "--prompt", "a red fox", "--no-progress", "--steps", "2", "--frames", "5"]
    small += ["--height", "32", "--width", "32", "--variant", "mhla-hybrid", "--layers", "1", "--layers-2", "0,2"]
    assert gen.main([*small, "--out", f"{tmp_path}/a.mp4", "--frames-npy", f"{tmp_path}/a.npy"]) == 0
    argv = [*small, "--out", f"{tmp_path}/b.mp4", "--frames-npy", f"{tmp_path}/b.npy", "--offload", mode]
    assert gen.main(argv) == 0
    assert f"offload {mode}" in capsys.readouterr().out
    a, b = _frames(tmp_path / "a.npy"), _frames(tmp_path / "b.npy")
    assert np.isfinite(a).all() and a.shape == (5, 32, 32, 3)
    np.testing.assert_allclose(b, a, atol=1e-6)


def test_sequential_offload_holds_the_second_experts_weights_and_its_new_ones_off_the_device(tmp_path):
    """Between calls, sequential offloading keeps weights on ``meta`` (the hooks bring them in): the second expert's
    too, and the MHLA parameters its conversion adds under the hooks (on this CPU an unhooked expert would run just
    the same, so the video alone cannot tell)."""
    from pipelines.loading import load_components
    from pipelines.scale import Scale
    from pipelines.tiny import save_tiny_model

    components = load_components(save_tiny_model("wan2.2-t2v-a14b", tmp_path / "a14b", num_layers=3), device="cpu")
    scale = Scale(offload="sequential")
    scale.attach(components, torch.device("cpu"))
    for expert in (components.transformer, components.transformer_2):
        assert {p.device.type for p in expert.parameters()} == {"meta"}
    request = GenerationRequest(prompt="a red fox", variant="mhla-hybrid", layers=[1], layers_2=[0, 2])
    request = request.with_defaults(components.defaults).check((1, 2, 2), (4, 8, 8))
    with scale.running(components, request, components.transformer, None):  # converted as generate() would
        for expert, layers in ((components.transformer, [1]), (components.transformer_2, [0, 2])):
            mhla = [n for n, _ in expert.named_parameters() if ".attn1.mhla." in n]
            assert sorted({int(n.split(".")[1]) for n in mhla}) == layers
            assert {p.device.type for p in expert.parameters()} == {"meta"}


def _generate(argv: list[str], tmp_path: Path, procs: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MHLA_LOG_DIR": str(tmp_path / "logs")}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    if procs > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
        cmd = [*launch, "-m", "pipelines.cli", *argv]
    else:
        cmd = [sys.executable, "-m", "pipelines.cli", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # three launches of the tiny model, two of them 2 processes: about 40 s on a busy 2-core CPU
def test_torchrun_context_parallel_video_equals_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m pipelines.cli ... --context-parallel ring|ulysses`` on the tiny model,
    linear and MHLA in one call (the second conversion's processors get the parallel config too): the frames equal
    the single-process frames to float32 tolerance (ring: the block summaries are summed in another order, measured
    3e-6; Ulysses: the same arithmetic per head, measured 0). Only process 0 writes and prints."""
    base = [*TINY, "--variant", "linear,mhla"]
    one = _generate([*base, "--out", f"{tmp_path}/one.mp4", "--frames-npy", f"{tmp_path}/one.npy"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    for mode in ("ring", "ulysses"):
        argv = [*base, "--out", f"{tmp_path}/{mode}.mp4", "--frames-npy", f"{tmp_path}/{mode}.npy"]
        run = _generate([*argv, "--context-parallel", mode], tmp_path, procs=2)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"context parallel: {mode} over 2 processes" in run.stdout
        assert run.stdout.count("wrote ") == 2  # process 0 only, once per variant
        for v in ("linear", "mhla"):
            a, b = _frames(tmp_path / f"one_{v}.npy"), _frames(tmp_path / f"{mode}_{v}.npy")
            assert a.shape == (9, 64, 96, 3)
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-4, err_msg=f"{mode} {v}")


@pytest.mark.parametrize(
    "mode", [pytest.param("model", marks=pytest.mark.slow), pytest.param("group", marks=pytest.mark.slow), "sequential"]
)
def test_the_image_encoder_runs_under_the_hooks_and_gives_the_plain_video(mode, tmp_path, capsys):
    """Wan2.1-I2V's CLIP image encoder joins the offload hooks like the text encoder (sequential: its weights on
    meta between calls); the video equals the un-hooked one."""
    from PIL import Image

    from pipelines.loading import load_components
    from pipelines.tiny import save_tiny_model

    model = save_tiny_model("wan2.1-i2v", tmp_path / "i2v", seed=0, num_layers=3)
    image = tmp_path / "first.png"
    Image.fromarray((np.arange(32 * 48 * 3).reshape(32, 48, 3) % 251).astype(np.uint8)).save(image)
    small = ["--model", str(model), "--prompt", "a red fox", "--no-progress", "--steps", "2", "--frames", "5"]
    small += ["--height", "32", "--width", "32", "--variant", "mhla", "--image", str(image)]
    assert gen.main([*small, "--out", f"{tmp_path}/a.mp4", "--frames-npy", f"{tmp_path}/a.npy"]) == 0
    assert gen.main([*small, "--out", f"{tmp_path}/b.mp4", "--frames-npy", f"{tmp_path}/b.npy", "--offload", mode]) == 0
    a, b = _frames(tmp_path / "a.npy"), _frames(tmp_path / "b.npy")
    assert np.isfinite(a).all()
    np.testing.assert_allclose(b, a, atol=1e-6)
    if mode == "sequential":
        components = load_components(model, device="cpu")
        Scale(offload="sequential").attach(components, torch.device("cpu"))
        assert {p.device.type for p in components.image_encoder.parameters()} == {"meta"}

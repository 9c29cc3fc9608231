"""Issue 32: the fine-tuning recipe on Wan2.2. Tiny random pipelines of each architecture are saved with
``save_pretrained`` (nothing downloaded) and trained a few steps: TI2V-5B's transformer gets one timestep per
token, an A14B run trains one expert on its own noise levels, loads and writes only that expert, and its
checkpoint drops into the model directory in the expert's place. Bad configs stop in preflight."""

from __future__ import annotations

import contextlib
import hashlib
import math
from pathlib import Path

import pytest
import torch

from pipelines.tiny import TINY_ARCHITECTURES
from tests.boundary import assert_refused
from training import finetune

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "finetune" / "tiny.yaml")
ARCHITECTURES = TINY_ARCHITECTURES  # each one the tiny models have, Wan2.1-I2V's image encoder too
LAYERS = 3  # per expert: mhla-hybrid converts 1 and 2, layer 0 stays softmax


@pytest.fixture(autouse=True)
def quiet_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """architecture -> a model directory written by diffusers' save_pretrained of the tiny pipeline."""
    from pipelines.tiny import build_tiny_pipeline

    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ARCHITECTURES:
        build_tiny_pipeline(arch, num_layers=LAYERS).save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def run_recipe(run_dir: Path, model: Path, *overrides: str) -> None:
    argv = ["--config", TINY, f"run_dir={run_dir}", f"model.path={model}", "log.tensorboard=false"]
    argv += ["data.num_samples=4", "train.batch_size=2", "validation.loss_batches=1", *overrides]
    code = finetune.main(argv)
    assert code == 0, f"finetune exited {code}"


@contextlib.contextmanager
def recorded_calls(monkeypatch):
    """Every transformer forward of the run (training and evaluation): its hidden_states shape and timestep."""
    calls: list[tuple[torch.Size, torch.Tensor]] = []
    build = finetune.build_model

    def spy(*args, **kwargs):
        components, transformer, grid = build(*args, **kwargs)

        def hook(module, args, kwargs):
            calls.append((kwargs["hidden_states"].shape, kwargs["timestep"].detach().clone()))

        transformer.register_forward_pre_hook(hook, with_kwargs=True)
        return components, transformer, grid

    monkeypatch.setattr(finetune, "build_model", spy)
    yield calls


def loaded_transformer_folders(monkeypatch) -> list[str]:
    """The transformer folders the run reads (every load goes through MHLAWanTransformer3DModel.from_pretrained)."""
    from pipelines.model import MHLAWanTransformer3DModel

    seen: list[str] = []
    original = MHLAWanTransformer3DModel.from_pretrained

    def spy(cls, path, *args, **kwargs):
        seen.append(Path(path).name)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(MHLAWanTransformer3DModel, "from_pretrained", classmethod(spy))
    return seen


def metrics(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- fast: no model is trained


def test_per_token_timestep_is_the_pipelines():
    """model_timestep matches WanPipeline(expand_timesteps=True)'s construction for each sample's t, and is t
    itself without expand_timesteps."""
    from training.experts import model_timestep

    latents = torch.zeros(3, 48, 4, 6, 10)
    t = torch.tensor([10.0, 500.0, 990.0])
    got = model_timestep(t, latents, (1, 2, 2), expand_timesteps=True)
    assert got.shape == (3, 4 * 3 * 5)
    mask = torch.ones(latents.shape)
    for i in range(3):  # diffusers' pipeline_wan.py, one sample at a time
        expected = (mask[0][0][:, ::2, ::2] * t[i]).flatten()
        assert torch.equal(got[i], expected)
    assert model_timestep(t, latents, (1, 2, 2), expand_timesteps=False) is t


@pytest.mark.parametrize("weighting", ["logit_normal", "uniform"])
@pytest.mark.parametrize("boundary", [0.875, 0.9])
def test_expert_sigmas_stay_in_the_experts_range(weighting, boundary):
    """Each expert's timesteps lie on its side of boundary_ratio * 1000 (the high-noise transformer at t >= it,
    as WanPipeline switches) and follow the full density truncated to the range (its quantiles match those of
    the full samples that fall in the range)."""
    from training.config import FlowSection
    from training.flow import FlowMatching

    full = FlowMatching(FlowSection(shift=12.0, weighting=weighting)).sample_sigmas(
        100_000, torch.Generator().manual_seed(0)
    )
    for low, high in ((boundary, 1.0), (0.0, boundary)):
        flow = FlowMatching(FlowSection(shift=12.0, weighting=weighting), sigma_range=(low, high))
        x_t, t, _ = flow.noisy_input(torch.zeros(20_000, 1, 1, 1, 1), torch.Generator().manual_seed(1))
        if low > 0:
            assert bool((t >= boundary * 1000).all()), float(t.min())
        else:
            assert bool((t < boundary * 1000).all()), float(t.max())
        sigma = t / 1000
        inside = full[(full >= low) & (full < high)]
        for q in (0.02, 0.5, 0.98):
            assert abs(float(sigma.quantile(q)) - float(inside.quantile(q))) < 0.01, q


def test_the_target_is_read_from_the_model_directory(models):
    from training.config import load_config
    from training.experts import read_target

    def target(arch, *overrides):
        return read_target(load_config(TINY, [f"model.path={models[arch]}", *overrides]).model)

    ti2v = target("wan2.2-ti2v")
    assert (ti2v.expand_timesteps, ti2v.vae_stride, ti2v.experts) == (True, (4, 16, 16), ("transformer",))
    high = target("wan2.2-t2v-a14b", "model.expert=transformer")
    low = target("wan2.2-t2v-a14b", "model.expert=transformer_2")
    assert high.experts == low.experts == ("transformer", "transformer_2")
    assert high.sigma_range == (0.875, 1.0) and low.sigma_range == (0.0, 0.875)
    assert target("wan2.1-t2v").sigma_range == (0.0, 1.0)
    assert read_target(load_config(TINY).model).architecture == "wan2.1-t2v"  # tiny-random


REFUSED = [
    # (architecture, overrides, words the message must hold)
    ("wan2.2-t2v-a14b", [], ["model.expert=None", "transformer_2"]),
    ("wan2.2-ti2v", ["model.expert=transformer_2"], ["model.expert='transformer_2'", "single transformer"]),
    ("wan2.1-t2v", ["model.expert=transformer"], ["model.expert='transformer'", "model.expert=null"]),
    ("wan2.2-ti2v", ["data.height=80"], ["data.height=80", "multiple of 32", "16x"]),
    ("wan2.2-ti2v", ["data.width=112"], ["data.width=112", "multiple of 32"]),
    ("wan2.2-ti2v", ["model.blocks=3x4x4"], ["model.blocks='3x4x4'", "64x96"]),  # the 3x2x3 token grid
    ("wan2.2-t2v-a14b", ["model.expert=transformer", "validation.every=5"], ["validation.every=5", "alone"]),
    ("wan2.2-t2v-a14b", ["model.expert=transformer_2", "validation.probe_every=5"], ["validation.probe_every=5"]),
    ("wan2.2-t2v-a14b", ["model.expert=transformer_3"], ["model.expert='transformer_3'", "transformer_2"]),
    ("wan2.2-i2v", [], ["WanImageToVideoPipeline", "image-to-video is not built"]),
    ("wan2.1-i2v", [], ["WanImageToVideoPipeline", "image-to-video is not built"]),
]


@pytest.mark.parametrize("arch, overrides, words", REFUSED, ids=[" ".join(r[1]) or r[0] for r in REFUSED])
def test_bad_configs_stop_in_preflight_naming_the_value(models, tmp_path, capsys, monkeypatch, arch, overrides, words):
    monkeypatch.setattr(finetune, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    argv = ["--config", TINY, f"run_dir={tmp_path}/run", f"model.path={models[arch]}", "log.tensorboard=false"]
    err = assert_refused(finetune.main, [*argv, "model.blocks=null", *overrides], capsys, tmp_path)
    for word in words:
        assert word in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "finetune").glob("wan2.2-*.yaml")))
def test_shipped_wan22_configs_fit_their_token_grid(models, name):
    """Each Wan2.2 config, pointed at a tiny model of its architecture (same VAE strides and patch), passes
    preflight and trains on the grid and blocks the paper's rule gives (3x10x10-token blocks)."""
    from training.config import load_config
    from training.preflight import check_model_plan, planned_blocks

    arch = "wan2.2-ti2v" if "ti2v" in name else "wan2.2-t2v-a14b"
    cfg = load_config(
        ROOT / "configs" / "finetune" / name, [f"model.path={models[arch]}", "data.path=null", "data.source=synthetic"]
    )
    assert (cfg.train.lr, cfg.train.precision, cfg.train.weight_decay) == (2e-5, "bf16", 0.0)
    check_model_plan(cfg)
    grid, blocks = planned_blocks(cfg.model, cfg.data)
    import mhla

    assert blocks == mhla.default_blocks(grid)
    if arch == "wan2.2-ti2v":
        assert (grid, blocks) == ((31, 22, 40), (10, 2, 4))
        assert cfg.model.expert is None
    else:
        assert (grid, blocks) == ((21, 45, 80), (7, 4, 8))
        assert cfg.model.expert == ("transformer" if name.endswith("-high.yaml") else "transformer_2")
    assert math.prod(blocks) ** 2 <= math.prod(grid)


# --------------------------------------------------------------------------- slow: the recipe runs


@pytest.mark.slow
def test_ti2v_trains_with_a_timestep_per_token(models, tmp_path, monkeypatch):
    from pipelines import load_transformer

    run = tmp_path / "run"
    with recorded_calls(monkeypatch) as calls:
        run_recipe(run, models["wan2.2-ti2v"], "model.blocks=3x1x1", "train.steps=2", "checkpoint.every=2")
    assert calls
    for shape, timestep in calls:
        b, c, f, h, w = shape
        assert c == 48 and (f, h, w) == (3, 64 // 16, 96 // 16)  # the 48-channel VAE's latents, 16x smaller
        assert timestep.shape == (b, f * (h // 2) * (w // 2))  # per token after the (1, 2, 2) patch
        assert bool((timestep == timestep[:, :1]).all())  # text-to-video: every token its clip's timestep
        assert bool((timestep > 0).all() and (timestep < 1000).all())
    losses = [r["loss"] for r in metrics(run) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    saved = run / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == ["transformer"]
    reloaded = load_transformer(saved / "transformer", dtype="float32", device="cpu")
    assert reloaded.conversion.to_config()["variant"] == "mhla" and reloaded.config.in_channels == 48


@pytest.mark.slow
@pytest.mark.parametrize("expert", ["transformer", "transformer_2"])
def test_a14b_trains_one_expert_on_its_range_and_writes_only_it(models, tmp_path, monkeypatch, expert):
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from pipelines import load_transformer
    from pipelines.model import MHLAWanTransformer3DModel

    model_dir = models["wan2.2-t2v-a14b"]
    other = "transformer_2" if expert == "transformer" else "transformer"
    before = tree_digest(model_dir)
    loaded = loaded_transformer_folders(monkeypatch)
    run = tmp_path / "run"
    with recorded_calls(monkeypatch) as calls:
        run_recipe(
            run,
            model_dir,
            f"model.expert={expert}",
            "model.variant=mhla-hybrid",
            "model.layers=[1]" if expert == "transformer" else "model.layers=[1,2]",  # a pattern per expert
            "train.steps=3",
            "checkpoint.every=3",
        )
    assert loaded == [expert]  # the other expert is never read
    assert tree_digest(model_dir) == before  # the model directory is left as it was
    boundary = 0.875 * 1000
    timesteps = torch.cat([t for _, t in calls])
    assert len(calls) >= 3 + 2  # training steps and the evaluations at the start and the end
    if expert == "transformer":
        assert bool((timesteps >= boundary).all()), float(timesteps.min())
    else:
        assert bool((timesteps < boundary).all()), float(timesteps.max())
    losses = [r["loss"] for r in metrics(run) if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)

    saved = run / "checkpoints" / "step-0000003"
    assert (saved / expert).is_dir() and not (saved / other).exists()
    # the trained weights moved away from this expert's, and are far closer to them than to the other expert's
    trained = load_file(saved / expert / "diffusion_pytorch_model.safetensors")
    mine = load_file(model_dir / expert / "diffusion_pytorch_model.safetensors")
    theirs = load_file(model_dir / other / "diffusion_pytorch_model.safetensors")
    shared = [k for k in mine if k in trained]
    moved = sum(float((trained[k] - mine[k]).abs().sum()) for k in shared)
    apart = sum(float((trained[k] - theirs[k]).abs().sum()) for k in shared)
    assert 0 < moved < 0.5 * apart
    # Adam moments exist only for the trained expert's parameters
    state = torch.load(saved / "training_state.pt", weights_only=True)
    n_params = sum(len(g["params"]) for g in state["optimizer"]["param_groups"])
    assert n_params == len(trained)

    reloaded = load_transformer(saved / expert, dtype="float32", device="cpu")
    record = reloaded.conversion.to_config()
    assert record["variant"] == "mhla-hybrid"
    assert record["linear_layers"] == ([1] if expert == "transformer" else [1, 2])
    # it drops into the model directory in its expert's place
    pipe = WanPipeline.from_pretrained(model_dir, **{expert: MHLAWanTransformer3DModel.from_pretrained(saved / expert)})
    assert pipe.config.boundary_ratio == 0.875
    assert getattr(pipe, expert).conversion.to_config()["variant"] == "mhla-hybrid"
    assert getattr(pipe, other).conversion.to_config()["variant"] == "flash"


@pytest.mark.slow
def test_an_expert_run_resumes_exactly_and_refuses_the_other_expert(models, tmp_path, capsys, monkeypatch):
    model_dir = models["wan2.2-t2v-a14b"]
    common = ["model.expert=transformer_2", "model.blocks=3x2x2", "log.param_digest=true", "checkpoint.every=1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(straight, model_dir, *common, "train.steps=3")
    run_recipe(resumed, model_dir, *common, "train.steps=2")
    run_recipe(resumed, model_dir, *common, "train.steps=3", "resume=latest")
    digest = [(r / "param_digest" / "rank0.txt").read_text() for r in (straight, resumed)]
    assert digest[0] == digest[1]
    capsys.readouterr()
    monkeypatch.setattr(finetune, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    argv = ["--config", TINY, f"run_dir={resumed}", f"model.path={model_dir}", "log.tensorboard=false"]
    argv += ["data.num_samples=4", "train.batch_size=2", *common[1:], "model.expert=transformer", "resume=latest"]
    err = assert_refused(finetune.main, [*argv, "train.steps=4"], capsys, tmp_path)
    assert "model.expert was 'transformer_2', now 'transformer'" in err


@pytest.mark.slow
def test_ti2v_trains_from_a_precomputed_cache_and_a_cache_of_another_vae_is_refused(models, tmp_path, capsys):
    """training.precompute writes the 48-channel latents of TI2V's VAE; the recipe trains from them. The same
    cache for the Wan2.1 model (16 channels at 8x) is refused in preflight, naming the folder and both shapes."""
    from safetensors.torch import load_file

    from training import precompute

    cache = tmp_path / "cache"
    ti2v = ["--config", TINY, f"model.path={models['wan2.2-ti2v']}", "data.num_samples=2"]
    assert precompute.main([*ti2v, "--out", str(cache)]) == 0
    latents = load_file(cache / "sample_0000000.safetensors")["latents"]
    assert latents.shape == (48, 3, 64 // 16, 96 // 16)
    run_recipe(tmp_path / "run", models["wan2.2-ti2v"], "data.source=cache", f"data.path={cache}", "train.steps=1")
    capsys.readouterr()
    argv = ["--config", TINY, f"run_dir={tmp_path}/other", f"model.path={models['wan2.1-t2v']}"]
    argv += ["data.source=cache", f"data.path={cache}", "log.tensorboard=false"]
    err = assert_refused(finetune.main, argv, capsys, tmp_path)
    assert f"data.path={str(cache)!r}" in err and "(48, 3, 4, 6)" in err and "(16, 3, 8, 12)" in err

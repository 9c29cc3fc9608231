"""The fine-tuning recipe on the tiny random-weight model, on CPU: it learns, resumes exactly, runs on two
processes, keeps the mixing valid, stops cleanly on bad losses and rejects bad configs."""

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training import checkpoint as ckpt
from training.config import load_config

pytestmark = pytest.mark.slow  # trains the tiny recipe, starts processes

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "finetune" / "tiny.yaml")
QUIET = ["log.tensorboard=false"]


def in_process(main, argv):
    """Run a command's ``main(argv)`` in this process, from the repository root, as its subprocess would:
    its exit code and what it printed (no interpreter start-up per call)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with warnings.catch_warnings(record=True) as caught:  # printed to stderr, as a process would
            warnings.simplefilter("always")
            code = main(argv)
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue() + shown)


def finetune(run_dir, *overrides, launcher=None, check=True):
    """The recipe on the tiny config; in this process unless a ``launcher`` starts several processes."""
    argv = ["--config", TINY, f"run_dir={run_dir}", *QUIET, *overrides]
    if launcher:
        cmd = [*launcher, str(ROOT / "training" / "finetune.py"), *argv]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    else:
        from training.finetune import main

        proc = in_process(main, argv)
    if check and proc.returncode != 0:
        raise AssertionError(f"finetune failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def precompute(*argv):
    from training.precompute import main

    return in_process(main, ["--config", TINY, *argv])


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def digest(run_dir, rank=0):
    return (Path(run_dir) / "param_digest" / f"rank{rank}.txt").read_text()


def test_tiny_recipe_learns_and_its_checkpoint_generates(tmp_path):
    run = tmp_path / "run"
    finetune(run, "train.steps=16", "checkpoint.every=8", "validation.every=16", "log.tensorboard=true")
    assert list(run.rglob("events.out.tfevents.*"))  # TensorBoard scalars
    import imageio.v3 as iio

    assert iio.imread(run / "validation" / "step-0000016" / "prompt0_seed0.mp4").shape == (9, 64, 96, 3)
    rows = metrics(run)
    held = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(held) == 2 and held[1] < 0.9 * held[0], held  # fixed batches and noise: a real drop
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 17))
    assert all(r["lr"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    found = ckpt.list_checkpoints(run)
    assert [p.name for p in found] == ["step-0000008", "step-0000016"]
    out = tmp_path / "ft.mp4"
    from pipelines.cli import main as generate_main

    gen = in_process(
        generate_main,
        [
            "--prompt",
            "a red circle moves to the left",
            "--model",
            "tiny-random",
            "--transformer",
            str(found[-1] / "transformer"),
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert gen.returncode == 0, gen.stderr
    assert "variant                mhla" in gen.stdout  # the checkpoint's own variant
    assert iio.imread(out).shape == (9, 64, 96, 3)


def test_kill_and_resume_gives_the_same_parameters(tmp_path):
    steps = ["train.steps=12", "checkpoint.every=3", "log.param_digest=true"]
    finetune(tmp_path / "straight", *steps)

    run = tmp_path / "killed"
    cmd = [sys.executable, str(ROOT / "training" / "finetune.py"), "--config", TINY, f"run_dir={run}", *QUIET, *steps]
    # the same intra-op thread count as this process's straight and resumed runs: a reduction split over another
    # number of threads sums in another order (a CI run failed here once its pytest process ran with another)
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / "step-0000006").exists():
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up, possibly mid-checkpoint
    proc.wait()
    done = ckpt.list_checkpoints(run)
    assert done and int(done[-1].name[5:]) < 12, "the run was meant to be killed before finishing"
    finetune(run, *steps, "resume=latest")
    assert digest(run) == digest(tmp_path / "straight")
    logged = [r["step"] for r in metrics(run) if "loss" in r]
    assert logged == list(range(1, 13))  # steps logged after the checkpoint and redone appear once


def test_two_process_ddp_on_cpu_stays_in_step(tmp_path):
    run = tmp_path / "ddp"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517"]
    finetune(run, "train.steps=3", "checkpoint.every=3", "log.param_digest=true", launcher=launcher)
    assert digest(run, 0) == digest(run, 1)
    final = ckpt.list_checkpoints(run)[-1]
    data = [ckpt.load_state(final / f"rank{r}.pt")["data"] for r in (0, 1)]
    assert data[0]["world_size"] == 2 and data[0]["samples_consumed"] == data[1]["samples_consumed"] == 6


def test_mixing_stays_valid_under_a_huge_learning_rate(tmp_path):
    run = tmp_path / "mix"
    finetune(
        run,
        "train.steps=3",
        "train.trainable=new",
        "train.lr=10",
        "train.mixing_lr=100",
        "train.warmup_steps=1",
        "train.grad_clip=0",
        "checkpoint.every=3",
    )
    from safetensors.torch import load_file

    weights = load_file(ckpt.list_checkpoints(run)[-1] / "transformer" / "diffusion_pytorch_model.safetensors")
    mixing = {k: v for k, v in weights.items() if k.endswith("mixing.weight")}
    assert len(mixing) == 30
    moved = 0
    from mhla import BlockLayout, locality_init

    init = locality_init(BlockLayout((3, 4, 6), (3, 2, 2))).float()
    for m in mixing.values():
        assert (m >= 0).all() and (m <= 1).all()
        torch.testing.assert_close(m.sum(1), torch.ones(m.shape[0]))
        moved += not torch.allclose(m, init, atol=1e-3)
    assert moved > 0  # the huge steps did change the coefficients


def test_attention_transfer_trains_only_converted_attention(tmp_path):
    run = tmp_path / "transfer"
    finetune(run, "transfer.steps=3", "train.steps=1", "checkpoint.every=3", "checkpoint.keep=0")
    rows = [r for r in metrics(run) if r.get("stage") == "transfer"]
    assert len(rows) == 3 and rows[-1]["loss"] < rows[0]["loss"]
    from safetensors.torch import load_file

    from pipelines.tiny import build_tiny_transformer

    after = load_file(ckpt.checkpoint_dir(run, 3) / "transformer" / "diffusion_pytorch_model.safetensors")
    base = build_tiny_transformer(seed=2).state_dict()  # the tiny model's transformer (load_components seed 0 + 2)
    changed = {k for k, v in base.items() if not torch.equal(v, after[k])}
    assert changed and all(".attn1." in k for k in changed)
    assert any(".attn1.to_q." in k for k in changed)


def test_nonfinite_losses_stop_the_run_and_keep_the_checkpoint(tmp_path):
    run = tmp_path / "nan"
    proc = finetune(
        run,
        "train.steps=20",
        "train.lr=1e20",
        "train.warmup_steps=1",
        "train.grad_clip=0",
        "train.max_nonfinite=3",
        "checkpoint.every=1",
        check=False,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "non-finite losses in a row" in proc.stdout + proc.stderr
    last = ckpt.list_checkpoints(run)[-1]
    assert ckpt.load_state(last / ckpt.STATE_FILE)["step"] >= 1
    assert not list((run / "checkpoints").glob(".*tmp"))  # nothing half-written left behind


def test_precomputed_cache_trains(tmp_path):
    cache = tmp_path / "cache"
    pre = precompute("--out", str(cache), "data.num_samples=4")
    assert pre.returncode == 0, pre.stderr
    index = json.loads((cache / "index.json").read_text())
    assert len(index["items"]) == 4 and index["video"] == [9, 64, 96]
    finetune(
        tmp_path / "run",
        "data.source=cache",
        f"data.path={cache}",
        "data.num_samples=4",
        "train.steps=2",
        "checkpoint.every=0",
    )
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1, 2]
    again = precompute("--out", str(cache), "data.num_samples=4", "data.short_captions=0.5")
    assert again.returncode == 2 and "holds a cache written with other settings" in again.stderr
    assert "data.short_captions: 0.0 -> 0.5" in again.stderr


def test_precompute_in_batches_writes_what_one_by_one_writes_and_an_interrupted_run_fills_only_the_gaps(tmp_path):
    from safetensors.torch import load_file

    one, many = tmp_path / "one", tmp_path / "many"
    assert precompute("--out", str(one), "--batch-size", "1", "data.num_samples=5").returncode == 0
    assert precompute("--out", str(many), "--batch-size", "3", "data.num_samples=5").returncode == 0
    listed = [  # the same files and captions (their checksums differ: latents encoded in another batch, see below)
        [
            {k: v for k, v in item.items() if k != "sha256"}
            for item in json.loads((d / "index.json").read_text())["items"]
        ]
        for d in (one, many)
    ]
    assert listed[0] == listed[1]
    for i in range(5):
        a, b = load_file(str(one / f"sample_{i:07d}.safetensors")), load_file(str(many / f"sample_{i:07d}.safetensors"))
        torch.testing.assert_close(b["latents"], a["latents"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b["text"], a["text"], rtol=1e-4, atol=1e-5)
    # an interrupted run: two samples missing, the others marked so a rewrite would show
    kept = many / "sample_0000000.safetensors"
    before = kept.stat().st_mtime_ns
    for i in (1, 3):
        (many / f"sample_{i:07d}.safetensors").unlink()
    (many / "index.json").unlink()
    assert precompute("--out", str(many), "--batch-size", "2", "data.num_samples=5").returncode == 0
    assert kept.stat().st_mtime_ns == before  # written once
    for i in (1, 3):
        a, b = load_file(str(one / f"sample_{i:07d}.safetensors")), load_file(str(many / f"sample_{i:07d}.safetensors"))
        torch.testing.assert_close(b["latents"], a["latents"], rtol=1e-4, atol=1e-5)
    assert len(json.loads((many / "index.json").read_text())["items"]) == 5
    bad = precompute("--out", str(tmp_path / "bad"), "--batch-size", "0")
    assert bad.returncode == 2 and "--batch-size 0" in bad.stderr and not (tmp_path / "bad").exists()
    from training.precompute import auto_batch

    # the default: 16 of the built-in model's clips, one Wan2.1 81-frame 480p clip (a batch would not fit a GPU)
    assert auto_batch(9, 64, 80) == 16 and auto_batch(81, 480, 832) == 1 and auto_batch(17, 128, 160) == 2


def test_lora_checkpoint_is_merged_into_the_pipeline_format(tmp_path):
    from peft import LoraConfig

    from pipelines import convert_self_attention, load_transformer
    from pipelines.tiny import build_tiny_transformer
    from training.finetune import save_model_for_pipeline

    model = convert_self_attention(build_tiny_transformer(seed=3, num_layers=3), "mhla", options=None)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a LoRA that does something
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 3, 8, 12, generator=g)
    text = torch.randn(1, 8, 32, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        expected = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    save_model_for_pipeline(model, tmp_path / "merged", lora=True)
    loaded = load_transformer(tmp_path / "merged", dtype=torch.float32, device="cpu")
    assert not any("lora" in k for k in loaded.state_dict())
    with torch.no_grad():
        got = loaded(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.stpes=5", "stpes"),
        ("data.num_frames=10", "data.num_frames=10: expected 4k+1"),
        ("data.source=folder", "data.path=None: expected a folder"),
        ("train.trainable=some", "train.trainable='some'"),
        ("model.path=/no/such/dir", "model.path='/no/such/dir'"),
        ("train.lr_schedule=step", "train.lr_schedule='step': expected one of"),
        ("data.default_background=pink", "data.default_background='pink': expected null or one of"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio=2: expected a value >= 0 and <= 1"),
        ("train.lr=-1", "train.lr=-1: expected a value > 0"),
        ("train.lr=abc", "train.lr='abc': expected a number"),
        ("train.steps=abc", "train.steps='abc': expected an integer"),
        ("train.steps=2.5", "train.steps=2.5: expected an integer"),
        ("train.grad_clip=true", "train.grad_clip=True: expected a number"),
        ("log.tensorboard=3", "log.tensorboard=3: expected true or false"),
        ("model.layers=[1,x]", "model.layers=[1, 'x']: expected a list of integers"),
        ("model.variant=softmax", "model.variant='softmax': expected one of"),
        ("data.short_captions=2", "data.short_captions=2: expected a value >= 0 and <= 1"),
        ("resume=/no/such/checkpoint", "resume='/no/such/checkpoint': expected null, 'latest' or a checkpoint"),
        ("train.ema_decay=1", "train.ema_decay=1: expected a decay in [0, 1)"),
        ("train.ema_decay=-0.5", "train.ema_decay=-0.5: expected a value >= 0"),
    ],
)
def test_bad_config_is_rejected_before_work(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(TINY, [override])


def test_malformed_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1\n")
    with pytest.raises(ValueError, match=re.escape(f"config file {str(bad)!r} is not valid YAML")):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(bad)


def test_cosine_schedule_and_a_resumed_run_follows_the_longer_schedule():
    from training.config import lr_multiplier

    f = lr_multiplier("cosine", 10, 110, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(59) == pytest.approx(0.55) and f(109) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(9, 200))
    assert {lr_multiplier("constant", 10, 110, 0.1)(s) for s in range(9, 300)} == {1.0}

    def scheduler(total):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier("cosine", 10, total, 0.1))

    opt, sched = scheduler(110)
    for _ in range(50):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2, sched2 = scheduler(1010)  # the same run resumed with train.steps grown to 1010
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(2.0 * lr_multiplier("cosine", 10, 1010, 0.1)(51))


def test_a_resumed_run_takes_a_changed_lr_and_keeps_its_place_and_moments():
    from training.checkpoint import restore_optimizer
    from training.config import lr_multiplier

    f = lr_multiplier("cosine", 5, 100, 0.1)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]

    def build(lr, mixing_lr):
        opt = torch.optim.AdamW([{"params": params[:1], "lr": lr}, {"params": params[1:], "lr": mixing_lr}])
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, f)

    opt, sched = build(1e-3, 1e-2)
    for _ in range(20):
        sum((p**2).sum() for p in params).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {"optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict()}
    opt2, sched2 = build(4e-3, 2e-2)  # train.lr and mixing_lr changed before resuming
    restore_optimizer(opt2, sched2, state)
    assert sched2.last_epoch == 20 and sched2.base_lrs == [4e-3, 2e-2]
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([4e-3 * f(20), 2e-2 * f(20)])
    assert torch.equal(opt2.state[params[0]]["exp_avg"], opt.state[params[0]]["exp_avg"])
    opt2.step()
    sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([4e-3 * f(21), 2e-2 * f(21)])


def test_builtin_build_restarts_a_conversion_whose_source_changed(tmp_path, monkeypatch):
    from factory import build as builtin

    configs = tmp_path / "configs"
    configs.mkdir()
    run = tmp_path / "runs" / "mhla"
    # the data cache is a build product (runs/builtin/cache-train), absent on a clean clone
    overrides = [f"run_dir={run}", "model.path=null", "data.path=null", "data.source=synthetic"]
    cfg = load_config(ROOT / "factory" / "configs" / "mhla.yaml", overrides)
    from training.config import config_yaml

    (configs / "mhla.yaml").write_text(config_yaml(cfg))
    monkeypatch.setattr(builtin, "CONFIGS", configs)
    assert builtin.stale_reason("mhla") is None  # no run yet
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config_yaml(cfg))
    assert builtin.stale_reason("mhla") is None and not builtin.stage_done("mhla")  # same source, no checkpoint
    cfg.model.transformer = "runs/builtin/base/checkpoints/step-0000100/transformer"
    (run / "config.yaml").write_text(config_yaml(cfg))
    why = builtin.stale_reason("mhla")
    assert "step-0000100" in why and "now starts from" in why
    moved = builtin.set_aside("mhla", why)
    assert not run.exists() and (moved / "config.yaml").is_file() and moved.name.startswith("mhla.old-")


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs" / "finetune").glob("*.yaml")):
        cfg = load_config(path, ["data.path=null", "data.source=synthetic"])
        # builtin-lora.yaml: a LoRA of the built-in model's softmax base, which plain diffusers loads whole
        converted = ("mhla", "mhla-hybrid", "linear") + (("flash",) if path.name == "builtin-lora.yaml" else ())
        assert cfg.model.variant in converted
        if path.name.startswith("wan2.1-1.3b"):
            assert (cfg.train.lr, cfg.train.weight_decay, cfg.flow.shift) == (2e-5, 0.0, 3.0)
            assert (cfg.data.num_frames, cfg.data.height, cfg.data.width) == (81, 480, 800)


def test_a_new_run_never_starts_over_an_earlier_one(tmp_path):
    run = tmp_path / "run"
    finetune(run, "train.steps=4", "checkpoint.every=2")
    before = (run / "metrics.jsonl").read_text()
    # overwrite=false: the smoke config itself replaces its last run (configs/finetune/tiny.yaml), a run's default does not
    again = finetune(run, "train.steps=2", "checkpoint.every=1", "overwrite=false", check=False)
    assert again.returncode == 2
    assert f"run_dir {str(run)!r} already holds a run (checkpoints up to step 4)" in again.stderr
    assert "resume=latest" in again.stderr and "overwrite=true" in again.stderr
    assert (run / "metrics.jsonl").read_text() == before  # nothing of the earlier run touched
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-0000002", "step-0000004"]
    finetune(run, "train.steps=2", "checkpoint.every=1", "overwrite=true")  # explicit: the old run goes
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-0000001", "step-0000002"]
    assert max(r["step"] for r in metrics(run)) == 2


def test_damaged_checkpoints_are_skipped_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    steps = ["train.steps=12", "checkpoint.every=3", "checkpoint.keep=0", "log.param_digest=true"]
    run = tmp_path / "run"
    finetune(run, *steps)
    straight = digest(run)
    found = {p.name: p for p in ckpt.list_checkpoints(run)}
    weights = found["step-0000012"] / "transformer" / "diffusion_pytorch_model.safetensors"
    with weights.open("r+b") as f:  # truncated, as by a full disk or a killed copy
        f.truncate(weights.stat().st_size // 2)
    state = found["step-0000009"] / ckpt.STATE_FILE
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    state.write_bytes(bytes(raw))
    (run / "param_digest" / "rank0.txt").unlink()
    proc = finetune(run, *steps, "resume=latest")
    out = proc.stdout + proc.stderr
    assert f"skipping damaged checkpoint {found['step-0000012']}" in out and "truncated" in out
    assert f"skipping damaged checkpoint {found['step-0000009']}" in out and "SHA-256" in out
    assert f"resumed from {found['step-0000006']} at step 6" in out
    assert digest(run) == straight
    assert ckpt.damage(found["step-0000012"]) is None  # rewritten by the resumed run
    with pytest.raises(ValueError, match="not an intact checkpoint: .*manifest.json is missing"):
        (found["step-0000003"] / ckpt.MANIFEST).unlink()
        ckpt.resolve_resume(str(found["step-0000003"]), run)


def test_a_full_disk_while_saving_ends_with_a_message_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, capsys):
    import errno

    from training import finetune as ft

    real_save_state, calls = ckpt.save_state, []

    def save_state(state, path):
        calls.append(path)
        if "step-0000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save_state(state, path)

    monkeypatch.setattr(ckpt, "save_state", save_state)
    run = tmp_path / "run"
    rc = ft.main(["--config", TINY, f"run_dir={run}", *QUIET, "train.steps=6", "checkpoint.every=2"])
    err = capsys.readouterr().err
    assert rc == 4
    assert "could not write the checkpoint of step 4" in err and "No space left on device" in err
    assert "step-0000002" in err and "resume=latest" in err
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-0000002"]
    assert ckpt.damage(run / "checkpoints" / "step-0000002") is None
    assert not list((run / "checkpoints").glob(".*"))  # no half-written folder left behind


def test_ema_checkpoints_hold_the_averages_and_resume_exactly(tmp_path):
    from safetensors.torch import load_file

    def weights(run, step):
        folder = ckpt.checkpoint_dir(run, step)
        averaged = {}
        for f in sorted((folder / "transformer").glob("*.safetensors")):
            averaged.update(load_file(f))
        return averaged, load_file(folder / "trainable.safetensors")

    steps = ["train.steps=6", "checkpoint.every=3", "checkpoint.keep=0", "train.ema_decay=0.9", "log.param_digest=true"]
    straight = tmp_path / "straight"
    proc = finetune(straight, *steps)
    assert "eval flow loss of the EMA weights (decay 0.9, 6 updates)" in proc.stdout + proc.stderr
    assert "eval_loss_ema" in metrics(straight)[-1]
    averaged, raw = weights(straight, 6)
    assert raw and all(k in averaged for k in raw)
    assert any(not torch.equal(averaged[k], raw[k]) for k in raw)  # transformer/ is the average, not the last step

    resumed = tmp_path / "resumed"
    finetune(resumed, *steps, "train.steps=3")  # stopped at step 3, then the same command for 6 steps
    proc = finetune(resumed, *steps, "resume=latest")
    assert "resumed from" in proc.stdout + proc.stderr
    again_averaged, again_raw = weights(resumed, 6)
    assert digest(resumed) == digest(straight)  # the raw weights trained on from the raw values
    for k in averaged:
        torch.testing.assert_close(again_averaged[k], averaged[k], rtol=0, atol=0)
    for k in raw:
        torch.testing.assert_close(again_raw[k], raw[k], rtol=0, atol=0)


def test_ema_and_lora_exclude_each_other():
    with pytest.raises(ValueError, match=r"train.ema_decay=0.99: expected 0 with train.trainable=lora"):
        load_config(TINY, ["train.ema_decay=0.99", "train.trainable=lora"])


def test_the_probe_is_logged_beside_the_eval_loss(tmp_path):
    run = tmp_path / "probe"
    proc = finetune(run, "train.steps=4", "validation.probe_every=2", "validation.probe_clips=2", "train.ema_decay=0.9")
    assert "probe at step 2: swap ratios colour" in proc.stdout + proc.stderr
    rows = [r for r in metrics(run) if "probe" in r]
    assert [r["step"] for r in rows] == [0, 2, 4]
    for r in rows:
        assert set(r["probe"]["mean_ratio"]) == {"colour", "shape", "motion", "background"}
        assert all(math.isfinite(v) and v > 0 for v in r["probe"]["mean_ratio"].values())
        assert "probe_ema" in r and math.isfinite(r["eval_loss_ema"])

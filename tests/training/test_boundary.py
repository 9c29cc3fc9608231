"""Issue 30 for the recipe's commands: one error boundary (a table of malformed values per entry point:
non-zero exit, a message, no traceback, pre-existing files byte-identical), the run-folder lock, and
captions and manifests read strictly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.boundary import assert_refused
from training import finetune, precompute

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "finetune" / "tiny.yaml")


@pytest.fixture(autouse=True)
def quiet_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))


@pytest.fixture
def world(tmp_path):
    """A run folder holding an earlier run's files, a plain file, a symlink loop, a latin-1 manifest."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (run / "config.yaml").write_text("run_dir: earlier\n")
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    data = tmp_path / "latin1"
    data.mkdir()
    (data / "manifest.csv").write_bytes("video,caption\nv.mp4,un carr\xe9 rouge\n".encode("latin-1"))
    return tmp_path


FINETUNE_TABLE = [
    ["model.blocks=9x9x9"],  # larger than the 3x4x6 training grid
    ["model.transformer=/no/such"],
    ["model.attention.bogus=1"],
    ["model.attention.feature_map=sigmoid"],
    ["model.attention.blocks=1x1x1"],
    ["run_dir=/proc/no/run"],
    ["model.variant=mhla-hybrid", "model.layers=[99]"],
    ["run_dir={root}/a_file"],  # an existing file
    ["run_dir={root}/loop_a/run"],
    ["train.steps=abc"],
    ["train.lr=-1"],
    ["checkpoint.keep=-1"],
    ["resume=/no/such/checkpoint"],
    ["data.source=folder", "data.path={root}/latin1"],  # a latin-1 manifest
    ["run_dir={root}/run"],  # an earlier run, no resume
    ["no_such_key=1"],
    ["train.seed=99999999999999999999999"],
    ["train.seed=9999999999999999999"],  # fits no 64-bit generator: failed after the model loaded
    ["model.seed=-1"],
    ["validation.seeds=[18446744073709551616]"],
    ['validation.prompts=["a NUL \x00 prompt"]'],
]


@pytest.mark.parametrize("extra", FINETUNE_TABLE, ids=[" ".join(a)[:40] for a in FINETUNE_TABLE])
def test_finetune_refuses_malformed_values(extra, world, capsys, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model loaded before the bad value was refused")

    monkeypatch.setattr(finetune, "build_model", no_model)
    argv = ["--config", TINY, f"run_dir={world}/new", "log.tensorboard=false"]
    argv += [a.replace("{root}", str(world)) for a in extra]
    assert_refused(finetune.main, argv, capsys, world)


def test_the_latin1_manifest_is_named(world, capsys):
    argv = ["--config", TINY, f"run_dir={world}/new", "data.source=folder", f"data.path={world}/latin1"]
    err = assert_refused(finetune.main, argv, capsys, world)
    assert f"manifest {str(world / 'latin1' / 'manifest.csv')!r} is not UTF-8 text" in err and "line 2" in err


PRECOMPUTE_TABLE = [
    ["--out", "{root}/loop_a/cache"],
    ["--out", "{root}/a_file"],
    ["data.source=cache"],
    ["data.num_frames=6"],
    ["--config", "/no/such.yaml"],
]


@pytest.mark.parametrize("extra", PRECOMPUTE_TABLE, ids=[" ".join(a)[:40] for a in PRECOMPUTE_TABLE])
def test_precompute_refuses_malformed_values(extra, world, capsys, monkeypatch):
    monkeypatch.setattr(precompute, "load_components", lambda *a, **k: pytest.fail("a model loaded"))
    argv = ["--config", TINY, "--out", f"{world}/cache"]
    extra = [a.replace("{root}", str(world)) for a in extra]
    if extra[0].startswith("--"):
        argv[argv.index(extra[0]) + 1] = extra[1]
    else:
        argv += extra
    assert_refused(precompute.main, argv, capsys, world)


# ---- class 3: runs are exclusive


def test_a_second_run_in_a_locked_run_dir_is_refused_naming_the_holder(tmp_path, capsys):
    from training.lock import RunLock

    run = tmp_path / "run"
    with RunLock(run):
        argv = ["--config", TINY, f"run_dir={run}", "log.tensorboard=false", "train.steps=1"]
        err = assert_refused(finetune.main, argv, capsys, tmp_path)
    assert f"is in use by another training run (PID {os.getpid()}" in err
    assert not (run / "metrics.jsonl").exists()  # the refused run wrote nothing


def test_a_lock_is_released_on_any_exit_and_a_dead_holders_lock_is_stale(tmp_path):
    from training.lock import RunLock, RunLockedError

    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from training.lock import RunLock; import time; RunLock({str(run)!r}).acquire(); time.sleep(60)",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        for _ in range(200):  # until the child holds it
            if (run / ".lock").is_file() and (run / ".lock").read_text().strip():
                break
            time.sleep(0.05)
        with pytest.raises(RunLockedError, match=f"PID {holder.pid}"):
            RunLock(run).acquire()
    finally:
        holder.kill()  # SIGKILL: no clean-up ran, the kernel dropped the lock
        holder.wait()
    lock = RunLock(run).acquire()
    assert lock.stale is not None and lock.stale["pid"] == holder.pid
    lock.release()
    with RunLock(run) as again:  # released cleanly: nothing stale
        assert again.stale is None
    with pytest.raises(ValueError, match="is a file"):
        RunLock(tmp_path / "run" / ".lock").acquire()


def test_overwrite_keeps_the_lock_file(tmp_path):
    from training import checkpoint as ckpt
    from training.lock import RunLock

    run = tmp_path / "run"
    with RunLock(run):
        (run / "metrics.jsonl").write_text("{}\n")
        ckpt.clear_run(run)
        assert sorted(p.name for p in run.iterdir()) == [".lock"]


# ---- class 6: captions read strictly


def test_a_latin1_caption_file_is_skipped_and_counted_with_its_name(tmp_path):
    from training.data import find_entries
    from world.synthetic import generate_sample, write_mp4

    for name, caption in (("good", b"a red square"), ("bad", "un carr\xe9 rouge".encode("latin-1"))):
        write_mp4(tmp_path / f"{name}.mp4", generate_sample(0, num_frames=5, height=32, width=32).frames)
        (tmp_path / f"{name}.txt").write_bytes(caption)
    (tmp_path / "nul.mp4").write_bytes((tmp_path / "good.mp4").read_bytes())
    (tmp_path / "nul.txt").write_text("a NUL \x00 caption")
    entries, skipped, _ = find_entries(tmp_path, "txt")
    assert [e.caption for e in entries] == ["a red square"]
    assert sorted(skipped) == [(str(tmp_path / "bad.txt"), "bad_caption"), (str(tmp_path / "nul.txt"), "bad_caption")]


@pytest.mark.slow
def test_a_resume_with_another_architecture_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """``resume=latest`` after changing ``model.blocks`` ended in a state-dict size mismatch (a traceback)
    after the model had loaded."""
    run = tmp_path / "run"
    base = ["--config", TINY, f"run_dir={run}", "log.tensorboard=false", "train.steps=1", "checkpoint.every=1"]
    assert finetune.main(base) == 0
    capsys.readouterr()
    monkeypatch.setattr(finetune, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    err = assert_refused(finetune.main, [*base, "resume=latest", "model.blocks=1x2x2"], capsys, tmp_path)
    assert "was trained with another architecture: MHLA blocks were 3x2x2, now 1x2x2" in err
    err = assert_refused(finetune.main, [*base, "resume=latest", "model.variant=linear"], capsys, tmp_path)
    assert "model.variant was 'mhla', now 'linear'" in err


@pytest.mark.slow
def test_sigterm_while_saving_a_checkpoint_exits_143_and_leaves_no_half_written_folder(tmp_path, monkeypatch, capsys):
    import signal

    from training import checkpoint as ckpt

    real_save_state = ckpt.save_state

    def save_state(state, path):
        if "step-0000004" in str(path):
            os.kill(os.getpid(), signal.SIGTERM)  # the boundary turns it into an exception here
        real_save_state(state, path)

    monkeypatch.setattr(ckpt, "save_state", save_state)
    run = tmp_path / "run"
    argv = ["--config", TINY, f"run_dir={run}", "log.tensorboard=false", "train.steps=6", "checkpoint.every=2"]
    assert finetune.main(argv) == 143
    assert "terminated" in capsys.readouterr().err
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-0000002"]
    assert ckpt.damage(run / "checkpoints" / "step-0000002") is None
    assert not list((run / "checkpoints").glob(".*"))
    monkeypatch.setattr(ckpt, "save_state", real_save_state)
    assert finetune.main([*argv, "resume=latest"]) == 0  # the lock was released; the run continues

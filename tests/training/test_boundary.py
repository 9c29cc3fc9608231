"""Issue 30 for the recipe's commands: one error boundary (a table of malformed values per entry point:
non-zero exit, a message, no traceback, pre-existing files byte-identical), the run-folder lock, and
captions and manifests read strictly."""

from __future__ import annotations

import json
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
    ["run_dir={root}/run", "overwrite=false"],  # an earlier run, no resume (the tiny config itself overwrites)
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
    assert f"is in use by PID {os.getpid()} (another training run" in err
    assert not (run / "metrics.jsonl").exists()  # the refused run wrote nothing


@pytest.mark.slow  # starts processes
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


# ---- issue 39: resume, full disk and run folders by their resolved path


def test_metrics_rows_half_written_or_broken_are_named(tmp_path):
    from training import checkpoint as ckpt

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')  # a crash mid-append
    with pytest.warns(UserWarning, match=r"metrics.jsonl'?: line 3, the last, is a half-written row"):
        assert ckpt.trim_metrics(log, 2) == 1
    assert log.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'
    log.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')  # damaged inside: not a crash's doing
    with pytest.raises(ValueError, match=r"metrics.jsonl'?: line 2 is not a JSON row \(Unterminated string"):
        ckpt.trim_metrics(log, 3)
    assert log.read_text() == '{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n'  # left as it was


def test_a_state_file_that_is_a_pickle_or_garbage_is_named(tmp_path):
    import pickle

    from training import checkpoint as ckpt

    (tmp_path / "p.pt").write_bytes(pickle.dumps({"step": 1, "run": os.system}, protocol=2))
    with pytest.raises(ValueError, match=r"p.pt' holds objects other than tensors and numbers, which weights_only"):
        ckpt.load_state(tmp_path / "p.pt")
    (tmp_path / "g.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"g.pt' is not a readable torch file"):
        ckpt.load_state(tmp_path / "g.pt")


def test_a_run_folder_is_known_by_its_resolved_path(tmp_path, capsys):
    """Issue 39, class 5: a symbolic link to a run folder not made yet ended in "cannot be used: File exists";
    an alias of a held folder is refused with "in use by PID"."""
    from training.lock import RunLock, RunLockedError

    alias = tmp_path / "alias"
    alias.symlink_to(tmp_path / "real")  # dangling: the run makes the folder it points to
    with RunLock(alias) as lock:
        assert lock.path == (tmp_path / "real" / ".lock") and (tmp_path / "real").is_dir()
        with pytest.raises(RunLockedError, match=rf"run_dir '.*real' is in use by PID {os.getpid()} "):
            RunLock(tmp_path / "real").acquire()
        (tmp_path / "alias2").symlink_to(tmp_path / "real")
        argv = ["--config", TINY, f"run_dir={tmp_path / 'alias2'}", "log.tensorboard=false", "train.steps=1"]
        err = assert_refused(finetune.main, argv, capsys, tmp_path)
        assert f"alias2' (that is '{tmp_path / 'real'}') is in use by PID {os.getpid()}" in err


@pytest.mark.slow
def test_a_resume_names_a_pickled_state_and_a_damaged_metrics_log(tmp_path, capsys):
    """Issue 39, class 3: a resume checkpoint holding a pickle payload (UnpicklingError from weights_only) and
    a damaged metrics.jsonl row ("Unterminated string", no file named) were both "unexpected failure"."""
    import pickle

    from training import checkpoint as ckpt

    run = tmp_path / "run"
    base = ["--config", TINY, f"run_dir={run}", "log.tensorboard=false", "checkpoint.every=1"]
    assert finetune.main([*base, "train.steps=2"]) == 0
    capsys.readouterr()
    log = run / "metrics.jsonl"
    good = log.read_text()
    # a crash mid-append: the resume drops the half row with a warning naming the file, and continues
    log.write_text(good + '{"step": 3, "lo')
    with pytest.warns(UserWarning, match="half-written row"):
        assert finetune.main([*base, "train.steps=3", "resume=latest"]) == 0
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    # a row damaged in the middle: named with its line, before the model loads; the log left as it was
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:12]
    log.write_text("\n".join(lines) + "\n")
    err = assert_refused(finetune.main, [*base, "train.steps=4", "resume=latest"], capsys, tmp_path)
    assert f"{str(log)!r}: line 2 is not a JSON row" in err and "unexpected failure" not in err
    log.write_text(good)
    # a state file holding a pickle payload, its manifest rewritten to match: refused, exit 2, the file named
    last = ckpt.list_checkpoints(run)[-1]
    (last / ckpt.STATE_FILE).write_bytes(pickle.dumps({"step": 3, "run": os.system}, protocol=2))
    ckpt.write_manifest(last)
    err = assert_refused(finetune.main, [*base, "train.steps=4", "resume=latest"], capsys, tmp_path)
    assert "weights_only" in err and str(last / ckpt.STATE_FILE) in err and "unexpected failure" not in err


@pytest.mark.slow
def test_a_full_disk_while_saving_a_checkpoint_is_exit_4_with_earlier_ones_intact(tmp_path, capsys):
    """Issue 39, class 3: the checkpoint save on a full disk (a tmpfs that holds one checkpoint) ended in an
    "unexpected failure" (safetensors' and torch's writers do not raise OSError)."""
    from tests.fulldisk import full_disk
    from training import checkpoint as ckpt

    with full_disk(tmp_path / "disk", size="8m") as disk:
        run = disk.root / "run"
        argv = ["--config", TINY, f"run_dir={run}", "log.tensorboard=false", "train.steps=3", "checkpoint.every=1"]
        rc = finetune.main(argv)
        err = capsys.readouterr().err
        assert rc == 4 and "unexpected failure" not in err, err
        assert "could not write the checkpoint of step 2" in err and "Earlier checkpoints are intact" in err
        assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-0000001"]
        assert ckpt.damage(run / "checkpoints" / "step-0000001") is None
        assert not list((run / "checkpoints").glob(".*"))


# ---- issue 39, class 2: overwrite removes only what the earlier run wrote


def _earlier_run(run):
    """A run folder as a run leaves it (its files listed in its run manifest) with a user's files beside them."""
    from training import checkpoint as ckpt

    ckpt.record_run_files(run, "config.yaml", "metrics.jsonl")
    (run / "config.yaml").write_text("run_dir: earlier\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    tmp = ckpt.begin_checkpoint(run, 1)
    (tmp / ckpt.STATE_FILE).write_bytes(b"state")
    ckpt.finish_checkpoint(run, 1)
    (run / "notes.txt").write_text("mine")
    (run / "data").mkdir()
    (run / "data" / "clip.txt").write_text("a red square")
    (run / "checkpoints" / "README").write_text("my notes on the checkpoints")


def test_overwrite_removes_only_what_the_earlier_run_listed(tmp_path):
    from training import checkpoint as ckpt
    from training.lock import RunLock

    run = tmp_path / "run"
    with RunLock(run):
        _earlier_run(run)
        replaced = ckpt.check_new_run(run, None, overwrite=True)
        assert sorted(p.name for p in replaced) == ["config.yaml", "metrics.jsonl", "step-0000001"]
        left = ckpt.clear_run(run)
    assert left == ["checkpoints/README", "data/clip.txt", "notes.txt"]
    assert (run / "notes.txt").read_text() == "mine" and (run / "data" / "clip.txt").read_text() == "a red square"
    assert not (run / "config.yaml").exists() and not ckpt.list_checkpoints(run)
    assert (run / ".lock").is_file() and not (run / ckpt.RUN_MANIFEST).exists()


def test_overwrite_refuses_to_replace_files_the_earlier_run_did_not_write(tmp_path):
    from training import checkpoint as ckpt

    run = tmp_path / "run"
    run.mkdir()
    _earlier_run(run)
    listed = json.loads((run / ckpt.RUN_MANIFEST).read_text())
    listed["written"].remove("config.yaml")  # a config.yaml of the user's own, where the new run writes its own
    (run / ckpt.RUN_MANIFEST).write_text(json.dumps(listed))
    with pytest.raises(ValueError, match=r"the earlier run did not write: config.yaml; move them away"):
        ckpt.check_new_run(run, None, overwrite=True)
    assert (run / "config.yaml").is_file() and ckpt.list_checkpoints(run)
    listed["written"] = ["../outside.txt", "/etc/hostname", "metrics.jsonl"]  # never followed out of run_dir
    (run / ckpt.RUN_MANIFEST).write_text(json.dumps(listed))
    (tmp_path / "outside.txt").write_text("keep")
    (run / "config.yaml").unlink()
    ckpt.clear_run(run)
    assert (tmp_path / "outside.txt").read_text() == "keep" and not (run / "metrics.jsonl").exists()


@pytest.mark.slow
def test_finetune_overwrite_keeps_files_the_earlier_run_did_not_write(tmp_path, capsys):
    """Issue 39, class 2: ``overwrite=true`` deleted notes.txt and data/clip.txt, which the earlier run had
    not written."""
    from training import checkpoint as ckpt

    run = tmp_path / "run"
    argv = ["--config", TINY, f"run_dir={run}", "log.tensorboard=false", "train.steps=1", "checkpoint.every=1"]
    argv += ["log.param_digest=true"]
    assert finetune.main(argv) == 0
    (run / "notes.txt").write_text("mine")
    (run / "data").mkdir()
    (run / "data" / "clip.txt").write_text("a red square")
    capsys.readouterr()
    assert finetune.main([*argv, "overwrite=true"]) == 0
    out = capsys.readouterr().out
    assert "left in place (not written by the earlier run): data/clip.txt, notes.txt" in out
    assert (run / "notes.txt").read_text() == "mine" and (run / "data" / "clip.txt").read_text() == "a red square"
    listed = json.loads((run / ckpt.RUN_MANIFEST).read_text())
    on_disk = {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.parent == run}
    assert on_disk - {".lock", ckpt.RUN_MANIFEST, "notes.txt"} <= set(listed["written"])
    assert "checkpoints/step-0000001" in listed["written"] and "param_digest/rank0.txt" in listed["written"]

"""Issue 53 (7): read-only folders. Every entry point that writes is given an output folder it cannot write (a
tmpfs remounted read-only as root, the folder's modes otherwise: :func:`tests.fulldisk.read_only`): each refuses
with one line naming the path and the reason (exit 2 or 4, never a traceback), before any model loads, and a
file already there is left as it was."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from tests.fulldisk import read_only

EARLIER = b"an earlier file, to be kept byte for byte"
REASON = re.compile(r"Read-only file system|Permission denied")


@pytest.fixture
def no_model_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the read-only folder was refused")

    monkeypatch.setattr("pipelines.loading.load_components", boom)
    monkeypatch.setattr("pipelines.loading.load_transformer", boom)


def _run(main, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def _refused(code: int, err: str, path) -> None:
    assert code in (2, 4), (code, err)
    assert err.startswith("error:") and str(path) in err and REASON.search(err), err
    assert "Traceback" not in err, err


def test_generate_into_a_read_only_folder_is_refused_before_the_model_loads(tmp_path, no_model_load):
    from pipelines.cli import main

    with read_only(tmp_path / "ro", {"a.mp4": EARLIER}) as folder:
        for out in (folder / "a.mp4", folder / "new" / "b.mp4"):
            code, err = _run(main, ["--model", "tiny-random", "--prompt", "a fox", "--no-progress", "--out", str(out)])
            _refused(code, err, folder)
        assert (folder / "a.mp4").read_bytes() == EARLIER and sorted(p.name for p in folder.iterdir()) == ["a.mp4"]


@pytest.mark.slow  # imports the training stack (about 3 s)
def test_a_run_dir_or_a_cache_in_a_read_only_folder_is_refused_by_name(tmp_path, no_model_load):
    from pathlib import Path

    from training.finetune import main as finetune
    from training.precompute import main as precompute

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "finetune" / "tiny.yaml")
    with read_only(tmp_path / "ro", {"run/notes.txt": EARLIER}) as folder:
        for run_dir in (folder / "run", folder / "new"):
            code, err = _run(finetune, ["--config", tiny, f"run_dir={run_dir}", "log.tensorboard=false"])
            _refused(code, err, run_dir)
        code, err = _run(precompute, ["--config", tiny, "--out", str(folder / "cache")])
        _refused(code, err, folder / "cache")
        assert (folder / "run" / "notes.txt").read_bytes() == EARLIER
        assert sorted(p.name for p in folder.rglob("*")) == ["notes.txt", "run"]


def test_a_video_written_into_a_read_only_folder_fails_naming_it_and_keeps_the_earlier_one(tmp_path):
    import numpy as np

    from common.video import write_mp4

    frames = np.zeros((5, 16, 16, 3), np.uint8)
    with read_only(tmp_path / "ro", {"a.mp4": EARLIER}) as folder:
        with pytest.raises(OSError) as e:
            write_mp4(folder / "a.mp4", frames)
        assert str(folder) in str(e.value) and REASON.search(str(e.value)), e.value
        assert (folder / "a.mp4").read_bytes() == EARLIER and sorted(p.name for p in folder.iterdir()) == ["a.mp4"]

"""The error boundary (common.errors.run_cli) and atomic outputs (common.outputs), on their own (issue 30)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from common import errors, outputs
from common.video import write_frame_grid, write_gif, write_mp4


@pytest.fixture(autouse=True)
def log_dir(tmp_path, monkeypatch):
    folder = tmp_path / "logs"
    monkeypatch.setenv("MHLA_LOG_DIR", str(folder))
    monkeypatch.delenv("MHLA_DEBUG", raising=False)
    return folder


def test_a_known_failure_is_one_paragraph_and_its_exit_code(capsys):
    def main(argv):
        raise ValueError("--steps 0: expected\n   at least 1")

    assert errors.run_cli(main, [], prog="t") == 2
    err = capsys.readouterr().err
    assert err == "error: --steps 0: expected at least 1\n"


@pytest.mark.parametrize(
    "exc,code",
    [
        (errors.ModelError("weights"), 3),
        (errors.OutputError("disk"), 4),
        (FileNotFoundError(2, "No such file or directory", "/no/such"), 2),
        (KeyboardInterrupt(), 130),
        (errors.Terminated(), 143),
        (SystemExit(2), 2),
    ],
)
def test_exit_codes(exc, code, capsys):
    def main(argv):
        raise exc

    assert errors.run_cli(main, [], prog="t") == code
    assert "Traceback" not in capsys.readouterr().err


def test_an_unexpected_failure_is_one_line_and_a_log_with_the_traceback(capsys, log_dir):
    def main(argv):
        raise TypeError("'NoneType' object is not subscriptable")

    assert errors.run_cli(main, ["--x"], prog="pipelines.cli") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    logs = list(log_dir.glob("pipelines-cli-*.log"))
    assert len(logs) == 1 and str(logs[0]) in err
    text = logs[0].read_text()
    assert "Traceback" in text and "TypeError" in text and "--x" in text


def test_debug_prints_the_traceback_and_is_taken_out_of_argv(capsys):
    seen = []

    def main(argv):
        seen.append(argv)
        raise TypeError("boom")

    assert errors.run_cli(main, ["--debug", "a"], prog="t") == 1
    assert seen == [["a"]] and "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize(
    "seed,ok", [(0, True), (2**63 - 1, True), (2**64, False), (-1, False), (1.5, False), (True, False)]
)
def test_seeds_must_fit_a_64_bit_generator(seed, ok):
    if ok:
        assert errors.check_seed(seed) == seed
    else:
        with pytest.raises(ValueError, match="expected a whole number in"):
            errors.check_seed(seed)


@pytest.mark.parametrize("text", ["a\x00b", "a\x1b[31m", "bad \udcff byte", ["a", "list"]])
def test_text_from_outside_is_refused_when_not_clean_text(text):
    with pytest.raises(ValueError, match="control character|not valid UTF-8|must be text"):
        errors.check_text(text, "--prompt")
    assert errors.check_text("tabs\tand\nnewlines are fine", "--prompt")


# ---- atomic outputs


def test_a_failed_writer_leaves_the_earlier_file_and_no_temporary(tmp_path):
    out = tmp_path / "result.json"
    out.write_text("the good one")
    with pytest.raises(RuntimeError):
        with outputs.atomic_write(out) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert out.read_text() == "the good one" and os.listdir(tmp_path) == ["result.json"]


def test_a_writer_that_writes_nothing_is_an_error_not_a_success(tmp_path):
    out = tmp_path / "x.mp4"
    with pytest.raises(errors.OutputError, match="produced no file"):
        with outputs.atomic_write(out):
            pass  # as ffmpeg failing without raising
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow  # starts a process
def test_sigterm_during_a_video_write_keeps_the_earlier_video(tmp_path, monkeypatch):
    """SIGTERM while an mp4 is written over an existing one: the error boundary turns it into an exception,
    the temporary file goes, the earlier video stays whole."""
    out = tmp_path / "v.mp4"
    frames = np.zeros((5, 16, 16, 3), np.uint8)
    write_mp4(out, frames)
    before = out.read_bytes()
    import imageio.v2 as imageio

    real = imageio.get_writer

    class Killed:
        def __init__(self, *a, **k):
            self.inner = real(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def append_data(self, frame):
            self.inner.append_data(frame)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(imageio, "get_writer", Killed)

    def main(argv):
        write_mp4(out, np.ones((5, 16, 16, 3), np.uint8) * 200)
        return 0

    assert errors.run_cli(main, [], prog="t") == 143
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["v.mp4"]


@pytest.mark.parametrize("fps", [0, -8, float("nan"), float("inf")])
def test_frame_rates_must_be_positive(tmp_path, fps):
    frames = np.zeros((5, 16, 16, 3), np.uint8)
    for write in (write_mp4, write_gif):
        with pytest.raises(ValueError, match="expected a frame rate > 0"):
            write(tmp_path / ("x.mp4" if write is write_mp4 else "x.gif"), frames, fps=fps)
    assert not list(tmp_path.iterdir())


def test_every_frame_writer_is_atomic(tmp_path, monkeypatch):
    frames = np.zeros((5, 16, 16, 3), np.uint8)
    paths = [tmp_path / "a.mp4", tmp_path / "a.gif", tmp_path / "a.png"]
    for p in paths:
        p.write_bytes(b"earlier")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    for path, write in zip(paths, (write_mp4, write_gif, write_frame_grid), strict=True):
        with pytest.raises(errors.OutputError, match="No space left on device"):
            write(path, frames)
    assert all(p.read_bytes() == b"earlier" for p in paths) and len(list(tmp_path.iterdir())) == 3


def test_atomic_dir_replaces_a_folder_whole_or_not_at_all(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(RuntimeError):
        with outputs.atomic_dir(out) as tmp:
            (tmp / "config.json").write_text("new")
            raise RuntimeError("save failed")
    assert (out / "config.json").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["model"]
    with outputs.atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["model"]


def test_a_symlink_loop_is_refused_before_any_work(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match="symbolic link loop"):
        outputs.resolve_output_folder(tmp_path / "a" / "videos")
    from common.video import check_output_path

    with pytest.raises(ValueError, match="symbolic link loop"):
        check_output_path(tmp_path / "a" / "videos" / "x.mp4")


def test_save_transformer_never_deletes_a_folder_of_other_files(tmp_path):
    from pipelines.loading import save_transformer
    from pipelines.tiny import build_tiny_transformer

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="holds other files"):
        save_transformer(build_tiny_transformer(), folder)
    assert (folder / "notes.txt").read_text() == "keep"


# ---- issue 39, class 1: writes are verified before they replace anything


def test_a_full_disk_never_replaces_an_earlier_video_gif_or_png(tmp_path):
    """ffmpeg on a full disk printed "No space left on device" and exited as if it had written: the earlier
    mp4 became an unreadable 12 KB file and the write counted as done. Now every frame writer checks what it
    wrote (the video decodes with its frames) before the rename: OutputError, the earlier files byte-identical."""
    from tests.fulldisk import full_disk

    with full_disk(tmp_path / "disk") as disk:
        small = np.zeros((5, 32, 32, 3), np.uint8)
        paths = [disk.root / "v.mp4", disk.root / "v.gif", disk.root / "v.png"]
        for path, write in zip(paths, (write_mp4, write_gif, write_frame_grid), strict=True):
            write(path, small)
        before = {p.name: p.read_bytes() for p in paths}
        disk.fill(free=12_000)
        noise = np.random.default_rng(0).integers(0, 256, (33, 128, 128, 3), dtype=np.uint8)
        for path, write in zip(paths, (write_mp4, write_gif, write_frame_grid), strict=True):
            with pytest.raises(errors.OutputError, match="the earlier file is left as it was|No space left") as e:
                write(path, noise)
            assert "\n" not in str(e.value) and str(path) in str(e.value)
        assert {p.name: p.read_bytes() for p in paths} == before
        assert disk.files() == ["v.gif", "v.mp4", "v.png"]  # no temporary left behind
        disk.release()
        write_mp4(paths[0], noise)  # with room again, the same write succeeds and decodes whole
        from common.video import read_video

        assert len(read_video(paths[0])) == 33


def test_a_writer_that_writes_short_without_raising_fails_with_exit_4(tmp_path, monkeypatch, capsys):
    """The same failure simulated (no tmpfs needed): a writer that leaves a truncated mp4 and says nothing."""
    import imageio.v2 as imageio

    out = tmp_path / "v.mp4"
    write_mp4(out, np.zeros((5, 16, 16, 3), np.uint8))
    before = out.read_bytes()
    real = imageio.get_writer

    class Short:
        def __init__(self, uri, *a, **k):
            self.uri, self.inner = uri, real(uri, *a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.__exit__(*exc)
            os.truncate(self.uri, 8192)  # what ENOSPC left: the header, no index
            return False

        def append_data(self, frame):
            self.inner.append_data(frame)

    monkeypatch.setattr(imageio, "get_writer", Short)

    def main(argv):
        write_mp4(out, np.random.default_rng(1).integers(0, 256, (9, 64, 64, 3), dtype=np.uint8))
        print("wrote", out)
        return 0

    assert errors.run_cli(main, [], prog="t") == 4
    captured = capsys.readouterr()
    assert "does not decode" in captured.err and captured.err.count("\n") == 1 and "wrote" not in captured.out
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["v.mp4"]


def test_a_text_output_of_the_wrong_size_is_not_renamed(tmp_path):
    out = tmp_path / "r.json"
    out.write_text("the good one")
    with pytest.raises(errors.OutputError, match="5 bytes were written of 10"):
        with outputs.atomic_write(out, size=10) as tmp:
            tmp.write_bytes(b"12345")
    assert out.read_text() == "the good one" and os.listdir(tmp_path) == ["r.json"]


def test_a_longest_allowed_output_name_is_written_and_a_longer_one_refused_before_any_work(tmp_path):
    """A 255-byte output name failed only after the whole run: the temporary name added to it was over the
    file system's limit. Temporary names are now cut to fit; a name over the limit is refused first."""
    from common.video import check_output_path

    limit = outputs.name_max(tmp_path)
    name = "v" * (limit - 4) + ".mp4"
    frames = np.zeros((5, 16, 16, 3), np.uint8)
    check_output_path(tmp_path / name)
    write_mp4(tmp_path / name, frames)
    write_mp4(tmp_path / name, frames)  # over an earlier one too
    outputs.write_text_atomic(tmp_path / ("t" * (limit - 5) + ".json"), "{}")
    with outputs.atomic_dir(tmp_path / ("d" * limit)) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(len(p.name) for p in tmp_path.iterdir()) == [limit] * 3
    too_long = tmp_path / ("x" * (limit - 3) + ".mp4")
    with pytest.raises(ValueError, match=f"is {limit + 1} bytes long; .* at most {limit} bytes"):
        check_output_path(too_long)
    with pytest.raises(ValueError, match="bytes long"):
        write_mp4(too_long, frames)
    # a name of multi-byte characters counts its bytes, not its characters
    with pytest.raises(ValueError, match="bytes long"):
        check_output_path(tmp_path / ("é" * (limit // 2) + ".mp4"))


# ---- issue 39, class 3: known causes named at the boundary, never "unexpected failure"


def test_a_pickle_refused_by_weights_only_is_a_known_failure(tmp_path, capsys):
    import pickle

    import torch

    payload = tmp_path / "state.pt"
    payload.write_bytes(pickle.dumps({"step": 1, "run": os.system}, protocol=2))

    def main(argv):
        torch.load(payload, weights_only=True)

    assert errors.run_cli(main, [], prog="t") == 2
    err = capsys.readouterr().err
    assert "weights_only" in err and "unexpected failure" not in err and err.count("\n") == 1


def test_writers_that_report_a_full_disk_their_own_way_are_exit_4(tmp_path, capsys):
    """torch's zip writer (a RuntimeError) and safetensors (a SafetensorError) on a full tmpfs: both were
    "unexpected failure"; both are write failures naming the file, the folder left clean."""
    import torch
    from safetensors.torch import save_file

    from tests.fulldisk import full_disk
    from training import checkpoint as ckpt

    tensors = {"w": torch.randn(200_000)}
    with full_disk(tmp_path / "disk", size="1m") as disk:
        disk.fill(free=30_000)
        with pytest.raises(errors.OutputError, match="could not write .*state.pt.*torch's file writer"):
            ckpt.save_state(tensors, disk.root / "state.pt")
        with pytest.raises(errors.OutputError, match="could not write .*model.*No space left on device"):
            with outputs.atomic_dir(disk.root / "model") as tmp:
                save_file(tensors, str(tmp / "w.safetensors"))
        assert not (disk.root / "model").exists()

        def main(argv):
            save_file(tensors, str(disk.root / "plain.safetensors"))

        assert errors.run_cli(main, [], prog="t") == 4
        assert "No space left on device" in capsys.readouterr().err


def test_an_unsupported_device_is_refused_by_name():
    from pipelines.loading import resolve_device

    for name in ("meta", "mps", "cuda:99" if __import__("torch").cuda.is_available() else "cuda"):
        with pytest.raises(ValueError, match=f"device '{name}'"):
            resolve_device(name)
    assert str(resolve_device("cpu")) == "cpu"


def test_every_other_writer_on_a_full_disk_is_exit_4_and_keeps_what_was_there(tmp_path, capsys):
    """The same mechanism at the other entry points that write for a user: ``world.synthetic`` (videos and
    manifests) and ``training.precompute``'s latent files (safetensors, which reports a full disk as its own
    error type): exit 4 / OutputError, never "unexpected", and an earlier file byte-identical."""
    import torch

    from tests.fulldisk import full_disk
    from training.precompute import _atomic_save
    from world import synthetic

    with full_disk(tmp_path / "disk", size="1m") as disk:
        sample = disk.root / "sample.safetensors"
        _atomic_save({"latent": torch.zeros(4)}, sample)
        before = sample.read_bytes()
        disk.fill(free=40_000)
        with pytest.raises(errors.OutputError, match="sample.safetensors.*No space left on device"):
            _atomic_save({"latent": torch.randn(100_000)}, sample)
        assert sample.read_bytes() == before
        rc = synthetic.main(["--out", str(disk.root / "world"), "--num", "40", "--frames", "9"])
        err = capsys.readouterr().err
        assert rc == 4 and "unexpected failure" not in err and err.strip().splitlines()[-1].startswith("error: "), err
        assert not [p for p in disk.root.rglob(".*") if p != disk.filler]  # no temporary left

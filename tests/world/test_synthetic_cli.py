"""Issue 30: ``python -m world.synthetic`` and ``python -m world.analyse`` behind the error boundary (a table
of malformed values: non-zero exit, a message, no traceback, pre-existing files byte-identical)."""

from __future__ import annotations

import pytest

from tests.boundary import assert_refused
from world import analyse, synthetic

TABLE = [
    ["--num", "0"],
    ["--num", "-3"],
    ["--fps", "0"],
    ["--fps", "-8"],
    ["--fps", "nan"],
    ["--frames", "0"],
    ["--height", "0"],
    ["--seed", str(2**64)],
    ["--out", "{root}/loop_a/data"],
    ["--out", "{root}/data/manifest.csv"],  # a file on the way
    ["--split", "test"],
]


@pytest.mark.parametrize("extra", TABLE, ids=[" ".join(a)[:40] for a in TABLE])
def test_synthetic_refuses_malformed_values(extra, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.csv").write_text("video,caption\nold.mp4,an earlier dataset\n")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    options = {"--out": f"{tmp_path}/data", "--num": "1", "--frames": "5", "--height": "16", "--width": "16"}
    options[extra[0]] = extra[1].replace("{root}", str(tmp_path))
    argv = [x for option in options.items() for x in option]
    assert_refused(synthetic.main, argv, capsys, tmp_path)


@pytest.mark.parametrize("video", ["/no/such.mp4", "{root}/not_a_video.mp4"])
def test_analyse_refuses_what_is_not_a_video(video, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))
    (tmp_path / "not_a_video.mp4").write_bytes(b"text, not a video")
    argv = [video.replace("{root}", str(tmp_path)), "--caption", "a red square moves to the right"]
    assert_refused(analyse.main, argv, capsys, tmp_path)

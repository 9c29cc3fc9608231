"""benchmarks.app_start and benchmarks.app_eta run end to end on the tiny model and write what they printed."""

import json
import shlex

import pytest

pytestmark = pytest.mark.slow


def test_app_start_writes_every_start(tmp_path):
    from benchmarks import app_start

    out = tmp_path / "start"
    assert app_start.main(["--runs", "1", "--out", str(out), "--", "--model", "tiny-random"]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert row["start"] == 1 and row["page_s"] > 0
    assert data["meta"]["app_args"] == ["--model", "tiny-random"] and data["meta"]["complete"] is True
    assert shlex.split(data["meta"]["command"]) == [
        "python",
        "-m",
        "benchmarks.app_start",
        "--runs=1",
        "--",
        "--model",
        "tiny-random",
    ]
    assert "| 1 |" in out.with_suffix(".md").read_text()


def test_app_eta_writes_each_request(tmp_path):
    from benchmarks import app_eta

    out = tmp_path / "eta"
    assert app_eta.main(["--model", "tiny-random", "--requests", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert row["request"] == 1 and row["seconds"] > 0
    if row["estimates"]:  # a tiny run can end before the first estimate is shown
        assert [a["share"] for a in row["at"]] == [0.1, 0.25, 0.5, 0.75, 0.9]
        assert all(a["left"] >= 0 for a in row["at"])
    assert data["meta"]["model"].endswith("tiny-random") or "tiny" in data["meta"]["model"]
    command = shlex.split(data["meta"]["command"])  # the command as it can be run again
    assert command[:3] == ["python", "-m", "benchmarks.app_eta"]
    assert {"--model=tiny-random", "--requests=1", f"--out={out}"} <= set(command)
    assert app_eta.parse_args(command[3:]).prompt == app_eta.parse_args([]).prompt
    assert out.with_suffix(".md").read_text().startswith("# The page's time-left estimate")

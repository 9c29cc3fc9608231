"""The context-parallel benchmark runs its processes and reports what the formula says each one sends."""

import json

import pytest

from benchmarks import context_parallel


@pytest.mark.slow
def test_runs_two_processes_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "cp"
    args = ["--grid", "2x4x5", "--blocks", "1x2x2", "--heads", "2", "--head-dim", "8", "--procs", "1", "2"]
    assert context_parallel.main([*args, "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "cp.json").read_text())["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    assert [r["tokens_per_process"] for r in rows] == [40, 20]
    # a ring all-reduce sends 2 (p-1)/p of the summaries (M x H x d x d) and sums (M x H x d), float32
    assert rows[1]["sent_mb_per_process"] == round(2 * 0.5 * 4 * 2 * 8 * 9 * 4 / 1e6, 2)
    assert rows[0]["comm_share"] == 0.0 and rows[1]["layer_ms"] > 0
    assert "| 2 | 20 |" in capsys.readouterr().out


def test_bad_settings_stop_before_any_process_starts(capsys):
    with pytest.raises(SystemExit):
        context_parallel.main(["--grid", "2x4x5", "--blocks", "3x1x1"])
    assert "blocks along frames" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        context_parallel.main(["--grid", "1x1x2", "--blocks", "1x1x1", "--procs", "3"])


def test_volumes_at_wan_size():
    # ring: 2 (p-1)/p x 105 blocks x 12 heads x 128 x 129 float32; Ulysses: 4 x (32,760 / 2) x 1536 bf16 x 1/2
    v = context_parallel.volumes((21, 30, 52), 105, 12, 128, 2)
    assert v == {"ring_mb": 83.2, "ulysses_mb": 100.6}
    # the ring's volume does not depend on the tokens; Ulysses' falls as the processes grow
    assert (
        context_parallel.volumes((21, 45, 80), 105, 12, 128, 4)["ring_mb"]
        == context_parallel.volumes((21, 30, 52), 105, 12, 128, 4)["ring_mb"]
    )
    assert context_parallel.volumes((21, 30, 52), 105, 12, 128, 8)["ulysses_mb"] < v["ulysses_mb"]

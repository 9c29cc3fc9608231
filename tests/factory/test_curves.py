"""factory.curves: a run's loss, held-out loss and probe curves from metrics.jsonl."""

import json

import pytest

from factory import curves


def _rows(with_ema: bool) -> list[dict]:
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-4} for s in range(1, 31)]
    for s in (10, 20, 30):
        row = {"step": s, "eval_loss": 0.5 - s / 100, "probe": {"mean_ratio": {"colour": 1 + s / 10, "shape": 1.0}}}
        if with_ema:
            row |= {"eval_loss_ema": 0.4, "probe_ema": {"mean_ratio": {"colour": 2.0, "shape": 1.1}}}
        rows.append(row)
    return rows


def test_probe_rows_keep_order_and_ema():
    rows = curves.probe_rows(_rows(with_ema=True))
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert rows[1]["ratio"] == {"colour": 3.0, "shape": 1.0}
    assert rows[2]["ratio_ema"] == {"colour": 2.0, "shape": 1.1}
    assert all(r["ratio_ema"] is None for r in curves.probe_rows(_rows(with_ema=False)))


def test_running_mean_matches_a_plain_mean():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    got = curves.running_mean(values, 3)
    want = [sum(values[max(0, i - 2) : i + 1]) / len(values[max(0, i - 2) : i + 1]) for i in range(len(values))]
    assert got == pytest.approx(want)


def test_cli_writes_plot_and_summary(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows(with_ema=True)))
    out, summary = tmp_path / "c.png", tmp_path / "c.json"
    assert curves.main([str(metrics), "--out", str(out), "--summary", str(summary), "--window", "5"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["step"] for r in json.loads(summary.read_text())] == [10, 20, 30]
    assert "step 30: held-out 0.2000" in capsys.readouterr().out


def test_bad_line_is_named(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0}\nnot json\n')
    assert curves.main([str(metrics), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:2" in err
    assert not (tmp_path / "c.png").exists()


def test_a_run_that_went_on_elsewhere_keeps_its_earlier_rows(tmp_path, capsys):
    """--earlier: a run begun at train.start_step on another machine has metrics from there on; the committed
    summary of its earlier part is drawn and summarised before them (its rows past the metrics' start dropped)."""
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in _rows(with_ema=True)))
    before = tmp_path / "before.json"
    assert curves.main([str(first), "--out", str(tmp_path / "a.png"), "--summary", str(before)]) == 0
    later = [{"step": s, "loss": 0.1, "lr": 1e-4} for s in range(26, 41)]
    later += [{"step": 25, "eval_loss": 0.2, "probe": {"mean_ratio": {"colour": 5.0, "shape": 1.5}}}]
    later += [{"step": 40, "eval_loss": 0.1, "probe": {"mean_ratio": {"colour": 6.0, "shape": 2.0}}}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in later))
    out, summary = tmp_path / "b.png", tmp_path / "b.json"
    argv = [str(metrics), "--out", str(out), "--summary", str(summary), "--earlier", str(before)]
    assert curves.main(argv) == 0
    rows = json.loads(summary.read_text())
    assert [r["step"] for r in rows] == [10, 20, 25, 40]  # step 30 of the first part lies past the new start
    assert rows[1]["ratio"] == {"colour": 3.0, "shape": 1.0} and rows[3]["ratio"]["shape"] == 2.0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text('{"step": 1}')
    capsys.readouterr()
    assert curves.main([*argv[:5], "--earlier", str(tmp_path / "bad.json")]) == 2
    assert "expected a list of probe rows" in capsys.readouterr().err

"""factory.progress: the built-in model's stages read back from the committed records, drawn and tabled."""

import json

import pytest

from factory import curves, progress


def _write(path, data):
    path.write_text(json.dumps(data))


def _probe(shape09: float, mean_only: bool = False) -> dict:
    by_sigma = {a: {"0.3": 1.0, "0.6": 1.5, "0.9": v} for a, v in (("shape", shape09), ("colour", 3.0))}
    if mean_only:
        return {"mean_ratio": {a: sum(v.values()) / 3 for a, v in by_sigma.items()}}
    return {"ratio": by_sigma, "mean_ratio": {a: sum(v.values()) / 3 for a, v in by_sigma.items()}}


@pytest.fixture
def folder(tmp_path):
    c = tmp_path / "curves"
    c.mkdir()
    # the first stage's metrics: two probes, a loss row between
    rows = [
        {"step": 0, "eval_loss": 1.0, "probe": _probe(1.00)},
        {"step": 5, "loss": 0.5},
        {"step": 250, "eval_loss": 0.5, "probe": _probe(1.10)},
    ]
    (c / "base-metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # an older joint summary (ignored: a later one exists) and the latest, one row without sigmas (skipped)
    _write(c / "joint-probe-step900.json", [{"step": 0, "ratio_by_sigma": {"shape": {"0.9": 9.0}}}])
    _write(
        c / "joint-probe-step1200.json",
        [
            {"step": 0, "ratio": {"shape": 1.2}, "ratio_by_sigma": {"shape": {"0.3": 1.0, "0.9": 1.25}}},
            {"step": 250, "ratio": {"shape": 1.3}},
            {"step": 500, "ratio": {"shape": 1.4}, "ratio_by_sigma": {"shape": {"0.3": 1.0, "0.9": 1.5}}},
        ],
    )
    _write(c / "shape-unconditional-step3000.json", {"shape_rate": 0.125})
    _write(c / "shape-unconditional-joint-step500.json", {"shape_rate": 0.25})
    swap = {"sigmas": {"0.5": {"kept": 16, "follows": 0, "clips": 16}, "0.9": {"kept": 6, "follows": 3, "clips": 16}}}
    _write(c / "shape-swap-joint-step500.json", swap)
    variants = {"flash": {"overall": 0.5}, "mhla": {"overall": 0.25}, "linear": {"overall": 0.0}}
    _write(c / "v3-eval-joint-step500-cpe.json", {"variants": variants})
    _write(c / "v3-eval-step3000.json", {"variants": {"flash": {"overall": 0.0}}})
    return c


def test_labels_name_the_base_step():
    assert progress.base_step("step3000") == 3000
    assert progress.base_step("joint-step0") == 3000
    assert progress.base_step("joint-step5400-cpe") == 8400
    assert progress.base_step("joint-step3000-conv600") == 6000
    assert progress.stage_step("joint-step5400-cpe") == 5400 and progress.stage_step("step3000") == 3000
    for bad in ("joint5400", "step", "joint-step54x", "Step3000"):
        with pytest.raises(ValueError, match=repr(bad)):
            progress.base_step(bad)


def test_stages_read_every_record_in_base_step_order(folder):
    found = progress.stages(folder)
    assert [(s.label, s.step) for s in found] == [
        ("step3000", 3000),
        ("joint-step500", 3500),
        ("joint-step500-cpe", 3500),
    ]
    first, joint, cpe = found
    assert first.unconditional == 0.125 and first.overall == {"flash": 0.0} and first.swap is None
    assert joint.unconditional == 0.25 and joint.swap == {"kept": 6, "follows": 3, "clips": 16}
    assert cpe.overall == {"flash": 0.5, "linear": 0.0, "mhla": 0.25} and cpe.unconditional is None


def test_probe_series_reads_sigma_09_from_both_stages(folder):
    series = progress.probe_series(folder)
    assert [s for s, _ in series] == [0, 250, 3000, 3500]  # the joint stage's step 250 had no sigmas
    assert series[1][1] == {"shape": 1.10, "colour": 3.0}
    assert series[2][1] == {"shape": 1.25} and series[3][1] == {"shape": 1.5}


def test_table_rows_and_targets(folder):
    text = progress.table(progress.stages(folder))
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| joint-step500 |"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "joint-step500",
        "3,500",
        "0.25",
        "6/16",
        "3/16",
        "",
        "",
        "",
        "",
    ]
    row = next(line for line in lines if line.startswith("| joint-step500-cpe |"))
    assert [c.strip() for c in row.strip("|").split("|")][5:] == ["0.50", "0.00", "0.25", ""]
    assert lines[-1].startswith("| *target* |") and ">= 12/16" in lines[-1] and ">= 0.80" in lines[-1]


def test_cli_writes_plot_and_table(folder, tmp_path, capsys):
    out = tmp_path / "out" / "progress"
    out.parent.mkdir()
    assert progress.main(["--curves", str(folder), "--out", str(out)]) == 0
    assert (tmp_path / "out" / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| step3000 | 3,000 | 0.12 |" in (tmp_path / "out" / "progress.md").read_text()
    assert "wrote" in capsys.readouterr().out


def test_bad_folders_are_named(tmp_path, capsys):
    assert progress.main(["--curves", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert progress.main(["--curves", str(empty)]) == 2
    assert "no v3-eval" in capsys.readouterr().err
    _write(empty / "v3-eval-joint5400.json", {"variants": {}})
    assert progress.main(["--curves", str(empty)]) == 2
    assert "'joint5400'" in capsys.readouterr().err
    assert not (empty / "progress.png").exists()


def test_curves_summary_keeps_the_sigmas():
    rows = [
        {"step": 10, "eval_loss": 0.3, "probe": _probe(1.7)},
        {"step": 20, "eval_loss": 0.2, "probe": _probe(1.8, True)},
    ]
    got = curves.probe_rows(rows)
    assert got[0]["ratio_by_sigma"]["shape"] == {"0.3": 1.0, "0.6": 1.5, "0.9": 1.7}
    assert "ratio_by_sigma" not in got[1]

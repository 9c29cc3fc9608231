"""factory.arms: short A/B arms of the base's recipe read from their metrics.jsonl and set against a control."""

import json
import random

import pytest

from factory import arms


def _probe(shape09: float, loss09: float) -> dict:
    ratio = {a: {"0.3": 1.0, "0.6": 2.0, "0.9": v} for a, v in (("shape", shape09), ("colour", 5.0), ("motion", 4.0))}
    return {"loss": {"0.3": 0.15, "0.9": loss09}, "ratio": ratio}


def _row(step: int, shape09: float, loss09: float = 0.1, ema09: float | None = None) -> dict:
    row = {"step": step, "eval_loss": 0.07, "probe": _probe(shape09, loss09)}
    if ema09 is not None:  # a run with an EMA logs its probe beside the raw weights'
        row["probe_ema"] = _probe(ema09, loss09)
    return row


def _metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_fit_recovers_a_line_and_its_noise():
    # exactly on a line: slope per 250 steps, no residual
    f = arms.fit([(0, 1.0), (50, 1.1), (100, 1.2), (150, 1.3)])
    assert f["n"] == 4 and f["mean"] == pytest.approx(1.15) and f["slope"] == pytest.approx(0.5)
    assert f["se"] == pytest.approx(0.0, abs=1e-12) and f["last"] == 1.3
    # noise about a flat line: the standard error of the mean is the residuals' sd / sqrt(n)
    rng = random.Random(0)
    ys = [2.0 + rng.gauss(0, 0.1) for _ in range(400)]
    f = arms.fit(list(zip(range(0, 400 * 50, 50), ys, strict=True)))
    assert f["mean"] == pytest.approx(2.0, abs=0.02) and abs(f["slope"]) < 0.01
    assert f["se"] == pytest.approx(0.1 / 20, rel=0.15)
    with pytest.raises(ValueError, match="no points"):
        arms.fit([])


def test_probe_rows_keep_the_window_and_the_last_of_a_repeated_step():
    rows = [_row(7000, 9.0), {"step": 7010, "loss": 0.05}, _row(7050, 1.0), _row(7050, 2.0), _row(7300, 9.0)]
    got = arms.probe_rows(rows, 7000, 7250)
    assert [r["step"] for r in got] == [7050] and got[0]["probe"]["ratio"]["shape"]["0.9"] == 2.0


def test_compare_calls_a_change_only_past_two_standard_errors():
    flat = {"ratio": {"shape": {"mean": 2.0, "se": 0.05}}}
    summaries = {
        "control": flat,
        "up": {"ratio": {"shape": {"mean": 2.3, "se": 0.05}}},  # +0.3 against se 0.071: higher
        "same": {"ratio": {"shape": {"mean": 2.1, "se": 0.05}}},  # +0.1 < 2 x 0.071: no change
        "down": {"ratio": {"shape": {"mean": 1.7, "se": 0.05}}},
    }
    got = arms.compare(summaries, "control")
    assert [got[k]["verdict"] for k in ("up", "same", "down")] == ["higher", "no change", "lower"]
    assert got["up"]["shape_diff"] == pytest.approx(0.3) and got["up"]["se"] == pytest.approx(0.05 * 2**0.5)


def test_cli_writes_the_table_plot_and_record(tmp_path, capsys):
    steps = range(7050, 7251, 50)
    control = _metrics(
        tmp_path / "control.jsonl",
        [_row(7000, 2.0)] + [_row(s, 2.0 + 0.01 * (s % 100 == 0), ema09=2.0 + (s - 7000) / 1000) for s in steps],
    )
    better = _metrics(tmp_path / "better.jsonl", [_row(s, 2.5 + 0.01 * (s % 100 == 0), 0.09) for s in steps])
    unc = tmp_path / "unc.json"
    unc.write_text(json.dumps({"shape_rate": 0.25, "object_rate": 0.5, "frames": 8}))
    uncap = tmp_path / "uncap.json"
    uncap.write_text(json.dumps({"sigmas": {"0.9": {"shape": 3, "colour": 4, "background": 5, "clips": 16}}}))
    swap = tmp_path / "swap.json"  # a swap record has per-sigma rows too: told apart by their keys
    swap.write_text(json.dumps({"sigmas": {"0.9": {"kept": 7, "follows": 2, "clips": 16, "kept_rate": 0.44}}}))
    out = tmp_path / "arms"
    argv = [f"control={control}", f"better={better}", "--from", "7000", "--to", "7250", "--out", str(out)]
    argv += ["--diagnosis", f"better={unc}", "--diagnosis", f"better={uncap}", "--diagnosis", f"control={swap}"]
    assert arms.main(argv) == 0
    res = json.loads((tmp_path / "arms.json").read_text())
    assert res["control"] == "control" and res["arms"]["control"]["steps"] == list(steps)
    assert res["vs_control"]["better"]["verdict"] == "higher"
    assert res["vs_control"]["better"]["shape_diff"] == pytest.approx(0.5)
    assert res["arms"]["better"]["loss"]["0.9"] == pytest.approx(0.09)
    assert res["diagnosis"]["better"]["unconditional"]["shape_rate"] == 0.25
    assert res["diagnosis"]["control"]["swap"]["sigmas"]["0.9"]["follows"] == 2
    assert "uncaptioned" not in res["diagnosis"]["control"]
    # the EMA's rows read apart from the raw weights' (a line: +0.25 per 250 steps, ending at 2.25); none in "better"
    ema = res["arms"]["control"]["ema"]["ratio"]["shape"]
    assert ema["slope"] == pytest.approx(0.25) and ema["last"] == pytest.approx(2.25)
    assert "ema" not in res["arms"]["better"]
    md = (tmp_path / "arms.md").read_text()
    assert (
        "| better | 5 |" in md
        and "higher (+0.500" in md
        and "| 2.250 | +0.250 |" in md
        and "0.25 (0.50 hold an object)" in md
        and "0.9: 3/4/5" in md
        and "0.9: 7/2 of 16" in md
    )
    assert (tmp_path / "arms.png").stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["only=x.jsonl"], "expected a control and at least one arm"),
        (["a=x", "b=y", "--to", "6000"], "--to must be past --from"),
        (["a=x", "b=y", "--control", "c"], "'c' is not one of the arms"),
        (["a=x", "a=y"], "names 'a' twice"),
        (["a", "b=y"], "expected NAME=PATH"),
        (["a=x", "b=y", "--diagnosis", "c=z.json"], "expected NAME=JSON with NAME one of the arms"),
    ],
)
def test_bad_arguments_are_named(argv, message, tmp_path, capsys):
    rc = arms.main(
        [*argv, "--from", "7000", *([] if "--to" in argv else ["--to", "7250"]), "--out", str(tmp_path / "o")]
    )
    assert rc != 0
    assert message in capsys.readouterr().err


def test_an_arm_without_probes_in_the_window_is_named(tmp_path, capsys):
    a = _metrics(tmp_path / "a.jsonl", [_row(7050, 2.0)])
    b = _metrics(tmp_path / "b.jsonl", [_row(7500, 2.0)])
    rc = arms.main([f"a={a}", f"b={b}", "--from", "7000", "--to", "7250", "--out", str(tmp_path / "o")])
    assert rc != 0
    err = capsys.readouterr().err
    assert "arm 'b'" in err and "no probe rows in steps (7000, 7250]" in err
    assert not (tmp_path / "o.json").exists()


def test_a_record_that_is_no_diagnosis_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sigmas": {"0.9": {"loss": 0.1}}}))
    a = _metrics(tmp_path / "a.jsonl", [_row(7050, 2.0)])
    b = _metrics(tmp_path / "b.jsonl", [_row(7050, 2.0)])
    argv = [
        f"a={a}",
        f"b={b}",
        "--from",
        "7000",
        "--to",
        "7250",
        "--diagnosis",
        f"a={bad}",
        "--out",
        str(tmp_path / "o"),
    ]
    assert arms.main(argv) != 0
    assert "is not a factory.shape_probe unconditional/uncaptioned/swap record" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()

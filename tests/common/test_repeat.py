"""tests.repeat: runs in a row, stops at the first failing run, names the failing test and its seed."""

import json

from tests.repeat import main, repeat

FLAKY = """
import pathlib

def test_second_run_fails():
    counter = pathlib.Path(__file__).with_name("count")
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    print("MHLA_TEST_SEED=4242")
    assert n != 1, "the second draw"

def test_always_passes():
    pass
"""


def test_stops_at_the_first_failing_run_and_names_its_seed(tmp_path):
    (tmp_path / "test_flaky.py").write_text(FLAKY)
    out = tmp_path / "record.json"
    record = repeat([str(tmp_path / "test_flaky.py")], runs=4, out=out)
    assert [r["passed"] for r in record["runs"]] == [2, 1]  # the third and fourth never ran
    assert record["passed_in_a_row"] == 1
    (failure,) = record["runs"][1]["failures"]
    assert failure["test"].endswith("test_second_run_fails") and failure["seed"] == "4242"
    assert "the second draw" in failure["message"]
    assert json.loads(out.read_text()) == record  # the record on disk is the last run's


def test_keep_going_runs_them_all_and_exit_code(tmp_path, capsys):
    (tmp_path / "test_flaky.py").write_text(FLAKY)
    assert main(["--runs", "3", "--keep-going", "--", str(tmp_path / "test_flaky.py")]) == 1
    assert "1 of 3 runs passed in a row" in capsys.readouterr().out
    (tmp_path / "count").unlink()
    (tmp_path / "test_flaky.py").write_text("def test_fine():\n    pass\n")
    assert main(["--runs", "2", "--", str(tmp_path / "test_flaky.py")]) == 0
    assert "2 of 2 runs passed in a row" in capsys.readouterr().out

"""``python -m factory.transfer_study`` runs from any working folder: its fine-tuning runs start from the checkout's
root (it once looked one folder above the checkout for training/finetune.py and failed before its first run)."""

import contextlib
import io
import os

import pytest

pytestmark = pytest.mark.slow  # five tiny fine-tuning runs in subprocesses


def test_the_study_runs_its_five_runs_and_prints_its_table(tmp_path):
    from factory.transfer_study import main

    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)  # not the checkout
    try:
        with contextlib.redirect_stdout(out):
            code = main(
                [
                    "--base-steps",
                    "2",
                    "--steps",
                    "2",
                    "--transfer-steps",
                    "1",
                    "--work-dir",
                    str(tmp_path / "w"),
                    "--no-save",
                ]
            )
    finally:
        os.chdir(cwd)
    assert code == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [r.split("|")[1].strip() for r in rows] == ["mhla", "mhla+transfer", "linear", "linear+transfer"]
    for name in ("base", "mhla", "mhla+transfer", "linear", "linear+transfer"):
        assert (tmp_path / "w" / name / "metrics.jsonl").is_file(), name

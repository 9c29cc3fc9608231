"""Issue 52 (7): the fine-tune smoke test (README: ``python -m training.finetune --config configs/finetune/tiny.yaml``)
runs twice as written, and on one intra-op thread (its steps took 1.6-20 s with two threads on a busy 2-core
machine, each tiny op waiting for both threads; 0.2 s with one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training import finetune
from training.config import load_config

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "finetune" / "tiny.yaml")


def test_the_smoke_config_replaces_its_last_run_and_runs_one_thread():
    cfg = load_config(TINY)
    assert cfg.overwrite is True and cfg.train.threads == 1
    assert load_config(TINY, ["train.threads=null"]).train.threads is None  # torch's default
    for bad, expected in (("-1", "expected a value >= 0"), ("1.5", "expected an integer")):  # 0: auto
        with pytest.raises(ValueError, match=f"train.threads={bad}: {expected}"):
            load_config(TINY, [f"train.threads={bad}"])


def test_intra_op_threads_are_the_runs_and_given_back():
    before = torch.get_num_threads()
    with finetune.intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with finetune.intra_op_threads(None):
        assert torch.get_num_threads() == before


@pytest.mark.slow  # two short runs of the tiny recipe
def test_the_smoke_command_runs_twice_as_written(tmp_path, capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as on a 2-core machine: the run must use 1 and give 2 back
    try:
        argv = ["--config", TINY, f"run_dir={tmp_path / 'run'}", "train.steps=2", "checkpoint.every=1"]
        assert finetune.main(argv) == 0
        first = capsys.readouterr().out
        assert "CPU threads: 1 (train.threads)" in first and torch.get_num_threads() == 2
        assert finetune.main(argv) == 0  # as written, again: not "run_dir ... already holds a run"
        again = capsys.readouterr().out
        assert "overwrite=true: removing the earlier run's" in again and "final model (step 2)" in again
        assert (tmp_path / "run" / "final" / "transformer" / "config.json").is_file()
    finally:
        torch.set_num_threads(before)

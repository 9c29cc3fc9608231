"""train.threads = 0: torch's threads follow the cores other work leaves (common/threads.py), on a CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training import finetune
from training.config import load_config

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "finetune" / "tiny.yaml")


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_follower_sets_what_pick_gives_when_it_is_time(monkeypatch, keep_threads):
    picks = iter([1, 2])
    monkeypatch.setattr(finetune.threads_mod, "pick", lambda: next(picks))
    follow = finetune.ThreadFollower(0, torch.device("cpu"), every_s=0.0)
    assert follow() == 1 and torch.get_num_threads() == 1
    assert follow() == 2 and torch.get_num_threads() == 2
    slow = finetune.ThreadFollower(0, torch.device("cpu"), every_s=3600.0)
    assert slow() is None  # not yet time


@pytest.mark.parametrize(("threads", "device"), [(None, "cpu"), (2, "cpu"), (0, "cuda")])
def test_the_follower_is_off_unless_asked_on_a_cpu(monkeypatch, threads, device):
    monkeypatch.setattr(finetune.threads_mod, "pick", lambda: pytest.fail("measured while off"))
    assert finetune.ThreadFollower(threads, torch.device(device), every_s=0.0)() is None


def test_threads_zero_sets_the_pick_for_the_run_and_gives_the_count_back(monkeypatch, keep_threads):
    torch.set_num_threads(2)
    monkeypatch.setattr(finetune.threads_mod, "pick", lambda: 1)
    with finetune.intra_op_threads(0):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_config_takes_zero_and_refuses_a_negative_count():
    assert load_config(TINY, ["train.threads=0"]).train.threads == 0
    with pytest.raises(ValueError, match="train.threads"):
        load_config(TINY, ["train.threads=-1"])

"""``model.mask_text_padding``: a run trains with the caption's padding masked in its cross-attention, saves the
setting with its weights, and a resume with the key left null goes on as its checkpoint was trained (its weights
load into a model built from ``model.transformer``, whose own setting may differ)."""

from __future__ import annotations

import json

import pytest
import torch

from pipelines.model import PaddingMaskedCrossAttnProcessor
from tests.training.test_training import TINY, finetune
from training import checkpoint as ckpt
from training.config import load_config
from training.finetune import build_model

pytestmark = pytest.mark.slow


def _masked(folder) -> bool:
    return json.loads((folder / "config.json").read_text()).get("mask_text_padding", False)


def test_the_key_sets_the_models_cross_attention_and_null_keeps_its_own(tmp_path):
    _, on, _ = build_model(
        load_config(TINY, ["model.mask_text_padding=true"]).model, load_config(TINY).data, torch.device("cpu")
    )
    assert on.config.mask_text_padding is True
    assert all(isinstance(b.attn2.processor, PaddingMaskedCrossAttnProcessor) for b in on.blocks)
    on.save_pretrained(tmp_path / "masked")
    cfg = load_config(TINY, [f"model.transformer={tmp_path / 'masked'}"])
    _, kept, _ = build_model(cfg.model, cfg.data, torch.device("cpu"))
    assert kept.config.mask_text_padding is True  # null: the starting transformer's own
    cfg = load_config(TINY, [f"model.transformer={tmp_path / 'masked'}", "model.mask_text_padding=false"])
    _, off, _ = build_model(cfg.model, cfg.data, torch.device("cpu"))
    assert off.config.mask_text_padding is False
    assert not any(isinstance(b.attn2.processor, PaddingMaskedCrossAttnProcessor) for b in off.blocks)


def test_a_masked_run_saves_the_mask_and_its_resume_keeps_it(tmp_path):
    run = tmp_path / "run"
    finetune(run, "train.steps=1", "checkpoint.every=1", "model.mask_text_padding=true")
    assert _masked(ckpt.checkpoint_dir(run, 1) / "transformer")
    assert _masked(run / "final" / "transformer")
    proc = finetune(run, "train.steps=2", "checkpoint.every=1", "resume=latest")  # the key left null
    assert "resumed from" in proc.stdout + proc.stderr
    assert _masked(ckpt.checkpoint_dir(run, 2) / "transformer")
    assert _masked(run / "final" / "transformer")
    plain = tmp_path / "plain"
    finetune(plain, "train.steps=1", "checkpoint.every=0")
    assert not _masked(plain / "final" / "transformer")

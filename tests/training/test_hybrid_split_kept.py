"""A fine-tuned hybrid goes on training with its own split: the run converts a loaded ``mhla-hybrid`` transformer
with ``model.layers`` when the config gives it, else with the layers the transformer already runs as MHLA (not
the default split, which would silently change the model being trained)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelines.attention import hybrid_layers
from pipelines.loading import save_transformer
from training.config import load_config
from training.finetune import build_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "finetune" / "tiny.yaml"


def _built(tmp_path, *overrides):
    cfg = load_config(TINY, list(overrides))
    _, transformer, _ = build_model(cfg.model, cfg.data, torch.device("cpu"))
    return transformer


def test_a_saved_hybrids_own_split_is_kept_and_an_explicit_one_wins(tmp_path):
    first = _built(tmp_path, "model.variant=mhla-hybrid", "model.layers=[0]")
    num_layers = len(first.blocks)
    assert list(first.conversion.linear_layers) == [0] != hybrid_layers(num_layers)
    save_transformer(first, tmp_path / "hybrid")

    kept = _built(tmp_path, "model.variant=mhla-hybrid", f"model.transformer={tmp_path / 'hybrid'}")
    assert list(kept.conversion.linear_layers) == [0]
    chosen = _built(
        tmp_path, "model.variant=mhla-hybrid", "model.layers=[1]", f"model.transformer={tmp_path / 'hybrid'}"
    )
    assert list(chosen.conversion.linear_layers) == [1]
    # another variant converts as it says: every layer
    full = _built(tmp_path, "model.variant=mhla", f"model.transformer={tmp_path / 'hybrid'}")
    assert list(full.conversion.linear_layers) == list(range(num_layers))
    # an untouched model takes the default split
    fresh = _built(tmp_path, "model.variant=mhla-hybrid")
    assert list(fresh.conversion.linear_layers) == hybrid_layers(num_layers)

"""Importing the MHLA authors' published Wan2.1 checkpoints, and the compatibility mode their forward needs.

Nobody can download the real files here, so every test uses a tiny synthetic checkpoint in the published
key format (original Wan names + ``self_attn.block_attn.conv.weight`` / ``self_attn.g_norm.weight``), with
random values, and checks the imported model against a dense O(N^2) implementation of the authors' forward
written in this file from its description (PAPER_NOTES, issue 8).
"""

from __future__ import annotations

import json

import pytest
import torch

import mhla
from mhla import BlockLayout, MixingCoefficients, locality_columns_init
from pipelines.attention import AttentionOptions, resample_mixing
from pipelines.convert import convert_self_attention, self_attention_state
from pipelines.loading import load_transformer, save_transformer
from pipelines.tiny import build_tiny_transformer

# ---------------------------------------------------------------------------------------------------------
# compatibility-mode pieces of the operator and the options


def test_locality_columns_init_by_hand():
    # centres 0, 1, 2; global max distance 2: 1 - D/2 = [[1, .5, 0], [.5, 1, .5], [0, .5, 1]], columns / sums
    m = locality_columns_init(BlockLayout((1, 1, 6), (1, 1, 3)))
    raw = torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.5], [0.0, 0.5, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(m, raw / raw.sum(0, keepdim=True), rtol=0, atol=1e-15)
    torch.testing.assert_close(m.sum(0), torch.ones(3, dtype=torch.float64))
    assert not torch.allclose(m.sum(1), torch.ones(3, dtype=torch.float64))  # rows are not normalised
    assert locality_columns_init(BlockLayout((1, 1, 2), (1, 1, 1))).tolist() == [[1.0]]
    coeffs = MixingCoefficients(BlockLayout((1, 1, 6), (1, 1, 3)), init="locality_columns", constrain=False)
    torch.testing.assert_close(coeffs(), m.float())


def test_unconstrained_mixing_is_used_as_stored():
    layout = BlockLayout((1, 2, 2), (1, 2, 2))
    coeffs = MixingCoefficients(layout, constrain=False)
    with torch.no_grad():
        coeffs.weight.copy_(torch.tensor([[2.0, -1.0, 0.0, 0.5]] * 4))
    assert torch.equal(coeffs(), coeffs.weight)
    coeffs.project_()  # a no-op without the constraint
    assert coeffs.weight[0, 1] == -1.0


def test_constrain_mixing_option_defaults_on_and_travels_in_the_config(tmp_path):
    assert AttentionOptions().constrain_mixing is True
    assert AttentionOptions.from_dict({"blocks": [1, 2, 2]}).constrain_mixing is True  # configs saved before it
    with pytest.raises(ValueError, match="constrain_mixing must be True or False"):
        AttentionOptions(constrain_mixing="no")

    model = build_tiny_transformer(seed=4, num_layers=2)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(1, 2, 2), constrain_mixing=False))
    mod = model.blocks[1].attn1.mhla
    assert mod.mhla.mixing.constrain is False
    with torch.no_grad():
        mod.mhla.mixing.weight.mul_(-3.0)  # negative, rows far from 1: kept as they are
    assert torch.equal(mod.mhla.mixing(), mod.mhla.mixing.weight)
    save_transformer(model, tmp_path / "t")
    saved = json.loads((tmp_path / "t" / "config.json").read_text())["self_attention"]["options"]
    assert saved["constrain_mixing"] is False
    loaded = load_transformer(tmp_path / "t", dtype="float32", device="cpu")
    assert loaded.blocks[1].attn1.mhla.mhla.mixing.constrain is False
    assert torch.equal(loaded.blocks[1].attn1.mhla.mhla.mixing(), mod.mhla.mixing.weight)
    # our own conversions keep the paper's constraint
    ours = convert_self_attention(build_tiny_transformer(seed=4, num_layers=2), "mhla")
    assert ours.blocks[0].attn1.mhla.mhla.mixing.constrain is True
    assert self_attention_state(ours)["options"]["constrain_mixing"] is True


def test_resample_without_renormalising_keeps_row_totals(gen):
    m = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    out = resample_mixing(m, (3, 2, 2), (1, 2, 2), renormalize=False)
    rows = torch.tensor([4, 5, 6, 7])  # the middle frame block's rows (nearest centre to the single new one)
    torch.testing.assert_close(out.sum(1), m[rows].sum(1))
    torch.testing.assert_close(out, m[rows].reshape(4, 3, 4).sum(1))
    normalised = resample_mixing(m.abs(), (3, 2, 2), (1, 2, 2))
    torch.testing.assert_close(normalised.sum(1), torch.ones(4, dtype=torch.float64))


def test_mhla_module_exports():
    assert "locality_columns" in mhla.mixing.MIXING_INITS

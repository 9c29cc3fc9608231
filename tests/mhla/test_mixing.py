import math

import pytest
import torch

from mhla import BlockLayout, MixingCoefficients, constrain_mixing, locality_init, uniform_init


def test_locality_init_1d_by_hand():
    # centres 0, 1, 2; row 0: 1 - [0, 1, 2] / 2 = [1, .5, 0] -> [2/3, 1/3, 0]
    m = locality_init(BlockLayout((1, 1, 6), (1, 1, 3)))
    expected = torch.tensor([[2 / 3, 1 / 3, 0.0], [0.0, 1.0, 0.0], [0.0, 1 / 3, 2 / 3]], dtype=torch.float64)
    torch.testing.assert_close(m, expected, rtol=0, atol=1e-15)


def test_locality_init_2d_by_hand():
    # 2x2 blocks: row 0 distances [0, 1, 1, sqrt2] -> [1, 1-1/sqrt2, 1-1/sqrt2, 0] / (3 - sqrt2)
    m = locality_init(BlockLayout((1, 4, 4), (1, 2, 2)))
    assert m[0].tolist() == pytest.approx([0.6306019375, 0.1846990312, 0.1846990312, 0.0], abs=1e-9)
    # by symmetry every row is a permutation of row 0, with the diagonal largest
    for i in range(4):
        assert sorted(m[i].tolist()) == pytest.approx(sorted(m[0].tolist()))
        assert int(m[i].argmax()) == i
        assert m[i, 3 - i] == 0.0  # opposite corner is the farthest block


def test_locality_init_token_units_uneven():
    # 7 columns into 3 blocks of 3, 2, 2 -> token centres 1, 3.5, 5.5
    layout = BlockLayout((1, 1, 7), (1, 1, 3))
    m = locality_init(layout, units="token")
    row0 = torch.tensor([1.0, 1 - 2.5 / 4.5, 0.0], dtype=torch.float64)
    row1 = torch.tensor([0.0, 1.0, 1 - 2.0 / 2.5], dtype=torch.float64)
    torch.testing.assert_close(m[0], row0 / row0.sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(m[1], row1 / row1.sum(), rtol=0, atol=1e-12)
    # block units treat the blocks as equally spaced, so they differ here
    assert not torch.allclose(m, locality_init(layout, units="block"))


def test_single_block_is_identity():
    assert locality_init(BlockLayout((2, 2, 2), (1, 1, 1))).tolist() == [[1.0]]


def test_paper_layout_init_properties():
    m = locality_init(BlockLayout((21, 30, 50), (7, 3, 5)))
    assert m.shape == (105, 105)
    assert (m >= 0).all()
    torch.testing.assert_close(m.sum(1), torch.ones(105, dtype=torch.float64))
    assert torch.equal(m.argmax(1), torch.arange(105))


def test_uniform_init():
    assert torch.equal(uniform_init(4), torch.full((4, 4), 0.25, dtype=torch.float64))


def test_constrain_clips_above_one_too():
    raw = torch.tensor([[2.0, 1.0, 0.5], [-1.0, 0.25, 0.25], [3.0, -2.0, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[0.4, 0.4, 0.2], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)  # by hand
    torch.testing.assert_close(constrain_mixing(raw), expected)


def test_feature_maps_by_their_formulas():
    from mhla import get_feature_map

    x = torch.tensor([-3.0, -0.5, 0.0, 0.7, 2.0], dtype=torch.float64)
    relu_expected = torch.tensor([1e-6, 1e-6, 1e-6, 0.7 + 1e-6, 2.0 + 1e-6], dtype=torch.float64)
    elu_expected = torch.tensor([math.exp(-3.0), math.exp(-0.5), 1.0, 1.7, 3.0], dtype=torch.float64)
    torch.testing.assert_close(get_feature_map("relu")(x), relu_expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(get_feature_map("elu")(x), elu_expected, rtol=1e-15, atol=1e-15)


def test_constrain_clamps_and_normalises_rows(gen):
    raw = torch.randn(6, 6, generator=gen) * 2
    raw[2] = -torch.rand(6, generator=gen) - 0.1  # a row that clamps to all zeros
    m = constrain_mixing(raw)
    assert (m >= 0).all() and (m <= 1).all()
    torch.testing.assert_close(m.sum(1), torch.ones(6))
    torch.testing.assert_close(m[2], torch.full((6,), 1 / 6))  # falls back to uniform
    # rows already valid are unchanged
    valid = torch.rand(3, 4, generator=gen) + 0.05
    valid = valid / valid.sum(1, keepdim=True)
    torch.testing.assert_close(constrain_mixing(valid), valid)


def test_mixing_stays_valid_after_large_steps(gen):
    mix = MixingCoefficients(BlockLayout((4, 4, 4), (2, 2, 2)))
    opt = torch.optim.SGD(mix.parameters(), lr=50.0)
    for _ in range(5):
        target = torch.randn(8, 8, generator=gen)
        loss = (mix() * target).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (mix.weight < 0).any() or (mix.weight > 1).any()  # the raw weight did leave [0, 1]
    m = mix()
    assert (m >= 0).all() and (m <= 1).all()
    torch.testing.assert_close(m.sum(1), torch.ones(8))
    mix.project_()
    assert (mix.weight >= 0).all()
    torch.testing.assert_close(mix.weight.sum(1), torch.ones(8))


def test_frozen_per_head_and_unconstrained_options():
    layout = BlockLayout((2, 4, 4), (2, 2, 2))
    frozen = MixingCoefficients(layout, learnable=False)
    assert list(frozen.parameters()) == [] and "weight" in frozen.state_dict()
    ph = MixingCoefficients(layout, per_head=True, num_heads=3)
    assert ph().shape == (3, 8, 8)
    torch.testing.assert_close(ph()[1], locality_init(layout).float())
    raw = MixingCoefficients(layout, init="uniform", constrain=False)
    with torch.no_grad():
        raw.weight[0, 0] = -0.5
    assert raw()[0, 0] == -0.5  # used as stored
    with pytest.raises(ValueError, match="num_heads"):
        MixingCoefficients(layout, per_head=True)
    with pytest.raises(ValueError, match="unknown mixing init"):
        MixingCoefficients(layout, init="gaussian")


def test_locality_init_rows_zero_at_farthest_block():
    layout = BlockLayout((6, 6, 6), (3, 2, 2))
    m = locality_init(layout)
    centres = layout.block_centres()
    d = torch.cdist(centres, centres)
    for i in range(layout.num_blocks):
        far = d[i] == d[i].max()
        assert (m[i][far] == 0).all()
        assert math.isclose(float(m[i].sum()), 1.0, rel_tol=1e-12)

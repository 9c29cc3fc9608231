import math

import pytest
import torch

from mhla import BlockLayout, default_blocks, parse_blocks, resolve_blocks, split_points


def test_paper_default_layout():
    layout = BlockLayout.for_grid((21, 30, 50))
    assert layout.blocks == (7, 3, 5)
    assert layout.num_blocks == 105
    assert layout.num_tokens == 31_500
    assert layout.is_even
    assert set(layout.block_sizes.tolist()) == {300}  # 3 x 10 x 10 tokens each


def test_480x832_grid_default_is_uneven_105():
    layout = BlockLayout.for_grid((21, 30, 52))
    assert layout.blocks == (7, 3, 5)
    assert not layout.is_even
    assert split_points(52, 5) == [0, 11, 22, 32, 42, 52]
    assert sorted(set(layout.block_sizes.tolist())) == [300, 330]


@pytest.mark.parametrize(
    "grid", [(21, 30, 50), (21, 30, 52), (13, 30, 52), (21, 45, 80), (1, 1, 1024), (5, 8, 8), (1, 1, 1), (2, 3, 5)]
)
def test_default_rule_keeps_mixing_cost_below_summaries(grid):
    blocks = default_blocks(grid)
    assert all(1 <= b <= s for b, s in zip(blocks, grid))
    assert math.prod(blocks) ** 2 <= math.prod(grid)


def test_default_rule_on_a_sequence_is_about_sqrt_n():
    assert default_blocks((1, 1, 1024)) == (1, 1, 32)
    assert BlockLayout.sequence(1000, 10).blocks == (1, 1, 10)


@pytest.mark.parametrize("size,parts", [(52, 5), (7, 3), (10, 10), (11, 1), (30, 7)])
def test_split_points_cover_axis_with_near_equal_segments(size, parts):
    pts = split_points(size, parts)
    lengths = [b - a for a, b in zip(pts[:-1], pts[1:])]
    assert pts[0] == 0 and pts[-1] == size and len(lengths) == parts
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize("grid,blocks", [((5, 6, 7), (2, 3, 2)), ((21, 30, 52), (7, 3, 5)), ((3, 4, 5), (3, 4, 5))])
def test_every_token_in_exactly_one_block(grid, blocks):
    layout = BlockLayout(grid, blocks)
    tb = layout.token_block
    assert tb.shape == (layout.num_tokens,)
    assert int(tb.min()) == 0 and int(tb.max()) == layout.num_blocks - 1
    assert int(layout.block_sizes.sum()) == layout.num_tokens
    # token -> block agrees with a direct computation from (f, h, w) coordinates
    f, h, w = grid
    expected = []
    pts = layout.axis_points
    for i in range(f):
        for j in range(h):
            for k in range(w):
                bi = next(a for a in range(blocks[0]) if pts[0][a] <= i < pts[0][a + 1])
                bj = next(a for a in range(blocks[1]) if pts[1][a] <= j < pts[1][a + 1])
                bk = next(a for a in range(blocks[2]) if pts[2][a] <= k < pts[2][a + 1])
                expected.append((bi * blocks[1] + bj) * blocks[2] + bk)
    assert tb.tolist() == expected
    # gather/scatter are inverse permutations on real tokens
    flat = layout.gather_index.reshape(-1)
    assert torch.equal(flat[layout.scatter_index], torch.arange(layout.num_tokens))
    assert int((flat == layout.num_tokens).sum()) == layout.gather_index.numel() - layout.num_tokens


def test_parse_blocks():
    assert parse_blocks("7x3x5") == (7, 3, 5)
    assert parse_blocks(" 7 X 3 x 5 ") == (7, 3, 5)
    assert parse_blocks([1, 2, 3]) == (1, 2, 3)


@pytest.mark.parametrize("spec", ["7x3", "axbxc", "7x3x0", "", "7x3x5x2", [1, 2], [0, 1, 1]])
def test_bad_block_specs_raise(spec):
    with pytest.raises(ValueError, match="blocks"):
        parse_blocks(spec)


def test_parse_grid():
    from mhla import parse_grid

    assert parse_grid("21x30x50") == (21, 30, 50) and parse_grid(" 5X16x20 ") == (5, 16, 20)
    for bad in ("21x30", "21x30x0", "21x-3x50", "a x b x c", "21*30*50", ""):
        with pytest.raises(ValueError, match="a grid looks like 21x30x50") as e:
            parse_grid(bad)
        assert str(e.value).endswith(f"got {bad!r}")


def test_more_blocks_than_cells_raises_naming_axis():
    with pytest.raises(ValueError, match="8 blocks along frames.*only 5 cells"):
        BlockLayout((5, 30, 50), (8, 3, 5))
    with pytest.raises(ValueError, match="grid"):
        BlockLayout((5, 0, 50), (1, 1, 1))


def test_block_centres_units():
    layout = BlockLayout((4, 6, 10), (2, 3, 2))
    blk = layout.block_centres("block")
    tok = layout.block_centres("token")
    assert blk[0].tolist() == [0, 0, 0] and blk[-1].tolist() == [1, 2, 1]
    # token units: block (0,0,0) spans frames 0-1, rows 0-1, cols 0-4 -> centre (0.5, 0.5, 2)
    assert tok[0].tolist() == [0.5, 0.5, 2.0]
    assert tok[-1].tolist() == [2.5, 4.5, 7.0]
    with pytest.raises(ValueError, match="units"):
        layout.block_centres("pixels")


def test_block_rule_requested_else_own_else_default():
    # requested: parsed, kept, must fit the grid as it is
    r = resolve_blocks((5, 16, 20), "2x4x5", own=(1, 1, 1))
    assert r.blocks == (2, 4, 5) and r.layout == BlockLayout((5, 16, 20), (2, 4, 5)) and not r.shrunk
    assert resolve_blocks((5, 16, 20), [2, 4, 5]).blocks == (2, 4, 5)
    with pytest.raises(ValueError, match="3 blocks along frames, but the token grid 1x4x4 has only 1"):
        resolve_blocks((1, 4, 4), "3x2x2")  # a request is never shrunk
    with pytest.raises(ValueError, match="blocks must look like '7x3x5'"):
        resolve_blocks((5, 16, 20), "2x4")
    # own: kept, shrunk per axis on a smaller grid
    own = resolve_blocks((1, 4, 4), own=(3, 2, 2))
    assert own.blocks == (3, 2, 2) and own.layout.blocks == (1, 2, 2) and own.shrunk
    assert str(own) == "1x2x2 blocks (M=4) over a 1x4x4 grid (N=16) (shrunk from 3x2x2)"
    assert resolve_blocks((5, 16, 20), own=(2, 4, 5)).layout.blocks == (2, 4, 5)
    # neither: the default rule with the given target block shape
    assert resolve_blocks((21, 30, 50)).blocks == default_blocks((21, 30, 50)) == (7, 3, 5)
    assert resolve_blocks((5, 16, 20), block_shape=(3, 4, 4)).blocks == default_blocks((5, 16, 20), (3, 4, 4))
    assert str(resolve_blocks((21, 30, 50))) == str(BlockLayout((21, 30, 50), (7, 3, 5)))


def test_block_rule_answers_share_one_layout():
    a = resolve_blocks((3, 4, 6), own=(2, 2, 2))
    assert resolve_blocks([3, 4, 6], own=[2, 2, 2]) is a  # one instance per question: no second fit per call
    assert resolve_blocks((3, 4, 6), "2x2x2").layout is a.layout  # and one layout, whatever the route

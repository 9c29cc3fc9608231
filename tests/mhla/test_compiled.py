"""mhla.compiled: the operator as custom ops for torch.compile, against the dense references."""

import pytest
import torch

from mhla import MHLA, linear_attention_dense, mhla_attention_dense
from mhla.compiled import _attention, attention_op
from mhla.layout import BlockLayout, fit_blocks
from mhla.mixing import resample_mixing
from tests.mhla.test_ops import draw, random_mixing, rel_err, rope_for


@pytest.mark.parametrize(
    ("grid", "blocks", "per_head"),
    [((2, 4, 6), (1, 2, 3), False), ((2, 4, 6), (2, 2, 2), True), ((1, 4, 6), (2, 2, 3), False)],  # last: shrinks
)
@pytest.mark.parametrize("normalize", [False, True])
def test_mhla_op_forward_and_backward_match_the_dense_formula(grid, blocks, per_head, normalize, gen):
    b, h, d = 2, 2, 4
    n = grid[0] * grid[1] * grid[2]
    q, k, v = (draw(gen, (b, n, h, d)).requires_grad_(True) for _ in range(3))
    m = math_m = blocks[0] * blocks[1] * blocks[2]
    mixing = random_mixing(gen, m, h if per_head else None).requires_grad_(True)
    rope = rope_for(gen, n, d)
    out = attention_op(q, k, v, mixing, grid, blocks, "relu", normalize, rope, 1e-6, True, torch.float64)

    # reference: the dense O(N^2) formula on the layout that fits the grid, with the resampled mixing
    used = fit_blocks(blocks, grid)
    mix = mixing if used == blocks else resample_mixing(mixing, blocks, used, renormalize=True)
    assert (used != blocks) == (grid[0] < blocks[0]) and math_m == m
    ref = mhla_attention_dense(q, k, v, BlockLayout(grid, used), mix, "relu", normalize, rope, 1e-6)
    assert rel_err(out.detach(), ref.detach()) < 1e-10
    g = draw(gen, out.shape)
    got = torch.autograd.grad(out, (q, k, v, mixing), g)
    want = torch.autograd.grad(ref, (q, k, v, mixing), g)
    for a, e in zip(got, want, strict=True):
        assert rel_err(a, e) < 1e-9


def test_linear_op_matches_the_dense_formula(gen):
    q, k, v = (draw(gen, (1, 10, 2, 4)).requires_grad_(True) for _ in range(3))
    out = attention_op(q, k, v, None, (1, 1, 1), (1, 1, 1), "relu", True, None, 1e-6, True, torch.float64)
    ref = linear_attention_dense(q, k, v, "relu", True, None, 1e-6)
    assert rel_err(out.detach(), ref.detach()) < 1e-10
    g = draw(gen, out.shape)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        assert rel_err(a, e) < 1e-9


@pytest.mark.slow  # opcheck runs the op many ways: about 4 s
def test_op_passes_torch_library_checks(gen):
    """Schema, fake (meta) implementation and autograd registration, as torch.library checks them."""
    q, k, v = (draw(gen, (1, 8, 2, 4), torch.float32).requires_grad_(True) for _ in range(3))
    mixing = random_mixing(gen, 4).float().requires_grad_(True)
    cos, sin = (t.float() for t in rope_for(gen, 8, 4))
    args = (q, k, v, mixing, cos, sin, [1, 2, 4], [1, 2, 2], "relu", False, 1e-6, True, torch.float32)
    torch.library.opcheck(_attention, args)


@pytest.mark.parametrize("blocks", [(1, 2, 2), (2, 2, 2)])  # the second shrinks on the 1x4x4 grid
def test_module_compiles_in_one_graph_with_eager_gradients(blocks, gen):
    import torch._dynamo

    layer = MHLA(blocks, normalize=False, num_heads=2)
    with torch.no_grad():
        layer.mixing.weight.add_(0.1 * draw(gen, layer.mixing.weight.shape, torch.float32).abs())
    q, k, v = (draw(gen, (1, 16, 2, 4), torch.float32).requires_grad_(True) for _ in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: layer(q, k, v, (1, 4, 4)), fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), layer(q, k, v, (1, 4, 4))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    g = draw(gen, got.shape, torch.float32)
    wrt = (q, k, v, layer.mixing.weight)
    for a, e in zip(torch.autograd.grad(got, wrt, g), torch.autograd.grad(want, wrt, g), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        assert e.abs().max() > 0

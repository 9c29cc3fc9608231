"""The efficient MHLA and linear paths against the dense O(N^2) references, forward and backward."""

import pytest
import torch

from mhla import (
    MHLA,
    BlockLayout,
    linear_attention,
    linear_attention_dense,
    locality_init,
    mhla_attention,
    mhla_attention_dense,
)
from tests import independent

GRIDS = [((4, 6, 8), (2, 3, 2)), ((5, 6, 7), (2, 3, 2)), ((3, 5, 13), (1, 2, 5)), ((1, 1, 37), (1, 1, 6))]


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def draw(gen, shape, dtype=torch.float64):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def rope_for(gen, n, d, dtype=torch.float64):
    # Wan's rotary tables: angles repeated over interleaved channel pairs
    angles = torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64) * 6.28
    angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def random_mixing(gen, m, heads=None):
    shape = (m, m) if heads is None else (heads, m, m)
    w = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.01
    return w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("grid,blocks", GRIDS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("use_rope", [False, True])
def test_mhla_matches_dense_float64(gen, grid, blocks, normalize, use_rope):
    layout = BlockLayout(grid, blocks)
    b, n, h, d = 2, layout.num_tokens, 3, 8
    q, k, v = (draw(gen, (b, n, h, d)) for _ in range(3))
    mix = random_mixing(gen, layout.num_blocks)
    rope = rope_for(gen, n, d) if use_rope else None
    out = mhla_attention(q, k, v, layout, mix, normalize=normalize, rotary_emb=rope)
    ref = mhla_attention_dense(q, k, v, layout, mix, normalize=normalize, rotary_emb=rope)
    assert out.shape == (b, n, h, d) and out.dtype == torch.float64
    assert rel_err(out, ref) < 1e-10


@pytest.mark.parametrize("feature_map", ["relu", "elu"])
def test_mhla_per_head_mixing_and_value_dim(gen, feature_map):
    layout = BlockLayout((3, 4, 6), (3, 2, 2))
    b, n, h, d, e = 2, layout.num_tokens, 4, 6, 10
    q, k = draw(gen, (b, n, h, d)), draw(gen, (b, n, h, d))
    v = draw(gen, (b, n, h, e))
    mix = random_mixing(gen, layout.num_blocks, heads=h)
    out = mhla_attention(q, k, v, layout, mix, feature_map=feature_map)
    ref = mhla_attention_dense(q, k, v, layout, mix, feature_map=feature_map)
    assert out.shape == (b, n, h, e)
    assert rel_err(out, ref) < 1e-10


@pytest.mark.parametrize("grid,blocks", GRIDS[:2])
def test_mhla_float32_matches_float64_reference(gen, grid, blocks):
    layout = BlockLayout(grid, blocks)
    q, k, v = (draw(gen, (2, layout.num_tokens, 2, 16)) for _ in range(3))
    mix = locality_init(layout)
    rope = rope_for(gen, layout.num_tokens, 16)
    ref = mhla_attention_dense(q, k, v, layout, mix, rotary_emb=rope)
    out = mhla_attention(
        q.float(), k.float(), v.float(), layout, mix.float(), rotary_emb=tuple(t.float() for t in rope)
    )
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5


def test_half_precision_inputs_accumulate_in_float32(gen):
    layout = BlockLayout((4, 8, 8), (2, 2, 2))
    q, k, v = (draw(gen, (1, layout.num_tokens, 2, 32)) for _ in range(3))
    mix = locality_init(layout)
    ref = mhla_attention_dense(q, k, v, layout, mix)
    out = mhla_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, mix.float())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("use_rope", [False, True])
def test_linear_matches_dense(gen, normalize, use_rope):
    b, n, h, d = 2, 150, 3, 8
    q, k, v = (draw(gen, (b, n, h, d)) for _ in range(3))
    rope = rope_for(gen, n, d) if use_rope else None
    out = linear_attention(q, k, v, normalize=normalize, rotary_emb=rope)
    ref = linear_attention_dense(q, k, v, normalize=normalize, rotary_emb=rope)
    assert rel_err(out, ref) < 1e-10
    out32 = linear_attention(
        q.float(),
        k.float(),
        v.float(),
        normalize=normalize,
        rotary_emb=None if rope is None else tuple(t.float() for t in rope),
    )
    assert rel_err(out32, ref) < 1e-5


@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_single_block_mhla_equals_linear(gen, use_rope, normalize):
    layout = BlockLayout((3, 5, 7), (1, 1, 1))
    q, k, v = (draw(gen, (2, layout.num_tokens, 3, 8)) for _ in range(3))
    rope = rope_for(gen, layout.num_tokens, 8) if use_rope else None
    one = locality_init(layout)
    assert one.tolist() == [[1.0]]
    a = mhla_attention(q, k, v, layout, one, normalize=normalize, rotary_emb=rope)
    b = linear_attention(q, k, v, normalize=normalize, rotary_emb=rope)
    torch.testing.assert_close(a, b, rtol=1e-13, atol=0)


def test_blocks_mix_only_through_the_mixing_matrix(gen):
    """With identity mixing a query block sees only its own block: perturbing another block's
    keys/values leaves its output unchanged. With locality mixing it does change."""
    layout = BlockLayout((2, 4, 4), (2, 2, 2))
    q, k, v = (draw(gen, (1, layout.num_tokens, 1, 4)) for _ in range(3))
    eye = torch.eye(layout.num_blocks, dtype=torch.float64)
    other = layout.token_block == 5
    mine = layout.token_block == 0
    v2 = v.clone()
    v2[:, other] += 1.0
    a = mhla_attention(q, k, v, layout, eye)
    b = mhla_attention(q, k, v2, layout, eye)
    assert torch.equal(a[:, mine], b[:, mine]) and not torch.allclose(a[:, other], b[:, other])
    loc = locality_init(layout)
    assert loc[0, 5] > 0
    assert not torch.allclose(
        mhla_attention(q, k, v, layout, loc)[:, mine], mhla_attention(q, k, v2, layout, loc)[:, mine]
    )


@pytest.mark.slow  # numerical gradient check
def test_gradcheck_mhla(gen):
    layout = BlockLayout((2, 3, 4), (2, 1, 2))
    n = layout.num_tokens
    q, k, v = (draw(gen, (2, n, 2, 4)).requires_grad_() for _ in range(3))
    mix = random_mixing(gen, layout.num_blocks).requires_grad_()
    rope = rope_for(gen, n, 4)
    for normalize in (True, False):
        assert torch.autograd.gradcheck(
            lambda q, k, v, m, normalize=normalize: mhla_attention(
                q, k, v, layout, m, feature_map="elu", normalize=normalize, rotary_emb=rope
            ),
            (q, k, v, mix),
        )
    assert torch.autograd.gradcheck(lambda q, k, v, m: mhla_attention(q, k, v, layout, m), (q, k, v, mix))


@pytest.mark.slow  # numerical gradient check
def test_gradcheck_linear(gen):
    q, k, v = (draw(gen, (2, 9, 2, 4)).requires_grad_() for _ in range(3))
    rope = rope_for(gen, 9, 4)
    assert torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, rotary_emb=rope), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, normalize=False), (q, k, v))


@pytest.mark.parametrize("grid,blocks", GRIDS[1:3])
def test_gradients_match_dense_on_larger_inputs(gen, grid, blocks):
    layout = BlockLayout(grid, blocks)
    n = layout.num_tokens
    inputs = [draw(gen, (2, n, 2, 8)) for _ in range(3)] + [random_mixing(gen, layout.num_blocks, heads=2)]
    rope = rope_for(gen, n, 8)
    upstream = draw(gen, (2, n, 2, 8))
    grads = []
    for fn in (mhla_attention, mhla_attention_dense):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves[:3], layout, leaves[3], rotary_emb=rope)
        (out * upstream).sum().backward()
        grads.append([t.grad for t in leaves])
    for g, r in zip(*grads):
        assert rel_err(g, r) < 1e-10


def test_module_trains_mixing_and_handles_grids(gen):
    mod = MHLA("2x2x2", normalize=False).double()
    q, k, v = (draw(gen, (1, 4 * 6 * 5, 2, 4)) for _ in range(3))
    out = mod(q, k, v, grid=(4, 6, 5))
    ref = mhla_attention_dense(q, k, v, BlockLayout((4, 6, 5), (2, 2, 2)), mod.mixing(), normalize=False)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    assert mod.mixing.weight.grad is not None and mod.mixing.weight.grad.abs().sum() > 0
    # a grid with 1 frame: the module shrinks its 2x2x2 layout to 1x2x2 and resamples its mixing
    small = mod(q[:, :30], k[:, :30], v[:, :30], grid=(1, 6, 5))
    mixing = independent.nearest_block_resample(mod.mixing().detach(), (2, 2, 2), (1, 2, 2))
    ref = independent.mhla_dense(q[:, :30], k[:, :30], v[:, :30], (1, 6, 5), (1, 2, 2), mixing)
    torch.testing.assert_close(small, ref)


def test_out_dtype_keeps_half_inputs_with_a_float32_output(gen):
    layout = BlockLayout((3, 4, 6), (1, 2, 2))
    q, k, v = (draw(gen, (1, layout.num_tokens, 2, 16)) for _ in range(3))
    mix = locality_init(layout)
    ref = mhla_attention_dense(q, k, v, layout, mix, normalize=False)
    half = [t.to(torch.float16) for t in (q, k, v)]
    out = mhla_attention(*half, layout, mix.float(), normalize=False, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 5e-3
    lin = linear_attention(*half, normalize=False, out_dtype=torch.float32)
    assert lin.dtype == torch.float32
    assert rel_err(lin, linear_attention_dense(q, k, v, normalize=False)) < 5e-3

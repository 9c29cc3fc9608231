"""The chunked PyTorch path of mhla.ops against a reference written here from the formula alone.

The reference (paper Eq. 5, dense O(N^2)) has its own feature maps, RoPE as a complex product on
interleaved pairs, and its own token-to-block map from split points, so it shares no code with the
operator (no mhla.reference, mhla.rope, mhla.feature_maps or BlockLayout.token_block). Small chunk
budgets force every way the operator cuts the work: several blocks per chunk, head groups, parts of
one block accumulated.

Inputs are fixed per test case (issue 39): each case's seed comes from its name, so the float64 tolerances
are checked on the same draws every run and a test cannot pass 512 times and then fail on a draw whose
mixing gradient nearly cancels. ``MHLA_TEST_SEED`` replays any other draw. Fresh draws every run are
:func:`test_randomized_sweep_reports_near_misses`'s: it reports errors near or over a tolerance (with the
seed to replay) without failing, and fails only on an error no rounding explains (a wrong formula: O(1)).
"""

import os
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F

import mhla.ops as ops
from mhla import BlockLayout, linear_attention, mhla_attention
from mhla.naive import mhla_attention_naive

# (grid, blocks): even, uneven on every axis, a 1-D sequence, one block
LAYOUTS = [
    ((4, 6, 8), (2, 3, 2)),
    ((5, 7, 9), (2, 3, 4)),
    ((1, 1, 37), (1, 1, 6)),
    ((3, 5, 7), (1, 1, 1)),
]
BUDGETS = [1, 7, 50, 4096]  # token-heads per chunk


def ref_phi(x, name):
    return torch.clamp(x, min=0) + 1e-6 if name == "relu" else torch.where(x > 0, x + 1, torch.exp(x))


def ref_rope(x, cos, sin):
    # pairs (x[2i], x[2i+1]) as complex numbers times cos[2i] + i sin[2i+1]
    c = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    t = torch.complex(cos[..., 0::2], sin[..., 1::2])
    return torch.view_as_real(c * t).reshape(x.shape)


def ref_token_blocks(grid, blocks):
    def lengths(size, parts):
        base, extra = divmod(size, parts)
        return [base + 1] * extra + [base] * (parts - extra)

    owner = []
    for size, parts in zip(grid, blocks):
        axis = []
        for seg, length in enumerate(lengths(size, parts)):
            axis += [seg] * length
        owner.append(axis)
    ids = []
    for f in range(grid[0]):
        for y in range(grid[1]):
            for x in range(grid[2]):
                ids.append((owner[0][f] * blocks[1] + owner[1][y]) * blocks[2] + owner[2][x])
    return torch.tensor(ids)


def ref_mhla(q, k, v, grid, blocks, mixing, feature_map="relu", normalize=True, rope=None, eps=1e-6):
    """out_t = sum_s m_{b(t)b(s)} phi(q_t).phi(k_s) v_s / (sum_s m_{b(t)b(s)} phi(q_t).phi(k_s) + eps),
    RoPE on phi(q), phi(k) in the numerator only."""
    fq, fk = ref_phi(q, feature_map), ref_phi(k, feature_map)
    idx = ref_token_blocks(grid, blocks)
    pair = mixing[..., idx[:, None], idx[None, :]]  # (N, N) or (H, N, N)
    if pair.dim() == 2:
        pair = pair.expand(q.shape[2], -1, -1)
    nq, nk = (fq, fk) if rope is None else (ref_rope(fq, *rope), ref_rope(fk, *rope))
    num_w = torch.einsum("bthd,bshd->bhts", nq, nk) * pair
    out = torch.einsum("bhts,bshe->bthe", num_w, v)
    if normalize:
        den = (torch.einsum("bthd,bshd->bhts", fq, fk) * pair).sum(-1).transpose(1, 2)
        out = out / (den[..., None] + eps)
    return out


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def make(gen, grid, blocks, b=2, h=3, d=8, e=6, per_head=False, fused=False):
    n = grid[0] * grid[1] * grid[2]
    m = blocks[0] * blocks[1] * blocks[2]
    if fused:  # q, k, v as chunks of one fused projection: strided, non-contiguous views
        qkv = torch.randn(b, n, h * (2 * d + e), generator=gen, dtype=torch.float64)
        q, k, v = qkv.split([h * d, h * d, h * e], dim=-1)
        q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (h, d)), v.unflatten(-1, (h, e))
    else:
        q, k = (torch.randn(b, n, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(b, n, h, e, generator=gen, dtype=torch.float64)
    w = torch.rand((h, m, m) if per_head else (m, m), generator=gen, dtype=torch.float64) + 0.05
    mix = w / w.sum(-1, keepdim=True)
    angles = torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64).repeat_interleave(2, -1) * 6.28
    return q, k, v, mix, (angles.cos(), angles.sin())


@pytest.fixture
def gen(request):
    """This module's inputs: a generator seeded from the test case's name (the same draws every run), or
    from ``MHLA_TEST_SEED``; the seed is printed, so a failure says how to replay it."""
    seed = int(os.environ.get("MHLA_TEST_SEED", zlib.crc32(request.node.name.encode()) % 2**31))
    print(f"MHLA_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def grad_tolerance(name: str, normalize: bool) -> float:
    """float64 tolerance of a gradient's relative error. With the normalizer the mixing gradient is a
    near-cancellation (exactly 0 for one block: the output does not depend on the mixing's scale), so its
    relative error measures rounding noise over a tiny value (seen up to 2.3e-9); a wrong formula gives O(1)."""
    return 1e-6 if name == "m" and normalize else 1e-9


@pytest.fixture(params=BUDGETS)
def budget(request, monkeypatch):
    monkeypatch.setattr(ops, "CHUNK_TOKEN_HEADS", request.param)
    return request.param


def budgets(*slow: int) -> list:
    """BUDGETS for an indirect parametrization of ``budget``, the given ones marked slow (thousands of chunks)."""
    return [pytest.param(b, marks=pytest.mark.slow) if b in slow else b for b in BUDGETS]


def case_errors(gen, grid, blocks, normalize: bool, use_rope: bool) -> dict[str, float]:
    """Relative errors of the operator against the reference on one draw: the output ("out") and the
    gradients of q, k, v and the mixing ("m"), float64."""
    q, k, v, mix, rope = make(gen, grid, blocks)
    rope = rope if use_rope else None
    layout = BlockLayout(grid, blocks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mix)]
    out = mhla_attention(*leaves[:3], layout, leaves[3], normalize=normalize, rotary_emb=rope)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, mix)]
    ref = ref_mhla(*ref_leaves[:3], grid, blocks, ref_leaves[3], normalize=normalize, rope=rope)
    assert out.shape == ref.shape and out.dtype == torch.float64
    errors = {"out": rel_err(out, ref)}
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    for name, a, r in zip("qkvm", leaves, ref_leaves):
        errors[name] = rel_err(a.grad, r.grad)
    return errors


def tolerance(name: str, normalize: bool) -> float:
    return 1e-12 if name == "out" else grad_tolerance(name, normalize)


@pytest.mark.parametrize("grid,blocks", LAYOUTS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("use_rope", [True, False])
@pytest.mark.parametrize("budget", budgets(1), indirect=True)
def test_forward_and_gradients_match_reference(gen, budget, grid, blocks, normalize, use_rope):
    for name, err in case_errors(gen, grid, blocks, normalize, use_rope).items():
        assert err < tolerance(name, normalize), (name, err)


SWEEP_DRAWS = int(os.environ.get("MHLA_SWEEP_DRAWS", "1"))  # fresh draws per case; raise it for a long sweep


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
def test_randomized_sweep_reports_near_misses(monkeypatch, capsys):
    """Fresh random draws of every layout, normalizer and RoPE setting (chunk budget 7): an error over a tenth
    of its tolerance is reported with its seed (a warning and a printed line), never failed, since a draw can
    make a gradient a near-cancellation; an error over 1e-3 on the output or q, k, v fails, as no rounding of
    float64 explains it (a wrong formula gives O(1)). ``MHLA_SWEEP_DRAWS=200`` runs a long sweep."""
    monkeypatch.setattr(ops, "CHUNK_TOKEN_HEADS", 7)
    near = []
    for grid, blocks in LAYOUTS:
        for normalize in (True, False):
            for use_rope in (True, False):
                for _ in range(SWEEP_DRAWS):
                    seed = torch.seed() % 2**31
                    errors = case_errors(torch.Generator().manual_seed(seed), grid, blocks, normalize, use_rope)
                    for name, err in errors.items():
                        if name != "m":
                            assert err < 1e-3, f"{name}: {err:.3g} (MHLA_TEST_SEED={seed}, {grid}, {blocks})"
                        tol = tolerance(name, normalize)
                        if err > tol / 10:
                            near.append(
                                f"{name} {err:.3g} ({'over' if err >= tol else 'near'} its tolerance {tol:g}): "
                                f"grid {grid} blocks {blocks} "
                                f"normalize={normalize} rope={use_rope} MHLA_TEST_SEED={seed}"
                            )
    with capsys.disabled():
        for line in near:
            print(f"\nnear-miss (reported, not failed): {line}")
    if near:
        warnings.warn(f"{len(near)} near-miss(es) in the randomized sweep: {near[0]}", stacklevel=1)


@pytest.mark.parametrize("feature_map", ["relu", "elu"])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("budget", budgets(1, 7), indirect=True)
def test_elu_per_head_mixing_and_fused_projection_views(gen, budget, feature_map, per_head):
    grid, blocks = (5, 7, 9), (2, 3, 4)
    q, k, v, mix, rope = make(gen, grid, blocks, per_head=per_head, fused=True)
    assert not q.is_contiguous() and not v.is_contiguous()
    layout = BlockLayout(grid, blocks)
    for normalize in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mix)]
        # views of the leaves, as a model's fused projection hands them over
        out = mhla_attention(
            *leaves[:3], layout, leaves[3], feature_map=feature_map, normalize=normalize, rotary_emb=rope
        )
        ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mix)]
        ref = ref_mhla(*ref_leaves[:3], grid, blocks, ref_leaves[3], feature_map, normalize, rope)
        assert rel_err(out, ref) < 1e-12
        upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out * upstream).sum().backward()
        (ref * upstream).sum().backward()
        for name, a, r in zip("qkvm", leaves, ref_leaves):
            assert rel_err(a.grad, r.grad) < grad_tolerance(name, normalize), name


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("use_rope", [True, False])
def test_linear_attention_matches_single_block_reference(gen, budget, normalize, use_rope):
    grid = (2, 3, 11)
    q, k, v, _, rope = make(gen, grid, (1, 1, 1), fused=True)
    rope = rope if use_rope else None
    one = torch.ones(1, 1, dtype=torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = linear_attention(*leaves, normalize=normalize, rotary_emb=rope)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = ref_mhla(*ref_leaves, grid, (1, 1, 1), one, normalize=normalize, rope=rope)
    assert rel_err(out, ref) < 1e-12
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    for name, a, r in zip("qkv", leaves, ref_leaves):
        assert rel_err(a.grad, r.grad) < 1e-9, (
            name
        )  # float64; the mixing gradient is a near-cancellation with the normalizer


@pytest.mark.parametrize("budget_value", [5, 4096])
@pytest.mark.slow  # numerical gradient check
def test_gradcheck_float64(gen, monkeypatch, budget_value):
    monkeypatch.setattr(ops, "CHUNK_TOKEN_HEADS", budget_value)
    grid, blocks = (2, 3, 4), (1, 2, 2)
    layout = BlockLayout(grid, blocks)
    q, k, v, mix, rope = make(gen, grid, blocks, b=1, h=2, d=4, e=3, per_head=True)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, mix)]
    fast = budget_value < 100  # many small chunks: the random-projection check keeps the test quick
    for feature_map in ("relu", "elu"):
        for normalize in (True, False):
            assert torch.autograd.gradcheck(
                lambda q, k, v, m, fm=feature_map, nz=normalize: mhla_attention(
                    q, k, v, layout, m, feature_map=fm, normalize=nz, rotary_emb=rope
                ),
                inputs,
                fast_mode=fast,
            )
    assert torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, rotary_emb=rope), inputs[:3])


def test_float32_and_bfloat16_inputs(gen):
    grid, blocks = (5, 7, 9), (2, 3, 4)
    q, k, v, mix, rope = make(gen, grid, blocks, d=16, e=16)
    ref = ref_mhla(q, k, v, grid, blocks, mix, rope=rope)
    layout = BlockLayout(grid, blocks)
    rope32 = tuple(t.float() for t in rope)
    out = mhla_attention(q.float(), k.float(), v.float(), layout, mix.float(), rotary_emb=rope32)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5
    half = [t.bfloat16() for t in (q, k, v)]
    out = mhla_attention(*half, layout, mix.float(), rotary_emb=rope32)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 2e-2
    out = mhla_attention(*half, layout, mix.float(), rotary_emb=rope32, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 2e-2
    leaves = [t.clone().requires_grad_() for t in half]
    mhla_attention(*leaves, layout, mix.float(), rotary_emb=rope32).float().square().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all() for t in leaves)


def test_rope_tables_that_need_gradients_get_them(gen):
    grid, blocks = (2, 3, 4), (1, 1, 2)
    q, k, v, mix, (cos, sin) = make(gen, grid, blocks)
    cos, sin = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    layout = BlockLayout(grid, blocks)
    mhla_attention(q, k, v, layout, mix, rotary_emb=(cos, sin)).square().sum().backward()
    c2, s2 = cos.detach().clone().requires_grad_(), sin.detach().clone().requires_grad_()
    ref_mhla(q, k, v, grid, blocks, mix, rope=(c2, s2)).square().sum().backward()
    assert rel_err(cos.grad, c2.grad) < 1e-11 and rel_err(sin.grad, s2.grad) < 1e-11


@pytest.mark.parametrize(
    "grid,blocks,heads,budget_value",
    [
        # the large layout (21x30x52 tokens) in chunks of one token-head is slow
        pytest.param(
            *layout,
            *hb,
            id=f"{hb[0]}-{hb[1]}-grid{i}-blocks{i}",
            marks=pytest.mark.slow if (i, hb) == (4, (3, 1)) else (),
        )
        for i, layout in enumerate(LAYOUTS + [((21, 30, 52), (7, 3, 5))])
        for hb in [(3, 1), (3, 50), (12, 4096), (12, 100_000)]
    ],
)
def test_chunks_cover_every_token_and_head_once(grid, blocks, heads, budget_value):
    n = grid[0] * grid[1] * grid[2]
    count = torch.zeros(1, n, heads, 2)
    for c in ops._plan(grid, blocks, heads, budget_value):
        ops._token_view(count, c, grid).add_(1)
    assert torch.equal(count, torch.ones_like(count))


def test_uneven_boxes_tile_the_grid():
    layout = BlockLayout((21, 30, 52), (7, 3, 5))
    assert len(layout.even_boxes) == 2
    assert BlockLayout((21, 30, 50), (7, 3, 5)).even_boxes == (((0, 0, 7, 3), (0, 0, 3, 10), (0, 0, 5, 10)),)
    idx = ref_token_blocks((5, 7, 9), (2, 3, 4)).view(5, 7, 9)
    for (tf, bf, nf, lf), (ty, by, nh, lh), (tx, bx, nw, lw) in BlockLayout((5, 7, 9), (2, 3, 4)).even_boxes:
        box = idx[tf : tf + nf * lf, ty : ty + nh * lh, tx : tx + nw * lw]
        first = box[::lf, ::lh, ::lw]
        assert int(first[0, 0, 0]) == (bf * 3 + by) * 4 + bx
        assert box.unique().numel() == nf * nh * nw


# ---- checks of bad input (issue 15) ----


def small(gen, dtype=torch.float32):
    layout = BlockLayout((2, 2, 4), (1, 1, 2))
    q, k, v = (torch.randn(1, 16, 2, 4, generator=gen).to(dtype) for _ in range(3))
    return layout, q, k, v, torch.full((2, 2), 0.5)


def test_batch_zero_is_refused(gen):
    layout, q, k, v, mix = small(gen)
    with pytest.raises(ValueError, match="batch size 0"):
        mhla_attention(q[:0], k[:0], v[:0], layout, mix)
    with pytest.raises(ValueError, match="batch size 0"):
        linear_attention(q[:0], k[:0], v[:0])


@pytest.mark.parametrize("eps", [float("nan"), -1e-6, float("inf")])
def test_bad_eps_is_refused(gen, eps):
    layout, q, k, v, mix = small(gen)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        mhla_attention(q, k, v, layout, mix, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        linear_attention(q, k, v, eps=eps)


def test_integer_tensors_are_refused(gen):
    layout, q, k, v, mix = small(gen)
    with pytest.raises(ValueError, match="q must have a floating dtype.*int64"):
        mhla_attention(q.long(), k.long(), v.long(), layout, mix)
    with pytest.raises(ValueError, match="v must have a floating dtype"):
        linear_attention(q, k, v.int())
    with pytest.raises(ValueError, match="mixing matrix must have a floating dtype"):
        mhla_attention(q, k, v, layout, torch.ones(2, 2, dtype=torch.long))
    cos = torch.ones(1, 16, 1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="rotary_emb cos must have a floating dtype"):
        mhla_attention(q, k, v, layout, mix, rotary_emb=(cos, cos.float()))


@pytest.mark.parametrize("grid", [(3, 4, 5.7), (3, True, 5), (3, 4, "5")])
def test_fractional_grids_are_refused_not_truncated(grid):
    with pytest.raises(ValueError, match="grid must be three"):
        BlockLayout(grid, (1, 1, 1))
    with pytest.raises(ValueError, match="grid must be three"):
        BlockLayout.for_grid(grid)
    assert BlockLayout((3.0, 4, 5), (1, 1, 1)).grid == (3, 4, 5)


def test_naive_formulation_matches_reference(gen):
    grid, blocks = (5, 7, 9), (2, 3, 4)
    q, k, v, mix, rope = make(gen, grid, blocks)
    out = mhla_attention_naive(q, k, v, BlockLayout(grid, blocks), mix, rotary_emb=rope, normalize=False)
    assert rel_err(out, ref_mhla(q, k, v, grid, blocks, mix, normalize=False, rope=rope)) < 1e-12


def test_elu_reference_is_elu_plus_one(gen):
    x = torch.randn(100, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(ref_phi(x, "elu"), F.elu(x) + 1)

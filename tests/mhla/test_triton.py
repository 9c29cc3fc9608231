"""Fused Triton kernels against the dense reference, forward and backward.

On a machine without a GPU they run in Triton's interpreter (set up in conftest), on small shapes;
with a GPU the `gpu` tests run them compiled, in bf16/fp16/fp32, on the Wan grids.
"""

import pytest
import torch

from mhla import (
    BlockLayout,
    linear_attention,
    linear_attention_dense,
    locality_init,
    mhla_attention,
    mhla_attention_dense,
)

pytestmark = pytest.mark.slow  # Triton's interpreter on a CPU

triton_ops = pytest.importorskip("mhla.triton_ops")
from mhla import triton_kernels  # noqa: E402 (after the skip)

if not triton_ops.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max() / b.detach().double().abs().max())


def inputs(gen, layout, b=2, h=2, d=32, e=32, per_head=False):
    n = layout.num_tokens
    q, k = (torch.randn(b, n, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, n, h, e, generator=gen, dtype=torch.float64)
    m = (
        torch.rand(
            (h, layout.num_blocks, layout.num_blocks) if per_head else (layout.num_blocks,) * 2,
            generator=gen,
            dtype=torch.float64,
        )
        + 0.01
    )
    m = m / m.sum(-1, keepdim=True)
    angles = (torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64) * 6.28).repeat_interleave(2, -1)
    return [q, k, v, m], (angles.cos(), angles.sin())


def fused_vs_dense(
    gen, layout, dtype, normalize, use_rope, feature_map="relu", per_head=False, d=32, e=32, version="v2"
):
    (q, k, v, m), rope = inputs(gen, layout, d=d, e=e, per_head=per_head)
    rope = rope if use_rope else None
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)] + [m.to(DEVICE, torch.float32).requires_grad_()]
    out = triton_ops.mhla_attention_fused(
        *leaves[:3],
        layout,
        leaves[3],
        feature_map=feature_map,
        normalize=normalize,
        rotary_emb=None if rope is None else tuple(t.to(DEVICE, torch.float32) for t in rope),
        version=version,
    )
    assert out.dtype == dtype and out.shape == v.shape
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * upstream.to(DEVICE)).sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, m)]
    ref = mhla_attention_dense(
        *ref_leaves[:3], layout, ref_leaves[3], feature_map=feature_map, normalize=normalize, rotary_emb=rope
    )
    (ref * upstream).sum().backward()
    return rel_err(out, ref), [rel_err(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]


@pytest.mark.parametrize(
    "grid,blocks,normalize,use_rope",
    [
        ((3, 5, 13), (1, 2, 5), True, True),  # uneven along two axes
        ((3, 5, 13), (1, 2, 5), False, True),
        ((4, 6, 8), (2, 3, 2), True, False),  # even
        ((4, 6, 8), (2, 3, 2), False, False),
    ],
)
def test_fused_matches_dense_fp32(gen, grid, blocks, normalize, use_rope):
    err, grad_errs = fused_vs_dense(gen, BlockLayout(grid, blocks), torch.float32, normalize, use_rope)
    assert err < 1e-4
    assert max(grad_errs) < 1e-4, grad_errs


@pytest.mark.parametrize("version", ["v2", "v1"])
@pytest.mark.parametrize("normalize", [True, False])
def test_fused_bf16_matches_dense(gen, version, normalize):
    # v2 keeps the block summaries in bf16 between the passes, v1 in float32; both within bf16's
    # tolerance of the float64 formula, forward and every gradient (the mixing's included)
    layout = BlockLayout((3, 5, 13), (1, 2, 5))
    err, grad_errs = fused_vs_dense(gen, layout, torch.bfloat16, normalize, True, version=version)
    assert err < 2e-2
    assert max(grad_errs) < 2e-2, grad_errs


def test_fused_v2_keeps_bf16_summaries(gen):
    layout = BlockLayout((2, 4, 6), (2, 2, 2))
    (q, k, v, m), _ = inputs(gen, layout, b=1)
    for dtype, version, expected in [
        (torch.bfloat16, "v2", torch.bfloat16),
        (torch.bfloat16, "v1", torch.float32),
        (torch.float16, "v2", torch.float32),  # fp16's range is too small for summaries
        (torch.float32, "v2", torch.float32),
    ]:
        leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
        out = triton_ops.mhla_attention_fused(*leaves, layout, m.float().to(DEVICE), version=version)
        summaries = out.grad_fn.saved_tensors[4]
        assert summaries.shape == (2, layout.num_blocks, 32, 32) and summaries.dtype == expected, (dtype, version)
    with pytest.raises(ValueError, match="unknown kernel version"):
        triton_ops.mhla_attention_fused(*leaves, layout, m.float().to(DEVICE), version="v3")


def test_rope_halves_are_made_once_per_pair_of_tables(gen):
    # the Wan layers share one (cos, sin): v2's half tables are sliced once, and again after a change
    layout = BlockLayout((2, 4, 6), (2, 2, 2))
    (q, k, v, _), rope = inputs(gen, layout, b=1)
    rope = tuple(t.float() for t in rope)

    def tables(rope):
        return triton_ops._Geometry(q, v, layout, rope, "v2").tables(rope, q)

    first, again = tables(rope), tables(rope)
    assert again[0] is first[0] and again[1] is first[1]
    torch.testing.assert_close(first[0], rope[0][..., 0::2], rtol=0, atol=0)
    torch.testing.assert_close(first[1], rope[1][..., 1::2], rtol=0, atol=0)
    rope[1].mul_(-1)  # in place: the kept halves are stale
    changed = tables(rope)
    torch.testing.assert_close(changed[1], rope[1][..., 1::2], rtol=0, atol=0)
    other = tuple(t.clone() for t in rope)  # equal values, other tensors: made for them
    assert tables(other)[0] is not changed[0]


@pytest.fixture
def tf32_switch():
    """Sets torch.backends.cuda.matmul.allow_tf32 and restores it by hand afterwards: the switch is a
    property of a module object, which pytest's monkeypatch (9.x) cannot undo."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32

    def set_tf32(value: bool) -> None:
        matmul.allow_tf32 = value

    yield set_tf32
    matmul.allow_tf32 = saved


def test_product_precision_policy(tf32_switch):
    import triton.language as tl

    tf32_switch(False)
    assert triton_ops._dot_types(torch.float32) == (tl.float32, "ieee")  # exact, as PyTorch's default
    tf32_switch(True)
    assert triton_ops._dot_types(torch.float32) == (tl.float32, "tf32")  # follows PyTorch's TF32 switch
    assert triton_ops._dot_types(torch.float16) == (tl.float32, "tf32")  # never fp16 operands (their range)


@pytest.mark.gpu
def test_fused_gpu_fp32_with_tf32_allowed(gen, monkeypatch, tf32_switch):
    monkeypatch.setattr(triton_ops, "AUTOTUNE", False)
    tf32_switch(True)
    check_wan_grid(gen, (21, 30, 52), torch.float32, "cuda", 2, 128, (True, False), tf32_tolerance(21 * 30 * 52))


def tf32_tolerance(reduction_length: int, chained_products: int = 3) -> float:
    """The relative error allowed for fp32 inputs whose products run as TF32 (fp32 accumulation).

    A TF32 operand keeps 10 of fp32's 23 mantissa bits; the tensor cores may truncate rather than round,
    so each operand carries a relative error of up to u = 2**-10. A product of two such operands: up to
    2u. Between the inputs and any output or gradient the kernels chain at most 3 products (phi(k)^T v
    summaries; their mixing by M; phi(q) times the mixed summary, or the backward's transposes of
    these), so up to 3 * 2u = 5.9e-3 per term. The fp32 sum over the reduction's L tokens adds about
    sqrt(L) * 2**-24 (1.1e-5 at L = 32,760: negligible). Errors of independent terms partly cancel, so
    the measured error is below this: 1.55e-3 and 1.60e-3 on an H100 (2026-11-26), where the first
    tolerance, 1e-3, was an exact-fp32 habit, not a TF32 number. A wrong kernel errs by O(1)."""
    u = 2.0**-10
    return chained_products * 2 * u + reduction_length**0.5 * 2.0**-24


def test_tf32_tolerance_is_derived():
    tol = tf32_tolerance(21 * 30 * 52)
    assert 1.60e-3 < tol < 1e-2  # above the H100's measured 1.60e-3, far below a wrong kernel's O(1)
    assert tf32_tolerance(10**6) - tf32_tolerance(1) < 1e-4  # the fp32 accumulation term stays small


def test_fused_fixed_launch_settings(gen, monkeypatch):
    # MHLA_AUTOTUNE=0: v2 with its fixed per-kernel settings (16-32 tokens per step: blocks of up to
    # 27 tokens take two steps, the second one masked)
    monkeypatch.setattr(triton_ops, "AUTOTUNE", False)
    layout = BlockLayout((3, 5, 13), (1, 2, 5))
    for normalize in (True, False):
        err, grad_errs = fused_vs_dense(gen, layout, torch.float32, normalize, True)
        assert err < 1e-4 and max(grad_errs) < 1e-4, (normalize, grad_errs)


def test_fused_per_head_elu_odd_sizes(gen):
    # head_dim 24 and value dim 20 are not powers of two: the kernels mask the padding
    layout = BlockLayout((2, 3, 7), (2, 1, 3))
    err, grad_errs = fused_vs_dense(gen, layout, torch.float32, True, True, "elu", per_head=True, d=24, e=20)
    assert err < 1e-4 and max(grad_errs) < 1e-4, grad_errs


def test_fused_linear_attention(gen):
    layout = BlockLayout((2, 4, 80), (1, 1, 1))  # 640 tokens -> the linear kernel cuts 2 chunks
    (q, k, v, _), rope = inputs(gen, layout, b=1)
    out = triton_ops.linear_attention_fused(
        q.float().to(DEVICE),
        k.float().to(DEVICE),
        v.float().to(DEVICE),
        rotary_emb=tuple(t.float().to(DEVICE) for t in rope),
    )
    assert rel_err(out, linear_attention_dense(q, k, v, rotary_emb=rope)) < 1e-4


def test_fused_dispatch_and_bad_input(gen):
    layout = BlockLayout((2, 4, 4), (1, 2, 2))
    (q, k, v, m), _ = inputs(gen, layout, b=1, h=1)
    q, k, v = (t.float().to(DEVICE) for t in (q, k, v))
    forced = mhla_attention(q, k, v, layout, m.float().to(DEVICE), impl="triton")
    torch.testing.assert_close(
        forced, mhla_attention(q, k, v, layout, m.float().to(DEVICE), impl="torch"), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(ValueError, match="unknown impl"):
        mhla_attention(q, k, v, layout, m.float(), impl="cuda")
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        triton_ops.mhla_attention_fused(q.double(), k.double(), v.double(), layout, m)
    with pytest.raises(ValueError, match="even head_dim"):
        triton_ops.mhla_attention_fused(q[..., :31], k[..., :31], v, layout, m)


def check_wan_grid(gen, grid, dtype, device, h, d, normalizes, tol, version="v2"):
    """Fused kernels on a Wan latent grid (with its default block layout) against the float64 PyTorch
    path (itself checked against the dense formula above), forward and gradients, and on a sample of
    query rows against the dense formula directly."""
    layout = BlockLayout.for_grid(grid)
    n = layout.num_tokens
    q, k, v = (torch.randn(1, n, h, d, generator=gen, dtype=torch.float64).to(device) for _ in range(3))
    m = locality_init(layout).to(device)
    angles = (torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64) * 6.28).repeat_interleave(2, -1)
    rope = (angles.cos().to(device), angles.sin().to(device))
    for normalize in normalizes:
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [m.float().requires_grad_()]
        out = triton_ops.mhla_attention_fused(
            *leaves[:3],
            layout,
            leaves[3],
            normalize=normalize,
            rotary_emb=tuple(t.float() for t in rope),
            version=version,
        )
        upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
        (out.double() * upstream).sum().backward()
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, m)]
        ref = mhla_attention(*ref_leaves[:3], layout, ref_leaves[3], normalize=normalize, rotary_emb=rope, impl="torch")
        (ref * upstream).sum().backward()
        assert rel_err(out, ref) < tol
        for a, b in zip(leaves, ref_leaves):
            assert rel_err(a.grad, b.grad) < tol
        rows = torch.randint(0, n, (64,), generator=gen).to(device)
        sub = layout.token_block.to(device)
        pair = m[sub[rows][:, None], sub[None, :]]
        phi = lambda x: torch.relu(x) + 1e-6  # noqa: E731
        from mhla.rope import apply_rotary

        fq, fk = phi(q), phi(k)
        rq, rk = apply_rotary(fq, rope), apply_rotary(fk, rope)
        for head in range(h):
            w = (rq[0, rows, head] @ rk[0, :, head].T) * pair
            num = w @ v[0, :, head]
            if normalize:
                num = num / (((fq[0, rows, head] @ fk[0, :, head].T) * pair).sum(-1, keepdim=True) + 1e-6)
            assert rel_err(out[0, rows, head], num) < tol


GPU_CASES = (
    # the autotuned launch on the even Wan grid (compiles every candidate setting once: the only tuned
    # case of the GPU tests), then the fixed settings in every dtype on the uneven Wan grid and a small
    # one, and v1
    [((21, 30, 50), torch.bfloat16, "v2", True)]
    + [(g, t, "v2", False) for t in (torch.bfloat16, torch.float16, torch.float32) for g in ((21, 30, 52), (5, 12, 20))]
    + [((21, 30, 52), torch.bfloat16, "v1", False)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("grid,dtype,version,tuned", GPU_CASES)
def test_fused_gpu_wan_grids(gen, monkeypatch, grid, dtype, version, tuned):
    """Compiled, head_dim 128, in every input dtype."""
    monkeypatch.setattr(triton_ops, "AUTOTUNE", tuned)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    check_wan_grid(gen, grid, dtype, "cuda", 2, 128, (True, False), tol, version=version)
    if tuned:
        assert {"summaries", "output", "backward_query", "backward_key"} <= triton_ops.tuned_launches().keys()


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [64 * 2**20, 0], ids=["mixed in the kernels", "mixing kernel"])
def test_fused_gpu_direct_launches(gen, monkeypatch, budget):
    """Compiled: from the second call on the kernels are launched through the compiled kernels kept by the
    first (no Triton launcher); the same numbers, forward and backward, with both ways of mixing (bf16)."""
    import warnings

    monkeypatch.setattr(triton_ops, "AUTOTUNE", False)
    monkeypatch.setattr(triton_ops, "MIX_IN_KERNEL_BYTES", budget)
    monkeypatch.setattr(triton_ops, "DIRECT_LAUNCH", True)
    triton_ops._DIRECT.clear()
    layout = BlockLayout((3, 16, 20), (1, 3, 3))
    (q, k, v, m), rope = inputs(gen, layout, b=2, h=4, d=128, e=128)
    rope = tuple(t.to(DEVICE, torch.float32) for t in rope)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "direct kernel launches turned off" would fail here
        for _ in range(3):
            leaves = [t.to(DEVICE, torch.bfloat16).requires_grad_() for t in (q, k, v)]
            out = triton_ops.mhla_attention_fused(
                *leaves, layout, m.to(DEVICE).float(), normalize=False, rotary_emb=rope
            )
            out.float().square().sum().backward()
            results.append([out.detach(), *(t.grad for t in leaves)])
            assert triton_ops._DIRECT, "no compiled kernel was kept"
    assert triton_ops.DIRECT_LAUNCH
    for first, later in zip(results[0], results[2]):
        assert torch.equal(first, later)  # the kernels are deterministic: direct launches change nothing
    ref = mhla_attention_dense(q, k, v, layout, m, normalize=False, rotary_emb=tuple(t.double().cpu() for t in rope))
    assert rel_err(results[2][0], ref) < 2e-2


@pytest.mark.skipif(DEVICE == "cuda", reason="the gpu test above covers these grids compiled")
@pytest.mark.parametrize("grid,normalize", [((21, 30, 52), True), ((21, 30, 50), False)])
def test_fused_wan_grids_interpreted(gen, grid, normalize):
    """The full 31,500 and 32,760-token grids (M = 105 blocks, uneven along W at 52) in Triton's
    interpreter: one head of dim 16, float32, about 20 s each on a 2-core CPU."""
    check_wan_grid(gen, grid, torch.float32, DEVICE, 1, 16, (normalize,), 1e-4)


def test_fused_out_dtype_float32_from_half_inputs(gen):
    layout = BlockLayout((2, 4, 6), (2, 2, 2))
    (q, k, v, m), rope = inputs(gen, layout, b=1)
    leaves = [t.to(DEVICE, torch.float16).requires_grad_() for t in (q, k, v)]
    out = triton_ops.mhla_attention_fused(
        *leaves, layout, m.float().to(DEVICE), normalize=False, out_dtype=torch.float32
    )
    assert out.dtype == torch.float32
    assert rel_err(out, mhla_attention_dense(q, k, v, layout, m, normalize=False)) < 5e-3
    out.square().mean().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float16 for t in leaves)


@pytest.mark.parametrize("kind", ["mhla", "linear"])
def test_dispatch_passes_out_dtype_to_the_kernels(gen, kind):
    # the converted Wan layers ask for a float32 output from half-precision q, k, v; the fused path
    # must honour it exactly as the PyTorch path does (it once returned float16 for MHLA)
    layout = BlockLayout((2, 4, 6), (2, 2, 2))
    (q, k, v, m), _ = inputs(gen, layout, b=1)
    half = [t.to(DEVICE, torch.float16) for t in (q, k, v)]
    for impl in ("triton", "torch"):
        if kind == "mhla":
            out = mhla_attention(*half, layout, m.float().to(DEVICE), impl=impl, out_dtype=torch.float32)
        else:
            out = linear_attention(*half, impl=impl, out_dtype=torch.float32)
        assert out.dtype == torch.float32, impl
    ref = mhla_attention_dense(q, k, v, layout, m) if kind == "mhla" else linear_attention_dense(q, k, v)
    assert rel_err(out, ref) < 5e-3


def test_fp16_summaries_do_not_overflow(gen):
    # 2,048 tokens whose values average 100: the global summary's entries reach about 8e4, past
    # float16's 65,504. The kernels must keep them in a wider type, as the PyTorch path does.
    n, d = 2048, 32
    q, k = (torch.randn(1, n, 1, d, generator=gen) for _ in range(2))
    v = torch.randn(1, n, 1, d, generator=gen) + 100
    half = [t.to(DEVICE, torch.float16) for t in (q, k, v)]
    layout = BlockLayout((2, 4, 256), (1, 2, 2))
    m = torch.ones(4, 4, device=DEVICE)  # unconstrained mixing: every block sums all summaries
    for normalize in (True, False):
        ref = linear_attention_dense(*(t.double() for t in half), normalize=normalize)
        out = triton_ops.linear_attention_fused(*half, normalize=normalize, out_dtype=torch.float32)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 5e-3, normalize
        ref = mhla_attention_dense(*(t.double() for t in half), layout, m.double(), normalize=normalize)
        out = triton_ops.mhla_attention_fused(*half, layout, m, normalize=normalize, out_dtype=torch.float32)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 5e-3, normalize


def strided_qkv(q, k, v, kind):
    """q, k, v as views that are not dense: ``"chunk"`` splits one fused projection (tokens x (q|k|v)
    channels, as a fused QKV linear layer writes them), ``"transpose"`` is a dense but permuted
    (batch, heads, tokens, dim) buffer seen as (batch, tokens, heads, dim)."""
    if kind == "chunk":
        fused = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)  # (B, N, H*D + H*D + H*E)
        hd, he = q.shape[2] * q.shape[3], v.shape[2] * v.shape[3]
        qs, ks, vs = fused.split([hd, hd, he], dim=-1)
        return qs.unflatten(2, q.shape[2:]), ks.unflatten(2, k.shape[2:]), vs.unflatten(2, v.shape[2:])
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))


@pytest.mark.parametrize("kind", ["chunk", "transpose"])
@pytest.mark.parametrize("normalize", [True, False])
def test_fused_strided_views(gen, kind, normalize):
    # the backward once wrote dq, dk, dv with the inputs' strides into contiguous buffers: out of
    # bounds for views of a fused QKV projection (the interpreter crashed, `mremap_chunk(): invalid
    # pointer`). Forward and every gradient against the dense formula, and the gradients' layout.
    layout = BlockLayout((2, 3, 7), (1, 2, 3))
    (q, k, v, m), rope = inputs(gen, layout, b=2, h=2, d=16, e=8)
    dense = [t.float().to(DEVICE) for t in (q, k, v)]
    views = strided_qkv(*dense, kind)
    leaves = [t.detach().requires_grad_() for t in views] if kind == "transpose" else None
    if kind == "chunk":  # the leaf is the fused buffer; q, k, v are views of it
        base = views[0]._base.detach().requires_grad_()
        hd = q.shape[2] * q.shape[3]
        qs, ks, vs = base.split([hd, hd, v.shape[2] * v.shape[3]], dim=-1)
        views = (qs.unflatten(2, q.shape[2:]), ks.unflatten(2, k.shape[2:]), vs.unflatten(2, v.shape[2:]))
    else:
        views = leaves
    assert not any(t.is_contiguous() for t in views)
    rope32 = tuple(t.float().to(DEVICE) for t in rope)
    out = triton_ops.mhla_attention_fused(*views, layout, m.float().to(DEVICE), normalize=normalize, rotary_emb=rope32)
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * upstream.to(DEVICE)).sum(), views)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mhla_attention_dense(*ref_leaves, layout, m, normalize=normalize, rotary_emb=rope)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), ref_leaves)
    assert rel_err(out, ref) < 1e-4
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape and rel_err(g, r) < 1e-4, name


@pytest.mark.parametrize("per_head,transpose", [(False, False), (True, True)])
def test_bf16_mixing_keeps_the_coefficients(gen, per_head, transpose):
    # v2 mixes bf16 summaries; the float32 coefficients must not be rounded to bf16 first (0.4% each,
    # while the normalizer sums mix with the float32 ones): the result is the exact mixture rounded
    # once. With the coefficients rounded, about 57% of the entries come out correctly rounded.
    b, h, blocks, width = 2, 3, 40, 256
    x = torch.randn(b * h, blocks, width, generator=gen).bfloat16()
    m = torch.rand((h, blocks, blocks) if per_head else (blocks, blocks), generator=gen)
    m = m / m.sum(-1, keepdim=True)
    mt = m.transpose(-1, -2) if transpose else m
    exact = (mt.double() @ x.double().reshape(b, h, blocks, width)).reshape(x.shape)
    mixed = triton_ops._mix(m, x, b, h, transpose=transpose)
    assert mixed.dtype == torch.bfloat16
    same = float((mixed == exact.bfloat16()).float().mean())
    assert same > 0.98, f"{same:.3f} of the mixed entries are the correctly rounded exact mixture"


def test_mixing_gradient_is_float32(gen):
    # dm = <dS~_i, S_b> over d*E products of bf16 summaries: float32 result, not rounded to bf16 (a bf16
    # result is off by about 2e-3 relative)
    d_mixed, summaries = (torch.randn(6, 40, 16, 16, generator=gen).bfloat16() for _ in range(2))
    exact = torch.bmm(d_mixed.flatten(2).double(), summaries.flatten(2).double().transpose(1, 2))
    dm = triton_ops._mixing_grad(d_mixed, summaries)
    assert dm.dtype == torch.float32 and rel_err(dm, exact) < 1e-5


def test_launch_arguments_follow_the_options(gen):
    # without the normalizer no z buffer is made (the kernels skip the key sums); RoPE halves are
    # bf16 for bf16 inputs only; linear attention keeps one summary per (batch, head), not M copies
    layout = BlockLayout((2, 4, 6), (2, 2, 2))
    (q, k, v, m), rope = inputs(gen, layout, b=1)
    for normalize in (True, False):
        leaves = [t.float().to(DEVICE).requires_grad_() for t in (q, k, v)]
        out = triton_ops.mhla_attention_fused(*leaves, layout, m.float().to(DEVICE), normalize=normalize)
        z = out.grad_fn.saved_tensors[5]
        assert z.numel() == (2 * layout.num_blocks * 32 if normalize else 1), normalize
    rope32 = tuple(t.float() for t in rope)
    for dtype, table in (
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
    ):
        cos, sin, _ = triton_ops._Geometry(q.to(dtype), v.to(dtype), layout, rope32, "v2").tables(rope32, q)
        assert cos.dtype == table and sin.dtype == table, dtype
        v1 = triton_ops._Geometry(q.to(dtype), v.to(dtype), layout, rope32, "v1").tables(rope32, q)
        assert v1[0].dtype == torch.float32
    summaries = torch.randn(2, 5, 32, 32)
    geo = triton_ops._Geometry(q, v, layout, None, "v2")
    shared, shared_z = triton_ops._mix_all(None, summaries, torch.randn(2, 5, 32), geo, True)
    assert shared.shape == (2, 1, 32, 32) and shared_z.shape == (2, 1, 32)
    torch.testing.assert_close(shared[:, 0], summaries.sum(1))


@pytest.mark.parametrize("normalize", [True, False])
def test_fused_linear_attention_backward(gen, normalize):
    # the query chunks share one summary (SHARED in the kernels), forward and backward
    layout = BlockLayout((1, 2, 300), (1, 1, 1))  # 600 tokens -> 2 chunks
    (q, k, v, _), rope = inputs(gen, layout, b=2, h=1, d=16, e=8)
    leaves = [t.float().to(DEVICE).requires_grad_() for t in (q, k, v)]
    rope32 = tuple(t.float().to(DEVICE) for t in rope)
    out = triton_ops.linear_attention_fused(*leaves, normalize=normalize, rotary_emb=rope32)
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * upstream.to(DEVICE)).sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = linear_attention_dense(*ref_leaves, normalize=normalize, rotary_emb=rope)
    (ref * upstream).sum().backward()
    assert rel_err(out, ref) < 1e-4
    for name, a, b in zip("qkv", leaves, ref_leaves):
        assert rel_err(a.grad, b.grad) < 1e-4, name


def test_batch_offsets_are_int64():
    # B*N*H*D passes 2^31 at realistic sizes (e.g. batch 8 of 480x832x81 with Wan 14B's 5,120 channels):
    # the offset of a batch element is formed in int64. Checked on the helper every kernel uses, in
    # the interpreter (which wraps int32 products as a GPU does: the control below shows it).
    import triton
    import triton.language as tl

    @triton.jit
    def probe(OUT, WRAPPED, stride, H, M):
        b, h, blk, bh, row = triton_kernels._program(H, M, False)
        tl.store(OUT + tl.program_id(0), b * stride + h)
        tl.store(WRAPPED + tl.program_id(0), (tl.program_id(0) // H) * stride)  # int32, as before

    if DEVICE != "cpu":
        pytest.skip("an interpreter check (the compiled kernels are the gpu tests' business)")
    stride, heads = 2**30 + 16, 2
    out = torch.zeros(3 * heads, dtype=torch.int64)
    wrapped = torch.zeros(3 * heads, dtype=torch.int32)
    probe[(3 * heads, 1)](out, wrapped, stride, heads, 1)
    expected = [(i // heads) * stride + i % heads for i in range(3 * heads)]
    assert out.tolist() == expected
    assert wrapped[2 * heads] == 2 * stride - 2**32  # the int32 product wraps


def test_in_sample_offsets_are_checked():
    # within one batch element offsets stay int32: the launcher refuses what passes 2^31 - 1, naming it
    n = 2**20 + 16
    big = torch.empty(1, n, 16, 128, device="meta")
    with pytest.raises(ValueError, match=r"q \(1, 1048592, 16, 128\).*spans 2147516415 elements"):
        triton_ops.linear_attention_fused(big, big, big)
    many = torch.empty(2**13, 1024, 2, 128, device="meta")  # 2^31 elements in all, small per element
    triton_ops.check_offsets("q", many)


def test_autotune_key_has_batch_and_feature_map():
    for name, tuner in triton_ops._TUNED.items():
        assert {"B", "N", "M", "FEATURE", "NORMALIZE", "PRECISION"} <= set(tuner.keys), name
        if name != "summaries":
            assert "SHARED" in tuner.keys, name

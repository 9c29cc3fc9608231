"""Every implementation of MHLA and linear attention against the straightforward formulation (mhla.naive),
forward and backward, over layouts (even, uneven, 1-D, one block), dtypes, normalizer and RoPE: the chunked
PyTorch path (mhla.ops), the dense O(N^2) formulas (mhla.reference) and, where Triton runs, the fused kernels.

The naive formulation is itself held to a reference written apart from the code in test_ops_chunked.py.
"""

import pytest
import torch

import mhla.ops as ops
from mhla import BlockLayout, linear_attention, mhla_attention
from mhla.naive import linear_attention_naive, mhla_attention_naive
from mhla.reference import linear_attention_dense, mhla_attention_dense

LAYOUTS = [((4, 6, 8), (2, 3, 2)), ((3, 5, 7), (2, 3, 4)), ((1, 1, 37), (1, 1, 6)), ((2, 3, 4), (1, 1, 1))]
# relative tolerance of outputs and gradients per input dtype (the paths accumulate in float32 or float64)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _triton_runs() -> bool:
    from mhla import triton_ops

    return triton_ops.available() and torch.cuda.is_available()


def mhla_paths():
    paths = {
        "chunked": lambda *a, **kw: mhla_attention(*a, impl="torch", **kw),
        "dense": mhla_attention_dense,
    }
    if _triton_runs():
        paths["fused"] = lambda *a, **kw: mhla_attention(*a, impl="triton", **kw)
    return paths


def inputs(gen, grid, blocks, dtype, b=2, h=2, d=8, e=6):
    n, m = grid[0] * grid[1] * grid[2], blocks[0] * blocks[1] * blocks[2]
    q, k = (torch.randn(b, n, h, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    v = torch.randn(b, n, h, e, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.rand(m, m, generator=gen, dtype=torch.float64) + 0.05
    mix = (w / w.sum(-1, keepdim=True)).float() if dtype != torch.float64 else w / w.sum(-1, keepdim=True)
    angles = torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64).repeat_interleave(2, -1) * 6.28
    rope = (angles.cos().float(), angles.sin().float()) if dtype != torch.float64 else (angles.cos(), angles.sin())
    return q, k, v, mix, rope


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def run(fn, q, k, v, *extra, **kw):
    """Output and the gradients of a fixed projection of it with respect to q, k, v and any tensor in ``extra``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, *extra)]
    out = fn(*leaves[:3], *leaves[3:], **kw)
    probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape).to(out.dtype)
    (out * probe).sum().backward()
    return out, [t.grad for t in leaves]


# the dense formulas are a float32/float64 diagnostic: no bfloat16 row for them
CASES = [(p, d) for p in mhla_paths() for d in TOLERANCE if not (p == "dense" and d == torch.bfloat16)]


@pytest.mark.parametrize("path,dtype", CASES)
@pytest.mark.parametrize("grid,blocks", LAYOUTS)
@pytest.mark.parametrize("normalize,use_rope", [(True, False), (False, True)])
def test_mhla_paths_match_naive(gen, path, dtype, grid, blocks, normalize, use_rope):
    q, k, v, mix, rope = inputs(gen, grid, blocks, dtype)
    layout = BlockLayout(grid, blocks)
    kw = dict(normalize=normalize, rotary_emb=rope if use_rope else None)
    want, want_grads = run(lambda q, k, v, m: mhla_attention_naive(q, k, v, layout, m, **kw), q, k, v, mix)
    got, got_grads = run(lambda q, k, v, m: mhla_paths()[path](q, k, v, layout, m, **kw), q, k, v, mix)
    assert got.dtype == want.dtype == dtype
    tol = TOLERANCE[dtype]
    assert rel_err(got, want) < tol
    for name, g, w in zip("qkvm", got_grads, want_grads):
        # with the normalizer the mixing gradient is a near-cancellation (0 for one block): compare absolutely
        scale = 1.0 if name == "m" and normalize else None
        err = float((g.double() - w.double()).abs().max()) if scale else rel_err(g, w)
        assert err < (tol * 10 if name == "m" else tol), (name, err)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize,use_rope", [(True, False), (False, True)])
@pytest.mark.parametrize("budget", [7, 4096])
def test_linear_paths_match_naive(gen, dtype, normalize, use_rope, budget, monkeypatch):
    monkeypatch.setattr(ops, "CHUNK_TOKEN_HEADS", budget)  # several chunks, and one
    q, k, v, _, rope = inputs(gen, (1, 1, 37), (1, 1, 1), dtype)
    args = ("relu", normalize, rope if use_rope else None, 1e-6, None)
    want, want_grads = run(lambda q, k, v: linear_attention_naive(q, k, v, *args), q, k, v)
    kw = dict(normalize=normalize, rotary_emb=rope if use_rope else None)
    paths = {"chunked": lambda q, k, v: linear_attention(q, k, v, impl="torch", **kw)}
    if dtype != torch.bfloat16:
        paths["dense"] = lambda q, k, v: linear_attention_dense(q, k, v, **kw)
    for name, fn in paths.items():
        got, got_grads = run(fn, q, k, v)
        assert rel_err(got, want) < TOLERANCE[dtype], name
        for g, w in zip(got_grads, want_grads):
            assert rel_err(g, w) < TOLERANCE[dtype], name

"""Efficient (linear-cost) MHLA and linear attention in plain PyTorch.

This is the CPU path and the reference for GPU kernels. Cost is O(N d^2 + M^2 d^2) time and
O(N d + M d^2) extra memory: nothing of size N x N is formed. Summaries accumulate in float32
(float64 for float64 inputs); the output has the input's dtype.

How the fast path works (CPU-bound; see ``benchmarks/results/attention_cpu_*.md`` for its speed):

- every block of an even layout is a strided view of the token-order tensors (an uneven layout is at
  most 8 evenly split boxes, :attr:`BlockLayout.even_boxes`), so there are no gathers, no padding and
  no ``index_put_`` in the backward;
- the tokens are processed in chunks of a few thousand token-heads: each chunk's phi, RoPE (one
  complex product on the half tables) and block-order packing write into small buffers that stay in
  the caches and are reused, so no temporary of the size of q is ever made (large temporaries cost
  page faults on every call, which dominated the previous formulation);
- one batched matrix product per chunk and pass, on contiguous operands;
- a hand-written backward (:class:`_MHLAFunction`) that recomputes phi and RoPE per chunk instead
  of keeping them, and saves only the block summaries.

The straightforward formulation (gather into block order, per-block summaries, mixing, scatter back)
is :mod:`mhla.naive`, beside the dense references: the tests hold every path to it, the benchmark times
it, and inputs the fast path does not take (RoPE tables that require a gradient, feature maps it does
not know) run through it.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .checks import check_eps, check_mixing, check_qkv, check_rotary_dtype  # noqa: F401 (re-exported)
from .feature_maps import RELU_EPS, get_feature_map
from .layout import BlockLayout, Grid, cached_layout
from .naive import (  # noqa: F401 (block_summaries, mix_summaries re-exported: code imports them from here)
    block_summaries,
    linear_attention_naive,
    mhla_attention_naive,
    mix_summaries,
)
from .rope import Rotary, check_rotary

IMPLS = ("auto", "torch", "triton")
_fused_failed = False  # set when the Triton kernels fail to build on this machine: warn once, use torch

# Token-heads per chunk of the PyTorch path (times the batch). A chunk's buffers (about five of
# CHUNK x head_dim elements) stay in the CPU's caches; far below glibc's 32 MB mmap threshold.
CHUNK_TOKEN_HEADS = 4096


def _use_fused(impl: str, q: torch.Tensor) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    from . import triton_ops

    return (
        q.is_cuda
        and triton_ops.available()
        and not _fused_failed
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.shape[-1] % 2 == 0
    )


def _run_fused(fn: Callable[..., torch.Tensor], *args: Any, impl: str, **kwargs: Any) -> torch.Tensor | None:
    """Runs a fused kernel; under ``impl="auto"`` a kernel that fails to build falls back to torch."""
    global _fused_failed
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any build/launch failure of the optional fast path
        if impl != "auto" or isinstance(e, (ValueError, torch.cuda.OutOfMemoryError)):
            raise
        _fused_failed = True
        warnings.warn(f"MHLA Triton kernels failed ({type(e).__name__}: {e}); using the PyTorch path", stacklevel=3)
        return None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


# ----------------------------------------------------------------------------------------------
# The chunked path


@dataclass(frozen=True)
class _Chunk:
    """A box of tokens processed at once: ``counts`` blocks along (F, H, W) starting at block
    ``block``, of which it covers ``sizes`` tokens per axis (the whole block, or part of one when a
    block alone exceeds the chunk), starting at token ``token``; heads ``heads``. ``first``: the first
    part of its blocks (writes their summaries; later parts add)."""

    token: tuple[int, int, int]
    block: tuple[int, int, int]
    counts: tuple[int, int, int]
    sizes: tuple[int, int, int]
    steps: tuple[int, int, int]
    heads: tuple[int, int]
    first: bool

    @property
    def num_blocks(self) -> int:
        return self.counts[0] * self.counts[1] * self.counts[2]

    @property
    def block_tokens(self) -> int:
        return self.sizes[0] * self.sizes[1] * self.sizes[2]


def _ranges(total: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(step, total - a)) for a in range(0, total, step)]


@lru_cache(maxsize=256)
def _plan(grid: Grid, blocks: Grid, heads: int, budget: int) -> tuple[_Chunk, ...]:
    """Chunks covering every token and head once, each about ``budget`` token-heads."""
    layout = cached_layout(grid, blocks)
    chunks = []
    for (tf, bf0, nf, lf), (ty, by0, nh, lh), (tx, bx0, nw, lw) in layout.even_boxes:
        steps = (lf, lh, lw)
        size = lf * lh * lw
        if size * heads <= budget:  # several whole blocks, all heads
            per = budget // (size * heads)
            cw = min(nw, per)
            ch = min(nh, max(1, per // cw)) if cw == nw else 1
            cf = min(nf, max(1, per // (cw * ch))) if ch == nh else 1
            for i, a in _ranges(nf, cf):
                for j, b in _ranges(nh, ch):
                    for m, c in _ranges(nw, cw):
                        token = (tf + i * lf, ty + j * lh, tx + m * lw)
                        chunks.append(
                            _Chunk(token, (bf0 + i, by0 + j, bx0 + m), (a, b, c), steps, steps, (0, heads), True)
                        )
            continue
        if size <= budget:  # one whole block, a group of heads
            group = budget // size
            for i in range(nf):
                for j in range(nh):
                    for m in range(nw):
                        token = (tf + i * lf, ty + j * lh, tx + m * lw)
                        for h, g in _ranges(heads, group):
                            chunks.append(
                                _Chunk(token, (bf0 + i, by0 + j, bx0 + m), (1, 1, 1), steps, steps, (h, h + g), True)
                            )
            continue
        # a block larger than the budget: parts of it, one head at a time
        if lh * lw <= budget:
            part = (budget // (lh * lw), lh, lw)
        elif lw <= budget:
            part = (1, budget // lw, lw)
        else:
            part = (1, 1, budget)
        for i in range(nf):
            for j in range(nh):
                for m in range(nw):
                    block = (bf0 + i, by0 + j, bx0 + m)
                    for h in range(heads):
                        first = True
                        for pf, sf in _ranges(lf, part[0]):
                            for py, sy in _ranges(lh, part[1]):
                                for px, sx in _ranges(lw, part[2]):
                                    token = (tf + i * lf + pf, ty + j * lh + py, tx + m * lw + px)
                                    chunks.append(
                                        _Chunk(token, block, (1, 1, 1), (sf, sy, sx), steps, (h, h + 1), first)
                                    )
                                    first = False
    return tuple(chunks)


def _token_view(x: torch.Tensor, c: _Chunk, grid: Grid) -> torch.Tensor:
    """The chunk of ``x`` ``(B, N, H, D)`` as ``(B, heads, bf, bh, bw, lf, lh, lw, D)`` (a strided view)."""
    sb, sn, sh, sd = x.stride()
    _, gh, gw = grid
    f0, y0, x0 = c.token
    plane, row = gh * gw * sn, gw * sn
    return x.as_strided(
        (x.shape[0], c.heads[1] - c.heads[0], *c.counts, *c.sizes, x.shape[3]),
        (sb, sh, c.steps[0] * plane, c.steps[1] * row, c.steps[2] * sn, plane, row, sn, sd),
        x.storage_offset() + f0 * plane + y0 * row + x0 * sn + c.heads[0] * sh,
    )


def _table_view(table: torch.Tensor, c: _Chunk, grid: Grid) -> torch.Tensor:
    """The chunk of the complex RoPE table ``(N, D/2)`` as ``(bf, bh, bw, lf, lh, lw, D/2)``."""
    _, gh, gw = grid
    sn = table.stride(0)
    f0, y0, x0 = c.token
    plane, row = gh * gw * sn, gw * sn
    return table.as_strided(
        (*c.counts, *c.sizes, table.shape[1]),
        (c.steps[0] * plane, c.steps[1] * row, c.steps[2] * sn, plane, row, sn, 1),
        f0 * plane + y0 * row + x0 * sn,
    )


def _summary_view(s: torch.Tensor, c: _Chunk) -> torch.Tensor:
    """The chunk's blocks of per-block tensors ``(B, H, bf, bh, bw, ...)``."""
    (i, j, m), (a, b, n) = c.block, c.counts
    return s[:, c.heads[0] : c.heads[1], i : i + a, j : j + b, m : m + n]


class _Buffers:
    """Flat scratch buffers reused by every chunk of one call."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, count: int) -> None:
        self.bufs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]

    def get(self, i: int, shape: Sequence[int]) -> torch.Tensor:
        return self.bufs[i][: math.prod(shape)].view(shape)


# The chunks run on worker threads that each use one intra-op thread, pulling chunks from a shared
# queue: no barrier between the many small ops (with PyTorch's own threads every op is a parallel
# region, and on a shared machine a descheduled thread stalls each one: measured 9 s instead of 0.3 s
# for a forward at 31,500 tokens under a load of 4 on 2 cores).
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _forget_pool_after_fork() -> None:
    # a forked child (e.g. a DataLoader worker) has none of the parent's threads: it makes its own pool
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _single_threaded() -> None:
    torch.zeros(1 << 17).add_(1)  # PyTorch initialises a thread's thread count at its first parallel op
    torch.set_num_threads(1)


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=True)
            threads = torch.get_num_threads()
            _pool = ThreadPoolExecutor(n, thread_name_prefix="mhla", initializer=_single_threaded)
            started = threading.Barrier(n + 1)  # start all n threads now (each runs the initializer)
            futures = [_pool.submit(started.wait) for _ in range(n)]
            started.wait()
            for f in futures:
                f.result()
            torch.set_num_threads(threads)  # the workers' setting is their own; keep the process default
            _pool_size = n
        return _pool


def _run(
    step: Callable[[_Chunk, _Buffers], None],
    plan: Sequence[_Chunk],
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    nbufs: int,
) -> None:
    """Calls ``step(chunk, buffers)`` for every chunk of ``plan``. Parts of one block (a chunk with
    ``first`` False and those before it) stay on one thread, in order, as they accumulate."""
    tasks: list[list[_Chunk]] = []
    for c in plan:
        if c.first or not tasks:
            tasks.append([c])
        else:
            tasks[-1].append(c)
    n = min(torch.get_num_threads(), len(tasks))
    if n <= 1 or device.type != "cpu":
        bufs = _Buffers(numel, dtype, device, nbufs)
        for task in tasks:
            for c in task:
                step(c, bufs)
        return
    queue = iter(tasks)
    lock = threading.Lock()

    def work() -> None:
        with torch.no_grad():
            bufs = _Buffers(numel, dtype, device, nbufs)
            while True:
                with lock:
                    task = next(queue, None)
                if task is None:
                    return
                for c in task:
                    step(c, bufs)

    for f in [_workers(n).submit(work) for _ in range(n)]:
        f.result()


def _phi_into(x: torch.Tensor, out: torch.Tensor, feature_map: str) -> torch.Tensor:
    """``out = phi(x)`` (``x`` a strided chunk view, ``out`` a packed buffer, same values as
    :mod:`mhla.feature_maps`)."""
    if feature_map == "relu" and x.dtype == out.dtype:
        torch.clamp(x, min=0, out=out)
    else:
        out.copy_(x)
        if feature_map == "relu":
            out.clamp_(min=0)
        else:
            F.elu_(out)
    return out.add_(RELU_EPS if feature_map == "relu" else 1.0)


def _rotate_into(x: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = x`` with interleaved channel pairs rotated: one complex product with ``table``."""
    torch.mul(
        torch.view_as_complex(x.unflatten(-1, (-1, 2))), table, out=torch.view_as_complex(out.unflatten(-1, (-1, 2)))
    )
    return out


def _phi_backward_into(
    grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor, feature_map: str, scratch: torch.Tensor
) -> None:
    """``out = grad * phi'(x)`` with the derivative autograd uses for relu / elu."""
    if x.dtype != grad.dtype:
        x = scratch.copy_(x)
    if feature_map == "relu":
        res = torch.ops.aten.threshold_backward(grad, x, 0)
    else:
        res = torch.ops.aten.elu_backward(grad, 1.0, 1, 1, False, x)
    out.copy_(res)


def _mix(mixing: torch.Tensor | None, s: torch.Tensor, transpose: bool = False, inplace: bool = False) -> torch.Tensor:
    """``sum_j m_ij s_j`` over the block axis of ``s`` ``(B, H, M, X)``; ``m^T`` when ``transpose``.
    ``inplace`` overwrites ``s`` a slice of X at a time (no second full-size tensor)."""
    if mixing is None:
        return s
    m = mixing.to(s.dtype)
    m = m.transpose(-1, -2) if transpose else m
    if m.dim() == 3:
        m = m.unsqueeze(0)
    if not inplace:
        return torch.matmul(m, s)
    # slices of ~2 MB: big enough for an efficient product, small enough to stay in the caches
    step = max(1, 524288 // max(1, s.shape[0] * s.shape[1] * s.shape[2]))
    for a in range(0, s.shape[-1], step):
        part = s[..., a : a + step]
        part.copy_(torch.matmul(m, part))
    return s


def _summaries(
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Sequence[_Chunk],
    grid: Grid,
    nblocks: Grid,
    table: torch.Tensor | None,
    feature_map: str,
    normalize: bool,
    dt: torch.dtype,
    numel: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-block ``S`` ``(B, H, M, D, E)`` and, with ``normalize``, ``z`` ``(B, H, M, D)``."""
    b, _, h, d = k.shape
    e = v.shape[-1]
    s = torch.empty(b, h, *nblocks, d, e, dtype=dt, device=k.device)
    z = torch.empty(b, h, *nblocks, d, dtype=dt, device=k.device) if normalize else None

    def step(c: _Chunk, bufs: _Buffers) -> None:
        hg, nb, lc = c.heads[1] - c.heads[0], c.num_blocks, c.block_tokens
        kv, vv = _token_view(k, c, grid), _token_view(v, c, grid)
        fk = _phi_into(kv, bufs.get(0, kv.shape), feature_map)
        rk = fk if table is None else _rotate_into(fk, _table_view(table, c, grid), bufs.get(1, kv.shape))
        vp = bufs.get(2, vv.shape).copy_(vv)
        part = torch.matmul(rk.view(b, hg, nb, lc, d).transpose(-1, -2), vp.view(b, hg, nb, lc, e))
        sv = _summary_view(s, c)
        (sv.copy_ if c.first else sv.add_)(part.view(sv.shape))
        if z is not None:  # with the normalizer
            zv = _summary_view(z, c)
            zpart = fk.view(b, hg, nb, lc, d).sum(dim=-2)
            (zv.copy_ if c.first else zv.add_)(zpart.view(zv.shape))

    _run(step, plan, numel, dt, k.device, 3)
    return s, z


def _outputs(
    q: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor | None,
    plan: Sequence[_Chunk],
    grid: Grid,
    table: torch.Tensor | None,
    feature_map: str,
    eps: float,
    out: torch.Tensor,
    numel: int,
) -> None:
    """``out`` (token order) from the mixed summaries ``s`` ``(B, H, bf, bh, bw, D, E)`` (and ``z``)."""
    b, _, h, d = q.shape
    e = s.shape[-1]

    def step(c: _Chunk, bufs: _Buffers) -> None:
        hg, nb, lc = c.heads[1] - c.heads[0], c.num_blocks, c.block_tokens
        qv = _token_view(q, c, grid)
        fq = _phi_into(qv, bufs.get(0, qv.shape), feature_map)
        rq = fq if table is None else _rotate_into(fq, _table_view(table, c, grid), bufs.get(1, qv.shape))
        sb = _summary_view(s, c).reshape(b, hg, nb, d, e)
        o = torch.matmul(rq.view(b, hg, nb, lc, d), sb, out=bufs.get(2, (b, hg, nb, lc, e)))
        if z is not None:
            zb = _summary_view(z, c).reshape(b, hg, nb, d, 1)
            den = torch.matmul(fq.view(b, hg, nb, lc, d), zb).add_(eps)
            o.div_(den)
        ov = _token_view(out, c, grid)
        ov.copy_(o.view(ov.shape))

    _run(step, plan, numel, s.dtype, q.device, 3)


class _MHLAFunction(torch.autograd.Function):
    """The chunked forward with a hand-written backward that recomputes phi and RoPE per chunk and
    keeps only the block summaries (``S``, ``S~`` and, with the normalizer, ``z``, ``z~``)."""

    @staticmethod
    def forward(
        ctx: Any,  # autograd's FunctionCtx, or _NoCtx without autograd
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mixing: torch.Tensor | None,
        plan: tuple[_Chunk, ...],
        grid: Grid,
        nblocks: Grid,
        table: torch.Tensor | None,
        feature_map: str,
        normalize: bool,
        eps: float,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        dt = _compute_dtype(q)
        b, n, h, d = q.shape
        m = math.prod(nblocks)
        numel = _max_chunk(plan, b, max(d, v.shape[-1]))
        s, z = _summaries(k, v, plan, grid, nblocks, table, feature_map, normalize, dt, numel)
        flat = (b, h, m, -1)
        keep = mixing is not None and ctx.needs_input_grad[3]  # S itself is needed for the mixing's gradient
        s_mixed = _mix(mixing, s.view(flat), inplace=not keep).view(s.shape)
        z_mixed = None if z is None else _mix(mixing, z.view(flat), inplace=not keep).view(z.shape)
        out = torch.empty(b, n, h, v.shape[-1], dtype=out_dtype, device=q.device)
        _outputs(q, s_mixed, z_mixed, plan, grid, table, feature_map, eps, out, numel)
        ctx.setup = (plan, grid, nblocks, feature_map, normalize, eps)
        ctx.save_for_backward(q, k, v, mixing, table, s if keep else None, s_mixed, z if keep else None, z_mixed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, grid, nblocks, feature_map, normalize, eps = ctx.setup
        q, k, v, mixing, table, s, s_mixed, z, z_mixed = ctx.saved_tensors
        dt = s_mixed.dtype
        b, n, h, d = q.shape
        e = v.shape[-1]
        m = math.prod(nblocks)
        numel = _max_chunk(plan, b, max(d, e))
        ds_mixed = torch.empty_like(s_mixed)
        dz_mixed = torch.empty_like(z_mixed) if normalize else None
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)

        # pass over the queries: dS~, dz~ and dq (the output is never kept: g . out comes from g S~^T)
        def query_step(c: _Chunk, bufs: _Buffers) -> None:
            hg, nb, lc = c.heads[1] - c.heads[0], c.num_blocks, c.block_tokens
            mat_d, mat_e = (b, hg, nb, lc, d), (b, hg, nb, lc, e)
            qv, gv = _token_view(q, c, grid), _token_view(grad, c, grid)
            fq = _phi_into(qv, bufs.get(0, qv.shape), feature_map)
            tv = None if table is None else _table_view(table, c, grid)
            rq = (fq if tv is None else _rotate_into(fq, tv, bufs.get(1, qv.shape))).view(mat_d)
            fq = fq.view(mat_d)
            gp = bufs.get(2, gv.shape).copy_(gv).view(mat_e)
            sb = _summary_view(s_mixed, c).reshape(b, hg, nb, d, e)
            u = torch.matmul(gp, sb.transpose(-1, -2), out=bufs.get(3, mat_d))  # g S~^T
            if dz_mixed is not None:  # with the normalizer
                zb = _summary_view(z_mixed, c).reshape(b, hg, nb, 1, d)
                den = torch.matmul(fq, zb.transpose(-1, -2)).add_(eps)  # (..., lc, 1)
                gp.div_(den)
                # d out / d den = -out / den, and g . out = (rq . g S~^T) / den
                gden = (rq * u).sum(dim=-1, keepdim=True).div_(den).div_(den).neg_()
                u.div_(den)
                dzv = _summary_view(dz_mixed, c)
                dzpart = torch.matmul(fq.transpose(-1, -2), gden)
                (dzv.copy_ if c.first else dzv.add_)(dzpart.view(dzv.shape))
            dsv = _summary_view(ds_mixed, c)
            dspart = torch.matmul(rq.transpose(-1, -2), gp)
            (dsv.copy_ if c.first else dsv.add_)(dspart.view(dsv.shape))
            dfq = u if tv is None else _rotate_into(u.view(qv.shape), tv.conj(), bufs.get(1, qv.shape)).view(mat_d)
            if normalize:
                dfq.addcmul_(gden, zb)
            _phi_backward_into(dfq.view(qv.shape), qv, _token_view(dq, c, grid), feature_map, bufs.get(0, qv.shape))

        _run(query_step, plan, numel, dt, q.device, 5)
        flat = (b, h, m, -1)
        dmix = None
        if mixing is not None and ctx.needs_input_grad[3]:
            # dm_ij = sum over the batch (and the heads, for a shared matrix) of <dS~_i, S_j> + <dz~_i, z_j>
            dmix = torch.matmul(ds_mixed.view(flat), s.view(flat).transpose(-1, -2))
            if dz_mixed is not None:  # with the normalizer
                dmix += torch.matmul(dz_mixed.view(flat), z.view(flat).transpose(-1, -2))
            dmix = dmix.sum(dim=(0, 1) if mixing.dim() == 2 else 0).to(mixing.dtype)
        ds = _mix(mixing, ds_mixed.view(flat), transpose=True, inplace=True).view(s_mixed.shape)
        dz = (
            None
            if dz_mixed is None
            else _mix(mixing, dz_mixed.view(flat), transpose=True, inplace=True).view(z_mixed.shape)
        )
        # pass over the keys and values: dk, dv
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)

        def key_step(c: _Chunk, bufs: _Buffers) -> None:
            hg, nb, lc = c.heads[1] - c.heads[0], c.num_blocks, c.block_tokens
            mat_d, mat_e = (b, hg, nb, lc, d), (b, hg, nb, lc, e)
            kv, vv = _token_view(k, c, grid), _token_view(v, c, grid)
            fk = _phi_into(kv, bufs.get(0, kv.shape), feature_map)
            tv = None if table is None else _table_view(table, c, grid)
            rk = (fk if tv is None else _rotate_into(fk, tv, bufs.get(1, kv.shape))).view(mat_d)
            vp = bufs.get(2, vv.shape).copy_(vv).view(mat_e)
            dsb = _summary_view(ds, c).reshape(b, hg, nb, d, e)
            dvp = torch.matmul(rk, dsb, out=bufs.get(3, mat_e))
            dvv = _token_view(dv, c, grid)
            dvv.copy_(dvp.view(dvv.shape))
            drk = torch.matmul(vp, dsb.transpose(-1, -2), out=bufs.get(4, mat_d))
            dfk = drk if tv is None else _rotate_into(drk.view(kv.shape), tv.conj(), bufs.get(1, kv.shape)).view(mat_d)
            if dz is not None:  # with the normalizer
                dfk.add_(_summary_view(dz, c).reshape(b, hg, nb, 1, d))
            _phi_backward_into(dfk.view(kv.shape), kv, _token_view(dk, c, grid), feature_map, bufs.get(0, kv.shape))

        _run(key_step, plan, numel, dt, k.device, 5)
        return dq, dk, dv, dmix, None, None, None, None, None, None, None, None


def _max_chunk(plan: Sequence[_Chunk], batch: int, width: int) -> int:
    return batch * width * max((c.heads[1] - c.heads[0]) * c.num_blocks * c.block_tokens for c in plan)


def _rope_table(rotary_emb: Rotary | None, dt: torch.dtype) -> torch.Tensor | None:
    """``(N, D/2)`` complex table ``cos[2i] + i sin[2i+1]``: rotating pair ``(x[2i], x[2i+1])`` as in
    :func:`mhla.rope.apply_rotary` is one complex product with it."""
    if rotary_emb is None:
        return None
    cos, sin = rotary_emb
    return torch.complex(cos[0, :, 0, 0::2].to(dt), sin[0, :, 0, 1::2].to(dt))


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor | None,
    feature_map: str,
    normalize: bool,
    rotary_emb: Rotary | None,
    eps: float,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    grid = layout.grid
    plan = _plan(grid, layout.blocks, q.shape[2], max(1, CHUNK_TOKEN_HEADS // q.shape[0]))
    table = _rope_table(rotary_emb, _compute_dtype(q))
    args = (q, k, v, mixing, plan, grid, layout.blocks, table, feature_map, normalize, eps, out_dtype or q.dtype)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, mixing)):
        return _MHLAFunction.apply(*args)
    with torch.no_grad():
        return _MHLAFunction.forward(_NoCtx(), *args)


class _NoCtx:
    """Stands in for autograd's ctx when no gradient is needed."""

    needs_input_grad = (False,) * 12

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        pass


def _takes_fast_path(feature_map: str, rotary_emb: Rotary | None) -> bool:
    get_feature_map(feature_map)  # raises on unknown names
    if feature_map not in ("relu", "elu"):
        return False
    return rotary_emb is None or not (torch.is_grad_enabled() and any(t.requires_grad for t in rotary_emb))


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
    impl: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Multi-head linear attention over spatiotemporal blocks.

    For a query token t in block i: ``phi(q_t) S~_i / (phi(q_t) . z~_i + eps)`` with
    ``S~_i = sum_b m_ib S_b`` and ``z~_i = sum_b m_ib z_b``; without the normalizer
    ``phi(q_t) S~_i``. RoPE, when given, rotates phi(q) and phi(k) in the numerator only.

    Args:
        q, k: ``(B, N, H, D)``; v: ``(B, N, H, E)``; tokens in (F, H, W) order of ``layout.grid``.
            Any strides (e.g. chunks of a fused projection); floating dtypes only.
        layout: the block layout, ``layout.num_tokens == N``.
        mixing: ``(M, M)`` or per-head ``(H, M, M)``, used exactly as given (constrain it beforehand,
            e.g. with :class:`mhla.MixingCoefficients`).
        rotary_emb: ``(cos, sin)``, each ``(1, N, 1, D)``, as diffusers' Wan passes it.
        eps: added to the normalizer; a finite number >= 0.
        impl: ``"auto"`` runs the fused Triton kernels on CUDA when Triton is present and this
            PyTorch path otherwise; ``"torch"`` or ``"triton"`` force one.
        out_dtype: dtype of the output (default: that of ``q``). ``torch.float32`` keeps an
            un-normalised output (it grows with the token count) out of float16's range limits while
            q, k, v stay in half precision.
    Returns:
        ``(B, N, H, E)`` in ``out_dtype``.

    Inputs are not checked for NaN or infinity here (that would cost a pass over q, k, v in every
    layer); the pipeline checks its latents after every denoising step.
    """
    check_qkv(q, k, v)
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if layout.num_tokens != q.shape[1]:
        g = layout.grid
        raise ValueError(f"token grid {g[0]}x{g[1]}x{g[2]} has {layout.num_tokens} tokens but q has {q.shape[1]}")
    check_mixing(mixing, layout.num_blocks, q.shape[2], q.device)
    check_rotary(rotary_emb, q.shape[1], q.shape[3])
    check_rotary_dtype(rotary_emb, q.device)
    eps = check_eps(eps)
    if _use_fused(impl, q):
        from .triton_ops import fused_attention

        out = _run_fused(
            fused_attention,
            *(q, k, v, layout, mixing.float(), feature_map, normalize, rotary_emb, eps, out_dtype, "v2"),
            impl=impl,
        )
        if out is not None:
            return out
    if not _takes_fast_path(feature_map, rotary_emb):
        return mhla_attention_naive(q, k, v, layout, mixing, feature_map, normalize, rotary_emb, eps, out_dtype)
    return _chunked(q, k, v, layout, mixing, feature_map, normalize, rotary_emb, eps, out_dtype)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
    impl: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Vanilla linear attention: ``phi(q_t) G / (phi(q_t) . z + eps)`` with one global
    ``G = sum_s phi(k_s)^T v_s`` and ``z = sum_s phi(k_s)``. Shapes, ``impl``, ``out_dtype`` and
    checks as :func:`mhla_attention`."""
    check_qkv(q, k, v)
    check_rotary(rotary_emb, q.shape[1], q.shape[3])
    check_rotary_dtype(rotary_emb, q.device)
    eps = check_eps(eps)
    if _use_fused(impl, q):
        from .triton_ops import fused_attention, linear_layout

        args = (q, k, v, linear_layout(q.shape[1]), None, feature_map, normalize, rotary_emb, eps, out_dtype, "v2")
        out = _run_fused(fused_attention, *args, impl=impl)
        if out is not None:
            return out
    if not _takes_fast_path(feature_map, rotary_emb):
        return linear_attention_naive(q, k, v, feature_map, normalize, rotary_emb, eps, out_dtype)
    layout = cached_layout((1, 1, q.shape[1]), (1, 1, 1))
    return _chunked(q, k, v, layout, None, feature_map, normalize, rotary_emb, eps, out_dtype)

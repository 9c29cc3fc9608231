"""Efficient (linear-cost) MHLA and linear attention in plain PyTorch.

This is the CPU path and the reference for GPU kernels. Cost is O(N d^2 + M^2 d^2) time and
O(N d + M d^2) extra memory: nothing of size N x N is formed. Summaries accumulate in float32
(float64 for float64 inputs); the output has the input's dtype.
"""

from __future__ import annotations

import warnings

import torch

from .feature_maps import get_feature_map
from .layout import BlockLayout
from .rope import Rotary, apply_rotary, check_rotary

IMPLS = ("auto", "torch", "triton")
_fused_failed = False  # set when the Triton kernels fail to build on this machine: warn once, use torch


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


def _run_fused(fn, *args, impl: str, **kwargs):
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


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ValueError unless q, k, v are ``(B, N, H, D)`` with matching batch, tokens and heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, tokens, heads, head_dim), got shape {tuple(t.shape)}")
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "q and k must have the same shape and v the same batch, tokens and heads; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def check_mixing(mixing: torch.Tensor, num_blocks: int, num_heads: int) -> None:
    ok = mixing.dim() == 2 or (mixing.dim() == 3 and mixing.shape[0] == num_heads)
    if not ok or mixing.shape[-2:] != (num_blocks, num_blocks):
        raise ValueError(
            f"mixing matrix has shape {tuple(mixing.shape)}, expected ({num_blocks}, {num_blocks}) "
            f"or per-head ({num_heads}, {num_blocks}, {num_blocks}) for a layout of M={num_blocks} blocks"
        )


def _to_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``(B, N, H, D)`` -> ``(B, M, L, H, D)`` in block order; padded slots are zero."""
    index = layout.on("gather_index", x.device)
    if not layout.is_even:
        x = torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)
    return x[:, index]


def _from_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``(B, M, L, H, D)`` -> ``(B, N, H, D)`` in token order (padded slots dropped)."""
    flat = x.flatten(1, 2)
    return flat.index_select(1, layout.on("scatter_index", x.device))


def block_summaries(fk: torch.Tensor, v: torch.Tensor, layout: BlockLayout, fk_rope: torch.Tensor | None = None):
    """Per-block key-value summaries.

    Args:
        fk: ``(B, N, H, D)`` feature-mapped keys, phi(k).
        v: ``(B, N, H, E)`` values.
        fk_rope: ``(B, N, H, D)`` RoPE'd phi(k) for the numerator, when RoPE is on.
    Returns:
        ``S`` ``(B, M, H, D, E)`` = sum over tokens s of block b of phi(k_s)^T v_s, and
        ``z`` ``(B, M, H, D)`` = sum of phi(k_s) (never RoPE'd).
    """
    kb = _to_blocks(fk, layout)
    vb = _to_blocks(v, layout)
    kn = kb if fk_rope is None else _to_blocks(fk_rope, layout)
    summaries = torch.einsum("bmlhd,bmlhe->bmhde", kn, vb)
    return summaries, kb.sum(dim=2)


def mix_summaries(mixing: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """``S~_i = sum_b m_ib S_b`` for ``summaries`` ``(B, M, H, ...)`` and ``mixing`` ``(M, M)`` or ``(H, M, M)``."""
    m = mixing.to(summaries.dtype)
    if m.dim() == 2:
        b, n, h = summaries.shape[:3]
        return (m @ summaries.reshape(b, n, -1)).reshape(summaries.shape)
    return torch.einsum("hij,bjh...->bih...", m, summaries)


def _features(q, k, feature_map: str, rotary_emb: Rotary | None):
    dt = _compute_dtype(q)
    phi = get_feature_map(feature_map)
    fq, fk = phi(q.to(dt)), phi(k.to(dt))
    if rotary_emb is None:
        return fq, fk, fq, fk
    rope = tuple(t.to(dt) for t in rotary_emb)
    return fq, fk, apply_rotary(fq, rope), apply_rotary(fk, rope)


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
        layout: the block layout, ``layout.num_tokens == N``.
        mixing: ``(M, M)`` or per-head ``(H, M, M)``, used exactly as given (constrain it beforehand,
            e.g. with :class:`mhla.MixingCoefficients`).
        rotary_emb: ``(cos, sin)``, each ``(1, N, 1, D)``, as diffusers' Wan passes it.
        impl: ``"auto"`` runs the fused Triton kernels on CUDA when Triton is present and this
            PyTorch path otherwise; ``"torch"`` or ``"triton"`` force one.
        out_dtype: dtype of the output (default: that of ``q``). ``torch.float32`` keeps an
            un-normalised output (it grows with the token count) out of float16's range limits while
            q, k, v stay in half precision.
    Returns:
        ``(B, N, H, E)`` in ``out_dtype``.
    """
    check_qkv(q, k, v)
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if layout.num_tokens != q.shape[1]:
        g = layout.grid
        raise ValueError(f"token grid {g[0]}x{g[1]}x{g[2]} has {layout.num_tokens} tokens but q has {q.shape[1]}")
    check_mixing(mixing, layout.num_blocks, q.shape[2])
    check_rotary(rotary_emb, q.shape[1], q.shape[3])
    if _use_fused(impl, q):
        from .triton_ops import mhla_attention_fused

        out = _run_fused(
            mhla_attention_fused,
            *(q, k, v, layout, mixing, feature_map, normalize, rotary_emb, eps, out_dtype),
            impl=impl,
        )
        if out is not None:
            return out

    fq, fk, rq, rk = _features(q, k, feature_map, rotary_emb)
    v32 = v.to(fq.dtype)
    summaries, z = block_summaries(fk, v32, layout, None if rotary_emb is None else rk)
    summaries = mix_summaries(mixing, summaries)
    qb = _to_blocks(rq, layout)
    out = torch.einsum("bmlhd,bmhde->bmlhe", qb, summaries)
    if normalize:
        z = mix_summaries(mixing, z)
        den = torch.einsum("bmlhd,bmhd->bmlh", qb if rotary_emb is None else _to_blocks(fq, layout), z)
        out = out / (den[..., None] + eps)
    return _from_blocks(out, layout).to(out_dtype or q.dtype)


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
    ``G = sum_s phi(k_s)^T v_s`` and ``z = sum_s phi(k_s)``. Shapes, ``impl`` and ``out_dtype`` as
    :func:`mhla_attention`."""
    check_qkv(q, k, v)
    check_rotary(rotary_emb, q.shape[1], q.shape[3])
    if _use_fused(impl, q):
        from .triton_ops import linear_attention_fused

        out = _run_fused(linear_attention_fused, q, k, v, feature_map, normalize, rotary_emb, eps, out_dtype, impl=impl)
        if out is not None:
            return out
    fq, fk, rq, rk = _features(q, k, feature_map, rotary_emb)
    summary = torch.einsum("bnhd,bnhe->bhde", rk, v.to(fq.dtype))
    out = torch.einsum("bnhd,bhde->bnhe", rq, summary)
    if normalize:
        den = torch.einsum("bnhd,bhd->bnh", fq, fk.sum(dim=1))
        out = out / (den[..., None] + eps)
    return out.to(out_dtype or q.dtype)

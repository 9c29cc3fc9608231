"""MHLA and linear attention in their straightforward formulation: the math in a few plain lines.

Linear cost like :mod:`mhla.ops` (nothing of size N x N: that is :mod:`mhla.reference`), but written for
reading, not speed: gather the tokens into block order (padded to the largest block), per-block summaries
``S_b = sum_{s in b} phi(k_s)^T v_s``, mixing ``S~_i = sum_b m_ib S_b``, one einsum per output, scatter back.
Plain autograd. The tests compare every other path (the chunked PyTorch path of :mod:`mhla.ops`, the fused
Triton kernels) with it, forward and backward; the benchmark times it as its "naive" row; and
:func:`mhla.mhla_attention` falls back to it for inputs the fast path does not take.
"""

from __future__ import annotations

import torch

from .feature_maps import get_feature_map
from .layout import BlockLayout
from .rope import Rotary, apply_rotary


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


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


def block_summaries(
    fk: torch.Tensor, v: torch.Tensor, layout: BlockLayout, fk_rope: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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


def _features(
    q: torch.Tensor, k: torch.Tensor, feature_map: str, rotary_emb: Rotary | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dt = _compute_dtype(q)
    phi = get_feature_map(feature_map)
    fq, fk = phi(q.to(dt)), phi(k.to(dt))
    if rotary_emb is None:
        return fq, fk, fq, fk
    cos, sin = (t.to(dt) for t in rotary_emb)
    rope = (cos, sin)
    return fq, fk, apply_rotary(fq, rope), apply_rotary(fk, rope)


def mhla_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The straightforward formulation of :func:`mhla_attention` (same arguments, no checks): gather
    the tokens into block order (padded to the largest block), per-block summaries, mixing, one
    einsum per output, scatter back. Plain autograd; kept as the benchmark's "naive" row."""
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


def linear_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str,
    normalize: bool,
    rotary_emb: Rotary | None,
    eps: float,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The straightforward formulation of :func:`mhla.linear_attention` (same arguments, no checks): one
    global summary ``G = sum_s phi(k_s)^T v_s``, ``out_t = phi(q_t) G`` (divided by ``phi(q_t) . z + eps``)."""
    fq, fk, rq, rk = _features(q, k, feature_map, rotary_emb)
    summary = torch.einsum("bnhd,bnhe->bhde", rk, v.to(fq.dtype))
    out = torch.einsum("bnhd,bhde->bnhe", rq, summary)
    if normalize:
        den = torch.einsum("bnhd,bhd->bnh", fq, fk.sum(dim=1))
        out = out / (den[..., None] + eps)
    return out.to(out_dtype or q.dtype)

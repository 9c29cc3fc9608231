"""Dense O(N^2) reference implementations, written straight from the formulas.

Only for tests and diagnostics: they form the full N x N attention matrix. All take and return
``(batch, tokens, heads, head_dim)`` tensors and compute in float64 when given float64.
"""

from __future__ import annotations

import math

import torch

from .feature_maps import get_feature_map
from .layout import BlockLayout
from .rope import Rotary, apply_rotary


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def softmax_attention_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``out_t = sum_s softmax_s(q_t . k_s * scale) v_s`` with ``scale = 1/sqrt(d)`` by default."""
    dt = _compute_dtype(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q.to(dt), k.to(dt)) * scale
    return torch.einsum("bhts,bshd->bthd", scores.softmax(dim=-1), v.to(dt)).to(q.dtype)


def mhla_weights_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    feature_map: str = "relu",
    rotary_emb: Rotary | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised MHLA weights ``(B, H, N, N)``: numerator ``m_{b(t)b(s)} phi(q_t).phi(k_s)``
    (RoPE on phi(q), phi(k) when given) and normalizer weights (never RoPE'd)."""
    dt = _compute_dtype(q)
    phi = get_feature_map(feature_map)
    fq, fk = phi(q.to(dt)), phi(k.to(dt))
    idx = layout.token_block.to(q.device)
    mix = mixing.to(dt)
    # (H or 1, N, N) mixing weight between the blocks of t and s
    pair = mix[..., idx[:, None], idx[None, :]]
    if pair.dim() == 2:
        pair = pair[None]
    den_w = torch.einsum("bthd,bshd->bhts", fq, fk) * pair
    if rotary_emb is not None:
        cos, sin = (t.to(dt) for t in rotary_emb)
        fq, fk = apply_rotary(fq, (cos, sin)), apply_rotary(fk, (cos, sin))
    num_w = torch.einsum("bthd,bshd->bhts", fq, fk) * pair
    return num_w, den_w


def mhla_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Paper Eq. 5: ``out_t = sum_s m_{b(t)b(s)} phi(q_t).phi(k_s) v_s / (sum_s m_{b(t)b(s)} phi(q_t).phi(k_s) + eps)``.

    ``mixing`` is ``(M, M)`` or per-head ``(H, M, M)``, used as given. Without the normalizer the
    output is the numerator alone.
    """
    dt = _compute_dtype(q)
    num_w, den_w = mhla_weights_dense(q, k, layout, mixing, feature_map, rotary_emb)
    out = torch.einsum("bhts,bshd->bthd", num_w, v.to(dt))
    if normalize:
        out = out / (den_w.sum(dim=-1).transpose(1, 2)[..., None] + eps)
    return out.to(q.dtype)


def linear_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Vanilla linear attention: every query sees one global summary (MHLA with a single block)."""
    n = q.shape[1]
    layout = BlockLayout((1, 1, n), (1, 1, 1))
    ones = torch.ones(1, 1, dtype=torch.float64, device=q.device)
    return mhla_attention_dense(q, k, v, layout, ones, feature_map, normalize, rotary_emb, eps)

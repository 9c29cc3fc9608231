"""Expressivity diagnostics: rank and entropy of attention-weight matrices (paper Sec. 3.2, Fig. 3b).

Linear attention's N x N weight matrix ``A = phi(Q) phi(K)^T`` (row-normalised) has rank <= d and
drifts towards uniform rows (high entropy) as N grows; MHLA's rank is bounded by
``sum_b min(n_b, d)`` instead. These functions form N x N matrices: use them on small N.
"""

from __future__ import annotations

import math

import torch

from .layout import BlockLayout
from .reference import mhla_weights_dense

ATTENTION_KINDS = ("softmax", "linear", "mhla")


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    kind: str,
    layout: BlockLayout | None = None,
    mixing: torch.Tensor | None = None,
    feature_map: str = "relu",
    scale: float | None = None,
) -> torch.Tensor:
    """Row-stochastic attention weights ``(N, N)`` for single-head ``q``, ``k`` of shape ``(N, d)``."""
    if q.dim() != 2 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (tokens, head_dim), got {tuple(q.shape)} and {tuple(k.shape)}")
    n, d = q.shape
    q64, k64 = q.double(), k.double()
    if kind == "softmax":
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        return (q64 @ k64.T * scale).softmax(dim=-1)
    if kind == "linear":
        layout, mixing = BlockLayout((1, 1, n), (1, 1, 1)), torch.ones(1, 1, dtype=torch.float64)
    elif kind == "mhla":
        if layout is None or mixing is None:
            raise ValueError("kind='mhla' needs a layout and a mixing matrix")
    else:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {ATTENTION_KINDS}")
    w, _ = mhla_weights_dense(q64[None, :, None], k64[None, :, None], layout, mixing.double(), feature_map)
    w = w[0, 0]
    return w / w.sum(dim=-1, keepdim=True)


def rank_and_entropy(weights: torch.Tensor, rtol: float = 1e-8) -> tuple[int, float]:
    """Numerical rank (singular values above ``rtol * largest``) and mean row entropy in nats."""
    s = torch.linalg.svdvals(weights)
    rank = int((s > rtol * s[0]).sum())
    p = weights.clamp_min(1e-300)
    entropy = float(-(weights * p.log()).sum(dim=-1).mean())
    return rank, entropy


def expressivity(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    feature_map: str = "relu",
) -> dict[str, dict[str, float]]:
    """Rank and mean row entropy of softmax, linear and MHLA attention for ``q``, ``k`` ``(N, d)``.

    Returns ``{kind: {"rank": int, "entropy": nats, "max_entropy": log N}}``.
    """
    out = {}
    for kind in ATTENTION_KINDS:
        w = attention_weights(q, k, kind, layout, mixing, feature_map)
        rank, ent = rank_and_entropy(w)
        out[kind] = {"rank": rank, "entropy": ent, "max_entropy": math.log(q.shape[0])}
    return out

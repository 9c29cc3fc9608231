"""Checks of the operator's inputs, shared by the PyTorch path (:mod:`mhla.ops`) and the fused kernels'
layer (:mod:`mhla.triton_ops`): each raises ValueError naming the bad value and what was expected."""

from __future__ import annotations

import math

import torch

from .rope import Rotary


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ValueError unless q, k, v are floating ``(B, N, H, D)`` with matching batch, tokens and
    heads and a batch of at least 1."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor (batch, tokens, heads, head_dim), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, tokens, heads, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype (float32, bfloat16, float16, float64), got {t.dtype}")
    if q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "q and k must have the same shape and v the same batch, tokens and heads; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] < 1:
        raise ValueError(f"q, k, v have batch size {q.shape[0]}, expected at least 1 (shape {tuple(q.shape)})")


def check_mixing(mixing: torch.Tensor, num_blocks: int, num_heads: int) -> None:
    if not isinstance(mixing, torch.Tensor):
        raise ValueError(f"mixing must be a tensor of shape ({num_blocks}, {num_blocks}), got {type(mixing).__name__}")
    ok = mixing.dim() == 2 or (mixing.dim() == 3 and mixing.shape[0] == num_heads)
    if not ok or mixing.shape[-2:] != (num_blocks, num_blocks):
        raise ValueError(
            f"mixing matrix has shape {tuple(mixing.shape)}, expected ({num_blocks}, {num_blocks}) "
            f"or per-head ({num_heads}, {num_blocks}, {num_blocks}) for a layout of M={num_blocks} blocks"
        )
    if not mixing.is_floating_point():
        raise ValueError(f"mixing matrix must have a floating dtype, got {mixing.dtype}")


def check_eps(eps: float) -> float:
    """``eps`` as a float; ValueError unless it is a finite number >= 0."""
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return value


def check_rotary_dtype(rotary_emb: Rotary | None) -> None:
    if rotary_emb is None:
        return
    for name, t in zip(("cos", "sin"), rotary_emb):
        if not t.is_floating_point():
            raise ValueError(f"rotary_emb {name} must have a floating dtype, got {t.dtype}")

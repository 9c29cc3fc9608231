"""Rotary position embedding in the form diffusers' Wan passes it to attention processors."""

from __future__ import annotations

import torch

Rotary = tuple[torch.Tensor, torch.Tensor]


def check_rotary(rotary_emb: Rotary | None, num_tokens: int, head_dim: int) -> None:
    """Raises ValueError unless ``rotary_emb`` is ``(cos, sin)`` broadcastable to ``(1, N, 1, D)``."""
    if rotary_emb is None:
        return
    if not (isinstance(rotary_emb, (tuple, list)) and len(rotary_emb) == 2):
        raise ValueError("rotary_emb must be a (cos, sin) pair of tensors shaped (1, tokens, 1, head_dim)")
    for name, t in zip(("cos", "sin"), rotary_emb):
        if t.dim() != 4 or t.shape[1] != num_tokens or t.shape[3] != head_dim or t.shape[0] != 1 or t.shape[2] != 1:
            raise ValueError(f"rotary_emb {name} has shape {tuple(t.shape)}, expected (1, {num_tokens}, 1, {head_dim})")
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")


def apply_rotary(x: torch.Tensor, rotary_emb: Rotary) -> torch.Tensor:
    """Rotates interleaved channel pairs ``(x[2i], x[2i+1])`` of ``x`` ``(B, N, H, D)``.

    Same convention as diffusers' ``WanAttnProcessor``: ``cos`` is read at even channels,
    ``sin`` at odd channels. The result has the dtype of the wider of ``x`` and ``cos``.
    """
    cos, sin = rotary_emb
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = cos[..., 0::2]
    sin = sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

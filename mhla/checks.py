"""Checks of the operator's inputs, shared by the PyTorch path (:mod:`mhla.ops`) and the fused kernels'
layer (:mod:`mhla.triton_ops`): each raises ValueError naming the bad value and what was expected."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

import torch

from .rope import Rotary

# torch.compile of a transformer (mhla.compiled.compile_transformer): its repeated blocks or the whole forward.
# Here, not in mhla.compiled, so that a command line can offer them without registering the custom ops.
COMPILE_MODES = ("blocks", "full")


def check_compile_mode(mode: str) -> None:
    """Raises ValueError unless ``mode`` is one of :data:`COMPILE_MODES`."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ValueError unless q, k, v are floating ``(B, N, H, D)`` on one device, with matching batch,
    tokens and heads, a batch of at least 1 and at least one head."""
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
    if q.shape[2] < 1 or q.shape[3] < 1 or v.shape[3] < 1:
        raise ValueError(
            f"q, k, v need at least one head and one channel per head; got q {tuple(q.shape)}, v {tuple(v.shape)} "
            "(batch, tokens, heads, head_dim)"
        )
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")


def check_grid(grid: Iterable[object]) -> tuple[int, int, int]:
    """``grid`` as three ints ``(frames, height, width)``, each >= 1; ValueError for anything else (a float,
    even 5.0, a bool, a string): a fractional grid would otherwise be truncated into another layout."""
    try:
        values = tuple(grid)
    except TypeError:
        raise ValueError(f"grid must be three integers (frames, height, width), got {grid!r}") from None
    ints = []
    for x in values:
        if isinstance(x, bool | float | str) or (isinstance(x, torch.Tensor) and x.is_floating_point()):
            raise ValueError(f"grid must be three integers (frames, height, width), got {grid!r}")
        try:
            ints.append(operator.index(x))  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(f"grid must be three integers (frames, height, width), got {grid!r}") from None
    if len(ints) != 3 or min(ints) < 1:
        raise ValueError(f"grid must be three positive integers (frames, height, width), got {grid!r}")
    return (ints[0], ints[1], ints[2])


def check_mixing(mixing: torch.Tensor, num_blocks: int, num_heads: int, device: torch.device | None = None) -> None:
    """Raises ValueError unless ``mixing`` is a floating ``(M, M)`` or per-head ``(H, M, M)`` tensor on
    ``device`` (that of q, k, v, when given)."""
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
    if device is not None and mixing.device != device:
        raise ValueError(f"mixing matrix is on {mixing.device} but q, k, v are on {device}; expected one device")


def check_eps(eps: float) -> float:
    """``eps`` as a float; ValueError unless it is a finite number >= 0."""
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return value


def check_rotary_dtype(rotary_emb: Rotary | None, device: torch.device | None = None) -> None:
    """Raises ValueError unless ``cos`` and ``sin`` are floating and on ``device`` (that of q, k, v, when given)."""
    if rotary_emb is None:
        return
    for name, t in zip(("cos", "sin"), rotary_emb):
        if not t.is_floating_point():
            raise ValueError(f"rotary_emb {name} must have a floating dtype, got {t.dtype}")
        if device is not None and t.device != device:
            raise ValueError(f"rotary_emb {name} is on {t.device} but q, k, v are on {device}; expected one device")

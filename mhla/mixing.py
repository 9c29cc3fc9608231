"""Multi-head mixing coefficients: the learnable M x M matrix that mixes block summaries.

Row ``i`` says how query block ``i`` weighs the key-value summaries of all blocks.
The paper (Sec. 4.2) initialises it towards locality and keeps it non-negative and
row-normalised; :class:`MixingCoefficients` enforces both on every use, so no optimiser
step can produce negative or unnormalised mixing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import cast

import torch
from torch import nn

from .layout import BlockLayout, Grid

MIXING_INITS = ("locality", "uniform", "locality_columns")


def locality_init(layout: BlockLayout, units: str = "block") -> torch.Tensor:
    """``(M, M)`` float64 locality-biased mixing: ``m_ij ~ 1 - dist(i, j) / max_k dist(i, k)``.

    ``dist`` is the Euclidean distance between block centres (``units`` as in
    :meth:`BlockLayout.block_centres`); each row is normalised to sum to 1. The farthest block of
    each row gets 0 and the block itself the largest weight. With a single block the matrix is [[1]].
    """
    centres = layout.block_centres(units)
    dist = torch.cdist(centres, centres)
    far = dist.max(dim=1, keepdim=True).values
    m = torch.where(far > 0, 1.0 - dist / far.clamp_min(1e-300), torch.ones_like(dist))
    return m / m.sum(dim=1, keepdim=True)


def locality_columns_init(layout: BlockLayout, units: str = "block") -> torch.Tensor:
    """``(M, M)`` float64 locality mixing as the MHLA authors' code initialises it (not the paper's rule).

    ``m_ij ~ 1 - dist(i, j) / max dist`` with one global maximum distance, each *column* normalised to
    sum to 1 (rows of the result do not sum to 1). Only for reproducing their training recipe; our
    conversions use :func:`locality_init`. With a single block the matrix is [[1]].
    """
    centres = layout.block_centres(units)
    dist = torch.cdist(centres, centres)
    far = dist.max()
    m = 1.0 - dist / far if far > 0 else torch.ones_like(dist)
    return m / m.sum(dim=0, keepdim=True)


def uniform_init(num_blocks: int) -> torch.Tensor:
    """``(M, M)`` float64 uniform mixing: every block sees the mean of all summaries."""
    return torch.full((num_blocks, num_blocks), 1.0 / num_blocks, dtype=torch.float64)


def constrain_mixing(raw: torch.Tensor) -> torch.Tensor:
    """Clamps into [0, 1] and renormalises each row (last dim) to sum to 1.

    A row that is all zero after clamping falls back to uniform mixing rather than dividing by
    zero. Works on ``(M, M)`` and per-head ``(H, M, M)`` matrices.
    """
    m = raw.clamp(0.0, 1.0)
    total = m.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(m, 1.0 / m.shape[-1])
    return torch.where(total > 0, m / total.clamp_min(torch.finfo(m.dtype).tiny), uniform)


_REUSE_SCOPE = [0]  # 0: off; else the id of the innermost reuse_constrained_mixing() scope
_SCOPES = itertools.count(1)


@contextmanager
def reuse_constrained_mixing() -> Iterator[None]:
    """Within it, each :class:`MixingCoefficients` computes its (constrained) matrix once, when no gradient
    is taken, and hands the same tensor to every later call (a pipeline's denoising loop: 5 small kernel
    launches fewer per layer and step, and the fused kernels' cached operands hit). For code whose weights do
    not change inside (inference): an in-place change through ``.data`` would not be seen; an ordinary
    in-place update (an optimiser's, ``load_state_dict``) is. A new scope always computes afresh."""
    before = _REUSE_SCOPE[0]
    _REUSE_SCOPE[0] = next(_SCOPES)
    try:
        yield
    finally:
        _REUSE_SCOPE[0] = before


class MixingCoefficients(nn.Module):
    """Learnable mixing matrix of one attention layer.

    Args:
        layout: the block layout; only its number of blocks and block centres are used.
        init: ``"locality"`` (paper default), ``"uniform"`` (ablation, paper Table 7a) or
            ``"locality_columns"`` (the authors' code: global max distance, columns normalised).
        units: distance units of the locality init, ``"block"`` or ``"token"``.
        learnable: ``False`` freezes the coefficients (stored as a buffer, still saved).
        per_head: one matrix per attention head, shape ``(H, M, M)``, instead of one shared ``(M, M)``.
        num_heads: required when ``per_head``.
        constrain: enforce non-negativity and row normalisation on every use (the paper's rule).
            ``False`` uses the stored matrix as it is; only for reproducing checkpoints trained that way.

    ``forward()`` returns the matrix to use, float32, shape ``(M, M)`` or ``(H, M, M)``.
    """

    def __init__(
        self,
        layout: BlockLayout,
        init: str = "locality",
        units: str = "block",
        learnable: bool = True,
        per_head: bool = False,
        num_heads: int | None = None,
        constrain: bool = True,
    ):
        super().__init__()
        if init == "locality":
            matrix = locality_init(layout, units)
        elif init == "uniform":
            matrix = uniform_init(layout.num_blocks)
        elif init == "locality_columns":
            matrix = locality_columns_init(layout, units)
        else:
            raise ValueError(f"unknown mixing init {init!r}; expected one of {MIXING_INITS}")
        if per_head:
            if not num_heads or num_heads < 1:
                raise ValueError(f"per_head mixing needs num_heads >= 1, got {num_heads!r}")
            matrix = matrix.expand(num_heads, -1, -1).clone()
        matrix = matrix.to(torch.float32)
        self.num_blocks = layout.num_blocks
        self.per_head = per_head
        self.constrain = constrain
        if learnable:
            self.weight = nn.Parameter(matrix)
        else:
            self.register_buffer("weight", matrix)

    def forward(self) -> torch.Tensor:
        w = self.weight
        # is_compiling() first: a compiled graph must not read the scope counter (TorchDynamo would guard on
        # its value, which changes every call, and recompile the layer on every forward)
        if torch.compiler.is_compiling():
            return self._compute(w)
        scope = _REUSE_SCOPE[0]
        if not scope or (torch.is_grad_enabled() and w.requires_grad):
            return self._compute(w)
        # inside reuse_constrained_mixing(): the weights are fixed, so the matrix is computed once per scope
        # (and again if the weight changes in place, moves or is replaced), not on every call of every layer
        key = (scope, w.data_ptr(), w._version, w.device, w.dtype)
        hit = getattr(self, "_reused", None)
        if hit is None or hit[0] is not w or hit[1] != key:
            hit = (w, key, self._compute(w).detach())
            self._reused = hit
        return hit[2]

    def _compute(self, w: torch.Tensor) -> torch.Tensor:
        w = w.float()
        return constrain_mixing(w) if self.constrain else w

    @torch.no_grad()
    def project_(self) -> None:
        """Writes the constrained matrix back into the stored weight (e.g. after an optimiser step).

        Not needed for correctness, since :meth:`forward` constrains on every use, but it keeps the
        stored values readable and stops them drifting far outside [0, 1].
        """
        if self.constrain:
            self.weight.copy_(constrain_mixing(self.weight.float()).to(self.weight.dtype))

    def extra_repr(self) -> str:
        shape = "x".join(str(s) for s in self.weight.shape)
        return f"{shape}, per_head={self.per_head}, constrain={self.constrain}, learnable={isinstance(self.weight, nn.Parameter)}"


# ---- a mixing matrix for a smaller layout


def _nearest(src: int, dst: int) -> torch.Tensor:
    """For each of ``src`` segments of [0, 1], the index of the ``dst`` segment with the nearest centre."""
    a = (torch.arange(src, dtype=torch.float64) + 0.5) / src
    b = (torch.arange(dst, dtype=torch.float64) + 0.5) / dst
    return (a[:, None] - b[None, :]).abs().argmin(dim=1)  # ties go to the lower index


@lru_cache(maxsize=64)
def _block_map(src: Grid, dst: Grid) -> torch.Tensor:
    """``(prod(src),)`` id in ``dst`` of the block whose centre is nearest each block of ``src``."""
    f, h, w = (_nearest(s, d) for s, d in zip(src, dst, strict=True))
    return ((f[:, None, None] * dst[1] + h[None, :, None]) * dst[2] + w[None, None, :]).reshape(-1)


def resample_mixing(mixing: torch.Tensor, blocks: Grid, new_blocks: Grid, renormalize: bool = True) -> torch.Tensor:
    """Adapts an ``(M, M)`` (or ``(H, M, M)``) mixing matrix of layout ``blocks`` to ``new_blocks``.

    Used when a grid has fewer cells on an axis than the model has blocks (e.g. few frames), so the
    layout must shrink. Block centres are compared in normalised coordinates ([0, 1] per axis):
    new query block ``a`` takes the row of the old block nearest its centre, and each old key block's
    weight goes to the new block nearest it (so weights of merged blocks add up). Rows are then
    renormalised, unless ``renormalize=False`` (unconstrained mixing, whose rows need not sum to 1: each new
    row then keeps the total weight of the old row it came from). Differentiable; with
    ``new_blocks == blocks`` it returns ``mixing`` unchanged.
    """
    if tuple(new_blocks) == tuple(blocks):
        return mixing
    # hashable for _block_map's cache (a caller may pass lists)
    blocks, new_blocks = cast(Grid, tuple(blocks)), cast(Grid, tuple(new_blocks))
    rows = _block_map(new_blocks, blocks).to(mixing.device)
    cols = _block_map(blocks, new_blocks).to(mixing.device)
    m_new = math.prod(new_blocks)
    picked = mixing[..., rows, :]
    out = picked.new_zeros(*picked.shape[:-1], m_new).index_add(-1, cols, picked)
    if not renormalize:
        return out
    return out / out.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(out.dtype).tiny)

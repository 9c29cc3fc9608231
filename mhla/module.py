"""``MHLA``: the operator as an ``nn.Module`` that owns its mixing coefficients.

Drop it into any attention layer that produces q, k, v as ``(batch, tokens, heads, head_dim)``.
"""

from __future__ import annotations

import torch
from torch import nn

from .checks import check_grid
from .feature_maps import get_feature_map
from .layout import BlockLayout, Grid, ResolvedBlocks, parse_blocks, resolve_blocks
from .mixing import MixingCoefficients, resample_mixing
from .ops import mhla_attention
from .rope import Rotary


class MHLA(nn.Module):
    """Multi-head linear attention with a fixed block count and a learnable mixing matrix.

    Args:
        blocks: block count per axis, ``(bf, bh, bw)`` or ``"7x3x5"``. It stays fixed, so the
            ``M x M`` mixing matrix fits every grid with at least that many cells per axis
            (uneven splits are fine).
        grid: the grid the locality init is computed on (only the block centres matter, so any
            grid that fits gives the same init in ``"block"`` units). Defaults to ``blocks``.
        feature_map, normalize, eps: as :func:`mhla.mhla_attention`.
        mixing_init, mixing_units, learnable_mixing, per_head_mixing, num_heads, constrain_mixing:
            as :class:`mhla.MixingCoefficients`.
    """

    def __init__(
        self,
        blocks: str | Grid,
        grid: Grid | None = None,
        feature_map: str = "relu",
        normalize: bool = True,
        eps: float = 1e-6,
        mixing_init: str = "locality",
        mixing_units: str = "block",
        learnable_mixing: bool = True,
        per_head_mixing: bool = False,
        num_heads: int | None = None,
        constrain_mixing: bool = True,
    ):
        super().__init__()
        get_feature_map(feature_map)  # validate early
        self.blocks = parse_blocks(blocks)
        self.feature_map = feature_map
        self.normalize = normalize
        self.eps = eps
        layout = BlockLayout(self.blocks if grid is None else grid, self.blocks)
        self.mixing = MixingCoefficients(
            layout,
            init=mixing_init,
            units=mixing_units,
            learnable=learnable_mixing,
            per_head=per_head_mixing,
            num_heads=num_heads,
            constrain=constrain_mixing,
        )

    def resolve(self, grid: Grid) -> ResolvedBlocks:
        """The module's blocks on ``grid`` by the block rule (:func:`mhla.resolve_blocks`): kept, and shrunk on
        any axis where the grid has fewer cells. ``.layout`` is what runs; ``str()`` the note a run reports."""
        # ints only: int(5.5) would silently give another layout
        return resolve_blocks(check_grid(grid), own=self.blocks)

    def layout(self, grid: Grid) -> BlockLayout:
        """The layout on ``grid`` (:meth:`resolve`)."""
        return self.resolve(grid).layout

    def mixing_for(self, layout: BlockLayout) -> torch.Tensor:
        """The mixing matrix for ``layout``: the module's own, resampled by nearest block centres when the
        layout was shrunk (:func:`mhla.resample_mixing`; rows renormalised when the mixing is constrained)."""
        if layout.blocks == self.blocks:
            return self.mixing()
        return resample_mixing(self.mixing(), self.blocks, layout.blocks, renormalize=self.mixing.constrain)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: Grid | ResolvedBlocks,
        rotary_emb: Rotary | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """q, k ``(B, N, H, D)``, v ``(B, N, H, E)``, ``grid`` = ``(F, H, W)`` with ``F*H*W == N``, or this
        module's :meth:`resolve` of it when the caller already has it (then the rule is not applied again);
        ``out_dtype`` as :func:`mhla.mhla_attention`. A grid with fewer cells on an axis than the module
        has blocks shrinks the layout (see :meth:`resolve`, :meth:`mixing_for`)."""
        if torch.compiler.is_compiling():  # one opaque op in the graph (see mhla.compiled); same numbers
            from .compiled import attention_op

            return attention_op(
                q,
                k,
                v,
                self.mixing(),
                grid.layout.grid if isinstance(grid, ResolvedBlocks) else grid,
                self.blocks,
                self.feature_map,
                self.normalize,
                rotary_emb,
                self.eps,
                self.mixing.constrain,
                out_dtype or q.dtype,
            )
        resolved = grid if isinstance(grid, ResolvedBlocks) else self.resolve(grid)
        if resolved.blocks != self.blocks:
            theirs, ours = ("x".join(map(str, b)) for b in (resolved.blocks, self.blocks))
            raise ValueError(f"a layout resolved for {theirs} blocks was passed to an MHLA module with {ours} blocks")
        layout = resolved.layout
        return mhla_attention(
            q,
            k,
            v,
            layout,
            self.mixing_for(layout),
            feature_map=self.feature_map,
            normalize=self.normalize,
            rotary_emb=rotary_emb,
            eps=self.eps,
            out_dtype=out_dtype,
        )

    def extra_repr(self) -> str:
        b = "x".join(map(str, self.blocks))
        return f"blocks={b}, feature_map={self.feature_map!r}, normalize={self.normalize}"

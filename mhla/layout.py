"""Spatiotemporal block layouts: which MHLA block ("token-level head") each token belongs to.

Tokens are flattened in (frame, height, width) order of a latent-token grid ``(F, H, W)``,
as diffusers' Wan transformer flattens its patch grid. A layout splits each axis into a
number of contiguous segments; a block is one segment per axis, so ``M = bf * bh * bw``.
Segments along an axis differ in length by at most one (``size // n`` or ``size // n + 1``),
so any grid works, e.g. 52 columns into 5 blocks of 11, 11, 10, 10, 10 columns.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import SupportsIndex, cast

import torch

Grid = tuple[int, int, int]

# The paper's video blocks: 3 x 10 x 10 latent tokens (21x30x50 grid -> 7x3x5 = 105 blocks).
PAPER_BLOCK_SHAPE: Grid = (3, 10, 10)


def _as_int(x: SupportsIndex | float) -> int:
    """``x`` as an int if it is an integer (or an integral float such as ``5.0``); TypeError otherwise.

    Bools and fractional values are refused rather than truncated: ``int(5.7)`` would silently
    give a different grid."""
    if isinstance(x, bool):
        raise TypeError
    if isinstance(x, float):
        if not x.is_integer():
            raise TypeError
        return int(x)
    return operator.index(x)


def _as_triple(value: Iterable[SupportsIndex | float], name: str) -> Grid:
    try:
        triple = tuple(_as_int(x) for x in value)
    except TypeError:
        raise ValueError(f"{name} must be three integers (frames, height, width), got {value!r}") from None
    if len(triple) != 3 or any(x < 1 for x in triple):
        raise ValueError(f"{name} must be three positive integers (frames, height, width), got {value!r}")
    return triple


def parse_blocks(spec: str | Sequence[int]) -> Grid:
    """Parses a block count such as ``"7x3x5"`` (or a 3-sequence) into ``(bf, bh, bw)``."""
    if isinstance(spec, str):
        if not re.fullmatch(r"\s*\d+\s*[xX*,]\s*\d+\s*[xX*,]\s*\d+\s*", spec):
            raise ValueError(f"blocks must look like '7x3x5' (frames x height x width), got {spec!r}")
        spec = [int(x) for x in re.split(r"[xX*,]", spec)]
    return _as_triple(spec, "blocks")


def parse_grid(text: str) -> Grid:
    """A token grid such as ``"21x30x50"`` (frames x height x width, in tokens) -> ``(21, 30, 50)``."""
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a grid looks like 21x30x50 (frames x height x width), got {text!r}")
    return (int(parts[0]), int(parts[1]), int(parts[2]))


def split_points(size: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous segments of ``range(size)`` whose lengths differ by <= 1.

    The longer segments come first: ``split_points(52, 5) == [0, 11, 22, 32, 42, 52]``.
    """
    if not 1 <= parts <= size:
        raise ValueError(f"cannot split {size} cells into {parts} blocks (need 1 <= blocks <= cells)")
    base, extra = divmod(size, parts)
    points = [0]
    for i in range(parts):
        points.append(points[-1] + base + (1 if i < extra else 0))
    return points


def default_blocks(grid: Grid, block_shape: Grid = PAPER_BLOCK_SHAPE) -> Grid:
    """The default block count for a grid.

    Rule: aim for the paper's block shape (3 x 10 x 10 tokens by default), i.e. on each axis
    ``round(size / target)`` blocks, at least 1 and at most ``size``. Then, while ``M * M > N``
    (where the mixing cost ``M^2 d^2`` would rival the ``N d^2`` of the summaries), take one block
    away from the axis whose blocks are smallest relative to the target, which keeps the block
    shape close to the target's proportions. 21x30x50 gives 7x3x5 (M = 105); 21x30x52 gives
    7x3x5 too; a 1-D sequence of N tokens (grid 1x1xN) gets about sqrt(N) blocks.
    """
    grid = _as_triple(grid, "grid")
    block_shape = _as_triple(block_shape, "block_shape")
    blocks = [max(1, min(size, math.floor(size / target + 0.5))) for size, target in zip(grid, block_shape)]
    n = math.prod(grid)
    while math.prod(blocks) ** 2 > n:
        # relative block size on each axis (smaller = more over-split than the target asks)
        rel = [(size / b) / target if b > 1 else math.inf for size, b, target in zip(grid, blocks, block_shape)]
        axis = min(range(3), key=lambda a: rel[a])
        blocks[axis] -= 1
    return cast(Grid, tuple(blocks))  # three axes: one count per axis of the grid


def fit_blocks(blocks: Grid, grid: Grid) -> Grid:
    """The block count used on ``grid``: ``blocks``, capped per axis at the grid's cell count (a grid with
    fewer cells on an axis than the model has blocks, e.g. a video of few frames, shrinks the layout)."""
    return cast(Grid, tuple(min(b, s) for b, s in zip(blocks, grid, strict=True)))


@dataclass(frozen=True)
class BlockLayout:
    """A split of a ``(F, H, W)`` token grid into ``bf x bh x bw`` spatiotemporal blocks.

    Block ids run in (frame, height, width) order too: block ``(i, j, l)`` has id
    ``(i * bh + j) * bw + l``.
    """

    grid: Grid
    blocks: Grid

    def __post_init__(self) -> None:
        grid = _as_triple(self.grid, "grid")
        blocks = parse_blocks(self.blocks)
        for axis, size, b in zip(("frames", "height", "width"), grid, blocks):
            if b > size:
                raise ValueError(
                    f"layout {blocks[0]}x{blocks[1]}x{blocks[2]} has {b} blocks along {axis}, "
                    f"but the token grid {grid[0]}x{grid[1]}x{grid[2]} has only {size} cells there"
                )
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "blocks", blocks)

    @classmethod
    def for_grid(cls, grid: Grid, blocks: str | Grid | None = None) -> BlockLayout:
        """The layout for ``grid``: ``blocks`` when given (e.g. ``"7x3x5"``; it must fit), else
        :func:`default_blocks` (the block rule, :func:`resolve_blocks`, without a model's own blocks)."""
        return resolve_blocks(grid, blocks).layout

    @classmethod
    def sequence(cls, num_tokens: int, num_blocks: int | None = None) -> BlockLayout:
        """A 1-D layout (grid ``1 x 1 x N``) with ``num_blocks`` contiguous blocks (default about sqrt(N))."""
        grid = (1, 1, int(num_tokens))
        return cls.for_grid(grid, None if num_blocks is None else (1, 1, int(num_blocks)))

    @property
    def num_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def num_blocks(self) -> int:
        return math.prod(self.blocks)

    def __str__(self) -> str:
        f, h, w = self.grid
        bf, bh, bw = self.blocks
        return f"{bf}x{bh}x{bw} blocks (M={self.num_blocks}) over a {f}x{h}x{w} grid (N={self.num_tokens})"

    @cached_property
    def axis_points(self) -> tuple[list[int], list[int], list[int]]:
        """Segment boundaries along (frames, height, width)."""
        points = tuple(split_points(size, b) for size, b in zip(self.grid, self.blocks))
        return cast(tuple[list[int], list[int], list[int]], points)

    def _axis_ids(self, axis: int) -> torch.Tensor:
        points = self.axis_points[axis]
        lengths = torch.tensor([b - a for a, b in zip(points[:-1], points[1:])])
        return torch.repeat_interleave(torch.arange(len(lengths)), lengths)

    @cached_property
    def token_block(self) -> torch.Tensor:
        """``(N,)`` long tensor: the block id of every token, in flattened (F, H, W) order."""
        f, h, w = (self._axis_ids(a) for a in range(3))
        _, bh, bw = self.blocks
        return ((f[:, None, None] * bh + h[None, :, None]) * bw + w[None, None, :]).reshape(-1)

    @cached_property
    def block_sizes(self) -> torch.Tensor:
        """``(M,)`` number of tokens in each block."""
        return torch.bincount(self.token_block, minlength=self.num_blocks)

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """``(M, L)`` token indices of each block, ``L`` = the largest block; short rows are padded with ``N``.

        Index ``N`` points at a zero row appended by the caller, so padded slots contribute nothing.
        For layouts that divide the grid evenly there is no padding.
        """
        order = torch.argsort(self.token_block, stable=True)
        sizes = self.block_sizes
        longest = int(sizes.max())
        starts = torch.cumsum(sizes, 0) - sizes
        slot = torch.arange(longest)
        valid = slot[None, :] < sizes[:, None]
        pos = (starts[:, None] + slot[None, :]).clamp(max=self.num_tokens - 1)
        return torch.where(valid, order[pos], torch.full_like(pos, self.num_tokens))

    @cached_property
    def scatter_index(self) -> torch.Tensor:
        """``(N,)`` position of each token in the flattened ``(M * L)`` padded block order."""
        flat = self.gather_index.reshape(-1)
        positions = torch.arange(flat.numel())
        keep = flat < self.num_tokens
        out = torch.empty(self.num_tokens, dtype=torch.long)
        out[flat[keep]] = positions[keep]
        return out

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """Index tensor ``name`` (``"gather_index"``, ``"scatter_index"``, ``"token_block"``) on ``device``.

        Cached per device, so a forward pass does not copy it from the host in every layer.
        """
        cache = self.__dict__.setdefault("_device_cache", {})
        key = (name, str(device))
        if key not in cache:
            cache[key] = getattr(self, name).to(device)
        return cache[key]

    @cached_property
    def even_boxes(self) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
        """The grid as at most 8 boxes that each split evenly into equal blocks.

        Along an axis, segments of equal length are consecutive (the longer ones first), so each
        axis has at most two runs ``(token_start, block_start, num_blocks, block_length)``; a box is
        one run per axis. An even layout is a single box. The efficient path reads every box as a
        strided view of the token-order tensors, without gathers or padding.
        """
        runs = []
        for points in self.axis_points:
            axis: list[tuple[int, int, int, int]] = []
            for b, (a, e) in enumerate(zip(points[:-1], points[1:])):
                if axis and axis[-1][3] == e - a:
                    t0, b0, n, length = axis[-1]
                    axis[-1] = (t0, b0, n + 1, length)
                else:
                    axis.append((a, b, 1, e - a))
            runs.append(axis)
        return tuple((f, h, w) for f in runs[0] for h in runs[1] for w in runs[2])

    @property
    def is_even(self) -> bool:
        return all(size % b == 0 for size, b in zip(self.grid, self.blocks))

    def block_centres(self, units: str = "block") -> torch.Tensor:
        """``(M, 3)`` float64 centre of each block in (frame, height, width) coordinates.

        ``units="block"``: block-index units (block ``(i, j, l)`` sits at ``(i, j, l)``).
        ``units="token"``: the mean token coordinate of the block, which differs from the former
        when blocks are not cubes or the grid does not divide evenly.
        """
        if units == "block":
            axes = [torch.arange(b, dtype=torch.float64) for b in self.blocks]
        elif units == "token":
            axes = [
                torch.tensor([(a + b - 1) / 2 for a, b in zip(p[:-1], p[1:])], dtype=torch.float64)
                for p in self.axis_points
            ]
        else:
            raise ValueError(f"units must be 'block' or 'token', got {units!r}")
        f, h, w = torch.meshgrid(*axes, indexing="ij")
        return torch.stack([f, h, w], dim=-1).reshape(-1, 3)


@lru_cache(maxsize=64)
def cached_layout(grid: Grid, blocks: Grid) -> BlockLayout:
    """One shared :class:`BlockLayout` per ``(grid, blocks)``: layouts cache their index tensors (per
    device), so every layer and step of a model should reuse the same instance."""
    return BlockLayout(cast(Grid, tuple(int(x) for x in grid)), parse_blocks(blocks))


def resolve_blocks(
    grid: Sequence[int],
    requested: str | Sequence[int] | None = None,
    own: Sequence[int] | None = None,
    block_shape: Grid = PAPER_BLOCK_SHAPE,
) -> ResolvedBlocks:
    """The block rule, in one place: which block count a model runs with and the layout it gets on ``grid``.

    - ``requested`` (e.g. ``"2x4x5"`` from ``--blocks``, or a triple) is parsed and must fit ``grid`` as it is:
      a request that does not fit is an error (``ValueError`` naming the axis), never shrunk;
    - else ``own``, the block count a model already has (its ``M x M`` mixing matrices are fixed for it), kept
      and, on a grid with fewer cells on an axis than it has blocks (e.g. a video of few frames), shrunk
      there (:func:`fit_blocks`);
    - else :func:`default_blocks` of ``grid`` with the target ``block_shape``.

    Returns a :class:`ResolvedBlocks`: ``blocks`` (the model's count) and ``layout`` (what runs on ``grid``),
    one shared instance per argument set, so a layer calling this on every forward pays a dict look-up.
    """
    key_requested = requested if requested is None or isinstance(requested, str) else tuple(requested)
    key_own = None if own is None else tuple(own)
    return _resolve_blocks(tuple(grid), key_requested, key_own, tuple(block_shape))


@lru_cache(maxsize=256)
def _resolve_blocks(
    grid: tuple[int, ...],
    requested: str | tuple[int, ...] | None,
    own: tuple[int, ...] | None,
    block_shape: tuple[int, ...],
) -> ResolvedBlocks:
    checked = _as_triple(grid, "grid")
    if requested is not None:
        blocks = parse_blocks(requested)
        layout = cached_layout(checked, blocks)  # BlockLayout raises, naming the axis, when it does not fit
    elif own is not None:
        blocks = parse_blocks(own)
        layout = cached_layout(checked, fit_blocks(blocks, checked))
    else:
        blocks = default_blocks(checked, _as_triple(block_shape, "block_shape"))
        layout = cached_layout(checked, blocks)
    return ResolvedBlocks(blocks, layout)


@dataclass(frozen=True)
class ResolvedBlocks:
    """The answer of :func:`resolve_blocks` for one grid.

    ``blocks``: the model's block count ``(bf, bh, bw)`` (its mixing matrices are ``M x M`` for it);
    ``layout``: the :class:`BlockLayout` that runs on the grid, ``blocks`` shrunk where the grid is smaller.
    ``str()`` is the note a run reports, e.g. ``"1x2x2 blocks (M=4) over a 1x4x4 grid (N=16) (shrunk from 3x2x2)"``.
    """

    blocks: Grid
    layout: BlockLayout

    @property
    def shrunk(self) -> bool:
        return self.layout.blocks != self.blocks

    def __str__(self) -> str:
        note = f" (shrunk from {'x'.join(map(str, self.blocks))})" if self.shrunk else ""
        return f"{self.layout}{note}"

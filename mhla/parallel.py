"""MHLA over a sequence split across processes ("ring" context parallelism), exact.

Each process holds a contiguous slice of the tokens (``start`` to ``start + n``, in the flattened
``(F, H, W)`` order of ``layout.grid``); a slice may cut through blocks, and blocks may span several
processes. The block summaries add over tokens, ``S_b = sum_{s in b} phi(k_s)^T v_s`` and
``z_b = sum_{s in b} phi(k_s)``, so each process sums its own tokens into their global blocks, one
``all_reduce(SUM)`` makes every summary exact everywhere, and each process mixes them and produces its
own queries' outputs. Autograd-aware: the reduction's backward is the same reduction of the gradients.

Communication per layer and process: one all-reduce of the ``B x M x H x D x E`` summaries and the
``B x M x H x D`` normalizer sums in the compute dtype (float32), whatever the sequence length; a ring all-reduce
sends ``2 (p - 1) / p`` of it from each process. Ulysses instead sends ``(p - 1) / p`` of each process's q, k, v
and output. ``python -m benchmarks.context_parallel --volumes`` computes both at Wan's sizes (README's table).

Torch only: ``torch.distributed`` with any backend (gloo on CPU, NCCL on GPUs); nothing here knows Wan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import check_eps
from .feature_maps import get_feature_map
from .layout import BlockLayout
from .naive import mix_summaries
from .rope import Rotary, apply_rotary


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group, differentiable (the backward sums the gradients the same way)."""
    import warnings

    from torch.distributed.nn.functional import all_reduce

    with (
        warnings.catch_warnings()
    ):  # torch.distributed.nn's form is the autograd-aware one; its deprecation notice is noise here
        warnings.simplefilter("ignore", FutureWarning)
        return all_reduce(x, op=dist.ReduceOp.SUM, group=group or dist.group.WORLD)


def _local_blocks(ids: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For local tokens with global block ``ids`` ``(n,)``: ``(gather (M, L), scatter (n,))``: each block's local
    token positions padded with ``n`` (a zero row), and each token's position in the flattened ``(M * L)``."""
    n = ids.numel()
    sizes = torch.bincount(ids, minlength=num_blocks)
    longest = max(1, int(sizes.max()) if n else 1)
    order = torch.argsort(ids, stable=True)
    starts = torch.cumsum(sizes, 0) - sizes
    slot = torch.arange(longest, device=ids.device)
    valid = slot[None, :] < sizes[:, None]
    pos = (starts[:, None] + slot[None, :]).clamp(max=max(n - 1, 0))
    gather = torch.where(valid, order[pos] if n else pos, torch.full_like(pos, n))
    rank_in_block = torch.empty_like(ids)
    rank_in_block[order] = torch.arange(n, device=ids.device) - starts[ids[order]]
    return gather, ids * longest + rank_in_block


def _to_local_blocks(x: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """``(B, n, H, D)`` -> ``(B, M, L, H, D)``; padded slots are zero."""
    x = torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)
    return x[:, gather]


def mhla_attention_sharded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    start: int,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`mhla.mhla_attention` for this process's tokens ``start .. start + n`` of ``layout``'s grid.

    Args:
        q, k: ``(B, n, H, D)``; v: ``(B, n, H, E)``: this process's slice of the sequence.
        layout: the whole sequence's block layout (global block ids).
        mixing: ``(M, M)`` or ``(H, M, M)``, the same on every process.
        start: the global index of this slice's first token.
        rotary_emb: ``(cos, sin)`` for this slice's tokens, each ``(1, n, 1, D)``.
        group: the process group whose slices make up the sequence (default: the whole world).
    Returns:
        ``(B, n, H, E)``: the outputs of this slice's queries, equal to the single-process result.
    """
    n = q.shape[1]
    if q.dim() != 4 or k.shape[:3] != q.shape[:3] or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v must be (B, n, H, D) with equal (B, n, H); got {q.shape}, {k.shape}, {v.shape}")
    if not 0 <= start <= layout.num_tokens - n:
        raise ValueError(
            f"tokens {start}..{start + n} do not lie in the layout's {layout.num_tokens} tokens ({layout.grid})"
        )
    m = layout.num_blocks
    if mixing.shape[-2:] != (m, m):
        raise ValueError(f"mixing must be ({m}, {m}) or (H, {m}, {m}) for {layout}, got {tuple(mixing.shape)}")
    eps = check_eps(eps)
    dt = torch.promote_types(q.dtype, torch.float32)
    phi = get_feature_map(feature_map)
    fq, fk = phi(q.to(dt)), phi(k.to(dt))
    rq, rk = fq, fk
    if rotary_emb is not None:
        rope = (rotary_emb[0].to(dt), rotary_emb[1].to(dt))
        rq, rk = apply_rotary(fq, rope), apply_rotary(fk, rope)
    ids = layout.token_block[start : start + n].to(q.device)
    gather, scatter = _local_blocks(ids, m)
    kb, vb = _to_local_blocks(rk, gather), _to_local_blocks(v.to(dt), gather)
    summaries = torch.einsum("bmlhd,bmlhe->bmhde", kb, vb)  # this slice's share of every block
    summaries = _all_reduce(summaries, group)
    qb = _to_local_blocks(rq, gather)
    out = torch.einsum("bmlhd,bmhde->bmlhe", qb, mix_summaries(mixing, summaries))
    if normalize:
        z = _to_local_blocks(fk, gather).sum(dim=2)
        z = _all_reduce(z, group)
        den = torch.einsum("bmlhd,bmhd->bmlh", _to_local_blocks(fq, gather), mix_summaries(mixing, z))
        out = out / (den[..., None] + eps)
    return out.flatten(1, 2).index_select(1, scatter).to(out_dtype or q.dtype)


def shard_bounds(num_tokens: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` of ``parts`` near-equal contiguous slices (the first ones one longer):
    ``torch.tensor_split``'s split, which diffusers' context parallelism uses when the length does not divide
    (``ring_anything`` / ``ulysses_anything``) and equals ``torch.chunk``'s when it does."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"need 0 <= index < parts, got index {index} of {parts}")
    base, extra = divmod(num_tokens, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)

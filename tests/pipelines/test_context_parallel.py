"""Linear and MHLA attention under context parallelism, the way diffusers splits a sequence (gloo, CPU): the
Ulysses exchange and the ring's summed summaries give each process exactly its tokens' single-process output."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mhla import mhla_attention
from mhla.layout import BlockLayout
from mhla.parallel import mhla_attention_sharded, shard_bounds
from pipelines.context_parallel import gather_sequence, ring_start, ulysses
from tests.independent import constrain

GRID, BLOCKS = (3, 5, 7), (2, 2, 3)


def _worker(rank: int, world: int, init: str, per_head: bool, out: dict):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        n, h, d = math.prod(GRID), 4, 8
        layout = BlockLayout(GRID, BLOCKS)
        q, k, v = (torch.randn(1, n, h, d, dtype=torch.float64) for _ in range(3))
        m = layout.num_blocks
        mixing = constrain(torch.rand(h, m, m) if per_head else torch.rand(m, m)).double()
        ang = torch.rand(1, n, 1, d // 2, dtype=torch.float64)
        rope = (torch.repeat_interleave(ang.cos(), 2, -1), torch.repeat_interleave(ang.sin(), 2, -1))
        whole = mhla_attention(q, k, v, layout, mixing, rotary_emb=rope)
        start, stop = shard_bounds(n, world, rank)
        group = dist.group.WORLD
        assert ring_start(n, group) == start
        local = [x[:, start:stop].clone().requires_grad_(True) for x in (q, k, v)]
        local_rope = tuple(t[:, start:stop] for t in rope)
        full_rope = tuple(gather_sequence(t, n, group) for t in local_rope)
        assert all(torch.equal(a, b) for a, b in zip(full_rope, rope))

        def attend(qh, kh, vh, heads):
            mix = mixing[heads] if mixing.dim() == 3 else mixing
            return mhla_attention(qh, kh, vh, layout, mix, rotary_emb=full_rope)

        got_u = ulysses(*local, n, group, attend)
        got_r = mhla_attention_sharded(*local, layout, mixing, start, rotary_emb=local_rope)
        # linear attention: ring MHLA with one block
        one = BlockLayout(GRID, (1, 1, 1))
        got_l = mhla_attention_sharded(*local, one, torch.ones(1, 1, dtype=torch.float64), start, rotary_emb=local_rope)
        whole_l = mhla_attention(q, k, v, one, torch.ones(1, 1, dtype=torch.float64), rotary_emb=rope)
        (got_u.sum() + got_r.sum()).backward()
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for g, x in zip(grads, local):
            g[:, start:stop] = x.grad
            dist.all_reduce(g)
        if rank == 0:
            ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
            (2 * mhla_attention(*ref, layout, mixing, rotary_emb=rope).sum()).backward()
            out["grads"] = max((g - r.grad).abs().max().item() for g, r in zip(grads, ref))
        out[f"ulysses{rank}"] = (got_u.detach() - whole[:, start:stop]).abs().max().item()
        out[f"ring{rank}"] = (got_r.detach() - whole[:, start:stop]).abs().max().item()
        out[f"linear{rank}"] = (got_l.detach() - whole_l[:, start:stop]).abs().max().item()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world,per_head", [(2, False), (4, True)])
def test_ulysses_and_ring_equal_one_process(tmp_path, world, per_head):
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), per_head, out), nprocs=world, join=True)
    for rank in range(world):
        for kind in ("ulysses", "ring", "linear"):
            assert out[f"{kind}{rank}"] < 1e-10, (kind, rank, out[f"{kind}{rank}"])
    assert out["grads"] < 1e-10

"""MHLA over a sequence split across processes (gloo on CPU, 2 and 4 processes): each process's outputs and
the gathered gradients equal the paper's formula on the whole sequence, for slices that cut through blocks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from mhla.layout import BlockLayout
from mhla.parallel import mhla_attention_sharded, shard_bounds
from pipelines.context_parallel import exit_process
from tests.independent import constrain, mhla_dense
from tests.spawned import group_runner

GRID, BLOCKS = (3, 5, 7), (2, 2, 3)  # uneven blocks; 105 tokens split 4 ways: 27, 26, 26, 26


def _rope(n: int, d: int):
    ang = torch.rand(1, n, 1, d // 2, dtype=torch.float64) * 6.28
    cos = torch.repeat_interleave(ang.cos(), 2, dim=-1)
    sin = torch.repeat_interleave(ang.sin(), 2, dim=-1)
    return cos, sin


def _dense(q, k, v, mixing, normalize, rope):
    """The independent reference, one head at a time where the mixing is per head."""
    if mixing.dim() == 2:
        return mhla_dense(q, k, v, GRID, BLOCKS, mixing, normalize=normalize, rope=rope)
    heads = [
        mhla_dense(
            q[:, :, i : i + 1],
            k[:, :, i : i + 1],
            v[:, :, i : i + 1],
            GRID,
            BLOCKS,
            mixing[i],
            normalize=normalize,
            rope=rope,
        )
        for i in range(q.shape[2])
    ]
    return torch.cat(heads, dim=2)


def _case(rank: int, world: int, normalize: bool, rope: bool, per_head: bool) -> dict[str, float]:
    """This process's share of the sequence split ``world`` ways; rank 0 returns the errors against the reference."""
    out: dict[str, float] = {}
    torch.manual_seed(0)  # the same whole-sequence inputs on every process
    n, h, d = math.prod(GRID), 2, 8
    q, k, v = (torch.randn(1, n, h, d, dtype=torch.float64) for _ in range(3))
    m = math.prod(BLOCKS)
    mixing = constrain(torch.rand(h, m, m) if per_head else torch.rand(m, m)).double()
    tables = _rope(n, d) if rope else None
    start, stop = shard_bounds(n, world, rank)
    local = [x[:, start:stop].clone().requires_grad_(True) for x in (q, k, v)]
    mix = mixing.clone().requires_grad_(True)
    rot = None if tables is None else tuple(t[:, start:stop] for t in tables)
    got = mhla_attention_sharded(
        *local, BlockLayout(GRID, BLOCKS), mix, start, normalize=normalize, rotary_emb=rot, eps=1e-6
    )
    # the loss of the whole output, as a sum of every process's share
    weights = torch.randn(1, n, h, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (got * weights[:, start:stop]).sum().backward()
    dist.all_reduce(mix.grad)  # every process's queries' share of the mixing gradient
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for g, x in zip(grads, local):
        g[:, start:stop] = x.grad
        dist.all_reduce(g)
    if rank == 0:
        whole = [x.clone().requires_grad_(True) for x in (q, k, v)]
        mix_ref = mixing.clone().requires_grad_(True)
        ref = _dense(*whole, mix_ref, normalize, tables)
        (ref * weights).sum().backward()
        out["forward"] = (got.detach() - ref.detach()[:, start:stop]).abs().max().item()
        out["grads"] = max((g - x.grad).abs().max().item() for g, x in zip(grads, whole))
        out["mixing"] = (mix.grad - mix_ref.grad).abs().max().item()
    # every process checks its own slice of the forward pass
    ref_all = _dense(q, k, v, mixing, normalize, tables)
    assert torch.allclose(got.detach(), ref_all[:, start:stop], atol=1e-9), rank
    return out


def _worker(rank: int, world: int, init_file: str, cases: list[tuple[bool, bool, bool]], out: dict):
    """One process of a group that runs every case of its size, one after another (each case seeds itself)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case in cases:
            got = _case(rank, world, *case)
            if rank == 0:
                out[case] = got
    finally:
        dist.destroy_process_group()
    exit_process(0)  # a finished worker: gloo may abort the interpreter's teardown


CASES = [(2, True, False, False), (4, False, True, True), (4, True, True, False), (3, True, False, True)]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """``groups(world)``: every case of that many processes, run in one group spawned once for the module (a
    spawned process imports torch again: seconds on a 2-core CPU, more than a case's own work). Returns
    ``{(normalize, rope, per_head): errors}``; a group that failed fails each of its tests with its error."""
    return group_runner(
        tmp_path_factory, _worker, lambda world: [tuple(case[1:]) for case in CASES if case[0] == world]
    )


@pytest.mark.slow
@pytest.mark.parametrize("world,normalize,rope,per_head", CASES)
def test_sharded_mhla_equals_the_whole_sequence(groups, world, normalize, rope, per_head):
    out = groups(world)[(normalize, rope, per_head)]
    assert out["forward"] < 1e-9
    assert out["grads"] < 1e-9
    assert out["mixing"] < 1e-9


def test_shard_bounds_are_tensor_split():
    for n, parts in ((105, 4), (32760, 4), (31500, 8), (7, 3)):
        pieces = torch.arange(n).tensor_split(parts)
        for i, piece in enumerate(pieces):
            assert shard_bounds(n, parts, i) == (int(piece[0]), int(piece[-1]) + 1)
    with pytest.raises(ValueError):
        shard_bounds(10, 2, 2)


def test_a_slice_outside_the_layout_is_refused():
    layout = BlockLayout(GRID, BLOCKS)
    q = torch.randn(1, 30, 2, 8)
    with pytest.raises(ValueError, match="do not lie"):
        mhla_attention_sharded(q, q, q, layout, torch.eye(12), start=90)

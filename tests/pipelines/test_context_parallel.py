"""Linear and MHLA attention under context parallelism, the way diffusers splits a sequence (gloo, CPU): the
Ulysses exchange and the ring's summed summaries give each process exactly its tokens' single-process output."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from mhla import mhla_attention
from mhla.layout import BlockLayout
from mhla.parallel import mhla_attention_sharded, shard_bounds
from pipelines.context_parallel import exit_process, gather_sequence, ring_start, ulysses
from tests.independent import constrain
from tests.spawned import group_runner

GRID, BLOCKS = (3, 5, 7), (2, 2, 3)
OPERATOR_CASES = [(2, False), (4, True)]  # (processes, per-head mixing)
MODEL_CASES = [
    ("mhla", "ring", 2),
    ("linear", "ring", 2),
    ("mhla", "ulysses", 2),
    ("mhla-hybrid", "ulysses", 2),
    ("linear", "ulysses", 2),
    ("mhla", "ring", 4),  # 15 tokens a process
    ("mhla-hybrid", "ulysses", 4),  # one head a process
]  # (variant, mode, processes); the cases of one size run in one group of processes (``groups`` below)


def _operator_case(rank: int, world: int, per_head: bool) -> dict[str, float]:
    """The operator split ``world`` ways (this process's share; rank 0 also the gathered gradients' error)."""
    out: dict[str, float] = {}
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
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,per_head", OPERATOR_CASES)
def test_ulysses_and_ring_equal_one_process(groups, world, per_head):
    out = {key: error for errors in groups(world)[("operator", per_head)].values() for key, error in errors.items()}
    for rank in range(world):
        for kind in ("ulysses", "ring", "linear"):
            assert out[f"{kind}{rank}"] < 1e-10, (kind, rank, out[f"{kind}{rank}"])
    assert out["grads"] < 1e-10


def _model_case(rank: int, world: int, variant: str, mode: str) -> dict[str, float]:
    """A converted tiny transformer under diffusers' context parallelism against one process (this process's
    errors)."""
    from unittest import mock

    from diffusers import ContextParallelConfig

    from pipelines.attention import AttentionOptions
    from pipelines.model import convert_self_attention
    from pipelines.tiny import build_tiny_transformer

    # as many heads as processes (Ulysses gives each process world-th of them), 8 channels each; a 3x4x5
    # token grid = 60 tokens, 30 or 15 per process: the split falls mid-frame, through blocks (uneven slices
    # are tested above: diffusers' gather of uneven slices needs all_gather of unequal sizes, which gloo lacks)
    heads = max(2, world)
    model = build_tiny_transformer(0, num_layers=3, num_attention_heads=heads, attention_head_dim=32 // heads)
    model = model.double()
    # an uneven 2x2x2 layout (blocks of 2 and 1 frames, 2 and 1 rows, 3 and 2 columns), per-head mixing
    convert_self_attention(model, variant, options=AttentionOptions(blocks=(2, 2, 2), per_head_mixing=True))
    torch.manual_seed(3)  # the same on every process
    with torch.no_grad():  # mixing away from its initial value, so a wrong head or block would show
        for p in model.parameters():
            if p.ndim == 3 and p.shape[-1] == p.shape[-2] == 8:
                p.copy_(torch.rand_like(p))
    torch.manual_seed(1)
    x = torch.randn(1, 16, 3, 8, 10, dtype=torch.float64)
    t = torch.tensor([500.0])
    text = torch.randn(1, 8, 32, dtype=torch.float64)
    weight = torch.randn(1, 16, 3, 8, 10, dtype=torch.float64)  # a loss that weighs every output differently
    params = dict(model.named_parameters())

    def grads() -> dict[str, torch.Tensor]:
        return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in params.items()}

    whole = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    (whole * weight).sum().backward()
    whole_grads = grads()
    model.zero_grad(set_to_none=True)
    config = ContextParallelConfig(ring_degree=world) if mode == "ring" else ContextParallelConfig(ulysses_degree=world)
    # diffusers places each process on an accelerator (rank % device_count): one "device", the CPU
    with mock.patch("torch.accelerator.device_count", return_value=1):
        model.enable_parallelism(config=config)
    got = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    # backward: every process takes the same loss of the gathered output; its parameter gradients hold its own
    # tokens' share, so their sum over the processes (what data parallelism's all-reduce would form) is the
    # single process's gradient
    (got * weight).sum().backward()
    split_grads = grads()
    for g in split_grads.values():
        dist.all_reduce(g)

    def error(names) -> float:
        scale = max(whole_grads[n].abs().max().item() for n in names)
        return max((split_grads[n] - whole_grads[n]).abs().max().item() for n in names) / scale

    attention = [n for n in params if ".attn1." in n and ".mixing." not in n]
    return {
        "forward": (got - whole).abs().max().item(),
        # the self-attention layers' projections and norms reduce over tokens in float64
        "attention_grads": error(attention),
        # two parts are float32 whatever the model's dtype: MHLA's mixing matrix (mhla/mixing.py keeps it
        # float32), whose gradient is rounded to float32 per process before the sum, and diffusers' Wan block's
        # norm and modulation (``norm1(hidden_states.float()) * (1 + scale) + shift``), whose shift/scale
        # gradients, hence the time embedding's, sum float32 terms per slice (measured 1e-8 to 4e-8)
        "grads": error(list(params)),
        "with_grad": sum(bool(g.abs().max() > 0) for g in whole_grads.values()) / len(params),
    }


def _group_worker(rank: int, world: int, init: str, cases: list[tuple], out: dict):
    """One process of a group that runs every case of its size, one after another (each case seeds itself)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        for case in cases:
            got = _operator_case(rank, world, case[1]) if case[0] == "operator" else _model_case(rank, world, *case[1:])
            out[(case, rank)] = got
    finally:
        dist.destroy_process_group()
    exit_process(0)  # a finished worker: gloo may abort the interpreter's teardown


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """``groups(world)``: every case of that many processes, run in one group spawned once for the module (each
    spawned process imports torch and diffusers again: several seconds a process on a 2-core CPU, more than a case's
    own work). Returns ``{case: {rank: errors}}``; a group that failed fails each of its tests with its error."""

    def cases(world: int) -> list:
        found: list = [("operator", per_head) for w, per_head in OPERATOR_CASES if w == world]
        return found + [("model", variant, mode) for variant, mode, w in MODEL_CASES if w == world]

    spawned = group_runner(tmp_path_factory, _group_worker, cases)

    def run(world: int) -> dict:
        results: dict = {}
        for (case, rank), got in spawned(world).items():
            results.setdefault(case, {})[rank] = got
        return results

    return run


@pytest.mark.slow
@pytest.mark.parametrize("variant,mode,world", MODEL_CASES)
def test_a_converted_transformer_under_enable_parallelism_equals_one_process(groups, variant, mode, world):
    """Forward and backward: each process's gathered output, and the parameter gradients summed over the
    processes, equal one process's (float64)."""
    out = groups(world)[("model", variant, mode)]
    for rank in range(world):
        assert out[rank]["forward"] < 1e-9, out
        assert out[rank]["attention_grads"] < 1e-9, out
        assert out[rank]["grads"] < 1e-6, out
        assert out[rank]["with_grad"] > 0.9, out  # the comparison covers (almost) every parameter

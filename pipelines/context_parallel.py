"""MHLA and linear attention under diffusers' context parallelism (``transformer.enable_parallelism``).

diffusers splits the sequence across processes at the first block (Wan's ``_cp_plan``; the RoPE tables are split
the same way) and hands each self-attention processor its ``_parallel_config``. Softmax layers go through
``dispatch_attention_fn``, which does the exchange itself. Linear and MHLA layers do it here, both ways diffusers
offers:

- **Ulysses** (``ulysses_degree``): an all-to-all turns "my tokens, every head" into "every token, my heads";
  MHLA runs unchanged on the whole sequence for those heads (a per-head mixing matrix is sliced to them), and a
  second all-to-all turns the outputs back. The heads must divide by the degree.
- **Ring** (``ring_degree``): each process keeps its slice of the sequence; the block summaries are summed over
  the processes with one all-reduce (:func:`mhla.parallel.mhla_attention_sharded`). Linear attention is MHLA with
  one block.

Slices follow ``torch.tensor_split`` (diffusers' ``*_anything`` modes; equal to ``chunk`` when the length divides).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mhla.parallel import shard_bounds


def parallel_kind(config: Any) -> tuple[str, dist.ProcessGroup] | None:
    """``("ulysses" | "ring", group)`` of an enabled ``ContextParallelConfig``; None when there is none."""
    if config is None:
        return None
    ring, ulysses = int(getattr(config, "ring_degree", 1) or 1), int(getattr(config, "ulysses_degree", 1) or 1)
    if ring > 1 and ulysses > 1:
        raise NotImplementedError(
            f"linear and MHLA layers run with ring_degree or ulysses_degree, not both (got ring {ring}, ulysses {ulysses})"
        )
    if ring == 1 and ulysses == 1:
        return None
    mesh = config._ulysses_mesh if ulysses > 1 else config._ring_mesh
    if mesh is None:
        raise RuntimeError("the ContextParallelConfig has no mesh yet: call transformer.enable_parallelism(...) first")
    return ("ulysses" if ulysses > 1 else "ring"), mesh.get_group()


def _all_to_all(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    import warnings

    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    with warnings.catch_warnings():  # torch.distributed.nn's form is the autograd-aware one
        warnings.simplefilter("ignore", FutureWarning)
        return all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)


def gather_sequence(x: torch.Tensor, num_tokens: int, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Every process's slice of ``x`` along ``dim`` put back together (no gradient: for RoPE tables)."""
    world = dist.get_world_size(group)
    sizes = [b - a for a, b in (shard_bounds(num_tokens, world, r) for r in range(world))]
    longest = max(sizes)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def ulysses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_tokens: int,
    group: dist.ProcessGroup,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, slice], torch.Tensor],
) -> torch.Tensor:
    """Runs ``attend(q, k, v, heads)`` on the whole sequence for this process's heads; returns its tokens' outputs.

    ``q, k, v``: this process's slice ``(B, n, H, D)``; ``attend`` gets ``(B, num_tokens, H / p, D)`` tensors and the
    slice of heads they are, and returns ``(B, num_tokens, H / p, E)``.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, _ = q.shape
    if h % world:
        raise ValueError(f"Ulysses splits the {h} heads over {world} processes: the heads must divide by it")
    hs = h // world
    sizes = [stop - start for start, stop in (shard_bounds(num_tokens, world, r) for r in range(world))]
    if sizes[rank] != n:
        raise ValueError(f"process {rank} holds {n} tokens; a {num_tokens}-token sequence gives it {sizes[rank]}")

    def to_heads(x: torch.Tensor) -> torch.Tensor:  # (B, n, H, D) -> (B, N, H/p, D)
        parts = x.reshape(b, n, world, hs, x.shape[-1]).permute(2, 1, 0, 3, 4).reshape(world * n, b, hs, x.shape[-1])
        return _all_to_all(parts, sizes, [n] * world, group).permute(1, 0, 2, 3)

    out = attend(to_heads(q), to_heads(k), to_heads(v), slice(rank * hs, (rank + 1) * hs))
    e = out.shape[-1]
    back = _all_to_all(out.permute(1, 0, 2, 3), [n] * world, sizes, group)  # (p * n, B, H/p, E)
    return back.reshape(world, n, b, hs, e).permute(2, 1, 0, 3, 4).reshape(b, n, h, e)


def ring_start(num_tokens: int, group: dist.ProcessGroup) -> int:
    """The global index of this process's first token."""
    return shard_bounds(num_tokens, dist.get_world_size(group), dist.get_rank(group))[0]


def _keep_parallel_config(module: torch.nn.Module, _args: Any) -> None:
    """Forward pre-hook: hands the model's parallel config to self-attention processors built after
    ``enable_parallelism`` (a conversion to another variant, or ``generate()``'s own conversion, installs new
    processors, which diffusers never saw)."""
    config = getattr(module, "_parallel_config", None)
    if config is None:
        return
    for block in getattr(module, "blocks", ()):
        processor = getattr(getattr(block, "attn1", None), "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config") and processor._parallel_config is None:
            processor._parallel_config = config


def enable_context_parallel(transformer: torch.nn.Module, mode: str, degree: int) -> None:
    """``transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=degree))`` (``mode="ring"``) or
    ``(ulysses_degree=degree)``, in a process group already joined. Convert the transformer first: diffusers hands
    its config to the processors that exist at that moment; a forward pre-hook hands it to processors installed
    later. On a machine without an accelerator diffusers' ``rank % torch.accelerator.device_count()`` divides by
    zero: there (only) the count is taken as 1, the CPU."""
    from unittest import mock

    from diffusers import ContextParallelConfig

    if mode not in ("ulysses", "ring"):
        raise ValueError(f"context parallel mode {mode!r}: expected ulysses or ring")
    config = (
        ContextParallelConfig(ring_degree=degree) if mode == "ring" else ContextParallelConfig(ulysses_degree=degree)
    )
    if torch.accelerator.device_count() == 0:
        with mock.patch("torch.accelerator.device_count", return_value=1):
            transformer.enable_parallelism(config=config)  # type: ignore[operator]
    else:
        transformer.enable_parallelism(config=config)  # type: ignore[operator]
    transformer.register_forward_pre_hook(_keep_parallel_config)


def exit_process(code: int = 0) -> NoReturn:
    """Ends a process whose distributed work is done (its process group destroyed) without the interpreter's
    teardown. On a CPU, gloo's threads sometimes abort that teardown ("terminate called without an active
    exception", SIGABRT) after everything was written: measured about 1 run in 15 of the context-parallel
    benchmark's 2-process workers on a loaded 2-core CPU, 0 in 40 with this exit. torchrun or ``mp.spawn`` would
    then report a failure for a finished run. Streams and log handlers are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

"""A generation beyond one GPU's memory or beyond one GPU: the CLI's ``--offload``, ``--vae-tiling``,
``--context-parallel`` and ``--cp-degree``.

    python -m pipelines.cli ... --offload group --vae-tiling
    torchrun --nproc-per-node 4 -m pipelines.cli ... --variant mhla --context-parallel ring

Offloading and tiling are :mod:`pipelines.memory` (diffusers' hooks, applied once after loading). Context
parallelism is diffusers' ``transformer.enable_parallelism`` with a ``ContextParallelConfig`` (linear and MHLA
layers: :mod:`pipelines.context_parallel`): every process started by ``torchrun`` loads the model, runs the same
seeded generation on its slice of the sequence (ring) or its share of the heads (Ulysses), and only process 0
writes files and prints. Everything is checked before a model loads (:func:`check_scale`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from .attention import SOFTMAX_VARIANTS
from .memory import OFFLOAD_MODES, Offload, apply_offload

if TYPE_CHECKING:
    from .loading import WanComponents
    from .model import MHLAWanTransformer3DModel
    from .request import GenerationRequest

CP_MODES = ("ulysses", "ring")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--offload``, ``--vae-tiling``, ``--context-parallel``, ``--cp-degree`` on the CLI's parser."""
    p.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default="none",
        help="diffusers' offload hooks: model (enable_model_cpu_offload: one component on the device at a time), "
        "group (block-level group offloading, CUDA streams on a GPU), sequential (one layer's weights at a time); "
        "default none",
    )
    p.add_argument("--vae-tiling", action="store_true", help="decode the video in overlapping 256 px tiles")
    p.add_argument(
        "--context-parallel",
        choices=CP_MODES,
        default=None,
        help="split one video over the processes torchrun starts: ring (each holds a slice of the tokens) or "
        "ulysses (each holds a share of the heads); e.g. torchrun --nproc-per-node 4 -m pipelines.cli ...",
    )
    p.add_argument(
        "--cp-degree",
        type=int,
        default=None,
        help="processes one video is split over (default and only value: the number torchrun started)",
    )


@dataclass
class Scale:
    """What the command line asked for beyond one device, checked (:func:`check_scale`)."""

    offload: str = "none"
    vae_tiling: bool = False
    context_parallel: str | None = None
    degree: int = 1
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    _offload: Offload | None = None
    _group: bool = False

    @property
    def main(self) -> bool:
        """Whether this process writes files and prints (process 0, or the only one)."""
        return self.rank == 0

    def run_device(self, device: torch.device) -> torch.device:
        """The device this process computes on: its own GPU (``LOCAL_RANK``) under context parallelism."""
        if self.context_parallel and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def load_device(self, device: torch.device) -> torch.device:
        """Where the components load: the CPU when they are offloaded (the hooks bring them to ``device``)."""
        return torch.device("cpu") if self.offload != "none" else self.run_device(device)

    def start(self, device: torch.device) -> None:
        """Joins the process group (nccl on CUDA, gloo on the CPU) under context parallelism."""
        if not self.context_parallel:
            return
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self._group = True

    def close(self) -> None:
        if self._group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._group = False

    def attach(self, components: WanComponents, device: torch.device) -> str:
        """The offload hooks and VAE tiling, once, on the loaded components; returns what is on, as the model line
        shows it (:meth:`describe`: "" when nothing is)."""
        if self.offload != "none" or self.vae_tiling:
            self._offload = apply_offload(components, self.offload, device, self.vae_tiling)
        return self.describe()

    def describe(self) -> str:
        parts = [self._offload.describe()] if self._offload is not None else []
        if self.context_parallel:
            parts.append(f"context parallel: {self.context_parallel} over {self.degree} processes")
        return " · ".join(p for p in parts if p)

    @contextmanager
    def running(
        self,
        components: WanComponents,
        request: GenerationRequest,
        transformer: MHLAWanTransformer3DModel,
        overrides: dict[str, Any] | None,
        drop: bool = False,
    ) -> Iterator[None]:
        """Around ``generate(components, request, transformer=transformer)``. Before: ``transformer`` (and the
        model's second expert) converted to the request's variant as ``generate()`` will (which then adds nothing),
        each with its own hybrid split, under the hooks (:meth:`pipelines.memory.Offload.prepare`), and context
        parallelism enabled on it (once per transformer, after its first conversion). After: every component back
        on the offload device; ``drop``: ``transformer`` (a variant's own, loaded for its runs) unhooked and
        forgotten."""
        from .pipeline import convert_for_request

        experts: list[tuple[MHLAWanTransformer3DModel, list[int] | None, str]] = [
            (transformer, request.layers, "transformer")
        ]
        second = getattr(components, "transformer_2", None)
        if second is not None:
            experts.append((second, request.layers_2, "transformer_2"))

        def convert(expert: MHLAWanTransformer3DModel, layers: list[int] | None, name: str) -> None:
            convert_for_request(components, expert, request, overrides, layers, name)

        if self.context_parallel:  # (check_scale refuses it with offloading)
            from .context_parallel import enable_context_parallel

            for expert, layers, name in experts:
                convert(expert, layers, name)
                if getattr(expert, "_parallel_config", None) is None:
                    enable_context_parallel(expert, self.context_parallel, self.degree)
        offload = self._offload
        if offload is not None:
            for expert, layers, name in experts:
                offload.prepare(expert, partial(convert, expert, layers, name))
        try:
            yield
        finally:
            if offload is not None:
                offload.release()
                if drop:
                    offload.detach(transformer)


def check_scale(
    args: argparse.Namespace,
    requests: Sequence[GenerationRequest],
    device: torch.device,
    num_heads: int,
    env: Mapping[str, str] | None = None,
) -> Scale:
    """The checked :class:`Scale` of a command line; ValueError naming the value and what was expected (before
    any model loads). ``args.offload``: a mode :func:`pipelines.memory.check_offload` passed for ``device`` (the
    CLI checks it with the other values). ``env``: the process environment (``torchrun`` sets ``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``)."""
    env = os.environ if env is None else env
    offload = args.offload
    scale = Scale(offload=offload, vae_tiling=bool(args.vae_tiling))
    mode = args.context_parallel
    if mode is None:
        if args.cp_degree is not None:
            raise ValueError(f"--cp-degree {args.cp_degree}: applies with --context-parallel ulysses|ring only")
        return scale
    if mode not in CP_MODES:
        raise ValueError(f"--context-parallel {mode!r}: expected one of {', '.join(CP_MODES)}")
    launch = f"torchrun --nproc-per-node N -m pipelines.cli ... --context-parallel {mode}"
    if "WORLD_SIZE" not in env or "RANK" not in env:
        raise ValueError(
            f"--context-parallel {mode}: one process per device is needed, started by torchrun ({launch}); "
            "WORLD_SIZE and RANK are not set, so this is a single process"
        )
    try:
        world, rank, local_rank = int(env["WORLD_SIZE"]), int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError:
        raise ValueError(
            f"--context-parallel {mode}: WORLD_SIZE={env['WORLD_SIZE']!r}, RANK={env['RANK']!r} are not whole numbers "
            f"(start the command with {launch})"
        ) from None
    degree = world if args.cp_degree is None else args.cp_degree
    if world < 2:
        raise ValueError(f"--context-parallel {mode}: torchrun started {world} process; start 2 or more ({launch})")
    if degree != world:
        raise ValueError(
            f"--cp-degree {degree}: expected the number of processes torchrun started ({world}); one video is split "
            "over all of them (leave --cp-degree unset)"
        )
    if offload != "none":
        raise ValueError(
            f"--offload {offload} with --context-parallel {mode}: not combined (untested); each process holds the "
            "whole model, so use one or the other"
        )
    if mode == "ulysses" and num_heads % degree:
        raise ValueError(
            f"--context-parallel ulysses --cp-degree {degree}: the model's {num_heads} attention heads do not divide "
            f"by {degree}; each process takes an equal share of the heads (use a degree dividing {num_heads}, or ring)"
        )
    for request in requests:
        tokens = math.prod(request.grid or (0,))
        if tokens % degree:
            raise ValueError(
                f"--context-parallel {mode} over {degree} processes: the video's {tokens} tokens "
                f"({'x'.join(map(str, request.grid or ()))}) do not divide by {degree}; diffusers splits the sequence "
                "into equal parts (choose --frames, --height or --width so they do)"
            )
        if mode == "ring" and device.type == "cpu" and request.variant in SOFTMAX_VARIANTS:
            raise ValueError(
                f"--context-parallel ring on the CPU: variant {request.variant!r} has softmax self-attention layers, "
                "which cannot ring here (the ring merges partial softmax results by their log-sum-exp, which "
                "diffusers' CPU attention does not return); use --variant linear or mhla, or --context-parallel ulysses"
            )
    scale.context_parallel, scale.degree = mode, degree
    scale.rank, scale.world, scale.local_rank = rank, world, local_rank
    return scale

"""Sequence-parallel ("ring") MHLA: time per layer and the share spent in communication, over 1-8 processes.

    python -m benchmarks.context_parallel                          # CPU, gloo: 1, 2 and 4 processes, 5x16x20 tokens
    python -m benchmarks.context_parallel --grid 21x30x52 --blocks 7x3x4 --procs 1 2 4 8 --device cuda   # GPUs, NCCL

Each process holds a contiguous slice of the sequence (``torch.tensor_split``'s split, as diffusers' context
parallelism makes it) and runs :func:`mhla.parallel.mhla_attention_sharded`: its tokens' block summaries, one
``all_reduce(SUM)`` of the ``B x M x H x D x D`` summaries and the normalizer sums, the mixing and its own
queries' outputs. Per process count it prints the median time of the whole layer, the median of the same
all-reduces alone, their share, and the bytes each process sends. On a CPU with fewer cores than processes the
processes share the cores, so the compute time does not fall with more processes there: the table shows the
communication's cost, not the scaling a GPU per process would show (run it on GPUs for that).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import RESULTS
from mhla.layout import BlockLayout, parse_blocks, parse_grid
from mhla.parallel import mhla_attention_sharded, shard_bounds
from pipelines.context_parallel import exit_process

_LOAD: list[tuple[float, float, float]] = []


def _machine(device: str) -> dict:
    """Where the numbers were taken: the CPU (or GPU), its cores, the load around the run, the date."""
    import datetime
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    what = f"{cpu}, {os.cpu_count()} cores"
    if device == "cuda" and torch.cuda.is_available():
        what = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; host {what}"
    return {
        "description": what,
        "load_avg_start": [round(x, 2) for x in _LOAD[0]] if _LOAD else None,
        "load_avg_end": [round(x, 2) for x in _LOAD[1]] if len(_LOAD) > 1 else None,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, procs: int, init: str, args: dict, out: dict) -> None:
    backend = "nccl" if args["device"] == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=procs)
    try:
        device = torch.device(f"cuda:{rank}" if args["device"] == "cuda" else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(max(1, args["threads"] // procs))
        layout = BlockLayout(args["grid"], args["blocks"])
        n, h, d = layout.num_tokens, args["heads"], args["head_dim"]
        start, stop = shard_bounds(n, procs, rank)
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, stop - start, h, d, generator=g).to(device) for _ in range(3))
        mixing = torch.full((layout.num_blocks, layout.num_blocks), 1.0 / layout.num_blocks, device=device)
        summaries = torch.zeros(1, layout.num_blocks, h, d, d, device=device)
        sums = torch.zeros(1, layout.num_blocks, h, d, device=device)
        layer, comm = [], []
        with torch.no_grad():
            for i in range(args["warmup"] + args["repeats"]):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                mhla_attention_sharded(q, k, v, layout, mixing, start)
                _sync(device)
                t1 = time.perf_counter()
                dist.barrier()
                _sync(device)
                t2 = time.perf_counter()
                dist.all_reduce(summaries)
                dist.all_reduce(sums)
                _sync(device)
                t3 = time.perf_counter()
                if i >= args["warmup"]:
                    layer.append(t1 - t0)
                    comm.append(t3 - t2)
        if rank == 0:
            out["layer_ms"] = statistics.median(layer) * 1e3
            out["allreduce_ms"] = statistics.median(comm) * 1e3
            out["tokens_per_process"] = stop - start
    finally:
        dist.destroy_process_group()
    exit_process(0)  # the results are in ``out``: see exit_process for why not a plain return


def measure(procs: int, args: dict) -> dict:
    out = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(procs, os.path.join(tmp, "init"), args, out), nprocs=procs, join=True)
    layout = BlockLayout(args["grid"], args["blocks"])
    numbers = layout.num_blocks * args["heads"] * args["head_dim"] * (args["head_dim"] + 1)
    sent = 0 if procs == 1 else 2 * (procs - 1) / procs * numbers * 4  # ring all-reduce, float32
    return {
        "processes": procs,
        "tokens_per_process": out["tokens_per_process"],
        "layer_ms": round(out["layer_ms"], 2),
        "allreduce_ms": round(out["allreduce_ms"], 2) if procs > 1 else 0.0,
        "comm_share": round(out["allreduce_ms"] / out["layer_ms"], 3) if procs > 1 else 0.0,
        "sent_mb_per_process": round(sent / 1e6, 2),
    }


# (name, token grid, M, heads, head_dim) for the communication volumes of --volumes
WAN_SETTINGS = (
    ("Wan2.1-1.3B 81x480x832", (21, 30, 52), 105, 12, 128),
    ("Wan2.1-14B 81x480x832", (21, 30, 52), 105, 40, 128),
    ("Wan2.1-14B 81x720x1280", (21, 45, 80), 168, 40, 128),
)


def volumes(grid: tuple[int, int, int], m: int, heads: int, head_dim: int, procs: int) -> dict:
    """MB each process sends per self-attention layer: ring (one all-reduce of the M x H x d x (d + 1) summaries and
    normalizer sums in float32: 2 (p - 1) / p of it) and Ulysses (q, k, v out and the output back in bfloat16:
    4 tensors of this process's N / p tokens x H x d, of which (p - 1) / p leave)."""
    n = math.prod(grid)
    ring = 2 * (procs - 1) / procs * m * heads * head_dim * (head_dim + 1) * 4
    ulysses = 4 * (n / procs) * heads * head_dim * 2 * (procs - 1) / procs
    return {"ring_mb": round(ring / 1e6, 1), "ulysses_mb": round(ulysses / 1e6, 1)}


def print_volumes() -> None:
    print("| setting | M | processes | ring MB sent per process | Ulysses MB sent per process |")
    print("|---|---:|---:|---:|---:|")
    for name, grid, m, heads, d in WAN_SETTINGS:
        for procs in (2, 4, 8):
            v = volumes(grid, m, heads, d, procs)
            print(f"| {name} | {m} | {procs} | {v['ring_mb']} | {v['ulysses_mb']} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="5x16x20", help="token grid FxHxW (default: the built-in model's 1,600 tokens)")
    p.add_argument("--blocks", default="2x4x5")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads shared by the processes")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--out", default=None, help="writes OUT.json (default: benchmarks/results/context_parallel_<device>)"
    )
    p.add_argument(
        "--volumes", action="store_true", help="print the bytes per layer at Wan's sizes (computed) and stop"
    )
    a = p.parse_args(argv)
    if a.volumes:
        print_volumes()
        return 0
    try:  # a grid or layout that does not fit stops here, before any process starts
        grid, blocks = parse_grid(a.grid), parse_blocks(a.blocks)
        BlockLayout(grid, blocks)
    except ValueError as e:
        p.error(str(e))
    if a.device == "cuda" and max(a.procs) > torch.cuda.device_count():
        p.error(f"--procs {max(a.procs)} needs that many GPUs; this machine has {torch.cuda.device_count()}")
    if min(a.procs) < 1 or max(a.procs) > math.prod(grid):
        p.error(f"--procs must lie in 1..{math.prod(grid)} (the tokens), got {a.procs}")
    args = dict(
        grid=grid,
        blocks=blocks,
        heads=a.heads,
        head_dim=a.head_dim,
        device=a.device,
        threads=a.threads,
        warmup=a.warmup,
        repeats=a.repeats,
    )
    load_start = os.getloadavg()
    rows = [measure(n, args) for n in a.procs]
    _LOAD.extend([load_start, os.getloadavg()])
    print(
        f"ring MHLA, {a.grid} tokens ({math.prod(grid)}), {a.blocks} blocks, {a.heads} heads x {a.head_dim}, "
        f"{a.device}, {a.threads} threads shared"
    )
    print("| processes | tokens each | layer ms | all-reduce ms | comm share | MB sent per process |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['processes']} | {r['tokens_per_process']} | {r['layer_ms']} | {r['allreduce_ms']} | "
            f"{r['comm_share']:.0%} | {r['sent_mb_per_process']} |"
        )
    out = Path(a.out) if a.out else RESULTS / f"context_parallel_{a.device}"
    out = out.with_name(out.name.removesuffix(".json") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    machine = _machine(a.device)
    tmp.write_text(json.dumps({"settings": {**vars(a)}, "machine": machine, "rows": rows}, indent=1) + "\n")
    tmp.replace(out)
    md = out.with_suffix(".md")
    lines = [
        f"# Ring MHLA over processes ({a.device}): communication share",
        "",
        f"`python -m benchmarks.context_parallel {' '.join(argv if argv is not None else sys.argv[1:])}`. "
        f"{a.grid} tokens ({math.prod(grid)}), {a.blocks} blocks, {a.heads} heads x {a.head_dim}, float32. "
        f"Machine: {machine['description']}; load average at the start {machine['load_avg_start']}, at the end "
        f"{machine['load_avg_end']}; {machine['date']}. Processes share {a.threads} CPU threads.",
        "",
        "| processes | tokens each | layer ms | all-reduce ms | comm share | MB sent per process |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['processes']} | {r['tokens_per_process']} | {r['layer_ms']} | {r['allreduce_ms']} | "
            f"{r['comm_share']:.0%} | {r['sent_mb_per_process']} |"
            for r in rows
        ),
    ]
    tmp = md.with_name(md.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(md)
    print(f"wrote {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Shared by the benchmark scripts: timing, device facts, measured ceilings, result files.

Timing follows the device method notes: warm-up first, then the median of repeated runs; CUDA
events on a GPU (with the L2 cache flushed before each timed run, as ``triton.testing.do_bench``
does, so small inputs are not timed out of the cache), wall clock on a CPU.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from common.outputs import atomic_write, write_text_atomic
from common.timing import device_name  # the one owner (the CPU's model name from /proc/cpuinfo)

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Times ``fn()`` in milliseconds: CUDA events (after an L2 flush) on a GPU, wall clock on a CPU."""

    def __init__(self, device: torch.device, flush_l2: bool = True):
        self.device = device
        self.flush = None
        if device.type == "cuda" and flush_l2:
            self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

    def __call__(self, fn) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        if self.flush is not None:
            self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def compiled_graphs() -> int:
    """Graphs TorchDynamo has compiled in this process so far (0 when torch.compile never ran). A timed run of
    a compiled model must not change it: a graph compiled while timing means the times include compiling (a
    guard that fails on every call once made compiled MHLA look no faster than softmax)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(fn, device: torch.device, warmup: int, repeats: int, timer: Timer | None = None) -> dict:
    """Median (and min, spread) of ``repeats`` timed runs after ``warmup`` runs, and the peak memory
    the runs allocate above what was allocated before them (CUDA only; ``None`` on a CPU)."""
    timer = timer or Timer(device)
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    graphs = compiled_graphs()
    times = [timer(fn) for _ in range(repeats)]
    out = {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
        "repeats": repeats,
        "peak_mib": None,
        "peak_total_mib": None,
        "graphs_compiled_while_timed": compiled_graphs() - graphs,
    }
    if device.type == "cuda":
        out["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        out["peak_total_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def cpu_peak_bytes(fn) -> int:
    """Peak bytes allocated by one call of ``fn()`` on the CPU above what was allocated before it
    (PyTorch's CPU allocator as its profiler records it; Python objects and the allocator's cache
    not counted)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    running = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        running += e["args"]["Bytes"]
        peak = max(peak, running)
    return peak


def measure_interleaved(fns: list, device: torch.device, warmup: int, repeats: int, timer: Timer | None = None):
    """:func:`measure` for several functions timed in turn (``a b c a b c ...``), so that a change of
    load on a shared machine hits every variant alike. Returns one dict per function."""
    timer = timer or Timer(device)
    for fn in fns:
        for _ in range(warmup):
            fn()
    sync(device)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            ts.append(timer(fn))
    return [{"ms": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts), "repeats": repeats} for ts in times]


def attention_min_bytes(numel: int, size_in: int, size_out: int, backward: bool) -> int:
    """The fewest bytes an attention op moves, for q, k, v of ``numel`` elements each (``size_in`` bytes
    per element) and an output as large (``size_out``): forward, q, k, v read and the output written;
    forward+backward adds q, k, v read again, the output gradient read and dq, dk, dv written."""
    fwd = numel * (3 * size_in + size_out)
    return fwd + numel * (6 * size_in + size_out) if backward else fwd


def copy_bandwidth(device: torch.device) -> float:
    """Measured device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = (1024 if device.type == "cuda" else 64) * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = Timer(device, flush_l2=False)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        ms = statistics.median(t(lambda: dst.copy_(src)) for _ in range(10))
    else:  # a limit: the best of several runs (a shared CPU's load only ever slows a run down)
        ms = min(t(lambda: dst.copy_(src)) for _ in range(15))
    return 2 * n / (ms / 1e3)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Measured dense matrix-product rate in FLOP/s for ``dtype`` (random operands, never zeros)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = Timer(device, flush_l2=False)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        ms = statistics.median(t(lambda: a @ b) for _ in range(10))
    else:  # the best of several runs, as for the copy bandwidth
        ms = min(t(lambda: a @ b) for _ in range(10))
    return 2 * n**3 / (ms / 1e3)


def device_kind(device: torch.device) -> str:
    """Short file-name tag for the device: ``h100``, ``h200``, ``a100``..., or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")[:20]


def environment(device: torch.device) -> dict:
    """Device and software facts for the JSON header."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import os

    info = {
        "device": device_name(device),
        "device_type": device.type,
        "device_kind": device_kind(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "triton_mode": (
            "interpreter"
            if os.environ.get("TRITON_INTERPRET") == "1"
            else ("compiled" if device.type == "cuda" else "unused (no GPU)")
        ),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
        )
        try:
            import diffusers

            info["diffusers"] = diffusers.__version__
        except ImportError:
            pass
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def default_tag(prefix: str, device: torch.device) -> str:
    return f"{prefix}_{device_kind(device)}_{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d')}"


def cpu_caveat(meta: dict) -> list[str]:
    """A line that heads every CPU table: such runs check the scripts, they measure no speed."""
    if meta.get("device_type") == "cuda":
        return []
    return [
        f"**CPU run ({meta.get('device_type')}): this checks that the benchmark runs; its times (wall clock on a "
        "shared machine, few repeats) say nothing about GPU speed.**",
        "",
    ]


def write_partial(out_dir: Path, tag: str, meta: dict, rows: list[dict]) -> None:
    """Writes ``<tag>.json`` with the rows so far (``meta["complete"] = False``), so a run that is
    killed part-way (a time limit on the GPU machine) still leaves its measurements behind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": {**meta, "complete": False}, "rows": rows}
    write_text_atomic(out_dir / f"{tag}.json", json.dumps(data, indent=2) + "\n")


def write_results(out_dir: Path, tag: str, meta: dict, rows: list[dict], table: str, plot=None) -> list[Path]:
    """Writes ``<tag>.json`` (meta + rows), ``<tag>.md`` (the table) and, when ``plot`` is given and
    matplotlib is installed, ``<tag>.png`` (``plot(ax_factory, path)``). Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{tag}.json", out_dir / f"{tag}.md"]
    write_text_atomic(written[0], json.dumps({"meta": {**meta, "complete": True}, "rows": rows}, indent=2) + "\n")
    write_text_atomic(written[1], table)
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot written")
        else:
            fig = plot(plt)
            png = out_dir / f"{tag}.png"
            with atomic_write(png) as tmp:
                fig.savefig(tmp, dpi=110)
            plt.close(fig)
            written.append(png)
    print("wrote " + ", ".join(str(p) for p in written))
    return written

"""Attention operator latency and peak memory versus token count.

    python -m benchmarks.attention                          # CPU-sized defaults on this machine
    python -m benchmarks.attention --grids 21x30x50,21x30x52 --heads 12 --dim 128 --dtype bf16 --backward

Times softmax (the fastest backend present, or every backend with --softmax-backends all),
vanilla linear attention and MHLA (PyTorch path) on q, k, v of shape (1, N, heads, dim) over
latent-token grids, forward (and forward+backward with --backward). Prints a markdown table with
each variant's ratio to the memory floor (bytes of q, k, v and output over the measured copy
bandwidth) and writes JSON, markdown and a log-log PNG to benchmarks/results/.
Median of --repeats timed runs after --warmup runs; CUDA events on a GPU, wall clock on a CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from mhla import BlockLayout, last_softmax_backend, linear_attention, locality_init, mhla_attention, softmax_attention
from mhla.softmax import _candidates

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_GRIDS = "2x32x32,8x32x32,32x32x32"
GPU_GRIDS = "1x32x32,4x32x32,16x32x32,21x30x50,21x30x52,32x48x48,32x64x64"


def parse_grid(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a grid looks like 21x30x50 (frames x height x width), got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def timer(device: torch.device):
    """Returns a function that times ``fn()`` once in milliseconds."""
    if device.type == "cuda":

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end)

    else:

        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

    return run


def copy_bandwidth(device: torch.device) -> float:
    """Measured device copy bandwidth in bytes/s (read + write), median of a few large copies."""
    n = (256 if device.type == "cuda" else 64) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(device)
    for _ in range(2):
        dst.copy_(src)
    ms = statistics.median(t(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * n / (ms / 1e3)


def measure(fn, device, warmup: int, repeats: int) -> dict:
    t = timer(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = [t(fn) for _ in range(repeats)]
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    return {"ms": statistics.median(times), "ms_min": min(times), "peak_mib": peak}


def variants(args, device, dtype):
    backends = _candidates(torch.empty(0, device=device, dtype=dtype)) if args.softmax_backends == "all" else ["auto"]
    out = [(f"softmax[{b}]", "softmax", b) for b in backends]
    return out + [("linear", "linear", None), ("mhla", "mhla", None)]


def run_case(kind, backend, q, k, v, layout, mixing, rope, backward):
    if kind == "softmax":
        fwd = lambda: softmax_attention(q, k, v, backend=backend)  # noqa: E731
    elif kind == "linear":
        fwd = lambda: linear_attention(q, k, v, normalize=False, rotary_emb=rope)  # noqa: E731
    else:
        fwd = lambda: mhla_attention(q, k, v, layout, mixing, normalize=False, rotary_emb=rope)  # noqa: E731
    if not backward:
        return fwd

    def step():
        out = fwd()
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None

    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grids", default=None, help=f"comma-separated FxHxW token grids (CPU default {CPU_GRIDS})")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=None, help="head dim (default 128 on GPU, 64 on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--backward", action="store_true", help="time forward+backward instead of forward")
    p.add_argument("--softmax-backends", choices=["auto", "all"], default="auto")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--max-softmax-tokens",
        type=int,
        default=None,
        help="skip softmax above this many tokens (default: no limit on GPU, 40k on CPU)",
    )
    p.add_argument("--tag", default=None, help="name of the result files (default attention_<device>)")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    dim = args.dim or (64 if cpu else 128)
    grids = [parse_grid(g) for g in (args.grids or (CPU_GRIDS if cpu else GPU_GRIDS)).split(",")]
    warmup = args.warmup if args.warmup is not None else (1 if cpu else 5)
    repeats = args.repeats if args.repeats is not None else (3 if cpu else 20)
    max_softmax = args.max_softmax_tokens or (40_000 if cpu else None)
    bandwidth = copy_bandwidth(device)
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    )

    print(
        f"# attention {'forward+backward' if args.backward else 'forward'} on {device_name} ({device.type}), "
        f"{str(dtype).replace('torch.', '')}, heads={args.heads}, dim={dim}, torch {torch.__version__}, "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, median of {repeats} after {warmup} warm-up"
    )
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for grid in grids:
        layout = BlockLayout.for_grid(grid)
        n = layout.num_tokens
        shape = (1, n, args.heads, dim)
        q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(args.backward) for _ in range(3))
        angles = torch.rand(1, n, 1, dim // 2, generator=gen).repeat_interleave(2, -1) * 6.28
        rope = (angles.cos().to(device), angles.sin().to(device))
        mixing = locality_init(layout).float().to(device)
        floor_ms = 4 * q.numel() * q.element_size() / bandwidth * 1e3 * (3 if args.backward else 1)
        for name, kind, backend in variants(args, device, dtype):
            row = {
                "grid": "x".join(map(str, grid)),
                "tokens": n,
                "blocks": layout.num_blocks,
                "variant": name,
                "floor_ms": floor_ms,
            }
            if kind == "softmax" and max_softmax and n > max_softmax:
                row["skipped"] = f"softmax above {max_softmax} tokens (--max-softmax-tokens)"
            else:
                try:
                    fn = run_case(kind, backend, q, k, v, layout, mixing, rope, args.backward)
                    row.update(measure(fn, device, warmup, repeats))
                    if kind == "softmax":
                        row["backend"] = last_softmax_backend()
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # OOM or unsupported: report, go on
                    row["skipped"] = str(e).splitlines()[0][:100]
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
            print(format_row(row), flush=True)
        del q, k, v

    meta = {
        "benchmark": "attention",
        "pass": "forward+backward" if args.backward else "forward",
        "device": device_name,
        "device_type": device.type,
        "dtype": str(dtype).replace("torch.", ""),
        "heads": args.heads,
        "head_dim": dim,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "warmup": warmup,
        "repeats": repeats,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    table = markdown(rows, meta)
    print("\n" + table)
    if not args.no_save:
        tag = args.tag or f"attention_{device.type}{'_bwd' if args.backward else ''}"
        save(rows, meta, table, tag)


def format_row(row):
    if "skipped" in row:
        return f"{row['grid']:>10} N={row['tokens']:>7} {row['variant']:<22} skipped: {row['skipped']}"
    peak = f" peak {row['peak_mib']:.0f} MiB" if row.get("peak_mib") is not None else ""
    return (
        f"{row['grid']:>10} N={row['tokens']:>7} {row['variant']:<22} {row['ms']:10.2f} ms "
        f"({row['ms'] / row['floor_ms']:.1f}x floor){peak}"
    )


def markdown(rows, meta) -> str:
    lines = [
        f"Attention {meta['pass']}, {meta['device']} ({meta['device_type']}), {meta['dtype']}, "
        f"{meta['heads']} heads x {meta['head_dim']}, torch {meta['torch']}, {meta['date']}",
        "",
        "| grid | tokens | M | variant | backend | ms | x floor | growth vs previous grid | peak MiB |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    prev: dict[str, tuple[int, float]] = {}
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['grid']} | {r['tokens']} | {r['blocks']} | {r['variant']} | | skipped | | | |")
            continue
        growth = ""
        if r["variant"] in prev:
            n0, ms0 = prev[r["variant"]]
            growth = f"{r['ms'] / ms0:.1f}x for {r['tokens'] / n0:.1f}x tokens"
        prev[r["variant"]] = (r["tokens"], r["ms"])
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
        lines.append(
            f"| {r['grid']} | {r['tokens']} | {r['blocks']} | {r['variant']} | {r.get('backend', '')} | "
            f"{r['ms']:.2f} | {r['ms'] / r['floor_ms']:.1f} | {growth} | {peak} |"
        )
    return "\n".join(lines) + "\n"


def save(rows, meta, table, tag):
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / f"{tag}.md").write_text(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["tokens"], r["ms"]) for r in rows if r["variant"] == variant and "ms" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=variant)
    done = [r for r in rows if "ms" in r]
    if done:
        n0 = min(r["tokens"] for r in done)
        t0 = min(r["ms"] for r in done if r["tokens"] == n0)
        ns = sorted({r["tokens"] for r in rows})
        ax.plot(ns, [t0 * n / n0 for n in ns], "k:", lw=1, label="O(N) slope")
        ax.plot(ns, [t0 * (n / n0) ** 2 for n in ns], "k--", lw=1, label="O(N^2) slope")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="tokens N",
        ylabel="ms",
        title=f"attention {meta['pass']}: {meta['device']}, {meta['dtype']}",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{tag}.png", dpi=120)
    print(f"wrote {RESULTS / tag}.json/.md/.png")


if __name__ == "__main__":
    main()

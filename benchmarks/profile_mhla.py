"""Where the fused MHLA operator's time goes: a profile per kernel, with the bytes each must move.

    python -m benchmarks.profile_mhla                       # GPU: 21x30x50, 12 heads x 128, bf16, v2 and v1
    python -m benchmarks.profile_mhla --passes fwd --versions v2 --grid 21x30x52
    python -m benchmarks.profile_mhla --device cpu --grid 2x4x6 --heads 2 --dim 16 --iters 1   # smoke run

Runs :func:`mhla.triton_ops.mhla_attention_fused` (forward, and forward+backward) under
``torch.profiler`` after a warm-up (which also autotunes), and sums each device kernel's own time
per iteration: the four Triton kernels (summaries, output, backward_query, backward_key), the mixing
matrix products, the RoPE-table slicing and any other copy. For the Triton kernels it adds the bytes
that kernel must move at least (its inputs read once, its outputs written once; the RoPE tables once,
not per head) and the bandwidth that implies, next to the measured copy bandwidth of the device. The
total is compared with the operator's memory floor (``common.attention_min_bytes``, as in
``benchmarks.attention``).

This is the profile the issue asks for when a measured number misses its target. On a CPU the
kernels run in Triton's interpreter and the profile only shows that the script works.
Writes ``profile_mhla_<device>_<grid>.json`` and ``.md`` to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mhla import BlockLayout, locality_init, triton_ops
from mhla.layout import parse_grid

from .common import (
    DTYPES,
    RESULTS,
    attention_min_bytes,
    copy_bandwidth,
    cpu_caveat,
    device_kind,
    dtype_name,
    environment,
    sync,
    write_results,
)

KERNELS = triton_ops.KERNEL_NAMES


def kernel_bytes(name: str, *, b, n, h, d, e, m, size_in, size_sum, size_out, normalize, rope_half, size_rope=4) -> int:
    """The fewest bytes kernel ``name`` moves: each tensor it reads or writes, once."""
    x_k = b * n * h * d * size_in  # q or k (and dq or dk)
    x_v = b * n * h * e * size_in  # v (and dv)
    out = b * n * h * e * size_out  # the output (and its gradient)
    summ = b * h * m * d * e * size_sum  # the block summaries (mixed or not, or their gradients)
    z = b * h * m * d * 4 if normalize else 0  # normalizer sums, float32
    den = b * h * n * 4 if normalize else 0  # per-token denominators, float32
    # cos and sin, read once for all heads (v2: the half tables, bf16 for bf16 inputs; v1: full, float32)
    rope = 2 * n * d * size_rope // (2 if rope_half else 1)
    if name == "summaries":
        return x_k + x_v + rope + summ + z  # z only with the normalizer
    if name == "output":
        return x_k + summ + z + rope + out + den
    if name == "backward_query":
        return x_k + out + summ + z + den + rope + x_k + summ + z
    if name == "backward_key":
        return x_k + x_v + summ + z + rope + x_k + x_v
    raise ValueError(name)


def label(key: str) -> str:
    """Short name of a profiler entry: the Triton kernels by their role, the rest as reported."""
    for name in KERNELS:
        if key in (f"_{name}_kernel", f"mhla.{name}"):
            return name
    return key


def profile_once(fn, device: torch.device, iters: int) -> dict[str, dict]:
    """``{entry: {"us": own time per iteration, "calls": per iteration}}`` for the kernels (GPU) or
    the kernels' profiler ranges and other operators (CPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    entries: dict[str, dict] = {}
    for ev in prof.key_averages():
        if device.type == "cuda":
            us = getattr(ev, "self_device_time_total", None)
            if us is None:  # older torch
                us = ev.self_cuda_time_total
            if ev.key.startswith("mhla."):  # the ranges: their kernels are listed by name already
                continue
        else:
            us = ev.self_cpu_time_total
        if us <= 0:
            continue
        key = label(ev.key)
        slot = entries.setdefault(key, {"us": 0.0, "calls": 0.0})
        slot["us"] += us / iters
        slot["calls"] += ev.count / iters
    return entries


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grid", default="21x30x50", help="latent-token grid F x H x W (default 21x30x50)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=128, help="head_dim (default 128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default=None, help="bf16 (GPU default), fp16 or fp32 (CPU default)")
    p.add_argument("--out-dtype", default=None, help="output dtype (default: the input's; fp32 as the pipeline asks)")
    p.add_argument("--versions", default="v2,v1")
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--normalize", action="store_true", help="with the normalizer (default off: Wan's setting)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (they also autotune)")
    p.add_argument("--iters", type=int, default=10, help="profiled iterations (times are per iteration)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--no-save", action="store_true")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if not triton_ops.available():
        raise SystemExit("Triton is not installed: there are no fused kernels to profile")
    if device.type == "cpu" and not triton_ops._interpreted():
        raise SystemExit("on a CPU the kernels run only in Triton's interpreter: set TRITON_INTERPRET=1")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    out_dtype = DTYPES[args.out_dtype] if args.out_dtype else dtype
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    bad = [v for v in versions if v not in triton_ops.VERSIONS]
    if bad:
        raise SystemExit(f"unknown versions {bad}; expected some of {triton_ops.VERSIONS}")
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    bad = [p for p in passes if p not in ("fwd", "fwd+bwd")]
    if bad:
        raise SystemExit(f"unknown passes {bad}; expected fwd, fwd+bwd")
    layout = BlockLayout.for_grid(parse_grid(args.grid))
    b, n, h, d, m = args.batch, layout.num_tokens, args.heads, args.dim, layout.num_blocks
    gen = torch.Generator().manual_seed(args.seed)
    shape = (b, n, h, d)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    angles = torch.rand(1, n, 1, d // 2, generator=gen).repeat_interleave(2, -1) * 6.28
    rope = (angles.cos().to(device), angles.sin().to(device))
    mixing = locality_init(layout).float().to(device)
    grad = torch.randn((b, n, h, d), generator=gen).to(device, out_dtype)
    bandwidth = copy_bandwidth(device)
    env = environment(device)
    size_in = torch.empty((), dtype=dtype).element_size()
    size_out = torch.empty((), dtype=out_dtype).element_size()
    print(
        f"# profile of the fused MHLA on {env['device']}: {layout}, batch {b} x {h} heads x {d}, "
        f"{dtype_name(dtype)} in, {dtype_name(out_dtype)} out; copy {bandwidth / 1e9:.0f} GB/s",
        flush=True,
    )
    rows = []
    triton_ops.PROFILE_RANGES = True
    try:
        for version in versions:
            size_sum = torch.empty((), dtype=triton_ops.summary_dtype(version, dtype)).element_size()
            for pass_ in passes:
                backward = pass_ == "fwd+bwd"
                leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]

                def fn(leaves=leaves, backward=backward, version=version):
                    out = triton_ops.mhla_attention_fused(
                        *leaves,
                        layout,
                        mixing,
                        normalize=args.normalize,
                        rotary_emb=rope,
                        out_dtype=out_dtype,
                        version=version,
                    )
                    if backward:
                        out.backward(grad)
                        for t in leaves:
                            t.grad = None

                for _ in range(args.warmup):
                    fn()
                sync(device)
                entries = profile_once(fn, device, args.iters)
                total = sum(x["us"] for x in entries.values())
                small = [key for key, x in entries.items() if key not in KERNELS and x["us"] < 0.01 * total]
                if len(small) > 1:  # entries under 1% of the time each, summed into one line
                    rest = {"us": sum(entries[key]["us"] for key in small), "calls": 0.0}
                    rest["calls"] = sum(entries.pop(key)["calls"] for key in small)
                    entries[f"other ({len(small)} entries under 1% each)"] = rest
                floor = attention_min_bytes(b * n * h * d, size_in, size_out, backward) / bandwidth * 1e6
                for key, x in sorted(entries.items(), key=lambda kv: -kv[1]["us"]):
                    row = {
                        "version": version,
                        "pass": pass_,
                        "entry": key,
                        "us": x["us"],
                        "calls": x["calls"],
                        "share": x["us"] / total if total else None,
                        "bytes": None,
                        "gbs": None,
                    }
                    if key in KERNELS:
                        row["bytes"] = x["calls"] * kernel_bytes(
                            key,
                            b=b,
                            n=n,
                            h=h,
                            d=d,
                            e=d,
                            m=m,
                            size_in=size_in,
                            size_sum=size_sum,
                            size_out=size_out,
                            normalize=args.normalize,
                            rope_half=version != "v1",
                            size_rope=triton_ops.rope_table_dtype(version, dtype).itemsize,
                        )
                        row["gbs"] = row["bytes"] / (x["us"] * 1e-6) / 1e9 if x["us"] else None
                    rows.append(row)
                rows.append(
                    {
                        "version": version,
                        "pass": pass_,
                        "entry": "TOTAL",
                        "us": total,
                        "floor_us": floor,
                        "x_floor": total / floor,
                    }
                )
                print(
                    f"{version} {pass_:>7}: {total:10.1f} us per iteration, {total / floor:.2f}x the floor", flush=True
                )
    finally:
        triton_ops.PROFILE_RANGES = False
    meta = {
        **env,
        "benchmark": "profile_mhla",
        "grid": args.grid,
        "layout": str(layout),
        "tokens": n,
        "blocks": m,
        "batch": b,
        "heads": h,
        "head_dim": d,
        "dtype": dtype_name(dtype),
        "out_dtype": dtype_name(out_dtype),
        "normalize": args.normalize,
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "iters": args.iters,
        "warmup": args.warmup,
        "triton_launches": triton_ops.tuned_launches(),
    }
    table = markdown(rows, meta)
    print("\n" + table, flush=True)
    if not args.no_save:
        write_results(args.out_dir, f"profile_mhla_{device_kind(device)}_{args.grid}", meta, rows, table)
    return {"meta": meta, "rows": rows}


def markdown(rows: list[dict], meta: dict) -> str:
    lines = cpu_caveat(meta) + [
        f"Fused MHLA profile, {meta['device']}: {meta['layout']}, batch {meta['batch']} x {meta['heads']} heads x "
        f"{meta['head_dim']}, {meta['dtype']} in, {meta['out_dtype']} out, normalizer "
        f"{'on' if meta['normalize'] else 'off'}; own device time per iteration over {meta['iters']} iterations; "
        f"copy bandwidth {meta['copy_bandwidth_gbs']:.0f} GB/s (measured); {meta['date']}",
        "",
        "| version | pass | kernel or entry | calls | us | share | min bytes (MB) | GB/s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["entry"] == "TOTAL":
            lines.append(
                f"| {r['version']} | {r['pass']} | **total** (floor {r['floor_us']:.1f} us: {r['x_floor']:.2f}x) | | "
                f"**{r['us']:.1f}** | | | |"
            )
            continue
        mb = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else ""
        gbs = f"{r['gbs']:.0f}" if r["gbs"] else ""
        lines.append(
            f"| {r['version']} | {r['pass']} | {r['entry'][:60]} | {r['calls']:.0f} | {r['us']:.1f} | "
            f"{100 * r['share']:.0f}% | {mb} | {gbs} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])

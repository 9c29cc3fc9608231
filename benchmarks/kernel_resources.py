"""Registers, spills and shared memory of the fused MHLA kernels compiled for an H100, on any machine.

    python -m benchmarks.kernel_resources                        # Wan's 21x30x50 grid, bf16, every launch setting
    python -m benchmarks.kernel_resources --dtypes bf16,fp16,fp32 --grid 21x30x52 --batch 2
    python -m benchmarks.kernel_resources --quick --no-save      # bf16, the v1 setting only (a compile check)

No GPU is needed. Triton compiles ahead of time for a named target (``--arch``, default 90a: H100 and
H200) with the ptxas it ships, and ``ptxas -v`` on the same PTX reports each kernel's registers per
thread, stack frame and spill traffic (the compiler's resource report the device method notes ask
for before any timing). The kernels' arguments are captured from a real forward and backward of
:func:`mhla.triton_ops.mhla_attention_fused` on CPU tensors of the requested shape, with the launches
intercepted (nothing runs), so each kernel is compiled with the specialisations a GPU launch of that
shape gets: unit strides as constants, sizes and pointers divisible by 16 marked so.

From the report, an estimate of what fits on one streaming multiprocessor (H100: 65,536 registers,
228 KB shared memory, 64 warps, 32 programs; registers allocated per warp in units of 256) and of
the waves of programs over 132 of them. Spilled registers go to local memory: traffic the memory
floor does not count.

Writes ``kernel_resources_sm<arch>_<grid>_<dtypes>[_tf32].json`` and ``.md`` to ``benchmarks/results/``.
Runs without ``TRITON_INTERPRET``; the tests run it in a subprocess with that variable removed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mhla.layout import parse_grid

from .common import DTYPES, RESULTS, dtype_name

SM = dict(registers=65536, shared=228 * 1024, shared_reserved=1024, warps=64, programs=32, count=132)
PTR_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}


def compile_support() -> str | None:
    """Why this Triton cannot compile ahead of time for an NVIDIA target here, or None when it can."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"this Triton has no ahead-of-time NVIDIA compile API ({e})"
    try:
        ptxas = get_ptxas(90).path
        subprocess.run([ptxas, "--version"], capture_output=True, check=True)
    except Exception as e:  # noqa: BLE001 - any reason the bundled ptxas does not run here
        return f"Triton's ptxas does not run here ({type(e).__name__}: {e})"
    return None


def capture_launches(dtype, version: str, grid, heads: int, dim: int, batch: int, normalize: bool, out_dtype):
    """``[(kernel name, summary dtype, args, meta)]`` of one forward and backward, launches intercepted."""
    from mhla import BlockLayout, locality_init, triton_ops

    launches = []

    def record(geometry, name, args, meta):
        launches.append((name, geometry.summary_dtype, args, {**meta, **geometry.static}))

    layout = BlockLayout.for_grid(grid)
    n = layout.num_tokens
    with triton_ops.intercept_launches(record):
        # uninitialised CPU buffers: the kernels do not run, and the mixing in between may see garbage
        q, k, v = (torch.empty(batch, n, heads, dim, dtype=dtype).requires_grad_() for _ in range(3))
        rope = tuple(torch.empty(1, n, 1, dim) for _ in range(2))
        mixing = locality_init(layout).float().requires_grad_()
        out = triton_ops.mhla_attention_fused(
            q, k, v, layout, mixing, normalize=normalize, rotary_emb=rope, out_dtype=out_dtype, version=version
        )
        out.backward(torch.zeros_like(out))
    return launches, layout


def compile_source(fn, args, meta: dict):
    """Triton's ASTSource for ``fn`` with the specialisations a launch with ``args`` gets."""
    from triton.compiler import ASTSource

    values = dict(zip([p.name for p in fn.params if not p.is_constexpr], args))
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", meta[p.name]
            continue
        val = values[p.name]
        if isinstance(val, torch.Tensor):
            signature[p.name] = PTR_TYPES[val.dtype]
            aligned = val.data_ptr() % 16 == 0
        elif isinstance(val, bool):
            signature[p.name], aligned = "i1", False
        elif isinstance(val, int):
            if val == 1:  # Triton specialises integer arguments equal to 1 into constants
                signature[p.name], constexprs[p.name] = "constexpr", 1
                continue
            signature[p.name] = "i32" if -(2**31) <= val < 2**31 else "i64"
            aligned = val % 16 == 0
        else:
            signature[p.name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def ptxas_report(ptx: str, arch: str) -> dict:
    """Registers, stack frame and spill bytes from ``ptxas -v`` (Triton's own ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(int(arch.rstrip("a"))).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [ptxas, f"-arch=sm_{arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    text = run.stdout + run.stderr
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{text[-2000:]}")
    regs = re.search(r"Used (\d+) registers", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {
        "registers": int(regs.group(1)),
        "stack_bytes": int(frame.group(1)) if frame else 0,
        "spill_store_bytes": int(frame.group(2)) if frame else 0,
        "spill_load_bytes": int(frame.group(3)) if frame else 0,
    }


def occupancy(registers: int, shared: int, warps: int) -> int:
    """Programs that fit on one SM at once (estimate from the three per-SM limits)."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = SM["registers"] // (per_warp * warps)
    by_shared = SM["shared"] // (shared + SM["shared_reserved"])
    return max(0, min(by_regs, by_shared, SM["warps"] // warps, SM["programs"]))


def settings_for(version: str, quick: bool, kernel: str, all_settings: bool = False):
    """Launch settings to compile ``kernel`` with: v1's one, or v2's tuning candidates for this kernel
    (``all_settings``: the union over all kernels, to compare what was left out)."""
    from mhla import triton_ops

    v1 = triton_ops.V1_LAUNCH
    if version == "v1" or quick:
        return [(v1["BLOCK_N"], v1["num_warps"], v1["num_stages"])]
    if all_settings:
        return sorted({c for cands in triton_ops.TUNE_CANDIDATES.values() for c in cands})
    return list(triton_ops.TUNE_CANDIDATES[kernel])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="21x30x50", help="latent-token grid F x H x W (default 21x30x50)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=128, help="head_dim (default 128)")
    p.add_argument("--batch", type=int, default=2, help="batch (default 2: classifier-free guidance)")
    p.add_argument("--dtypes", default="bf16", help="comma-separated input dtypes: bf16, fp16, fp32")
    p.add_argument("--versions", default="v2,v1", help="kernel versions (v2: every tuning candidate)")
    p.add_argument("--normalize", action="store_true", help="with the normalizer (Wan's setting: without)")
    p.add_argument(
        "--out-dtype", default="fp32", help="output dtype (default fp32, as the pipeline's converted layers ask)"
    )
    p.add_argument("--arch", default="90a", help="compute capability to compile for (default 90a: H100/H200)")
    p.add_argument(
        "--tf32",
        action="store_true",
        help="fp32 inputs multiply in TF32 (as with torch.backends.cuda.matmul.allow_tf32)",
    )
    p.add_argument("--quick", action="store_true", help="bf16 only, the v1 launch setting only")
    p.add_argument("--all-settings", action="store_true", help="every kernel with every kernel's tuning candidates")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--no-save", action="store_true")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the interpreter has no compiled kernels to report on")
    import triton
    from triton.backends.compiler import GPUTarget

    from mhla import triton_ops

    if not triton_ops.available():
        raise SystemExit("Triton is not installed")
    reason = compile_support()
    if reason:
        raise SystemExit(reason)
    grid = parse_grid(args.grid)
    dtypes = ["bf16"] if args.quick else [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"unknown dtypes {bad}; expected some of {sorted(DTYPES)}")
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    bad = [v for v in versions if v not in triton_ops.VERSIONS]
    if bad:
        raise SystemExit(f"unknown versions {bad}; expected some of {triton_ops.VERSIONS}")
    if args.quick:
        versions = versions[:1]
    out_dtype = DTYPES[args.out_dtype]
    target = GPUTarget("cuda", int(args.arch.rstrip("a")), 32)
    rows = []
    t0 = time.perf_counter()
    for dname in dtypes:
        for version in versions:
            tf32_before = torch.backends.cuda.matmul.allow_tf32  # the launcher reads it for fp32 products
            torch.backends.cuda.matmul.allow_tf32 = args.tf32
            try:
                launches, layout = capture_launches(
                    DTYPES[dname], version, grid, args.heads, args.dim, args.batch, args.normalize, out_dtype
                )
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32_before
            programs = args.batch * args.heads * layout.num_blocks
            for name, summary_dtype, launch_args, meta in launches:
                fn = triton_ops.KERNELS[name]
                for block_n, warps, stages in settings_for(version, args.quick, name, args.all_settings):
                    src = compile_source(fn, launch_args, {**meta, "BLOCK_N": block_n})
                    kernel = triton.compile(src, target=target, options=dict(num_warps=warps, num_stages=stages))
                    report = ptxas_report(kernel.asm["ptx"], args.arch)
                    fits = occupancy(report["registers"], kernel.metadata.shared, warps)
                    row = {
                        "kernel": name,
                        "version": version,
                        "dtype": dname,
                        "summary_dtype": dtype_name(summary_dtype),
                        "BLOCK_N": block_n,
                        "num_warps": warps,
                        "num_stages": stages,
                        **report,
                        "shared_bytes": kernel.metadata.shared,
                        "programs_per_sm": fits,
                        "warps_per_sm": fits * warps,
                        "waves": programs / (SM["count"] * fits) if fits else None,
                    }
                    rows.append(row)
                    print(format_row(row), flush=True)
    meta = {
        "arch": f"sm_{args.arch}",
        "triton": triton.__version__,
        "grid": args.grid,
        "tokens": math.prod(grid),
        "layout": str(layout),
        "heads": args.heads,
        "head_dim": args.dim,
        "batch": args.batch,
        "normalize": args.normalize,
        "out_dtype": args.out_dtype,
        "fp32_products": "tf32" if args.tf32 else "ieee",
        "programs_per_launch": args.batch * args.heads * layout.num_blocks,
        "sm_limits": SM,
        "compile_seconds": round(time.perf_counter() - t0, 1),
    }
    table = markdown(rows, meta)
    print("\n" + table)
    if not args.no_save:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        tag = "-".join(dtypes) + ("_tf32" if args.tf32 else "")
        stem = args.out_dir / f"kernel_resources_sm{args.arch}_{args.grid}_{tag}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        stem.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {stem}.json and .md")
    return {"meta": meta, "rows": rows}


def format_row(r: dict) -> str:
    spill = f"{r['spill_store_bytes']}/{r['spill_load_bytes']}"
    return (
        f"{r['kernel']:<15} {r['version']} {r['dtype']:<4} N{r['BLOCK_N']:<4} w{r['num_warps']} s{r['num_stages']} "
        f"regs {r['registers']:>3} spill {spill:>9} smem {r['shared_bytes'] / 1024:6.1f} KB "
        f"programs/SM {r['programs_per_sm']}"
    )


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Fused MHLA kernels compiled for {meta['arch']} (Triton {meta['triton']}, no GPU involved): "
        f"{meta['layout']}, batch {meta['batch']} x {meta['heads']} "
        f"heads x {meta['head_dim']}, normalizer {'on' if meta['normalize'] else 'off'}, output {meta['out_dtype']}, "
        f"fp32 products {meta.get('fp32_products', 'ieee')}; "
        f"{meta['programs_per_launch']} programs per launch. Registers and spills from ptxas -v; programs/SM "
        "and waves are estimates from the per-SM limits.",
        "",
        "| kernel | version | input | summaries | BLOCK_N | warps | stages | registers | spill st/ld bytes "
        "| shared KB | programs/SM | waves |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        waves = f"{r['waves']:.1f}" if r["waves"] else "-"
        lines.append(
            f"| {r['kernel']} | {r['version']} | {r['dtype']} | {r['summary_dtype']} | {r['BLOCK_N']} | "
            f"{r['num_warps']} | {r['num_stages']} | {r['registers']} | "
            f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['shared_bytes'] / 1024:.1f} | "
            f"{r['programs_per_sm']} | {waves} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])

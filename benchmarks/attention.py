"""Attention operator latency and peak memory versus token count.

    python -m benchmarks.attention                    # CPU-sized defaults (fp32, small grids, seconds)
    python -m benchmarks.attention --passes fwd       # forward only (--backward: forward+backward only)
    python -m benchmarks.attention --grids 21x30x50,21x30x52 --dim 128 --dtype bf16 --softmax-backends all  # GPU

Times, on q, k, v of shape ``(1, N, heads, dim)`` over latent-token grids ``F x H x W``:

- ``softmax[<backend>]``: the fastest backend present (``--softmax-backends auto``), or every backend
  that can run here, each under its own name (``all``), or a comma-separated list of names;
- ``linear[torch]`` / ``mhla[torch]``: the PyTorch path of :mod:`mhla.ops`;
- ``mhla[naive]``: MHLA's straightforward formulation (:func:`mhla.naive.mhla_attention_naive`: gather into
  block order, per-block summaries, mixing, scatter back), so the gain of the real path is measured in
  every run;
- ``linear[triton]`` / ``mhla[triton]``: the fused Triton kernels (default on CUDA when Triton is
  installed; ``--impls torch,triton`` forces them, e.g. in Triton's interpreter on a CPU);
  ``linear[triton-v1]`` / ``mhla[triton-v1]``: the first kernel version (float32 summaries, strided
  channel reads, one fixed launch setting), timed in the same run so that v2's gain is measured;
- ``linear[triton-graph]`` / ``mhla[triton-graph]`` (CUDA only, forward): the fused operator captured once in a
  CUDA graph and replayed: the GPU's own time for the call, without the host's launches and Python (the
  graph's one launch instead); next to ``[triton]`` it splits a call's time into GPU work and fixed host cost;
- ``linear[layer]`` / ``mhla[layer]`` (``--impls`` ``layer``, in the default set): the attention core of a
  converted Wan layer as the pipeline runs it (:class:`pipelines.LinearSelfAttention`: q, k, v in
  their own dtype, the operator with ``impl="auto"`` writing a float32 output, output RMSNorm, cast
  back), so the cost of what surrounds the operator shows next to the operator alone;

forward (``fwd``) and forward+backward (``fwd+bwd``). MHLA runs with the paper's video settings
(default block layout, e.g. 7x3x5 at 21x30x50; no normalizer; RoPE on the numerator).

Each row carries two floors (device method notes): the memory floor, the fewest bytes the op must
move (q, k, v read and the output written once forward; plus the output gradient read and dq, dk, dv
written backward) over the measured copy bandwidth; and the arithmetic floor, its FLOPs over the
measured bf16/fp16/fp32 matrix-product rate. ``x mem floor`` is measured time over the memory floor.
Median of ``--repeats`` runs after ``--warmup``; CUDA events with the L2 flushed before each run on a
GPU (and ``host ms``: the median time from a call to its return with the GPU idle before it, not waited
for after: what the call costs the CPU, launches and Python; a GPU call shorter than that is host-bound), wall clock on a CPU, where the variants of one grid and pass are timed in turn (``a b c a b c``)
so that the load of a shared machine hits them alike, and the load average is recorded. Peak memory:
above what was allocated before the call (CUDA allocator; on a CPU the profiler's record of
PyTorch's CPU allocator, one extra untimed call). Writes JSON, markdown and a PNG to ``benchmarks/results/`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from mhla import BlockLayout, last_softmax_backend, linear_attention, locality_init, mhla_attention, softmax_attention
from mhla.layout import parse_grid
from mhla.naive import mhla_attention_naive
from mhla.softmax import SOFTMAX_BACKENDS, candidate_backends, installed_external_backends
from mhla.triton_ops import tuned_launches

from .common import (
    DTYPES,
    RESULTS,
    Timer,
    attention_min_bytes,
    copy_bandwidth,
    cpu_caveat,
    cpu_peak_bytes,
    default_tag,
    dtype_name,
    environment,
    matmul_rate,
    measure,
    measure_interleaved,
    write_partial,
    write_results,
)

CPU_GRIDS = "2x16x16,4x16x16,8x16x16"
# 1k ... 128k tokens, with the two Wan2.1 480p grids (31,500 and 32,760 tokens) in between
GPU_GRIDS = "1x32x32,4x32x32,16x32x32,21x30x50,21x30x52,32x48x48,32x64x64"
PASSES = ("fwd", "fwd+bwd")
IMPLS = ("torch", "naive", "triton", "triton-v1", "layer", "triton-graph")


def triton_runs_here(device: torch.device) -> bool:
    """Whether the fused kernels run compiled on ``device`` (CUDA with Triton installed)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    from mhla import triton_ops

    return triton_ops.available()


def variants(device: torch.device, dtype: torch.dtype, softmax_backends: str, impls: list[str]):
    """``(label, kind, backend_or_impl)`` for every variant to time."""
    probe = torch.empty(0, device=device, dtype=dtype)
    if softmax_backends == "none":
        backends = []
    elif softmax_backends == "auto":
        backends = ["auto"]
    elif softmax_backends == "all":
        backends = candidate_backends(probe)
    else:
        backends = [b.strip() for b in softmax_backends.split(",") if b.strip()]
        bad = [b for b in backends if b not in SOFTMAX_BACKENDS]
        if bad:
            raise ValueError(f"unknown softmax backends {bad}; expected some of {SOFTMAX_BACKENDS}, 'all' or 'auto'")
    out = [(f"softmax[{b}]", "softmax", b) for b in backends]
    for kind in ("linear", "mhla"):
        # naive: MHLA's straightforward formulation (gather to block order, einsums, scatter back)
        out += [(f"{kind}[{impl}]", kind, impl) for impl in impls if not (impl == "naive" and kind == "linear")]
    return out


def flops(kind: str, n: int, heads: int, dim: int, blocks: int, backward: bool) -> float:
    """Multiply-adds x 2 of the matrix products (feature maps, RoPE and softmax's exp not counted)."""
    if kind == "softmax":
        fwd = 4 * n * n * dim * heads  # q k^T and p v
        return fwd * 3.5 if backward else fwd  # backward recomputes q k^T and does 4 more products: 2.5x
    mix = 2 * blocks * blocks * dim * dim * heads if kind == "mhla" else 0
    fwd = 4 * n * dim * dim * heads + mix  # summaries phi(k)^T v, then phi(q) S~
    return fwd * 3 if backward else fwd  # dq, dS~ (one pass), dk, dv (one pass): two products each


def layer_core(kind: str, layout: BlockLayout, heads: int, dim: int, device, dtype):
    """The pipeline's attention core of a converted layer (new parameters as a fresh conversion makes them)."""
    from pipelines import AttentionOptions, LinearSelfAttention

    module = LinearSelfAttention(kind, heads * dim, heads, dim, AttentionOptions(blocks=layout.blocks))
    for name, p in module.named_parameters():  # as pipelines.convert: mixing in float32, the rest in the layer's dtype
        p.data = p.data.to(device, torch.float32 if name.startswith("mhla.") else dtype)
    return module


def timed_call(kind, impl, q, k, v, layout, mixing, rope, backward):
    """The call the benchmark times: operator ``kind`` (softmax, linear, mhla) through ``impl`` (a softmax
    backend, an MHLA/linear implementation such as ``auto``, ``torch``, ``triton``, ``triton-v1``, ``naive``,
    or ``layer`` for the whole attention layer); forward only, or forward and backward."""
    if impl == "triton-graph":
        if q.device.type != "cuda":
            raise RuntimeError("triton-graph replays a CUDA graph: CUDA only")
        if backward:
            raise NotImplementedError("triton-graph times the forward only")
        if kind == "linear":
            eager = lambda: linear_attention(q, k, v, normalize=False, rotary_emb=rope, impl="triton")  # noqa: E731
        else:
            eager = lambda: mhla_attention(  # noqa: E731
                q, k, v, layout, mixing, normalize=False, rotary_emb=rope, impl="triton"
            )
        return graphed(eager)
    if impl == "layer":
        core = layer_core(kind, layout, q.shape[2], q.shape[3], q.device, q.dtype)
        fwd = lambda: core(q, k, v, layout.grid, rope)  # noqa: E731
    elif kind == "softmax":
        fwd = lambda: softmax_attention(q, k, v, backend=impl)  # noqa: E731
    elif impl == "triton-v1":  # the previous kernel version, timed beside the current one
        from mhla.triton_ops import linear_attention_fused, mhla_attention_fused

        if kind == "linear":
            fwd = lambda: linear_attention_fused(q, k, v, normalize=False, rotary_emb=rope, version="v1")  # noqa: E731
        else:
            fwd = lambda: mhla_attention_fused(  # noqa: E731
                q, k, v, layout, mixing, normalize=False, rotary_emb=rope, version="v1"
            )
    elif impl == "naive":
        fwd = lambda: mhla_attention_naive(q, k, v, layout, mixing, normalize=False, rotary_emb=rope)  # noqa: E731
    elif kind == "linear":
        fwd = lambda: linear_attention(q, k, v, normalize=False, rotary_emb=rope, impl=impl)  # noqa: E731
    else:
        fwd = lambda: mhla_attention(q, k, v, layout, mixing, normalize=False, rotary_emb=rope, impl=impl)  # noqa: E731
    if not backward:

        def run():
            with torch.no_grad():
                return fwd()

        return run
    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype)  # random, not ones: no special values

    def step():
        out = fwd()
        out.backward(grad)
        for t in (q, k, v):
            t.grad = None

    return step


def graphed(fn):
    """``fn`` (a forward, no gradient) captured in a CUDA graph after three warm-up calls on a side stream (the
    kernels compiled and their launches kept); returns the graph's replay. Tables the operator would keep
    between calls are made inside the graph instead (see ``mhla.triton_ops._rope_halves``), so a replay also
    slices the RoPE halves: about 24 MB more at 31,500 tokens (~8 us)."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kept = fn()  # the graph's output buffer, alive as long as the replay closure

    def replay():
        graph.replay()
        return kept

    return replay


def host_time(fn, repeats: int) -> float:
    """Median milliseconds from a call of ``fn`` to its return on a GPU, the GPU idle before it and not waited
    for after: the host's own cost of the call (Python, launches), which a GPU call cannot go below."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grids", default=None, help=f"comma-separated FxHxW token grids (CPU default {CPU_GRIDS})")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=None, help="head dim (default 128 on GPU, 64 on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    p.add_argument("--backward", action="store_true", help="same as --passes fwd+bwd")
    p.add_argument(
        "--softmax-backends",
        default="auto",
        help="auto (fastest present), all (every backend that runs here), none, or names such as sdpa_flash,sdpa_cudnn",
    )
    p.add_argument(
        "--impls",
        default=None,
        help="linear/MHLA paths: comma-separated torch, naive, triton, triton-v1, layer, triton-graph "
        "(default torch,naive,layer; on CUDA all six)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 3 on GPU, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, median reported (default 10 GPU, 3 CPU)")
    p.add_argument(
        "--max-softmax-tokens",
        type=int,
        default=None,
        help="skip softmax above this many tokens (default: no limit on GPU, 8192 on CPU)",
    )
    p.add_argument(
        "--max-math-tokens",
        type=int,
        default=16_384,
        help="skip sdpa_math (forms N x N) above this many tokens",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default=None, help="result file name (default attention_<device kind>_<date>)")
    p.add_argument("--no-save", action="store_true")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    dim = args.dim or (64 if cpu else 128)
    grids = [parse_grid(g) for g in (args.grids or (CPU_GRIDS if cpu else GPU_GRIDS)).split(",")]
    passes = ["fwd+bwd"] if args.backward else [s.strip() for s in args.passes.split(",") if s.strip()]
    bad = [s for s in passes if s not in PASSES]
    if bad:
        raise SystemExit(f"unknown passes {bad}; expected some of {PASSES}")
    default_impls = list(IMPLS) if triton_runs_here(device) else ["torch", "naive", "layer"]
    impls = args.impls.split(",") if args.impls else default_impls
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"unknown impls {bad}; expected some of {IMPLS}")
    warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    repeats = args.repeats if args.repeats is not None else (3 if cpu else 10)
    max_softmax = args.max_softmax_tokens or (8192 if cpu else None)
    env = environment(device)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    bandwidth = copy_bandwidth(device)
    rate = matmul_rate(device, dtype)
    rates = {dtype_name(t): matmul_rate(device, t) / 1e12 for t in (torch.float32, torch.bfloat16)}
    timer = Timer(device)
    todo = variants(device, dtype, args.softmax_backends, impls)

    meta = {
        "benchmark": "attention",
        **env,
        "dtype": dtype_name(dtype),
        "heads": args.heads,
        "head_dim": dim,
        "batch": 1,
        "passes": passes,
        "impls": impls,
        "softmax_backends_requested": args.softmax_backends,
        "softmax_backends_available": candidate_backends(torch.empty(0, device=device, dtype=dtype)),
        "softmax_external_installed": installed_external_backends(),
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "matmul_tflops": rate / 1e12,
        "matmul_tflops_by_dtype": rates,
        "loadavg_start": load_start,
        "warmup": warmup,
        "repeats": repeats,
        "mhla_settings": "default block layout, relu feature map, no normalizer, RoPE on the numerator",
    }
    print(
        f"# attention on {env['device']} ({device.type}), {dtype_name(dtype)}, heads={args.heads}, dim={dim}, "
        f"torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']} ({env['triton_mode']}); "
        f"copy {bandwidth / 1e9:.1f} GB/s, matmul {rate / 1e12:.3g} TFLOP/s; median of {repeats} after {warmup}",
        flush=True,
    )
    tag = args.tag or default_tag("attention", device)
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    for grid in grids:
        layout = BlockLayout.for_grid(grid)
        n = layout.num_tokens
        shape = (1, n, args.heads, dim)
        angles = torch.rand(1, n, 1, dim // 2, generator=gen).repeat_interleave(2, -1) * 6.28
        rope = (angles.cos().to(device), angles.sin().to(device))
        mixing = locality_init(layout).float().to(device)
        size = torch.empty((), dtype=dtype).element_size()
        for pass_ in passes:
            backward = pass_ == "fwd+bwd"
            q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(backward) for _ in range(3))
            min_bytes = attention_min_bytes(torch.Size(shape).numel(), size, size, backward)
            mem_floor = min_bytes / bandwidth * 1e3
            pending = []  # (row, fn) to time
            for label, kind, impl in todo:
                f = flops(kind, n, args.heads, dim, layout.num_blocks, backward)
                row = {
                    "grid": "x".join(map(str, grid)),
                    "tokens": n,
                    "blocks": layout.num_blocks if kind == "mhla" else (1 if kind == "linear" else None),
                    "layout": str(layout) if kind == "mhla" else None,
                    "pass": pass_,
                    "variant": label,
                    "kind": kind,
                    "impl": impl if kind != "softmax" else None,
                    "min_bytes": min_bytes,
                    "mem_floor_ms": mem_floor,
                    "flops": f,
                    "flop_floor_ms": f / rate * 1e3,
                }
                rows.append(row)
                if kind == "softmax" and max_softmax and n > max_softmax:
                    row["skipped"] = f"softmax above {max_softmax} tokens (--max-softmax-tokens)"
                elif impl == "sdpa_math" and n > args.max_math_tokens:
                    row["skipped"] = f"sdpa_math above {args.max_math_tokens} tokens (--max-math-tokens)"
                else:
                    try:
                        fn = timed_call(kind, impl, q, k, v, layout, mixing, rope, backward)
                        if cpu:  # time later, interleaved with the other variants
                            fn()
                            pending.append((row, fn))
                            continue
                        row.update(measure(fn, device, warmup, repeats, timer))
                        row["host_ms"] = host_time(fn, repeats)
                        finish_row(row, kind)
                    except (RuntimeError, ValueError, NotImplementedError, torch.cuda.OutOfMemoryError) as e:
                        row["skipped"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
                    finally:
                        for t in (q, k, v):
                            t.grad = None
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                print(format_row(row), flush=True)
                meta["triton_launches"] = tuned_launches()
                if not args.no_save:
                    write_partial(args.out_dir, tag, meta, rows)
            if pending:
                results = measure_interleaved([fn for _, fn in pending], device, max(0, warmup - 1), repeats, timer)
                for (row, fn), res in zip(pending, results):
                    row.update(res)
                    row["peak_mib"] = cpu_peak_bytes(fn) / 2**20
                    finish_row(row, row["kind"])
                    print(format_row(row), flush=True)
                meta["triton_launches"] = tuned_launches()
                if not args.no_save:
                    write_partial(args.out_dir, tag, meta, rows)
            del q, k, v
    meta["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    add_speedups(rows)
    table = markdown(rows, meta)
    print("\n" + table, flush=True)
    if not args.no_save:
        write_results(args.out_dir, tag, meta, rows, table, lambda plt: plot(plt, rows, meta))
    return {"meta": meta, "rows": rows}


def finish_row(row: dict, kind: str) -> None:
    if kind == "softmax":
        row["backend"] = last_softmax_backend()
    row["x_mem_floor"] = row["ms"] / row["mem_floor_ms"]
    row["x_floor"] = row["ms"] / max(row["mem_floor_ms"], row["flop_floor_ms"])
    row["x_flop_floor"] = row["ms"] / row["flop_floor_ms"] if row["flop_floor_ms"] else None


def add_speedups(rows: list[dict]) -> None:
    """Per (grid, pass): ``speedup_vs_softmax`` against the fastest softmax row, and
    ``speedup_vs_torch`` of a Triton row against the same kind's PyTorch row."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["grid"], r["pass"]), []).append(r)
    for group in groups.values():
        timed = [r for r in group if "ms" in r]
        soft = [r["ms"] for r in timed if r["kind"] == "softmax"]
        best = min(soft) if soft else None
        torch_ms = {r["kind"]: r["ms"] for r in timed if r.get("impl") == "torch"}
        for r in timed:
            # MHLA's time over linear attention's (same path, same grid and pass): the cost of the blocks
            r["x_linear"] = r["ms"] / torch_ms["linear"] if r["kind"] == "mhla" and "linear" in torch_ms else None
            r["speedup_vs_softmax"] = best / r["ms"] if best else None
            r["speedup_vs_torch"] = (
                torch_ms[r["kind"]] / r["ms"]
                if str(r.get("impl")).startswith("triton") and r["kind"] in torch_ms
                else None
            )


def format_row(row: dict) -> str:
    head = f"{row['pass']:>7} {row['grid']:>10} N={row['tokens']:>7} {row['variant']:<24}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    peak = f" peak {row['peak_mib']:.0f} MiB" if row.get("peak_mib") is not None else ""
    host = f" host {row['host_ms']:.3f} ms" if row.get("host_ms") is not None else ""
    return f"{head} {row['ms']:10.3f} ms ({row['x_mem_floor']:.1f}x mem floor {row['mem_floor_ms']:.3f} ms){host}{peak}"


def _load(load) -> str:
    return "n/a" if load is None else " / ".join(f"{x:.2f}" for x in load)


def _fmt(x, spec=".2f", suffix=""):
    return "" if x is None else f"{x:{spec}}{suffix}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = cpu_caveat(meta) + [
        f"Attention op, {meta['device']} ({meta['device_type']}), {meta['dtype']}, batch 1, "
        f"{meta['heads']} heads x {meta['head_dim']}; torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"Triton {meta['triton']} ({meta['triton_mode']}); copy {meta['copy_bandwidth_gbs']:.0f} GB/s, "
        f"matmul {meta['matmul_tflops']:.3g} TFLOP/s (both measured); median of {meta['repeats']}; {meta['date']}",
        "",
    ]
    if meta.get("loadavg_start") is not None:
        rates = ", ".join(f"{k} {v * 1e3:.0f} GFLOP/s" for k, v in (meta.get("matmul_tflops_by_dtype") or {}).items())
        lines += [
            f"Machine limits measured at the start: matmul {rates}; copy {meta['copy_bandwidth_gbs']:.1f} GB/s "
            f"(read + write). Load average (1, 5, 15 min) at the start {_load(meta['loadavg_start'])}, at the end "
            f"{_load(meta.get('loadavg_end'))}; {meta.get('cpu_threads', '?')} threads.",
            "",
        ]
    lines += [
        "| pass | grid | tokens | variant | backend | ms | host ms | mem floor ms | x mem floor | x flop floor | x floor | "
        "vs softmax | x linear | vs torch | peak MiB |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (PASSES.index(r["pass"]), r["tokens"], r["grid"])):
        if "skipped" in r:
            lines.append(
                f"| {r['pass']} | {r['grid']} | {r['tokens']} | {r['variant']} | | skipped | | "
                f"{r['mem_floor_ms']:.3f} | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['pass']} | {r['grid']} | {r['tokens']} | {r['variant']} | {r.get('backend') or r.get('impl') or ''} | "
            f"{r['ms']:.3f} | {_fmt(r.get('host_ms'), '.3f')} | {r['mem_floor_ms']:.3f} | {r['x_mem_floor']:.1f} | {_fmt(r.get('x_flop_floor'), '.1f')} | "
            f"{r['x_floor']:.1f} | {_fmt(r.get('speedup_vs_softmax'), '.2f', 'x')} | {_fmt(r.get('x_linear'), '.2f')} | "
            f"{_fmt(r.get('speedup_vs_torch'), '.2f', 'x')} | "
            f"{_fmt(r.get('peak_mib'), '.0f')} |"
        )
    lines += [
        "",
        "mem floor: bytes of q, k, v and output (forward; plus d_out, dq, dk, dv backward) over the measured copy "
        "bandwidth; x flop floor: measured over FLOPs / measured matmul rate; x floor: measured over max(mem floor, "
        "flop floor). vs softmax: the fastest softmax backend's time over this row's, same grid and pass. x linear: "
        "this MHLA row's time over linear[torch]'s. vs torch: the PyTorch path's time over the fused kernel's. "
        "peak MiB: allocated above what was allocated before the call (output included). host ms (GPU): the "
        "median time from a call to its return with the GPU idle before it: the host's own cost of the call; "
        "[triton-graph]: the forward replayed from a CUDA graph, the GPU's own time without that cost.",
    ]
    return "\n".join(lines) + "\n"


def plot(plt, rows: list[dict], meta: dict):
    passes = [p for p in PASSES if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4.5), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        sel = [r for r in rows if r["pass"] == pass_]
        for variant in dict.fromkeys(r["variant"] for r in sel):
            pts = sorted((r["tokens"], r["ms"]) for r in sel if r["variant"] == variant and "ms" in r)
            backend = next((r.get("backend") for r in sel if r["variant"] == variant and r.get("backend")), None)
            label = f"softmax[auto: {backend}]" if variant == "softmax[auto]" and backend else variant
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        floor = sorted({(r["tokens"], r["mem_floor_ms"]) for r in sel})
        ax.plot(*zip(*floor), "k--", lw=1, label="memory floor")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="tokens N",
            ylabel="ms (median)",
            title=f"{pass_}: {meta['device']}, {meta['dtype']}, {meta['heads']}x{meta['head_dim']}",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()

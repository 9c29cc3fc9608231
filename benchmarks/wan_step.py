"""Wan2.1 transformer step latency: flash vs linear vs MHLA vs hybrid MHLA, side by side in one run.

    python -m benchmarks.wan_step                                   # GPU: Wan2.1-1.3B at 480x800 and 480x832
    python -m benchmarks.wan_step --grad-ckpt                       # training step with gradient checkpointing
    python -m benchmarks.wan_step --config tiny --layers 2 --grids 3x8x8   # CPU smoke test (seconds)
    python -m benchmarks.wan_step --config builtin --grids 5x16x20 --blocks 2x4x5 --text-len 32 --passes fwd  # CPU

Builds the real Wan2.1 architecture (diffusers' ``WanTransformer3DModel`` with the ``--config``
sizes) with RANDOM weights directly on the device (bf16 on a GPU, the modules diffusers keeps in
float32 stay float32; nothing is downloaded; random weights time the same as trained ones), converts
its self-attention once with :func:`pipelines.convert_self_attention` (linear and MHLA parameters
added to ONE set of weights), and switches variants with :func:`pipelines.set_variant`.

For every video size and variant it times

- ``fwd``: one transformer forward at ``--batch`` (default 2: the conditional and unconditional
  halves of classifier-free guidance in one batch), under ``torch.no_grad``; the projected denoising
  time is ``--steps`` (default 50) such forwards (transformer only: no text encoder, no VAE);
- ``fwd+bwd``: forward + backward of a mean-square loss at ``--train-batch`` (default 1), the
  transformer's part of a training step (``--grad-ckpt`` turns on gradient checkpointing);

as the median of ``--repeats`` runs after ``--warmup`` (CUDA events; wall clock on a CPU), with peak
memory, speedup vs ``flash`` and, from one extra forward with the processors' timers on, the time
inside self-attention vs the rest. Text embeddings are random ``(batch, 512, text_dim)``. On a CPU the variants
are timed in turn (``a b c a b c``) so that the load of a shared machine hits them alike.
Writes JSON, markdown and a PNG to ``benchmarks/results/`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from mhla.checks import COMPILE_MODES
from mhla.layout import parse_grid
from mhla.triton_ops import tuned_launches
from pipelines import AttentionOptions, convert_self_attention, set_variant
from pipelines.attention import HYBRID, LINEAR, MHLA, SOFTMAX, VARIANTS, linear_layers_for
from pipelines.loading import WAN_CONFIGS
from pipelines.tiny import TINY_TRANSFORMER

from .common import (
    DTYPES,
    RESULTS,
    Timer,
    compiled_graphs,
    cpu_caveat,
    default_tag,
    dtype_name,
    environment,
    measure,
    sync,
    write_partial,
    write_results,
)

CONFIGS = {**WAN_CONFIGS, "tiny": dict(TINY_TRANSFORMER)}  # random weights here
# the built-in model's architecture (assets/builtin, 4 heads x 32, 6 layers; random weights here as for
# the others). Its own size: 17 frames at 128x160 -> grid 5x16x20 (1,600 tokens), blocks 2x4x5,
# 32 text tokens:  --config builtin --grids 5x16x20 --blocks 2x4x5 --text-len 32
_BUILTIN_JSON = Path(__file__).resolve().parents[1] / "assets" / "builtin" / "builtin.json"
if _BUILTIN_JSON.is_file():
    CONFIGS["builtin"] = {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in json.loads(_BUILTIN_JSON.read_text())["transformer"].items()
    }
# 81 frames at 480x800 (the paper's setting, 21x30x50 = 31,500 tokens) and 480x832 (32,760 tokens)
GPU_SIZES = "81x480x800,81x480x832"
CPU_GRIDS = "3x8x8"
VAE_STRIDE = (4, 8, 8)
# Paper Table 5: 50-step latency in seconds of the fine-tuned Wan2.1-1.3B at 31,500 tokens (GPU not named)
PAPER_SECONDS = {SOFTMAX: 166, LINEAR: 82, MHLA: 81, HYBRID: 103}
PAPER_GRID = "21x30x50"
# Targets for the forward at 31,500 tokens (speedup vs the fastest softmax)
TARGETS = {MHLA: 2.5, HYBRID: 1.7}


def parse_size(text: str) -> tuple[int, int, int]:
    """``"81x480x800"`` (frames x height x width in pixels) -> latent-token grid ``(21, 30, 50)``."""
    frames, height, width = parse_grid(text)
    if (frames - 1) % VAE_STRIDE[0] or height % 16 or width % 16:
        raise ValueError(f"a video size needs 4k+1 frames and height, width multiples of 16, got {text!r}")
    return (frames - 1) // VAE_STRIDE[0] + 1, height // 16, width // 16


def build_transformer(config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight Wan transformer (``MHLAWanTransformer3DModel``, unconverted) built on ``device`` in ``dtype``
    (no float32 copy first, so a 14B model needs only its bf16 size), with diffusers' float32-kept modules in
    float32."""
    from pipelines.model import MHLAWanTransformer3DModel

    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = MHLAWanTransformer3DModel(**config)
    finally:
        torch.set_default_dtype(previous)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, p in model.named_parameters():  # by parameter name, as from_pretrained: covers scale_shift_table
        if any(k in name.split(".") for k in keep):
            p.data = p.data.float()
    return model.eval()


def latent_inputs(config: dict, grid, batch: int, text_len: int, device, dtype, gen: torch.Generator) -> dict:
    p_t, p_h, p_w = config["patch_size"]
    f, h, w = grid
    shape = (batch, config["in_channels"], f * p_t, h * p_h, w * p_w)
    return {
        "hidden_states": torch.randn(shape, generator=gen).to(device, dtype),
        "timestep": torch.randint(0, 1000, (batch,), generator=gen).float().to(device),
        "encoder_hidden_states": torch.randn(batch, text_len, config["text_dim"], generator=gen).to(device, dtype),
        "return_dict": False,
    }


def forward_fn(model, inputs):
    from mhla.mixing import reuse_constrained_mixing

    def run():
        with torch.no_grad(), reuse_constrained_mixing():  # as pipelines.pipeline.generate
            return model(**inputs)[0]

    return run


def train_fn(model, inputs):
    def step():
        out = model(**inputs)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def attention_breakdown(model, fn, device) -> dict:
    """One run of ``fn`` with the self-attention timers on: ms inside self-attention and outside it."""
    timer = model.attention_context.timer
    clock = Timer(device)
    timer.reset(enabled=True)
    try:
        total = clock(fn)
        attn = timer.seconds() * 1e3
        calls = timer.calls
    finally:
        timer.reset(enabled=False)
    return {"attn_ms": attn, "other_ms": total - attn, "attn_calls": calls, "breakdown_total_ms": total}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", choices=sorted(CONFIGS), default=None, help="default 1.3b on GPU, tiny on CPU")
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--sizes", default=None, help=f"video sizes FRAMESxHEIGHTxWIDTH in pixels (GPU default {GPU_SIZES})")
    p.add_argument(
        "--grids", default=None, help=f"latent-token grids FxHxW instead of --sizes (CPU default {CPU_GRIDS})"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    p.add_argument("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    p.add_argument("--batch", type=int, default=2, help="forward batch (2 = classifier-free guidance)")
    p.add_argument("--train-batch", type=int, default=1, help="forward+backward batch")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in forward+backward")
    p.add_argument("--steps", type=int, default=50, help="denoising steps for the projected time")
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--blocks", default="7x3x5", help="MHLA blocks per axis (paper: 7x3x5 = 105)")
    p.add_argument("--softmax-backend", default="auto", help="softmax layers' backend (mhla.SOFTMAX_BACKENDS)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2 on GPU, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 5 on GPU, 2 on CPU)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the attention-vs-rest forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default=None, help="result file name (default wan_step_<config>_<device kind>_<date>)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument(
        "--compile",
        choices=("none", *COMPILE_MODES),
        default="none",
        help="torch.compile the transformer (mhla.compiled.compile_transformer): its repeated blocks or the whole "
        "forward; the warm-up runs include the compile, the breakdown is skipped (its timers would break graphs)",
    )
    p.add_argument(
        "--compile-mode",
        choices=TORCH_COMPILE_MODES,
        default="default",
        help="torch.compile's mode with --compile: reduce-overhead (CUDA graphs where shapes are static: one replay "
        "per block instead of its launches; use --warmup 3, the second call records), max-autotune-no-cudagraphs "
        "(inductor's tuned matrix-product templates: minutes of tuning in the warm-up), max-autotune (both)",
    )
    p.add_argument(
        "--fuse-qkv",
        action="store_true",
        help="fuse each self-attention's q, k, v projections into one product (and each cross-attention's k, v): "
        "diffusers' WanAttention.fuse_projections, which the project's processors follow; the input is read once "
        "instead of three times",
    )
    return p


# torch.compile's modes (``--compile-mode``); "default" passes none
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


def fuse_qkv(model: torch.nn.Module) -> int:
    """Fuses the projections of every attention that can (diffusers' ``fuse_projections``: self-attention's q, k, v
    into ``to_qkv``, cross-attention's k, v into ``to_kv``); returns how many. Same numbers up to the products'
    summation order; the processors (the project's and diffusers') take ``to_qkv`` when ``fused_projections``."""
    fused = 0
    for module in model.modules():
        if hasattr(module, "fuse_projections") and hasattr(module, "to_q"):
            module.fuse_projections()
            fused += 1
    return fused


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    config_name = args.config or ("tiny" if cpu else "1.3b")
    config = dict(CONFIGS[config_name])
    if args.layers is not None:
        config["num_layers"] = args.layers
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; expected some of {VARIANTS}")
    passes = [s.strip() for s in args.passes.split(",") if s.strip()]
    if any(s not in ("fwd", "fwd+bwd") for s in passes):
        raise SystemExit(f"passes must be fwd and/or fwd+bwd, got {args.passes!r}")
    if args.grids:
        cases = [(None, parse_grid(g)) for g in args.grids.split(",")]
    elif args.sizes or not cpu:
        cases = [(s.strip(), parse_size(s)) for s in (args.sizes or GPU_SIZES).split(",")]
    else:
        cases = [(None, parse_grid(g)) for g in CPU_GRIDS.split(",")]
    warmup = args.warmup if args.warmup is not None else (1 if cpu else 2)
    repeats = args.repeats if args.repeats is not None else (2 if cpu else 5)

    env = environment(device)
    model = build_transformer(config, device, dtype, args.seed)
    num_layers = config["num_layers"]
    options = AttentionOptions(blocks=args.blocks, softmax_backend=args.softmax_backend)
    # one set of weights: add vanilla-linear and MHLA parameters once, then only switch processors
    convert_self_attention(model, LINEAR, options=options)
    convert_self_attention(model, MHLA, options=options)
    if args.grad_ckpt:
        model.enable_gradient_checkpointing()
    fused = fuse_qkv(model) if args.fuse_qkv else 0
    if args.compile_mode != "default" and args.compile == "none":
        raise SystemExit(f"--compile-mode {args.compile_mode} needs --compile blocks or full")
    if args.compile != "none":
        from mhla.compiled import compile_transformer

        compile_transformer(
            model, args.compile, compile_mode=None if args.compile_mode == "default" else args.compile_mode
        )
        args.no_breakdown = True
    params = sum(p.numel() for p in model.parameters())
    ctx = model.attention_context
    meta = {
        "benchmark": "wan_step",
        **env,
        "config": config_name,
        "transformer": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        "parameters": params,
        "weights": "random (timing only)",
        "dtype": dtype_name(dtype),
        "batch_fwd": args.batch,
        "batch_fwd_bwd": args.train_batch,
        "grad_ckpt": args.grad_ckpt,
        "steps": args.steps,
        "text_len": args.text_len,
        "blocks": args.blocks,
        "softmax_backend_requested": args.softmax_backend,
        "hybrid_mhla_layers": linear_layers_for(HYBRID, num_layers),
        "warmup": warmup,
        "repeats": repeats,
        "attention_options": options.to_dict(),
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "fused_projections": fused,
    }
    print(
        f"# Wan2.1 {config_name} ({num_layers} layers, {params / 1e9:.2f}B parameters, random weights) on "
        f"{env['device']}, {dtype_name(dtype)}, torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']} "
        f"({env['triton_mode']}); median of {repeats} after {warmup}",
        flush=True,
    )

    gen = torch.Generator().manual_seed(args.seed)
    timer = Timer(device)
    compiled = "" if args.compile == "none" else f"_compiled-{args.compile}"
    compiled += "" if args.compile_mode == "default" else f"-{args.compile_mode}"
    compiled += "_fused-qkv" if args.fuse_qkv else ""
    tag = args.tag or default_tag(f"wan_step_{config_name}{compiled}", device)
    rows = []
    for size, grid in cases:
        tokens = grid[0] * grid[1] * grid[2]
        for pass_ in passes:
            batch = args.batch if pass_ == "fwd" else args.train_batch
            inputs = latent_inputs(config, grid, batch, args.text_len, device, dtype, gen)
            pending = []
            for variant in variants:
                set_variant(model, variant)
                ctx.layouts.clear()
                ctx.softmax_backend = None
                row = {
                    "size": size,
                    "grid": "x".join(map(str, grid)),
                    "tokens": tokens,
                    "variant": variant,
                    "pass": pass_,
                    "batch": batch,
                    "mhla_layers": len(linear_layers_for(variant, num_layers)) if variant != LINEAR else 0,
                    "linear_layers": num_layers if variant == LINEAR else 0,
                }
                try:
                    fn = forward_fn(model, inputs) if pass_ == "fwd" else train_fn(model, inputs)
                    if cpu:  # timed below, the variants in turn, so that the load hits them alike
                        for _ in range(warmup):
                            fn()
                        pending.append((row, variant, fn))
                    else:
                        row.update(measure(fn, device, warmup, repeats, timer))
                    if pass_ == "fwd" and not cpu:
                        row["projected_s"] = row["ms"] * args.steps / 1e3
                        if not args.no_breakdown:
                            row.update(attention_breakdown(model, fn, device))
                    row["softmax_backend"] = ctx.softmax_backend
                    row["layouts"] = sorted(ctx.layouts)
                except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as e:
                    row["skipped"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
                finally:
                    model.zero_grad(set_to_none=True)
                    sync(device)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                meta["triton_launches"] = tuned_launches()
                if not pending or pending[-1][0] is not row:
                    print(format_row(row), flush=True)
                if not args.no_save:
                    write_partial(args.out_dir, tag, meta, rows)
            if pending:
                times = {id(row): [] for row, _, _ in pending}
                graphs = {id(row): 0 for row, _, _ in pending}
                for _ in range(repeats):
                    for row, variant, fn in pending:
                        set_variant(model, variant)
                        before = compiled_graphs()
                        times[id(row)].append(timer(fn))
                        graphs[id(row)] += compiled_graphs() - before
                        model.zero_grad(set_to_none=True)
                for row, variant, fn in pending:
                    ts = times[id(row)]
                    row.update(ms=statistics.median(ts), ms_min=min(ts), ms_max=max(ts), repeats=repeats)
                    row["graphs_compiled_while_timed"] = graphs[id(row)]
                    row.update(peak_mib=None, peak_total_mib=None)
                    set_variant(model, variant)
                    ctx.layouts.clear()
                    ctx.softmax_backend = None
                    if pass_ == "fwd":
                        row["projected_s"] = row["ms"] * args.steps / 1e3
                    if pass_ == "fwd" and not args.no_breakdown:
                        row.update(attention_breakdown(model, fn, device))
                    else:
                        fn()  # one more run of this variant alone: its softmax backend and layouts
                        model.zero_grad(set_to_none=True)
                    row["softmax_backend"] = ctx.softmax_backend
                    row["layouts"] = sorted(ctx.layouts)
                    print(format_row(row), flush=True)
                if not args.no_save:
                    write_partial(args.out_dir, tag, meta, rows)
            del inputs
    add_speedups(rows)
    table = markdown(rows, meta)
    print("\n" + table, flush=True)
    if not args.no_save:
        write_results(args.out_dir, tag, meta, rows, table, lambda plt: plot(plt, rows, meta))
    return {"meta": meta, "rows": rows}


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_flash`` (flash's time over the row's, same grid and pass) and, for forward rows,
    ``memory_vs_flash`` (peak over flash's peak)."""
    flash = {(r["grid"], r["pass"]): r for r in rows if r["variant"] == SOFTMAX and "ms" in r}
    for r in rows:
        ref = flash.get((r["grid"], r["pass"]))
        if "ms" not in r:
            continue
        r["speedup_vs_flash"] = ref["ms"] / r["ms"] if ref else None
        if ref and r.get("peak_total_mib") and ref.get("peak_total_mib"):
            r["memory_vs_flash"] = r["peak_total_mib"] / ref["peak_total_mib"]


def format_row(row: dict) -> str:
    head = f"{row['pass']:>7} {row['grid']:>9} N={row['tokens']:>6} B={row['batch']} {row['variant']:<12}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    extra = f" (attn {row['attn_ms']:.1f} ms)" if "attn_ms" in row else ""
    peak = f" peak {row['peak_total_mib'] / 1024:.1f} GiB" if row.get("peak_total_mib") else ""
    proj = (
        f" -> {row['projected_s']:.1f} s per {int(round(row['projected_s'] * 1e3 / row['ms']))} steps"
        if "projected_s" in row
        else ""
    )
    return f"{head} {row['ms']:10.1f} ms{extra}{proj}{peak}"


def _fmt(x, spec=".2f", suffix=""):
    return "" if x is None else f"{x:{spec}}{suffix}"


def markdown(rows: list[dict], meta: dict) -> str:
    ckpt = ", gradient checkpointing" if meta["grad_ckpt"] else ""
    lines = cpu_caveat(meta) + [
        f"Wan2.1 {meta['config']} transformer ({meta['transformer']['num_layers']} layers, random weights), "
        f"{meta['device']} ({meta['device_type']}), {meta['dtype']}; fwd at batch {meta['batch_fwd']} (CFG), "
        f"fwd+bwd at batch {meta['batch_fwd_bwd']}{ckpt}; torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"Triton {meta['triton']} ({meta['triton_mode']}); median of {meta['repeats']}; {meta['date']}",
        "",
        f"| pass | size | tokens | variant | ms | vs flash | {meta['steps']} steps s | attn ms | rest ms | "
        "peak GiB | softmax backend |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        size = r["size"] or r["grid"]
        if "skipped" in r:
            lines.append(f"| {r['pass']} | {size} | {r['tokens']} | {r['variant']} | skipped | | | | | | |")
            continue
        peak = r.get("peak_total_mib")
        recompiles = r.get("graphs_compiled_while_timed")
        flag = f" (RECOMPILED x{recompiles} while timed)" if recompiles else ""
        lines.append(
            f"| {r['pass']} | {size} | {r['tokens']} | {r['variant']}{flag} | {r['ms']:.1f} | "
            f"{_fmt(r.get('speedup_vs_flash'), '.2f', 'x')} | {_fmt(r.get('projected_s'), '.1f')} | "
            f"{_fmt(r.get('attn_ms'), '.1f')} | {_fmt(r.get('other_ms'), '.1f')} | "
            f"{_fmt(None if peak is None else peak / 1024, '.1f')} | {r.get('softmax_backend') or ''} |"
        )
    paper = [r for r in rows if r["grid"] == PAPER_GRID and r["pass"] == "fwd" and "ms" in r]
    if paper:
        lines += [
            "",
            f"Against the paper (Table 5, Wan2.1-1.3B, 31,500 tokens, {meta['steps']}-step latency; its GPU not named):",
            "",
            "| variant | paper s | paper vs flash | measured s (transformer only) | measured vs flash | target |",
            "|---|---:|---:|---:|---:|---|",
        ]
        linear = next((r for r in paper if r["variant"] == LINEAR), None)
        for r in paper:
            p = PAPER_SECONDS.get(r["variant"])
            target = f">= {TARGETS[r['variant']]}x" if r["variant"] in TARGETS else ""
            if r["variant"] == MHLA and linear:
                target += f"; within 5% of linear ({r['ms'] / linear['ms'] - 1:+.1%})"
            lines.append(
                f"| {r['variant']} | {p} | {PAPER_SECONDS[SOFTMAX] / p:.2f}x | {r['projected_s']:.1f} | "
                f"{_fmt(r.get('speedup_vs_flash'), '.2f', 'x')} | {target} |"
            )
    lines += [
        "",
        "vs flash: flash's time over this row's (same size and pass, same weights, one run). "
        f"{meta['steps']} steps s: the forward time x {meta['steps']} (the transformer's part of denoising with CFG "
        "batched; text encoder and VAE not included). attn ms / rest ms: one extra forward with the self-attention "
        "timers on. Peak: all memory allocated during the timed runs, weights included (GPU only).",
    ]
    return "\n".join(lines) + "\n"


def plot(plt, rows: list[dict], meta: dict):
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p and "ms" in r for r in rows)] or ["fwd"]
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4.2), squeeze=False)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for ax, pass_ in zip(axes[0], passes):
        grids = list(dict.fromkeys(r["grid"] for r in rows if r["pass"] == pass_))
        width = 0.8 / max(1, len(variants))
        for i, variant in enumerate(variants):
            ms = [
                next(
                    (
                        r["ms"]
                        for r in rows
                        if r["grid"] == g and r["pass"] == pass_ and r["variant"] == variant and "ms" in r
                    ),
                    0.0,
                )
                for g in grids
            ]
            xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(grids))]
            bars = ax.bar(xs, ms, width, label=variant)
            for bar, r in zip(bars, grids):
                sp = next(
                    (
                        x.get("speedup_vs_flash")
                        for x in rows
                        if x["grid"] == r and x["pass"] == pass_ and x["variant"] == variant and "ms" in x
                    ),
                    None,
                )
                if sp:
                    ax.annotate(
                        f"{sp:.2f}x",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(grids)), [f"{g}\n({eval_tokens(g)} tokens)" for g in grids], fontsize=8)
        ax.set(ylabel="ms (median)", title=f"Wan2.1 {meta['config']} {pass_}: {meta['device']}, {meta['dtype']}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def eval_tokens(grid: str) -> int:
    f, h, w = parse_grid(grid)
    return f * h * w


def recompiled(rows: list[dict]) -> list[str]:
    """The rows whose timed runs compiled graphs (their times include compiling): ``variant pass size (n)``."""
    return [
        f"{r['variant']} {r['pass']} {r['size'] or r['grid']} ({r['graphs_compiled_while_timed']})"
        for r in rows
        if r.get("graphs_compiled_while_timed")
    ]


if __name__ == "__main__":
    bad = recompiled(main()["rows"])
    if bad:  # the results are written (and flagged per row); the exit status says they are not timings
        raise SystemExit(f"torch.compile compiled graphs during the timed runs of {', '.join(bad)}: not steady-state")

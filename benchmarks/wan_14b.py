"""Wan2.1-14B at 720p (81x720x1280: 21x45x80 = 75,600 tokens): the transformer step per variant, eager and compiled,
with the memory each needs; random weights built on the device in bf16.

    python -m benchmarks.wan_14b                                  # GPU: 4 of the 40 layers timed, scaled to 40
    python -m benchmarks.wan_14b --layers 40                      # the whole model (~27 GiB of weights)
    python -m benchmarks.wan_14b --config tiny --grid 3x8x8 --layers 1 --full-layers 3   # CPU check

A step of the whole 14B model at 75,600 tokens takes ~27 s in softmax (benchmarks/results/count_step_14b_75600.md),
too long to time every variant twice within one device call. So by default it times a BLOCK of ``--layers`` layers
and scales, and says so in every table: the model is built with that many layers (every layer of a Wan transformer
is the same computation on the same shapes), each variant's forward is timed at that depth and with no layers at
all (the patch and text embeddings, the time embedding and the head: the fixed part), and the step of the full
model is ``fixed + full_layers x (depth time - fixed) / layers``. mhla-hybrid is composed from the flash and MHLA
layers in its split of the full model (14 softmax, 26 MHLA of 40). The peak memory is measured at that depth; for
the full model the extra layers' weights are added (activations do not grow with depth in a no-grad forward).
``--layers`` equal to the model's own count times the whole model and scales nothing.

Each forward: batch 2 (CFG's two halves, as wan_step), 512 random text tokens, ``--warmup`` untimed runs then
the median of ``--repeats`` (CUDA events). Eager first, then ``--compile`` (torch.compile of the repeated
blocks, mhla.compiled.compile_transformer; the warm-up compiles). The counted prediction for each row
(benchmarks.count_step) is shown beside the measurement when its JSON (``--predictions``) is there.
Writes ``<tag>.json`` and ``<tag>.md`` after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DTYPES, RESULTS, Timer, default_tag, dtype_name, environment, measure, sync
from benchmarks.wan_step import CONFIGS, attention_breakdown, build_transformer, forward_fn, latent_inputs, parse_size
from common.outputs import write_text_atomic
from mhla.checks import COMPILE_MODES
from mhla.layout import parse_grid
from pipelines import AttentionOptions, convert_self_attention, set_variant
from pipelines.attention import HYBRID, LINEAR, MHLA, SOFTMAX, linear_layers_for

MEASURED_VARIANTS = (SOFTMAX, MHLA, LINEAR)
PREDICTIONS = RESULTS / "count_step_14b_75600.json"
TARGET_VS_FLASH = 3.0  # issue 50: MHLA >= 3x cuDNN softmax per step, eager and compiled


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan_14b", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", choices=sorted(CONFIGS), default="14b")
    p.add_argument("--size", default="81x720x1280", help="FRAMESxHEIGHTxWIDTH in pixels")
    p.add_argument("--grid", default=None, help="latent-token grid FxHxW instead of --size (CPU checks)")
    p.add_argument("--layers", type=int, default=4, help="layers built and timed (the model's own count: no scaling)")
    p.add_argument("--full-layers", type=int, default=None, help="the model's layer count (default: the config's)")
    p.add_argument("--variants", default=",".join(MEASURED_VARIANTS), help="of flash, mhla, linear (hybrid: composed)")
    p.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    p.add_argument("--compile", choices=COMPILE_MODES, default="blocks")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--blocks", default=None, help="MHLA blocks FxHxW (default: mhla.default_blocks of the grid)")
    p.add_argument("--softmax-backend", default="auto", help="flash's backend (mhla.SOFTMAX_BACKENDS)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=50, help="denoising steps for the projected video time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--predictions", type=Path, default=PREDICTIONS, help="benchmarks.count_step's JSON for this size")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default=None, help="file name (default wan_step_14b_720p_<gpu>_<date>)")
    return p


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


class Depth:
    """The model's blocks cut to ``n`` (0: none) for the duration, then put back."""

    def __init__(self, model: Any, n: int) -> None:
        self.model, self.n, self.blocks = model, n, model.blocks

    def __enter__(self) -> None:
        self.model.blocks = torch.nn.ModuleList(list(self.blocks)[: self.n])

    def __exit__(self, *exc: object) -> None:
        self.model.blocks = self.blocks


def main(argv: Sequence[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype or ("fp32" if device.type == "cpu" else "bf16")]
    config = dict(CONFIGS[a.config])
    full = a.full_layers or config["num_layers"]
    layers = min(a.layers, full)
    if layers < 1:
        raise SystemExit("--layers must be >= 1")
    grid = parse_grid(a.grid) if a.grid else parse_size(a.size)
    tokens = math.prod(grid)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if any(v not in MEASURED_VARIANTS for v in variants) or not variants:
        raise SystemExit(f"--variants: some of {', '.join(MEASURED_VARIANTS)} (mhla-hybrid is composed from them)")
    if any(m not in ("eager", "compiled") for m in modes) or not modes:
        raise SystemExit("--modes: eager and/or compiled")
    modes = [m for m in ("eager", "compiled") if m in modes]  # eager first: compiling is in place
    scaled = layers < full
    env = environment(device)
    import mhla

    blocks = a.blocks or "x".join(map(str, mhla.default_blocks(grid)))
    hybrid_mhla = len(linear_layers_for(HYBRID, full))
    model = build_transformer(dict(config, num_layers=layers), device, dtype, a.seed)
    options = AttentionOptions(blocks=blocks, softmax_backend=a.softmax_backend)
    convert_self_attention(model, LINEAR, options=options)
    convert_self_attention(model, MHLA, options=options)
    with Depth(model, 0):
        base_bytes = weight_bytes(model)
    per_layer_bytes = (weight_bytes(model) - base_bytes) / layers
    full_weights = base_bytes + full * per_layer_bytes
    tag = a.tag or default_tag(f"wan_step_{a.config}_720p", device)
    predictions = _load_predictions(a.predictions, a.config, tokens)
    meta: dict[str, Any] = {
        "benchmark": "wan_14b",
        **env,
        "config": a.config,
        "grid": "x".join(map(str, grid)),
        "size": None if a.grid else a.size,
        "tokens": tokens,
        "layers_timed": layers,
        "full_layers": full,
        "scaled": scaled,
        "dtype": dtype_name(dtype),
        "batch": a.batch,
        "text_len": a.text_len,
        "blocks": blocks,
        "softmax_backend_requested": a.softmax_backend,
        "hybrid_mhla_layers": hybrid_mhla,
        "warmup": a.warmup,
        "repeats": a.repeats,
        "steps": a.steps,
        "compile": a.compile,
        "weights_gib_timed": weight_bytes(model) / 2**30,
        "weights_gib_full": full_weights / 2**30,
        "predictions_file": str(a.predictions) if predictions else None,
        "weights": "random (timing only)",
    }
    how = (
        f"{layers} of {full} layers timed and SCALED to {full}" if scaled else f"the whole model ({full} layers) timed"
    )
    print(
        f"# Wan2.1 {a.config} at {meta['grid']} ({tokens:,} tokens) on {env['device']}, {meta['dtype']}, batch "
        f"{a.batch}: {how}; blocks {blocks}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(a.seed)
    inputs = latent_inputs(config, grid, a.batch, a.text_len, device, dtype, gen)
    timer = Timer(device)
    rows: list[dict[str, Any]] = []
    record = {"meta": meta, "rows": rows}
    for mode in modes:
        if mode == "compiled":
            from mhla.compiled import compile_transformer

            compile_transformer(model, a.compile)
        fixed = None
        for variant in variants:
            set_variant(model, variant)
            row: dict[str, Any] = {"variant": variant, "mode": mode}
            try:
                fn = forward_fn(model, inputs)
                at_depth = measure(fn, device, a.warmup, a.repeats, timer)
                row.update(
                    depth_ms=at_depth["ms"],
                    depth_ms_min=at_depth["ms_min"],
                    depth_ms_max=at_depth["ms_max"],
                    peak_gib_timed=None if at_depth["peak_total_mib"] is None else at_depth["peak_total_mib"] / 1024,
                    graphs_compiled_while_timed=at_depth["graphs_compiled_while_timed"],
                )
                if mode == "eager":  # one more forward with the self-attention timers on (they break graphs)
                    row["depth_attn_ms"] = attention_breakdown(model, fn, device)["attn_ms"]
                if scaled:
                    if fixed is None:  # the same for every variant: no attention in it
                        with Depth(model, 0):
                            fixed = measure(forward_fn(model, inputs), device, a.warmup, a.repeats, timer)["ms"]
                    row["fixed_ms"] = fixed
                    row["per_layer_ms"] = (row["depth_ms"] - fixed) / layers
                    row["step_ms"] = fixed + full * row["per_layer_ms"]
                else:
                    row["step_ms"] = row["depth_ms"]
                if row["peak_gib_timed"] is not None:
                    extra = (full - layers) * per_layer_bytes / 2**30
                    row["peak_gib_full"] = row["peak_gib_timed"] + extra
                if "depth_attn_ms" in row:
                    row["attn_ms_full"] = row["depth_attn_ms"] * full / layers
            except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as e:
                row["skipped"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            finally:
                sync(device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            finish(rows, meta, predictions)
            print(format_row(row, meta), flush=True)
            write(a.out_dir, tag, record)
    table = write(a.out_dir, tag, record, complete=True)
    print("\n" + table, flush=True)
    print(f"wrote {a.out_dir / tag}.json and .md", flush=True)
    return record


def _load_predictions(path: Path | None, config: str, tokens: int) -> dict | None:
    """benchmarks.count_step's predictions when they are for this model and size (else None)."""
    if path is None or not Path(path).is_file():
        return None
    data = json.loads(Path(path).read_text())
    m = data.get("meta", {})
    if m.get("config") != config or m.get("tokens") != tokens or "attention" not in data:
        return None
    return data


def finish(rows: list[dict[str, Any]], meta: dict, predictions: dict | None) -> None:
    """Composes mhla-hybrid from the flash and MHLA rows of each mode; ``vs_flash`` (same mode); the counted
    prediction of each row (the H200's, else the H100's, of benchmarks.count_step)."""
    rows[:] = [r for r in rows if r["variant"] != HYBRID]
    full, hybrid = meta["full_layers"], meta["hybrid_mhla_layers"]
    for mode in ("eager", "compiled"):
        got = {r["variant"]: r for r in rows if r["mode"] == mode and "step_ms" in r}
        flash, mhla_row = got.get(SOFTMAX), got.get(MHLA)
        if flash and mhla_row and meta["scaled"]:
            h: dict[str, Any] = {"variant": HYBRID, "mode": mode, "composed": True}
            h["fixed_ms"] = flash["fixed_ms"]
            h["per_layer_ms"] = ((full - hybrid) * flash["per_layer_ms"] + hybrid * mhla_row["per_layer_ms"]) / full
            h["step_ms"] = h["fixed_ms"] + full * h["per_layer_ms"]
            peaks = [r.get("peak_gib_full") for r in (flash, mhla_row)]
            h["peak_gib_full"] = None if None in peaks else max(p for p in peaks if p is not None)
            rows.append(h)
            got[HYBRID] = h
        for r in got.values():
            r["vs_flash"] = None if flash is None else flash["step_ms"] / r["step_ms"]
            r["video_s"] = r["step_ms"] * meta["steps"] / 1e3
    if predictions:
        gpu = "H200" if meta.get("device_kind") == "h200" else "H100"
        table = predictions["predictions"][gpu]
        for r in rows:
            p = table.get(r["variant"])
            if isinstance(p, dict):
                r["predicted_ms"] = p[f"{r['mode']}_ms"]
                r["predicted_vs_flash"] = p[f"vs_flash_{r['mode']}"]
                r["predicted_for"] = gpu


def format_row(r: dict[str, Any], meta: dict) -> str:
    head = f"{r['mode']:>8} {r['variant']:<12}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    scaled = f" (scaled from {meta['layers_timed']} layers: {r['depth_ms']:.1f} ms)" if meta["scaled"] else ""
    peak = f", peak {r['peak_gib_full']:.1f} GiB" if r.get("peak_gib_full") is not None else ""
    return f"{head} step {r['step_ms']:.1f} ms{scaled}{peak}"


def write(out_dir: Path, tag: str, record: dict, complete: bool = False) -> str:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record["meta"]["complete"] = complete
    table = markdown(record)
    write_text_atomic(out_dir / f"{tag}.json", json.dumps(record, indent=1, default=str) + "\n")
    write_text_atomic(out_dir / f"{tag}.md", table)
    return table


def _f(x: Any, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown(record: dict) -> str:
    m, rows = record["meta"], record["rows"]
    lines = []
    if m.get("device_type") != "cuda":
        lines += ["**CPU run: this checks that the benchmark runs; its times say nothing about GPU speed.**", ""]
    if not m.get("complete"):
        lines += [f"PARTIAL RUN: {len(rows)} rows so far.", ""]
    if m["scaled"]:
        how = (
            f"**SCALED, not the whole model: {m['layers_timed']} of its {m['full_layers']} layers were built and "
            f"timed**, and the model without layers (its fixed part); step = fixed + {m['full_layers']} x per layer. "
            f"mhla-hybrid is COMPOSED from the flash and MHLA layers ({m['hybrid_mhla_layers']} MHLA, "
            f"{m['full_layers'] - m['hybrid_mhla_layers']} softmax), not timed. Peak memory: measured at "
            f"{m['layers_timed']} layers, plus the other layers' weights."
        )
    else:
        how = f"The whole model ({m['full_layers']} layers) timed; nothing scaled."
    lines += [
        f"# Wan2.1-{m['config']} transformer step at {m['grid']} ({m['tokens']:,} tokens): {m['device']}, {m['date']}",
        "",
        how,
        "",
        f"Random weights, {m['dtype']}, batch {m['batch']} (CFG), {m['text_len']} text tokens, MHLA blocks {m['blocks']}; "
        f"softmax backend {m['softmax_backend_requested']}; median of {m['repeats']} after {m['warmup']}; torch "
        f"{m['torch']}, compiled: torch.compile ({m['compile']}). Weights {m['weights_gib_full']:.1f} GiB for the "
        f"whole model.",
        "",
        f"| variant | mode | step ms | vs flash | {m['steps']} steps s | timed ms ({m['layers_timed']} layers) | "
        "fixed ms | per layer ms | attention ms | peak GiB | predicted ms (count) | predicted vs flash |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['variant']} | {r['mode']} | skipped: {r['skipped']} ||||||||||")
            continue
        name = r["variant"] + (" (composed)" if r.get("composed") else "")
        if r.get("graphs_compiled_while_timed"):
            name += f" (RECOMPILED x{r['graphs_compiled_while_timed']} while timed)"
        lines.append(
            f"| {name} | {r['mode']} | {r['step_ms']:.1f} | {_f(r.get('vs_flash'), '.2f', 'x')} | "
            f"{_f(r.get('video_s'), '.0f')} | {_f(r.get('depth_ms'))} | {_f(r.get('fixed_ms'))} | "
            f"{_f(r.get('per_layer_ms'))} | {_f(r.get('attn_ms_full'), '.0f')} | {_f(r.get('peak_gib_full'))} | "
            f"{_f(r.get('predicted_ms'), '.0f')} | {_f(r.get('predicted_vs_flash'), '.2f', 'x')} |"
        )
    mhla_rows = [r for r in rows if r["variant"] == MHLA and r.get("vs_flash")]
    if mhla_rows and m.get("device_type") == "cuda":
        lines.append("")
        for r in mhla_rows:
            met = "met" if r["vs_flash"] >= TARGET_VS_FLASH else "MISSED"
            lines.append(f"Target MHLA >= {TARGET_VS_FLASH:g}x flash, {r['mode']}: {r['vs_flash']:.2f}x ({met}).")
    lines += [
        "",
        "step ms: the whole model's forward (scaled as said above); attention ms: self-attention's time in the "
        "eager forward (timers on), scaled to every layer; peak: all memory allocated during the timed runs, weights "
        "included, for the whole model; predicted: benchmarks.count_step's count (benchmarks/results/"
        "count_step_14b_75600.md) for this GPU kind (H200, else H100).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
    sys.exit(0)

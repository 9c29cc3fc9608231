"""The Benchmark tab's logic: latency against sequence length, measured live on this machine.

Two levels, over latent-token grids of growing size:
- the attention operator alone, ``(1, N, heads, head_dim)`` at the loaded model's heads and head size:
  softmax (fastest backend present), vanilla linear attention, MHLA, through :mod:`mhla`'s public ops;
- one forward pass of the loaded transformer (every block, no classifier-free guidance) per variant,
  i.e. one denoising step's work at the model's real width.

A size that does not fit (out of memory) ends that series; the rest still run.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path

import torch

import mhla
from common.outputs import write_text_atomic
from common.timing import device_name, time_call
from pipelines import VARIANTS
from pipelines.attention import SOFTMAX

from . import inputs
from .compare import VARIANT_COLOURS
from .models import AppModels

OPERATORS = ("softmax", "linear", "mhla")
CPU_GRIDS = "1x16x16,1x32x32,2x32x32"  # 256 .. 2,048 tokens: seconds on 2 CPU cores with the tiny model
GPU_GRIDS = "1x32x32,4x32x32,8x32x48,21x30x50,21x30x52,32x48x48"  # .. 73,728 tokens
MAX_GRIDS = 12
LEVELS = ("operator", "transformer forward")
FIELDS = ("level", "variant", "grid", "tokens", "M", "ms", "backend", "note")


def default_grids(device: torch.device) -> str:
    return GPU_GRIDS if device.type == "cuda" else CPU_GRIDS


def operator_call(op: str, q, k, v, layout, mixing, rope):
    """One forward of operator ``op`` (``softmax``, ``linear``, ``mhla``) on ``(1, N, heads, dim)`` inputs."""

    @torch.no_grad()
    def run():
        if op == "softmax":
            return mhla.softmax_attention(q, k, v)
        if op == "linear":
            return mhla.linear_attention(q, k, v, normalize=False, rotary_emb=rope)
        return mhla.mhla_attention(q, k, v, layout, mixing, normalize=False, rotary_emb=rope)

    return run


def parse_grids(text: str, max_tokens: int | None = None) -> list[tuple[int, int, int]]:
    """``"1x16x16, 2x16x32"`` -> grids sorted by token count; ``ValueError`` names the bad entry."""
    if text is not None and not isinstance(text, str):
        raise ValueError(f"token grids must be text such as 1x16x16,2x16x32, got {type(text).__name__}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("no token grids given; expected e.g. 1x16x16,2x16x32 (frames x height x width in tokens)")
    grids = []
    for part in text.split(","):
        grid = mhla.parse_grid(part)
        if max_tokens is not None and math.prod(grid) > max_tokens:
            raise ValueError(
                f"grid {part.strip()} has {math.prod(grid):,} tokens; this app allows at most {max_tokens:,} here "
                "(start it with --max-bench-tokens to change)"
            )
        grids.append(grid)
    if len(grids) > MAX_GRIDS:
        raise ValueError(f"at most {MAX_GRIDS} grids per run, got {len(grids)}")
    return sorted(set(grids), key=math.prod)


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def operator_rows(models: AppModels, grids, warmup=2, repeats=3, progress=None) -> list[dict]:
    """Operator latency (ms, median of ``repeats``) per operator and grid."""
    cfg = models.components.transformer.config
    heads, dim = cfg.num_attention_heads, cfg.attention_head_dim
    device, dtype = models.device, models.components.dtype
    gen = torch.Generator().manual_seed(0)
    rows, stopped = [], set()
    for grid in grids:
        layout = mhla.BlockLayout.for_grid(grid)
        n = layout.num_tokens
        try:
            q, k, v = (torch.randn(1, n, heads, dim, generator=gen).to(device, dtype) for _ in range(3))
        except torch.OutOfMemoryError:
            stopped.update(OPERATORS)
            q = k = v = None
        angles = torch.rand(1, n, 1, dim // 2, generator=gen).repeat_interleave(2, -1) * 6.28
        rope = (angles.cos().to(device), angles.sin().to(device))
        mixing = mhla.locality_init(layout).float().to(device)
        for op in OPERATORS:
            if progress is not None:
                progress(f"operator {op} at {n:,} tokens")
            row = {"level": "operator", "variant": op, "grid": "x".join(map(str, grid)), "tokens": n}
            row["M"] = layout.num_blocks if op == "mhla" else (1 if op == "linear" else "")
            if op in stopped:
                row["note"] = "skipped: a smaller size did not fit"
            else:
                try:
                    row["ms"] = (
                        time_call(operator_call(op, q, k, v, layout, mixing, rope), device, warmup, repeats).median
                        * 1e3
                    )
                    if op == "softmax":
                        row["backend"] = mhla.last_softmax_backend()
                except (RuntimeError, torch.OutOfMemoryError) as e:
                    row["note"] = "out of memory" if _oom(e) else str(e).splitlines()[0][:120]
                    stopped.add(op)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
        del q, k, v
    return rows


def _forward(transformer, grid, device):
    """One forward of ``transformer`` on random latents for token grid ``grid`` (batch 1, 64 text tokens)."""
    cfg = transformer.config
    f, h, w = grid
    p_t, p_h, p_w = cfg.patch_size
    dtype = transformer.dtype
    latents = torch.randn(1, cfg.in_channels, f * p_t, h * p_h, w * p_w, device=device, dtype=dtype)
    text = torch.randn(1, 64, cfg.text_dim, device=device, dtype=dtype)
    step = torch.tensor([500], device=device)
    return lambda: transformer(hidden_states=latents, timestep=step, encoder_hidden_states=text, return_dict=False)


@torch.no_grad()
def transformer_rows(models: AppModels, grids, variants=VARIANTS, warmup=1, repeats=2, progress=None) -> list[dict]:
    """One transformer forward (all blocks, batch 1, random latents and text embeddings) per variant and grid."""
    device = models.device
    rows, stopped = [], set()
    for grid in grids:
        n = math.prod(grid)
        for name in variants:
            vm = models.variants[name]
            tr = vm.transformer
            if progress is not None:
                progress(f"transformer [{name}] at {n:,} tokens")
            row = {
                "level": "transformer forward",
                "variant": name,
                "grid": "x".join(map(str, grid)),
                "tokens": n,
                "M": "",
            }
            if name in stopped:
                row["note"] = "skipped: a smaller size did not fit"
                rows.append(row)
                continue
            try:
                if tr.conversion.variant != name:
                    # the shared base transformer switches in place, as generate() does at each run
                    tr.convert(name)
                row["ms"] = time_call(_forward(tr, grid, device), device, warmup, repeats).median * 1e3
            except (RuntimeError, torch.OutOfMemoryError, ValueError) as e:
                row["note"] = "out of memory" if _oom(e) else str(e).splitlines()[0][:120]
                stopped.add(name)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
    return rows


def run_benchmark(
    models: AppModels,
    grids_text: str,
    levels=("operator", "transformer forward"),
    variants=VARIANTS,
    max_tokens: int | None = None,
    repeats: int = 3,
    progress=None,
) -> dict:
    """Both levels over the grids; returns ``{"meta": ..., "rows": [...]}`` (rows as :data:`FIELDS`)."""
    grids = parse_grids(grids_text, max_tokens)
    variants = inputs.choices("variants", list(variants) if isinstance(variants, tuple) else variants, VARIANTS)
    if not isinstance(levels, list | tuple) or not levels or any(lv not in LEVELS for lv in levels):
        raise ValueError(f"levels must be some of {', '.join(map(repr, LEVELS))}, got {levels!r}")
    repeats = inputs.whole_number("repeats", repeats, 1, 20)  # 2.7 is refused, never truncated
    t0 = time.perf_counter()
    rows = []
    if "operator" in levels:
        rows += operator_rows(models, grids, repeats=repeats, progress=progress)
    if "transformer forward" in levels and variants:
        rows += transformer_rows(models, grids, variants, repeats=repeats, progress=progress)
    cfg = models.components.transformer.config
    meta = {
        "device": device_name(models.device),
        "dtype": str(models.components.dtype).replace("torch.", ""),
        "model": models.components.source,
        "heads": cfg.num_attention_heads,
        "head_dim": cfg.attention_head_dim,
        "layers": cfg.num_layers,
        "torch": torch.__version__,
        "repeats": repeats,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return {"meta": meta, "rows": rows}


def table(result: dict) -> list[list]:
    return [[r.get(k, "") if k != "ms" or "ms" not in r else round(r["ms"], 3) for k in FIELDS] for r in result["rows"]]


def to_csv(result: dict) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(result["rows"])
    return buf.getvalue()


def save(result: dict, folder: Path) -> tuple[Path, Path]:
    """Writes ``benchmark.json`` and ``benchmark.csv`` into ``folder`` (a server-made folder, never a UI path)."""
    folder.mkdir(parents=True, exist_ok=True)
    js, cs = folder / "benchmark.json", folder / "benchmark.csv"
    write_text_atomic(js, json.dumps(result, indent=2) + "\n")
    write_text_atomic(cs, to_csv(result))
    return js, cs


def figure(result: dict):
    """Log-log latency against tokens, one line per level and variant, with O(N) and O(N^2) slopes drawn
    through each panel's first measured point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(dict.fromkeys(r["level"] for r in result["rows"]))
    fig, axes = plt.subplots(1, max(len(levels), 1), figsize=(6 * max(len(levels), 1), 4.2), squeeze=False)
    for ax, level in zip(axes[0], levels):
        rows = [r for r in result["rows"] if r["level"] == level]
        for name in dict.fromkeys(r["variant"] for r in rows):
            pts = [(r["tokens"], r["ms"]) for r in rows if r["variant"] == name and "ms" in r]
            if pts:  # one colour per variant, as on the Compare tab (the softmax operator is flash's)
                colour = VARIANT_COLOURS.get(SOFTMAX if name == "softmax" else name)
                ax.plot(*zip(*pts), marker="o", label=name, color=colour)
        done = [r for r in rows if "ms" in r]
        if done:
            ns = sorted({r["tokens"] for r in rows})
            n0 = ns[0]
            t0 = min((r["ms"] for r in done if r["tokens"] == n0), default=min(r["ms"] for r in done))
            ax.plot(ns, [t0 * n / n0 for n in ns], "k:", lw=1, label="O(N) slope")
            ax.plot(ns, [t0 * (n / n0) ** 2 for n in ns], "k--", lw=1, label="O(N^2) slope")
        ax.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="ms", title=level)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"{meta['device']}, {meta['dtype']}, {meta['heads']} heads x {meta['head_dim']}", fontsize=9)
    fig.tight_layout()
    plt.close(fig)
    return fig

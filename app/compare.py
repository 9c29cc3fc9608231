"""The Compare tab's logic: one prompt and seed through several self-attention variants, timed.

Plain functions over :mod:`pipelines`' public API (``generate``, ``write_mp4``, ``Timing``); the UI only
calls :func:`run_compare` and shows what it returns.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mhla
from pipelines import VARIANTS, Timing, write_mp4
from pipelines.pipeline import generate

from .models import AppModels, device_name

log = logging.getLogger(__name__)

# (num_frames, height, width). Token grid: ((frames-1)/4+1) x height/16 x width/16.
PRESETS = (
    (5, 32, 48),  # 2x2x3 = 12 tokens: quick on a CPU with the tiny model
    (9, 64, 96),  # the tiny random model's default size
    (17, 128, 160),  # the built-in model's size: 5x16x20 = 1,600 tokens with its 1x1x1 patch
    (17, 128, 192),
    (33, 240, 416),
    (17, 480, 832),
    (81, 480, 800),  # the paper's setting: 21x30x50 = 31,500 tokens, M = 105
    (81, 480, 832),  # Wan2.1's own default: 21x30x52 = 32,760 tokens
)
# The paper's target block shape in tokens; the preset labels name the M a real model gets with it.
PAPER_BLOCK_SHAPE = (3, 10, 10)
# On a CPU the wall time of a run grows fast with tokens; above this a request is refused with a
# message instead of tying up the (single) queue for hours. --max-tokens changes it.
CPU_MAX_TOKENS = 8192
MAX_STEPS = 100
MAX_GUIDANCE = 30.0
MAX_PROMPT_CHARS = 2000  # the text encoder reads at most a few hundred tokens; more is a mistake or abuse
KEEP_RUNS = 20  # run folders kept on disk (videos the page may still show)


def preset_key(preset: tuple[int, int, int]) -> str:
    return "x".join(map(str, preset))


def preset_grid(preset: tuple[int, int, int], patch=(1, 2, 2)) -> tuple[int, int, int]:
    """Latent-token grid of a preset for a transformer with ``patch`` (Wan2.1: 1x2x2)."""
    frames, height, width = preset
    return ((frames - 1) // 4 + 1) // patch[0], height // 8 // patch[1], width // 8 // patch[2]


def preset_label(preset: tuple[int, int, int], patch=(1, 2, 2), block_shape=PAPER_BLOCK_SHAPE) -> str:
    """E.g. ``81 frames, 480x800: 31,500 tokens (21x30x50), M=105`` (tokens and M for this patch and block shape)."""
    frames, height, width = preset
    grid = preset_grid(preset, patch)
    m = math.prod(mhla.default_blocks(grid, block_shape))
    return f"{frames} frames, {height}x{width}: {math.prod(grid):,} tokens ({'x'.join(map(str, grid))}), M={m}"


def preset_choices(patch=(1, 2, 2), block_shape=PAPER_BLOCK_SHAPE) -> list[tuple[str, str]]:
    return [(preset_label(p, patch, block_shape), preset_key(p)) for p in PRESETS]


def parse_preset(key) -> tuple[int, int, int]:
    """Only the listed presets are accepted: the value comes from the browser and is not trusted."""
    for p in PRESETS:
        if key == preset_key(p):
            return p
    raise ValueError(f"unknown resolution preset {key!r}; expected one of {', '.join(preset_key(p) for p in PRESETS)}")


def _as_int(name: str, value, lo: int, hi: int | None = None) -> int:
    # gr.Number sends floats; an integral float is fine, 2.5 steps is not
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be between {lo} and {hi}, got {value}" if hi else f"{name} must be >= {lo}")
    return value


@dataclass
class CompareRequest:
    prompt: str
    negative_prompt: str
    seed: int
    num_inference_steps: int
    guidance_scale: float
    preset: tuple[int, int, int]
    variants: list[str]

    @property
    def num_frames(self) -> int:
        return self.preset[0]

    @property
    def height(self) -> int:
        return self.preset[1]

    @property
    def width(self) -> int:
        return self.preset[2]


def check_request(
    models: AppModels,
    prompt,
    negative_prompt,
    seed,
    steps,
    guidance,
    preset,
    variants,
    max_tokens: int | None = None,
) -> CompareRequest:
    """Validates everything the page sends before any model work; ``ValueError`` names the bad value."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: describe the video to generate (e.g. 'a red fox running through snow')")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise ValueError(f"negative prompt must be text, got {type(negative_prompt).__name__}")
    for name, text in (("prompt", prompt), ("negative prompt", negative_prompt or "")):
        if len(text) > MAX_PROMPT_CHARS:
            raise ValueError(f"the {name} has {len(text):,} characters; at most {MAX_PROMPT_CHARS:,} are accepted")
    seed = _as_int("seed", seed, 0, 2**63 - 1)
    steps = _as_int("steps", steps, 1, MAX_STEPS)
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not 0 <= guidance <= MAX_GUIDANCE:
        raise ValueError(f"guidance must be a number between 0 and {MAX_GUIDANCE:g}, got {guidance!r}")
    chosen = list(variants or [])
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; expected some of {', '.join(VARIANTS)}")
    if not chosen:
        raise ValueError(f"no variant chosen: tick at least one of {', '.join(VARIANTS)}")
    preset = parse_preset(preset)
    grid = models.grid(preset[1], preset[2], preset[0])
    tokens = math.prod(grid)
    if max_tokens is not None and tokens > max_tokens:
        raise ValueError(
            f"preset {preset_label(preset, models.patch, models.components.block_shape)} is too large for this device ({device_name(models.device)}): "
            f"{tokens:,} tokens, this app allows at most {max_tokens:,} here (start it with --max-tokens to change)"
        )
    return CompareRequest(
        prompt=prompt.strip(),
        negative_prompt=(negative_prompt or "").strip(),
        seed=seed,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        preset=preset,
        variants=[v for v in VARIANTS if v in chosen],  # canonical order, no duplicates
    )


@dataclass
class VariantRun:
    """One variant's outcome: a video and its timing, or the error that stopped it."""

    variant: str
    note: str
    kind: str = ""
    video: Path | None = None
    timing: Timing | None = None
    error: str | None = None


@dataclass
class CompareResult:
    request: CompareRequest
    runs: list[VariantRun]
    device: str
    random_note: str | None = None
    notes: list[str] = field(default_factory=list)

    def run(self, variant: str) -> VariantRun | None:
        return next((r for r in self.runs if r.variant == variant), None)

    @property
    def softmax_backend(self) -> str:
        names = sorted({r.timing.softmax_backend for r in self.runs if r.timing and r.timing.softmax_backend})
        return ", ".join(names) or "- (no softmax layer ran)"


def _error_text(e: BaseException, models: AppModels, request: CompareRequest) -> str:
    tokens = math.prod(models.grid(request.height, request.width, request.num_frames))
    if isinstance(e, torch.OutOfMemoryError):
        return (
            f"out of memory on {device_name(models.device)} at {tokens:,} tokens "
            f"({request.num_frames} frames, {request.height}x{request.width}); choose a smaller preset"
        )
    if isinstance(e, (ValueError, FloatingPointError)):  # our own messages: they name the bad value
        return _without_paths(f"{type(e).__name__}: {e}")
    log.error("compare: %s failed", request.variants, exc_info=e)  # the details stay in the server's log
    return f"internal error ({type(e).__name__}); the details are in the server's log"


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.\-+~@]+){2,}")


def _without_paths(text: str) -> str:
    """Server paths never reach the browser: each absolute path is cut to its last part."""
    return _PATH.sub(lambda m: ".../" + re.split(r"[/\\]", m.group(0))[-1], text)


def new_run_dir(out_root: Path) -> Path:
    """A fresh folder for one compare run's videos; only the newest :data:`KEEP_RUNS` are kept."""
    out_root.mkdir(parents=True, exist_ok=True)
    old = sorted((p for p in out_root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for p in old[: max(0, len(old) - KEEP_RUNS + 1)]:
        shutil.rmtree(p, ignore_errors=True)
    run_dir = out_root / uuid.uuid4().hex[:12]
    run_dir.mkdir()
    return run_dir


def run_compare(
    models: AppModels, request: CompareRequest, out_root: Path, progress=None, fps: int = 16
) -> CompareResult:
    """Runs each chosen variant with the same seed, one after the other; writes one mp4 per variant.

    ``progress(done, total, desc)`` is called before each variant. A variant that fails (out of memory,
    anything raised inside generation) gets its error in its :class:`VariantRun`; the others still run.
    """
    run_dir = new_run_dir(out_root)
    runs = []
    for i, name in enumerate(request.variants):
        vm = models.variants[name]
        if progress is not None:
            progress(i, len(request.variants), f"{name} ({i + 1}/{len(request.variants)})")
        run = VariantRun(name, vm.note, vm.kind)
        try:
            with warnings.catch_warnings():
                # "untrained attention parameters": the column already says "converted, not fine-tuned"
                warnings.simplefilter("ignore", UserWarning)
                result = generate(
                    models.components,
                    request.prompt,
                    negative_prompt=request.negative_prompt,
                    height=request.height,
                    width=request.width,
                    num_frames=request.num_frames,
                    num_inference_steps=request.num_inference_steps,
                    guidance_scale=request.guidance_scale,
                    seed=request.seed,
                    variant=name,
                    transformer=vm.transformer,
                )
            comment = f"{name} | seed {request.seed} | {request.prompt}"
            if models.random_note:
                comment = f"{models.random_note} | {comment}"
            run.video = write_mp4(run_dir / f"{name}.mp4", result.frames, fps=fps, comment=comment)
            run.timing = result.timing
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others' results
            run.error = _error_text(e, models, request)
            if models.device.type == "cuda":
                torch.cuda.empty_cache()  # give the next variant (and request) the memory back
        runs.append(run)
    if progress is not None:
        progress(len(request.variants), len(request.variants), "done")
    return CompareResult(request, runs, device_name(models.device), models.random_note, list(models.notes))


# ---- presenting a result ------------------------------------------------------------------------------


def _peak(t: Timing) -> str:
    return "n/a (CPU)" if t.peak_memory_bytes is None else f"{t.peak_memory_bytes / 2**30:.2f} GiB"


def attention_share(t: Timing) -> float:
    """Fraction of denoising time spent inside self-attention."""
    return t.self_attention / t.denoising if t.denoising > 0 else 0.0


def variant_markdown(run: VariantRun) -> str:
    """The latency block under a variant's video."""
    head = f"### {run.variant}\n_{run.note}_\n\n"
    if run.error:
        return head + f"**Error:** {run.error}"
    t = run.timing
    return head + "\n".join(
        [
            f"- total: **{t.total:.3f} s**",
            f"- denoising: {t.denoising:.3f} s ({len(t.steps)} steps)",
            f"- per step: **{t.per_step:.3f} s**",
            f"- self-attention: {t.self_attention:.3f} s ({attention_share(t):.0%} of denoising)",
            f"- peak memory: {_peak(t)}",
            f"- tokens: {t.num_tokens:,}; layout: {t.layout}",
        ]
    )


TABLE_HEADERS = [
    "variant",
    "weights",
    "tokens",
    "M",
    "total s",
    "denoising s",
    "per step s",
    "self-attn s",
    "attn share",
    "peak memory",
    "speedup vs flash",  # per denoising step
    "self-attn speedup",
    "softmax backend",
]


def table_rows(result: CompareResult) -> list[list]:
    """One row per variant (failed ones say why); speedups are flash's time over the variant's."""
    flash = result.run("flash")
    base = flash.timing if flash and flash.timing else None
    rows = []
    for r in result.runs:
        if r.error:
            rows.append([r.variant, r.kind, "", "", "", "", "", "", "", "", "", "", f"error: {r.error}"])
            continue
        t = r.timing
        speed = f"{base.per_step / t.per_step:.2f}x" if base and t.per_step > 0 else "-"
        attn = f"{base.self_attention / t.self_attention:.2f}x" if base and t.self_attention > 0 else "-"
        rows.append(
            [
                r.variant,
                r.kind,
                t.num_tokens,
                "-" if t.num_blocks is None else t.num_blocks,
                round(t.total, 4),
                round(t.denoising, 4),
                round(t.per_step, 4),
                round(t.self_attention, 4),
                f"{attention_share(t):.0%}",
                _peak(t),
                speed,
                attn,
                t.softmax_backend or "-",
            ]
        )
    return rows


def summary_markdown(result: CompareResult) -> str:
    req = result.request
    tokens = next((r.timing.num_tokens for r in result.runs if r.timing), None)
    lines = [
        f"**Device:** {result.device} · **softmax backend that ran:** {result.softmax_backend}",
        f"**Request:** {req.num_frames} frames at {req.height}x{req.width}"
        + (f" ({tokens:,} tokens)" if tokens else "")
        + f", {req.num_inference_steps} steps, guidance {req.guidance_scale:g}, seed {req.seed} (same noise for every variant)",
    ]
    failed = [r.variant for r in result.runs if r.error]
    if failed:
        lines.append(f"**Failed:** {', '.join(failed)} (see their columns); the app is still serving.")
    if result.random_note:
        lines.append(f"**{result.random_note}.**")
    return "\n\n".join(lines)


def speedup_figure(result: CompareResult):
    """Bar chart of per-step latency by variant, each bar labelled with its speedup over flash."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in result.runs if r.timing]
    flash = result.run("flash")
    base = flash.timing.per_step if flash and flash.timing else None
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    names = [r.variant for r in done]
    values = [r.timing.per_step * 1e3 for r in done]
    attn = [r.timing.self_attention / max(len(r.timing.steps), 1) * 1e3 for r in done]
    bars = ax.bar(names, values, color="#4c78a8", label="per denoising step")
    ax.bar(names, attn, color="#f58518", width=0.5, label="of which self-attention")
    for bar, r in zip(bars, done):
        text = f"{base / r.timing.per_step:.2f}x" if base and r.timing.per_step > 0 else ""
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    tokens = done[0].timing.num_tokens if done else 0
    ax.set(ylabel="ms per step", title=f"latency per step at {tokens:,} tokens (label: speedup vs flash)")
    ax.legend(fontsize=8, loc="lower right")
    ax.margins(y=0.15)
    fig.tight_layout()
    plt.close(fig)  # gradio renders the figure object; keep pyplot's registry from growing per request
    return fig

"""The Compare tab's logic: one prompt and seed through several self-attention variants, timed and
measured against flash.

Plain functions over :mod:`pipelines`' public API (``generate``, ``write_mp4``, ``Timing``, ``spread``);
the UI calls :func:`iter_compare` (one snapshot per finished variant) and shows what it yields.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from pipelines import VARIANTS, GenerationRequest, Timing, model_request, write_mp4
from pipelines.pipeline import generate
from pipelines.timing import Spread, device_name, spread

from . import inputs, quality
from .models import AppModels

log = logging.getLogger(__name__)

# (num_frames, height, width); the token grid is pipelines.latent_grid's (the model's patch and VAE strides)
PRESETS = (
    (5, 32, 48),  # quick on a CPU
    (9, 64, 96),  # the tiny random model's default size
    (17, 128, 160),  # the built-in model's size: 5x16x20 = 1,600 tokens with its 1x1x1 patch
    (17, 128, 192),
    (33, 240, 416),
    (17, 480, 832),
    (81, 480, 800),  # the paper's setting: 21x30x50 = 31,500 tokens, M = 105 (Wan2.1's patch)
    (81, 480, 832),  # Wan2.1's own default: 21x30x52 = 32,760 tokens
)
# On a CPU the wall time of a run grows fast with tokens; above this a request is refused with a
# message instead of tying up the (single) queue for hours. --max-tokens changes it.
CPU_MAX_TOKENS = 8192
MAX_STEPS = 100
MAX_GUIDANCE = 30.0
MAX_REPEATS = 10
MAX_PROMPT_CHARS = 2000  # the text encoder reads at most a few hundred tokens; more is a mistake or abuse
KEEP_RUNS = 20  # run folders kept on disk (videos the page may still show)
# above this relative spread (half the interquartile range over the median) of the denoising steps the page
# says that the machine is too noisy for the speedups to mean much
NOISY = 0.15


def preset_key(preset: tuple[int, int, int]) -> str:
    return "x".join(map(str, preset))


def preset_label(models: AppModels, preset: tuple[int, int, int]) -> str:
    """E.g. ``17 frames, 128x160: 1,600 tokens (5x16x20), M=40``: the tokens and the M that a run of this
    preset gets with the loaded model (its patch, and the MHLA layout generate() uses, shrunk to fit)."""
    frames, height, width = preset
    grid = models.grid(height, width, frames)
    ms = {v: models.num_blocks(grid, v) for v in ("mhla", "mhla-hybrid")}
    m = str(ms["mhla"]) if len(set(ms.values())) == 1 else f"{ms['mhla']} (mhla), {ms['mhla-hybrid']} (mhla-hybrid)"
    return f"{frames} frames, {height}x{width}: {math.prod(grid):,} tokens ({'x'.join(map(str, grid))}), M={m}"


def preset_tokens(models: AppModels, preset: tuple[int, int, int]) -> int:
    return math.prod(models.grid(preset[1], preset[2], preset[0]))


def preset_choices(models: AppModels, max_tokens: int | None = None) -> list[tuple[str, str]]:
    """``(label, key)`` of the presets this device accepts (at most ``max_tokens`` tokens)."""
    return [
        (preset_label(models, p), preset_key(p))
        for p in PRESETS
        if max_tokens is None or preset_tokens(models, p) <= max_tokens
    ]


def presets_left_out(models: AppModels, max_tokens: int | None) -> str | None:
    """Why the larger presets are not offered here, or None when every preset is."""
    if max_tokens is None:
        return None
    out = [p for p in PRESETS if preset_tokens(models, p) > max_tokens]
    if not out:
        return None
    sizes = ", ".join(f"{preset_key(p)} ({preset_tokens(models, p):,} tokens)" for p in out)
    return (
        f"Not offered on this device (more than {max_tokens:,} tokens; start the app with --max-tokens to change): "
        f"{sizes}."
    )


def parse_preset(key) -> tuple[int, int, int]:
    """Only the listed presets are accepted: the value comes from the browser and is not trusted."""
    for p in PRESETS:
        if key == preset_key(p):
            return p
    raise ValueError(f"unknown resolution preset {key!r}; expected one of {', '.join(preset_key(p) for p in PRESETS)}")


def _as_int(name: str, value, lo: int, hi: int) -> int:
    # gr.Number sends floats; an integral float is fine, 2.5 steps is not (refused, never rounded)
    return inputs.whole_number(name, value, lo, hi)


@dataclass
class CompareRequest:
    prompt: str
    negative_prompt: str
    seed: int
    num_inference_steps: int
    guidance_scale: float
    preset: tuple[int, int, int]
    variants: list[str]
    repeats: int = 1

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
    repeats=1,
) -> CompareRequest:
    """Validates everything the page sends before any model work; ``ValueError`` names the bad value.
    Out-of-range values are refused, never clamped or rounded."""
    # types first (a list is not a prompt), then control characters (a NUL would fail every variant's write)
    prompt = inputs.text("prompt", prompt, MAX_PROMPT_CHARS)
    negative_prompt = inputs.text("negative prompt", negative_prompt, MAX_PROMPT_CHARS)
    if not prompt.strip():
        raise ValueError(f"the prompt is empty: describe the video to generate, e.g. '{models.example_prompt}'")
    variants = inputs.choices("variants", variants, VARIANTS)
    seed = _as_int("seed", seed, 0, 2**63 - 1)
    steps = _as_int("steps", steps, 1, MAX_STEPS)
    repeats = _as_int("repeats", repeats, 1, MAX_REPEATS)
    if (
        isinstance(guidance, bool)
        or not isinstance(guidance, (int, float))
        or not math.isfinite(guidance)
        or not 0 <= guidance <= MAX_GUIDANCE
    ):
        raise ValueError(f"guidance must be a number between 0 and {MAX_GUIDANCE:g}, got {guidance!r}")
    chosen = list(variants or [])
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; expected some of {', '.join(VARIANTS)}")
    if not chosen:
        raise ValueError(f"no variant chosen: tick at least one of {', '.join(VARIANTS)}")
    preset = parse_preset(preset)
    tokens = preset_tokens(models, preset)
    if max_tokens is not None and tokens > max_tokens:
        raise ValueError(
            f"preset {preset_label(models, preset)} is too large for this device ({device_name(models.device)}): "
            f"{tokens:,} tokens, this app allows at most {max_tokens:,} here (start it with --max-tokens to change)"
        )
    return CompareRequest(
        prompt=prompt.strip(),
        negative_prompt=(negative_prompt or "").strip(),
        seed=seed,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        preset=preset,
        variants=[v for v in VARIANTS if v in chosen],  # canonical order (flash first), no duplicates
        repeats=repeats,
    )


@dataclass
class VariantRun:
    """One variant's outcome: a video, its timings (one per repeat) and its quality against flash, or the
    error that stopped it."""

    variant: str
    note: str
    kind: str = ""
    video: Path | None = None
    timings: list[Timing] = field(default_factory=list)
    error: str | None = None
    psnr: float | None = None  # dB against flash's video (None: flash not run, or this is flash)
    ssim: float | None = None
    attributes: tuple[int, int] | None = None  # (right, named) by the model's analyser (AppModels.judge)

    @property
    def timing(self) -> Timing | None:
        return self.timings[-1] if self.timings else None

    @property
    def steps(self) -> Spread:
        """Denoising step seconds over every step of every repeat."""
        return spread(s for t in self.timings for s in t.steps)

    def stage(self, name: str) -> Spread:
        """A stage's seconds over the repeats: ``total``, ``text_encoding``, ``denoising``, ``vae_decode``,
        ``self_attention``."""
        return spread(getattr(t, name) for t in self.timings)


@dataclass
class CompareResult:
    request: CompareRequest
    runs: list[VariantRun]
    device: str
    random_note: str | None = None
    notes: list[str] = field(default_factory=list)
    stopped: bool = False  # the user pressed Stop: ``runs`` holds the variants that finished

    def run(self, variant: str) -> VariantRun | None:
        return next((r for r in self.runs if r.variant == variant), None)

    @property
    def softmax_backend(self) -> str:
        names = sorted({r.timing.softmax_backend for r in self.runs if r.timing and r.timing.softmax_backend})
        return ", ".join(names) or "- (no softmax layer ran)"

    def speedups(self, run: VariantRun) -> tuple[float | None, float | None, bool]:
        """``(denoising, end_to_end, within_noise)``: flash's median over the variant's (denoising step and
        whole generation); ``within_noise`` when the two step ranges overlap or a side has one sample."""
        flash = self.run("flash")
        if not (flash and flash.timings and run.timings):
            return None, None, False
        a, b = flash.steps, run.steps
        total_a, total_b = flash.stage("total"), run.stage("total")
        noise = run is not flash and (a.n < 2 or b.n < 2 or a.overlaps(b))
        return a.median / b.median, total_a.median / total_b.median, noise


class RunCancelled(Exception):
    """The user pressed Stop: the run ends before the next transformer call."""


class _Stages:
    """Readable stages from the transformer's calls ("mhla: denoising step 7/20", "mhla: decoding video"),
    and the place where a Stop takes effect: before any transformer call.

    Forward hooks on the transformer (public torch API): generate() runs diffusers' pipeline, which calls the
    transformer once per step, twice with classifier-free guidance.
    """

    def __init__(self, transformer, report: Callable[[str], None], cancel: threading.Event | None):
        self.transformer, self.report, self.cancel = transformer, report, cancel
        self.calls, self.steps, self.per_step, self.label, self.decode = 0, 1, 1, "", True
        self.span = (0.0, 1.0)  # the part of the variant's work this generation is, for the time-left estimate

    def __enter__(self):
        self._hooks = [
            self.transformer.register_forward_pre_hook(self._before),
            self.transformer.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()

    def check(self):
        if self.cancel is not None and self.cancel.is_set():
            raise RunCancelled

    def start(self, label: str, steps: int, guidance: float, decode: bool, span=(0.0, 1.0)):
        self.check()
        self.label, self.steps, self.decode, self.calls, self.span = label, steps, decode, 0, span
        self.per_step = 2 if guidance > 1.0 else 1  # WanPipeline: conditional and unconditional calls
        self.show(f"{label}: encoding the prompt", 0.0)

    def show(self, text: str, fraction: float):
        """Reports ``text`` with ``fraction`` of this variant's span of the progress bar."""
        lo, hi = self.span
        self.report(text, lo + (hi - lo) * fraction)

    def _before(self, _module, _args):
        self.check()
        if self.calls % self.per_step == 0:
            step = self.calls // self.per_step + 1
            self.show(f"{self.label}: denoising step {step}/{self.steps}", (step - 1) / self.steps)

    def _after(self, _module, _args, _out):
        self.calls += 1
        if self.decode and self.calls == self.steps * self.per_step:
            self.show(f"{self.label}: decoding video", 1.0)


def _error_text(e: BaseException, models: AppModels, request: CompareRequest) -> str:
    tokens = preset_tokens(models, request.preset)
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


def iter_compare(
    models: AppModels,
    request: CompareRequest,
    out_root: Path,
    progress: Callable[[str, float], None] | None = None,
    cancel: threading.Event | None = None,
    fps: int = 16,
) -> Iterator[CompareResult]:
    """Runs each chosen variant with the same seed, one after the other, and yields a snapshot of the result
    after each one (the page fills that variant's column at once); writes one mp4 per variant.

    Per variant: one untimed warm-up generation (one step; the first variant also decodes, to warm the
    shared VAE), then ``request.repeats`` timed generations. ``progress(text, fraction)`` gets readable
    stages ("mhla: denoising step 7/20") and the fraction of the run done. Setting ``cancel`` stops the run
    before the next transformer call; the last snapshot then has ``stopped`` set. A variant that fails (out
    of memory, anything raised inside generation) gets its error in its :class:`VariantRun`; the others run.
    """
    run_dir = new_run_dir(out_root)
    result = CompareResult(request, [], device_name(models.device), models.random_note, list(models.notes))
    n = len(request.variants)
    reference = None  # flash's frames: what PSNR and SSIM compare against

    def snapshot() -> CompareResult:
        return replace(result, runs=list(result.runs))

    for i, name in enumerate(request.variants):
        vm = models.variants[name]
        run = VariantRun(name, vm.note, vm.kind)

        def report(text, fraction, i=i):
            if progress is not None:
                progress(f"{text} · variant {i + 1}/{n}", (i + fraction) / n)

        try:
            # built and checked once per variant; the warm-up is the same request with one step
            timed = model_request(
                models.components,
                GenerationRequest(
                    prompt=request.prompt,
                    negative_prompt=request.negative_prompt,
                    height=request.height,
                    width=request.width,
                    num_frames=request.num_frames,
                    num_inference_steps=request.num_inference_steps,
                    guidance_scale=request.guidance_scale,
                    seed=request.seed,
                    variant=name,
                ),
                vm.transformer,
            )
            warm_up = replace(timed, num_inference_steps=1, output_type="np" if i == 0 else "latent")
            with _Stages(vm.transformer, report, cancel) as stages, warnings.catch_warnings():
                # "untrained attention parameters": the column already says "converted, not fine-tuned"
                warnings.simplefilter("ignore", UserWarning)
                # spans of the variant's work by denoising steps: the warm-up is one step, each repeat all of them
                work = 1 + request.repeats * request.num_inference_steps
                stages.start(f"{name}: warm-up (not timed)", 1, request.guidance_scale, i == 0, (0, 1 / work))
                generate(models.components, warm_up, transformer=vm.transformer, show_progress=False)
                for r in range(request.repeats):
                    label = name if request.repeats == 1 else f"{name} (repeat {r + 1}/{request.repeats})"
                    span = (
                        (1 + r * request.num_inference_steps) / work,
                        (1 + (r + 1) * request.num_inference_steps) / work,
                    )
                    stages.start(label, request.num_inference_steps, request.guidance_scale, True, span)
                    out = generate(models.components, timed, transformer=vm.transformer, show_progress=False)
                    run.timings.append(out.timing)
            stages.check()
            report(f"{name}: writing video", 1.0)
            comment = f"{name} | seed {request.seed} | {request.prompt}"
            if models.random_note:
                comment = f"{models.random_note} | {comment}"
            run.video = write_mp4(run_dir / f"{name}.mp4", out.frames, fps=fps, comment=comment)
            frames = np.asarray(out.frames)
            if name == "flash":
                reference = frames
            elif reference is not None:
                run.psnr, run.ssim = quality.psnr(frames, reference), quality.ssim(frames, reference)
            if models.judge is not None:
                run.attributes = models.judge(frames, request.prompt)
        except RunCancelled:
            result.stopped = True
            yield snapshot()
            return
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others' results
            run.error = _error_text(e, models, request)
            run.timings = []
            if models.device.type == "cuda":
                torch.cuda.empty_cache()  # give the next variant (and request) the memory back
        result.runs.append(run)
        yield snapshot()


def run_compare(models: AppModels, request: CompareRequest, out_root: Path, **kwargs) -> CompareResult:
    """:func:`iter_compare` to the end: the final result."""
    results = list(iter_compare(models, request, out_root, **kwargs))
    return results[-1]


# ---- presenting a result ------------------------------------------------------------------------------


def _peak(t: Timing) -> str:
    return "n/a (CPU)" if t.peak_memory_bytes is None else f"{t.peak_memory_bytes / 2**30:.2f} GiB"


def attention_share(t: Timing) -> float:
    """Fraction of denoising time spent inside self-attention."""
    return t.self_attention / t.denoising if t.denoising > 0 else 0.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _speedup(x: float | None, noise: bool) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" + (" (noise)" if noise else "")


def quality_text(run: VariantRun) -> str:
    parts = []
    if run.psnr is not None:
        parts.append("PSNR identical" if math.isinf(run.psnr) else f"PSNR {run.psnr:.1f} dB")
        parts.append(f"SSIM {run.ssim:.3f} vs flash")
    if run.attributes is not None:
        parts.append(f"attributes {run.attributes[0]}/{run.attributes[1]}")
    return ", ".join(parts)


def variant_markdown(run: VariantRun, result: CompareResult | None = None) -> str:
    """The block under a variant's video: speed, quality against flash, where the time went."""
    head = f"### {run.variant}\n_{run.note}_\n\n"
    if run.error:
        return head + f"> **⛔ {run.variant} failed:** {run.error}"
    t, s = run.timing, run.steps
    lines = [f"- denoising step: **{_ms(s.median)}** median, ±{s.relative:.0%} ({s.n} steps)"]
    if result is not None and run.variant != "flash":
        den, e2e, noise = result.speedups(run)
        if den is not None:
            lines.append(
                f"- vs flash: **{_speedup(den, noise)}** denoising, {_speedup(e2e, noise)} end-to-end"
                + (" · _within the timing noise_" if noise else "")
            )
    q = quality_text(run)
    if q:
        lines.append(f"- quality: **{q}**")
    lines += [
        f"- end-to-end: {run.stage('total').median:.2f} s = text encoding {run.stage('text_encoding').median:.2f} s"
        f" + denoising {run.stage('denoising').median:.2f} s + VAE decoding {run.stage('vae_decode').median:.2f} s",
        f"- self-attention: {attention_share(t):.0%} of denoising; peak memory: {_peak(t)}",
        f"- tokens: {t.num_tokens:,}; layout: {t.layout}",
    ]
    return head + "\n".join(lines)


TABLE_HEADERS = [  # speed and quality first: what a person reads at a glance
    "variant",
    "tokens",
    "M",
    "step ms (median)",
    "step spread",
    "denoising speedup",
    "end-to-end s",
    "end-to-end speedup",
    "PSNR dB vs flash",
    "SSIM vs flash",
    "attributes",
    "text encoding s",
    "VAE decoding s",
    "self-attention share",
    "weights",
    "peak memory",
    "softmax backend",
]


def table_rows(result: CompareResult) -> list[list]:
    """One row per finished variant (failed ones say why); speedups are flash's median over the variant's."""
    rows = []
    for r in result.runs:
        if r.error:
            rows.append([r.variant] + [""] * (len(TABLE_HEADERS) - 2) + [f"error: {r.error}"])
            continue
        t, s = r.timing, r.steps
        den, e2e, noise = result.speedups(r)
        psnr = "" if r.psnr is None else ("inf" if math.isinf(r.psnr) else round(r.psnr, 2))
        rows.append(
            [
                r.variant,
                t.num_tokens,
                "-" if t.num_blocks is None else t.num_blocks,
                round(s.median * 1e3, 2),
                f"±{s.relative:.0%} (n={s.n})",
                _speedup(den, noise),
                round(r.stage("total").median, 3),
                _speedup(e2e, noise),
                psnr,
                "" if r.ssim is None else round(r.ssim, 4),
                "" if r.attributes is None else f"{r.attributes[0]}/{r.attributes[1]}",
                round(r.stage("text_encoding").median, 3),
                round(r.stage("vae_decode").median, 3),
                f"{attention_share(t):.0%}",
                r.kind,
                _peak(t),
                t.softmax_backend or "-",
            ]
        )
    return rows


def noise_warning(result: CompareResult) -> str | None:
    """A warning when the step times vary too much for the speedups to mean anything, else None."""
    timed = [r for r in result.runs if r.timings]
    noisy = [r.variant for r in timed if r.steps.relative > NOISY]
    within = [r.variant for r in timed if r.variant != "flash" and result.speedups(r)[2]]
    if not noisy and not within:
        return None
    parts = []
    if noisy:
        parts.append(f"the denoising steps of {', '.join(noisy)} vary by more than ±{NOISY:.0%}")
    if within:
        parts.append(f"the speedups of {', '.join(within)} are within the timing noise (marked 'noise')")
    return (
        "⚠ **Timings are not reliable here:** "
        + "; ".join(parts)
        + ". The machine is shared or busy: raise **Repeats**, use more steps, or run on a quiet machine."
    )


def summary_markdown(result: CompareResult) -> str:
    req = result.request
    tokens = next((r.timing.num_tokens for r in result.runs if r.timing), None)
    lines = [
        f"**Device:** {result.device} · **softmax backend that ran:** {result.softmax_backend}",
        f"**Request:** {req.num_frames} frames at {req.height}x{req.width}"
        + (f" ({tokens:,} tokens)" if tokens else "")
        + f", {req.num_inference_steps} steps, guidance {req.guidance_scale:g}, **seed used: {req.seed}** "
        "(same noise for every variant)",
        f"**Timing:** each variant warmed up once (not counted), then {req.repeats} timed run(s); step times are "
        "the median over every denoising step, ± half the interquartile range. Speedups are flash's median over "
        "the variant's: per denoising step, and end to end (text encoding + denoising + VAE decoding). "
        "PSNR and SSIM compare each video with flash's (same prompt and seed).",
    ]
    warning = noise_warning(result)
    if warning:
        lines.append(warning)
    failed = [r.variant for r in result.runs if r.error]
    if failed:
        lines.append(f"**Failed:** {', '.join(failed)} (see their columns); the app is still serving.")
    if result.stopped:
        done = [r.variant for r in result.runs]
        lines.append(f"**Stopped** by the user after {', '.join(done) or 'no variant'}.")
    if result.random_note:
        lines.append(f"**{result.random_note}.**")
    return "\n\n".join(lines)


def speedup_figure(result: CompareResult):
    """Median denoising-step latency by variant with interquartile error bars, each bar labelled with its
    speedup over flash."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in result.runs if r.timings]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    names = [r.variant for r in done]
    stats = [r.steps for r in done]
    med = [s.median * 1e3 for s in stats]
    err = [[(s.median - s.low) * 1e3 for s in stats], [(s.high - s.median) * 1e3 for s in stats]]
    attn = [s.median * attention_share(r.timing) * 1e3 for r, s in zip(done, stats, strict=True)]
    ax.bar(names, med, color="#4c78a8", label="denoising step (median, bars: interquartile range)")
    ax.errorbar(names, med, yerr=err, fmt="none", ecolor="black", capsize=6, lw=1.2)
    ax.bar(names, attn, color="#f58518", width=0.5, label="of which self-attention")
    for x, (r, s) in enumerate(zip(done, stats, strict=True)):
        den, _, noise = result.speedups(r)
        if den is not None:
            ax.annotate(
                _speedup(den, noise),
                (x, s.high * 1e3),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
            )
    tokens = done[0].timing.num_tokens if done else 0
    ax.set(ylabel="ms per denoising step", title=f"Denoising step latency at {tokens:,} tokens (label: vs flash)")
    ax.title.set_fontsize(10)
    ax.margins(y=0.2)
    # below the axes: a legend inside would cover a bar
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    plt.close(fig)  # gradio renders the figure object; keep pyplot's registry from growing per request
    return fig

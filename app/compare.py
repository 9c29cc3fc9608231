"""The Compare tab's logic: one prompt and seed through several self-attention variants, timed and
measured against flash.

Plain functions over :mod:`pipelines`' public API (``generate``, ``write_mp4``, ``Timing``, ``spread``);
the UI calls :func:`iter_compare` (one snapshot per finished variant) and shows what it yields. ``generate``
is called in one place, :func:`_generate`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.outputs import replace_dir
from common.timing import Spread, Timing, device_name, spread
from common.video import to_uint8, write_mp4
from pipelines import VARIANTS, GenerationRequest, model_request
from pipelines.attention import HYBRID, LINEAR, MHLA, MHLA_VARIANTS, SOFTMAX
from pipelines.caching import cached
from pipelines.pipeline import generate

from . import inputs, quality
from .interleave import NOISY, PairedSpeedup, Turns, paired_speedup
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


def preset_key(preset: tuple[int, int, int]) -> str:
    return "x".join(map(str, preset))


def preset_label(models: AppModels, preset: tuple[int, int, int]) -> str:
    """E.g. ``17 frames, 128x160: 1,600 tokens (5x16x20), M=40``: the tokens and the M that a run of this
    preset gets with the loaded model (its patch, and the MHLA layout generate() uses, shrunk to fit)."""
    frames, height, width = preset
    grid = models.grid(height, width, frames)
    ms = {v: models.num_blocks(grid, v) for v in MHLA_VARIANTS}
    m = str(ms[MHLA]) if len(set(ms.values())) == 1 else ", ".join(f"{n} ({v})" for v, n in ms.items())
    return f"{frames} frames, {height}x{width}: {math.prod(grid):,} tokens ({'x'.join(map(str, grid))}), M={m}"


def preset_tokens(models: AppModels, preset: tuple[int, int, int]) -> int:
    return math.prod(models.grid(preset[1], preset[2], preset[0]))


def preset_choices(models: AppModels, max_tokens: int | None = None) -> list[tuple[str, str]]:
    """``(label, key)`` of the presets this device accepts (at most ``max_tokens`` tokens)."""
    return [
        (preset_label(models, p), preset_key(p))
        for p in PRESETS
        if models.fits(p[1], p[2]) and (max_tokens is None or preset_tokens(models, p) <= max_tokens)
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
    unknown_words: list[str] = field(default_factory=list)  # words of the prompt the model does not know
    image: Any = None  # the first frame (a PIL image) for a model that takes one; never stored with a result

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
    image=None,
    upload_dirs: list[Path] | None = None,
) -> CompareRequest:
    """Validates everything the page sends before any model work; ``ValueError`` names the bad value.
    Out-of-range values are refused, never clamped or rounded. ``image``: the uploaded first frame (gradio's
    file data, checked to lie in ``upload_dirs``, or a PIL image), required by an image-to-video model and
    refused by a model that takes none."""
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
    if not models.fits(preset[1], preset[2]):
        raise ValueError(
            f"preset {preset_key(preset)} does not divide into this model's tokens (height and width must be "
            f"multiples of {models.vae_stride[1] * models.patch[1]}); pick another size"
        )
    first_frame = inputs.image("image", image, upload_dirs or [])
    if models.needs_image and first_frame is None:
        raise ValueError("this model makes a video from an image: upload the first frame (PNG, JPEG or WebP)")
    if first_frame is not None and not models.takes_image:
        raise ValueError("this model is text-to-video: it takes no image (remove the upload)")
    tokens = preset_tokens(models, preset)
    if max_tokens is not None and tokens > max_tokens:
        raise ValueError(
            f"preset {preset_label(models, preset)} is too large for this device ({device_name(models.device)}): "
            f"{tokens:,} tokens, this app allows at most {max_tokens:,} here (start it with --max-tokens to change)"
        )
    return CompareRequest(
        unknown_words=unknown_words(models, prompt),
        prompt=prompt.strip(),
        negative_prompt=(negative_prompt or "").strip(),
        seed=seed,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        preset=preset,
        variants=[v for v in VARIANTS if v in chosen],  # canonical order (flash first), no duplicates
        repeats=repeats,
        image=first_frame,
    )


def unknown_words(models: AppModels, prompt: str) -> list[str]:
    """The words of ``prompt`` that the model's tokenizer reads as its unknown token (each once, in order):
    the built-in model knows only the few dozen words of its world; a large model's tokenizer knows nearly
    every word, and this is then empty."""
    tokenizer = models.components.tokenizer
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not isinstance(prompt, str):
        return []
    out: list[str] = []
    for word in re.findall(r"\w+", prompt.lower()):
        if word not in out and unk in tokenizer(word, add_special_tokens=False).input_ids:
            out.append(word)
    return out


def vocabulary_note(models: AppModels, words: list[str]) -> str:
    """The warning for a prompt with words outside the model's vocabulary ('' when there are none)."""
    if not words:
        return ""
    what = (
        "the built-in model knows only its world's words (colours, shapes, sizes, motions, backgrounds)"
        if models.builtin
        else "the model's tokenizer does not know them"
    )
    return f"⚠ Not in the model's vocabulary: **{', '.join(words)}**; {what}, so these are ignored."


# ---- a link that reproduces a request --------------------------------------------------------------------
PERMALINK_KEYS = ("prompt", "seed", "steps", "variants", "guidance", "preset")


def permalink_query(request: CompareRequest) -> str:
    """The URL query that restores ``request`` on the page: ``?prompt=...&seed=0&steps=20&variants=flash,mhla``
    (guidance and preset too)."""
    from urllib.parse import urlencode

    return "?" + urlencode(
        {
            "prompt": request.prompt,
            "seed": request.seed,
            "steps": request.num_inference_steps,
            "variants": ",".join(request.variants),
            "guidance": f"{request.guidance_scale:g}",
            "preset": preset_key(request.preset),
        }
    )


def request_key(source: str, prompt: str, seed: int, steps: int, guidance: float, preset: str, variants) -> str:
    """The hash a finished run is kept under on this server, so that its permalink opens with its results:
    the model (``source``) and every field the link carries (a run with a negative prompt, a first frame or
    repeats is not kept: its link could not name it)."""
    import hashlib

    fields = [source, prompt, int(seed), int(steps), float(guidance), preset, list(variants)]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:24]


def parse_permalink(params) -> tuple[dict, list[str]]:
    """The page's fields from a URL query (a mapping of str to str, from the browser: not trusted):
    ``({"prompt": ..., "seed": int, "steps": int, "variants": [...], "guidance": float, "preset": key},
    problems)``; a bad value is left out and named in ``problems``, never passed on."""
    out: dict = {}
    problems = []
    get = {k: params.get(k) for k in PERMALINK_KEYS if isinstance(params.get(k), str)}
    if "prompt" in get:
        if len(get["prompt"]) <= MAX_PROMPT_CHARS and get["prompt"].strip():
            out["prompt"] = get["prompt"]
        else:
            problems.append("prompt")
    for key, lo, hi in (("seed", 0, 2**63 - 1), ("steps", 1, MAX_STEPS)):
        if key in get:
            try:
                out[key] = _as_int(key, int(get[key]), lo, hi)
            except ValueError:
                problems.append(key)
    if "guidance" in get:
        try:
            g = float(get["guidance"])
            if not (math.isfinite(g) and 0 <= g <= MAX_GUIDANCE):
                raise ValueError(g)
            out["guidance"] = g
        except ValueError:
            problems.append("guidance")
    if "variants" in get:
        chosen = [v for v in get["variants"].split(",") if v]
        if chosen and all(v in VARIANTS for v in chosen):
            out["variants"] = [v for v in VARIANTS if v in chosen]
        else:
            problems.append("variants")
    if "preset" in get:
        try:
            out["preset"] = preset_key(parse_preset(get["preset"]))
        except ValueError:
            problems.append("preset")
    return out, problems


@dataclass
class VariantRun:
    """One variant's outcome: a video, its timings (one per repeat), its verdict against the prompt and its
    agreement with flash, or the error that stopped it."""

    variant: str
    note: str
    kind: str = ""
    video: Path | None = None
    timings: list[Timing] = field(default_factory=list)
    error: str | None = None
    psnr: float | None = None  # dB against flash's video (None: flash not run, or this is flash)
    ssim: float | None = None
    # the model's analyser (AppModels.judge): {attribute: shown?} for the attributes the prompt names
    attributes: dict[str, bool] | None = None
    degenerate: str | None = None  # "blank", "frozen", "saturated" (quality.degenerate), None: a video
    judged: bool = False  # the model's analyser looked at it (attributes None then: the prompt names nothing it knows)

    @property
    def timing(self) -> Timing | None:
        return self.timings[-1] if self.timings else None

    @property
    def steps(self) -> Spread:
        """Denoising step seconds over every step of every repeat."""
        return spread(s for t in self.timings for s in t.steps)

    @property
    def paired_steps(self) -> list[float]:
        """The steps that enter the paired speedups: each run's first step is a warm-up (new shapes, cold
        caches) and is left out, unless it is the only one."""
        return [s for t in self.timings for s in t.warm_steps]

    def stage(self, name: str) -> Spread:
        """A stage's seconds over the repeats: ``total``, ``text_encoding``, ``denoising``, ``vae_decode``,
        ``self_attention``."""
        return spread(getattr(t, name) for t in self.timings)

    @property
    def verdict(self) -> str:
        """What the video is worth at a glance: the degenerate label, else the analyser's verdict per attribute."""
        if self.degenerate:
            return f"⚠ {self.degenerate} video"
        if self.judged and self.attributes is None:
            return quality.NOT_JUDGED
        return quality.verdict_text(self.attributes)


@dataclass
class CompareResult:
    request: CompareRequest
    runs: list[VariantRun]
    device: str
    random_note: str | None = None
    notes: list[str] = field(default_factory=list)
    stopped: bool = False  # the user pressed Stop: ``runs`` holds the variants that finished
    interleaved: bool = True  # variants took turns step by step (False: one after another, shared transformer)
    load: str = ""  # the machine's load when the run started, e.g. "load 1.9 on 2 cores"
    side_by_side: Path | None = None  # every variant's video in one labelled mp4
    measured: str = ""  # for a stored result: where and when it was measured
    speed: str = ""  # --compile / --cache as the page words them (app.models.speed_note); '' when neither is on

    def run(self, variant: str) -> VariantRun | None:
        return next((r for r in self.runs if r.variant == variant), None)

    @property
    def softmax_backend(self) -> str:
        names = sorted({r.timing.softmax_backend for r in self.runs if r.timing and r.timing.softmax_backend})
        return ", ".join(names) or "- (no softmax layer ran)"

    def speedups(self, run: VariantRun) -> tuple[PairedSpeedup | None, float | None]:
        """``(denoising, end_to_end)`` of ``run`` over flash: per denoising step from the paired steps
        (:func:`app.interleave.paired_speedup`), and flash's median end-to-end time over the variant's."""
        flash = self.run(SOFTMAX)
        if not (flash and flash.timings and run.timings) or run is flash:
            return None, None
        a, b = flash.paired_steps, run.paired_steps
        n = min(len(a), len(b))
        den = paired_speedup(a[:n], b[:n]) if n else None
        return den, flash.stage("total").median / run.stage("total").median

    def ranking(self) -> list[VariantRun]:
        """Finished variants, best against the prompt first: by the share of the prompt's attributes shown;
        a degenerate video always last (ties keep the variants' order)."""
        done = [r for r in self.runs if not r.error]

        def key(r: VariantRun):
            shown = sum(r.attributes.values()) / len(r.attributes) if r.attributes else 0.0
            return (r.degenerate is not None, -shown)

        return sorted(done, key=key)


def machine_load() -> str:
    """The 1-minute load average against the cores, e.g. ``load 1.9 on 2 cores`` ('' where unknown)."""
    try:
        return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except (OSError, AttributeError):
        return ""


class RunCancelled(Exception):
    """The user pressed Stop: the run ends before the next transformer call."""


class _StepClock:
    """Times one variant's denoising steps from the transformer's calls, and takes turns with the other
    variants between steps (:class:`app.interleave.Turns`).

    Forward hooks on the transformer (public torch API): generate() runs diffusers' pipeline, which calls the
    transformer once per step, twice with classifier-free guidance. A step is timed from its first call's
    start to its last call's end, so waiting for the turn is never counted. Hooks count only calls from the
    thread that made them (variants sharing one transformer run one after another, each in its thread).
    """

    def __init__(self, name, transformer, turns: Turns, per_step: int, interleaved: bool, cancel, on_step):
        self.name, self.transformer, self.turns = name, transformer, turns
        self.per_step, self.interleaved, self.cancel, self.on_step = per_step, interleaved, cancel, on_step
        self.thread = threading.get_ident()
        self.begin()

    def begin(self):
        self.calls, self.steps, self.first, self.last, self._t = 0, [], 0.0, 0.0, 0.0

    def __enter__(self):
        self.thread = threading.get_ident()
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

    def _before(self, _module, _args):
        if threading.get_ident() != self.thread:
            return
        if self.calls % self.per_step == 0:
            if self.calls and self.interleaved:  # a step is done: the next variant's turn
                self.turns.done(self.name)
                self.turns.wait(self.name)
            self.check()
            self._t = time.perf_counter()
            if not self.calls:
                self.first = self._t
            self.on_step(self.name, len(self.steps), False)
        else:
            self.check()

    def _after(self, _module, _args, _out):
        if threading.get_ident() != self.thread:
            return
        self.calls += 1
        if self.calls % self.per_step == 0:
            self.last = time.perf_counter()
            self.steps.append(self.last - self._t)
            self.on_step(self.name, len(self.steps), True)

    def timing(self, t: Timing, start: float, end: float) -> Timing:
        """generate()'s timing with the stages as this variant's own compute: its steps as timed here, text
        encoding up to its first step, VAE decoding after its last (no time spent waiting for its turn)."""
        t = replace(t, steps=list(self.steps))
        t.denoising = sum(self.steps)
        t.text_encoding = self.first - start
        t.vae_decode = end - self.last
        t.total = t.text_encoding + t.denoising + t.vae_decode
        return t


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


def _generate(models: AppModels, request: CompareRequest, variant: str, steps: int, output_type: str = "np"):
    """The app's one call of :func:`pipelines.pipeline.generate`: the page's request as a
    :class:`~pipelines.GenerationRequest`, checked once against the model (:func:`pipelines.model_request`)."""
    vm = models.variants[variant]
    checked = model_request(
        models.components,
        GenerationRequest(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            height=request.height,
            width=request.width,
            num_frames=request.num_frames,
            num_inference_steps=steps,
            guidance_scale=request.guidance_scale,
            seed=request.seed,
            variant=variant,
            output_type=output_type,
            image=request.image,
        ),
        vm.transformer,
    )
    if models.compile != "none":  # as the CLI's --compile: lazily, the first call compiles (once per variant)
        from mhla.compiled import compile_transformer

        compile_transformer(vm.transformer, models.compile)
    with cached(vm.transformer, models.cache, steps):  # as the CLI's --cache; nothing when None
        return generate(models.components, checked, transformer=vm.transformer, show_progress=False)


# "untrained attention parameters": each converted variant's column already says "converted, not fine-tuned"
_UNTRAINED = r"variant '.*' added freshly initialised"


def warm_up(models: AppModels, decodes: list[tuple[float, int]] | None = None) -> float:
    """One short untimed generation per variant at the model's default size (one step; the first also
    decodes, warming the shared text encoder and VAE), done once when the app starts so that no request pays
    for it. Returns the seconds it took; ``decodes`` gets ``(seconds, pixels)`` of its video decode (the
    page's first estimate of a decode's length)."""
    d = models.components.defaults
    preset = (d["num_frames"], d["height"], d["width"])
    request = CompareRequest(models.example_prompt, "", 0, 1, float(d["guidance_scale"]), preset, list(VARIANTS))
    if models.needs_image:  # an image-to-video model warms up on a plain grey first frame
        from PIL import Image

        request.image = Image.new("RGB", (preset[2], preset[1]), (128, 128, 128))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNTRAINED, category=UserWarning)
        for i, name in enumerate(VARIANTS):
            out = _generate(models, request, name, 1, "np" if i == 0 else "latent")
            if i == 0 and decodes is not None and out.timing.vae_decode > 0:
                decodes.append((out.timing.vae_decode, preset[0] * preset[1] * preset[2]))
    return time.perf_counter() - start


class Warmup:
    """:func:`warm_up` in a background thread, so the page answers at once (a 41 s warm-up before the server
    starts would make the page take 68 s). Requests wait for it (:meth:`wait`); the page says it is going.
    A warm-up that fails is logged and counts as done: requests then pay the cold caches, nothing worse.

    :meth:`loading` makes one that first loads the models (``load()``), so that the page can be served from
    the model's files (:class:`app.models.ModelFacts`) before diffusers is even imported; a load that fails
    is logged, named on the page, and every run is refused with it."""

    def __init__(self, models: AppModels | None = None, load: Callable[[], AppModels] | None = None):
        if (models is None) == (load is None):
            raise ValueError("Warmup needs the loaded models or a function that loads them, not both")
        self.models = models
        self._load = load
        self._loaded = threading.Event()
        if models is not None:
            self._loaded.set()
        self._done = threading.Event()
        self.started: float | None = None
        self.load_seconds: float | None = None  # how long loading took, once loaded (None: nothing to load)
        self.error: str | None = None  # why loading failed
        self.seconds: float | None = None  # how long the warm-up took, once done
        self.decodes: list[tuple[float, int]] = []  # (seconds, pixels) of its video decode

    @classmethod
    def loading(cls, load: Callable[[], AppModels]) -> Warmup:
        return cls(load=load)

    def start(self) -> Warmup:
        self.started = time.monotonic()
        threading.Thread(target=self._run, name="warm-up", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            if self._load is not None:
                try:
                    self.models = self._load()
                    self.load_seconds = time.monotonic() - (self.started or 0.0)
                    log.info("models loaded: %.1f s (in the background)", self.load_seconds)
                except Exception as e:  # noqa: BLE001 - named on the page; runs are refused with it
                    log.exception("loading the models failed")
                    self.error = f"{type(e).__name__}: {_without_paths(str(e))[:300]}"
                    return
                finally:
                    self._loaded.set()
            assert self.models is not None
            self.seconds = warm_up(self.models, self.decodes)
            log.info("warm-up: %.1f s (in the background)", self.seconds)
        except Exception:  # noqa: BLE001 - a failed warm-up only means cold caches
            log.exception("warm-up failed; requests pay the cold caches")
        finally:
            self._done.set()

    @property
    def loaded(self) -> bool:
        """Loading is over (the models are here, or :attr:`error` says why not)."""
        return self._loaded.is_set()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def note(self) -> str:
        """The page's line while it loads or warms up ('' once done; the error when loading failed)."""
        if self.error is not None:
            return (
                f"✖ **The model could not be loaded** ({self.error}); runs are refused. The details are in the "
                "server's log."
            )
        if self.done:
            return ""
        since = 0.0 if self.started is None else time.monotonic() - self.started
        if not self.loaded:
            return (
                f"**Loading the model** in the background ({since:.0f} s so far; a warm-up follows). The page "
                "works now: pick an example, write a prompt; Generate waits for the model."
            )
        return (
            f"**Warming up** in the background ({since:.0f} s so far: one step per variant and one decode, so "
            "that no run pays for cold caches). The page works now; Generate waits for the warm-up to finish."
        )


def side_by_side_frames(videos: dict[str, np.ndarray], label_height: int = 16) -> np.ndarray:
    """Every variant's frames ``(T, H, W, 3)`` in one row, each under a strip with its name: ``(T, H +
    label_height, W * n + 2 * (n - 1), 3)`` uint8 (2-pixel grey gaps between videos)."""
    from PIL import Image, ImageDraw

    tiles = []
    for name, frames in videos.items():
        x = to_uint8(frames)
        strip = Image.new("RGB", (x.shape[2], label_height), (24, 24, 24))
        ImageDraw.Draw(strip).text((4, 2), name, fill=VARIANT_COLOURS.get(name, "#ffffff"))
        label = np.broadcast_to(np.asarray(strip), (x.shape[0], label_height, x.shape[2], 3))
        tiles.append(np.concatenate([label, x], axis=1))
    gap = np.full((*tiles[0].shape[:2], 2, 3), 96, np.uint8)
    row = [tiles[0]]
    for t in tiles[1:]:
        row += [gap, t]
    return np.concatenate(row, axis=2)


def iter_compare(
    models: AppModels,
    request: CompareRequest,
    out_root: Path,
    progress: Callable[[str, float], None] | None = None,
    cancel: threading.Event | None = None,
    fps: int = 16,
    variant_steps: Callable[[dict[str, tuple[int, int]]], None] | None = None,
) -> Iterator[CompareResult]:
    """Runs the chosen variants with the same seed and yields a snapshot of the result each time one is
    done (the page fills its column at once); writes one mp4 per variant and one side by side.

    The variants take turns, one denoising step each, round-robin (:class:`app.interleave.Turns`), so a
    change of machine load hits all of them alike and step ``k`` of each variant pairs with flash's step
    ``k`` for the speedup's interval. Variants that share one transformer (converted in place at each run)
    cannot interleave: they run one after another (``CompareResult.interleaved`` is then False). No warm-up
    generation per request (:func:`warm_up` runs once when the app starts); each run's first step is left
    out of the paired speedups instead. ``progress(text, fraction)`` gets readable stages, and
    ``variant_steps({variant: (steps done, steps in all)})`` each variant's own count at the same moments (the
    page's bar per column while they take turns). Setting ``cancel`` stops the run before the next transformer call; the last snapshot then has ``stopped`` set.
    A variant that fails (out of memory, anything raised inside generation) gets its error in its
    :class:`VariantRun`; the others run.
    """
    run_dir = new_run_dir(out_root)
    names = list(request.variants)
    interleaved = len({id(models.variants[n].transformer) for n in names}) == len(names)
    result = CompareResult(
        request,
        [],
        device_name(models.device),
        models.random_note,
        list(models.notes),
        interleaved=interleaved,
        load=machine_load(),
        speed=models.speed,
    )
    turns = Turns(names)
    events: queue.Queue = queue.Queue()
    per_step = 2 if request.guidance_scale > 1.0 else 1  # WanPipeline: conditional and unconditional calls
    steps = request.num_inference_steps
    total = len(names) * request.repeats * steps
    done = dict.fromkeys(names, 0)  # steps finished per variant (over repeats)
    videos: dict[str, np.ndarray] = {}  # uint8 frames by variant: PSNR/SSIM reference, side-by-side video

    def report(text: str) -> None:
        if variant_steps is not None:  # first: the status line that follows shows these counts
            variant_steps({n: (done[n], request.repeats * steps) for n in names})
        if progress is not None:
            progress(text, sum(done.values()) / total)

    def on_step(name: str, k: int, finished: bool, repeat: int = 0) -> None:
        if finished:
            done[name] += 1
            if k == steps:
                report(f"{name}: decoding video")
            return
        where = f" · round {k + 1}/{steps}" if interleaved else f" · variant {names.index(name) + 1}/{len(names)}"
        again = f" (repeat {repeat + 1}/{request.repeats})" if request.repeats > 1 else ""
        report(f"{name}{again}: denoising step {k + 1}/{steps}{where}")

    def work(name: str) -> None:
        vm = models.variants[name]
        run = VariantRun(name, vm.note, vm.kind)
        outcome = "done"
        try:
            turns.wait(name)
            repeat = [0]
            clock = _StepClock(
                name,
                vm.transformer,
                turns,
                per_step,
                interleaved,
                cancel,
                lambda n, k, f: on_step(n, k, f, repeat[0]),
            )
            with clock:
                for r in range(request.repeats):
                    clock.check()
                    repeat[0] = r
                    clock.begin()
                    start = time.perf_counter()
                    out = _generate(models, request, name, steps)
                    run.timings.append(clock.timing(out.timing, start, time.perf_counter()))
            clock.check()
            report(f"{name}: writing video")
            frames = to_uint8(out.frames)
            comment = f"{name} | seed {request.seed} | {request.prompt}"
            if models.random_note:
                comment = f"{models.random_note} | {comment}"
            run.video = write_mp4(run_dir / f"{name}.mp4", frames, fps=fps, comment=comment)
            run.degenerate = quality.degenerate(frames)
            if models.judge is not None:
                run.attributes = models.judge(frames, request.prompt)
                run.judged = True
            videos[name] = frames
            # here, in this variant's turn, not in the consumer's thread: there it would slow the next
            # variant's VAE decode (measured: the later a variant decoded, the slower)
            if name != SOFTMAX and SOFTMAX in videos:
                run.psnr, run.ssim = quality.psnr(frames, videos[SOFTMAX]), quality.ssim(frames, videos[SOFTMAX])
        except RunCancelled:
            outcome = "cancelled"
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others' results
            run.error = _error_text(e, models, request)
            run.timings = []
            if models.device.type == "cuda":
                torch.cuda.empty_cache()  # give the next variant (and request) the memory back
        finally:
            turns.leave(name)
            events.put((outcome, run))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNTRAINED, category=UserWarning)
        threads = [threading.Thread(target=work, args=(n,), name=f"compare-{n}", daemon=True) for n in names]
        for t in threads:
            t.start()
        try:
            for _ in names:
                outcome, run = events.get()
                if outcome == "cancelled":
                    result.stopped = True
                    continue
                result.runs = sorted([*result.runs, run], key=lambda r: names.index(r.variant))
                if not result.stopped:
                    _agreement(result, videos)
                    yield replace(result, runs=list(result.runs))
        finally:
            if cancel is not None and any(t.is_alive() for t in threads):
                cancel.set()  # the consumer went away: end the variants' threads too
            for t in threads:
                t.join()
    _agreement(result, videos)
    if len(videos) > 1 and not result.stopped:
        report("writing the side-by-side video")
        result.side_by_side = write_mp4(
            run_dir / "side_by_side.mp4",
            side_by_side_frames({n: videos[n] for n in names if n in videos}),
            fps=fps,
            comment=f"{', '.join(videos)} | seed {request.seed} | {request.prompt}",
        )
    yield replace(result, runs=list(result.runs))


def _agreement(result: CompareResult, videos: dict[str, np.ndarray]) -> None:
    """PSNR and SSIM of each finished video against flash's, where both exist and it is not yet computed."""
    reference = videos.get(SOFTMAX)
    if reference is None:
        return
    for run in result.runs:
        if run.variant != SOFTMAX and run.psnr is None and run.variant in videos:
            run.psnr = quality.psnr(videos[run.variant], reference)
            run.ssim = quality.ssim(videos[run.variant], reference)


def run_compare(models: AppModels, request: CompareRequest, out_root: Path, **kwargs) -> CompareResult:
    """:func:`iter_compare` to the end: the final result."""
    results = list(iter_compare(models, request, out_root, **kwargs))
    return results[-1]


# ---- a result stored and read back (the example prompts' precomputed results) --------------------------


def result_to_dict(result: CompareResult) -> dict:
    """A JSON-ready record of ``result``; videos by file name (they lie beside the record)."""
    req = result.request
    return {
        "request": {**{k: v for k, v in req.__dict__.items() if k != "image"}, "preset": list(req.preset)},
        "device": result.device,
        "random_note": result.random_note,
        "notes": result.notes,
        "interleaved": result.interleaved,
        "load": result.load,
        "measured": result.measured,
        "speed": result.speed,
        "side_by_side": result.side_by_side.name if result.side_by_side else None,
        "runs": [
            {
                **{k: v for k, v in r.__dict__.items() if k not in ("video", "timings")},
                "video": r.video.name if r.video else None,
                "timings": [t.as_dict() for t in r.timings],
            }
            for r in result.runs
        ],
    }


def result_from_dict(record: dict, folder: Path) -> CompareResult:
    """The result :func:`result_to_dict` wrote, its videos looked up in ``folder`` by their bare names."""

    def path(name):
        return None if not name else folder / Path(name).name

    def timing(d: dict) -> Timing:
        return Timing.from_dict(d)

    req = dict(record["request"])
    request = CompareRequest(**{**req, "preset": tuple(req["preset"])})
    runs = [
        VariantRun(**{**r, "video": path(r["video"]), "timings": [timing(t) for t in r["timings"]]})
        for r in record["runs"]
    ]
    return CompareResult(
        request,
        runs,
        record["device"],
        record.get("random_note"),
        list(record.get("notes", [])),
        interleaved=record.get("interleaved", True),
        load=record.get("load", ""),
        side_by_side=path(record.get("side_by_side")),
        measured=record.get("measured", ""),
        speed=record.get("speed", ""),
    )


# ---- presenting a result ------------------------------------------------------------------------------

# one colour per variant everywhere: columns, charts (the Benchmark tab's too), the side-by-side labels
# (Tableau 10: distinct for colour-blind readers, readable on light and dark backgrounds)
VARIANT_COLOURS = {SOFTMAX: "#4c78a8", LINEAR: "#f58518", MHLA: "#54a24b", HYBRID: "#e45756"}


def _peak(t: Timing) -> str:
    return "n/a (CPU)" if t.peak_memory_bytes is None else f"{t.peak_memory_bytes / 2**30:.2f} GiB"


def attention_share(t: Timing) -> float:
    """Fraction of denoising time spent inside self-attention."""
    return t.self_attention / t.denoising if t.denoising > 0 else 0.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _speedup(x: PairedSpeedup | None) -> str:
    if x is None:
        return "-"
    return x.text() + (" noisy" if x.noisy else "")


def agreement_text(run: VariantRun) -> str:
    """PSNR and SSIM against flash's video ('' without one)."""
    if run.psnr is None:
        return ""
    psnr = "identical" if math.isinf(run.psnr) else f"{run.psnr:.1f} dB"
    return f"{psnr} / {run.ssim:.3f}"


AGREEMENT_NOTE = (
    "Agreement with flash (PSNR, SSIM) says how close a video is to flash's for the same seed, not whether it "
    "shows the prompt: a blank video can agree well with a dark one."
)


def variant_markdown(run: VariantRun, result: CompareResult | None = None) -> str:
    """The block under a variant's video: what it shows, speed, agreement with flash, where the time went."""
    head = f"### {run.variant}\n_{run.note}_\n\n"
    if run.error:
        return head + f"> **✖ {run.variant} failed:** {run.error}"
    t, s = run.timing, run.steps
    lines = []
    if run.degenerate:
        lines.append(f"- **⚠ degenerate: {run.degenerate} video** (ranked last whatever its agreement with flash)")
    if run.attributes is not None:
        lines.append(
            f"- against the prompt: **{quality.verdict_text(run.attributes)}** "
            f"({quality.attribute_marks(run.attributes)})"
        )
    elif run.judged:
        lines.append(f"- against the prompt: {quality.NOT_JUDGED}")
    lines.append(f"- denoising step: **{_ms(s.median)}** median, ±{s.relative:.0%} ({s.n} steps)")
    if result is not None and run.variant != SOFTMAX:
        den, e2e = result.speedups(run)
        if den is not None:
            lines.append(
                f"- vs flash: **{den.estimate:.2f}x** per denoising step (95% interval "
                f"{den.low:.2f}-{den.high:.2f}, {den.n} paired steps)"
                + (" · _noisy_" if den.noisy else "")
                + (f", {e2e:.2f}x end to end" if e2e is not None else "")
            )
    agreement = agreement_text(run)
    if agreement:
        lines.append(f"- agreement with flash (PSNR / SSIM): {agreement}")
    lines += [
        f"- own time: {run.stage('total').median:.2f} s = text encoding {run.stage('text_encoding').median:.2f} s"
        f" + denoising {run.stage('denoising').median:.2f} s + VAE decoding {run.stage('vae_decode').median:.2f} s",
        f"- self-attention: {attention_share(t):.0%} of denoising; peak memory: {_peak(t)}",
        f"- tokens: {t.num_tokens:,}; layout: {t.layout}",
    ]
    return head + "\n".join(lines)


# the table a person reads at a glance (the page shows fewer of these on a phone); details on demand below
TABLE_HEADERS = [
    "variant",
    "against the prompt",
    "speedup per step vs flash (95% interval)",
    "end-to-end s",
    "end-to-end speedup",
    "agreement with flash (PSNR / SSIM)",
]
DETAIL_HEADERS = [
    "variant",
    "step ms (median)",
    "step spread",
    "paired steps",
    "ratio spread",
    "tokens",
    "M",
    "text encoding s",
    "denoising s",
    "VAE decoding s",
    "self-attention share",
    "weights",
    "peak memory",
    "softmax backend",
]


def table_rows(result: CompareResult) -> list[list]:
    """One row per finished variant, best against the prompt first (failed ones last, saying why)."""
    rows = []
    for r in [*result.ranking(), *(r for r in result.runs if r.error)]:
        if r.error:
            rows.append([r.variant, f"error: {r.error}"] + [""] * (len(TABLE_HEADERS) - 2))
            continue
        den, e2e = result.speedups(r)
        rows.append(
            [
                r.variant,
                r.verdict or "video (this model has no analyser)",
                "reference" if r.variant == SOFTMAX else _speedup(den),
                round(r.stage("total").median, 2),
                "reference" if r.variant == SOFTMAX else ("-" if e2e is None else f"{e2e:.2f}x"),
                agreement_text(r) or ("reference" if r.variant == SOFTMAX else "-"),
            ]
        )
    return rows


def table_markdown(result: CompareResult) -> str:
    """:func:`table_rows` as a Markdown table: a real HTML table on the page, whose less important columns a
    phone's narrow screen hides (end-to-end seconds, agreement with flash)."""
    lines = ["| " + " | ".join(TABLE_HEADERS) + " |", "|" + "---|" * len(TABLE_HEADERS)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in table_rows(result)]
    return "\n".join(lines)


ALL_HEADERS = TABLE_HEADERS + DETAIL_HEADERS[1:]


def detail_rows(result: CompareResult) -> list[list]:
    """Everything measured (:data:`ALL_HEADERS`: the table's columns, then the details), one row per variant,
    in the table's order."""
    rows = []
    compact = {row[0]: row for row in table_rows(result)}
    for r in [*result.ranking(), *(r for r in result.runs if r.error)]:
        if r.error:
            rows.append(compact[r.variant] + [""] * (len(DETAIL_HEADERS) - 1))
            continue
        t, s = r.timing, r.steps
        den, _ = result.speedups(r)
        rows.append(
            compact[r.variant]
            + [
                round(s.median * 1e3, 2),
                f"±{s.relative:.0%} (n={s.n})",
                len(r.paired_steps),
                "-" if den is None else f"±{den.ratio_spread:.0%}",
                t.num_tokens,
                "-" if t.num_blocks is None else t.num_blocks,
                round(r.stage("text_encoding").median, 3),
                round(r.stage("denoising").median, 3),
                round(r.stage("vae_decode").median, 3),
                f"{attention_share(t):.0%}",
                r.kind,
                _peak(t),
                t.softmax_backend or "-",
            ]
        )
    return rows


def noise_warning(result: CompareResult) -> str | None:
    """A warning when a speedup's interval is wider than ±10% (or the variants could not interleave)."""
    noisy = []
    for r in result.runs:
        den, _ = result.speedups(r)
        if den is not None and den.noisy:
            noisy.append(f"{r.variant} (±{den.half_width:.0%})" if den.n > 1 else f"{r.variant} (one pair)")
    parts = []
    if noisy:
        parts.append(f"the 95% intervals of {', '.join(noisy)} are wider than ±{NOISY:.0%}")
    if not result.interleaved and len(result.runs) > 1:
        parts.append(
            "the variants share one transformer (converted in place), so they ran one after another and a change "
            "of machine load between them shows up as a speedup"
        )
    if not parts:
        return None
    return (
        "⚠ **Noisy timings:** "
        + "; ".join(parts)
        + ". Raise **Repeats**, use more steps, or run on a quieter machine"
        + (f" ({result.load})." if result.load else ".")
    )


def headline_markdown(result: CompareResult) -> str:
    """The two lines a person takes away: the speedups with their intervals (flagged when noisy), and which
    video shows the prompt (a degenerate one labelled, never first)."""
    speed = []
    for r in result.runs:
        den, _ = result.speedups(r)
        if den is not None:
            flag = " ⚠ noisy" if den.noisy else ""
            speed.append(f"**{r.variant} {den.estimate:.2f}x**" + (f" ({den.low:.2f}-{den.high:.2f}){flag}"))
    lines = []
    if speed:
        lines.append("### Speedup per denoising step vs flash (95% interval): " + " · ".join(speed))
    ranked = result.ranking()
    if ranked:
        # one line first: which variants drew the prompt, or that none did (a degenerate video never counts)
        summary = quality.summary_line(
            {r.variant: None if r.degenerate else r.attributes for r in ranked}, any(r.judged for r in ranked)
        )
        per = [f"{r.variant}: {r.verdict}" for r in ranked if r.attributes is not None or r.degenerate]
        parts = [summary] if summary else []
        if per:
            parts.append("Against the prompt (best first): " + " · ".join(per))
        if parts:
            lines.append(" ".join(parts))
    return "\n\n".join(lines)


def summary_markdown(result: CompareResult) -> str:
    req = result.request
    tokens = next((r.timing.num_tokens for r in result.runs if r.timing), None)
    lines = []  # the headline and the noise warning are the page's first lines (headline_markdown, noise_warning)
    if result.measured:
        lines.append(f"**Precomputed result** ({result.measured}); press Generate for a fresh run on this machine.")
    how = (
        "the variants took turns, one denoising step each (round-robin), so a change of machine load hits all "
        "alike; each speedup is the median of the paired per-step ratios flash/variant with a distribution-free "
        "95% interval (each run's first step is a warm-up, not counted)"
        if result.interleaved
        else "the variants ran one after another (they share one transformer); speedups pair step k of each run"
    )
    lines += [
        f"**Device:** {result.device}"
        + (f" ({result.load} at the start)" if result.load else "")
        + f" · **softmax backend that ran:** {result.softmax_backend}",
        f"**Request:** {req.num_frames} frames at {req.height}x{req.width}"
        + (f" ({tokens:,} tokens)" if tokens else "")
        + f", {req.num_inference_steps} steps, guidance {req.guidance_scale:g}, **seed used: {req.seed}** "
        f"(same noise for every variant), {req.repeats} timed run(s) per variant",
        f"**Timing:** {how}. End to end is each variant's own time: text encoding + denoising + VAE decoding. "
        + AGREEMENT_NOTE,
    ]
    failed = [r.variant for r in result.runs if r.error]
    if failed:
        lines.append(f"**Failed:** {', '.join(failed)} (see their columns); the app is still serving.")
    if result.stopped:
        done = [r.variant for r in result.runs]
        lines.append(f"**Stopped** by the user after {', '.join(done) or 'no variant'}.")
    if result.random_note:
        lines.append(f"**{result.random_note}.**")
    return "\n\n".join(x for x in lines if x)


# mid grey reads on a white page and on a dark one: the chart has no background of its own
CHART_INK = "#8a8a8a"


def speedup_figure(result: CompareResult):
    """Median denoising-step latency by variant (one colour per variant, interquartile bars), each bar
    labelled with its paired speedup over flash; transparent, with mid-grey ink for light and dark pages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in result.runs if r.timings]
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    fig.patch.set_alpha(0.0)
    ax.set_facecolor("none")
    names = [r.variant for r in done]
    stats = [r.steps for r in done]
    med = [s.median * 1e3 for s in stats]
    err = [[(s.median - s.low) * 1e3 for s in stats], [(s.high - s.median) * 1e3 for s in stats]]
    ax.bar(names, med, color=[VARIANT_COLOURS.get(n, "#888888") for n in names])
    ax.errorbar(names, med, yerr=err, fmt="none", ecolor=CHART_INK, capsize=6, lw=1.2)
    for x, (r, s) in enumerate(zip(done, stats, strict=True)):
        den, _ = result.speedups(r)
        label = SOFTMAX if r.variant == SOFTMAX else (f"{den.estimate:.2f}x" if den else "")
        if den is not None and den.noisy:
            label += "?"
        ax.annotate(
            label, (x, s.high * 1e3), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
            fontsize=12, color=CHART_INK, fontweight="bold",
        )  # fmt: skip
    ax.set_ylabel("ms per denoising step", fontsize=11, color=CHART_INK)
    noisy = any((d := result.speedups(r)[0]) is not None and d.noisy for r in done)
    title = "step latency (median; label: speedup vs flash" + ("; ? = noisy, interval over ±10%)" if noisy else ")")
    ax.set_title(title, fontsize=10 if noisy else 11, color=CHART_INK)
    ax.tick_params(colors=CHART_INK, labelsize=11)
    for spine in ax.spines.values():
        spine.set_color(CHART_INK)
    ax.margins(y=0.25)
    fig.tight_layout()
    plt.close(fig)  # gradio renders the figure object; keep pyplot's registry from growing per request
    return fig


# ---- precomputed results of the example prompts, stored with the model ---------------------------------
STORED_FILE = "results.json"
STORED_QUALITY = 4  # imageio's 0-10 scale: the stored videos stay small (a few hundred KB for all of them)


def store_examples(
    models: AppModels, folder: Path, prompts: list[str], progress: Callable[[str], None] | None = None
) -> Path:
    """Runs a 4-variant compare at the model's defaults for each prompt and stores the results in ``folder``
    (``results.json`` and small mp4s named ``<example>-<variant>.mp4``), with the machine, load and date they
    were measured on. The page opens with them (:func:`load_stored`)."""

    d = models.components.defaults
    preset = (d["num_frames"], d["height"], d["width"])
    # the new store is built beside the old one and swapped in whole when every example is done: a run that is
    # stopped or fails part-way leaves the stored results (and their videos) as they were
    folder = Path(folder)
    staging = folder.with_name(f".{folder.name}.new")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        _store_into(models, staging, prompts, preset, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_in(staging, folder)
    return folder / STORED_FILE


def _store_into(models: AppModels, staging: Path, prompts: list[str], preset, progress) -> None:
    import datetime as dt

    from common.video import read_video

    d = models.components.defaults
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate(prompts):
            request = check_request(
                models, prompt, "", 0, d["num_inference_steps"], d["guidance_scale"], preset_key(preset), VARIANTS
            )
            if progress is not None:
                progress(f"example {i + 1}/{len(prompts)}: {prompt}")
            result = run_compare(models, request, Path(tmp))
            date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            result.measured = f"measured on {result.device}, {result.load}, {date}"
            for run in result.runs:
                if run.video is not None:
                    small = staging / f"{i}-{run.variant}.mp4"
                    write_mp4(small, read_video(run.video), quality=STORED_QUALITY, comment=f"{run.variant} | {prompt}")
                    run.video = small
            result.side_by_side = None  # a fresh run makes it; stored, it would double the size
            records.append(result_to_dict(result))  # videos by file name: valid in the folder they move to
    (staging / STORED_FILE).write_text(json.dumps({"results": records}, indent=1) + "\n")


def _swap_in(staging: Path, folder: Path) -> None:
    """Puts the complete ``staging`` folder at ``folder``. Files of ``folder`` that are not the store's (anything
    but its mp4s and results file) are carried over; the old folder is removed only after the new one is in
    place (a crash between the two renames leaves it as ``.<name>.old``)."""
    if folder.is_dir():
        for other in folder.iterdir():
            if other.suffix != ".mp4" and other.name != STORED_FILE and not (staging / other.name).exists():
                (shutil.copytree if other.is_dir() else shutil.copy2)(other, staging / other.name)
    replace_dir(staging, folder)


def stored_side_by_side(result: CompareResult, folder: Path, fps: int = 16) -> Path | None:
    """The side-by-side video of a stored result, made from its variants' stored videos into ``folder`` (the
    store keeps only those: the side-by-side would double its size); None when fewer than two videos."""
    from common.video import read_video

    videos = {r.variant: read_video(r.video) for r in result.runs if r.video is not None and r.video.is_file()}
    if len(videos) < 2:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    req = result.request
    return write_mp4(
        folder / "side_by_side.mp4",
        side_by_side_frames(videos),
        fps=fps,
        comment=f"{', '.join(videos)} | seed {req.seed} | {req.prompt} (stored example)",
    )


def load_stored(folder: Path | None) -> dict[str, CompareResult]:
    """The stored results by prompt ({} when there are none, or they cannot be read)."""
    path = None if folder is None else folder / STORED_FILE
    if path is None or not path.is_file():
        return {}
    try:
        records = json.loads(path.read_text())["results"]
        results = [result_from_dict(r, folder) for r in records]
    except (ValueError, KeyError, TypeError) as e:
        log.warning("stored example results in %s cannot be read: %s", folder, e)
        return {}
    return {r.request.prompt: r for r in results if all(x.video is None or x.video.is_file() for x in r.runs)}

"""The comparison engine: one prompt and seed through several self-attention variants, in turns, timed and
measured against flash. :func:`iter_compare` yields one snapshot per finished variant; ``generate`` is called
in one place, :func:`_generate`."""

from __future__ import annotations

import contextlib
import logging
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

import numpy as np
import torch

from common import threads
from common.interleave import (  # noqa: F401 - RunCancelled, machine_load: the page's names too
    PairedSpeedup,
    RunCancelled,
    StepClock,
    machine_load,
    paired_steps,
    step_speedup,
    take_turns,
)
from common.timing import Spread, Timing, device_name, spread
from common.video import to_uint8, write_mp4
from pipelines import VARIANTS, GenerationRequest, model_request
from pipelines.attention import HYBRID, LINEAR, MHLA, SOFTMAX
from pipelines.caching import cached
from pipelines.pipeline import generate

from .. import preview, quality
from ..models import AppModels
from .chart import warm_chart
from .request import CompareRequest, preset_tokens

log = logging.getLogger(__name__)

KEEP_RUNS = 20  # run folders kept on disk (videos the page may still show)

# one colour per variant everywhere: columns, charts (the Benchmark tab's too), the side-by-side labels
# (Tableau 10: distinct for colour-blind readers, readable on light and dark backgrounds)
VARIANT_COLOURS = {SOFTMAX: "#4c78a8", LINEAR: "#f58518", MHLA: "#54a24b", HYBRID: "#e45756"}


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
        """The steps that enter the paired speedups (:func:`common.interleave.paired_steps`: each run's first
        step is a warm-up and is left out, unless it is the only one)."""
        return paired_steps(self.timings)

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
    # the seconds each live preview took, by variant (in the variant's turn, outside its timed steps)
    preview_seconds: dict[str, list[float]] = field(default_factory=dict)

    def run(self, variant: str) -> VariantRun | None:
        return next((r for r in self.runs if r.variant == variant), None)

    @property
    def softmax_backend(self) -> str:
        names = sorted({r.timing.softmax_backend for r in self.runs if r.timing and r.timing.softmax_backend})
        return ", ".join(names) or "- (no softmax layer ran)"

    def speedups(self, run: VariantRun) -> tuple[PairedSpeedup | None, float | None]:
        """``(denoising, end_to_end)`` of ``run`` over flash: per denoising step from the paired steps
        (:func:`common.interleave.step_speedup`, the CLI's rule too), and flash's median end-to-end time over the
        variant's."""
        flash = self.run(SOFTMAX)
        if not (flash and flash.timings and run.timings) or run is flash:
            return None, None
        return step_speedup(flash.timings, run.timings), flash.stage("total").median / run.stage("total").median

    def ranking(self) -> list[VariantRun]:
        """Finished variants, best against the prompt first: by the share of the prompt's attributes shown;
        a degenerate video always last (ties keep the variants' order)."""
        done = [r for r in self.runs if not r.error]

        def key(r: VariantRun):
            shown = sum(r.attributes.values()) / len(r.attributes) if r.attributes else 0.0
            return (r.degenerate is not None, -shown)

        return sorted(done, key=key)


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


def _generate(
    models: AppModels, request: CompareRequest, variant: str, steps: int, output_type: str = "np", on_step=None
):
    """The app's one call of :func:`pipelines.pipeline.generate`: the page's request as a
    :class:`~pipelines.GenerationRequest`, checked once against the model (:func:`pipelines.model_request`).
    ``on_step``: generate's hook after each denoising step (the live previews)."""
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
        return generate(models.components, checked, transformer=vm.transformer, show_progress=False, on_step=on_step)


# "untrained attention parameters": each converted variant's column already says "converted, not fine-tuned"
_UNTRAINED = r"variant '.*' added freshly initialised"


def interleaves(models: AppModels, names: list[str]) -> bool:
    """Whether these variants take turns step by step (each has its own transformer); else they run one after
    another on the shared one."""
    return len({id(models.variants[n].transformer) for n in names}) == len(names)


def _video_tail(
    models: AppModels,
    request: CompareRequest,
    run: VariantRun,
    decoded: np.ndarray,
    run_dir: Path,
    fps: int,
    reference: np.ndarray | None,
    judge: bool = True,
) -> np.ndarray:
    """What follows a variant's decode: its mp4, the degenerate-video check, the verdict against the prompt
    (``judge``) and, with flash's video as ``reference`` (not for flash itself), PSNR and SSIM; into ``run``.
    Returns the frames."""
    frames = to_uint8(decoded)
    comment = f"{run.variant} | seed {request.seed} | {request.prompt}"
    if models.random_note:
        comment = f"{models.random_note} | {comment}"
    run.video = write_mp4(run_dir / f"{run.variant}.mp4", frames, fps=fps, comment=comment)
    run.degenerate = quality.degenerate(frames)
    if judge and models.judge is not None:
        run.attributes = models.judge(frames, request.prompt)
        run.judged = True
    if run.variant != SOFTMAX and reference is not None:
        run.psnr, run.ssim = quality.psnr(frames, reference), quality.ssim(frames, reference)
    return frames


def warm_up(
    models: AppModels, decodes: list[tuple[float, int]] | None = None, ends: list[tuple[float, int]] | None = None
) -> float:
    """One short untimed generation per variant at the model's default size (one step; the first also
    decodes, warming the shared text encoder and VAE), done once when the app starts so that no request pays
    for it. Returns the seconds it took; ``decodes`` gets ``(seconds, pixels)`` of a variant's tail (its video
    decode, writing and checks) at two sizes, the default and a smaller one (:func:`_tail_sizes`): the page's first
    estimate of that tail's length at any size, a fixed part and a part per pixel. ``ends`` gets ``(seconds,
    pixels)`` of a run's end at the default size (:func:`_end_seconds`: the side-by-side video and the chart, warm),
    beside that size's tail in ``decodes``: the page's first estimate of a run's end, as a share of a tail."""
    d = models.components.defaults
    preset = (d["num_frames"], d["height"], d["width"])
    request = CompareRequest(models.example_prompt, "", 0, 1, float(d["guidance_scale"]), preset, list(VARIANTS))
    if models.needs_image:  # an image-to-video model warms up on a plain grey first frame
        from PIL import Image

        request.image = Image.new("RGB", (preset[2], preset[1]), (128, 128, 128))
    start = time.perf_counter()
    first: tuple[float, float] | None = None  # the default size's decode and the rest of its tail, in seconds
    latents = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNTRAINED, category=UserWarning)
        if decodes is not None:
            _first_vae_call(models)
        for i, name in enumerate(VARIANTS):
            out = _generate(models, request, name, 1, "np" if i == 0 else "latent")
            if i > 0:
                latents = out.frames
            if i == 0 and decodes is not None and out.timing.vae_decode > 0:
                # a variant's whole tail, as a run has it: the decode, then its video written and checked
                # (against itself as the reference: the same work as against flash's)
                with tempfile.TemporaryDirectory(prefix="mhla-warm-") as tmp:
                    frames = to_uint8(out.frames)
                    # twice: the first pays the cold costs (the mp4 writer's start) that no run pays again; without
                    # the verdict, which on a one-step video (noise: countless blobs) took ~10x a real video's
                    # (measured: with both, the first run's estimate was 5x too long at its end)
                    for _ in range(2):
                        tail = time.perf_counter()
                        run = VariantRun(LINEAR, "")
                        _video_tail(models, request, run, frames, Path(tmp), 16, frames, judge=False)
                        first = (out.timing.vae_decode, time.perf_counter() - tail)
                    if ends is not None:
                        try:
                            ends.append((_end_seconds(frames, Path(tmp)), preset[0] * preset[1] * preset[2]))
                        except Exception:  # noqa: BLE001 - the end's first estimate is then a tail's
                            log.exception("warm-up: timing a run's end failed; its first estimate is a tail's")
        if decodes is not None and first is not None:
            decodes.append((sum(first), preset[0] * preset[1] * preset[2]))
            if latents is not None:
                try:
                    decodes[-1:] = _tail_sizes(models, request, latents, first)
                except Exception:  # noqa: BLE001 - the default size's tail alone is still a first estimate
                    log.exception("warm-up: the second decode size failed; the tails' first estimate is one size's")
    return time.perf_counter() - start


def _end_seconds(frames: np.ndarray, folder: Path) -> float:
    """A run's end at the size of ``frames`` (T, H, W, 3), as the first run pays it once warm: the side-by-side
    video of four variants and the speedup chart. The chart is drawn once untimed first: its library's import and
    fonts (0.4 s on this CPU, more under load) were paid by the first run's end, which then took twice the next
    runs' and made their estimates of it long (issue 52 (4))."""
    _draw_chart()
    start = time.perf_counter()
    write_mp4(folder / "side_by_side.mp4", side_by_side_frames({n: frames for n in VARIANTS}), fps=16)
    _draw_chart()
    return time.perf_counter() - start


def _draw_chart() -> None:
    """The page's step-latency chart drawn and closed once, with placeholder numbers (:mod:`app.compare.chart`)."""
    warm_chart(list(VARIANTS), [VARIANT_COLOURS.get(n, "#888888") for n in VARIANTS])


@torch.no_grad()
def _first_vae_call(models: AppModels) -> None:
    """The VAE's first call, on one latent frame of 2x2 (untimed): it pays the cold costs (its kernels' first use)
    that would otherwise sit in the warm-up's timed decode at the default size, which a fixed part and a part per
    pixel fitted on it would carry to larger sizes. A failure is only a colder first decode (logged)."""
    try:
        channels = models.components.vae.config.z_dim
        preview.vae_decode(models.components, torch.zeros(1, channels, 1, 2, 2))
    except Exception:  # noqa: BLE001 - the warm-up's decode is then cold, nothing worse
        log.exception("warm-up: the VAE's first call failed")


@torch.no_grad()
def _tail_sizes(
    models: AppModels, request: CompareRequest, latents: torch.Tensor, first: tuple[float, float]
) -> list[tuple[float, int]]:
    """A variant's tail at the default size and at a smaller one, ``[(seconds, pixels)]`` (issue 52 (4)).

    ``latents``: a warm-up generation's, ``(1, C, F, h, w)`` at the default size; ``first``: the seconds of its
    decode (after the VAE's first call, :func:`_first_vae_call`: a run's first decode at a size new to it is the
    same) and of the rest of its tail (video, checks). The VAE decodes the first half of the latents in every
    dimension (about an eighth of the pixels; the VAE alone: no transformer call, so no other shape is compiled),
    twice, the faster kept (on a shared CPU one measure can be several times another); its video is written and
    checked once (the mp4 writer is warm by then). One size alone is a seconds per pixel: scaled from the default
    9x64x80 to 17x128x160 it said +77% near the first run's end on a quiet CPU; two give a fixed part and a part per
    pixel (:class:`app.interleave.SizeCost`)."""
    frames, height, width = request.preset
    out = [(sum(first), frames * height * width)]
    half = latents[:1, :, : (latents.shape[2] + 1) // 2, : (latents.shape[3] + 1) // 2, : (latents.shape[4] + 1) // 2]
    if half.shape == latents[:1].shape:  # one latent pixel: no smaller size
        return out
    started = time.perf_counter()
    seconds = []
    for _ in range(2):
        began = time.perf_counter()
        video = preview.vae_decode(models.components, half)  # (1, 3, T, H, W) in [0, 1]
        seconds.append(time.perf_counter() - began)
    decoded = video[0].permute(1, 2, 3, 0).numpy()  # (T, H, W, 3), as generate gives them
    small = replace(request, preset=tuple(video.shape[2:]))
    with tempfile.TemporaryDirectory(prefix="mhla-warm-") as tmp:
        tail = time.perf_counter()
        _video_tail(models, small, VariantRun(LINEAR, ""), decoded, Path(tmp), 16, to_uint8(decoded), judge=False)
        out.append((min(seconds) + time.perf_counter() - tail, small.num_frames * small.height * small.width))
    log.info(
        "warm-up: a tail %.2f s at %d pixels, %.2f s at %d (the second size: %.2f s more)",
        *out[0],
        *out[1],
        time.perf_counter() - started,
    )
    return out


class Warmup:
    """:func:`warm_up` in a background thread, so the page answers at once (a 41 s warm-up before the server
    starts would make the page take 68 s). Requests wait for it (:meth:`wait`); the page says it is going.
    A warm-up that fails is logged and counts as done: requests then pay the cold caches, nothing worse.

    :meth:`loading` makes one that first loads the models (``load()``), so that the page can be served from
    the model's files (:class:`app.models.ModelFacts`) before diffusers is even imported; a load that fails
    is logged, named on the page, and every run is refused with it."""

    def __init__(
        self, models: AppModels | None = None, load: Callable[[], AppModels] | None = None, previews: bool = True
    ):
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
        self.ends: list[tuple[float, int]] = []  # (seconds, pixels) of a run's end (side-by-side video, chart)
        self.previews = previews  # then fit the live previews' colour map (no run pays for it)

    @classmethod
    def loading(cls, load: Callable[[], AppModels], previews: bool = True) -> Warmup:
        return cls(load=load, previews=previews)

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
            self.seconds = warm_up(self.models, self.decodes, self.ends)
            log.info("warm-up: %.1f s (in the background)", self.seconds)
            if self.previews:  # the live previews' colour map, fitted once (app.preview.latent_map)
                started = time.perf_counter()
                preview.latent_map(self.models)
                log.info("live previews' colour map fitted: %.1f s", time.perf_counter() - started)
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
        # seconds only once it has started and only as they are: the page is built before start() and served
        # seconds later, and a "0 s so far" baked into it stayed until the first refresh, then jumped
        since = "" if self.started is None else f"{time.monotonic() - self.started:.0f} s so far; "
        if not self.loaded:
            return (
                f"**Loading the model** in the background ({since}a warm-up follows). The page works now: pick an "
                "example, write a prompt; Generate waits for the model."
            )
        return (
            f"**Warming up** in the background ({since}one step per variant and one decode, so that no run pays "
            "for cold caches). The page works now; Generate waits for the warm-up to finish."
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
    preview_every: int = 0,
    show_preview: Callable[[str, int, int, np.ndarray, bool], None] | None = None,
) -> Iterator[CompareResult]:
    """Runs the chosen variants with the same seed and yields a snapshot of the result each time one is
    done (the page fills its column at once); writes one mp4 per variant and one side by side.

    The variants take turns, one denoising step each, round-robin (:func:`common.interleave.take_turns`), so a
    change of machine load hits all of them alike and step ``k`` of each variant pairs with flash's step
    ``k`` for the speedup's interval. Variants that share one transformer (converted in place at each run)
    cannot interleave: they run one after another (``CompareResult.interleaved`` is then False). No warm-up
    generation per request (:func:`warm_up` runs once when the app starts); each run's first step is left
    out of the paired speedups instead. ``progress(text, fraction)`` gets readable stages, and
    ``variant_steps({variant: (steps done, steps in all)})`` each variant's own count at the same moments (the
    page's bar per column while they take turns). With ``show_preview``, every ``preview_every`` steps (not the
    last) ``show_preview(variant, step, steps, frame, is_estimate)`` gets the variant's latest denoised estimate as a
    ``(h, w, 3)`` uint8 frame (:mod:`app.preview`), made in the variant's turn between two of its timed steps (the
    seconds each took: ``CompareResult.preview_seconds``). Setting ``cancel`` stops the run before the next
    transformer call; the last snapshot then has ``stopped`` set.
    A variant that fails (out of memory, anything raised inside generation) gets its error in its
    :class:`VariantRun`; the others run.
    """
    run_dir = new_run_dir(out_root)
    names = list(request.variants)
    interleaved = interleaves(models, names)
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

    def work(name: str, clock: StepClock) -> VariantRun:
        vm = models.variants[name]
        run = VariantRun(name, vm.note, vm.kind)
        try:
            repeat = [0]
            clock.on_step = lambda n, k, f: on_step(n, k, f, repeat[0])
            hook = None
            if show_preview is not None:
                spent = result.preview_seconds.setdefault(name, [])
                hook = preview.make_previewer(
                    models,
                    request.height,
                    request.width,
                    preview_every,
                    steps,
                    lambda k, frame, estimate: show_preview(name, k, steps, frame, estimate),
                    spent,
                )
            for r in range(request.repeats):
                clock.check()
                repeat[0] = r
                clock.begin()
                start = time.perf_counter()
                out = _generate(models, request, name, steps, on_step=hook)
                run.timings.append(clock.timing(out.timing, start, time.perf_counter()))
            clock.check()
            report(f"{name}: writing video")
            # here, in this variant's turn, not in the consumer's thread: there it would slow the next
            # variant's VAE decode (measured: the later a variant decoded, the slower)
            videos[name] = _video_tail(models, request, run, out.frames, run_dir, fps, videos.get(SOFTMAX))
        except RunCancelled:
            raise
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others' results
            run.error = _error_text(e, models, request)
            run.timings = []
            if models.device.type == "cuda":
                torch.cuda.empty_cache()  # give the next variant (and request) the memory back
        return run

    if models.device.type == "cpu":
        threads.adjust()  # torch's threads for this request: the cores other work leaves (common/threads.py)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNTRAINED, category=UserWarning)
        # the shared rule (common.interleave, the CLI's too): a thread per variant, one step each in turn
        outcomes = take_turns(
            names,
            lambda n: models.variants[n].transformer,
            work,
            per_step,
            interleaved,
            cancel,
            device=models.device,
            thread_name="compare",
        )
        with contextlib.closing(outcomes):  # the consumer went away: the variants' threads end too
            for outcome in outcomes:
                if outcome.cancelled:
                    result.stopped = True
                    continue
                if outcome.error is not None:  # work() keeps a variant's own failure; anything else is the run's
                    raise outcome.error
                run = outcome.value
                result.runs = sorted([*result.runs, run], key=lambda r: names.index(r.variant))
                if not result.stopped:
                    _agreement(result, videos)
                    yield replace(result, runs=list(result.runs))
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

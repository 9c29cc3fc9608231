"""The built-in model's third design built in one GPU call (issue 49, item 3), and its weights laid into the tree.

    python3 -m factory.gpu_build --out DIR --deadline-s SECONDS            # on the device: the real build
    python3 -m factory.gpu_build --out DIR --deadline-s 300 --dry-run      # tiny counts, CPU float32 (the test)
    python -m factory.gpu_build import DIR [--into assets/builtin-next/v3]  # later, on a CPU machine

The build, phase by phase, each against the deadline (counted from this module's import when run as a command:
the interpreter started a moment before), each writing what it has before the next one starts:

1. **data**: the third world (``world_named("v3")``, train split, data seed 0) rendered by worker processes
   (``multiprocessing``, fork: started before CUDA is, so they render while the parent loads the model):
   ``--clips`` clips of 9x64x80 and ``--stills`` one-frame stills (``images=True``: joint image-video training),
   each sample what :class:`world.synthetic.SyntheticVideoDataset` gives for its index. The parent encodes each
   chunk on the device with the committed VAE through :class:`training.encoding.Encoder` (posterior mean,
   normalised with the VAE's ``latents_mean`` / ``latents_std``, float32) into ONE device tensor per kind,
   clips ``(N, 16, 5, 16, 20)`` and stills ``(M, 16, 1, 16, 20)``; captions as indices into one table of text
   embeddings ``(U + 1, 16, 64)``, computed once per unique caption (the empty caption, caption dropout's, last).
2. **base**: the committed raw softmax base (``SOURCE/transformer``) trained on with flow matching exactly as
   :mod:`training.finetune` does (:class:`training.flow.FlowMatching`: shift 3, logit-normal sigmas, its loss;
   :class:`training.finetune.ModelCall`; caption dropout 0.1 drawn like :class:`training.data.BatchEncoder`),
   ``--batch`` clips and ``--image-ratio`` x as many stills a step (their own forward pass, the loss a mean over
   samples, as :class:`training.finetune.ImageStream`), batches drawn on the device (``torch.randint``), bf16
   autocast over float32 master weights, AdamW, warm-up + cosine, gradient clip 1.0, EMA
   (:class:`training.ema.EMA`). Writes ``transformer`` (raw) and ``transformer-ema``.
3. **convert**: ``linear``, ``mhla`` and ``mhla-hybrid`` each converted from the base's EMA as
   :func:`training.finetune.build_model` converts (:func:`pipelines.convert_self_attention`, blocks from the
   model's block shape) and fine-tuned on clips with one shared budget (the first conversion's fitted step count
   is the others' cap); each writes its EMA's weights, as ``factory.next save-variant`` takes a checkpoint's.
   Without a base trained here they start from the committed ``SOURCE/transformer-ema``.
4. **eval**: the swap probe (:class:`training.probe.SwapProbe`, validation clips) and a quick evaluation
   (:func:`factory.evaluate.heldout_loss`, :func:`factory.evaluate.semantic`: a few validation prompts x seeds per
   variant, rounds of prompts while time lasts) of the base's EMA and each conversion, into ``build.json``.

A training phase times a few steps, then fits its step count (and so its cosine) to its share of the time left
(``PHASE_WEIGHTS``); the deadline stops any phase, which then saves what it trained (a phase with no finished step
saves nothing: the last complete phase's weights stay). Progress lines name steps, losses, ms a step and samples
a second.

What comes back (the device returns at most 8 files of <= 16 MiB, <= 2 folders down; the caller adds its log):
``DIR/build.json`` (each part's ``config.json`` text, file, SHA-256 and training record; the results) and one
float16 safetensors per part (``transformer``, ``transformer-ema``, ``linear``, ``mhla``, ``mhla-hybrid``: about
3.4-3.6 MB each), written through :func:`factory.next._save_half`, the function behind ``save --half``. ``import``
lays them into ``--into`` as ``factory.next save-checkpoint --half`` and ``save-variant`` would (``transformer/``,
``transformer-ema/``, ``variants/<v>/``, each ``config.json`` + ``diffusion_pytorch_model.safetensors``), all or
nothing, after checking every file's hash, that the VAE, text encoder and tokenizer are the ones the build encoded
with, that each conversion's base is the ``transformer-ema`` that will sit beside it, that each folder loads with
:func:`pipelines.load_transformer`, and the size budget of ``assets/builtin-next``.

The real run's numbers (defaults; ``--dry-run`` takes :data:`DRY`):

- model: 6 layers x 128 (4 heads x 32, FFN 512), 1.76M parameters. Per sample, measured with
  ``torch.utils.flop_counter`` on its projections and FFN plus the attention counted by hand (``4 N^2 d`` a layer):
  a clip (400 tokens) 1.12 + 0.49 = 1.6 GFLOP forward, about 4.8 GFLOP forward and backward (3x); a still (80
  tokens) 0.23 + 0.02 = 0.25 GFLOP forward, 0.75 trained. A step of 256 clips + 1,024 stills: 1.23 + 0.77 = 2.0
  TFLOP, 2.5 ms at an H200's ~790 TFLOP/s dense bf16. A width of 128 cannot use that: every matrix product is
  memory-bound ((102,400 x 128) @ (128 x 128) reads and writes 26 MB for 3.4 GFLOP), and the elementwise work
  (float32 norms and modulation, RoPE, GELU) and a thousand-odd small kernel launches a step dominate. Assumed:
  3-5% of peak, 25-40 TFLOP/s, 50-80 ms a step: the base's ~270 s then holds 3,400-5,400 steps, 0.9-1.4M clips
  and 3.4-5.5M stills. 1M samples of this mix (1.56 GFLOP each) need 5.8 TFLOP/s (0.7% of peak); 1M clips
  alone (3,900 steps) 29 TFLOP/s (3.7%). The fit, not this guess, sets the count; the log prints the rate.
- data: 65,536 clips (1.6 ms each to render on one core: ~7 s on 15 workers; 4.7 GFLOP each to encode: 305
  TFLOP, ~10 s at ~30 TFLOP/s of TF32 convolutions) and 131,072 stills (0.3 ms, 0.7 GFLOP); 6.7 + 2.7 GB of
  float32 latents on the device. The earlier base saw 8,192 clips; here each clip is drawn ~15 times.
- base: batch 256 clips + 1,024 stills (``--image-ratio`` 4, as ``factory/configs/v3/joint.yaml``), lr 1e-3
  (joint.yaml's 5e-4 at 32 clips, scaled by the square root of the 8x batch and rounded down), 200 warm-up
  steps, cosine to 0.1x, EMA 0.999 (averages the last ~1,000 steps), at most 12,000 steps.
- conversions: 256 clips a step, no stills, lr 5e-4 (the conversion configs' 3e-4 at 32 clips, scaled less: they
  start from a trained base), 50 warm-up steps, cosine to 0.1x, EMA 0.995, at most 1,500 steps each.
- time: :data:`PHASE_WEIGHTS` of what is left after the set-up (imports, CUDA, the model folder: ~15 s), less a
  10 s reserve, each share recomputed from what is left as its phase starts (a phase ending early leaves its
  time to the rest): at ``--deadline-s 490`` (``benchmarks/run_gpu.sh``'s build stage: BUILD_S 500 less 10)
  about 37 s of data, 270 s of base, 38 s for each conversion, 57 s of probe and evaluation (12 prompts x 2
  seeds a variant at most, 20 denoising steps, CFG 4).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# the deadline's zero: before torch, diffusers and the project load (seconds on a fresh machine)
_STARTED = time.monotonic()

CONFIGS = Path(__file__).resolve().parent / "configs" / "v3"  # the conversions' committed configs
BUILD_JSON = "build.json"
FORMAT = 1
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
# the parts a build brings back: the file it writes, the folder import lays it into (as factory.next names them)
PARTS = {
    "transformer": "transformer",
    "transformer-ema": "transformer-ema",
    "linear": "variants/linear",
    "mhla": "variants/mhla",
    "mhla-hybrid": "variants/mhla-hybrid",
}
CONVERSIONS = ("linear", "mhla", "mhla-hybrid")  # factory.build.CONVERSIONS, in the order they train
PHASES = ("base", "convert", "eval")  # what --phases names; data runs whenever a training phase does
# the device's limits on what comes back: files, bytes each, folders below $OUT (DIR is one of them)
MAX_FILES, MAX_FILE_BYTES = 8, 16 * 2**20
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
# shares of the time left after set-up, given to each phase as it starts (over the phases still to run): the
# base is the point of the call; the conversions share theirs equally; data is cheap (render and encode)
PHASE_WEIGHTS = {"data": 0.08, "base": 0.56, "convert": 0.24, "eval": 0.12}
# the source sample each part of the design must match at import (the latents and captions the build trained on)
SOURCE_FILES = {
    "vae": "vae/diffusion_pytorch_model.safetensors",
    "text_encoder": "text_encoder/model.safetensors",
    "tokenizer": "tokenizer/tokenizer.json",
}


@dataclass(frozen=True)
class Settings:
    """The build's numbers (module docstring: why these); ``steps`` are caps, the deadline fits the real counts."""

    clips: int = 65536
    stills: int = 131072
    batch: int = 256  # clips a step
    image_ratio: float = 4.0  # stills a step per clip (base)
    base_steps: int = 12000
    base_lr: float = 1e-3
    base_warmup: int = 200
    base_ema: float = 0.999
    convert_steps: int = 1500
    convert_lr: float = 5e-4
    convert_warmup: int = 50
    convert_ema: float = 0.995
    convert_cpe: bool = True  # the conversion configs' model.attention.cpe (a 300-step A/B: loss 0.128 vs 0.147)
    convert_image_ratio: float = 0.0  # the conversion configs train on clips; MHLA's blocks are laid over 5 frames
    min_lr_ratio: float = 0.1
    caption_dropout: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    workers: int = 0  # render processes; 0 = one less than the CPUs
    probe_clips: int = 8
    eval_prompts: int = 12
    eval_seeds: int = 2
    eval_steps: int | None = None  # denoising steps; None = the model's (20)
    eval_round: int = 4  # prompts per round of the evaluation (every variant, then the next round)
    loss_batches: int = 4
    loss_batch_size: int = 16
    log_every: int = 100
    timed_steps: int = 20  # steps timed (after 3 untimed) to fit a phase's step count to its time
    reserve_s: float = 10.0  # kept back at the end for the last writes
    min_phase_s: float = 5.0  # a phase with less than this left is skipped
    device: str = "auto"


# the dry run: every phase and file of the real one, at counts a 2-core CPU runs in float32 in well under a minute
DRY = replace(
    Settings(),
    clips=8,
    stills=16,
    batch=4,
    image_ratio=1.0,
    base_steps=3,
    base_warmup=1,
    convert_steps=3,
    convert_warmup=1,
    workers=2,
    probe_clips=1,
    eval_prompts=1,
    eval_seeds=1,
    eval_steps=2,
    eval_round=1,
    loss_batches=1,
    loss_batch_size=1,
    log_every=1,
    timed_steps=1,
    reserve_s=0.0,
    min_phase_s=0.0,
    device="cpu",
)


class Clock:
    """Seconds since ``start`` (a ``time.monotonic()`` reading; default: now) against ``deadline_s``, less
    ``reserve_s``."""

    def __init__(self, deadline_s: float, reserve_s: float = 0.0, start: float | None = None):
        self.deadline_s, self.reserve_s = float(deadline_s), float(reserve_s)
        self.start = time.monotonic() if start is None else start

    def now(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds left before the reserve (negative once past it)."""
        return self.deadline_s - self.reserve_s - self.now()

    def share(self, phase: str, later: list[str]) -> float:
        """When ``phase`` must stop (seconds since start): its :data:`PHASE_WEIGHTS` share of the time left, over
        ``later``, the phases still to run including it."""
        weights = sum(PHASE_WEIGHTS[p] for p in later)
        return self.now() + max(0.0, self.left()) * PHASE_WEIGHTS[phase] / weights


def log(clock: Clock, message: str) -> None:
    print(f"[gpu_build {clock.now():6.1f}s] {message}", flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when inside it (``assets/builtin-next/v3/transformer``), else as given."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- data


def _render(task: tuple[str, int, int, int]):
    """One worker's chunk ``(kind, start, stop, seed)``: samples ``start .. stop - 1`` of ``kind`` ("clips" or
    "stills") of the third world's train split -> ``(kind, start, frames uint8 (n, T, 64, 80, 3), captions)``,
    each what :class:`world.synthetic.SyntheticVideoDataset` renders for that index (T = 9, or 1 for stills)."""
    import numpy as np

    from factory.v3 import DEFAULTS, WORLD
    from world.synthetic import generate_sample, world_named

    kind, start, stop, seed = task
    still = kind == "stills"
    world = world_named(WORLD)
    samples = [
        generate_sample(
            i,
            seed=seed,
            split="train",
            num_frames=1 if still else DEFAULTS["num_frames"],
            height=DEFAULTS["height"],
            width=DEFAULTS["width"],
            world=world,
            images=still,
        )
        for i in range(start, stop)
    ]
    return kind, start, np.stack([s.frames for s in samples]), [s.caption for s in samples]


class Renderer:
    """Worker processes rendering ``clips`` clips then ``stills`` stills in chunks, in index order. Start it before
    CUDA is initialised: the workers are forked (no re-import), and a process that has started CUDA cannot fork
    safely (``spawn`` is used then). ``inline``: no workers, each chunk rendered in this process when asked for."""

    def __init__(self, clips: int, stills: int, seed: int = 0, workers: int = 0, inline: bool = False):
        import multiprocessing

        import torch

        if clips < 1 or stills < 0:
            raise ValueError(f"rendering needs clips >= 1 and stills >= 0, got clips={clips}, stills={stills}")
        self.counts = {"clips": clips, "stills": stills}
        self.workers = workers or max(1, (os.cpu_count() or 2) - 1)
        self.tasks: list[tuple[str, int, int, int]] = []
        for kind, n, most in (("clips", clips, 128), ("stills", stills, 512)):
            # chunks small enough that every worker has several (and the parent's encoding can follow them)
            size = max(1, min(most, math.ceil(n / (4 * self.workers))))
            self.tasks += [(kind, a, min(n, a + size), seed) for a in range(0, n, size)]
        self.pool = None
        if inline:
            self.method, self.workers, self.pending = "inline", 0, iter(self.tasks)
            return
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        if torch.cuda.is_initialized():
            method = "spawn"
        self.pool = multiprocessing.get_context(method).Pool(self.workers)
        self.results = self.pool.imap(_render, self.tasks)
        self.method = method

    def __iter__(self):
        return iter(self.tasks)

    def next(self, timeout: float):
        """The next chunk ``(kind, start, frames, captions)``; ``multiprocessing.TimeoutError`` after ``timeout``."""
        if self.pool is None:
            return _render(next(self.pending))
        return self.results.next(timeout=max(timeout, 0.01))

    def close(self, finished: bool) -> None:
        if self.pool is None:
            return
        if finished:
            self.pool.close()
        else:
            self.pool.terminate()  # chunks still rendering past the deadline are dropped
        self.pool.join()


@dataclass
class Cache:
    """The encoded world on the device: ``clips`` ``(N, C, F, h, w)`` and ``stills`` ``(M, C, 1, h, w)`` float32
    latents (M may be 0: ``stills`` None), their captions as indices (``clip_text`` ``(N,)``, ``still_text``
    ``(M,)`` int64) into ``text`` ``(U + 1, L, D)``, whose last row is the empty caption's (caption dropout's)."""

    clips: object
    clip_text: object
    stills: object
    still_text: object
    text: object
    captions: list[str]
    seconds: float = 0.0
    cut_short: bool = False

    @property
    def empty(self) -> int:
        return len(self.captions)

    def text_batch(self, ids, generator, dropout: float):
        """``(B, L, D)`` embeddings of the captions ``ids`` ``(B,)``, each replaced by the empty caption's with
        probability ``dropout`` (one draw per sample from ``generator``, as :class:`training.data.BatchEncoder`)."""
        import torch

        if dropout > 0:
            drop = torch.rand(len(ids), generator=generator, device=generator.device) < dropout
            ids = torch.where(drop.to(ids.device), torch.full_like(ids, self.empty), ids)
        return self.text[ids]


def encode_rendered(renderer: Renderer, encoder, end_at: float, clock: Clock) -> Cache:
    """Encodes the renderer's chunks as they arrive (``encoder``: :class:`training.encoding.Encoder`, on the
    device) into :class:`Cache`'s tensors; at ``end_at`` (seconds on ``clock``) it stops and keeps the chunks
    encoded so far (a prefix of each kind, at least one clip: else a ``RuntimeError``)."""
    import multiprocessing

    import torch

    t0 = time.monotonic()
    device = next(encoder.vae.parameters()).device
    store: dict[str, torch.Tensor] = {}
    ids: dict[str, list[int]] = {"clips": [], "stills": []}
    done = {"clips": 0, "stills": 0}
    table: dict[str, int] = {}
    finished = False
    shown = 0
    try:
        for _ in renderer:
            try:
                kind, start, frames, captions = renderer.next(end_at - clock.now())
            except multiprocessing.TimeoutError:
                break
            if start != done[kind]:  # imap keeps the order; a gap would misplace latents
                raise RuntimeError(f"rendered chunk of {kind} starts at {start}, expected {done[kind]}")
            # the dataset's own arithmetic, on the device: uint8 (n, T, H, W, 3) -> (n, 3, T, H, W) in [-1, 1]
            video = torch.from_numpy(frames).to(device).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
            latents = encoder.latents(video)
            if kind not in store:
                store[kind] = torch.empty(
                    (renderer.counts[kind], *latents.shape[1:]), dtype=torch.float32, device=latents.device
                )
            store[kind][start : start + len(latents)] = latents
            ids[kind] += [table.setdefault(c, len(table)) for c in captions]
            done[kind] += len(latents)
            total = done["clips"] + done["stills"]
            if total >= shown + (renderer.counts["clips"] + renderer.counts["stills"]) / 10:
                shown = total
                dt = time.monotonic() - t0
                log(
                    clock,
                    f"data: {done['clips']}/{renderer.counts['clips']} clips, {done['stills']}/"
                    f"{renderer.counts['stills']} stills rendered and encoded ({done['clips'] / dt:,.0f} clips/s, "
                    f"{done['stills'] / dt:,.0f} stills/s)",
                )
            if clock.now() >= end_at:
                break
        else:
            finished = True
    finally:
        renderer.close(finished)
    if not done["clips"]:
        raise RuntimeError(
            f"no clip was rendered and encoded by {end_at:.0f} s (data's share of the deadline): nothing to train on"
        )
    captions = list(table)
    names = [*captions, ""]  # once per unique caption, the empty one (caption dropout's) last
    with torch.no_grad():
        text = torch.cat([encoder.text(names[a : a + 256]) for a in range(0, len(names), 256)])
    cache = Cache(
        clips=store["clips"][: done["clips"]],
        clip_text=torch.tensor(ids["clips"], dtype=torch.long, device=device),
        stills=store["stills"][: done["stills"]] if done["stills"] else None,
        still_text=torch.tensor(ids["stills"], dtype=torch.long, device=device) if done["stills"] else None,
        text=text.to(device),
        captions=captions,
        seconds=time.monotonic() - t0,
        cut_short=not finished,
    )
    if len(cache.text) != len(captions) + 1:
        raise RuntimeError(f"text table has {len(cache.text)} rows, expected {len(captions) + 1} (captions + empty)")
    return cache


class HostEncoder:
    """An :class:`training.encoding.Encoder` whose outputs come back to the CPU: :class:`training.probe.SwapProbe`
    keeps its latents and noise on the CPU and moves each noised batch to the transformer's device."""

    def __init__(self, encoder):
        self.encoder = encoder

    def latents(self, video):
        return self.encoder.latents(video).cpu()

    def text(self, captions):
        return self.encoder.text(captions).cpu()


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Stage:
    """One training phase's recipe: ``steps`` a cap (the time share fits the count), the rest as the configs."""

    name: str
    steps: int
    lr: float
    warmup: int
    ema_decay: float
    image_ratio: float


def train(model, cache: Cache, stage: Stage, s: Settings, end_at: float, clock: Clock, autocast):
    """Flow matching on ``model`` (float32 master weights, all trainable) from ``cache``, as
    :func:`training.finetune.train`'s loop: per step ``s.batch`` clips (and ``round(image_ratio * batch)`` stills in
    their own forward pass, the loss a mean over samples) drawn on the device, caption dropout, AdamW, warm-up and
    cosine, gradient clip, non-finite steps skipped (10 in a row stop it), MHLA mixing projected, EMA updated.
    After 3 untimed and ``s.timed_steps`` timed steps the step count is fitted to ``end_at`` (seconds on
    ``clock``); ``end_at`` also stops it. Returns ``(record, ema)``."""
    import torch

    from training.config import lr_multiplier
    from training.ema import EMA
    from training.finetune import ModelCall, param_groups, project_mixing
    from training.flow import FlowMatching

    device = next(model.parameters()).device
    model.train()
    model.requires_grad_(True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ema = EMA(model, names, stage.ema_decay)
    extra = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(
        param_groups(model, stage.lr, None), betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **extra
    )
    base_lrs = [g["lr"] for g in opt.param_groups]
    flow = FlowMatching()
    call = ModelCall(False, tuple(model.config.patch_size))
    # its own stream per stage (str hashes change from run to run; crc32 does not)
    generator = torch.Generator(device=device).manual_seed(s.seed * 1000 + zlib.crc32(stage.name.encode()) % 1000)
    n_img = round(stage.image_ratio * s.batch) if cache.stills is not None else 0
    params = [p for p in model.parameters() if p.requires_grad]
    total, warmup = stage.steps, stage.warmup
    factor = lr_multiplier("cosine", warmup, total, s.min_lr_ratio)
    losses: list[float] = []
    image_losses: list[float] = []
    step, nonfinite, skipped = 0, 0, 0
    untimed, timed_from, cut = 3, None, False
    t0 = last_t = time.monotonic()
    last_step, grad_norm = 0, None

    def draw(latents_all, text_ids, n):
        idx = torch.randint(len(latents_all), (n,), device=device, generator=generator)
        text = cache.text_batch(text_ids[idx], generator, s.caption_dropout)
        latents = latents_all[idx]
        x_t, t, target = flow.noisy_input(latents, generator)
        with autocast():
            pred = call(model, x_t, t, text)
        return flow.loss(pred, target, latents)

    while step < total:
        if clock.now() >= end_at:
            cut = True
            break
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * factor(step)
        loss_clips = draw(cache.clips, cache.clip_text, s.batch)
        loss = loss_clips
        if n_img:
            loss_stills = draw(cache.stills, cache.still_text, n_img)
            loss = (loss_clips * s.batch + loss_stills * n_img) / (s.batch + n_img)
        value = float(loss.detach())  # waits for the forward passes; a non-finite loss skips the step, as finetune does
        if not math.isfinite(value):
            opt.zero_grad(set_to_none=True)
            nonfinite += 1
            skipped += 1
            log(clock, f"{stage.name}: step {step + 1}: non-finite loss ({value}); skipped ({nonfinite} in a row)")
            if nonfinite >= 10:
                raise RuntimeError(f"{stage.name}: 10 non-finite losses in a row at step {step + 1}; stopped")
            continue
        nonfinite = 0
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        project_mixing(model)
        ema.update(model)
        step += 1
        losses.append(value)
        if n_img:
            image_losses.append(float(loss_stills.detach()))
        if step == untimed:
            timed_from = time.monotonic()
        elif timed_from is not None and step == untimed + s.timed_steps:
            per_step = (time.monotonic() - timed_from) / s.timed_steps
            # 3% kept for the save after the loop and the steps' spread
            fit = step + int(max(0.0, end_at - clock.now()) / per_step * 0.97)
            total = max(step + 1, min(stage.steps, fit))
            warmup = min(stage.warmup, max(1, total // 4))
            factor = lr_multiplier("cosine", warmup, total, s.min_lr_ratio)
            log(
                clock,
                f"{stage.name}: {per_step * 1e3:.1f} ms a step ({s.batch} clips + {n_img} stills): {total} steps "
                f"fit its {max(0.0, end_at - clock.now()):.0f} s (cap {stage.steps}), warm-up {warmup}",
            )
        if step % s.log_every == 0 or step == total:
            dt = time.monotonic() - last_t
            k = step - last_step
            recent = losses[-k:]
            stills = f", stills {sum(image_losses[-k:]) / k:.4f}" if n_img else ""
            log(
                clock,
                f"{stage.name}: step {step}/{total}, loss {sum(recent) / k:.4f}{stills}, lr "
                f"{opt.param_groups[0]['lr']:.2e}, grad norm {float(grad_norm):.3f}, {dt / k * 1e3:.1f} ms/step, "
                f"{(s.batch + n_img) * k / dt:,.0f} samples/s ({s.batch * k / dt:,.0f} clips/s)",
            )
            last_t, last_step = time.monotonic(), step
    seconds = time.monotonic() - t0
    head, tail = losses[: min(20, len(losses))], losses[-min(20, len(losses)) :]
    record = {
        "steps": step,
        "planned_steps": total,
        "cap": stage.steps,
        "cut_short": cut,
        "seconds": round(seconds, 2),
        "ms_per_step": round(seconds / max(step, 1) * 1e3, 2),
        "batch_clips": s.batch,
        "batch_stills": n_img,
        "clips": step * s.batch,
        "stills": step * n_img,
        "samples": step * (s.batch + n_img),
        "samples_per_s": round(step * (s.batch + n_img) / max(seconds, 1e-9), 1),
        "clips_per_s": round(step * s.batch / max(seconds, 1e-9), 1),
        "lr": stage.lr,
        "warmup": warmup,
        "min_lr_ratio": s.min_lr_ratio,
        "ema_decay": stage.ema_decay,
        "ema_updates": ema.updates,
        "caption_dropout": s.caption_dropout,
        "nonfinite_skipped": skipped,
        "loss_first": sum(head) / len(head) if head else None,
        "loss_last": sum(tail) / len(tail) if tail else None,
        "image_loss_last": sum(image_losses[-20:]) / len(image_losses[-20:]) if image_losses else None,
    }
    model.eval()
    return record, ema


def swap_in_ema(model, ema) -> None:
    """The EMA's averages become ``model``'s weights (for good: what a checkpoint's ``transformer/`` holds)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, shadow in ema.shadow.items():
            params[name].copy_(shadow)


def config_layers(variant: str, configs: Path = CONFIGS) -> list[int] | None:
    """The MHLA layers the variant's conversion config names (``model.layers`` of
    ``factory/configs/v3/<variant>.yaml``; None: the default split, as the config's null means)."""
    from omegaconf import OmegaConf

    path = Path(configs) / f"{variant}.yaml"
    layers = OmegaConf.load(path).model.get("layers") if path.is_file() else None
    return None if layers is None else [int(i) for i in layers]


def converted(model, variant: str, grid, block_shape, cpe: bool = True):
    """A copy of ``model`` converted to ``variant`` as :func:`training.finetune.build_model` converts with the
    conversion configs (``factory/configs/v3/<variant>.yaml``): blocks from the model's block shape over the
    training grid, the hybrid's layers (:func:`config_layers`), the paper's CPE (``cpe``), its other attention
    options, float32."""
    from pipelines import AttentionOptions

    copy = model.clone()
    blocks = copy.resolve_blocks(grid, None, block_shape).blocks
    layers = config_layers(variant) if variant == "mhla-hybrid" else None
    copy.convert(variant, layers, AttentionOptions(blocks=blocks, cpe=cpe))
    return copy.float()


# --------------------------------------------------------------------------- what comes back


class Record:
    """``DIR/build.json`` and the parts' float16 safetensors beside it, rewritten (atomically) after each part."""

    def __init__(self, out: Path, work: Path):
        self.out, self.work = out, work
        self.data: dict = {"format": FORMAT, "parts": {}, "results": {"phases": {}}}

    @property
    def results(self) -> dict:
        return self.data["results"]

    def write(self) -> None:
        from common.outputs import write_text_atomic

        write_text_atomic(self.out / BUILD_JSON, json.dumps(self.data, indent=1) + "\n")

    def save_part(self, name: str, model, info: dict) -> str:
        """``model`` saved as the product saves a transformer (:func:`pipelines.save_transformer`, float32),
        then its weights through ``save --half``'s own conversion into ``DIR/<name>.safetensors``; its
        ``config.json`` text, hash and ``info`` into build.json. Returns the file's SHA-256."""
        from common.outputs import atomic_write
        from factory.next import _save_half
        from pipelines import save_transformer
        from pipelines.conversion import CONFIG_KEY

        if name not in PARTS:
            raise ValueError(f"part {name!r}: expected one of {tuple(PARTS)}")
        variant = (model.config.get(CONFIG_KEY) or {}).get("variant", "flash")
        want = name if name in CONVERSIONS else "flash"
        if variant != want:
            raise ValueError(f"part {name!r} must hold a {want!r} transformer, got {variant!r}")
        folder = self.work / "parts" / name
        save_transformer(model, folder)
        dst = self.out / f"{name}.safetensors"
        with atomic_write(dst) as tmp:
            _save_half(folder / WEIGHTS_FILE, tmp)
        size = dst.stat().st_size
        if size > MAX_FILE_BYTES:  # 1.76M parameters are 3.5 MB: a part this large is not this design's
            dst.unlink()
            raise ValueError(
                f"{dst} is {size / 2**20:.1f} MiB, over the device's {MAX_FILE_BYTES / 2**20:.0f} MiB a file"
            )
        digest = sha256(dst)
        self.data["parts"][name] = {
            "file": dst.name,
            "folder": PARTS[name],
            "bytes": size,
            "sha256": digest,
            "config_json": (folder / "config.json").read_text(),
            **info,
        }
        self.write()
        shutil.rmtree(folder, ignore_errors=True)
        return digest


def limits_problems(out: Path) -> list[str]:
    """What in ``out`` the device would not bring back, as sentences: more than ``MAX_FILES - 1`` files (the caller
    adds its log), a file over ``MAX_FILE_BYTES``, one more than a folder below ``out`` (``out`` is one below
    ``$OUT``), a name with other characters than letters, digits, '.', '_' and '-'."""
    files = [f for f in out.rglob("*") if f.is_file()]
    problems = [] if len(files) <= MAX_FILES - 1 else [f"{len(files)} files, over {MAX_FILES - 1}"]
    for f in files:
        rel = f.relative_to(out)
        if f.stat().st_size > MAX_FILE_BYTES:
            problems.append(f"{rel}: {f.stat().st_size / 2**20:.1f} MiB, over {MAX_FILE_BYTES / 2**20:.0f} MiB")
        if len(rel.parts) > 2:
            problems.append(f"{rel}: more than 2 folders below $OUT")
        if not all(NAME_OK.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name the device does not bring back")
    return problems


def prepare_out(out: Path) -> Path:
    """``out`` made, empty but for an earlier build's own files (removed: a new build replaces them); a folder
    holding anything else is refused (the device brings back 8 files at most)."""
    ours = {BUILD_JSON, *(f"{p}.safetensors" for p in PARTS)}
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {str(out)!r} is a file; expected a folder (made if missing)")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
        if foreign:
            raise ValueError(
                f"--out {str(out)!r} holds {', '.join(foreign[:4])}: expected an empty folder or one holding only an "
                f"earlier build's files ({BUILD_JSON}, <part>.safetensors)"
            )
        for name in ours:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


# --------------------------------------------------------------------------- the build


def _scores(verdicts: list[dict], seconds: list[float]) -> dict:
    """The analyser's scores of one variant's videos (:func:`world.analyse.score`), those of its prompts with a
    held-out combination, the mean seconds a video and every video's verdict."""
    from world.analyse import score

    held = [x for x in verdicts if x["held_out"]]
    return {
        **score(verdicts),
        "overall_held_out": score(held)["overall"] if held else None,
        "seconds_per_video": round(sum(seconds) / len(seconds), 3) if seconds else None,
        "per_video": verdicts,
    }


class Build:
    """The phases of one build (see the module docstring), sharing the device, the components and the clock."""

    def __init__(self, out: Path, clock: Clock, s: Settings, phases: list[str], source: Path, dry_run: bool):
        self.out, self.clock, self.s, self.phases, self.source, self.dry_run = out, clock, s, phases, source, dry_run
        self.work = Path(tempfile.mkdtemp(prefix="gpu_build-"))
        self.record = Record(out, self.work)
        self.failed = False
        self.models: dict[str, object] = {}  # variant -> the EMA weights trained here (flash: the base)

    def phase(self, name: str, later: list[str]) -> float | None:
        """The end (seconds on the clock) of ``name``'s share, or None (recorded) when too little time is left."""
        if self.clock.left() <= self.s.min_phase_s:
            self.record.results["phases"][name] = {"skipped": f"deadline: {self.clock.left():.1f} s left"}
            self.record.write()
            log(self.clock, f"{name}: skipped, {self.clock.left():.1f} s left before the deadline")
            self.failed = True
            return None
        return self.clock.share(name, later)

    def fail(self, name: str, error: BaseException) -> None:
        traceback.print_exc()
        self.record.results["phases"][name] = {"error": f"{type(error).__name__}: {error}"}
        self.record.write()
        log(self.clock, f"{name}: FAILED ({type(error).__name__}: {error})")
        self.failed = True

    def run(self) -> int:
        import torch

        s, clock, res = self.s, self.clock, self.record.results
        res.update(
            settings=asdict(s),
            deadline_s=clock.deadline_s,
            dry_run=self.dry_run,
            requested=list(self.phases),
            source=str(self.source),
        )
        self.record.data["source"] = {k: sha256(self.source / f) for k, f in SOURCE_FILES.items()}
        self.record.write()
        training = [p for p in ("base", "convert") if p in self.phases]
        if clock.left() <= s.min_phase_s:
            for p in (["data"] if training else []) + self.phases:
                self.phase(p, [p])
            return self.finish()
        # the render workers fork now, before CUDA starts, and render while the parent loads the model
        renderer = None
        if training:
            try:
                renderer = Renderer(s.clips, s.stills, s.seed, s.workers)
            except Exception as e:  # no worker processes here (their locks need /dev/shm): slower, in this one
                log(clock, f"data: no render workers ({type(e).__name__}: {e}); rendering in this process")
                renderer = Renderer(s.clips, s.stills, s.seed, inline=True)
        if renderer is not None:
            log(
                clock,
                f"data: rendering {s.clips} clips, {s.stills} stills ({renderer.workers} workers, {renderer.method})",
            )
        try:
            self.set_up()
        except Exception as e:
            if renderer is not None:
                renderer.close(False)
            self.fail("setup", e)
            return self.finish()
        cache = None
        if renderer is not None:
            end = self.phase("data", ["data", *self.phases])
            if end is None:
                renderer.close(False)
            else:
                try:
                    cache = encode_rendered(renderer, self.encoder, end, clock)
                    res["phases"]["data"] = {
                        "clips": len(cache.clips),
                        "stills": 0 if cache.stills is None else len(cache.stills),
                        "captions": len(cache.captions),
                        "seconds": round(cache.seconds, 2),
                        "cut_short": cache.cut_short,
                        "latent_shape": list(cache.clips.shape[1:]),
                        "device_bytes": int(
                            cache.clips.numel() * 4 + (0 if cache.stills is None else cache.stills.numel() * 4)
                        ),
                    }
                    log(
                        clock,
                        f"data: {len(cache.clips)} clips {tuple(cache.clips.shape[1:])} and "
                        f"{res['phases']['data']['stills']} stills on {self.device} in {cache.seconds:.1f} s, "
                        f"{len(cache.captions)} unique captions"
                        + (" (CUT SHORT by its share)" if cache.cut_short else ""),
                    )
                except Exception as e:
                    self.fail("data", e)
                self.record.write()
        autocast = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            if self.device.type == "cuda"
            else (lambda: torch.autocast(self.device.type, enabled=False))
        )
        if "base" in self.phases and cache is not None:
            self.base(cache, autocast)
        if "convert" in self.phases and cache is not None:
            self.convert(cache, autocast)
        if "eval" in self.phases:
            self.evaluate()
        return self.finish()

    def set_up(self) -> None:
        """The working model folder (:func:`factory.v3.init` from the source design) and its components on the
        device, float32 (the text encoder and VAE frozen, as a run loads them)."""
        import torch

        from factory.v3 import DEFAULTS, init
        from pipelines import latent_grid, load_components
        from pipelines.loading import resolve_device
        from training.encoding import Encoder

        self.device = resolve_device(self.s.device)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # the VAE's convolutions see one chunk shape per kind
        t0 = time.monotonic()
        model_dir = init(self.work / "model", next_dir=self.source)
        self.components = load_components(model_dir, dtype=torch.float32, device=self.device)
        for part in (self.components.text_encoder, self.components.vae):
            part.requires_grad_(False)
        self.encoder = Encoder(self.components, DEFAULTS["max_sequence_length"])
        patch = tuple(self.components.transformer.config.patch_size)
        self.grid = latent_grid(
            DEFAULTS["height"], DEFAULTS["width"], DEFAULTS["num_frames"], patch, self.components.vae_stride
        )
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        self.record.results["machine"] = {
            "device": str(self.device),
            "name": name,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        }
        log(
            self.clock,
            f"setup: {self.components.source} on {self.device} ({name}) in {time.monotonic() - t0:.1f} s; grid "
            f"{'x'.join(map(str, self.grid))}, block shape {self.components.block_shape}",
        )

    def base(self, cache: Cache, autocast) -> None:
        import torch

        from pipelines import AttentionOptions, load_transformer

        end = self.phase("base", self.phases)
        if end is None:
            return
        s = self.s
        try:
            start = self.source / "transformer"
            model = load_transformer(start, dtype=torch.float32, device=self.device)
            # save_pretrained writes where the weights came from: the repository's path, not this machine's
            model.register_to_config(_name_or_path=repo_path(start))
            blocks = model.resolve_blocks(self.grid, None, self.components.block_shape).blocks
            model.convert("flash", None, AttentionOptions(blocks=blocks)).float()
            stage = Stage("base", s.base_steps, s.base_lr, s.base_warmup, s.base_ema, s.image_ratio)
            log(self.clock, f"base: from {start}, until {end:.0f} s")
            result, ema = train(model, cache, stage, s, end, self.clock, autocast)
            result["from"] = str(start)
            self.record.results["phases"]["base"] = result
            if not result["steps"]:
                raise RuntimeError("no step finished before the base's share of the deadline: nothing to save")
            info = {"phase": "base", "steps": result["steps"], "cut_short": result["cut_short"]}
            self.record.save_part("transformer", model, {**info, "weights": "raw"})
            swap_in_ema(model, ema)
            self.ema_sha = self.record.save_part("transformer-ema", model, {**info, "weights": "ema"})
            self.models["flash"] = model
            log(
                self.clock,
                f"base: {result['steps']} steps, {result['samples']:,} samples ({result['clips']:,} clips, "
                f"{result['stills']:,} stills) in {result['seconds']:.0f} s, {result['samples_per_s']:,.0f} samples/s; "
                f"loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}; wrote transformer, transformer-ema",
            )
        except Exception as e:
            self.fail("base", e)

    def convert(self, cache: Cache, autocast) -> None:
        import torch

        from pipelines import load_transformer

        s = self.s
        base = self.models.get("flash")
        origin = "this build's base EMA"
        if base is None:  # no base trained here: the committed one (what the committed base's variants start from)
            try:
                base = load_transformer(self.source / "transformer-ema", dtype=torch.float32, device=self.device)
                base.register_to_config(_name_or_path=repo_path(self.source / "transformer-ema"))
                self.ema_sha = sha256(self.source / "transformer-ema" / WEIGHTS_FILE)
                self.models["flash"] = base
                origin = f"the committed {self.source / 'transformer-ema'}"
            except Exception as e:
                self.fail("convert", e)
                return
        results = self.record.results["phases"].setdefault("convert", {"from": origin})
        cap = s.convert_steps
        for i, variant in enumerate(CONVERSIONS):
            # each conversion an equal share of what convert's weight gives the remaining ones
            if self.clock.left() <= s.min_phase_s:
                results[variant] = {"skipped": f"deadline: {self.clock.left():.1f} s left"}
                self.failed = True
                log(self.clock, f"{variant}: skipped, {self.clock.left():.1f} s left")
                continue
            later = [p for p in self.phases if p != "base"]
            end = self.clock.now() + (self.clock.share("convert", later) - self.clock.now()) / (len(CONVERSIONS) - i)
            try:
                model = converted(base, variant, self.grid, self.components.block_shape, s.convert_cpe)
                stage = Stage(variant, cap, s.convert_lr, s.convert_warmup, s.convert_ema, s.convert_image_ratio)
                log(self.clock, f"{variant}: converted from {origin}, until {end:.0f} s")
                result, ema = train(model, cache, stage, s, end, self.clock, autocast)
                results[variant] = result
                if not result["steps"]:
                    raise RuntimeError(f"no step of {variant} finished before its share of the deadline")
                if i == 0 or cap == s.convert_steps:  # the first one's fitted count is the shared budget
                    cap = result["planned_steps"]
                swap_in_ema(model, ema)
                info = {
                    "phase": "convert",
                    "steps": result["steps"],
                    "cut_short": result["cut_short"],
                    "weights": "ema",
                    "base_ema_sha256": self.ema_sha,
                }
                self.record.save_part(variant, model, info)
                self.models[variant] = model
                log(
                    self.clock,
                    f"{variant}: {result['steps']} steps in {result['seconds']:.0f} s, {result['samples_per_s']:,.0f} "
                    f"samples/s; loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}; wrote {variant}",
                )
            except Exception as e:
                traceback.print_exc()
                results[variant] = {"error": f"{type(e).__name__}: {e}"}
                self.failed = True
                log(self.clock, f"{variant}: FAILED ({type(e).__name__}: {e})")
            self.record.write()

    def evaluate(self) -> None:
        """The swap probe, the held-out loss and rounds of generated videos judged by the analyser, for the base's
        EMA (flash) and each conversion trained here."""
        import torch

        from factory import world_clips
        from factory.evaluate import heldout_loss, semantic
        from factory.v3 import DEFAULTS, WORLD
        from training.probe import SwapProbe, describe
        from world.synthetic import world_named

        if not self.models:
            self.record.results["phases"]["eval"] = {"skipped": "no transformer trained in this build"}
            log(self.clock, "eval: skipped, nothing trained in this build")
            return
        end = self.phase("eval", ["eval"])
        if end is None:
            return
        s, res = self.s, self.record.results["phases"].setdefault("eval", {})
        models = {v: m.eval() for v, m in self.models.items()}
        world = world_named(WORLD)
        d = DEFAULTS
        try:
            t0 = time.monotonic()
            probe = SwapProbe(
                HostEncoder(self.encoder), world, d["num_frames"], d["height"], d["width"], s.probe_clips, seed=s.seed
            )
            res["probe"] = {}
            for v, m in models.items():
                res["probe"][v] = probe(m)
                log(self.clock, f"eval: probe [{v}] {describe(res['probe'][v])}")
            validation = world_clips(max(s.eval_prompts, s.loss_batches * s.loss_batch_size), d, world)
            with torch.no_grad():
                res["heldout_loss"] = heldout_loss(
                    self.components, models, validation, s.loss_batches, s.loss_batch_size, draws=2
                )
            log(
                self.clock,
                "eval: held-out flow loss "
                + ", ".join(f"{v} {x['mean']:.4f}" for v, x in res["heldout_loss"].items())
                + f" ({time.monotonic() - t0:.1f} s with the probe)",
            )
            self.record.write()
            steps = s.eval_steps or self.components.defaults["num_inference_steps"]
            guidance = self.components.defaults["guidance_scale"]
            seeds = list(range(s.eval_seeds))
            verdicts: dict[str, list] = {v: [] for v in models}
            timing: dict[str, list] = {v: [] for v in models}
            round_s = 0.0
            for a in range(0, s.eval_prompts, s.eval_round):
                # a round runs every variant on the same prompts, so the scores compare; one that would overrun is left
                if self.clock.now() + round_s > end:
                    break
                t1 = time.monotonic()
                prompts = list(range(a, min(s.eval_prompts, a + s.eval_round)))
                for v, m in models.items():
                    row, _ = semantic(self.components, m, v, validation, prompts, seeds, steps, guidance)
                    verdicts[v] += row["per_video"]
                    timing[v].append(row["total_s"])
                round_s = time.monotonic() - t1
                res["semantic"] = {v: _scores(verdicts[v], timing[v]) for v in models}  # written after every round
                res.update(
                    prompts=a + len(prompts),
                    seeds=seeds,
                    num_inference_steps=steps,
                    guidance_scale=guidance,
                    seconds=round(time.monotonic() - t0, 2),
                )
                self.record.write()
            for v, r in res.get("semantic", {}).items():
                log(
                    self.clock,
                    f"eval [{v}]: {r['videos']} videos: overall {r['overall']:.2f} (colour {r['colour']}, shape "
                    f"{r['shape']}, count {r['count']}, motion {r['motion']})",
                )
        except Exception as e:
            self.fail("eval", e)
        self.record.write()

    def finish(self) -> int:
        done = sorted(self.record.data["parts"])
        res = self.record.results
        res["seconds"] = round(self.clock.now(), 2)
        res["complete"] = not self.failed
        self.record.write()
        shutil.rmtree(self.work, ignore_errors=True)
        for problem in limits_problems(self.out):  # what the device would not bring back
            log(self.clock, f"LIMITS: {problem}")
            self.failed = True
        files = sorted(p.name for p in self.out.iterdir())
        log(
            self.clock,
            f"done: {'every phase ran' if not self.failed else 'a phase SKIPPED or FAILED (see above)'}; parts "
            f"{', '.join(done) or 'none'}; {self.out} holds {', '.join(files)} "
            f"({sum(p.stat().st_size for p in self.out.iterdir() if p.is_file()) / 2**20:.1f} MiB)",
        )
        return 1 if self.failed else 0


# --------------------------------------------------------------------------- import


def read_build(build_dir: Path) -> dict:
    """``build_dir/build.json``, every part's file checked (name, size, SHA-256); a ValueError names what is wrong."""
    path = build_dir / BUILD_JSON
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(build_dir)!r} has no {BUILD_JSON}; expected a folder written by factory.gpu_build"
        )
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT}")
    for name, part in data["parts"].items():
        if name not in PARTS or part.get("folder") != PARTS[name] or part.get("file") != f"{name}.safetensors":
            raise ValueError(
                f"{path}: part {name!r} (file {part.get('file')!r}, folder {part.get('folder')!r}); expected one of "
                f"{PARTS}, in <part>.safetensors"
            )
        file = build_dir / part["file"]
        if not file.is_file() or sha256(file) != part["sha256"]:
            raise ValueError(f"{file}: missing or not the file build.json hashed (SHA-256 {part['sha256'][:12]}...)")
    return data


def import_build(build_dir: Path, into: Path) -> list[Path]:
    """Lays a build's parts into the design folder ``into`` (e.g. ``assets/builtin-next/v3``) as ``factory.next
    save-checkpoint --half`` / ``save-variant`` would: ``PART/config.json`` (the text the build saved) and
    ``PART/diffusion_pytorch_model.safetensors`` (float16, as ``save --half`` wrote it). All or nothing: every
    part is staged, checked and loaded first, then the folders are swapped in, an earlier one moved back if a
    later swap fails. Returns the folders written."""
    import torch

    from factory.next import MAX_MB, _budget_root
    from pipelines import load_transformer
    from pipelines.conversion import CONFIG_KEY

    into = Path(into)
    data = read_build(Path(build_dir))
    parts = data["parts"]
    if not parts:
        raise ValueError(f"{build_dir} holds no finished part (its build was cut short before any): nothing to import")
    if not (into / "vae" / "config.json").is_file():
        raise ValueError(f"--into {str(into)!r}: expected a design's folder (with vae/), e.g. assets/builtin-next/v3")
    for key, rel in SOURCE_FILES.items():  # the latents and captions the parts were trained on
        here = into / rel
        if not here.is_file() or sha256(here) != data["source"][key]:
            raise ValueError(
                f"{here} is not the {key} the build encoded with (SHA-256 {data['source'][key][:12]}...): its "
                "transformers would not fit this design"
            )
    ema_after = parts["transformer-ema"]["sha256"] if "transformer-ema" in parts else None
    if ema_after is None and (into / "transformer-ema" / WEIGHTS_FILE).is_file():
        ema_after = sha256(into / "transformer-ema" / WEIGHTS_FILE)
    for name in CONVERSIONS:
        if name in parts and parts[name]["base_ema_sha256"] != ema_after:
            raise ValueError(
                f"part {name!r} was converted from a base EMA (SHA-256 {parts[name]['base_ema_sha256'][:12]}...) that "
                f"is not the transformer-ema {into} would hold: import the build's transformer-ema with it"
            )
    stage, old = into / ".gpu-import.new", into / ".gpu-import.old"
    for folder in (stage, old):
        shutil.rmtree(folder, ignore_errors=True)
    written: list[Path] = []
    moved: list[tuple[Path, Path]] = []  # (where it was, where it went): undone on failure
    try:
        for name, part in parts.items():
            staged = stage / part["folder"]
            staged.mkdir(parents=True)
            (staged / "config.json").write_text(part["config_json"])
            shutil.copyfile(Path(build_dir) / part["file"], staged / WEIGHTS_FILE)
            model = load_transformer(staged, dtype=torch.float32, device="cpu")  # what the product's loader accepts
            got = (model.config.get(CONFIG_KEY) or {}).get("variant", "flash")
            if got != (name if name in CONVERSIONS else "flash"):
                raise ValueError(f"part {name!r} holds a {got!r} transformer")
            del model
        root = _budget_root(into)
        replaced = [into / p["folder"] for p in parts.values()]
        others = sum(
            f.stat().st_size
            for f in root.rglob("*")
            if f.is_file() and stage not in f.parents and not any(r in f.parents for r in replaced)
        )
        total = (others + sum(f.stat().st_size for f in stage.rglob("*") if f.is_file())) / 2**20
        if total > MAX_MB:
            raise ValueError(f"{root} would hold {total:.1f} MB, over its {MAX_MB} MB budget")
        for part in parts.values():
            dst, new = into / part["folder"], stage / part["folder"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.exists():
                aside = old / part["folder"]
                aside.parent.mkdir(parents=True, exist_ok=True)
                os.replace(dst, aside)
                moved.append((dst, aside))
            os.replace(new, dst)
            written.append(dst)
    except BaseException:
        for dst in written:
            shutil.rmtree(dst, ignore_errors=True)
        for dst, aside in reversed(moved):
            os.replace(aside, dst)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    stale = [v for v in CONVERSIONS if v not in parts and (into / PARTS[v] / "config.json").is_file()]
    if "transformer-ema" in parts and stale:
        print(
            f"warning: {', '.join(f'{into / PARTS[v]}' for v in stale)} were converted from the earlier base EMA; "
            "retrain them from the new one (this build did not finish them)",
            file=sys.stderr,
        )
    results = data["results"]
    print(
        f"wrote {', '.join(str(w) for w in written)} from {build_dir} (built in {results.get('seconds')} s"
        + ("" if results.get("complete") else ", a phase skipped or failed: see its build.json")
        + ")"
    )
    return written


# --------------------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected an integer >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m factory.gpu_build", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder the parts and build.json go to (e.g. $OUT/builtin)")
    p.add_argument("--deadline-s", type=float, required=True, help="seconds from start by which every file is written")
    p.add_argument("--dry-run", action="store_true", help="tiny counts, CPU, float32 (the test): every phase and file")
    p.add_argument("--source", default=None, help="the design's committed folder (default assets/builtin-next/v3)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"some of {','.join(PHASES)} (data goes with training)")
    for name, kind in (
        ("clips", _positive_int),
        ("stills", int),
        ("batch", _positive_int),
        ("image-ratio", float),
        ("base-steps", _positive_int),
        ("base-lr", float),
        ("convert-steps", _positive_int),
        ("convert-lr", float),
        ("eval-prompts", _positive_int),
        ("eval-seeds", _positive_int),
        ("workers", int),
        ("seed", int),
    ):
        p.add_argument(f"--{name}", type=kind, default=None, help="default: the real run's (module docstring) or DRY's")
    p.add_argument(
        "--device", default=None, help="auto (a CUDA GPU; the real build refuses to run without one), cpu, cuda"
    )
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    """The preset (:class:`Settings` or :data:`DRY`) with the options given; a ValueError names a bad value."""
    s = DRY if args.dry_run else Settings()
    given = {
        k: getattr(args, k)
        for k in (
            "clips",
            "stills",
            "batch",
            "image_ratio",
            "base_steps",
            "base_lr",
            "convert_steps",
            "convert_lr",
            "eval_prompts",
            "eval_seeds",
            "workers",
            "seed",
            "device",
        )
        if getattr(args, k) is not None
    }
    s = replace(s, **given)
    if s.stills < 0 or s.workers < 0:
        raise ValueError(f"--stills {s.stills}, --workers {s.workers}: expected >= 0")
    if not (s.image_ratio >= 0 and math.isfinite(s.image_ratio)):
        raise ValueError(f"--image-ratio {s.image_ratio}: expected a finite ratio >= 0 (stills per clip)")
    for name in ("base_lr", "convert_lr"):
        if not (getattr(s, name) > 0 and math.isfinite(getattr(s, name))):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)}: expected a learning rate > 0")
    return s


def build_main(argv: list[str], started: float | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("MHLA_AUTOTUNE", "0")  # autotuning compiles every kernel configuration: minutes it lacks
    os.environ.setdefault("TQDM_DISABLE", "1")  # the evaluation's progress bars, one per round, flood the log
    # benchmarks/run_gpu.sh makes the fused kernels' fall-back warning an error (its timings must not time the
    # PyTorch path); a build needs the right numbers, not the fast path: it trains on, slower, and the log says so
    warnings.filterwarnings("default", message="MHLA Triton kernels failed")
    if not (math.isfinite(args.deadline_s) and args.deadline_s >= 0):
        raise ValueError(f"--deadline-s {args.deadline_s}: expected seconds >= 0")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise ValueError(f"--phases {args.phases!r}: expected some of {','.join(PHASES)}")
    phases = [p for p in PHASES if p in phases]
    if phases == ["eval"]:
        raise ValueError("--phases eval: the evaluation judges what this build trains; add base or convert")
    s = settings_from(args)
    from factory.v3 import NEXT

    source = Path(args.source) if args.source else NEXT
    if not (source / "transformer" / "config.json").is_file() or not (source / "vae" / "config.json").is_file():
        raise ValueError(f"--source {str(source)!r}: expected the design's folder (transformer/, vae/, text_encoder/)")
    if s.device == "auto" and not args.dry_run:
        import torch

        if not torch.cuda.is_available():  # (CUDA's driver only: the render workers still fork cleanly after it)
            raise ValueError(
                "the real build needs a CUDA GPU (none here); --dry-run runs the CPU path, --device cpu forces it"
            )
    out = prepare_out(Path(args.out))
    clock = Clock(args.deadline_s, s.reserve_s, started)
    log(
        clock,
        f"build to {out}, deadline {args.deadline_s:g} s, phases {','.join(phases)}"
        + (" (dry run)" if args.dry_run else ""),
    )
    return Build(out, clock, s, phases, source, args.dry_run).run()


def import_main(argv: list[str]) -> int:
    from factory.v3 import NEXT

    p = argparse.ArgumentParser(prog="python -m factory.gpu_build import", description="a build's parts into the tree")
    p.add_argument("build", help="the folder a build wrote (its --out, as the device brought it back)")
    p.add_argument("--into", default=str(NEXT), help="the design's folder (default %(default)s)")
    args = p.parse_args(argv)
    import_build(Path(args.build), Path(args.into))
    return 0


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """``python -m factory.gpu_build --out DIR --deadline-s S [...]`` (exit 0: every phase ran and wrote what it
    trained, one its time share stopped short of its planned steps too (build.json: ``cut_short``); 1: a phase was
    skipped for the deadline or failed, what finished is in DIR) or ``... import DIR [--into FOLDER]``; 2: a bad
    argument or input.
    The deadline counts from ``started`` (a ``time.monotonic()`` reading; the command passes its module's import,
    a caller in-process its call)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["import"]:
            return import_main(argv[1:])
        return build_main(argv, started)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(started=_STARTED))

"""Live previews: while a compare run goes, each variant's column shows its latest denoised estimate every few steps,
as a picture (issue 52 (3)).

Decoding a latent with the VAE at every preview would cost about as much as the run's final decode, each time. A
preview maps latents to colours instead with one linear map per VAE, ``rgb = W z + b`` per latent pixel
(:class:`LatentMap`), fitted once by least squares (:func:`fit_latent_map`) on latents the VAE itself decoded: the
map predicts the mean colour of the pixels each latent pixel stands for (its ``t x h x w`` patch of the video). The
built-in model's VAE is fitted on clips of its synthetic world encoded and decoded again (latents like the ones it
makes); any other model's on random latents decoded (:func:`fit_for`). The map is kept in memory per VAE
(:func:`latent_map`); nothing is written to disk.

What is mapped: the scheduler's latest denoised estimate (x0) where it keeps one (UniPC and DPM-Solver++, Wan's
schedulers, as ``predict_x0``), else the current latents (:func:`denoised`). One frame is shown, the middle one,
upsampled to the video's size (at most :data:`PREVIEW_WIDTH` px wide) as a JPEG inside the column's HTML: a data
URL, so no file is written to gradio's cache per preview.
"""

from __future__ import annotations

import base64
import html
import io
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PREVIEW_EVERY = 4  # the page's default: a preview every this many denoising steps (0: none)
PREVIEW_WIDTH = 320  # px: wider videos are previewed smaller (a column is about this wide)
# the fit: many small clips rather than a few large ones (the map is per latent pixel, and the colours of many
# scenes matter more than their size: on the built-in model's VAE, 32 clips of 4x5 latent pixels predicted held-out
# clips' colours with a third of the error of 3 clips of 16x20, at a quarter of the decoding), decoded in one batch
# (24 clips: 5.3 s on this CPU at a load of 3 per core, 14 s in batches of 8)
FIT_CLIPS = 24
FIT_LATENT = (4, 5)  # latent pixels (height, width) of a fitting clip; three latent frames
FIT_BATCH = 24  # clips decoded at once


@dataclass(frozen=True)
class LatentMap:
    """Latent channels to RGB: ``rgb = weight @ z + bias`` per latent pixel, ``weight`` ``(3, C)``, ``bias``
    ``(3,)``, in the video's [0, 1] colour range."""

    weight: torch.Tensor
    bias: torch.Tensor

    def rgb(self, latents: torch.Tensor) -> torch.Tensor:
        """``(C, F, h, w)`` latents (or ``(1, C, F, h, w)``) -> ``(F, h, w, 3)`` float32 colours clamped to [0, 1]."""
        z = latents[0] if latents.dim() == 5 else latents
        if z.dim() != 4 or z.shape[0] != self.weight.shape[1]:
            raise ValueError(
                f"latents of shape {tuple(latents.shape)}: expected (C, F, h, w) or (1, C, F, h, w) with "
                f"C = {self.weight.shape[1]} channels"
            )
        flat = z.detach().float().cpu().reshape(z.shape[0], -1)
        out = (self.weight @ flat + self.bias[:, None]).reshape(3, *z.shape[1:])
        return out.permute(1, 2, 3, 0).clamp(0.0, 1.0)

    def frame(self, latents: torch.Tensor, height: int, width: int, index: int | None = None) -> np.ndarray:
        """One latent frame (default the middle one) mapped and upsampled (bilinear) to ``height x width``:
        ``(height, width, 3)`` uint8. Only that frame's latents are mapped."""
        z = latents[0] if latents.dim() == 5 else latents
        f = z.shape[1] // 2 if index is None else index
        rgb = self.rgb(z[:, f : f + 1])[0]  # (h, w, 3)
        up = F.interpolate(rgb.permute(2, 0, 1)[None], size=(height, width), mode="bilinear", align_corners=False)
        return (up[0].permute(1, 2, 0).clamp(0, 1) * 255 + 0.5).to(torch.uint8).numpy()


def patch_means(videos: torch.Tensor, stride: tuple[int, int, int], latent_shape: tuple[int, int, int]) -> torch.Tensor:
    """The mean colour of the pixels each latent pixel stands for: ``videos`` ``(B, 3, T, H, W)`` ->
    ``(B, F, h, w, 3)`` for latents ``(F, h, w)``. Wan's VAEs keep the first frame alone (latent frame 0 is video
    frame 0) and fold each later ``t`` frames into one (latent frame ``f >= 1`` is frames ``(f-1)t+1 ... ft``);
    space folds ``h x w`` patches."""
    st, sh, sw = stride
    frames, h, w = latent_shape
    if videos.shape[2] < (frames - 1) * st + 1 or videos.shape[3] < h * sh or videos.shape[4] < w * sw:
        raise ValueError(f"videos {tuple(videos.shape)} are too small for latents {latent_shape} at stride {stride}")
    groups = [videos[:, :, :1]] + [videos[:, :, (f - 1) * st + 1 : f * st + 1] for f in range(1, frames)]
    means = torch.stack([g.mean(dim=2) for g in groups], dim=2)  # (B, 3, F, H, W)
    b = means.shape[0]
    pooled = F.avg_pool2d(means[..., : h * sh, : w * sw].reshape(b * 3 * frames, 1, h * sh, w * sw), (sh, sw)).reshape(
        b, 3, frames, h, w
    )
    return pooled.permute(0, 2, 3, 4, 1)


def fit_latent_map(latents: torch.Tensor, videos: torch.Tensor, stride: tuple[int, int, int]) -> LatentMap:
    """The least-squares :class:`LatentMap` from ``latents`` ``(B, C, F, h, w)`` to the :func:`patch_means` of
    ``videos`` ``(B, 3, T, H, W)`` in [0, 1] (each latent pixel one sample; a bias column)."""
    b, c, frames, h, w = latents.shape
    targets = patch_means(videos.float().cpu(), stride, (frames, h, w)).reshape(-1, 3).double()
    x = latents.detach().float().cpu().permute(0, 2, 3, 4, 1).reshape(-1, c).double()
    if x.shape[0] <= c:
        raise ValueError(f"{x.shape[0]} latent pixels cannot fit a map of {c} channels and a bias: need more")
    design = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    solution = torch.linalg.lstsq(design, targets).solution  # (C + 1, 3)
    return LatentMap(solution[:c].T.float().contiguous(), solution[c].float().contiguous())


def vae_decode(components: Any, latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's decode: normalised latents ``(B, C, F, h, w)`` -> videos ``(B, 3, T, H, W)`` float32 in [0, 1]
    (``WanPipeline`` un-normalises with the VAE's ``latents_mean``/``latents_std`` and maps [-1, 1] to [0, 1])."""
    vae = components.vae
    mean, std = _stats(vae.config)
    p = next(vae.parameters())
    z = latents.float() * std + mean
    video = vae.decode(z.to(p.device, p.dtype), return_dict=False)[0]
    return ((video.float().cpu() + 1) / 2).clamp(0, 1)


def vae_encode(components: Any, videos: torch.Tensor) -> torch.Tensor:
    """Videos ``(B, 3, T, H, W)`` in [0, 1] -> normalised latents (the posterior mean), as training encodes."""
    vae = components.vae
    mean, std = _stats(vae.config)
    p = next(vae.parameters())
    z = vae.encode((videos * 2 - 1).to(p.device, p.dtype)).latent_dist.mean.float().cpu()
    return (z - mean) / std


def _stats(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
    return mean, std


# a model's own clips to fit on: (count, frames, height, width, seed) -> uint8 frames (count, frames, height, width, 3)
ClipSource = Callable[[int, int, int, int, int], np.ndarray]


def fitting_latents(
    components: Any, clip_source: ClipSource | None = None, clips: int = FIT_CLIPS, seed: int = 0
) -> torch.Tensor:
    """Latents to fit on, normalised ``(clips, C, 3, h, w)`` with ``(h, w)`` = :data:`FIT_LATENT`: ``clip_source``'s
    clips encoded (the built-in model's world, given by the launcher: clips like those it draws), else random (a
    standard normal, the denoising's start)."""
    st, sh, sw = components.vae_stride
    height, width = FIT_LATENT[0] * sh, FIT_LATENT[1] * sw
    frames = 2 * st + 1  # three latent frames
    if clip_source is not None:
        videos = torch.from_numpy(np.ascontiguousarray(clip_source(clips, frames, height, width, seed)))
        return vae_encode(components, videos.permute(0, 4, 1, 2, 3).float() / 255)
    generator = torch.Generator().manual_seed(seed)
    channels = components.vae.config.z_dim
    return torch.randn(clips, channels, 3, height // sh, width // sw, generator=generator)


@torch.no_grad()
def fit_for(components: Any, clip_source: ClipSource | None = None, clips: int = FIT_CLIPS, seed: int = 0) -> LatentMap:
    """A model's :class:`LatentMap`, fitted on :func:`fitting_latents` decoded by its VAE."""
    latents = fitting_latents(components, clip_source, clips, seed)
    videos = torch.cat([vae_decode(components, z) for z in latents.split(FIT_BATCH)])
    return fit_latent_map(latents, videos, components.vae_stride)


_MAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # VAE module -> (LatentMap, seconds to fit)
_LOCK = threading.Lock()


def latent_map(models: Any) -> LatentMap:
    """The served model's :class:`LatentMap`, fitted on first use (the warm-up's) and kept while its VAE lives."""
    vae = models.components.vae
    with _LOCK:  # one fit even when several variants' first previews ask at once
        if vae not in _MAPS:
            start = time.perf_counter()
            fitted = fit_for(models.components, getattr(models, "clip_source", None))
            _MAPS[vae] = (fitted, time.perf_counter() - start)
        return _MAPS[vae][0]


def fit_seconds(models: Any) -> float | None:
    """How long fitting the served model's map took (None: not fitted yet)."""
    with _LOCK:
        entry = _MAPS.get(models.components.vae)
    return None if entry is None else entry[1]


def denoised(latents: torch.Tensor, scheduler: Any) -> tuple[torch.Tensor, bool]:
    """The best picture of the video so far: the scheduler's latest denoised estimate (x0) where it keeps one
    (UniPC with ``predict_x0``, DPM-Solver++: their latest converted model output), else the latents themselves.
    Returns ``(latents, is_estimate)``."""
    outputs = getattr(scheduler, "model_outputs", None)
    algorithm = str(getattr(getattr(scheduler, "config", None), "algorithm_type", ""))
    keeps_x0 = getattr(scheduler, "predict_x0", False) is True or algorithm in ("dpmsolver++", "sde-dpmsolver++")
    if keeps_x0 and outputs and isinstance(outputs[-1], torch.Tensor) and outputs[-1].shape == latents.shape:
        return outputs[-1], True
    return latents, False


def preview_html(frame: np.ndarray, name: str, step: int, steps: int, estimate: bool = True) -> str:
    """A preview as the column's HTML: the frame as a JPEG data URL under its label ``preview, step k/n``."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=85)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    label = f"preview, step {step}/{steps}"
    what = "denoised estimate" if estimate else "current latents"
    return (
        f'<div class="preview" data-step="{step}" data-steps="{steps}">'
        f'<img src="data:image/jpeg;base64,{data}" alt="{html.escape(name)} {label}" style="width:100%">'
        f"<div><b>{label}</b> · {what}, middle frame, a fast colour map (the video follows)</div></div>"
    )


def make_previewer(
    models: Any,
    height: int,
    width: int,
    every: int,
    steps: int,
    show: Callable[[int, np.ndarray, bool], None],
    spent: list[float] | None = None,
) -> Callable[[int, torch.Tensor, Any], None] | None:
    """The ``on_step`` hook of :func:`pipelines.pipeline.generate` that previews every ``every`` steps (none at the
    last step: the video follows; None when ``every`` < 1): ``show(step, frame, is_estimate)`` gets the
    ``(h, w, 3)`` uint8 frame, at most :data:`PREVIEW_WIDTH` wide. ``spent`` gets the seconds each preview took."""
    if every < 1:
        return None
    scale = min(1.0, PREVIEW_WIDTH / width)
    size = (max(1, round(height * scale)), max(1, round(width * scale)))

    failed = []

    def on_step(i: int, latents: torch.Tensor, scheduler: Any) -> None:
        step = i + 1
        if step % every or step >= steps or failed:
            return
        start = time.perf_counter()
        try:
            z, estimate = denoised(latents, scheduler)
            frame = latent_map(models).frame(z, *size)
        except Exception:  # noqa: BLE001 - a preview is never worth a variant's run: this run shows no more
            log.exception("live preview failed; no more previews in this run")
            failed.append(step)
            return
        show(step, frame, estimate)
        if spent is not None:
            spent.append(time.perf_counter() - start)

    return on_step

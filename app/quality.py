"""Quality beside speed: each variant's video against the flash video of the same prompt and seed.

PSNR and SSIM are the measures sparse- and linear-attention papers report against the dense output.
Both are written out plainly here (numpy and one torch convolution) so a test can check them against
values computed by hand. A model that has an analyser of its videos (the built-in model) hands it to the
app as ``AppModels.judge`` (see ``run_app.py``); ``app/`` itself never imports the analyser.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, for data in [0, 1]
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_C1 = (0.01 * 1.0) ** 2
SSIM_C2 = (0.03 * 1.0) ** 2


def _as_float(frames) -> np.ndarray:
    """``(T, H, W, 3)`` frames as float64 in [0, 1] (uint8 frames are divided by 255)."""
    a = np.asarray(frames)
    if a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3), got shape {a.shape}")
    return a.astype(np.float64) / 255.0 if a.dtype == np.uint8 else a.astype(np.float64)


def _check_pair(video, reference) -> tuple[np.ndarray, np.ndarray]:
    x, y = _as_float(video), _as_float(reference)
    if x.shape != y.shape:
        raise ValueError(f"videos to compare must have the same shape, got {x.shape} and {y.shape}")
    return x, y


def psnr(video, reference) -> float:
    """Peak signal-to-noise ratio in dB over all frames and channels, peak 1.0: ``10 log10(1 / MSE)``
    (``inf`` for identical videos)."""
    x, y = _check_pair(video, reference)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _luma(frames: np.ndarray) -> np.ndarray:
    """ITU-R BT.601 luma, as SSIM is usually reported on colour video: ``(T, H, W)``."""
    return frames @ np.array([0.299, 0.587, 0.114])


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)[None, None]  # (1, 1, size, size)


def ssim(video, reference) -> float:
    """Mean structural similarity of the frames' luma (Wang et al. 2004, Gaussian window, valid positions
    only), averaged over frames. Frames smaller than the window use a window as large as they are."""
    x, y = _check_pair(video, reference)
    size = min(SSIM_WINDOW, *x.shape[1:3])
    size -= 1 - size % 2  # odd
    w = _gaussian_window(size, SSIM_SIGMA)
    a = torch.from_numpy(_luma(x))[:, None]  # (T, 1, H, W)
    b = torch.from_numpy(_luma(y))[:, None]

    def blur(t):
        return torch.nn.functional.conv2d(t, w)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + SSIM_C1) * (2 * cov + SSIM_C2)) / (
        (mu_a**2 + mu_b**2 + SSIM_C1) * (var_a + var_b + SSIM_C2)
    )
    return float(s.mean())


# ---- is there a video at all? ---------------------------------------------------------------------------
# A video can agree well with flash's and still be nothing (an all-black video scores a good PSNR against a
# mostly black one). These checks need no model: they look at the pixels alone.
# every frame's spread (standard deviation over its pixels of each colour channel, the largest of the three)
# below this, of 1.0: nothing drawn. The world's smallest shape (a small triangle, about 0.4% of the frame) at
# full intensity on black or white spreads about 0.06; an all-but-black hybrid video about 0.02.
BLANK_STD = 0.03
FROZEN_DIFF = 0.5 / 255  # every frame within this mean absolute difference of the first: a still image
SATURATED_SHARE = 0.5  # more than this share of pixels clipped to full-intensity colour


def degenerate(frames) -> str | None:
    """``"blank"``, ``"frozen"`` or ``"saturated"`` when a video ``(T, H, W, 3)`` (uint8, or float in [0, 1])
    is not a usable video, else None.

    - blank: every frame is about one flat colour (the standard deviation of each channel over its pixels
      below :data:`BLANK_STD`);
    - frozen: several frames, all identical to the first to within :data:`FROZEN_DIFF` (a still object drawn
      by a diffusion model still varies by a few levels from frame to frame);
    - saturated: more than :data:`SATURATED_SHARE` of the pixels are clipped colour, one channel at full
      intensity and another at zero (white and black, the world's backgrounds, do not count).
    """
    x = _as_float(frames)
    if np.all(x.reshape(len(x), -1, 3).std(axis=1).max(axis=1) < BLANK_STD):
        return "blank"
    if len(x) > 1 and np.all(np.abs(x[1:] - x[:1]).mean(axis=(1, 2, 3)) < FROZEN_DIFF):
        return "frozen"
    high = (x >= 254 / 255).any(axis=-1)
    low = (x <= 1 / 255).any(axis=-1)
    if float(np.mean(high & low)) > SATURATED_SHARE:
        return "saturated"
    return None


def verdict_text(attributes: dict[str, bool] | None) -> str:
    """The analyser's verdict in words: ``draws the prompt`` when every attribute the prompt names is shown,
    else ``misses: shape, motion`` ('' for None)."""
    if not attributes:
        return ""
    missed = [name for name, ok in attributes.items() if not ok]
    return "draws the prompt" if not missed else "misses: " + ", ".join(missed)


def attribute_marks(attributes: dict[str, bool] | None) -> str:
    """Every attribute with its mark, e.g. ``count ✓ colour ✓ shape ✗ motion ✓`` ('' for None)."""
    return " ".join(f"{name} {'✓' if ok else '✗'}" for name, ok in (attributes or {}).items())


# what the page says when the analyser can read nothing in the prompt (it names no colour of the world)
NOT_JUDGED = "not judged: the prompt names nothing the analyser knows (a colour, shape or motion of its world)"


def summary_line(verdicts: dict[str, dict[str, bool] | None], judged: bool) -> str:
    """One line over the variants' verdicts (``{variant: attributes or None}``): which drew the prompt, or
    that none did; '' when the model has no analyser (``judged`` False)."""
    if not judged or not verdicts:
        return ""
    if all(v is None for v in verdicts.values()):
        return f"Against the prompt: {NOT_JUDGED}."
    drew = [name for name, v in verdicts.items() if v and all(v.values())]
    if not drew:
        return "**No variant drew the prompt.**"
    return f"**Drew the prompt: {', '.join(drew)} ({len(drew)} of {len(verdicts)}).**"

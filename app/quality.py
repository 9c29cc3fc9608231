"""Quality beside speed: each variant's video against the flash video of the same prompt and seed.

PSNR and SSIM are the measures sparse- and linear-attention papers report against the dense output.
Both are written out plainly here (numpy, shifted weighted sums) so a test can check them against
values computed by hand. A model that has an analyser of its videos (the built-in model) hands it to the
app as ``AppModels.judge`` (see ``run_app.py``); ``app/`` itself never imports the analyser.
"""

from __future__ import annotations

import math

import numpy as np

# Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, for data in [0, 1]
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_C1 = (0.01 * 1.0) ** 2
SSIM_C2 = (0.03 * 1.0) ** 2


# Every measure streams over chunks of frames: a Wan video of 81x480x832 is 97 million values per channel set,
# and whole-video float64 copies (and, worse, SSIM's 11x11 convolution, whose CPU im2col wanted ~30 GB at that
# size) made the app's per-video checks take ~95 s of a 112 s request on an H100 machine and cannot fit a 24 GB
# one. A chunk's working set stays near CHUNK_VALUES float64 values whatever the video's length or size.
CHUNK_VALUES = 1 << 22  # ~32 MB of float64 per array in flight


def _check(frames) -> np.ndarray:
    a = np.asarray(frames)
    if a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3), got shape {a.shape}")
    return a


def _chunks(a: np.ndarray):
    """``(start, stop)`` frame ranges of at most ~CHUNK_VALUES values each (at least one frame)."""
    per_frame = max(1, int(np.prod(a.shape[1:])))
    step = max(1, CHUNK_VALUES // per_frame)
    for start in range(0, len(a), step):
        yield start, min(len(a), start + step)


def _as_float(frames) -> np.ndarray:
    """``(T, H, W, 3)`` frames as float64 in [0, 1] (uint8 frames are divided by 255)."""
    a = _check(frames)
    return a.astype(np.float64) / 255.0 if a.dtype == np.uint8 else a.astype(np.float64)


def _check_pair(video, reference) -> tuple[np.ndarray, np.ndarray]:
    x, y = _check(video), _check(reference)
    if x.shape != y.shape:
        raise ValueError(f"videos to compare must have the same shape, got {x.shape} and {y.shape}")
    return x, y


def psnr(video, reference) -> float:
    """Peak signal-to-noise ratio in dB over all frames and channels, peak 1.0: ``10 log10(1 / MSE)``
    (``inf`` for identical videos)."""
    x, y = _check_pair(video, reference)
    total = 0.0
    for a, b in _chunks(x):
        total += float(np.sum((_as_float(x[a:b]) - _as_float(y[a:b])) ** 2))
    mse = total / max(1, x.size)
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _luma(frames: np.ndarray) -> np.ndarray:
    """ITU-R BT.601 luma, as SSIM is usually reported on colour video: ``(T, H, W)`` float32 in [0, 1] for
    ``(T, H, W, 3)`` frames (uint8, or floats in [0, 1]). A weighted sum of the channels, not a matrix product:
    BLAS would split it over threads (see :func:`ssim`)."""
    f = frames.astype(np.float32)
    if frames.dtype == np.uint8:
        f /= np.float32(255.0)
    return np.float32(0.299) * f[..., 0] + np.float32(0.587) * f[..., 1] + np.float32(0.114) * f[..., 2]


def _gaussian(size: int, sigma: float) -> np.ndarray:
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2
    g = np.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(video, reference) -> float:
    """Mean structural similarity of the frames' luma (Wang et al. 2004, Gaussian window, valid positions
    only), averaged over frames. Frames smaller than the window use a window as large as they are.

    The 2D Gaussian window is the outer product of a 1D one, so each blur is two 1D passes of shifted,
    weighted sums (22 taps instead of 121, no im2col copy), in float32 over a few frames at a time: about 7x
    faster than a float64 convolution on a CPU, and within ~1e-6 of it (SSIM is shown to 3 decimals).

    In numpy, on the calling thread: it is ~110 small element-wise passes, and a thread pool (torch's, as it
    was) synchronises its threads after each one; on a 2-core CPU shared with other work every pass then
    waits for a thread the scheduler has parked, and one SSIM at 17x128x160 took 1.9-2.8 s at load 5 against
    0.01 s on one thread (the app's tails, and so its time-left estimate, swung with the machine's load)."""
    x, y = _check_pair(video, reference)
    size = min(SSIM_WINDOW, *x.shape[1:3])
    size -= 1 - size % 2  # odd
    g = [np.float32(w) for w in _gaussian(size, SSIM_SIGMA)]

    def blur(t: np.ndarray) -> np.ndarray:  # (t, H, W) -> (t, H - size + 1, W - size + 1)
        h, w = t.shape[1] - size + 1, t.shape[2] - size + 1
        r = g[0] * t[:, :h]
        for k in range(1, size):
            r += g[k] * t[:, k : k + h]
        out = g[0] * r[:, :, :w]
        for k in range(1, size):
            out += g[k] * r[:, :, k : k + w]
        return out

    total = 0.0
    for start, stop in _chunks(x):
        a, b = _luma(x[start:stop]), _luma(y[start:stop])  # (t, H, W) float32
        mu_a, mu_b = blur(a), blur(b)
        var_a = blur(a * a) - mu_a**2
        var_b = blur(b * b) - mu_b**2
        cov = blur(a * b) - mu_a * mu_b
        s = ((2 * mu_a * mu_b + SSIM_C1) * (2 * cov + SSIM_C2)) / (
            (mu_a**2 + mu_b**2 + SSIM_C1) * (var_a + var_b + SSIM_C2)
        )
        # per-frame means (every frame has as many positions)
        total += float(s.astype(np.float64).mean(axis=(1, 2)).sum())
    return total / len(x)


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
    video = _check(frames)
    if len(video) == 0:
        raise ValueError("frames must hold at least one frame, got 0")
    first = _as_float(video[:1])
    blank = frozen = True
    clipped = 0
    for start, stop in _chunks(video):
        x = _as_float(video[start:stop])
        blank = blank and bool(np.all(x.reshape(len(x), -1, 3).std(axis=1).max(axis=1) < BLANK_STD))
        frozen = frozen and bool(np.all(np.abs(x - first).mean(axis=(1, 2, 3)) < FROZEN_DIFF))
        clipped += int(np.count_nonzero((x >= 254 / 255).any(axis=-1) & (x <= 1 / 255).any(axis=-1)))
    if blank:
        return "blank"
    if len(video) > 1 and frozen:
        return "frozen"
    if clipped / (video.size // 3) > SATURATED_SHARE:
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

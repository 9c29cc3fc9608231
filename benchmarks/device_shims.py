"""What the GPU machine lacks, stood in for by the benchmarks (never by the product).

The device image has no ``imageio-ffmpeg`` (its wheel, about 27 MiB with its ffmpeg, does not fit the
64 MiB that travels with a 53.3 MB (50.8 MiB) tracked tree and the carried zips), so
:func:`common.video.write_mp4` cannot run there.
:func:`install` then replaces it, for the benchmark's process only, with an mp4v writer through OpenCV
(``opencv-python-headless`` is in the image) that says so; the product's writer is untouched elsewhere.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def mp4_writer_available() -> bool:
    return importlib.util.find_spec("imageio_ffmpeg") is not None


def write_mp4_cv2(path: str | Path, frames: Any, fps: float = 16, comment: str | None = None, quality: int = 8) -> Path:
    """mp4 (MPEG-4 part 2, 'mp4v') through OpenCV; raises unless every frame was written and reads back."""
    import cv2  # type: ignore[import-not-found, unused-ignore]

    from common.video import to_uint8

    pixels = to_uint8(frames)
    path = Path(path)
    h, w = pixels.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (w, h))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV could not open an mp4 writer for {path}")
    for frame in pixels:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    count = int(cv2.VideoCapture(str(path)).get(cv2.CAP_PROP_FRAME_COUNT))
    if count != len(pixels):
        raise RuntimeError(f"{path}: {count} frames read back, {len(pixels)} written")
    return path


def install() -> str:
    """Replaces the mp4 writer where imageio-ffmpeg is missing; returns a line saying which writer runs."""
    if mp4_writer_available():
        return "mp4 writer: imageio-ffmpeg (the product's)"
    import common.video

    common.video.write_mp4 = write_mp4_cv2  # type: ignore[assignment]
    return "mp4 writer: OpenCV mp4v STAND-IN (no imageio-ffmpeg on this machine; the product's writer did not run)"

"""Writing generated frames: mp4 (imageio + its bundled ffmpeg), GIF, or one PNG with a grid of frames; each
written atomically (:mod:`common.outputs`) and checked before it replaces anything: the mp4 must decode
with the number of frames written, the GIF hold them all, the PNG be a whole image. ffmpeg on a full disk
prints "No space left on device" and exits as if it had written; the check catches that (exit 4), and an
earlier file is replaced only by a complete one."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

# metadata text goes onto ffmpeg's command line: bounded, one line
MAX_COMMENT_CHARS = 1000


def _bounded_comment(comment: str) -> str:
    # control characters (a NUL ends ffmpeg's argument) never reach the command line, whoever checked the text
    one_line = " ".join("".join(ch if ch.isprintable() else " " for ch in str(comment)).split())
    return one_line if len(one_line) <= MAX_COMMENT_CHARS else one_line[: MAX_COMMENT_CHARS - 3] + "..."


def check_output_path(path: str | Path, suffixes: tuple[str, ...] | None = None) -> Path:
    """Checks, before any work, that a file can be written at ``path`` (its folder exists or can be made,
    is no symbolic link loop, and is writable; ``path`` is not a folder); raises ValueError naming the path
    and why not. An existing file is left as it is."""
    from .outputs import check_name_fits, resolve_output_folder

    path = Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"output {str(path)!r} must end in {' or '.join(suffixes)}")
    resolve_output_folder(path.parent)  # a symlink loop (ELOOP) or a file on the way: refused here
    check_name_fits(path)  # a name over the file system's limit: refused now, not after the run
    try:
        is_dir = path.is_dir()
    except OSError as e:
        raise ValueError(f"output {str(path)!r} cannot be written: {e.strerror or e}") from None
    if is_dir:
        raise ValueError(f"output {str(path)!r} is a folder; expected a file name")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"output {str(path)!r} cannot be written: {str(ancestor)!r} is a file, not a folder")
    probe_dir = path.parent if path.parent.is_dir() else ancestor
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"output {str(path)!r} cannot be written in {str(probe_dir)!r}: {e.strerror or e}") from None
    return path


def check_fps(fps: object) -> float:
    """``fps`` as a float; ValueError unless it is a finite number > 0 (ffmpeg fails on others, or silently
    picks its own)."""
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps {fps!r}: expected a frame rate > 0 (e.g. 16)")
    return float(fps)


# a first frame larger than this is refused, before it is decoded (it is scaled to the video's size anyway; PIL's
# own limit warns at 89 MP and fails at twice that)
MAX_IMAGE_PIXELS = 64_000_000


def read_image(path: str | Path, label: str, detail: bool = True) -> Any:
    """An image file as an RGB PIL image, checked before it is decoded: FileNotFoundError or ValueError when it is
    missing, not a picture, truncated or over :data:`MAX_IMAGE_PIXELS`. ``label`` names it in every message
    (``"--image 'a.png'"``, ``"the first frame"``); ``detail``: add the decoder's own words (not where the path
    must stay private)."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path)
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise FileNotFoundError(f"{label} {what}; expected an image file (PNG, JPEG, WebP, ...)")
    try:
        with Image.open(file) as probe:
            width, height = probe.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(
                    f"{label} is {width}x{height} pixels; expected at most {MAX_IMAGE_PIXELS:,} (it is scaled to "
                    "the video's size anyway)"
                )
            probe.verify()  # structure and checksums, without decoding
        with Image.open(file) as img:
            return img.convert("RGB")  # decodes every pixel: a truncated file fails here
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
        why = f" ({type(e).__name__}: {e})" if detail else ""
        raise ValueError(f"{label} is not a readable image{why}; expected a PNG, JPEG or WebP picture") from None


def to_uint8(frames: npt.ArrayLike) -> np.ndarray:
    """Frames ``(num_frames, height, width, 3)`` as uint8; floats are read as [0, 1] and clipped."""
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"frames must be (num_frames, height, width, 3), got shape {array.shape}")
    if array.dtype == np.uint8:
        return array
    return (np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    useful = [x for x in lines if "rror" in x or "nvalid" in x] or lines or [type(e).__name__]
    return " ".join(useful[-1].split())[:200]


def check_mp4(path: Path, frames: int) -> str | None:
    """None when the video at ``path`` decodes (ffmpeg, every frame) to ``frames`` frames; else why not."""
    import imageio_ffmpeg  # type: ignore[import-untyped]

    try:
        count, _ = imageio_ffmpeg.count_frames_and_secs(str(path))
    except Exception as e:  # noqa: BLE001 - ffmpeg's failure to read it, in any form, is the answer
        return f"the written video does not decode ({_first_line(e)})"
    if count != frames:
        return f"the written video decodes to {count} frames, {frames} were written"
    return None


def check_image(path: Path, frames: int, format: str) -> str | None:
    """None when ``path`` is a whole ``format`` image whose every frame decodes, at most ``frames`` of them (a
    GIF stores a run of identical frames once, with their durations added); else why not."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            found = image.format
            count = getattr(image, "n_frames", 1)
            for i in range(count):  # decodes every frame: a truncated file fails here
                image.seek(i)
                image.load()
    except Exception as e:  # noqa: BLE001 - PIL's many errors all mean "not a readable image"
        return f"the written {format} does not decode ({type(e).__name__}: {_first_line(e)})"
    if found != format or not 1 <= count <= frames:
        return f"the written file is a {found} of {count} frame(s); expected a {format} of {frames}"
    return None


def write_mp4(
    path: str | Path, frames: npt.ArrayLike, fps: float = 16, comment: str | None = None, quality: int = 8
) -> Path:
    """H.264 mp4 in yuv420p (plays in browsers and common players). ``comment`` goes into the file's metadata;
    ``quality`` is imageio's 0-10 scale (9 is near-lossless, for training data whose colours must survive)."""
    import imageio.v2 as imageio

    from .outputs import atomic_write

    fps = check_fps(fps)
    pixels = to_uint8(frames)
    path = Path(path)
    params = ["-metadata", f"comment={_bounded_comment(comment)}"] if comment else None
    # written to a temporary name and renamed only when ffmpeg finished: an existing video is never truncated
    with atomic_write(path, check=lambda tmp: check_mp4(tmp, len(pixels))) as tmp:
        # macro_block_size=16 would silently resize sizes that are not multiples of 16; heights and widths
        # are multiples of 16 already, and 2 keeps yuv420p valid for any other even size.
        with imageio.get_writer(
            str(tmp),
            fps=fps,
            codec="libx264",
            pixelformat="yuv420p",
            quality=quality,
            macro_block_size=2,
            output_params=params,
            ffmpeg_log_level="error",
        ) as writer:
            for frame in pixels:
                # imageio's stubs type __enter__ as returning the base class, which lacks append_data
                writer.append_data(frame)  # type: ignore[attr-defined]
    return path


def write_gif(path: str | Path, frames: npt.ArrayLike, fps: float = 16, comment: str | None = None) -> Path:
    """Looping GIF; ``comment`` goes into the file's comment extension."""
    from PIL import Image

    from .outputs import atomic_write

    fps = check_fps(fps)
    path = Path(path)
    images = [Image.fromarray(f) for f in to_uint8(frames)]
    extra = {"comment": _bounded_comment(comment).encode()} if comment else {}
    with atomic_write(path, check=lambda tmp: check_image(tmp, len(images), "GIF")) as tmp:
        images[0].save(
            tmp, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0, **extra
        )
    return path


def frame_grid(frames: npt.ArrayLike, columns: int | None = None, max_frames: int = 16) -> np.ndarray:
    """Up to ``max_frames`` evenly spaced frames tiled into one ``(rows*H, columns*W, 3)`` uint8 image."""
    pixels = to_uint8(frames)
    n = len(pixels)
    picks = np.unique(np.linspace(0, n - 1, min(n, max_frames)).round().astype(int))
    chosen = pixels[picks]
    columns = columns or math.ceil(math.sqrt(len(chosen)))
    rows = math.ceil(len(chosen) / columns)
    h, w = chosen.shape[1:3]
    grid = np.zeros((rows * h, columns * w, 3), dtype=np.uint8)
    for i, frame in enumerate(chosen):
        r, c = divmod(i, columns)
        grid[r * h : (r + 1) * h, c * w : (c + 1) * w] = frame
    return grid


def write_frame_grid(
    path: str | Path, frames: npt.ArrayLike, columns: int | None = None, comment: str | None = None
) -> Path:
    """PNG of :func:`frame_grid`; ``comment`` goes into a PNG text chunk ("Comment")."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    from .outputs import atomic_write

    path = Path(path)
    info = PngInfo()
    if comment:
        info.add_text("Comment", comment)
    with atomic_write(path, check=lambda tmp: check_image(tmp, 1, "PNG")) as tmp:
        Image.fromarray(frame_grid(frames, columns)).save(tmp, format="PNG", pnginfo=info)
    return path


def read_video(path: str | Path) -> np.ndarray:
    """All frames of a video file as ``(num_frames, height, width, 3)`` uint8 (for tests and checks)."""
    import imageio.v2 as imageio

    if not Path(path).is_file():
        raise FileNotFoundError(f"video {str(path)!r} does not exist")
    try:
        with imageio.get_reader(str(path)) as reader:
            # imageio's stubs type __enter__ as returning the base class, which is not iterable
            return np.stack([np.asarray(f)[..., :3] for f in reader])  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - imageio's readers raise many kinds; all mean "not a readable video"
        first = " ".join(str(e).split())[:200]
        raise ValueError(f"{str(path)!r} is not a readable video ({type(e).__name__}: {first})") from None

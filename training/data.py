"""Video-caption datasets for fine-tuning: a folder of videos with captions.

Layouts (``layout="auto"`` picks the first that applies):

- ``jsonl`` / ``csv``: a manifest with one row per video, columns ``video`` (path relative
  to the manifest, or absolute) and ``caption``, or Hugging Face's ``file_name`` and ``text``
  (``metadata.csv`` / ``metadata.jsonl`` of a ``videofolder`` dataset), or the columns
  ``video_column`` / ``caption_column`` name; extra columns are ignored. ``root`` may be
  the manifest file itself or a folder holding ``manifest.jsonl``, ``manifest.csv``,
  ``metadata.jsonl`` or ``metadata.csv`` (first found wins).
- ``txt``: every video under the folder (recursively; .mp4, .webm, .mov, .mkv, .avi) with a
  caption in a ``.txt`` file of the same name beside it.

Several folders (or manifests) make one dataset, each with its ``repeats`` (``extra``); a ``trigger_word`` goes in
front of every caption. :class:`ImageFolderDataset` reads a folder of images (.png, .jpg, .webp; the same layouts,
column ``image`` or ``file_name``) as one-frame clips: the images of joint image-video training.

Each item is a clip of ``num_frames`` frames taken every ``frame_stride`` frames (or at ``fps`` frames a second
whatever the video's own rate), resized (aspect preserved) and centre-cropped to ``height x width``:
``{"video": float32 (3, T, H, W) in [-1, 1], "caption": str, "index": int, "path": str}``. With ``min_frames``
(length buckets) a video too short for ``num_frames`` gives the longest ``4k + 1`` clip it holds instead of
being skipped, and :func:`collate` groups a batch by length.

Resolution and aspect buckets (``buckets``; :func:`aspect_buckets`, :func:`nearest_bucket`): clips of mixed sizes
(320x240, 640x360, portrait) each train at the ``(height, width)`` bucket nearest their aspect ratio, every bucket
of about ``height x width`` pixels in multiples of the model's VAE stride x patch; :meth:`VideoFolderDataset.probe_shapes`
opens each video once to assign them, and :class:`BucketBatchSampler` draws each batch from one bucket (one size
and one length). A cache (``training/precompute.py``) stores each clip at its bucket's size and, with
``cache_windows``, several windows of each long video (:class:`CachedLatents` draws among them by epoch).

Bad data never stops a run: entries with a missing file, an empty or missing caption or a bad
manifest row are dropped when the dataset is built; videos that fail to decode or are too short
are found when loaded and replaced by the next good video. Both are counted by reason in
``dataset.skipped`` (a Counter, shared with DataLoader worker processes) and described by
``dataset.skip_summary()``. A dataset with no usable entry at all raises before training starts.

Determinism for resumable training: :class:`ResumableSampler` yields ``ClipKey(index, epoch)``
in a seeded order, starting from any number of consumed samples, and the dataset picks the
clip's first frame from ``(seed, epoch, index)``, so a resumed run sees exactly the clips an
uninterrupted one would. In a training loop::

    dataset = VideoFolderDataset("data/shapes", num_frames=17, height=64, width=64, seed=seed)
    dataset.probe()  # optional: find unreadable / short videos before step 0
    sampler = ResumableSampler(len(dataset), seed=seed, rank=rank, world_size=world_size)
    if resuming:
        sampler.load_state_dict(checkpoint["data"])
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=2, drop_last=True)
    samples_consumed = sampler.samples_consumed  # 0, or where the checkpoint stopped
    for batch in loader:  # endless: stop on the step count
        ...  # batch["video"]: (batch, 3, T, H, W) in [-1, 1]; batch["caption"]: list of str
        samples_consumed += len(batch["caption"])
        checkpoint["data"] = sampler.state_dict(samples_consumed)  # when saving
    print(dataset.skip_summary())
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from training.config import DataSection, ModelSection
from training.encoding import Encoder
from training.experts import TrainingTarget, read_target, size_multiples
from world.synthetic import SyntheticVideoDataset, SyntheticWorld, world_named

VIDEO_EXTENSIONS: tuple[str, ...] = (".mp4", ".webm", ".mov", ".mkv", ".avi")
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp")
MANIFEST_NAMES: tuple[str, ...] = ("manifest.jsonl", "manifest.csv", "metadata.jsonl", "metadata.csv")
LAYOUTS: tuple[str, ...] = ("auto", "jsonl", "csv", "txt")
# manifest columns found without being named, first present wins: ours, then Hugging Face's (videofolder metadata)
VIDEO_COLUMNS: tuple[str, ...] = ("video", "file_name")
IMAGE_COLUMNS: tuple[str, ...] = ("image", "file_name")  # an image folder's manifest (Hugging Face's imagefolder)
CAPTION_COLUMNS: tuple[str, ...] = ("caption", "text")
BACKENDS: tuple[str, ...] = ("auto", "decord", "imageio")
LENGTH_CHECK_LIMIT = 256  # videos VideoFolderDataset.check_clip_lengths opens before training (spread over more)
# generated buckets span aspect ratios 1:4 to 4:1, as musubi-tuner's: a clip past them crops to the last one
MAX_BUCKET_ASPECT = 4.0
# Codes 1.. index this tuple in the shared per-entry tensor; 0 means "not skipped".
SKIP_REASONS: tuple[str, ...] = (
    "missing_file",  # the manifest names a file that is not there
    "missing_caption",  # txt layout: no .txt beside the video
    "empty_caption",
    "bad_manifest_row",  # unparsable JSON line, or no video path
    "unreadable",  # the decoder could not open or decode the file
    "too_few_frames",  # shorter than (num_frames - 1) * frame_stride + 1
    "bad_caption",  # a caption file that is not UTF-8 text (latin-1, binary) or a caption with control characters
)


class ClipKey(NamedTuple):
    """What a :class:`ResumableSampler` yields and :meth:`VideoFolderDataset.__getitem__` accepts."""

    index: int  # type: ignore[assignment]  # a field named as tuple.index, which it hides
    epoch: int


@dataclass(frozen=True)
class VideoEntry:
    path: Path
    caption: str


class SkippedSample(Exception):
    """Raised inside loading to replace a bad video; ``reason`` is one of :data:`SKIP_REASONS`."""

    def __init__(self, reason: str, path: Path | str, detail: str = ""):
        super().__init__(f"{reason}: {path} {detail}".strip())
        self.reason = reason
        self.path = path


def validate_num_frames(num_frames: int) -> int:
    """Wan's VAE compresses time 4x after the first frame, so clips need ``4k + 1`` frames."""
    if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % 4:
        raise ValueError(f"num_frames must be 4k+1 (1, 5, 9, ..., 17, ..., 81) for Wan's VAE, got {num_frames!r}")
    return num_frames


# --------------------------------------------------------------------------- resolution and aspect buckets


def aspect_buckets(
    height: int, width: int, multiple: int | tuple[int, int] = 16, max_aspect: float = MAX_BUCKET_ASPECT
) -> list[tuple[int, int]]:
    """``(height, width)`` buckets of about ``height * width`` pixels, both sides multiples of ``multiple`` (the VAE's
    spatial stride x the transformer's patch: 16 for Wan2.1, 32 for Wan2.2-TI2V; an int or ``(for height, for
    width)``), aspect ratios from ``1 : max_aspect`` to ``max_aspect : 1``, sorted by aspect (width / height).

    The short side steps over its multiples up to the square, the long side is the multiple nearest ``area /
    short`` (landscape: heights step, portrait: widths, so both halves are as fine); ``(height, width)`` itself is
    always one of them (a clip of the configured aspect trains at exactly the configured size). Of sizes of one
    aspect the one nearest the area is kept. E.g. ``aspect_buckets(64, 96)``: 128x48, 96x64, 80x80, 64x96, 48x128.
    """
    mh, mw = (multiple, multiple) if isinstance(multiple, int) else multiple
    if height % mh or width % mw or height < mh or width < mw:
        raise ValueError(f"aspect_buckets: {height}x{width} must be positive multiples of {mh} (height) x {mw} (width)")
    area = height * width
    side = math.sqrt(area)
    candidates = [(h, max(mw, round(area / h / mw) * mw)) for h in range(mh, int(side) + mh, mh)]  # landscape
    candidates += [(max(mh, round(area / w / mh) * mh), w) for w in range(mw, int(side) + mw, mw)]  # portrait
    found: dict[float, tuple[int, int]] = {width / height: (height, width)}
    for h, w in candidates:
        aspect = w / h
        if not 1 / max_aspect <= aspect <= max_aspect:
            continue
        if aspect not in found or abs(h * w - area) < abs(math.prod(found[aspect]) - area):
            found[aspect] = (h, w)
    return [found[a] for a in sorted(found)]


def nearest_bucket(height: int, width: int, sizes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket of ``sizes`` nearest a ``height x width`` frame's aspect ratio, nearest in ``log(width / height)``
    (3:2 is as far from 1:1 as 2:3 is); the first of equals."""
    target = math.log(width / height)
    return min(sizes, key=lambda s: abs(math.log(s[1] / s[0]) - target))


def check_bucket_sizes(
    sizes: Sequence[Sequence[int]], multiple: tuple[int, int], key: str = "data.bucket_sizes", model: str = "the model"
) -> list[tuple[int, int]]:
    """``sizes`` as a list of ``(height, width)``, each side a positive multiple of ``multiple`` (for height, for
    width); ValueError naming the bad bucket, the multiple and the nearest one that fits."""
    mh, mw = multiple
    out = []
    for size in sizes:
        if len(size) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in size):
            raise ValueError(f"{key}: bucket {list(size)!r}: expected [height, width], two integers")
        h, w = int(size[0]), int(size[1])
        if h < mh or w < mw or h % mh or w % mw:
            fit = [max(mh, round(h / mh) * mh), max(mw, round(w / mw) * mw)]
            raise ValueError(
                f"{key}: bucket {[h, w]} does not fit {model}: expected a height that is a multiple of {mh} and a "
                f"width that is a multiple of {mw} (the VAE's spatial stride x the transformer's patch), e.g. {fit}"
            )
        out.append((h, w))
    if len(set(out)) != len(out):
        raise ValueError(f"{key}={[list(s) for s in out]}: a bucket is listed twice")
    return out


def check_bucket_sizes_fit(data: DataSection, model: ModelSection, target: TrainingTarget | None = None) -> None:
    """``data.bucket_sizes`` against the model (``model.path``'s, ``target`` when read already): every bucket's sides
    multiples of :func:`size_multiples` (a ValueError names the bucket, the multiples and the nearest bucket that
    fits)."""
    if data.bucket_sizes:
        target = read_target(model) if target is None else target
        sizes = [(int(h), int(w)) for h, w in data.bucket_sizes]
        check_bucket_sizes(sizes, size_multiples(model, target), model=target.architecture)


# --------------------------------------------------------------------------- finding entries


def _expected_layouts(noun: str = "videos") -> str:
    column = "video" if noun == "videos" else "image"
    return (
        f"a folder of {noun} with a .txt caption beside each, or a manifest (.jsonl or .csv, "
        f"or a folder holding one of {', '.join(MANIFEST_NAMES)}) with columns {column!r} and 'caption' "
        "(or Hugging Face's 'file_name' and 'text')"
    )


def _find_manifest(root: Path, layout: str) -> Path | None:
    if root.is_file():
        suffix = root.suffix.lower().lstrip(".")
        if suffix not in ("csv", "jsonl") or layout not in ("auto", suffix):
            raise ValueError(f"manifest {root} must end in .jsonl or .csv matching layout={layout!r}")
        return root
    for name in MANIFEST_NAMES:
        if layout in ("auto", name.rsplit(".", 1)[1]) and (root / name).is_file():
            return root / name
    if layout in ("csv", "jsonl"):
        names = [n for n in MANIFEST_NAMES if n.endswith(layout)]
        raise FileNotFoundError(f"layout={layout!r} but {root} holds none of {names}")
    return None


def _caption_ok(caption: str) -> bool:
    """No control characters (NUL, escape: they end up in file metadata and tokenizers); tab and newline pass
    (the same rule as prompts: :func:`common.errors.check_text`)."""
    from common.errors import check_text

    try:
        check_text(caption, "caption")
    except ValueError:
        return False
    return True


def read_caption_file(path: Path) -> str | None:
    """A caption file's text, read strictly as UTF-8; None when it is not UTF-8 (a latin-1 file would otherwise
    train as replacement characters) or holds control characters: the caller skips the video and counts it."""
    try:
        caption = path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError:
        return None
    return caption if _caption_ok(caption) else None


def _read_manifest_rows(manifest: Path) -> list[dict[str, Any] | None]:
    """Rows as dicts; ``None`` for a JSONL line that does not parse to an object. A manifest that is not
    UTF-8 (a latin-1 spreadsheet export) raises ValueError naming the file and where."""
    try:
        return _read_rows(manifest)
    except UnicodeDecodeError as e:
        line = manifest.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(
            f"manifest {str(manifest)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line}); "
            "expected a UTF-8 file: re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _read_rows(manifest: Path) -> list[dict[str, Any] | None]:
    if manifest.suffix.lower() == ".csv":
        with open(manifest, newline="", encoding="utf-8-sig") as f:  # -sig: spreadsheet exports start with a BOM
            return list(csv.DictReader(f))
    rows: list[dict[str, Any] | None] = []
    with open(manifest, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            rows.append(row if isinstance(row, dict) else None)
    return rows


def _pick_column(columns: set[str], named: str | None, candidates: tuple[str, ...]) -> str | None:
    if named:
        return named if named in columns else None
    return next((c for c in candidates if c in columns), None)


def read_manifest(
    manifest: Path,
    video_column: str | None = None,
    caption_column: str | None = None,
    media_columns: tuple[str, ...] = VIDEO_COLUMNS,
) -> tuple[list[VideoEntry], list[tuple[str, str]]]:
    """Reads a CSV/JSONL manifest into entries and ``(path, reason)`` pairs for rows it drops. A column left
    None is found: ``video`` (``image`` for an image folder's: ``media_columns``) or Hugging Face's ``file_name``,
    ``caption`` or ``text``."""
    media = media_columns[0]
    rows = _read_manifest_rows(manifest)
    wanted = f"{video_column or media!r} and {caption_column or 'caption'!r}"
    if not rows:
        raise ValueError(f"manifest {manifest} has no rows; expected one row per video with columns {wanted}")
    columns = set().union(*(row for row in rows if row))
    video = _pick_column(columns, video_column, media_columns)
    caption = _pick_column(columns, caption_column, CAPTION_COLUMNS)
    if video is None or caption is None:
        if video_column or caption_column:  # a name the config gave
            roles = ((video_column, video, media_columns), (caption_column, caption, CAPTION_COLUMNS))
            missing = [named or candidates[0] for named, found, candidates in roles if found is None]
            found_by = ""
        else:
            missing = [c for c in (media_columns[0], CAPTION_COLUMNS[0]) if c not in columns]
            found_by = " (or Hugging Face's 'file_name' and 'text')"
        others = [("data.video_column", video_column, video), ("data.caption_column", caption_column, caption)]
        raise ValueError(
            f"manifest {manifest} has no column {missing}; found columns {sorted(columns)}, "
            f"expected {video_column or media!r} ({media} path) and {caption_column or 'caption'!r}{found_by}; "
            + (
                "name your columns with " + " and ".join(f"{key}=COLUMN" for key, _, found in others if found is None)
                if media_columns == VIDEO_COLUMNS
                else f"name them {' or '.join(map(repr, media_columns))} and 'caption' or 'text'"
            )
        )
    entries, skipped = [], []
    for line_number, row in enumerate(rows, start=1):
        file = str((row or {}).get(video) or "").strip()
        if not file:
            skipped.append((f"{manifest}:{line_number}", "bad_manifest_row"))
            continue
        path = manifest.parent / file  # absolute video paths stay absolute
        text = str((row or {}).get(caption) or "").strip()
        if not path.is_file():
            skipped.append((str(path), "missing_file"))
        elif not text:
            skipped.append((str(path), "empty_caption"))
        elif not _caption_ok(text):
            skipped.append((f"{manifest}:{line_number}", "bad_caption"))
        else:
            entries.append(VideoEntry(path, text))
    return entries, skipped


def scan_caption_files(
    folder: Path, extensions: tuple[str, ...] = VIDEO_EXTENSIONS, noun: str = "videos"
) -> tuple[list[VideoEntry], list[tuple[str, str]]]:
    """Videos (``extensions``: images for an image folder) under ``folder`` (sorted, recursive) with the caption
    in a ``.txt`` of the same name."""
    videos = sorted(p for p in folder.rglob("*") if p.suffix.lower() in extensions and p.is_file())
    if not videos:
        raise FileNotFoundError(
            f"no {noun} ({', '.join(extensions)}) found under {folder}; expected {_expected_layouts(noun)}"
        )
    entries, skipped = [], []
    for video in videos:
        caption_file = video.with_suffix(".txt")
        if not caption_file.is_file():
            skipped.append((str(video), "missing_caption"))
            continue
        caption = read_caption_file(caption_file)
        if caption is None:
            skipped.append((str(caption_file), "bad_caption"))
        elif caption:
            entries.append(VideoEntry(video, caption))
        else:
            skipped.append((str(video), "empty_caption"))
    return entries, skipped


def find_entries(
    root: str | Path,
    layout: str = "auto",
    video_column: str | None = None,
    caption_column: str | None = None,
    images: bool = False,
) -> tuple[list[VideoEntry], list[tuple[str, str]], str]:
    """Lists usable ``(video, caption)`` entries of a dataset (``images``: of a folder of images); raises if
    there are none.

    Returns ``(entries, skipped, source)``: ``skipped`` holds ``(path, reason)`` for entries
    dropped by cheap checks (no decoding), ``source`` names the manifest or folder read.
    """
    noun = "images" if images else "videos"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"dataset path {root} does not exist; expected {_expected_layouts(noun)}")
    manifest = None if layout == "txt" else _find_manifest(root, layout)
    if manifest is not None:
        columns = IMAGE_COLUMNS if images else VIDEO_COLUMNS
        entries, skipped = read_manifest(manifest, video_column, caption_column, columns)
        source = str(manifest)
    elif root.is_dir():
        entries, skipped = scan_caption_files(root, IMAGE_EXTENSIONS if images else VIDEO_EXTENSIONS, noun)
        source = str(root)
    else:
        raise ValueError(
            f"dataset path {root} is a file but not a .jsonl/.csv manifest; expected {_expected_layouts(noun)}"
        )
    if not entries:
        reasons = Counter(reason for _, reason in skipped)
        examples = "; ".join(f"{reason}: {path}" for path, reason in skipped[:3])
        raise ValueError(
            f"no usable {noun} in {source}: {len(skipped)} listed, all dropped ({dict(reasons)}), e.g. {examples}"
        )
    return entries, skipped, source


def with_trigger(caption: str, trigger_word: str | None) -> str:
    """``caption`` with ``trigger_word`` in front (``"TRIGGER, caption"``), unless the caption already holds it."""
    if not trigger_word or trigger_word in caption.split() or caption.startswith(trigger_word):
        return caption
    return f"{trigger_word}, {caption}"


# --------------------------------------------------------------------------- decoding


def decord_available() -> bool:
    try:
        import decord  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``decord`` when installed, else ``imageio`` (ffmpeg via imageio-ffmpeg)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "decord" if decord_available() else "imageio"
    if backend == "decord" and not decord_available():
        raise ImportError("backend='decord' but decord is not installed; `pip install decord` or use backend='imageio'")
    return backend


class _VideoReader:
    """An open video: ``num_frames``, ``fps`` (None when the file does not say), ``size`` ``(height, width)``,
    ``read(indices) -> uint8 (T, H, W, 3)``; a context manager."""

    num_frames: int
    fps: float | None = None

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` of the frames ``read`` gives."""
        height, width = self.read(np.zeros(1, dtype=np.int64)).shape[1:3]
        return int(height), int(width)

    def read(self, indices: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> _VideoReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _DecordVideo(_VideoReader):
    def __init__(self, path: Path):
        import decord

        # One thread per reader: DataLoader workers supply the parallelism.
        self._reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
        self.num_frames = len(self._reader)
        self.fps = float(self._reader.get_avg_fps()) or None

    def read(self, indices: np.ndarray) -> np.ndarray:
        return self._reader.get_batch([int(i) for i in indices]).asnumpy()


class _ImageioVideo(_VideoReader):
    """Fallback through imageio's ffmpeg plugin: counts frames exactly, then decodes sequentially."""

    def __init__(self, path: Path):
        import imageio.v2 as imageio

        self._reader = imageio.get_reader(str(path), format="FFMPEG")
        try:
            # Container metadata only estimates the count (duration x fps); this decodes to count exactly.
            self.num_frames = int(self._reader.count_frames())  # type: ignore[attr-defined]  # imageio's pyav plugin
            meta = self._reader.get_meta_data()
            self.fps = float(meta.get("fps") or 0) or None
            self._size = meta.get("size")  # (width, height) as ffmpeg reports it (after rotation)
        except Exception:
            self.close()
            raise

    @property
    def size(self) -> tuple[int, int]:
        if self._size:
            return int(self._size[1]), int(self._size[0])
        return super().size

    def read(self, indices: np.ndarray) -> np.ndarray:
        wanted = {int(i) for i in indices}
        frames: dict[int, np.ndarray] = {}
        for i, frame in enumerate(self._reader.iter_data()):
            if i in wanted:
                frames[i] = np.asarray(frame)[..., :3]
            if i >= max(wanted):
                break
        # Frames past the real end are missing; the caller sees a short clip.
        return np.stack([frames[int(i)] for i in indices if int(i) in frames]) if frames else np.zeros((0, 1, 1, 3))

    def close(self) -> None:
        self._reader.close()  # stops the ffmpeg subprocess


class _ImageFile(_VideoReader):
    """An image as a one-frame video (Pillow: PNG, JPEG, WebP); decoded by :meth:`read`."""

    num_frames = 1

    def __init__(self, path: Path):
        from PIL import Image

        self._image = Image.open(path)  # reads the header: a file that is no image raises here

    @property
    def size(self) -> tuple[int, int]:
        return self._image.height, self._image.width

    def read(self, indices: np.ndarray) -> np.ndarray:
        frame = np.asarray(self._image.convert("RGB"))
        return np.stack([frame for _ in indices])

    def close(self) -> None:
        self._image.close()


def open_video(path: str | Path, backend: str = "auto") -> _VideoReader:
    """Opens a video: ``num_frames`` and ``read(indices) -> uint8 (T, H, W, 3)``; use as a context manager."""
    backend = resolve_backend(backend)
    return _DecordVideo(Path(path)) if backend == "decord" else _ImageioVideo(Path(path))


def clip_indices(start: int, num_frames: int, frame_stride: int) -> np.ndarray:
    """Frame indices ``start, start + stride, ...`` (``num_frames`` of them)."""
    return start + frame_stride * np.arange(num_frames)


def resize_center_crop(frames: np.ndarray | torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 frames ``(T, H, W, 3)`` -> float32 ``(3, T, height, width)`` in [-1, 1].

    Scales so the frame covers ``height x width`` with its aspect ratio kept (bilinear with
    antialiasing, so downscaling does not alias), then crops the centre.
    """
    video = torch.as_tensor(np.asarray(frames)).permute(0, 3, 1, 2).float()  # (T, 3, H, W)
    in_h, in_w = video.shape[-2:]
    scale = max(height / in_h, width / in_w)
    new_h, new_w = max(height, round(in_h * scale)), max(width, round(in_w * scale))
    if (new_h, new_w) != (in_h, in_w):
        video = F.interpolate(video, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    video = video[:, :, top : top + height, left : left + width]
    return (video / 127.5 - 1.0).clamp(-1.0, 1.0).permute(1, 0, 2, 3).contiguous()


# --------------------------------------------------------------------------- dataset


class VideoFolderDataset(Dataset[dict[str, Any]]):
    """Clips and captions from a folder of videos (see the module docstring for layouts).

    Args:
        root: a folder, or a ``.jsonl`` / ``.csv`` manifest.
        num_frames: frames per clip, ``4k + 1``.
        height, width: output size after aspect-preserving resize and centre crop.
        frame_stride: take every ``frame_stride``-th frame (1 = consecutive).
        layout: ``"auto"``, ``"jsonl"``, ``"csv"`` or ``"txt"``.
        backend: ``"auto"`` (decord if installed), ``"decord"`` or ``"imageio"``.
        random_clip: pick the clip's first frame at random from ``(seed, epoch, index)``;
            ``False`` takes the centred clip (validation).
        seed: seed of the clip start positions.
        repeats: how many times each of ``root``'s videos counts in an epoch (each time another clip of it).
        extra: more datasets as ``(root, repeats)``, read with the same layout and columns; one dataset in all.
        trigger_word: put in front of every caption (``"TRIGGER, caption"``) that does not already hold it.
        fps: take the clip's frames at this rate from every video whatever its own frame rate (frames are
            picked by time; a video slower than ``fps`` repeats frames), instead of every ``frame_stride``-th.
        min_frames: length buckets: a video too short for ``num_frames`` but long enough for ``min_frames``
            (``4k + 1``) gives the longest ``4k + 1`` clip it holds instead of being skipped (items then differ in
            length: :func:`collate` groups a batch by shape).
        buckets: resolution and aspect buckets: ``True`` every clip trains at the bucket of ``bucket_sizes`` nearest
            its aspect ratio (resized to cover it, centre-cropped); ``None`` (auto) the same when the clips fall in
            more than one bucket, else every clip at ``height x width``; ``False`` every clip at ``height x width``.
            Assigned by :meth:`probe_shapes` (until then, and for videos it could not open: ``height x width``).
        bucket_sizes: the ``(height, width)`` buckets; None: :func:`aspect_buckets` of ``height x width`` in
            multiples of ``bucket_multiple`` (the VAE's spatial stride x the transformer's patch).

    Items: ``{"video": float32 (3, num_frames, height, width) in [-1, 1], "caption": str,
    "index": int, "path": str}`` (with buckets: the clip's bucket's length and size). ``dataset[i]`` uses epoch 0;
    ``dataset[ClipKey(i, epoch)]`` (or any ``(index, epoch)`` tuple) that epoch's clip.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        num_frames: int = 17,
        height: int = 64,
        width: int = 64,
        frame_stride: int = 1,
        layout: str = "auto",
        backend: str = "auto",
        random_clip: bool = True,
        seed: int = 0,
        video_column: str | None = None,
        caption_column: str | None = None,
        repeats: int = 1,
        extra: Sequence[tuple[str | Path, int]] = (),
        trigger_word: str | None = None,
        fps: float | None = None,
        min_frames: int | None = None,
        buckets: bool | None = False,
        bucket_sizes: Sequence[tuple[int, int]] | None = None,
        bucket_multiple: int | tuple[int, int] = 16,
    ):
        self.num_frames = validate_num_frames(num_frames)
        if min_frames is not None and (validate_num_frames(min_frames) > num_frames):
            raise ValueError(f"min_frames={min_frames} must be at most num_frames={num_frames}")
        self.min_frames = num_frames if min_frames is None else min_frames
        if frame_stride < 1:
            raise ValueError(f"frame_stride must be >= 1, got {frame_stride!r}")
        if height < 1 or width < 1:
            raise ValueError(f"height and width must be positive, got {height}x{width}")
        if fps is not None and (not fps > 0 or frame_stride != 1):
            raise ValueError(f"fps={fps!r}: expected a frame rate > 0, with frame_stride=1 (got {frame_stride})")
        self.height, self.width, self.frame_stride, self.fps = height, width, frame_stride, fps
        self.backend = resolve_backend(backend)
        self.random_clip, self.seed = random_clip, seed
        self.entries, self.dropped, sources = [], [], []
        copies: list[int] = []  # per entry: how many times it counts in an epoch
        for where, times in [(root, repeats), *extra]:
            if isinstance(times, bool) or not isinstance(times, int) or times < 1:
                raise ValueError(f"repeats of {str(where)!r} must be an integer >= 1, got {times!r}")
            entries, dropped, source = find_entries(where, layout, video_column, caption_column, images=self.IMAGES)
            self.entries += [VideoEntry(e.path, with_trigger(e.caption, trigger_word)) for e in entries]
            self.dropped += dropped
            copies += [times] * len(entries)
            sources.append(source if times == 1 else f"{source} (x{times})")
        self.source = " + ".join(sources)
        # dataset index -> (entry, copy): an entry repeated r times has r indices, each drawing its own clip
        self._order = [(entry, copy) for entry, times in enumerate(copies) for copy in range(times)]
        # Per-entry skip code found while loading, in shared memory so that DataLoader worker
        # processes report into the same counts the training loop reads.
        self._load_failures = torch.zeros(len(self.entries), dtype=torch.int8).share_memory_()
        self.buckets = buckets
        multiple = (
            (bucket_multiple, bucket_multiple)
            if isinstance(bucket_multiple, int)
            else (int(bucket_multiple[0]), int(bucket_multiple[1]))
        )
        if buckets is False:
            self.bucket_sizes = [(height, width)]
        elif bucket_sizes is not None:
            self.bucket_sizes = check_bucket_sizes(bucket_sizes, multiple)
        else:
            self.bucket_sizes = aspect_buckets(height, width, multiple)
        # per entry, set by probe_shapes: (clip frames, height, width) it trains at; None = (num_frames, height, width)
        self._shapes: list[tuple[int, int, int] | None] = [None] * len(self.entries)
        self.source_sizes: list[tuple[int, int] | None] = [None] * len(self.entries)  # (height, width) of each video
        self.bucketed = False  # whether probe_shapes assigned aspect buckets

    IMAGES = False  # ImageFolderDataset: a folder of images, each a one-frame clip
    NOUN = "videos"

    def _open(self, path: Path) -> _VideoReader:
        return open_video(path, self.backend)

    def available(self, video: _VideoReader) -> int:
        """Frames a clip of ``video`` can have: every ``frame_stride``-th of its frames, or at ``fps`` its
        duration's worth."""
        n = video.num_frames
        if n < 1:
            return 0
        if self.fps is None or not video.fps:
            return (n - 1) // self.frame_stride + 1
        return math.floor((n - 1) * self.fps / video.fps + 1e-6) + 1

    def clip_length(self, video: _VideoReader) -> int:
        """Frames of ``video``'s clip: ``num_frames``, or with ``min_frames`` the longest ``4k + 1`` it holds
        (0 when it is too short even for that)."""
        available = self.available(video)
        if available >= self.num_frames:
            return self.num_frames
        longest = (available - 1) // 4 * 4 + 1 if available >= 1 else 0
        return longest if longest >= self.min_frames else 0

    def _step(self, video: _VideoReader) -> float:
        """Source frames between a clip's frames: ``frame_stride``, or at ``fps`` the video's rate / ``fps``."""
        return video.fps / self.fps if self.fps is not None and video.fps else float(self.frame_stride)

    def _last_start(self, video: _VideoReader, length: int) -> int:
        """The latest first frame a clip of ``length`` frames can have in ``video``."""
        return max(0, math.floor(video.num_frames - 1 - (length - 1) * self._step(video) + 1e-6))

    def window_starts(self, video: _VideoReader, length: int, count: int) -> list[int]:
        """First frames of ``count`` windows spread evenly over ``video`` (its first and last clip among them), fewer
        where the video has fewer distinct clips: what a cache with ``data.cache_windows=count`` stores."""
        last = self._last_start(video, length)
        return sorted({round(float(x)) for x in np.linspace(0, last, count)})

    def _clip_frames(
        self, video: _VideoReader, index: int, epoch: int, copy: int, length: int, start: int | None = None
    ) -> np.ndarray:
        """The frame indices of the clip of entry ``index`` for ``(epoch, copy)``: a start drawn from
        ``(seed, epoch, index[, copy])`` (the centred clip without ``random_clip``; ``start`` when given), then every
        ``frame_stride``-th frame, or at ``fps`` the frame nearest each ``1 / fps`` step."""
        step = self._step(video)
        last_start = self._last_start(video, length)
        if start is not None:
            pass
        elif self.random_clip:
            key = [self.seed, epoch, index] + ([copy] if copy else [])
            start = int(np.random.default_rng(key).integers(0, last_start + 1))
        else:
            start = last_start // 2
        if self.fps is None or not video.fps:
            return clip_indices(start, length, self.frame_stride)
        picked = np.floor(start + step * np.arange(length) + 0.5).astype(np.int64)
        return np.minimum(picked, video.num_frames - 1)

    @property
    def span(self) -> int:
        """Frames a clip covers in the source video: ``(num_frames - 1) * frame_stride + 1``."""
        return (self.num_frames - 1) * self.frame_stride + 1

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, key: int | ClipKey) -> dict[str, Any]:
        index, epoch = (int(key[0]), int(key[1])) if isinstance(key, tuple) else (int(key), 0)
        if not 0 <= index < len(self._order):
            raise IndexError(f"index {index} out of range for a dataset of {len(self._order)} {self.NOUN}")
        entry, copy = self._order[index]
        # A bad video is replaced by the next good one, deterministically, so the batch keeps its size: the next of
        # its bucket first (the batch keeps one shape), then any
        for candidate in self._replacements(entry):
            if self._load_failures[candidate]:
                continue
            try:
                return self.load(candidate, epoch, copy)
            except SkippedSample as skipped:
                self._load_failures[candidate] = SKIP_REASONS.index(skipped.reason) + 1
        raise RuntimeError(f"every video in {self.source} failed to load; {self.skip_summary()}")

    def _replacements(self, entry: int) -> Iterator[int]:
        """``entry``, then the entries after it (wrapping round) of its shape, then those of other shapes."""
        n, shape = len(self.entries), self._shapes[entry]
        for same in (True, False):
            for offset in range(n):
                candidate = (entry + offset) % n
                if (self._shapes[candidate] == shape) == same:
                    yield candidate

    def _open_checked(self, entry: VideoEntry) -> _VideoReader:
        """Opens a video long enough for one clip, else raises :class:`SkippedSample`."""
        try:
            video = self._open(entry.path)
        except Exception as error:  # decoders raise their own error types for corrupt files
            raise SkippedSample("unreadable", entry.path, repr(error)) from error
        if not self.clip_length(video):
            video.close()
            raise SkippedSample("too_few_frames", entry.path, f"{video.num_frames} < {self.span}")
        return video

    def size_of(self, index: int) -> tuple[int, int]:
        """``(height, width)`` entry ``index``'s clips train at: its bucket's, else ``height x width``."""
        shape = self._shapes[index]
        return (self.height, self.width) if shape is None else (shape[1], shape[2])

    def load(self, index: int, epoch: int = 0, copy: int = 0, windows: int = 1) -> dict[str, Any]:
        """Loads entry ``index`` (its clip for ``epoch`` and, for a repeated dataset, ``copy``) at its bucket's size;
        raises :class:`SkippedSample` for an unreadable or too-short video. ``windows > 1`` (a cache's
        ``data.cache_windows``): ``"windows"``, a list of up to that many clips spread over the video
        (:meth:`window_starts`), ``"video"`` the first of them."""
        entry = self.entries[index]
        height, width = self.size_of(index)
        with self._open_checked(entry) as video:
            try:
                length = self.clip_length(video)
                if windows > 1:
                    starts = self.window_starts(video, length, windows)
                    picks = [self._clip_frames(video, index, epoch, copy, length, start) for start in starts]
                    wanted = np.unique(np.concatenate(picks))  # one decoding pass for all windows
                    decoded = video.read(wanted)
                    if len(decoded) != len(wanted):
                        raise SkippedSample("too_few_frames", entry.path, f"decoded {len(decoded)} of {len(wanted)}")
                    where = {int(f): k for k, f in enumerate(wanted)}
                    clips = [decoded[[where[int(f)] for f in pick]] for pick in picks]
                else:
                    clips = [video.read(self._clip_frames(video, index, epoch, copy, length))]
            except SkippedSample:
                raise
            except Exception as error:
                raise SkippedSample("unreadable", entry.path, repr(error)) from error
        if len(clips[0]) != length:  # the container claimed more frames than it decodes
            raise SkippedSample("too_few_frames", entry.path, f"decoded {len(clips[0])} of {length}")
        videos = [resize_center_crop(frames, height, width) for frames in clips]
        item = {"video": videos[0], "caption": entry.caption, "index": index, "path": str(entry.path)}
        if windows > 1:
            item["windows"] = videos
        return item

    def load_or_skip(self, index: int, epoch: int = 0, windows: int = 1) -> dict[str, Any] | None:
        """Sample ``index`` itself (its entry's clip; ``windows``: :meth:`load`'s), or None (counted in
        :meth:`skip_summary`) when it is unreadable or too short: for one pass over the data that must not
        substitute another video (a cache)."""
        entry, copy = self._order[index]
        if self._load_failures[entry]:
            return None
        try:
            return self.load(entry, epoch, copy, windows)
        except SkippedSample as skipped:
            self._load_failures[entry] = SKIP_REASONS.index(skipped.reason) + 1
            return None

    # ----------------------------------------------------------------------- buckets

    def probe_shapes(self, progress: bool = False) -> str | None:
        """Opens every video once (decord: its header and first frame) for its clip length and frame size, then
        assigns each its shape: ``(clip frames, height, width)``, the size the bucket nearest its aspect ratio
        (with ``buckets``; ``None``: when the videos fall in more than one bucket), else ``height x width``.
        Unreadable and too-short videos are skipped (and counted) from then on. Returns a line saying what was
        assigned (None when every clip trains at ``num_frames x height x width``)."""
        from tqdm import tqdm  # type: ignore[import-untyped]

        for index in tqdm(range(len(self.entries)), desc="reading video sizes", disable=not progress):
            if self._load_failures[index] or self.source_sizes[index] is not None:
                continue
            try:
                with self._open_checked(self.entries[index]) as video:
                    self.source_sizes[index] = video.size
                    length = self.clip_length(video)
            except SkippedSample as skipped:
                self._load_failures[index] = SKIP_REASONS.index(skipped.reason) + 1
                continue
            except Exception:  # a first frame that does not decode
                self._load_failures[index] = SKIP_REASONS.index("unreadable") + 1
                continue
            self._shapes[index] = (length, self.height, self.width)
        sizes = {i: s for i, s in enumerate(self.source_sizes) if s is not None and not self._load_failures[i]}
        nearest = {i: nearest_bucket(h, w, self.bucket_sizes) for i, (h, w) in sizes.items()}
        self.bucketed = self.buckets is True or (self.buckets is None and len(set(nearest.values())) > 1)
        for i, bucket in nearest.items():
            frames = self._shapes[i][0]  # type: ignore[index]
            self._shapes[i] = (frames, *bucket) if self.bucketed else (frames, self.height, self.width)
        if bool(self._load_failures.all()):
            raise ValueError(f"no usable {self.NOUN} in {self.source}; {self.skip_summary()}")
        counts = Counter(s for s in self._shapes if s is not None)
        if set(counts) <= {(self.num_frames, self.height, self.width)}:
            return None
        shown = ", ".join(f"{f}x{h}x{w}: {n}" for (f, h, w), n in sorted(counts.items(), key=lambda x: -x[1]))
        why = "aspect buckets (data.buckets)" if self.bucketed else "length buckets (data.min_frames)"
        return f"{why}: {len(counts)} clip shapes (frames x height x width: videos): {shown}"

    @property
    def needs_probe(self) -> bool:
        """Whether clips can differ in shape (aspect buckets not off, or length buckets): :meth:`probe_shapes` then
        assigns them before training."""
        return self.buckets is not False or self.min_frames < self.num_frames

    def shape_keys(self) -> list[tuple[int, int, int]]:
        """Per sample (``dataset[i]``): the ``(frames, height, width)`` its clip has; a batch takes one of them
        (:class:`BucketBatchSampler`). All ``(num_frames, height, width)`` before :meth:`probe_shapes`."""
        nominal = (self.num_frames, self.height, self.width)
        return [self._shapes[entry] or nominal for entry, _ in self._order]

    def check_clip_lengths(self, limit: int = LENGTH_CHECK_LIMIT) -> str | None:
        """Counts the videos too short for one clip (``(num_frames - 1) * frame_stride + 1`` frames) by opening
        them (every one, or ``limit`` spread over a larger dataset; decord reads no frame for it). When more than
        half of those opened are too short, raises ValueError naming the count, the cause and the fix (a lower
        ``data.num_frames``), before any model loads; when fewer, returns a warning saying the same; None when
        none is. The videos found too short or unreadable are skipped (and counted) from then on."""
        n = len(self.entries)
        if n <= limit:
            indices = list(range(n))
        else:
            indices = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
        too_short = SKIP_REASONS.index("too_few_frames") + 1
        frames: dict[int, int] = {}  # frame counts of the videos that opened
        clip: dict[int, int] = {}  # the longest clip each can give
        for index in indices:
            if self._load_failures[index]:
                continue
            try:
                video = self._open(self.entries[index].path)
            except Exception:  # decoders raise their own error types for corrupt files
                self._load_failures[index] = SKIP_REASONS.index("unreadable") + 1
                continue
            with video:
                frames[index], clip[index] = video.num_frames, self.available(video)
            if clip[index] < self.min_frames:
                self._load_failures[index] = too_short
        short = [i for i in indices if int(self._load_failures[i]) == too_short]
        bucketed = self.min_frames < self.num_frames
        key, need = ("data.min_frames", self.min_frames) if bucketed else ("data.num_frames", self.num_frames)
        if not short:
            shorter = sorted(clip[i] for i in clip if clip[i] < self.num_frames)
            if not shorter:
                return None
            lengths = sorted({(c - 1) // 4 * 4 + 1 for c in shorter})
            return (
                f"note: {len(shorter)} of the {len(indices)} videos checked in {self.source} are shorter than "
                f"data.num_frames={self.num_frames} and train at {lengths[0]}-{lengths[-1]} frames "
                f"(data.min_frames={self.min_frames}: the longest 4k+1 each holds)"
            )
        usable = sum(1 for i in indices if not self._load_failures[i])
        counts = sorted(frames[i] for i in short if i in frames)
        have = f"; they have {counts[0]}-{counts[-1]} frames" if counts else ""
        scope = f"{len(short)} of the {len(indices)} videos" + (f" checked (of {n})" if len(indices) < n else "")
        if self.fps is None:
            rate = f"data.frame_stride={self.frame_stride} ({(need - 1) * self.frame_stride + 1} frames of the video)"
        else:
            rate = f"data.fps={self.fps:g} ({(need - 1) / self.fps:.2f} s of the video)"
        cause = f"{scope} in {self.source} are too short for a clip of {key}={need} at {rate}{have}"
        fix = f"lower {key}"
        if clip:
            fits = (min(clip.values()) - 1) // 4 * 4 + 1  # the 4k+1 that every readable one holds
            fix += f" ({key}={fits} fits every readable video)"
        if self.frame_stride > 1:
            fix += " or data.frame_stride"
        if self.fps is not None:
            fix += " or data.fps"
        if not bucketed:
            fix += " or set data.min_frames (shorter videos then train at the longest 4k+1 they hold, >= it)"
        if 2 * len(short) > len(indices):
            raise ValueError(
                f"{key}={need}: {cause}, so only {usable} would train; expected most videos long enough: {fix}"
            )
        return f"WARNING: {cause} and are skipped ({usable} train): {fix} to train on them too"

    def require_usable(self) -> None:
        """Opens entries in order until one is usable (cheap: no frame decoding); raises ValueError naming the
        source when none is, so a dataset of only broken videos stops before any model is loaded."""
        for index in range(len(self.entries)):
            if self._load_failures[index]:
                continue
            try:
                self._open_checked(self.entries[index]).close()
                return
            except SkippedSample as skipped:
                self._load_failures[index] = SKIP_REASONS.index(skipped.reason) + 1
        raise ValueError(f"no usable {self.NOUN} in {self.source}; {self.skip_summary()}")

    def probe(self, progress: bool = False) -> Counter[str]:
        """Opens every video once (no frame decoding with decord) to find unreadable and too-short
        ones before training; returns :attr:`skipped`. Raises if no video is usable."""
        from tqdm import tqdm

        for index in tqdm(range(len(self.entries)), desc="probing videos", disable=not progress):
            if self._load_failures[index]:
                continue
            try:
                self._open_checked(self.entries[index]).close()
            except SkippedSample as skipped:
                self._load_failures[index] = SKIP_REASONS.index(skipped.reason) + 1
        if bool(self._load_failures.all()):
            raise ValueError(f"no usable videos in {self.source}; {self.skip_summary()}")
        return self.skipped

    # ----------------------------------------------------------------------- skip reporting

    def skipped_paths(self) -> dict[str, list[str]]:
        """Paths of skipped entries by reason: those dropped at build time and those that failed to load."""
        by_reason: dict[str, list[str]] = {}
        for path, reason in self.dropped:
            by_reason.setdefault(reason, []).append(path)
        for index in torch.nonzero(self._load_failures).flatten().tolist():
            reason = SKIP_REASONS[int(self._load_failures[index]) - 1]
            by_reason.setdefault(reason, []).append(str(self.entries[index].path))
        return by_reason

    @property
    def skipped(self) -> Counter[str]:
        """Number of skipped videos by reason (each video counted once)."""
        return Counter({reason: len(paths) for reason, paths in self.skipped_paths().items()})

    def skip_summary(self, max_examples: int = 3) -> str:
        """One line per reason, e.g. ``"skipped 2 of 10 entries in DIR: unreadable 1 (a.mp4); too_few_frames 1 (b.mp4)"``."""
        by_reason = self.skipped_paths()
        total = len(self.entries) + len(self.dropped)
        if not by_reason:
            return f"skipped 0 of {total} entries in {self.source}"
        parts = []
        for reason in SKIP_REASONS:
            paths = by_reason.get(reason, [])
            if paths:
                more = f", +{len(paths) - max_examples} more" if len(paths) > max_examples else ""
                parts.append(f"{reason} {len(paths)} ({', '.join(paths[:max_examples])}{more})")
        count = sum(len(p) for p in by_reason.values())
        return f"skipped {count} of {total} entries in {self.source}: " + "; ".join(parts)


class ImageFolderDataset(VideoFolderDataset):
    """Images with captions as one-frame clips, the images of joint image-video training (``data.image_path`` with
    ``data.source=folder``): ``.png`` / ``.jpg`` / ``.webp`` files with a ``.txt`` caption beside each, or a manifest
    with columns ``image`` (or Hugging Face's ``file_name``) and ``caption`` (or ``text``). Resized and
    centre-cropped like clips; items as :class:`VideoFolderDataset`'s with ``video`` of shape
    ``(3, 1, height, width)``; unreadable images are skipped and counted the same way."""

    IMAGES = True
    NOUN = "images"

    def __init__(
        self,
        root: str | Path,
        *,
        height: int = 64,
        width: int = 64,
        layout: str = "auto",
        seed: int = 0,
        trigger_word: str | None = None,
    ):
        super().__init__(
            root, num_frames=1, height=height, width=width, layout=layout, seed=seed, trigger_word=trigger_word
        )

    def _open(self, path: Path) -> _VideoReader:
        return _ImageFile(path)


# --------------------------------------------------------------------------- sampling


class ResumableSampler(Sampler[ClipKey]):
    """Seeded, epoch-by-epoch order of ``ClipKey(index, epoch)`` that can restart mid-epoch.

    Each epoch is a permutation of ``range(num_samples)`` drawn from ``(seed, epoch)`` (or the
    identity with ``shuffle=False``), padded by wrapping to a multiple of ``world_size`` and
    dealt out rank by rank (like ``DistributedSampler``), so every rank sees
    ``ceil(num_samples / world_size)`` keys per epoch.

    The position is the number of samples this rank has consumed. The sampler cannot count
    that itself, because DataLoader workers prefetch ahead of the training loop; the loop
    passes it to :meth:`state_dict` and a resumed run to ``samples_consumed`` /
    :meth:`load_state_dict`. Iteration runs for ``num_epochs`` epochs from the position, or
    forever when ``num_epochs`` is ``None`` (step-based training).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        samples_consumed: int = 0,
        num_epochs: int | None = None,
    ):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if samples_consumed < 0:
            raise ValueError(f"samples_consumed must be >= 0, got {samples_consumed}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.samples_consumed, self.num_epochs = samples_consumed, num_epochs

    @property
    def samples_per_epoch(self) -> int:
        """Keys this rank gets per epoch."""
        return math.ceil(self.num_samples / self.world_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """This rank's dataset indices for ``epoch``, in order."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        padded = np.resize(order, self.samples_per_epoch * self.world_size)  # wraps around
        return padded[self.rank :: self.world_size].tolist()

    def position(self, samples_consumed: int) -> tuple[int, int]:
        """``(epoch, offset in epoch)`` after this rank has consumed ``samples_consumed`` samples."""
        return divmod(samples_consumed, self.samples_per_epoch)

    def __iter__(self) -> Iterator[ClipKey]:
        epoch, offset = self.position(self.samples_consumed)
        while self.num_epochs is None or epoch < self.num_epochs:
            for index in self.epoch_order(epoch)[offset:]:
                yield ClipKey(index, epoch)
            epoch, offset = epoch + 1, 0

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("an endless ResumableSampler (num_epochs=None) has no length")
        return max(0, self.num_epochs * self.samples_per_epoch - self.samples_consumed)

    def state_dict(self, samples_consumed: int) -> dict[str, Any]:
        """State to checkpoint after the training loop consumed ``samples_consumed`` samples on this rank."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
            "samples_consumed": int(samples_consumed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a checkpointed position; the dataset size, seed and world size must match."""
        for key in ("num_samples", "seed", "shuffle", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data order: checkpoint has {key}={state[key]!r}, "
                    f"this run has {getattr(self, key)!r}"
                )
        self.samples_consumed = int(state["samples_consumed"])


class BucketBatchSampler(Sampler[list[ClipKey]]):
    """Batches of ``ClipKey(index, epoch)`` that each hold samples of one shape (``keys[index]``: a bucket's
    ``(frames, height, width)``), in a seeded order that can restart mid-epoch: the batch sampler of a dataset whose
    clips differ in size or length (:class:`ResumableSampler` orders one of a single shape).

    Each epoch: the samples in the order :class:`ResumableSampler` draws from ``(seed, epoch)``, split by shape
    (keeping that order), each shape's cut into batches of ``batch_size`` (the last one filled up with that shape's
    first samples, so every batch is full and of one shape), the batches shuffled (the same generator), padded by
    wrapping to a multiple of ``world_size`` and dealt out rank by rank. The position is the number of samples this
    rank consumed (whole batches), as :class:`ResumableSampler`'s: the loop passes it to :meth:`state_dict`.
    """

    def __init__(
        self,
        keys: Sequence[tuple[int, ...]],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        samples_consumed: int = 0,
    ):
        if not keys:
            raise ValueError("BucketBatchSampler needs at least one sample")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.keys, self.batch_size = list(keys), batch_size
        self.num_samples, self.seed, self.shuffle = len(self.keys), seed, shuffle
        self.rank, self.world_size, self.samples_consumed = rank, world_size, samples_consumed
        counts = Counter(self.keys)
        batches = sum(math.ceil(n / batch_size) for n in counts.values())
        self.batches_per_epoch = math.ceil(batches / world_size)  # this rank's
        self.num_buckets = len(counts)

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank gets per epoch (whole batches)."""
        return self.batches_per_epoch * self.batch_size

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of dataset indices for ``epoch``, in order."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples)
        by_key: dict[str, Any] = {}
        for index in order.tolist():
            by_key.setdefault(self.keys[index], []).append(index)
        batches = []
        for members in by_key.values():  # in order of each shape's first sample: seeded
            padded = np.resize(members, math.ceil(len(members) / self.batch_size) * self.batch_size).tolist()
            batches += [padded[i : i + self.batch_size] for i in range(0, len(padded), self.batch_size)]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        total = self.batches_per_epoch * self.world_size
        batches = [batches[i % len(batches)] for i in range(total)]  # wraps around
        return batches[self.rank :: self.world_size]

    def position(self, samples_consumed: int) -> tuple[int, int]:
        """``(epoch, batch in epoch)`` after this rank has consumed ``samples_consumed`` samples."""
        epoch, offset = divmod(samples_consumed, self.samples_per_epoch)
        return epoch, offset // self.batch_size

    def __iter__(self) -> Iterator[list[ClipKey]]:
        epoch, offset = self.position(self.samples_consumed)
        while True:
            for batch in self.epoch_batches(epoch)[offset:]:
                yield [ClipKey(index, epoch) for index in batch]
            epoch, offset = epoch + 1, 0

    def state_dict(self, samples_consumed: int) -> dict[str, Any]:
        """State to checkpoint after the training loop consumed ``samples_consumed`` samples on this rank."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
            "samples_consumed": int(samples_consumed),
            "buckets": self.num_buckets,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a checkpointed position; the dataset size, seed and world size must match."""
        ResumableSampler.load_state_dict(self, state)  # type: ignore[arg-type]


def make_sampler(
    dataset: Any, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1
) -> ResumableSampler | BucketBatchSampler:
    """The order a run reads ``dataset`` in: a :class:`BucketBatchSampler` when its samples differ in shape
    (``dataset.shape_keys()``: aspect or length buckets, or a cache of them), else a :class:`ResumableSampler`
    (a dataset of one shape keeps the order it always had)."""
    keys = dataset.shape_keys() if hasattr(dataset, "shape_keys") else None
    if keys is None or len(set(keys)) <= 1:
        return ResumableSampler(len(dataset), seed=seed, rank=rank, world_size=world_size)
    return BucketBatchSampler(keys, batch_size, seed=seed, rank=rank, world_size=world_size)


def data_loader(
    dataset: Any, sampler: ResumableSampler | BucketBatchSampler, batch_size: int, num_workers: int = 0
) -> DataLoader[dict[str, Any]]:
    """The DataLoader of ``dataset`` read in ``sampler``'s order (from its ``samples_consumed``): batches of
    ``batch_size`` (a :class:`BucketBatchSampler` makes them itself) through :func:`collate`."""
    if isinstance(sampler, BucketBatchSampler):
        return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, drop_last=True, collate_fn=collate
    )


# --------------------------------------------------------------------------- what the recipe reads


class CachedLatents(Dataset[dict[str, Any]]):
    """Items of a cache written by ``training/precompute.py``: latents and text embeddings, no decoding.

    A cache of aspect or length buckets records each item's clip shape (``"video": [frames, height, width]`` in
    ``index.json``; :meth:`shape_keys`), and one written with ``data.cache_windows`` several windows of each
    long video (``"windows": n``; tensors ``latents``, ``latents.1``, ...): ``dataset[ClipKey(i, epoch)]`` reads
    window ``w`` of them, each window once every ``n`` epochs in an order drawn from ``(seed, index, epoch // n)``,
    as live decoding draws a new clip each epoch. Checksums (:mod:`training.cache`): the index and every entry's
    size at open, each entry's SHA-256 when it is read (whole, every window); a damaged file is refused by name."""

    def __init__(self, path: str | Path, seed: int = 0):
        from training.cache import empty_text_item, load_entry, read_index

        root = Path(path)
        meta = read_index(root)
        self.meta = meta
        self.items = meta["items"]
        if not self.items:
            raise ValueError(f"cache {str(root)!r} holds no samples")
        self.root, self.seed = root, seed
        self.empty_text = load_entry(root, empty_text_item(meta))["text"]
        self._load = load_entry

    def __len__(self) -> int:
        return len(self.items)

    def shape_keys(self) -> list[tuple[int, ...]]:
        """Per item, the ``(frames, height, width)`` of its clip: as ``index.json`` records it, else (a cache written
        before buckets) the cache's one ``video`` shape."""
        nominal = tuple(self.meta.get("video") or ())
        return [tuple(item.get("video") or nominal) for item in self.items]

    def window(self, index: int, epoch: int) -> int:
        """Which of item ``index``'s windows epoch ``epoch`` reads: every one once in each ``n`` epochs."""
        n = int(self.items[index].get("windows", 1))
        if n <= 1:
            return 0
        return int(np.random.default_rng([self.seed, index, epoch // n]).permutation(n)[epoch % n])

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        index, epoch = (int(key[0]), int(key[1])) if isinstance(key, tuple) else (int(key), 0)
        item = self.items[index]
        window = self.window(index, epoch)
        t = self._load(self.root, item)  # read whole: its checksum covers every window
        latents, text = t[f"latents.{window}" if window else "latents"], t["text"]
        return {"latents": latents, "text": text, "caption": item["caption"], "index": index}


def build_validation_dataset(data: DataSection, seed: int, size: int) -> SyntheticVideoDataset | None:
    """Held-out clips for the evaluation loss: the synthetic world's validation split (unseen captions and
    held-out attribute combinations) for ``data.source: synthetic``, drawn with ``seed`` (``train.seed``); ``None``
    for other sources, whose evaluation reads the first training videos."""
    if data.source != "synthetic":
        return None
    return SyntheticVideoDataset(
        size,
        seed=seed,
        split="validation",
        num_frames=data.num_frames,
        height=data.height,
        width=data.width,
        world=synthetic_world(data),
    )


def synthetic_world(data: DataSection) -> SyntheticWorld:
    """The synthetic world the data section names: the preset ``data.world`` with ``data.short_captions`` and
    ``data.default_background`` where they are set."""
    return world_named(data.world, short_captions=data.short_captions, default_background=data.default_background)


def image_batch_size(data: DataSection, batch_size: int) -> int:
    """Images each step trains on beside its ``batch_size`` (``train.batch_size``) clips (joint image-video
    training: ``data.image_ratio``)."""
    return round(data.image_ratio * batch_size)


def build_dataset(
    data: DataSection, seed: int, model: ModelSection, images: bool = False
) -> SyntheticVideoDataset | VideoFolderDataset | ImageFolderDataset | CachedLatents:
    """The dataset the data section names: synthetic clips, a folder of videos (``data.path``, with ``data.extra``'s
    folders and their repeats), or a precomputed cache; ``seed`` (``train.seed``) draws its clips and windows, and
    ``model`` (the run's model section) gives a folder's aspect buckets their size multiples. With ``images``: the
    one-frame images of joint training (``data.image_*``): synthetic stills, a folder of images
    (``data.source=folder``) or a cache of them."""
    d = data
    if d.source == "synthetic":
        return SyntheticVideoDataset(
            (d.image_num_samples or d.num_samples) if images else d.num_samples,
            seed=seed,
            num_frames=1 if images else d.num_frames,
            height=d.height,
            width=d.width,
            world=synthetic_world(d),
            images=images,
        )
    if images and d.source == "folder":  # a folder of images with captions
        assert d.image_path is not None  # training.config.validate: data.image_ratio needs it
        return ImageFolderDataset(d.image_path, height=d.height, width=d.width, seed=seed, trigger_word=d.trigger_word)
    if images:  # a cache of images (training.precompute --images)
        assert d.image_path is not None  # training.config.validate: data.source=cache needs it with images
        return _checked_cache(d.image_path, [1, d.height, d.width], "data.image_path", seed)
    assert d.path is not None  # training.config.validate: data.source folder and cache need it
    if d.source == "folder":
        multiple = (16, 16)
        if d.buckets is not False:  # the model's VAE stride x patch, from its config files
            check_bucket_sizes_fit(d, model)  # data.bucket_sizes: a bucket that does not fit is named with the model
            multiple = size_multiples(model)
        return VideoFolderDataset(
            d.path,
            num_frames=d.num_frames,
            height=d.height,
            width=d.width,
            frame_stride=d.frame_stride,
            seed=seed,
            layout=d.layout,
            video_column=d.video_column,
            caption_column=d.caption_column,
            repeats=d.repeats,
            extra=[(e["path"], e.get("repeats", 1)) for e in d.extra],
            trigger_word=d.trigger_word,
            fps=d.fps,
            min_frames=d.min_frames,
            buckets=d.buckets,
            bucket_sizes=[(int(h), int(w)) for h, w in d.bucket_sizes] if d.bucket_sizes else None,
            bucket_multiple=multiple,
        )
    return _checked_cache(d.path, [d.num_frames, d.height, d.width], "data.path", seed)


def _checked_cache(path: str, want: list[int], key: str, seed: int = 0) -> CachedLatents:
    cache = CachedLatents(path, seed)
    if cache.meta.get("video") != want:
        raise ValueError(
            f"{key}: cache {path!r} holds samples of (frames, height, width) {cache.meta.get('video')}, "
            f"the config asks {want}"
        )
    return cache


def _shape(item: dict[str, Any]) -> tuple[int, ...]:
    return tuple((item["video"] if "video" in item else item["latents"]).shape)


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch: ``caption`` (list), ``index``, and ``video`` (or a cache's ``latents`` and ``text``) stacked.
    Items of several shapes (clips of several lengths: ``data.min_frames``) give ``groups``, a batch per shape
    (longest first) in place of the stacked tensors."""
    out = {"caption": [it["caption"] for it in items], "index": torch.tensor([it["index"] for it in items])}
    shapes = sorted({_shape(it) for it in items}, reverse=True)
    if len(shapes) > 1:
        out["groups"] = [collate([it for it in items if _shape(it) == shape]) for shape in shapes]
        return out
    for key in ("video", "latents", "text"):
        if key in items[0]:
            out[key] = torch.stack([it[key] for it in items])
    return out


def batch_groups(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The batches of one shape a :func:`collate` batch holds: itself, or its ``groups``."""
    return batch.get("groups") or [batch]


class BatchEncoder:
    """Latents and text embeddings of a batch, with caption dropout drawn from the training generator."""

    def __init__(
        self, encoder: Encoder | None, empty_text: torch.Tensor | None, dropout: float, device: torch.device
    ) -> None:
        self.encoder, self.empty_text, self.dropout, self.device = encoder, empty_text, dropout, device

    def __call__(self, batch: dict[str, Any], generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latents, text embeddings)`` of a batch on the run's device: a cache's as stored (a dropped caption's
        text is the cache's empty text), else the videos and captions encoded (a dropped caption encoded as "")."""
        n = len(batch["caption"])
        drop = torch.zeros(n, dtype=torch.bool)
        if generator is not None and self.dropout > 0:
            drop = (torch.rand(n, generator=generator, device=generator.device) < self.dropout).cpu()
        if "latents" in batch:  # precomputed cache
            text = batch["text"].clone()
            assert self.empty_text is not None  # a cache's batches come with its empty text
            text[drop] = self.empty_text.to(text.dtype)
            return batch["latents"].to(self.device), text.to(self.device)
        captions = ["" if d else c for c, d in zip(batch["caption"], drop.tolist())]
        assert self.encoder is not None  # videos come with an encoder
        return self.encoder.latents(batch["video"]), self.encoder.text(captions)

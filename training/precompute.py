"""Encode a dataset's VAE latents and text embeddings once, so training runs without the text encoder.

    python -m training.precompute --config configs/finetune/wan2.1-1.3b-mhla.yaml --out cache/mydata [key=value ...]
    python -m training.finetune   --config configs/finetune/wan2.1-1.3b-mhla.yaml data.source=cache data.path=cache/mydata

The dataset, resolution and frame count come from the same config as training (``data.*``, ``model.path``).
The cache holds one ``sample_XXXXXXX.safetensors`` per video (``latents`` ``(16, F, h, w)`` and
``text`` ``(max_sequence_length, text_dim)``), ``empty_text.safetensors`` (the embedding caption
dropout swaps in) and ``index.json``. Each file is written under a temporary name and renamed, and an
interrupted run picks up where it stopped. Each video is cached with one clip (its first-epoch clip), or with
``data.cache_windows=N`` up to N clips spread evenly over it (``latents``, ``latents.1``, ...; training reads
another each epoch, as live decoding draws a new clip each epoch). Clips of mixed sizes are stored at their aspect
bucket's size (``data.buckets``), the item's ``(frames, height, width)`` in ``index.json`` where it is not the
configured one. Videos are encoded ``--batch-size`` at a time (default: as many as hold about 1M frame pixels, at most 16: 16 of the built-in
model's 9x64x80 clips, about 2.7x faster a video than one by one on a 2-core CPU; one 81-frame 480p clip); every
sample still gets its own file.
Each entry carries the SHA-256 of its tensors in its header and ``index.json`` lists them with a checksum of itself
(:mod:`training.cache`): a re-run checks the entries already there and writes a damaged one again, and
``--verify`` checks a cache without writing anything.
``precompute.json`` records the settings the cache was written with (the ``data.*`` keys that shape it
and the model); a later run with other settings is refused instead of mixing two datasets in one folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from common.errors import run_cli
from common.outputs import atomic_write, ensure_output_folder, resolve_output_folder, write_text_atomic
from pipelines import load_components
from training import cache as checksums
from training.config import DEFAULTS, FinetuneConfig, load_config
from training.encoding import Encoder


def _atomic_save(tensors: dict[str, Any], path: Path, metadata: dict[str, Any] | None = None) -> None:
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
    metadata = checksums.sealed_metadata(tensors, metadata)  # the entry vouches for itself (training/cache.py)
    with atomic_write(path) as tmp:  # a kill or SIGTERM mid-write leaves no partial sample behind
        save_file(tensors, str(tmp), metadata=metadata)


# frames x height x width of one encode call, by default: 16 of the built-in model's 9x64x80 clips (0.74M), one
# Wan2.1 clip of 81x480x832 (32M: a batch of them would not fit a GPU's memory)
AUTO_BATCH_PIXELS = 1_000_000
AUTO_BATCH_MAX = 16


def auto_batch(num_frames: int, height: int, width: int) -> int:
    """Videos a default encode call takes: as many as hold about :data:`AUTO_BATCH_PIXELS`, 1 to 16."""
    return max(1, min(AUTO_BATCH_MAX, AUTO_BATCH_PIXELS // max(1, num_frames * height * width)))


RECORD = "precompute.json"
RECORD_KEYS = (
    "source",
    "path",
    "num_samples",
    "world",
    "short_captions",
    "default_background",
    "num_frames",
    "height",
    "width",
    "frame_stride",
    "max_sequence_length",
)


def cache_record(cfg: FinetuneConfig, images: bool = False) -> dict[str, Any]:
    """What a cache written with ``cfg`` holds: the data settings that shape it, the model and seed (with
    ``images``: the one-frame images of joint training, ``data.image_num_samples`` of them)."""
    section = cfg.data
    data: dict[str, Any] = {k: getattr(section, k) for k in RECORD_KEYS}
    for key in ("layout", "video_column", "caption_column"):  # which manifest and columns: recorded when set
        if getattr(section, key) not in (None, "auto"):
            data[key] = getattr(section, key)
    # what else shapes a folder's samples: recorded when not at its default (a record written before these keys
    # matches without them)
    shaping = ("trigger_word", "fps", "min_frames", "repeats", "extra", "buckets", "bucket_sizes", "cache_windows")
    for key in shaping:
        value = getattr(section, key)
        if value != DEFAULTS["data"][key]:
            data[key] = value
    if images:
        data.update(num_frames=1, num_samples=section.image_num_samples or section.num_samples, images=True)
        if section.source == "folder":  # a folder of images: that folder, not the clips' settings
            data.update(image_path=section.image_path, num_samples=None, frame_stride=1)
            folder_keys = ("path", "layout", "video_column", "caption_column", "fps", "min_frames", "repeats", "extra")
            for key in (*folder_keys, "buckets", "bucket_sizes", "cache_windows"):
                data.pop(key, None)
    if section.source == "synthetic":  # the world's values where the config leaves them to it
        from training.data import synthetic_world

        world = synthetic_world(section)
        data.update(short_captions=world.short_captions, default_background=world.default_background)
    elif data["short_captions"] is None:  # as records wrote it before the key could be left to the world
        data["short_captions"] = 0.0
    return {
        "data": data,
        "model": None if cfg.model.path is None else str(cfg.model.path),
        "seed": cfg.train.seed,
    }


def stale_cache(out: str | Path, cfg: FinetuneConfig, images: bool = False) -> str | None:
    """Why the cache in ``out`` was not written with ``cfg``'s settings (the differing keys), or None.
    A folder without a record (written before records existed) is taken as matching."""
    path = Path(out) / RECORD
    if not path.is_file():
        return None
    now = cache_record(cfg, images)
    try:
        was = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:  # cut short or damaged: named, never a guess at its settings
        raise checksums.CacheDamaged(
            f"{str(path)!r} is not readable JSON ({e}); expected the settings the cache was written with: move the "
            "cache away and write it again, or write to a new folder"
        ) from None
    was["data"].setdefault("world", "v1")  # written before worlds had names
    keys = [*now["data"], *(k for k in was["data"] if k not in now["data"])]  # a cache of images has one more
    diff = [
        f"data.{k}: {was['data'].get(k)!r} -> {now['data'].get(k)!r}"
        for k in keys
        if was["data"].get(k) != now["data"].get(k)
    ]
    diff += [f"{k}: {was.get(k)!r} -> {now[k]!r}" for k in ("model", "seed") if was.get(k) != now[k]]
    return "; ".join(diff) or None


def _windows(item: dict[str, Any]) -> list[torch.Tensor]:
    """The clips of a loaded sample: its ``windows`` (``data.cache_windows``), else its one ``video``."""
    return item.get("windows") or [item["video"]]


def _index_item(name: str, meta: dict[str, Any]) -> dict[str, Any]:
    """``index.json``'s entry for a sample file from its header's metadata: file, caption, and where recorded its
    clip's ``video`` ``[frames, height, width]`` and ``windows`` (files written before buckets have neither)."""
    item: dict[str, Any] = {"file": name, "caption": meta["caption"]}
    if meta.get("video"):
        item["video"] = json.loads(meta["video"])
    if int(meta.get("windows", 1)) > 1:
        item["windows"] = int(meta["windows"])
    return item


def main(argv: list[str] | None = None) -> int:
    """``python -m training.precompute``, behind the error boundary of :func:`common.errors.run_cli`."""
    return run_cli(_main, argv, prog="training.precompute")


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.precompute", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="the config the cache is written with (required, except with --verify)")
    p.add_argument("--out", required=True, help="cache folder to write")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="videos encoded at once (one file each); default: as many as hold about 1M frame pixels, at most 16",
    )
    p.add_argument(
        "--images",
        action="store_true",
        help="write the one-frame images of joint image-video training instead of the clips: data.image_num_samples "
        "stills of the synthetic world, or with data.source=folder the images of data.image_path (a folder of "
        "images with captions); training reads the cache as data.image_path with data.source=cache",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every entry of the cache in --out against its checksum (training/cache.py), write nothing",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.verify:
        return verify(args.out)
    if not args.config:
        p.error("the following arguments are required: --config")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: expected a positive number of videos")
    # writing the images' cache: the run's own image settings (data.image_path: this cache, maybe not there yet)
    # are not this command's
    overrides = [*args.overrides, "data.image_ratio=0", "data.image_path=null"] if args.images else args.overrides
    cfg = load_config(args.config, overrides)
    if args.images and cfg.data.source == "folder":  # there data.image_path is the folder of images to encode
        cfg = load_config(args.config, [*args.overrides, "data.image_ratio=0"])
    if cfg.data.source == "cache":
        raise ValueError("data.source=cache: precompute reads videos (data.source folder or synthetic)")
    if args.images and cfg.data.source == "folder" and not cfg.data.image_path:
        raise ValueError(
            "--images with data.source=folder reads data.image_path (a folder of .png/.jpg/.webp images with a .txt "
            "caption beside each, or a manifest); expected data.image_path=DIR"
        )
    resolve_output_folder(args.out)  # a file or a symlink loop on the way: named before any work
    stale = stale_cache(args.out, cfg, args.images)
    if stale:
        raise ValueError(
            f"--out {args.out!r} holds a cache written with other settings ({stale}); "
            "write to a new folder, or move that one away"
        )
    from training.data import VideoFolderDataset, build_dataset  # the same dataset training would read

    # before the model loads: a folder of broken videos stops here
    dataset = build_dataset(cfg.data, cfg.train.seed, cfg.model, images=args.images)
    folder = dataset if isinstance(dataset, VideoFolderDataset) else None  # videos (or images) read from files
    if folder is not None:
        short = folder.check_clip_lengths()  # most videos too short for data.num_frames: refused here
        if short:
            print(short, file=sys.stderr)
        if folder.needs_probe:  # aspect and length buckets: each clip cached at its bucket's shape
            shapes = folder.probe_shapes(progress=True)
            if shapes:
                print(shapes, file=sys.stderr)
        folder.require_usable()
    out = ensure_output_folder(args.out)
    write_text_atomic(out / RECORD, json.dumps(cache_record(cfg, args.images), indent=1))
    num_frames = 1 if args.images else cfg.data.num_frames
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    components = load_components(cfg.model.path, dtype=cfg.model.dtype, device=device, seed=cfg.model.seed)
    encoder = Encoder(components, cfg.data.max_sequence_length)
    _atomic_save({"text": encoder.text([""])[0]}, out / "empty_text.safetensors")

    windows = 1 if args.images else cfg.data.cache_windows  # clips per video (data.source=folder)

    def load_or_skip(i: int) -> dict[str, Any] | None:
        """Sample ``i``: a folder's video (its ``windows`` clips), None when it cannot be read; synthetic clips never
        fail."""
        return folder.load_or_skip(i, windows=windows) if folder is not None else dataset[i]

    items: list[dict[str, Any] | None] = [None] * len(dataset)
    todo = []  # indices not written by an earlier, interrupted run
    for i in range(len(dataset)):
        name = f"sample_{i:07d}.safetensors"
        found, damaged = checksums.intact_metadata(out / name)  # checked against its checksum: a damaged one is redone
        if found is not None:
            items[i] = _index_item(name, found)
        else:
            todo.append(i)
            if damaged:
                print(f"{damaged}: written again", file=sys.stderr)
    batch = args.batch_size or auto_batch(num_frames, cfg.data.height, cfg.data.width)
    with tqdm(total=len(dataset), initial=len(dataset) - len(todo), desc="precompute", unit="video") as bar:
        for start in range(0, len(todo), batch):  # a batch of videos encodes ~2.7x faster a video than one by one
            chunk = []
            for i in todo[start : start + batch]:
                # an unreadable video is left out (and counted), never replaced by another
                item = load_or_skip(i)
                if item is not None:
                    chunk.append((i, item))
            text = encoder.text([item["caption"] for _, item in chunk]) if chunk else None
            # every clip (each window of each video) by shape: (3, data.num_frames, data.height, data.width), and
            # with data.min_frames / data.buckets the other lengths and sizes, each shape one stack
            clips = [(k, w, clip) for k, (_, item) in enumerate(chunk) for w, clip in enumerate(_windows(item))]
            latents: dict[tuple[int, int], torch.Tensor] = {}
            for shape in sorted({tuple(clip.shape) for *_, clip in clips}, reverse=True):
                same = [(k, w, clip) for k, w, clip in clips if tuple(clip.shape) == shape]
                encoded = encoder.latents(torch.stack([clip for *_, clip in same]))
                latents.update({(k, w): encoded[j].clone() for j, (k, w, _) in enumerate(same)})  # own storage each
            for k, (i, item) in enumerate(chunk):
                name = f"sample_{i:07d}.safetensors"
                count = len(_windows(item))
                tensors = {("latents" if w == 0 else f"latents.{w}"): latents[(k, w)] for w in range(count)}
                # what index.json lists of it, also in its own header (an interrupted run's files are listed again):
                # its clip's shape where it is not the cache's (a bucket's), its windows where more than one
                meta = {"caption": item["caption"]}
                if list(item["video"].shape[1:]) != [num_frames, cfg.data.height, cfg.data.width]:
                    meta["video"] = json.dumps(list(item["video"].shape[1:]))
                if count > 1:
                    meta["windows"] = str(count)
                _atomic_save({**tensors, "text": text[k]}, out / name, meta)  # type: ignore[index]
                items[i] = _index_item(name, meta)
            bar.update(len(todo[start : start + batch]))
    items = [item for item in items if item is not None]
    if not items:
        why = folder.skip_summary() if folder is not None else "no sample was read"
        raise ValueError(f"no sample could be written to {out}; {why}")
    index = {
        "video": [num_frames, cfg.data.height, cfg.data.width],
        "model": components.source,
        "max_sequence_length": cfg.data.max_sequence_length,
        "items": items,
    }
    write_text_atomic(out / "index.json", json.dumps(checksums.seal_index(out, index), indent=1))
    print(f"wrote {len(items)} samples to {out}")
    summary = getattr(dataset, "skip_summary", None)
    if summary is not None:
        print(summary())
    return 0


def verify(out: str) -> int:
    """``--verify``: every entry of the cache in ``out`` read and checked against its checksum; exit 2 naming the
    damaged ones (a re-run of precompute writes them again)."""
    checked, damaged, sealed = checksums.verify_cache(out)
    if damaged:
        more = f" and {len(damaged) - 5} more" if len(damaged) > 5 else ""
        raise checksums.CacheDamaged(
            f"cache {out!r}: {len(damaged)} damaged file(s) of {checked} entries and empty_text: "
            f"{'; '.join(damaged[:5])}{more}; run "
            f"training.precompute with the cache's config and --out {out!r} again to write them again"
        )
    if sealed:
        print(f"cache {out!r}: all {checked} entries and empty_text match their checksums")
    else:
        print(f"cache {out!r}: all {checked} entries and empty_text read (written without checksums: none to check)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

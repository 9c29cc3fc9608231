"""Encode a dataset's VAE latents and text embeddings once, so training runs without the text encoder.

    python -m training.precompute --config configs/finetune/wan2.1-1.3b-mhla.yaml --out cache/mydata [key=value ...]
    python -m training.finetune   --config configs/finetune/wan2.1-1.3b-mhla.yaml data.source=cache data.path=cache/mydata

The dataset, resolution and frame count come from the same config as training (``data.*``, ``model.path``).
The cache holds one ``sample_XXXXXXX.safetensors`` per video (``latents`` ``(16, F, h, w)`` and
``text`` ``(max_sequence_length, text_dim)``), ``empty_text.safetensors`` (the embedding caption
dropout swaps in) and ``index.json``. Each file is written under a temporary name and renamed, and an
interrupted run picks up where it stopped. Each video is cached with one clip (its first-epoch clip). Videos are
encoded ``--batch-size`` at a time (default: as many as hold about 1M frame pixels, at most 16: 16 of the built-in
model's 9x64x80 clips, about 2.7x faster a video than one by one on a 2-core CPU; one 81-frame 480p clip); every
sample still gets its own file.
``precompute.json`` records the settings the cache was written with (the ``data.*`` keys that shape it
and the model); a later run with other settings is refused instead of mixing two datasets in one folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import ListConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from common.errors import run_cli
from common.outputs import atomic_write, ensure_output_folder, resolve_output_folder, write_text_atomic
from pipelines import load_components
from training.config import load_config
from training.encoding import Encoder


def _atomic_save(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    with atomic_write(path) as tmp:  # a kill or SIGTERM mid-write leaves no partial sample behind
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)


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


def cache_record(cfg, images: bool = False) -> dict:
    """What a cache written with ``cfg`` holds: the data settings that shape it, the model and seed (with
    ``images``: the one-frame images of joint training, ``data.image_num_samples`` of them)."""
    data = {k: cfg.data.get(k) for k in RECORD_KEYS}
    for key in ("layout", "video_column", "caption_column"):  # which manifest and columns: recorded when set
        if cfg.data.get(key) not in (None, "auto"):
            data[key] = cfg.data.get(key)
    # what else shapes a folder's samples: recorded when set (a record written before these keys matches without)
    for key, default in (("trigger_word", None), ("fps", None), ("min_frames", None), ("repeats", 1), ("extra", [])):
        value = cfg.data.get(key, default)
        value = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
        if value != default:
            data[key] = value
    if images:
        data.update(num_frames=1, num_samples=cfg.data.image_num_samples or cfg.data.num_samples, images=True)
        if cfg.data.source == "folder":  # a folder of images: that folder, not the clips' settings
            data.update(image_path=cfg.data.image_path, num_samples=None, frame_stride=1)
            for key in ("path", "layout", "video_column", "caption_column", "fps", "min_frames", "repeats", "extra"):
                data.pop(key, None)
    if cfg.data.source == "synthetic":  # the world's values where the config leaves them to it
        from training.data import synthetic_world

        world = synthetic_world(cfg)
        data.update(short_captions=world.short_captions, default_background=world.default_background)
    elif data["short_captions"] is None:  # as records wrote it before the key could be left to the world
        data["short_captions"] = 0.0
    return {
        "data": data,
        "model": None if cfg.model.path is None else str(cfg.model.path),
        "seed": cfg.train.seed,
    }


def stale_cache(out: str | Path, cfg, images: bool = False) -> str | None:
    """Why the cache in ``out`` was not written with ``cfg``'s settings (the differing keys), or None.
    A folder without a record (written before records existed) is taken as matching."""
    path = Path(out) / RECORD
    if not path.is_file():
        return None
    was, now = json.loads(path.read_text()), cache_record(cfg, images)
    was["data"].setdefault("world", "v1")  # written before worlds had names
    keys = [*now["data"], *(k for k in was["data"] if k not in now["data"])]  # a cache of images has one more
    diff = [
        f"data.{k}: {was['data'].get(k)!r} -> {now['data'].get(k)!r}"
        for k in keys
        if was["data"].get(k) != now["data"].get(k)
    ]
    diff += [f"{k}: {was.get(k)!r} -> {now[k]!r}" for k in ("model", "seed") if was.get(k) != now[k]]
    return "; ".join(diff) or None


def main(argv=None) -> int:
    """``python -m training.precompute``, behind the error boundary of :func:`common.errors.run_cli`."""
    return run_cli(_main, argv, prog="training.precompute")


def _main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m training.precompute", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
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
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
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
    from training.data import build_dataset  # the same dataset training would read

    dataset = build_dataset(cfg, images=args.images)  # before the model loads: a folder of broken videos stops here
    if hasattr(dataset, "check_clip_lengths"):  # most videos too short for data.num_frames: refused here
        short = dataset.check_clip_lengths()
        if short:
            print(short, file=sys.stderr)
    if hasattr(dataset, "require_usable"):
        dataset.require_usable()
    out = ensure_output_folder(args.out)
    write_text_atomic(out / RECORD, json.dumps(cache_record(cfg, args.images), indent=1))
    num_frames = 1 if args.images else cfg.data.num_frames
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    components = load_components(cfg.model.path, dtype=cfg.model.dtype, device=device, seed=cfg.model.seed)
    encoder = Encoder(components, cfg.data.max_sequence_length)
    load_or_skip = getattr(dataset, "load_or_skip", dataset.__getitem__)  # synthetic clips never fail
    _atomic_save({"text": encoder.text([""])[0]}, out / "empty_text.safetensors")

    items: list[dict | None] = [None] * len(dataset)
    todo = []  # indices not written by an earlier, interrupted run
    for i in range(len(dataset)):
        name = f"sample_{i:07d}.safetensors"
        if (out / name).is_file():
            with safe_open(str(out / name), framework="pt") as f:
                items[i] = {"file": name, "caption": f.metadata()["caption"]}
        else:
            todo.append(i)
    batch = args.batch_size or auto_batch(num_frames, cfg.data.height, cfg.data.width)
    with tqdm(total=len(dataset), initial=len(dataset) - len(todo), desc="precompute", unit="video") as bar:
        for start in range(0, len(todo), batch):  # a batch of videos encodes ~2.7x faster a video than one by one
            chunk = []
            for i in todo[start : start + batch]:
                item = load_or_skip(i)  # an unreadable video is left out (and counted), never replaced by another
                if item is not None:
                    chunk.append((i, item))
            # clips of one shape are one stack: (3, data.num_frames, data.height, data.width), and with
            # data.min_frames the shorter lengths, each its own
            for shape in sorted({tuple(item["video"].shape) for _, item in chunk}, reverse=True):
                same = [(i, item) for i, item in chunk if tuple(item["video"].shape) == shape]
                latents = encoder.latents(torch.stack([item["video"] for _, item in same]))
                text = encoder.text([item["caption"] for _, item in same])
                for k, (i, item) in enumerate(same):
                    name = f"sample_{i:07d}.safetensors"
                    _atomic_save({"latents": latents[k], "text": text[k]}, out / name, {"caption": item["caption"]})
                    items[i] = {"file": name, "caption": item["caption"]}
            bar.update(len(todo[start : start + batch]))
    items = [item for item in items if item is not None]
    if not items:
        raise ValueError(f"no sample could be written to {out}; {dataset.skip_summary()}")
    index = {
        "video": [num_frames, cfg.data.height, cfg.data.width],
        "model": components.source,
        "max_sequence_length": cfg.data.max_sequence_length,
        "items": items,
    }
    write_text_atomic(out / "index.json", json.dumps(index, indent=1))
    print(f"wrote {len(items)} samples to {out}")
    summary = getattr(dataset, "skip_summary", None)
    if summary is not None:
        print(summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the built-in model's shapes go wrong: two diagnoses whose outputs sit beside its evaluation (issue 49).

    python -m factory.shape_probe unconditional [--model DIR] [--transformer DIR] [--seeds 8] [--out OUT]
    python -m factory.shape_probe swap [--model DIR] [--transformer DIR] [--clips 16] [--sigmas 0.5 0.7 0.9] [--out OUT]
    python -m factory.shape_probe uncaptioned [--model DIR] [--transformer DIR] [--clips 16] [--sigmas ...] [--out OUT]

- **unconditional**: videos from the empty caption (no guidance), and the share of their frames whose object reads
  as any of the world's shapes (:func:`world.analyse.read_shape`, on a compact object): has the model learnt what a
  polygon is, with or without the word? Real clips read at 1.00.
- **swap** (the noised-real-clip test): real validation clips encoded, noised to sigma ``s`` (the training's flow
  convention, ``x_s = (1 - s) x_0 + s noise``) and denoised back with guidance, once with the true caption and once
  with the shape word swapped for another shape; per ``s``: *kept* (the true caption's video still shows the clip's
  shape) and *follows* (the swapped caption's video shows the swapped shape). At low ``s`` the clip's outline is
  still in the input, so it is kept whatever the caption; at high ``s`` the shape is decided by the model, and a
  model that reads the shape word follows the swap.
- **uncaptioned**: the same noised real clips denoised with the empty caption and no guidance; per ``s``, how many
  keep their background, their object's colour and its shape: the noise level up to which the model reads each
  attribute from the noisy input alone. Generating from pure noise without a caption needs it read near ``s = 1``
  (where the unconditional videos' background and object are decided); the unconditional mode reports, beside the
  shape rate, the frames with any object and the backgrounds drawn.

``--transformer`` replaces the model's transformer with a folder or a training checkpoint's (``--weights ema``, its
``transformer/``, or ``raw``, its trainable weights: what a short arm changed, undiluted by the EMA).

Both sample with the flow's Euler steps on the model scheduler's shifted sigmas (from ``s``, or 1, down to 0), the
transformer called as the training recipe calls it, classifier-free guidance against the empty caption; frames are
decoded by the model's VAE and judged by the analyser. ``--out OUT`` writes ``OUT.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from factory import world_clips, write_json
from factory.next import stage_transformer
from pipelines import BUILTIN_DIR, load_components
from training.encoding import Encoder
from training.finetune import ModelCall
from world.analyse import ANALYSER_VERSION, OTHER, analyse, colour_masks, is_object, read_shape
from world.synthetic import PLAIN_BACKGROUNDS, SHAPES, SyntheticVideoDataset, world_named


def flow_sigmas(steps: int, shift: float, start: float = 1.0) -> list[float]:
    """The sampler's noise levels from ``start`` down to 0: the model's ``steps``-step schedule (``linspace(1, 0)``
    shifted as Wan's flow schedulers shift it, ``shift * s / (1 + (shift - 1) * s)``), entered at ``start``."""
    s = np.linspace(1.0, 0.0, steps + 1)
    shifted = shift * s / (1 + (shift - 1) * s)
    return [float(start)] + [float(x) for x in shifted if x < start - 1e-6]


@torch.no_grad()
def denoise(transformer, x: torch.Tensor, sigmas: list[float], text, empty, guidance: float) -> torch.Tensor:
    """Euler steps of the flow ``dx/dsigma = v`` (the transformer predicts ``v = noise - x_0``) through ``sigmas``,
    with classifier-free guidance ``v_empty + guidance * (v_text - v_empty)`` (no guidance at 1 or less)."""
    call = ModelCall(patch_size=tuple(transformer.config.patch_size))
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((x.shape[0],), s, device=x.device)
        v = call(transformer, x, t, text)
        if guidance > 1.0:
            v_empty = call(transformer, x, t, empty)
            v = v_empty + guidance * (v - v_empty)
        x = x + (s_next - s) * v
    return x


@torch.no_grad()
def decode(components, latents: torch.Tensor) -> np.ndarray:
    """Normalised latents ``(B, C, F, h, w)`` -> uint8 frames ``(B, T, H, W, 3)``, as the pipeline decodes them."""
    cfg = components.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(latents)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(latents)
    p = next(components.vae.parameters())
    video = components.vae.decode((latents * std + mean).to(p.dtype), return_dict=False)[0].float()
    frames = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (B, 3, T, H, W)
    return frames.permute(0, 2, 3, 4, 1).cpu().numpy()


def frame_shapes(frames: np.ndarray, colours: tuple[str, ...]) -> list[str | None]:
    """Per frame of one video, what its largest object reads as: a world shape, ``other``, or None (nothing)."""
    masks = colour_masks(frames, colours=colours)
    out: list[str | None] = []
    for i in range(len(frames)):
        sizes = {c: int(m[i].sum()) for c, m in masks.items()}
        colour = max(sizes, key=sizes.get)
        mask = masks[colour][i]
        if sizes[colour] < 0.004 * mask.size:
            out.append(None)
        else:
            out.append(read_shape(mask).shape if is_object(mask) else OTHER)
    return out


def read_background(frames: np.ndarray, backgrounds: tuple[str, ...]) -> str:
    """The plain background (of ``backgrounds``) whose grey level is nearest the middle frame's median pixel: the
    object covers a few percent of a frame, so the median is the background's."""
    level = float(np.median(frames[len(frames) // 2]))
    plain = {b: PLAIN_BACKGROUNDS[b] for b in backgrounds if b in PLAIN_BACKGROUNDS}
    if not plain:
        raise ValueError(f"backgrounds {backgrounds} has no plain one ({', '.join(PLAIN_BACKGROUNDS)}) to read")
    return min(plain, key=lambda b: abs(plain[b] - level))


def _setup(args):
    components = load_components(args.model, dtype="float32", device="cpu")
    transformer = stage_transformer(args.transformer, args.weights) if args.transformer else None
    transformer = (transformer or components.transformer).eval()
    encoder = Encoder(components, components.defaults.get("max_sequence_length", 512))
    return components, transformer, encoder


def unconditional(args) -> dict:
    components, transformer, encoder = _setup(args)
    d, world = components.defaults, world_named(args.world)
    shift = float(components.scheduler.config.get("flow_shift", 3.0))
    stride = components.vae_stride
    shape = (1, transformer.config.in_channels, (d["num_frames"] - 1) // stride[0] + 1)
    shape += (d["height"] // stride[1], d["width"] // stride[1])
    empty = encoder.text([""])
    readings, backgrounds = [], []
    for seed in range(args.seeds):
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        latents = denoise(transformer, noise, flow_sigmas(args.steps, shift), empty, empty, 1.0)
        video = decode(components, latents)[0]
        readings.append(frame_shapes(video, world.colours))
        backgrounds.append(read_background(video, world.backgrounds))
    flat = [r for video in readings for r in video]
    counts = {k: flat.count(k) for k in (*SHAPES, OTHER, None)}
    return {
        "what": "share of frames of unconditional videos (empty caption, no guidance) whose object reads as a shape",
        "shape_rate": sum(counts[s] for s in SHAPES) / max(1, len(flat)),
        "object_rate": sum(r is not None for r in flat) / max(1, len(flat)),
        "frames": len(flat),
        "readings": {str(k): v for k, v in counts.items()},
        "backgrounds": {b: backgrounds.count(b) for b in world.backgrounds if b in PLAIN_BACKGROUNDS},
        "per_video": readings,
        "seeds": args.seeds,
    }


def _swapped(caption: str, shape: str) -> tuple[str, str]:
    other = SHAPES[(SHAPES.index(shape) + 1) % len(SHAPES)]
    return caption.replace(shape, other, 1), other


def swap(args) -> dict:
    components, transformer, encoder = _setup(args)
    d, world = components.defaults, world_named(args.world)
    shift = float(components.scheduler.config.get("flow_shift", 3.0))
    guidance = args.guidance if args.guidance is not None else d.get("guidance_scale", 4.0)
    data = _validation_clips(args, d, world)
    empty = encoder.text([""])
    rows = {f"{s:g}": {"kept": 0, "follows": 0, "clips": 0} for s in args.sigmas}
    per_clip = []
    for i in range(args.clips):
        item, obj = data[i], data.attributes(i)["objects"][0]
        if obj["shape"] not in item["caption"]:
            continue  # (the world's captions always name the shape)
        x0 = encoder.latents(item["video"][None])
        swapped, other = _swapped(item["caption"], obj["shape"])
        texts = encoder.text([item["caption"], swapped])
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1000 + i))
        clip = {"caption": item["caption"], "shape": obj["shape"], "swapped_to": other}
        for s in args.sigmas:
            start = (1 - s) * x0 + s * noise
            both = denoise(
                transformer,
                start.repeat(2, 1, 1, 1, 1),
                flow_sigmas(args.steps, shift, s),
                texts,
                empty.repeat(2, 1, 1),
                guidance,
            )
            true_video, swap_video = decode(components, both)
            kept = analyse(true_video, item["caption"], colours=world.colours)["shape"]
            follows = analyse(swap_video, swapped, colours=world.colours)["shape"]
            row = rows[f"{s:g}"]
            row["kept"] += bool(kept)
            row["follows"] += bool(follows)
            row["clips"] += 1
            clip[f"{s:g}"] = {"kept": bool(kept), "follows": bool(follows)}
        per_clip.append(clip)
    return {
        "what": "real clips noised to sigma and denoised with the true caption (kept) and a swapped shape word "
        "(follows)",
        "guidance": guidance,
        "sigmas": {
            k: {**v, "kept_rate": v["kept"] / max(1, v["clips"]), "follows_rate": v["follows"] / max(1, v["clips"])}
            for k, v in rows.items()
        },
        "per_clip": per_clip,
    }


def uncaptioned(args) -> dict:
    components, transformer, encoder = _setup(args)
    d, world = components.defaults, world_named(args.world)
    shift = float(components.scheduler.config.get("flow_shift", 3.0))
    data = _validation_clips(args, d, world)
    empty = encoder.text([""])
    rows = {f"{s:g}": dict.fromkeys(("background", "colour", "shape", "clips"), 0) for s in args.sigmas}
    for i in range(args.clips):
        item = data[i]
        x0 = encoder.latents(item["video"][None])
        own = read_background(decode(components, x0)[0], world.backgrounds)  # what the VAE gives back, not the label
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1000 + i))
        for s in args.sigmas:
            start = (1 - s) * x0 + s * noise
            video = decode(
                components, denoise(transformer, start, flow_sigmas(args.steps, shift, s), empty, empty, 1.0)
            )[0]
            verdict = analyse(video, item["caption"], colours=world.colours)
            row = rows[f"{s:g}"]
            row["background"] += read_background(video, world.backgrounds) == own
            row["colour"] += bool(verdict["colour"])
            row["shape"] += bool(verdict["shape"])
            row["clips"] += 1
    return {
        "what": "real clips noised to sigma and denoised with the empty caption, no guidance: clips that keep their "
        "background, their object's colour and its shape",
        "sigmas": rows,
    }


def _validation_clips(args, d: dict, world) -> SyntheticVideoDataset:
    return world_clips(args.clips, d, world, seed=args.data_seed)


def main(argv=None) -> int:
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.shape_probe")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.shape_probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("unconditional", "swap", "uncaptioned"):
        s = sub.add_parser(name)
        s.add_argument("--model", default=str(BUILTIN_DIR), help="model directory (default: the built-in model)")
        s.add_argument(
            "--transformer",
            default=None,
            help="a softmax transformer folder, or a training checkpoint's (see --weights), replacing the model's",
        )
        s.add_argument(
            "--weights",
            choices=("ema", "raw"),
            default="ema",
            help="of a checkpoint: its transformer/ (the EMA's; default) or its raw trainable weights",
        )
        s.add_argument("--world", default="v3", help="the synthetic world the model was trained on")
        s.add_argument("--steps", type=int, default=20, help="the full schedule's steps (a swap enters it at s)")
        s.add_argument("--out", default=None, help="writes OUT.json")
        if name == "unconditional":
            s.add_argument("--seeds", type=int, default=8)
        else:
            s.add_argument("--clips", type=int, default=16)
            default = [0.5, 0.7, 0.9] if name == "swap" else [0.5, 0.7, 0.8, 0.9, 0.95]
            s.add_argument("--sigmas", type=float, nargs="+", default=default)
            if name == "swap":
                s.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the model's)")
            s.add_argument("--data-seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.weights == "raw" and not args.transformer:
        p.error("--weights raw needs --transformer CHECKPOINT (a training checkpoint's raw weights)")
    if args.cmd != "unconditional" and not all(0 < s <= 1 for s in args.sigmas):
        p.error(f"--sigmas must be in (0, 1], got {args.sigmas}")
    t0 = time.time()
    res = {"unconditional": unconditional, "swap": swap, "uncaptioned": uncaptioned}[args.cmd](args)
    res.update(
        model=args.model,
        transformer=args.transformer,
        weights=args.weights if args.transformer else None,
        analyser_version=ANALYSER_VERSION,
        minutes=round((time.time() - t0) / 60, 2),
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    if args.cmd == "unconditional":
        print(
            f"unconditional: {res['shape_rate']:.2f} of {res['frames']} frames read as a shape {res['readings']}; "
            f"{res['object_rate']:.2f} hold an object; backgrounds {res['backgrounds']}"
        )
    elif args.cmd == "uncaptioned":
        for s, r in res["sigmas"].items():
            n = r["clips"]
            print(
                f"sigma {s}, no caption: kept background {r['background']}/{n}, colour {r['colour']}/{n}, shape {r['shape']}/{n}"
            )
    else:
        for s, r in res["sigmas"].items():
            print(f"sigma {s}: kept {r['kept']}/{r['clips']}, follows a swapped shape word {r['follows']}/{r['clips']}")
    if args.out:
        write_json(Path(args.out), res)
        print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

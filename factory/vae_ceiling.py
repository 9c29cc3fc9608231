"""The VAE ceiling: how well a VAE's reconstructions of held-out clips still show what their captions say.

    python -m factory.vae_ceiling --vae assets/builtin/vae                       # the shipped VAE
    python -m factory.vae_ceiling --ground-truth                                 # the clips themselves (~1.0)
    python -m factory.vae_ceiling --vae runs/pilots/x/final/vae --height 64 --width 80 --out benchmarks/results/x

A perfect transformer can draw no better than its VAE decodes: this is the top of the built-in
model's semantic score. For each of ``--num-clips`` clips of the synthetic *validation* split
(``--data-seed``; never seen by a VAE trained on the train split) it encodes the whole clip
(posterior mean), decodes it, and reports

- ``psnr_db``: PSNR over all pixels of all clips (pooled MSE, signal range [-1, 1]);
- ``psnr_object_db``: the same over the object pixels only (saturated ones in the real clip: a few
  per cent of a frame, what the analyser looks at);
- ``psnr_worst_clip_db``, ``psnr_by_background_db`` (pooled over the clips of each background) and
  ``psnr_by_frame_db`` (pooled over clips, one per frame index): where a VAE loses it, e.g. one
  background, or later frames drifting through the causal temporal cache;
- the analyser's (:mod:`world.analyse`) per-attribute accuracy and ``overall`` on the
  reconstructions, judged against each clip's attribute dict.

``--ground-truth`` scores the real clips (no VAE): the analyser must reach ~1.0 there, else the
analyser, not the VAE, is the limit. Writes ``<out>.json`` when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from factory import write_json
from world.analyse import ANALYSER_VERSION, ATTRIBUTES, analyse, score
from world.synthetic import WORLDS, SyntheticVideoDataset


def to_frames(video: torch.Tensor) -> np.ndarray:
    """``(3, T, H, W)`` in [-1, 1] -> uint8 ``(T, H, W, 3)`` (values outside [-1, 1] clipped)."""
    return ((video.float().clamp(-1, 1).permute(1, 2, 3, 0).cpu().numpy() + 1) * 127.5).round().astype(np.uint8)


def object_mask(video: torch.Tensor) -> torch.Tensor:
    """Saturated pixels ``(1, T, H, W)`` of a real clip ``(3, T, H, W)``: the objects (backgrounds are grey-toned)."""
    return (video.amax(0, keepdim=True) - video.amin(0, keepdim=True)) > 0.5


@torch.no_grad()
def reconstruction_ceiling(vae, dataset, indices, keep: list[np.ndarray] | None = None, keep_first: int = 0) -> dict:
    """PSNR and analyser scores of ``vae``'s reconstructions of ``dataset[i]`` for ``i`` in ``indices``
    (``vae=None``: the real clips themselves, PSNR infinite). The uint8 frames of the first
    ``keep_first`` reconstructions are appended to ``keep`` (the evaluation's picture grid)."""
    verdicts, sq, n, sq_obj, n_obj, per_clip = [], 0.0, 0, 0.0, 0, []
    by_background: dict[str, list[float]] = {}  # background -> [sum of squared errors, count]
    frame_sq: torch.Tensor | float = 0.0  # per frame index: sum of squared errors (all clips have as many frames)
    frame_n = 0  # and the count of each
    for i in indices:
        video = dataset[i]["video"]
        if vae is None:
            rec = video
        else:
            z = vae.encode(video[None].to(vae.device, vae.dtype)).latent_dist.mean
            rec = vae.decode(z).sample[0].float().cpu().clamp(-1, 1)
        # the analyser sees what a user sees: the clip quantised to uint8
        frames = to_frames(rec)
        if keep is not None and len(keep) < keep_first:
            keep.append(frames)
        err = (torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1.0) - video
        e2 = err.square()
        m = object_mask(video).expand_as(e2)
        sq, n = sq + e2.sum().item(), n + e2.numel()
        sq_obj, n_obj = sq_obj + e2[m].sum().item(), n_obj + int(m.sum())
        per_clip.append(e2.mean().item())
        attributes = dataset.attributes(i)
        acc = by_background.setdefault(attributes["background"], [0.0, 0])
        acc[0], acc[1] = acc[0] + e2.sum().item(), acc[1] + e2.numel()
        frame_sq = frame_sq + e2.sum(dim=(0, 2, 3), dtype=torch.float64)
        frame_n += e2[:, 0].numel()
        v = analyse(frames, attributes, colours=dataset.world.colours)
        v["index"] = int(i)
        verdicts.append(v)

    def psnr(mse):
        return round(10 * math.log10(4.0 / mse), 2) if mse > 0 else float("inf")

    out = score(verdicts)
    out.update(
        psnr_db=psnr(sq / n),
        psnr_object_db=psnr(sq_obj / max(n_obj, 1)),
        psnr_worst_clip_db=psnr(max(per_clip)),
        psnr_by_background_db={b: psnr(total / count) for b, (total, count) in sorted(by_background.items())},
        psnr_by_frame_db=[psnr(total / frame_n) for total in torch.as_tensor(frame_sq).tolist()],
        failures=[
            {
                "index": v["index"],
                "caption": dataset[v["index"]]["caption"],
                "found": v["found"],
                **{a: v[a] for a in ATTRIBUTES},
            }
            for v in verdicts
            if not all(v[a] in (True, None) for a in ATTRIBUTES)
        ][:8],
    )
    return out


def main(argv=None) -> int:
    """``python -m factory.vae_ceiling``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.vae_ceiling")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.vae_ceiling", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--vae", help="an AutoencoderKLWan folder (config.json + safetensors)")
    g.add_argument("--ground-truth", action="store_true", help="score the real clips (checks the analyser)")
    p.add_argument("--num-clips", type=int, default=32)
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic validation split")
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--width", type=int, default=160)
    p.add_argument("--world", choices=sorted(WORLDS), default="v1", help="the synthetic world's preset")
    p.add_argument("--out", default=None, help="writes OUT.json")
    args = p.parse_args(argv)
    if args.num_clips < 1:
        p.error(f"--num-clips must be >= 1, got {args.num_clips}")
    vae = None
    if args.vae:
        from diffusers import AutoencoderKLWan

        if not (Path(args.vae) / "config.json").is_file():
            p.error(f"--vae {args.vae!r} has no config.json (expected an AutoencoderKLWan folder)")
        vae = AutoencoderKLWan.from_pretrained(args.vae, dtype=torch.float32).eval()
    data = SyntheticVideoDataset(
        args.num_clips,
        seed=args.data_seed,
        split="validation",
        num_frames=args.frames,
        height=args.height,
        width=args.width,
        world=WORLDS[args.world],
    )
    t0 = time.time()
    res = reconstruction_ceiling(vae, data, range(args.num_clips))
    res = {
        "vae": args.vae or "ground truth",
        "vae_config": {k: vae.config[k] for k in ("base_dim", "z_dim", "dim_mult", "temperal_downsample")}
        if vae
        else None,
        "parameters_m": round(sum(x.numel() for x in vae.parameters()) / 1e6, 2) if vae else None,
        "clips": [args.frames, args.height, args.width],
        "num_clips": args.num_clips,
        "world": args.world,
        "data_seed": args.data_seed,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "analyser_version": ANALYSER_VERSION,
        "seconds": round(time.time() - t0, 1),
        **res,
    }
    line = ", ".join(f"{a} {res[a]:.2f}" for a in ATTRIBUTES if res[a] is not None)
    print(
        f"{res['vae']}: PSNR {res['psnr_db']} dB (objects {res['psnr_object_db']} dB, worst clip "
        f"{res['psnr_worst_clip_db']} dB); analyser overall {res['overall']:.2f} ({line}) on {args.num_clips} clips"
    )
    print("  by background: " + ", ".join(f"{b} {v} dB" for b, v in res["psnr_by_background_db"].items()))
    print("  by frame: " + " ".join(f"{v}" for v in res["psnr_by_frame_db"]) + " dB")
    for f in res["failures"][:4]:
        print(f"  wrong: {f['caption']!r} -> {f['found']}")
    if args.out:
        print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

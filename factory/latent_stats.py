"""Latent statistics, frame by frame: what the transformer generates against what the VAE encodes.

    python -m factory.latent_stats                       # the built-in model, flash, 6 prompts
    python -m factory.latent_stats --guidance 1 --variant mhla --num-prompts 12 --out runs/x

A diagnosis of a first-frame fault (every variant's first generated frame comes out in
the wrong colours). AutoencoderKLWan encodes causally: latent frame 0 holds pixel frame 0 alone, every
later latent frame four pixel frames, so frame 0's latents have statistics of their own. The
transformer sees positions only through RoPE, relatively, so it must infer that a token sits in the
first frame. For the first ``--num-prompts`` validation captions (data seed ``--data-seed``) this
encodes the real clip and generates one video (seed 0, ``output_type="latent"``), both in the
pipeline's normalised latent space, and reports per latent frame ``f``:

- ``real_std`` / ``generated_std``: the standard deviation of all latents of frame ``f``;
- ``channel_mean_gap``: the mean over channels of |mean over prompts and positions of generated
  minus real|;
- ``corr_real[f][g]``: the correlation, over the 16 channels, of the generated frame ``f``'s channel
  means with the real frame ``g``'s. A model that knows which frame it draws has its largest value of
  row ``f`` at ``g = f``; a first frame drawn like the second has it at ``g = 1``.

Writes ``<out>.json`` when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from tqdm.auto import tqdm

from factory import world_clips, write_json
from pipelines import BUILTIN_DIR, VARIANTS, GenerationRequest, load_components
from pipelines.attention import SOFTMAX
from pipelines.pipeline import generate
from training.encoding import Encoder
from world.synthetic import WORLDS


def frame_statistics(real: torch.Tensor, generated: torch.Tensor) -> dict:
    """Per-latent-frame statistics of ``real`` and ``generated`` latents, both ``(N, C, F, h, w)``."""
    if real.shape != generated.shape:
        raise ValueError(f"real latents {tuple(real.shape)} and generated ones {tuple(generated.shape)} differ")
    frames = real.shape[2]
    real_means = real.mean(dim=(0, 3, 4)).double().numpy()  # (C, F)
    gen_means = generated.mean(dim=(0, 3, 4)).double().numpy()
    corr = [[float(np.corrcoef(gen_means[:, f], real_means[:, g])[0, 1]) for g in range(frames)] for f in range(frames)]
    return {
        "real_std": [round(real[:, :, f].std().item(), 4) for f in range(frames)],
        "generated_std": [round(generated[:, :, f].std().item(), 4) for f in range(frames)],
        "channel_mean_gap": [round(float(np.abs(gen_means[:, f] - real_means[:, f]).mean()), 4) for f in range(frames)],
        "corr_real": [[round(v, 3) for v in row] for row in corr],
        "closest_real_frame": [int(np.argmax(row)) for row in corr],
    }


def main(argv=None) -> int:
    """``python -m factory.latent_stats``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.latent_stats")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.latent_stats", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the built-in model in assets/builtin)")
    p.add_argument("--variant", default=SOFTMAX, choices=VARIANTS)
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--world", choices=sorted(WORLDS), default="v1", help="the synthetic world (world.synthetic.WORLDS)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the model's)")
    p.add_argument(
        "--guidance-max-sigma",
        type=float,
        default=None,
        help="guide only the steps whose noise level sigma is at most this (default: the model's; 1 = every step)",
    )
    p.add_argument("--out", default=None, help="writes OUT.json")
    args = p.parse_args(argv)
    if args.num_prompts < 2:
        p.error(f"--num-prompts must be >= 2 (correlations over prompts' means), got {args.num_prompts}")
    if args.guidance_max_sigma is not None and not 0.0 <= args.guidance_max_sigma <= 1.0:
        p.error(f"--guidance-max-sigma must be a noise level in [0, 1], got {args.guidance_max_sigma:g}")
    components = load_components(args.model or BUILTIN_DIR, dtype="float32", device="cpu")
    if components.random_weights:
        p.error("the model has random weights; use the built-in model or a trained one (--model)")
    d = components.defaults
    data = world_clips(args.num_prompts, d, WORLDS[args.world], seed=args.data_seed)
    encoder = Encoder(components)  # the normalised latents the transformer was trained on
    real, generated = [], []
    for i in tqdm(range(args.num_prompts), desc=f"latents [{args.variant}]"):
        item = data[i]
        real.append(encoder.latents(item["video"][None])[0].cpu())
        request = GenerationRequest(
            prompt=item["caption"],
            variant=args.variant,
            seed=0,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            guidance_max_sigma=args.guidance_max_sigma,
            output_type="latent",
        )
        result = generate(components, request, show_progress=False)
        generated.append(torch.as_tensor(result.frames)[0].float().cpu())
    stats = frame_statistics(torch.stack(real), torch.stack(generated))
    res = {
        "model": str(args.model or BUILTIN_DIR),
        "variant": args.variant,
        "num_prompts": args.num_prompts,
        "data_seed": args.data_seed,
        "guidance_scale": args.guidance if args.guidance is not None else d["guidance_scale"],
        "guidance_max_sigma": args.guidance_max_sigma
        if args.guidance_max_sigma is not None
        else d.get("guidance_max_sigma", 1.0),
        "num_inference_steps": args.steps or d["num_inference_steps"],
        **stats,
    }
    print(
        f"{res['variant']}, CFG {res['guidance_scale']:g} at sigma <= {res['guidance_max_sigma']:g}, "
        f"{args.num_prompts} prompts"
    )
    print("frame | real std | generated std | channel-mean gap | closest real frame | corr with real frames")
    for f, row in enumerate(stats["corr_real"]):
        print(
            f"{f:5d} | {stats['real_std'][f]:8.3f} | {stats['generated_std'][f]:13.3f} | "
            f"{stats['channel_mean_gap'][f]:16.3f} | {stats['closest_real_frame'][f]:18d} | {' '.join(f'{v:5.2f}' for v in row)}"
        )
    if args.out:
        print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time one VAE training step (``task: vae``'s loss, forward and backward) per ``train.precision``.

    python -m factory.vae_speed                                              # the built-in VAE's settings
    python -m factory.vae_speed --set base_dim=24 --frames 9 --crop 64 --out benchmarks/results/vae_step_cpu
    python -m factory.vae_speed --set decoder_base_dim=24 --trainable decoder --frames 9 --crop 64
    python -m factory.vae_speed --encode --set base_dim=24 --frames 17 --height 128 --width 160 --batch 1

Builds an untrained ``AutoencoderKLWan`` with the built-in model's VAE settings changed by ``--set``
(checked as ``python -m factory init-vae`` checks them), then times :func:`training.vae.vae_loss` plus its
backward pass on a random batch ``(--batch, 3, --frames, --crop, --crop)``: one untimed step, then the
median of ``--repeats``, for each precision. ``--encode`` times what encoding a training cache costs instead:
the encoder's forward pass alone (posterior mean, no gradients) on whole ``--height`` x ``--width`` clips.
Prints a table and writes ``<out>.json`` with ``--out``.
Wall clock on this machine: run it on an otherwise idle one.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from factory import write_json
from training.vae import autocast_for, freeze_encoder, vae_loss

PRECISIONS = ("no", "bf16")


def time_steps(vae, video: torch.Tensor, precision: str, repeats: int, train_encoder: bool) -> list[float]:
    """Seconds per training step (loss, backward) of ``vae`` on ``video``: one warm-up, then ``repeats``."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        with autocast_for(precision):
            loss, _ = vae_loss(vae, video, 1e-6, 10.0, train_encoder)
        loss.backward()
        vae.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return times


@torch.no_grad()
def time_encodes(vae, video: torch.Tensor, precision: str, repeats: int) -> list[float]:
    """Seconds per encode of ``video`` (the posterior mean, as a training cache stores): one warm-up, then ``repeats``."""
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        with autocast_for(precision):
            vae.encode(video).latent_dist.mode()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    """``python -m factory.vae_speed``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.vae_speed")


def _main(argv=None) -> int:
    from diffusers import AutoencoderKLWan

    from factory.build import parse_overrides, vae_settings

    p = argparse.ArgumentParser(prog="python -m factory.vae_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="VAE settings, e.g. base_dim=24")
    p.add_argument("--trainable", choices=("all", "decoder"), default="all")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--crop", type=int, default=80)
    p.add_argument("--encode", action="store_true", help="time encoding whole clips (a training cache's cost)")
    p.add_argument("--height", type=int, default=None, help="with --encode: clip height (default --crop)")
    p.add_argument("--width", type=int, default=None, help="with --encode: clip width (default --crop)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="writes OUT.json")
    args = p.parse_args(argv)
    if (args.frames - 1) % 4:
        p.error(f"--frames must be 4k+1 (the VAE's causal chunks), got {args.frames}")
    try:
        settings = vae_settings(**parse_overrides(args.set))  # checked as init-vae checks them
    except ValueError as e:
        p.error(str(e))
    if (args.height or args.width) and not args.encode:
        p.error("--height/--width are for --encode (a training step takes square --crop crops)")
    height, width = (args.height or args.crop, args.width or args.crop) if args.encode else (args.crop, args.crop)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**settings).train(not args.encode)
    train_encoder = args.trainable == "all"
    if not train_encoder and not args.encode:
        freeze_encoder(vae)
    video = torch.rand(args.batch, 3, args.frames, height, width) * 2 - 1
    rows = {}
    for precision in PRECISIONS:
        if args.encode:
            times = time_encodes(vae, video, precision, args.repeats)
        else:
            times = time_steps(vae, video, precision, args.repeats, train_encoder)
        rows[precision] = {"median_s": round(statistics.median(times), 3), "times_s": [round(t, 3) for t in times]}
    res = {
        "vae": settings,
        "timed": "encode" if args.encode else "training step",
        "trainable": None if args.encode else args.trainable,
        "parameters_m": round(sum(x.numel() for x in vae.parameters() if x.requires_grad) / 1e6, 2),
        "encoder_parameters_m": round(
            sum(x.numel() for n, x in vae.named_parameters() if n.startswith(("encoder.", "quant_conv."))) / 1e6, 2
        ),
        "batch": [args.batch, 3, args.frames, height, width],
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "precision": rows,
        "bf16_over_fp32": round(rows["bf16"]["median_s"] / rows["no"]["median_s"], 2),
    }
    if args.encode:
        print(f"VAE encode, batch {res['batch']}, encoder {res['encoder_parameters_m']}M parameters, {res['machine']}")
    else:
        print(f"VAE step, batch {res['batch']}, {res['parameters_m']}M trainable ({args.trainable}), {res['machine']}")
    print(f"| precision | s/{'encode' if args.encode else 'step'} (median) |\n|---|---:|")
    for precision, row in rows.items():
        print(f"| {precision} | {row['median_s']:.3f} |")
    print(f"bf16 / float32: {res['bf16_over_fp32']:.2f}")
    if args.out:
        print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

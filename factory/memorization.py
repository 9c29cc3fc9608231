"""Does a stage learn its world or memorise its cache? The flow loss on the samples it trains on against fresh ones.

    python -m factory.memorization --transformer DIR [--model DIR] [--samples 8192] [--seed 0] [--out OUT]

A stage trains on a fixed cache: ``--samples`` clips and as many one-frame stills of the synthetic world, drawn with
``--seed`` (``train.seed``; ``factory/configs/v3/joint.yaml``: 8,192 of each, seed 0: a still is seen once every 64
steps). For clips and for stills, the held-out flow loss (:func:`factory.evaluate.heldout_loss`: the same noise and
timesteps for both sets) on the first ``--batches`` x ``--batch-size`` of those training draws and on as many fresh
draws of the same world (another seed). A gap (the training draws' loss well below the fresh ones') says the stage
memorises its cache and needs more samples; none says it is short of steps, not of data. ``--out OUT`` writes
``OUT.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from factory import write_json
from factory.evaluate import heldout_loss
from pipelines import BUILTIN_DIR, load_components, load_transformer
from world.synthetic import SyntheticVideoDataset, world_named

FRESH_SEED = 987_654  # another seed's draws of the same world: none of them in a cache drawn with seed 0


def draws(samples: int, seed: int, frames: int, height: int, width: int, world) -> SyntheticVideoDataset:
    """The world's clips (``frames`` > 1) or one-frame stills (captions without a motion word) drawn with ``seed``:
    with ``train.seed`` and ``data.num_samples``, the very samples a stage's cache was encoded from
    (``training.data.build_dataset`` on ``data.source=synthetic``)."""
    return SyntheticVideoDataset(
        samples, seed=seed, num_frames=frames, height=height, width=width, world=world, images=frames == 1
    )


def run(args) -> dict:
    components = load_components(args.model, dtype="float32", device="cpu")
    transformer = load_transformer(args.transformer, dtype=torch.float32, device="cpu").eval()
    d, world = components.defaults, world_named(args.world)
    rows = {}
    for kind, frames in (("clips", d["num_frames"]), ("stills", 1)):
        for which, seed in (("trained", args.seed), ("fresh", FRESH_SEED)):
            dataset = draws(args.samples, seed, frames, d["height"], d["width"], world)
            with torch.no_grad():
                loss = heldout_loss(
                    components, {"model": transformer}, dataset, args.batches, args.batch_size, seed=5, draws=2
                )["model"]
            rows[f"{kind} {which}"] = loss
            print(f"{kind}, {which} draws (seed {seed}): flow loss {loss['mean']:.4f} ± {loss['std']:.4f}", flush=True)
    gaps = {kind: rows[f"{kind} fresh"]["mean"] / rows[f"{kind} trained"]["mean"] - 1 for kind in ("clips", "stills")}
    for kind, gap in gaps.items():
        print(f"{kind}: fresh draws {gap:+.1%} against the trained ones")
    return {
        "what": "flow loss on a stage's training draws against fresh draws of the same world (factory.memorization)",
        "command": "python -m factory.memorization " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "transformer": args.transformer,
        "samples": args.samples,
        "seed": args.seed,
        "fresh_seed": FRESH_SEED,
        "evaluated": args.batches * args.batch_size,
        "losses": rows,
        "fresh_over_trained": gaps,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.memorization", description=__doc__.splitlines()[0])
    p.add_argument("--transformer", required=True, help="a softmax transformer folder (a stage's checkpoint, its EMA)")
    p.add_argument("--model", default=str(BUILTIN_DIR), help="model directory (default: the built-in model)")
    p.add_argument("--world", default="v3", help="the synthetic world the model was trained on")
    p.add_argument("--samples", type=int, default=8192, help="samples the stage's cache drew (data.num_samples)")
    p.add_argument("--seed", type=int, default=0, help="the seed the cache drew them with (train.seed)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default=None, help="writes OUT.json")
    args = p.parse_args(argv)
    for name in ("samples", "batches", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    res = run(args)
    if args.out:
        print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

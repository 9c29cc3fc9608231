"""Entry point of the product's front end.

The Gradio app (FlashAttention, linear attention and MHLA side by side) is not built yet; until it
is, this runs a short demo of the MHLA operator on this machine: the paper's 81-frame 480x800
token grid, agreement with the dense reference, latency of the three attentions and the rank of
their attention matrices.
"""

from __future__ import annotations

import argparse
import time

import torch

from mhla import (
    BlockLayout,
    expressivity,
    last_softmax_backend,
    linear_attention,
    locality_init,
    mhla_attention,
    mhla_attention_dense,
    softmax_attention,
)


def timed(fn, repeats=3):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(args.seed)
    layout = BlockLayout.for_grid((21, 30, 50))
    print(f"MHLA operator demo on {device}. Default layout for 81 frames at 480x800: {layout}")

    small = BlockLayout.for_grid((6, 10, 12), "2x2x3")
    q, k, v = (torch.randn(1, small.num_tokens, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mix = locality_init(small)
    err = (mhla_attention(q, k, v, small, mix) - mhla_attention_dense(q, k, v, small, mix)).abs().max()
    print(f"efficient vs dense O(N^2) MHLA on {small}: max abs difference {err:.2e}")

    stats = expressivity(q[0, :, 0], k[0, :, 0], small, mix)
    print("attention-matrix rank / mean row entropy (nats), head_dim 16:")
    for kind, s in stats.items():
        print(f"  {kind:<8} rank {s['rank']:>4}   entropy {s['entropy']:.3f} of max {s['max_entropy']:.3f}")

    shape = (1, layout.num_tokens, args.heads, args.dim)
    q, k, v = (torch.randn(shape, generator=g).to(device) for _ in range(3))
    mix = locality_init(layout).float().to(device)
    with torch.no_grad():
        rows = [
            ("softmax", timed(lambda: softmax_attention(q, k, v), repeats=1)),
            ("linear", timed(lambda: linear_attention(q, k, v))),
            ("mhla", timed(lambda: mhla_attention(q, k, v, layout, mix))),
        ]
    print(f"forward latency at N={layout.num_tokens}, {args.heads} heads x {args.dim} (best of 3; softmax: 1 run):")
    for name, ms in rows:
        extra = f" ({last_softmax_backend()})" if name == "softmax" else ""
        print(f"  {name:<8} {ms:9.1f} ms{extra}   {rows[0][1] / ms:5.1f}x vs softmax")


if __name__ == "__main__":
    main()

"""The efficient paths must never form an N x N tensor: every intermediate is O(N d + M^2 d^2)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhla import BlockLayout, linear_attention, locality_init, mhla_attention


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_n_by_n_tensor_at_32760_tokens(gen):
    layout = BlockLayout.for_grid((21, 30, 52))  # 480x832 at 81 frames: 32,760 tokens, M = 105, uneven
    n, b, h, d = layout.num_tokens, 1, 2, 16
    assert n == 32_760 and layout.num_blocks == 105
    q, k, v = (torch.randn(b, n, h, d, generator=gen).requires_grad_() for _ in range(3))
    mix = locality_init(layout).float().requires_grad_()
    cos = torch.rand(1, n, 1, d, generator=gen)
    rope = (cos, torch.sqrt(1 - cos**2))
    # every tensor may be a few times q's size (padding to the largest block, heads, channels),
    # but nothing comes near N * N = 1.07e9 elements
    bound = 4 * b * n * h * d + 4 * layout.num_blocks**2 * h * d * d
    for fn in (
        lambda: mhla_attention(q, k, v, layout, mix, rotary_emb=rope),
        lambda: mhla_attention(q, k, v, layout, mix, normalize=False),
        lambda: linear_attention(q, k, v, rotary_emb=rope),
    ):
        with LargestTensor() as probe:
            out = fn()
            out.square().mean().backward()
        assert out.shape == (b, n, h, d)
        assert probe.largest <= bound, f"an intermediate has {probe.largest} elements (bound {bound}, N*N={n * n})"
        assert probe.largest >= b * n * h * d  # the probe saw the real tensors

"""References written apart from the code they check: their own feature maps, RoPE as a complex product,
their own token-to-block map, mixing constraint and block resampling, in plain loops where that is
clearest. Nothing here imports mhla's or pipelines' helpers, so a mistake there cannot cancel out."""

from __future__ import annotations

import math

import torch


def relu_phi(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, min=0.0) + 1e-6


def elu_phi(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x + 1.0, torch.exp(x))


def rope_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs as a complex product: (x0 + i x1) * (cos + i sin), with the angle's
    cosine read at even channels and its sine at odd channels of the (1, N, 1, D) tables."""
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    rot = torch.complex(cos[..., 0::2].double(), sin[..., 1::2].double())
    return torch.view_as_real(pairs * rot).flatten(-2)


def segments(size: int, parts: int) -> list[int]:
    """Segment index of each of ``size`` cells split into ``parts`` contiguous runs, longer runs first."""
    base, extra = divmod(size, parts)
    out = []
    for i in range(parts):
        out += [i] * (base + (1 if i < extra else 0))
    return out


def token_blocks(grid, blocks) -> list[int]:
    f_ids, h_ids, w_ids = (segments(s, b) for s, b in zip(grid, blocks, strict=True))
    out = []
    for f in range(grid[0]):
        for h in range(grid[1]):
            for w in range(grid[2]):
                out.append((f_ids[f] * blocks[1] + h_ids[h]) * blocks[2] + w_ids[w])
    return out


def constrain(raw: torch.Tensor) -> torch.Tensor:
    """The paper's mixing rule: clip to [0, 1], rows normalised to 1 (an all-zero row becomes uniform)."""
    out = raw.clone()
    for row in range(out.shape[-2]):
        r = out[..., row, :].clamp(0.0, 1.0)
        total = r.sum(-1, keepdim=True)
        out[..., row, :] = torch.where(total > 0, r / total, torch.full_like(r, 1.0 / r.shape[-1]))
    return out


def nearest_block_resample(mixing: torch.Tensor, blocks, new_blocks) -> torch.Tensor:
    """Shrinks an (M, M) mixing matrix to ``new_blocks``: a new query block takes the row of the old block
    nearest its centre (ties to the lower index); each old key block's weight goes to the new block nearest
    it; rows renormalised. Centres in [0, 1] per axis."""

    def nearest(src: int, dst: int, i: int) -> int:
        c = (i + 0.5) / src
        return min(range(dst), key=lambda j: (abs(c - (j + 0.5) / dst), j))

    def ids(b):
        return [(f, h, w) for f in range(b[0]) for h in range(b[1]) for w in range(b[2])]

    def flat(t, b):
        return (t[0] * b[1] + t[1]) * b[2] + t[2]

    m_new = math.prod(new_blocks)
    out = torch.zeros(m_new, m_new, dtype=mixing.dtype)
    for a in ids(new_blocks):
        src_row = flat(tuple(nearest(n, o, x) for n, o, x in zip(new_blocks, blocks, a, strict=True)), blocks)
        for b in ids(blocks):
            dst_col = flat(tuple(nearest(o, n, x) for o, n, x in zip(blocks, new_blocks, b, strict=True)), new_blocks)
            out[flat(a, new_blocks), dst_col] += mixing[src_row, flat(b, blocks)]
    return out / out.sum(-1, keepdim=True)


def mhla_dense(q, k, v, grid, blocks, mixing, phi=relu_phi, normalize=False, rope=None, eps=1e-6):
    """Paper Eq. 5 with O(N^2) scores: out_t = sum_s m_{b(t),b(s)} phi(q_t).phi(k_s) v_s / (same without
    v_s + eps); RoPE on phi(q), phi(k) in the numerator only. q, k, v (B, N, H, D), float64."""
    blk = torch.tensor(token_blocks(grid, blocks))
    fq, fk = phi(q.double()), phi(k.double())
    nq, nk = (fq, fk) if rope is None else (rope_complex(fq, *rope), rope_complex(fk, *rope))
    weight = mixing.double()[blk][:, blk]  # (N, N): m_{b(t), b(s)}
    scores = torch.einsum("bthd,bshd->bhts", nq, nk) * weight
    out = torch.einsum("bhts,bshe->bthe", scores, v.double())
    if normalize:
        den = (torch.einsum("bthd,bshd->bhts", fq, fk) * weight).sum(-1)
        out = out / (den.permute(0, 2, 1)[..., None] + eps)
    return out

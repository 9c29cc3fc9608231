"""Positive feature maps phi for kernelised (linear) attention."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# relu(x) + eps keeps every phi(q).phi(k) strictly positive, so the normalizer never divides by 0.
RELU_EPS = 1e-6


def relu_feature(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x) + RELU_EPS


def elu_feature(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": relu_feature,
    "elu": elu_feature,
}


def get_feature_map(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``"relu"`` (relu(x) + 1e-6, the paper's and Wan default) or ``"elu"`` (elu(x) + 1)."""
    try:
        return FEATURE_MAPS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown feature map {name!r}; expected one of {sorted(FEATURE_MAPS)}") from None

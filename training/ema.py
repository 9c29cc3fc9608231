"""Exponential moving average (EMA) of the trained weights, the standard diffusion-training companion:
sampling from the average of the last few thousand steps' weights instead of the last step's.

``train.ema_decay: 0.999`` turns it on (0, the default, is off). After every optimizer step each tracked
parameter's shadow moves toward its new value, ``shadow <- d * shadow + (1 - d) * param``, with the decay
warmed up as ``d = min(ema_decay, (1 + n) / (10 + n))`` after ``n`` updates (diffusers' EMAModel rule), so
early averages do not drag in the random initialisation. Shadows are float32 whatever the model's dtype.

A checkpoint of a run with EMA holds the averaged weights as its pipeline-format ``transformer/`` (what
generation, the app and the built-in model's assembly load) and the raw trained values of the tracked
parameters in ``trainable.safetensors`` (what resuming continues from).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


class EMA:
    """Float32 moving averages of ``model``'s parameters named ``names``, started from their current values."""

    def __init__(self, model: torch.nn.Module, names: Iterable[str], decay: float, updates: int = 0):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay {decay!r}: expected a value in (0, 1)")
        params = dict(model.named_parameters())
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"EMA: the model has no parameters {missing[:3]}")
        self.decay = float(decay)
        self.updates = int(updates)
        self.shadow = {n: params[n].detach().float().clone() for n in names}

    def rate(self) -> float:
        """The decay the next update uses (warmed up over the first updates)."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        d = self.rate()
        params = dict(model.named_parameters())
        for name, shadow in self.shadow.items():
            shadow.lerp_(params[name].detach().float(), 1.0 - d)
        self.updates += 1

    @contextmanager
    def swapped_in(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` holds the averaged weights inside the block and its own again after it."""
        params = dict(model.named_parameters())
        saved = {n: params[n].detach().clone() for n in self.shadow}
        with torch.no_grad():
            for name, shadow in self.shadow.items():
                params[name].copy_(shadow)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    params[name].copy_(value)

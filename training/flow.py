"""Rectified-flow (flow-matching) training objective, as Wan2.1 is trained.

``x_t = (1 - sigma) x_0 + sigma * noise``; the transformer predicts the velocity ``noise - x_0`` at
timestep ``1000 * sigma``. Sigmas come from a logit-normal density (diffusers'
``compute_density_for_timestep_sampling``) and are shifted towards noise with Wan's flow shift
(3.0), the same shift its inference scheduler uses.

``sigma_range`` restricts the sampled noise levels to ``[low, high]`` (a Wan2.2-A14B expert's share of the
timesteps, see :mod:`training.experts`): the same logit-normal density, shifted, truncated to the range by
inverse transform sampling (one uniform draw per sample, so a resumed run draws the same sigmas).

``object_weight`` weights the loss toward the objects of flat-background data (the built-in model's synthetic
world): a latent cell whose clean value differs from its frame's typical cell (the per-channel median over the
frame, mean squared difference over channels above ``object_threshold``) counts ``1 + object_weight``, every other
cell 1, and the weighted mean is divided by the mean weight, so the loss keeps its scale. In the third design's
latents 16% of the cells are the object (threshold 1.0; README gives the command); with ``object_weight`` 0 (the default) the loss is
the plain mean squared error. The training loss logged is the weighted one; the eval loss and the probe stay plain,
so runs with and without it compare. Tried on the built-in model's base (README, issue 37): no gain there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_density_for_timestep_sampling

from training.config import FlowSection, check_section


@dataclass(frozen=True)
class FlowMatching:
    """The objective of a run: ``settings`` is its ``flow`` section (shift, weighting, logit-normal mean and std, the
    objects' weight and threshold: :class:`training.config.FlowSection`, defaults and ranges there), ``sigma_range``
    and ``num_train_timesteps`` come from the model (:class:`training.experts.TrainingTarget`)."""

    settings: FlowSection = field(default_factory=FlowSection)
    sigma_range: tuple[float, float] = (0.0, 1.0)  # [low, high]: an expert's noise levels (high = 1: inclusive)
    num_train_timesteps: int = 1000  # timestep = sigma * num_train_timesteps, as diffusers' flow schedulers

    def __post_init__(self) -> None:
        check_section(self.settings, "flow")  # a section built in code gets the checks a loaded config's keys get
        low, high = self.sigma_range
        if not 0 <= low < high <= 1:
            raise ValueError(f"sigma_range must satisfy 0 <= low < high <= 1, got {self.sigma_range}")

    @property
    def restricted(self) -> bool:
        return tuple(self.sigma_range) != (0.0, 1.0)

    def _unshift(self, sigma: float) -> float:
        """The inverse of the shift: the u in [0, 1] that :meth:`sample_sigmas` maps to ``sigma``."""
        return sigma / (self.settings.shift - (self.settings.shift - 1) * sigma)

    def sample_sigmas(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """``(batch,)`` shifted sigmas in (0, 1) (in :attr:`sigma_range` when restricted: ``low <= sigma < high``,
        ``sigma <= 1`` at the top), on the generator's device."""
        if not self.restricted:
            u = compute_density_for_timestep_sampling(
                self.settings.weighting,
                batch,
                self.settings.logit_mean,
                self.settings.logit_std,
                device=generator.device,
                generator=generator,
            )
        else:  # the density truncated to the u-interval that the shift maps onto sigma_range
            u_low, u_high = (self._unshift(s) for s in self.sigma_range)
            r = torch.rand(batch, generator=generator, device=generator.device, dtype=torch.float64)
            if self.settings.weighting == "uniform":
                u = u_low + r * (u_high - u_low)
            else:  # u = sigmoid(n), n ~ N(mean, std): invert the normal's CDF between the ends' quantiles
                ends = [
                    math.inf if x >= 1 else -math.inf if x <= 0 else (math.log(x / (1 - x)) - self.settings.logit_mean)
                    for x in (u_low, u_high)
                ]
                c_low, c_high = (
                    torch.special.ndtr(torch.tensor(e / self.settings.logit_std, dtype=torch.float64)) for e in ends
                )
                p = (c_low + r * (c_high - c_low)).clamp(1e-12, 1 - 1e-12)
                u = torch.sigmoid(self.settings.logit_mean + self.settings.logit_std * torch.special.ndtri(p))
        sigma = self.settings.shift * u / (1 + (self.settings.shift - 1) * u)
        if self.restricted:  # float32 rounding must not carry a sample over a boundary into the other expert's range
            low, high = self.sigma_range
            sigma = sigma.float()
            floor = torch.tensor(low, dtype=torch.float32)
            if floor.item() < low:
                floor = torch.nextafter(floor, torch.tensor(math.inf))
            ceiling = torch.tensor(high, dtype=torch.float32)
            if high < 1 and ceiling.item() >= high:
                ceiling = torch.nextafter(ceiling, torch.tensor(-math.inf))
            sigma = torch.minimum(torch.maximum(sigma, floor.to(sigma.device)), ceiling.to(sigma.device))
        return sigma

    def noisy_input(
        self, latents: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(x_t, timesteps, target)`` for clean ``latents`` ``(B, C, F, H, W)``."""
        b = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator, device=generator.device).to(latents)
        sigmas = self.sample_sigmas(b, generator).to(latents.device)
        s = sigmas.view(b, 1, 1, 1, 1).to(latents.dtype)
        x_t = (1 - s) * latents + s * noise
        return x_t, sigmas * float(self.num_train_timesteps), noise - latents

    def object_mask(self, latents: torch.Tensor) -> torch.Tensor:
        """``(B, 1, F, H, W)`` bool: the cells of clean ``latents`` ``(B, C, F, H, W)`` that differ from their frame's
        median cell (per channel, over H x W) by a mean squared difference over channels above ``object_threshold``."""
        flat = latents.detach().float().flatten(3)  # (B, C, F, H*W)
        median = flat.median(dim=3).values[..., None]
        diff = ((flat - median) ** 2).mean(dim=1, keepdim=True)  # (B, 1, F, H*W)
        return (diff > self.settings.object_threshold).view(latents.shape[0], 1, *latents.shape[2:])

    def loss(self, pred: torch.Tensor, target: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The training loss of ``pred`` against the velocity ``target`` for clean ``latents``: the mean squared
        error, weighted toward the objects' cells when ``object_weight`` > 0 (divided by the mean weight)."""
        if not self.settings.object_weight:
            return F.mse_loss(pred.float(), target.float())
        weight = 1.0 + self.settings.object_weight * self.object_mask(latents).float()
        err = (pred.float() - target.float()) ** 2
        return (err * weight).sum() / (weight.sum() * err.shape[1])

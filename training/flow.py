"""Rectified-flow (flow-matching) training objective, as Wan2.1 is trained.

``x_t = (1 - sigma) x_0 + sigma * noise``; the transformer predicts the velocity ``noise - x_0`` at
timestep ``1000 * sigma``. Sigmas come from a logit-normal density (diffusers'
``compute_density_for_timestep_sampling``) and are shifted towards noise with Wan's flow shift
(3.0), the same shift its inference scheduler uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.training_utils import compute_density_for_timestep_sampling


@dataclass(frozen=True)
class FlowMatching:
    shift: float = 3.0
    weighting: str = "logit_normal"  # or "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0

    def __post_init__(self):
        if self.weighting not in ("logit_normal", "uniform"):
            raise ValueError(f"flow.weighting must be 'logit_normal' or 'uniform', got {self.weighting!r}")
        if self.shift <= 0:
            raise ValueError(f"flow.shift must be > 0, got {self.shift}")

    def sample_sigmas(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """``(batch,)`` shifted sigmas in (0, 1), on the generator's device."""
        u = compute_density_for_timestep_sampling(
            self.weighting, batch, self.logit_mean, self.logit_std, device=generator.device, generator=generator
        )
        return self.shift * u / (1 + (self.shift - 1) * u)

    def noisy_input(self, latents: torch.Tensor, generator: torch.Generator):
        """Returns ``(x_t, timesteps, target)`` for clean ``latents`` ``(B, C, F, H, W)``."""
        b = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator, device=generator.device).to(latents)
        sigmas = self.sample_sigmas(b, generator).to(latents.device)
        s = sigmas.view(b, 1, 1, 1, 1).to(latents.dtype)
        x_t = (1 - s) * latents + s * noise
        return x_t, sigmas * 1000.0, noise - latents

"""Turning videos and captions into what the transformer trains on: VAE latents and text embeddings.

Both use the pipeline's own components and conventions (diffusers' ``WanPipeline``): latents are the
VAE posterior mean normalised with the VAE's ``latents_mean`` / ``latents_std`` (what the pipeline
undoes before decoding), and text embeddings are UMT5 states padded with zeros to
``max_sequence_length`` (``WanPipeline._get_t5_prompt_embeds``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipelines import WanComponents


class Encoder:
    """Encodes video batches and captions with a :class:`pipelines.WanComponents`' VAE and text encoder."""

    def __init__(self, components: WanComponents, max_sequence_length: int = 512) -> None:
        from diffusers import WanPipeline

        self.vae = components.vae
        self.text_encoder = components.text_encoder
        self.max_sequence_length = max_sequence_length
        # a pipeline object only for its prompt encoding; transformer and scheduler are not needed
        self._pipe = WanPipeline(
            tokenizer=components.tokenizer,
            text_encoder=components.text_encoder,
            vae=components.vae,
            scheduler=components.scheduler,
            transformer=None,
        )
        cfg = self.vae.config
        self._mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        self._std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)

    @torch.no_grad()
    def latents(self, video: torch.Tensor) -> torch.Tensor:
        """``video`` ``(B, 3, T, H, W)`` in [-1, 1] -> normalised latents ``(B, z_dim, (T-1)/4+1, H/s, W/s)`` float32:
        Wan2.1's VAE gives 16 channels at ``s = 8``; Wan2.2-TI2V's gives 48 at ``s = 16`` (it folds 2x2 pixels into
        channels before its 8x strides, inside ``encode``). Normalised per channel with its ``latents_mean`` /
        ``latents_std``, as ``WanPipeline`` undoes it before decoding."""
        p = next(self.vae.parameters())
        posterior = self.vae.encode(video.to(p.device, p.dtype)).latent_dist
        z = posterior.mean.float()
        return (z - self._mean.to(z.device)) / self._std.to(z.device)

    @torch.no_grad()
    def text(self, captions: list[str]) -> torch.Tensor:
        """Captions -> ``(B, max_sequence_length, text_dim)`` embeddings (zero beyond each caption's tokens)."""
        p = next(self.text_encoder.parameters())
        return self._pipe._get_t5_prompt_embeds(
            captions, max_sequence_length=self.max_sequence_length, device=p.device, dtype=p.dtype
        ).float()

"""Which transformer a fine-tuning run trains, and how that transformer is called: Wan2.1, Wan2.2 TI2V-5B and
Wan2.2 T2V-A14B, read from the model directory's config files before anything loads.

- **Wan2.1-T2V** (and the built-in / tiny models): one ``transformer/``, a timestep per sample.
- **Wan2.2-TI2V-5B** (``model_index.json``: ``expand_timesteps: true``): one ``transformer/``, the 48-channel VAE
  with 16x spatial compression, and the timestep given **per token**, as ``WanPipeline(expand_timesteps=True)``
  builds it from a mask of the latents (all ones for text-to-video: every latent is noised, so each token's
  timestep is its sample's; an image-conditioned first frame would get 0).
- **Wan2.2-T2V-A14B** (``transformer_2`` and ``boundary_ratio`` in ``model_index.json``): two experts. diffusers'
  ``WanPipeline`` runs ``transformer`` (the high-noise expert) at timesteps ``t >= boundary_ratio *
  num_train_timesteps`` and ``transformer_2`` (the low-noise expert) below. A run trains one of them,
  ``model.expert``, on its own range of noise levels only; the other is never loaded, and the checkpoints hold
  the trained expert under its own folder name, so it drops into the model directory in its place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipelines.model_dir import ModelDir, read_json
from training.config import ModelSection

if TYPE_CHECKING:
    from pipelines import WanComponents

ROLE = {"transformer": "the high-noise expert", "transformer_2": "the low-noise expert"}


@dataclass(frozen=True)
class TrainingTarget:
    """What a run trains: ``expert`` (the transformer folder it loads and writes: ``transformer`` or
    ``transformer_2``), the model's ``experts``, ``boundary_ratio`` (two experts only), ``expand_timesteps``
    (per-token timesteps), the scheduler's ``num_train_timesteps`` and the VAE's strides ``(t, h, w)``."""

    architecture: str  # wan2.1-t2v | wan2.2-ti2v | wan2.2-t2v-a14b (a description, for messages)
    expert: str = "transformer"
    experts: tuple[str, ...] = ("transformer",)
    boundary_ratio: float | None = None
    expand_timesteps: bool = False
    num_train_timesteps: int = 1000
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    # the model folder as read for this run (each file once), handed to every later reader and to loading
    model_dir: ModelDir | None = field(default=None, compare=False, repr=False)

    @property
    def two_experts(self) -> bool:
        return len(self.experts) == 2

    @property
    def sigma_range(self) -> tuple[float, float]:
        """The noise levels ``sigma = t / num_train_timesteps`` this expert is trained on: ``[boundary, 1]`` for
        the high-noise ``transformer``, ``[0, boundary)`` for the low-noise ``transformer_2``, else ``[0, 1]``."""
        if not self.two_experts or self.boundary_ratio is None:
            return (0.0, 1.0)
        return (self.boundary_ratio, 1.0) if self.expert == "transformer" else (0.0, self.boundary_ratio)

    @property
    def boundary_timestep(self) -> float | None:
        return None if self.boundary_ratio is None else self.boundary_ratio * self.num_train_timesteps

    def describe(self) -> str:
        if not self.two_experts:
            return self.architecture
        b = self.boundary_timestep
        side = f"t >= {b:g}" if self.expert == "transformer" else f"t < {b:g}"
        return f"{self.architecture}, expert {self.expert} ({ROLE[self.expert]}: {side})"


def read_target(section: ModelSection) -> TrainingTarget:
    """The run's :class:`TrainingTarget` from ``model.path``'s config files (``model_index.json``, the scheduler's and
    the VAE's config), checked against ``model.expert``: a model with two experts needs one named, a model with one
    transformer takes none. Raises ValueError naming the key, its value and what was expected."""
    expert = section.expert
    model = ModelDir(section.path)
    root = model.path  # None for the tiny random model (and the built-in one when absent)
    # the model directory's architecture, as generation reads it (pipelines.model_dir; a bad index is named there)
    index = model.index if root is not None and (root / "model_index.json").is_file() else None
    present = ("transformer", "transformer_2") if index is not None and index.transformer_2 else ("transformer",)
    boundary = index.boundary_ratio if index is not None else None
    expand = bool(index is not None and index.expand_timesteps)
    where = f"model.path={str(section.path)!r}"
    if index is not None and index.pipeline_class != "WanPipeline":
        raise ValueError(
            f"{where} is a {index.pipeline_class} (its model_index.json); the recipe fine-tunes text-to-video "
            "models (WanPipeline: Wan2.1-T2V, Wan2.2-TI2V-5B, Wan2.2-T2V-A14B); image-to-video is not built"
        )
    if len(present) == 2:
        if expert is None:
            raise ValueError(
                f"model.expert=None: {where} holds two experts, transformer ({ROLE['transformer']}, timesteps >= "
                f"{boundary} x 1000) and transformer_2 ({ROLE['transformer_2']}, below); the recipe trains one at a "
                "time: set model.expert=transformer or model.expert=transformer_2"
            )
        architecture = "wan2.2-t2v-a14b"
    else:
        if expert is not None:
            what = "the tiny random model" if root is None else f"{where} (one transformer/, no transformer_2)"
            raise ValueError(
                f"model.expert={expert!r}: {what} has a single transformer; expected model.expert=null "
                "(model.expert chooses one of the two experts of a Wan2.2-A14B directory)"
            )
        architecture = "wan2.2-ti2v" if expand else "wan2.1-t2v"
    expert = expert or "transformer"
    if root is not None and root.is_dir():
        folder = root / expert
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model.expert={expert!r}: {str(folder)!r} has no config.json; expected the expert's transformer "
                "folder in the model directory"
            )
    steps = 1000
    scheduler = root / "scheduler" / "scheduler_config.json" if root is not None else None
    if scheduler is not None and scheduler.is_file():
        steps = int(read_json(scheduler, "scheduler config").get("num_train_timesteps") or 1000)
    return TrainingTarget(
        architecture=architecture,
        expert=expert,
        experts=present,
        boundary_ratio=None if boundary is None else float(boundary),
        expand_timesteps=expand,
        num_train_timesteps=steps,
        vae_stride=model.vae_stride,
        model_dir=model,
    )


def expert_folder(model: ModelSection, target: TrainingTarget) -> Path | None:
    """The folder the trained expert starts from: ``model.transformer`` when set, else ``model.path/<expert>``
    (None for the tiny random model)."""
    if model.transformer:
        return Path(model.transformer)
    root = (target.model_dir or ModelDir(model.path)).path
    return None if root is None else root / target.expert


def size_multiples(model: ModelSection, target: TrainingTarget | None = None) -> tuple[int, int]:
    """What a clip's ``(height, width)`` must be a multiple of for the run's model: the VAE's spatial stride x the
    transformer's patch (16 for Wan2.1, 32 for Wan2.2-TI2V), from config files only: the step of aspect buckets."""
    target = read_target(model) if target is None else target
    patch = (target.model_dir or ModelDir(model.path)).shape(expert_folder(model, target)).patch
    return target.vae_stride[1] * patch[1], target.vae_stride[2] * patch[2]


def model_timestep(
    t: torch.Tensor, latents: torch.Tensor, patch_size: tuple[int, ...], expand_timesteps: bool
) -> torch.Tensor:
    """The ``timestep`` argument of the transformer for per-sample timesteps ``t`` ``(B,)`` and latents
    ``(B, C, F, H, W)``, as diffusers' ``WanPipeline`` passes it: ``t`` itself, or with ``expand_timesteps``
    (Wan2.2-TI2V) one timestep per token ``(B, seq_len)``, the mask of the latents (ones: text-to-video noises
    every latent) sampled at each patch's first latent and scaled by the sample's ``t``."""
    if not expand_timesteps:
        return t
    pt, ph, pw = (int(p) for p in patch_size)
    mask = torch.ones(latents.shape, dtype=torch.float32, device=latents.device)
    per_token = mask[:, 0, ::pt, ::ph, ::pw] * t.to(mask.device, torch.float32).view(-1, 1, 1, 1)
    return per_token.flatten(1)


def load_expert_components(model: ModelSection, target: TrainingTarget, device: torch.device) -> WanComponents:
    """:func:`pipelines.load_components` for a run's expert: the model's tokenizer, text encoder, VAE and scheduler,
    and only ``target.expert`` as the transformer (an A14B run never loads the other expert)."""
    from pipelines import load_components

    expert = target.expert if target.two_experts else None
    where = target.model_dir or model.path
    return load_components(where, dtype=model.dtype, device=device, seed=model.seed, expert=expert)

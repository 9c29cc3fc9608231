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

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from pipelines.builtin import BUILTIN_DIR, TINY_RANDOM, builtin_available
from pipelines.loading import model_vae_stride
from pipelines.model_dir import read_json
from training.config import EXPERTS

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


def _model_root(cfg: DictConfig) -> Path | None:
    """The model directory on disk, or None for the tiny random model (and the built-in one when absent)."""
    path = cfg.model.path
    if path is None:
        return BUILTIN_DIR if builtin_available() else None
    return None if str(path) == TINY_RANDOM else Path(path)


def read_target(cfg: DictConfig) -> TrainingTarget:
    """The run's :class:`TrainingTarget` from ``model.path``'s config files (``model_index.json``, the scheduler's and
    the VAE's config), checked against ``model.expert``: a model with two experts needs one named, a model with one
    transformer takes none. Raises ValueError naming the key, its value and what was expected."""
    expert = cfg.model.get("expert")
    root = _model_root(cfg)
    index_file = root / "model_index.json" if root is not None else None
    index = read_json(index_file, "model index") if index_file is not None and index_file.is_file() else {}

    def listed(name: str) -> bool:  # save_pretrained writes [null, null] for a component the pipeline lacks
        entry = index.get(name, [None] if name == "transformer_2" else ["diffusers"])
        return isinstance(entry, list) and bool(entry) and entry[0] is not None

    present = tuple(name for name in EXPERTS if listed(name))
    boundary = index.get("boundary_ratio")
    expand = bool(index.get("expand_timesteps", False))
    where = f"model.path={str(cfg.model.path)!r}"
    if len(present) == 2 and boundary is None:
        raise ValueError(
            f"{where}: its model_index.json lists transformer and transformer_2 but no boundary_ratio; expected a "
            "Wan2.2-A14B directory (boundary_ratio: the fraction of timesteps above which transformer runs)"
        )
    if boundary is not None and not (isinstance(boundary, int | float) and 0 < boundary < 1):
        raise ValueError(f"{where}: boundary_ratio={boundary!r} in its model_index.json; expected a number in (0, 1)")
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
        if present != ("transformer",):
            raise ValueError(f"{where}: its model_index.json lists no transformer; expected a Wan text-to-video model")
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
        vae_stride=model_vae_stride(cfg.model.path),
    )


def expert_folder(cfg: DictConfig, target: TrainingTarget) -> Path | None:
    """The folder the trained expert starts from: ``model.transformer`` when set, else ``model.path/<expert>``
    (None for the tiny random model)."""
    if cfg.model.transformer:
        return Path(cfg.model.transformer)
    root = _model_root(cfg)
    return None if root is None else root / target.expert


def model_timestep(t: torch.Tensor, latents: torch.Tensor, patch_size, expand_timesteps: bool) -> torch.Tensor:
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


def load_expert_components(cfg: DictConfig, target: TrainingTarget, device: torch.device):
    """:func:`pipelines.load_components` for a run's expert: the model's tokenizer, text encoder, VAE and scheduler,
    and only ``target.expert`` as the transformer (an A14B run never loads the other expert)."""
    from pipelines import WanComponents, check_model_dir, load_components, load_transformer
    from pipelines.loading import _load_scheduler, model_settings, resolve_dtype

    if target.expert == "transformer":  # Wan2.1, TI2V, A14B's high-noise expert: the model's own transformer/
        return load_components(cfg.model.path, dtype=cfg.model.dtype, device=device, seed=cfg.model.seed)
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    root = check_model_dir(cfg.model.path)
    dtype = resolve_dtype(cfg.model.dtype, device)
    text_encoder = UMT5EncoderModel.from_pretrained(root / "text_encoder", dtype=dtype).to(device).eval()
    defaults, block_shape, variant_dirs = model_settings(root)
    return WanComponents(
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        text_encoder=text_encoder,
        vae=AutoencoderKLWan.from_pretrained(root / "vae", dtype=torch.float32).to(device).eval(),
        scheduler=_load_scheduler(root / "scheduler"),
        # model.transformer, when set, replaces it in finetune.build_model: then this one is not read at all
        transformer=None if cfg.model.transformer else load_transformer(root / target.expert, dtype, device),
        source=f"{root} ({target.expert})",
        random_weights=False,
        device=device,
        dtype=dtype,
        defaults=defaults,
        block_shape=block_shape,
        variant_dirs=variant_dirs,
    )

"""What the app serves: shared Wan2.1 components and one transformer per distinct set of weights.

Text encoder and VAE are loaded once (:class:`pipelines.WanComponents`) and shared by every variant.
Variants without their own checkpoint run on the base transformer, converted in place by
``generate()`` at each run: conversion only adds small attention parameters (mixing matrices, output
norms), so keeping a deep copy per variant would multiply memory (4 x 28 GB at 14B) for identical
weights. A variant given as ``--variant NAME=DIR`` gets its own transformer, loaded once at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipelines import (
    VARIANTS,
    WanComponents,
    latent_grid,
    load_components,
    load_transformer,
    resolve_model_blocks,
)
from pipelines.builtin import BUILTIN_DIR, builtin_examples
from pipelines.convert import attention_options
from pipelines.loading import WAN_CONFIGS, build_random_wan

STORED_SUBDIR = "examples"  # beside the model's components: the example prompts' precomputed results
CONVERTED_NOTE = "converted, not fine-tuned: latency is real, quality is not"
RANDOM_SIZES = tuple(WAN_CONFIGS)
# prompts a model can draw: the built-in model knows coloured shapes moving on plain or textured backgrounds
BUILTIN_PROMPTS = [
    "a red square moves to the right",
    "a small yellow circle bounces up and down on a black background",
    "a large blue triangle moves diagonally up and to the left on a checkered background",
    "a small green diamond moves up and a large purple circle stays still on a white background",
]
GENERAL_PROMPTS = [
    "a red fox running through fresh snow, golden hour, cinematic",
    "a paper boat drifting down a rainy street gutter, close-up",
    "an astronaut riding a horse across a desert at sunset",
    "time-lapse of clouds rolling over snowy mountains",
]


def _shown(folder) -> str:
    """A checkpoint folder as the browser sees it: relative to the working directory, never the server's
    absolute layout (a folder outside it shows its last two parts)."""
    path = Path(folder).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path(*path.parts[-2:]))


@dataclass
class VariantModel:
    """The transformer a variant runs on and what its output is worth."""

    name: str
    transformer: torch.nn.Module
    note: str  # shown in the variant's column: where the weights come from and what the video is worth
    kind: str  # short form for tables: "base", "converted", "fine-tuned" (+ ", random" for random weights)


@dataclass
class AppModels:
    components: WanComponents
    variants: dict[str, VariantModel]
    random_note: str | None = None  # set when every video is noise (tiny model, --random-weights)
    notes: list[str] = field(default_factory=list)
    # reads a video back into the prompt's attributes: {attribute: shown?} for each attribute the prompt names,
    # or None when it names nothing the analyser knows; set by whoever composes the app for a model with an
    # analyser (run_app.py, the built-in model)
    judge: Callable[[np.ndarray, str], dict[str, bool] | None] | None = None
    # prompts the model is known to draw (the built-in model's, chosen from its evaluation); [] = the defaults below
    examples: list[str] = field(default_factory=list)
    # where the example prompts' precomputed results are stored with the model (app.compare.store_examples)
    stored_dir: Path | None = None
    # offload hooks and VAE tiling applied at start (pipelines.memory), as the page's model line shows them
    memory: str = ""

    @property
    def device(self) -> torch.device:
        return self.components.device

    @property
    def patch(self) -> tuple[int, int, int]:
        return tuple(self.components.transformer.config.patch_size)

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        """The VAE's strides (time, height, width): 4 x 8 x 8 for Wan2.1's, 4 x 16 x 16 for Wan2.2-TI2V's."""
        vae = self.components.vae.config
        return (vae.scale_factor_temporal, vae.scale_factor_spatial, vae.scale_factor_spatial)

    def grid(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        return latent_grid(height, width, num_frames, self.patch, self.vae_stride)

    def fits(self, height: int, width: int) -> bool:
        """Whether a video size divides into this model's tokens (VAE stride x patch on each side)."""
        _, sh, sw = self.vae_stride
        return height % (sh * self.patch[1]) == 0 and width % (sw * self.patch[2]) == 0

    @property
    def needs_image(self) -> bool:
        """An image-to-video model: every run starts from an uploaded first frame."""
        return self.components.index.image_to_video

    @property
    def takes_image(self) -> bool:
        """The page shows the image input: an image-to-video model, or Wan2.2-TI2V (optional there)."""
        return self.components.index.takes_image

    def num_blocks(self, grid, variant: str = "mhla") -> int:
        """The M that ``generate()`` runs ``variant`` (an MHLA variant) with on ``grid``, by the same rule
        (:func:`pipelines.resolve_model_blocks`): the transformer's own layout when it has MHLA parameters, else
        the default with the model's block shape; shrunk to fit the grid."""
        transformer = self.variants[variant].transformer
        return resolve_model_blocks(transformer, grid, block_shape=self.components.block_shape).layout.num_blocks

    @property
    def builtin(self) -> bool:
        """True for the built-in model (its example prompts; run_app.py gives it its analyser as ``judge``)."""
        return self.components.source.startswith("built-in model")

    @property
    def example_prompts(self) -> list[str]:
        return self.examples or (BUILTIN_PROMPTS if self.builtin else GENERAL_PROMPTS)

    @property
    def example_prompt(self) -> str:
        """A prompt this model can draw, for messages."""
        return self.example_prompts[0]


DECODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_dtype_for(device: torch.device, dtype: torch.dtype, choice: str = "auto") -> torch.dtype:
    """The VAE's dtype: ``choice`` by name, or for ``auto`` bfloat16 on a CPU (the Wan VAE's float32 3D
    convolutions take PyTorch's slow path there, its bfloat16 ones oneDNN's: 2-3x faster decoding, 59 dB PSNR
    against float32 on the built-in model; benchmarks/app_compare.py measures it), else the model's dtype."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cpu" else dtype
    if choice not in DECODE_DTYPES:
        raise ValueError(f"decode dtype must be auto or one of {', '.join(DECODE_DTYPES)}, got {choice!r}")
    return DECODE_DTYPES[choice]


def parse_variant_dirs(specs: list[str] | None) -> dict[str, Path]:
    """``["mhla=ckpt/wan-mhla", ...]`` -> ``{"mhla": Path("ckpt/wan-mhla")}``; errors name the bad spec."""
    out: dict[str, Path] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        name = name.strip()
        if not sep or not path.strip():
            raise ValueError(f"--variant expects NAME=DIR (e.g. mhla=ckpt/wan-mhla), got {spec!r}")
        if name not in VARIANTS:
            raise ValueError(f"--variant {spec!r}: unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")
        folder = Path(path.strip())
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"--variant {spec!r}: {str(folder)!r} has no config.json; expected a save_pretrained transformer folder"
            )
        out[name] = folder
    return out


def prepare_converted(components: WanComponents, names: list[str]) -> None:
    """Adds the attention parameters of the converted-only variants to the base transformer once, with the
    MHLA layout of the model's default video size; then back to flash.

    Without this the first MHLA run would fix the layout (M is fixed once a layer has its mixing matrix) at
    whatever preset came first, and a later 31,500-token run would use a tiny run's M. Smaller grids shrink
    the layout to fit (see mhla.resolve_blocks).
    """
    from pipelines import convert_self_attention

    d = components.defaults
    vae = components.vae.config
    stride = (vae.scale_factor_temporal, vae.scale_factor_spatial, vae.scale_factor_spatial)
    # a two-expert model's second transformer runs every variant too (generate() converts both)
    for transformer in (t for t in (components.transformer, components.transformer_2) if t is not None):
        patch = tuple(transformer.config.patch_size)
        grid = latent_grid(d["height"], d["width"], d["num_frames"], patch, stride)
        blocks = resolve_model_blocks(transformer, grid, block_shape=components.block_shape).blocks
        options = attention_options(transformer).replace(blocks=blocks)
        for name in names:
            convert_self_attention(transformer, "linear" if name == "linear" else "mhla", options=options)
        convert_self_attention(transformer, "flash", options=options)


def load_app_models(
    model: str | Path | None = None,
    variant_dirs: dict[str, Path] | None = None,
    random_weights: str | None = None,
    device="auto",
    dtype="auto",
    decode_dtype: str = "auto",
    offload: str = "none",
    vae_tiling: bool = False,
) -> AppModels:
    """Loads once what every request shares. ``model``: a local Wan2.1 T2V diffusers dir (None: the built-in
    model, ``"tiny-random"``: the tiny random-weight one); ``variant_dirs``: fine-tuned transformers by
    variant (default: those the model ships, e.g. the built-in model's); ``random_weights``:
    ``1.3b``/``14b`` (excludes ``model``); ``decode_dtype``: the VAE's dtype (``auto``: bfloat16 on a CPU, see
    :func:`decode_dtype_for`); ``offload``, ``vae_tiling``: :func:`pipelines.memory.apply_offload`, applied once
    after loading (the components load on the CPU when offloaded)."""
    from pipelines.loading import resolve_device, resolve_dtype
    from pipelines.memory import apply_offload, check_offload

    run_device = resolve_device(device)
    check_offload(offload, run_device)
    dtype = resolve_dtype(dtype, run_device)  # the execution device's (auto: bf16 on a GPU), wherever they load
    device = torch.device("cpu") if offload != "none" else run_device
    if model is not None and random_weights is not None:
        raise ValueError("--model and --random-weights exclude each other: random weights replace the model's")
    if random_weights is not None:
        components = build_random_wan(random_weights, device, dtype)
        random_note = (
            f"Wan2.1 {random_weights.upper()} architecture with RANDOM weights: latency is true-size, "
            "every video is noise (text encoder is a small stand-in, its time is not the real one)"
        )
    else:
        components = load_components(model, dtype=dtype, device=device)
        random_note = (
            f"{components.source}: every video is noise, made to test the plumbing"
            if components.random_weights
            else None
        )
    vae_dtype = decode_dtype_for(run_device, components.dtype, decode_dtype)
    if vae_dtype != components.vae.dtype:
        # WanPipeline casts the latents to the VAE's dtype before decoding. torch's own .to(): diffusers' override
        # only adds a warning about modules to keep in float32, and the Wan VAE lists none
        torch.nn.Module.to(components.vae, vae_dtype)
    variant_dirs = {**components.variant_dirs, **(variant_dirs or {})}
    variants = {}
    random_weights = components.random_weights
    noise = "; RANDOM weights: the video is noise" if random_weights else ""
    for name in VARIANTS:
        folder = (variant_dirs or {}).get(name)
        if folder is not None:
            transformer = load_transformer(folder, dtype=components.dtype, device=components.device)
            variants[name] = VariantModel(name, transformer, f"fine-tuned: {_shown(folder)}", "fine-tuned")
        elif name == "flash":
            note = "RANDOM weights: the video is noise" if random_weights else f"base weights: {components.source}"
            variants[name] = VariantModel(
                name, components.transformer, note, "base, random" if random_weights else "base"
            )
        else:
            kind = "converted, random" if random_weights else "converted"
            variants[name] = VariantModel(name, components.transformer, CONVERTED_NOTE + noise, kind)
    shared = [k for k, v in variants.items() if k != "flash" and v.transformer is components.transformer]
    if shared:
        prepare_converted(components, shared)
    notes = []
    if any(v.transformer is components.transformer for k, v in variants.items() if k != "flash"):
        notes.append(
            "variants without a fine-tuned checkpoint share the base transformer, switched in place at each run "
            "(conversion adds only small attention parameters)"
        )
    memory = ""
    if offload != "none" or vae_tiling:
        transformers = [v.transformer for v in variants.values()]
        memory = apply_offload(components, offload, run_device, vae_tiling, transformers).describe()
    examples = [] if components.random_weights else builtin_examples(BUILTIN_DIR if model is None else model)
    model_dir = BUILTIN_DIR if model is None else Path(model)
    stored_dir = None if components.random_weights or not model_dir.is_dir() else model_dir / STORED_SUBDIR
    return AppModels(components, variants, random_note, notes, examples=examples, stored_dir=stored_dir, memory=memory)

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
from typing import Any

import numpy as np
import torch

import mhla
from pipelines import (
    VARIANTS,
    WanComponents,
    latent_grid,
    load_components,
    load_transformer,
)
from pipelines.attention import LINEAR, MHLA, SOFTMAX
from pipelines.conversion import CONFIG_KEY, Conversion
from pipelines.loading import WAN_CONFIGS, build_random_wan
from pipelines.model_dir import BUILTIN_DIR, ModelDir, ModelIndex, builtin_examples

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


class _ModelQuestions:
    """What the page asks of a model, answered the same way before its weights load (:class:`ModelFacts`, from
    its files) and after (:class:`AppModels`): both give ``patch``, ``vae_stride``, ``index``, ``source`` and
    ``examples``."""

    patch: tuple[int, int, int]
    vae_stride: tuple[int, int, int]
    index: ModelIndex
    source: str
    examples: list[str]

    def grid(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        return latent_grid(height, width, num_frames, self.patch, self.vae_stride)

    def fits(self, height: int, width: int) -> bool:
        """Whether a video size divides into this model's tokens (VAE stride x patch on each side)."""
        _, sh, sw = self.vae_stride
        return height % (sh * self.patch[1]) == 0 and width % (sw * self.patch[2]) == 0

    @property
    def needs_image(self) -> bool:
        """An image-to-video model: every run starts from an uploaded first frame."""
        return self.index.image_to_video

    @property
    def takes_image(self) -> bool:
        """The page shows the image input: an image-to-video model, or Wan2.2-TI2V (optional there)."""
        return self.index.takes_image

    @property
    def builtin(self) -> bool:
        """True for the built-in model (its example prompts; run_app.py gives it its analyser as ``judge``)."""
        return self.source.startswith("built-in model")

    @property
    def example_prompts(self) -> list[str]:
        return self.examples or (BUILTIN_PROMPTS if self.builtin else GENERAL_PROMPTS)

    @property
    def example_prompt(self) -> str:
        """A prompt this model can draw, for messages."""
        return self.example_prompts[0]


@dataclass
class AppModels(_ModelQuestions):
    components: WanComponents
    variants: dict[str, VariantModel]
    random_note: str | None = None  # set when every video is noise (tiny model, --random-weights)
    notes: list[str] = field(default_factory=list)
    # reads a video back into the prompt's attributes: {attribute: shown?} for each attribute the prompt names,
    # or None when it names nothing the analyser knows; set by whoever composes the app for a model with an
    # analyser (run_app.py, the built-in model)
    judge: Callable[[np.ndarray, str], dict[str, bool] | None] | None = None
    # clips like those the model draws, to fit its live previews' colour map on (run_app.py gives the built-in
    # model its world's): (count, frames, height, width, seed) -> uint8 (count, frames, height, width, 3)
    clip_source: Callable[[int, int, int, int, int], np.ndarray] | None = None
    # prompts the model is known to draw (the built-in model's, chosen from its evaluation); [] = the defaults below
    examples: list[str] = field(default_factory=list)
    # where the example prompts' precomputed results are stored with the model (app.compare.store_examples)
    stored_dir: Path | None = None
    # offload hooks and VAE tiling applied at start (pipelines.memory), as the page's model line shows them
    memory: str = ""
    # the CLI's --compile (none, blocks, full) and --cache (pipelines.caching.CacheSpec or None), for every run
    compile: str = "none"
    cache: Any = None

    @property
    def speed(self) -> str:
        return speed_note(self.compile, self.cache)

    @property
    def device(self) -> torch.device:
        return self.components.device

    @property
    def dtype(self) -> torch.dtype:
        return self.components.dtype

    @property
    def source(self) -> str:  # type: ignore[override]
        return self.components.source

    @property
    def defaults(self) -> dict[str, Any]:
        return self.components.defaults

    @property
    def index(self) -> ModelIndex:  # type: ignore[override]
        return self.components.index

    @property
    def patch(self) -> tuple[int, int, int]:  # type: ignore[override]
        return tuple(self.components.transformer.config.patch_size)

    @property
    def vae_stride(self) -> tuple[int, int, int]:  # type: ignore[override]
        """The VAE's strides (time, height, width): 4 x 8 x 8 for Wan2.1's, 4 x 16 x 16 for Wan2.2-TI2V's."""
        vae = self.components.vae.config
        return (vae.scale_factor_temporal, vae.scale_factor_spatial, vae.scale_factor_spatial)

    @property
    def variant_notes(self) -> dict[str, str]:
        return {name: v.note for name, v in self.variants.items()}

    def num_blocks(self, grid, variant: str = MHLA) -> int:
        """The M that ``generate()`` runs ``variant`` (an MHLA variant) with on ``grid``, by the same rule
        (the model's ``resolve_blocks``): the transformer's own layout when it has MHLA parameters, else the default
        with the model's block shape; shrunk to fit the grid."""
        transformer = self.variants[variant].transformer
        return transformer.resolve_blocks(grid, block_shape=self.components.block_shape).layout.num_blocks


@dataclass
class ModelFacts(_ModelQuestions):
    """What the page is built from, read from the model's files without loading a weight or importing diffusers
    (:func:`describe_app_models`): the launcher serves the page from these while :func:`load_app_models` runs in
    the background (importing diffusers and loading take most of the start). The loaded :class:`AppModels`
    answers every question the page asks the same way (tests/app/test_start.py)."""

    source: str
    device: torch.device
    dtype: torch.dtype
    defaults: dict[str, Any]
    patch: tuple[int, int, int]
    vae_stride: tuple[int, int, int]
    block_shape: tuple[int, int, int]
    index: ModelIndex
    variant_notes: dict[str, str]
    own_blocks: dict[str, Any]  # each variant's transformer's own MHLA blocks once loaded (None: it has none)
    random_note: str | None = None
    notes: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    stored_dir: Path | None = None
    memory: str = ""
    kinds: dict[str, str] = field(default_factory=dict)  # VariantModel.kind by variant
    folders: dict[str, Path] = field(default_factory=dict)  # the fine-tuned transformers' folders by variant
    compile: str = "none"
    cache: Any = None

    @property
    def speed(self) -> str:
        return speed_note(self.compile, self.cache)

    def num_blocks(self, grid, variant: str = MHLA) -> int:
        """As :meth:`AppModels.num_blocks`, from the transformers' configs."""
        return mhla.resolve_blocks(grid, None, self.own_blocks[variant], self.block_shape).layout.num_blocks


DECODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bfloat16 natively on this CPU (AVX512-BF16 or AMX); without it bfloat16 is emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def decode_dtype_for(device: torch.device, dtype: torch.dtype, choice: str = "auto") -> torch.dtype:
    """The VAE's dtype: ``choice`` by name, or for ``auto`` bfloat16 on a CPU whose oneDNN runs bfloat16 natively
    (the Wan VAE's float32 3D convolutions take PyTorch's slow path there, its bfloat16 ones oneDNN's: 2-3x faster
    decoding, 59 dB PSNR against float32 on the built-in model), float32 on any other CPU (on an AVX2-only EPYC
    bfloat16 decoded 9x128x160 in 31.8 s against float32's 2.0 s: emulated), else the model's dtype."""
    if choice == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return dtype
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
    d = components.defaults
    stride = components.vae_stride
    # a two-expert model's second transformer runs every variant too (generate() converts both)
    for transformer in (t for t in (components.transformer, components.transformer_2) if t is not None):
        patch = tuple(transformer.config.patch_size)
        grid = latent_grid(d["height"], d["width"], d["num_frames"], patch, stride)
        blocks = transformer.resolve_blocks(grid, block_shape=components.block_shape).blocks
        options = transformer.conversion.options.replace(blocks=blocks)
        for name in names:
            transformer.convert(LINEAR if name == LINEAR else MHLA, options=options)
        transformer.convert(SOFTMAX, options=options)


def speed_note(compile: str = "none", cache=None) -> str:
    """The page's words for ``--compile`` and ``--cache`` ('' when neither is on): a cached step is approximate."""
    parts = [] if compile == "none" else [f"torch.compile: {compile} (the first step of a new size compiles)"]
    if cache is not None:
        parts.append(
            f"step cache: {cache.describe()}"
            + ("" if cache.kind == "mag-calibrate" else " (a skipped step reuses cached residuals: approximate)")
        )
    return " · ".join(parts)


SHARED_NOTE = (
    "variants without a fine-tuned checkpoint share the base transformer, switched in place at each run "
    "(conversion adds only small attention parameters)"
)


def describe_app_models(
    model: str | Path | ModelDir | None = None,
    variant_dirs: dict[str, Path] | None = None,
    random_weights: str | None = None,
    device="auto",
    dtype="auto",
    offload: str = "none",
    vae_tiling: bool = False,
    compile: str = "none",
    cache=None,
) -> ModelFacts:
    """What :func:`load_app_models` will serve with the same arguments, read from config files only (no weights,
    no diffusers import: well under a second); the arguments are checked as there, before anything loads."""
    if compile not in ("none", "blocks", "full"):
        raise ValueError(f"compile must be none, blocks or full, got {compile!r}")
    from pipelines.loading import random_wan_source, resolve_device, resolve_dtype
    from pipelines.memory import Offload, check_offload
    from pipelines.model_dir import check_model_dir, saved_transformer_config
    from pipelines.tiny_sizes import WAN_DEFAULTS

    run_device = resolve_device(device)
    check_offload(offload, run_device)
    dtype = resolve_dtype(dtype, run_device)  # the execution device's (auto: bf16 on a GPU), wherever they load
    if model is not None and random_weights is not None:
        raise ValueError("--model and --random-weights exclude each other: random weights replace the model's")
    base_config = None
    if random_weights is not None:
        if random_weights not in WAN_CONFIGS:
            raise ValueError(
                f"random-weight Wan2.1 size must be one of {', '.join(WAN_CONFIGS)}, got {random_weights!r}"
            )
        source, random, described = random_wan_source(random_weights), True, None
        defaults, block_shape, shipped = dict(WAN_DEFAULTS), mhla.PAPER_BLOCK_SHAPE, {}
        patch, stride, index = tuple(WAN_CONFIGS[random_weights]["patch_size"]), (4, 8, 8), ModelIndex()
    else:
        described = model if isinstance(model, ModelDir) else ModelDir(model)
        if described.path is not None:
            check_model_dir(described)  # once per ModelDir: the launcher's was checked already
            base_config = described.transformer_config()
        source, random = described.source(), described.random_weights
        defaults, block_shape, shipped = described.defaults, described.block_shape, described.variant_dirs
        patch, stride, index = described.shape().patch, described.vae_stride, described.index
    folders = {**shipped, **(variant_dirs or {})}
    noise = "; RANDOM weights: the video is noise" if random else ""
    notes, kinds, configs = {}, {}, {}
    for name in VARIANTS:
        folder = folders.get(name)
        if folder is not None:
            notes[name], kinds[name] = f"fine-tuned: {_shown(folder)}", "fine-tuned"
            configs[name] = saved_transformer_config(folder) or {}
        elif name == SOFTMAX:
            notes[name] = "RANDOM weights: the video is noise" if random else f"base weights: {source}"
            kinds[name] = "base, random" if random else "base"
        else:
            notes[name], kinds[name] = CONVERTED_NOTE + noise, "converted, random" if random else "converted"
    # the base transformer's own blocks, after prepare_converted gave it the default size's when an MHLA variant
    # shares it (the same rule, on its config)
    shared = [name for name in VARIANTS if name != SOFTMAX and name not in folders]
    base_blocks = _config_blocks(base_config or {})
    if any(name != LINEAR for name in shared):
        grid = latent_grid(defaults["height"], defaults["width"], defaults["num_frames"], patch, stride)
        base_blocks = mhla.resolve_blocks(grid, None, base_blocks, block_shape).blocks
    own_blocks = {name: _config_blocks(configs[name]) if name in configs else base_blocks for name in VARIANTS}
    if random_weights is not None:
        random_note = (
            f"Wan2.1 {random_weights.upper()} architecture with RANDOM weights: latency is true-size, "
            "every video is noise (text encoder is a small stand-in, its time is not the real one)"
        )
    else:
        random_note = f"{source}: every video is noise, made to test the plumbing" if random else None
    model_dir = BUILTIN_DIR if described is None or described.path is None else described.path
    return ModelFacts(
        source=source,
        device=run_device,
        dtype=dtype,
        defaults=defaults,
        patch=patch,
        vae_stride=stride,
        block_shape=tuple(block_shape),
        index=index,
        variant_notes=notes,
        own_blocks=own_blocks,
        random_note=random_note,
        notes=[SHARED_NOTE] if shared else [],
        examples=[] if random else builtin_examples(model_dir),
        stored_dir=None if random or not model_dir.is_dir() else model_dir / STORED_SUBDIR,
        memory=Offload(offload, run_device, vae_tiling).describe(),
        kinds=kinds,
        folders=folders,
        compile=compile,
        cache=cache,
    )


def _config_blocks(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """The MHLA blocks a transformer's ``config.json`` says it owns (:attr:`pipelines.conversion.Conversion.blocks`),
    read without loading the model."""
    return Conversion.from_config(config.get(CONFIG_KEY), int(config.get("num_layers") or 0)).blocks


def load_app_models(
    model: str | Path | ModelDir | None = None,
    variant_dirs: dict[str, Path] | None = None,
    random_weights: str | None = None,
    device="auto",
    dtype="auto",
    decode_dtype: str = "auto",
    offload: str = "none",
    vae_tiling: bool = False,
    compile: str = "none",
    cache=None,
) -> AppModels:
    """Loads once what every request shares. ``model``: a local Wan2.1 T2V diffusers dir (None: the built-in
    model, ``"tiny-random"``: the tiny random-weight one); ``variant_dirs``: fine-tuned transformers by
    variant (default: those the model ships, e.g. the built-in model's); ``random_weights``:
    ``1.3b``/``14b`` (excludes ``model``); ``decode_dtype``: the VAE's dtype (``auto``: bfloat16 on a CPU, see
    :func:`decode_dtype_for`); ``offload``, ``vae_tiling``: :func:`pipelines.memory.apply_offload`, applied once
    after loading (the components load on the CPU when offloaded); ``compile``, ``cache``: the generation CLI's
    ``--compile`` and ``--cache`` (a :class:`pipelines.caching.CacheSpec`), for every run (app.compare._generate).
    The page's notes are :func:`describe_app_models`' for the same arguments."""
    from pipelines.memory import apply_offload

    if random_weights is None and not isinstance(model, ModelDir):
        model = ModelDir(model)  # one description of the folder, for the facts and the loading alike
    facts = describe_app_models(model, variant_dirs, random_weights, device, dtype, offload, vae_tiling, compile, cache)
    run_device, dtype = facts.device, facts.dtype
    device = torch.device("cpu") if offload != "none" else run_device
    if random_weights is not None:
        components = build_random_wan(random_weights, device, dtype)
    else:
        components = load_components(model, dtype=dtype, device=device)
    vae_dtype = decode_dtype_for(run_device, components.dtype, decode_dtype)
    if vae_dtype != components.vae.dtype:
        # WanPipeline casts the latents to the VAE's dtype before decoding. torch's own .to(): diffusers' override
        # only adds a warning about modules to keep in float32, and the Wan VAE lists none
        torch.nn.Module.to(components.vae, vae_dtype)
    variants = {}
    for name in VARIANTS:
        folder = facts.folders.get(name)
        if folder is not None:
            transformer = load_transformer(folder, dtype=components.dtype, device=components.device)
        else:
            transformer = components.transformer
        variants[name] = VariantModel(name, transformer, facts.variant_notes[name], facts.kinds[name])
    shared = [k for k, v in variants.items() if k != SOFTMAX and v.transformer is components.transformer]
    if shared:
        prepare_converted(components, shared)
    memory = ""
    if offload != "none" or vae_tiling:
        transformers = [v.transformer for v in variants.values()]
        memory = apply_offload(components, offload, run_device, vae_tiling, transformers).describe()
    return AppModels(
        components,
        variants,
        facts.random_note,
        facts.notes,
        examples=facts.examples,
        stored_dir=facts.stored_dir,
        memory=memory,
        compile=compile,
        cache=cache,
    )

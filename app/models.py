"""What the app serves: shared Wan2.1 components and one transformer per distinct set of weights.

Text encoder and VAE are loaded once (:class:`pipelines.WanComponents`) and shared by every variant.
Variants without their own checkpoint run on the base transformer, converted in place by
``generate()`` at each run: conversion only adds small attention parameters (mixing matrices, output
norms), so keeping a deep copy per variant would multiply memory (4 x 28 GB at 14B) for identical
weights. A variant given as ``--variant NAME=DIR`` gets its own transformer, loaded once at start.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mhla
from pipelines import VARIANTS, WanComponents, latent_grid, load_components, load_transformer
from pipelines.pipeline import RANDOM_WEIGHTS_NOTE

CONVERTED_NOTE = "converted, not fine-tuned: latency is real, quality is not"
RANDOM_SIZES = ("1.3b", "14b")
# Wan2.1 T2V transformer configurations (diffusers' WanTransformer3DModel), for --random-weights.
WAN_TRANSFORMERS = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
}


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

    @property
    def device(self) -> torch.device:
        return self.components.device

    @property
    def patch(self) -> tuple[int, int, int]:
        return tuple(self.components.transformer.config.patch_size)

    def grid(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        return latent_grid(height, width, num_frames, self.patch)

    def num_blocks(self, grid) -> int:
        """M of the default MHLA layout for ``grid`` with this model's target block shape."""
        return math.prod(mhla.default_blocks(grid, self.components.block_shape))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # /proc/cpuinfo names the CPU model on Linux; platform.processor() is often empty there
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


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


def build_random_components(size: str, device="auto", dtype="auto") -> WanComponents:
    """The real Wan2.1 transformer (``1.3b`` or ``14b``) and VAE with random weights, for true-size latency.

    The text encoder is a 2-layer UMT5 stand-in with the real output width (4096): building the 5.7B-parameter
    UMT5-XXL would take minutes and ~11 GB for a stage that runs once per video and is not compared here.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    from pipelines.loading import resolve_device, resolve_dtype
    from pipelines.tiny import WAN_DEFAULTS

    if size not in WAN_TRANSFORMERS:
        raise ValueError(f"--random-weights must be one of {', '.join(RANDOM_SIZES)}, got {size!r}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    tokenizer = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        # built on the device directly: 14B parameters in float32 do not fit a 2-core CI box, let alone twice
        transformer = WanTransformer3DModel(**WAN_TRANSFORMERS[size]).eval()
        text_encoder = UMT5EncoderModel(
            UMT5Config(vocab_size=len(tokenizer), d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64)
        ).eval()
        vae = AutoencoderKLWan().eval()  # diffusers' defaults are Wan2.1's VAE
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or [])
    for name, module in transformer.named_modules():
        # as from_pretrained(dtype=...): norms, time embedding and RoPE stay float32
        if not keep.intersection(name.split(".")):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(dtype)
    from pipelines import convert_self_attention

    return WanComponents(
        tokenizer=tokenizer,
        text_encoder=text_encoder.to(dtype),
        vae=vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        transformer=convert_self_attention(transformer, "flash"),
        source=f"Wan2.1-T2V-{size.upper()} architecture with RANDOM weights",
        random_weights=True,
        device=device,
        dtype=dtype,
        defaults=dict(WAN_DEFAULTS),
    )


def prepare_converted(components: WanComponents, names: list[str]) -> None:
    """Adds the attention parameters of the converted-only variants to the base transformer once, with the
    MHLA layout of the model's default video size; then back to flash.

    Without this the first MHLA run would fix the layout (M is fixed once a layer has its mixing matrix) at
    whatever preset came first, and a later 31,500-token run would use a tiny run's M. Smaller grids shrink
    the layout to fit (see pipelines.attention.fit_blocks).
    """
    from pipelines import AttentionOptions, convert_self_attention, self_attention_state

    d = components.defaults
    transformer = components.transformer
    grid = latent_grid(d["height"], d["width"], d["num_frames"], tuple(transformer.config.patch_size))
    state = self_attention_state(transformer)
    options = AttentionOptions.from_dict(state["options"])
    if not state["parameters"]["mhla"]:
        options = options.replace(blocks=mhla.default_blocks(grid, components.block_shape))
    for name in names:
        convert_self_attention(transformer, "linear" if name == "linear" else "mhla", options=options)
    convert_self_attention(transformer, "flash", options=options)


def load_app_models(
    model: str | Path | None = None,
    variant_dirs: dict[str, Path] | None = None,
    random_weights: str | None = None,
    device="auto",
    dtype="auto",
) -> AppModels:
    """Loads once what every request shares. ``model``: a local Wan2.1 T2V diffusers dir (None: the built-in
    model, ``"tiny-random"``: the tiny random-weight one); ``variant_dirs``: fine-tuned transformers by
    variant (default: those the model ships, e.g. the built-in model's); ``random_weights``:
    ``1.3b``/``14b`` (excludes ``model``)."""
    if model is not None and random_weights is not None:
        raise ValueError("--model and --random-weights exclude each other: random weights replace the model's")
    if random_weights is not None:
        components = build_random_components(random_weights, device, dtype)
        random_note = (
            f"Wan2.1 {random_weights.upper()} architecture with RANDOM weights: latency is true-size, "
            "every video is noise (text encoder is a small stand-in, its time is not the real one)"
        )
    else:
        components = load_components(model, dtype=dtype, device=device)
        random_note = (
            RANDOM_WEIGHTS_NOTE.replace("this video is", "every video is") if components.random_weights else None
        )
    variant_dirs = {**components.variant_dirs, **(variant_dirs or {})}
    variants = {}
    rnd = components.random_weights
    noise = "; RANDOM weights: the video is noise" if rnd else ""
    for name in VARIANTS:
        folder = (variant_dirs or {}).get(name)
        if folder is not None:
            transformer = load_transformer(folder, dtype=components.dtype, device=components.device)
            variants[name] = VariantModel(name, transformer, f"fine-tuned: {_shown(folder)}", "fine-tuned")
        elif name == "flash":
            note = "RANDOM weights: the video is noise" if rnd else f"base weights: {components.source}"
            variants[name] = VariantModel(name, components.transformer, note, "base, random" if rnd else "base")
        else:
            kind = "converted, random" if rnd else "converted"
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
    return AppModels(components, variants, random_note, notes)

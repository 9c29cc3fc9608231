"""The tiny random-weight Wan2.1 model (tiny-random): real Wan architecture, tiny sizes, RANDOM weights.

It exists so the whole product (conversion, generation, video writing, the app, CI) runs on a
2-core CPU in seconds with nothing downloaded. Its weights are random: its videos are noise, and
everything that shows them must say so (see :attr:`pipelines.loading.WanComponents.random_weights`).

Parts, all built deterministically from ``seed``:
- ``WanTransformer3DModel``: 30 layers like Wan2.1-1.3B (so ``mhla-hybrid`` converts 20 of 30), 2 heads x 16.
- ``AutoencoderKLWan``: z_dim 16 (Wan2.1's latent channels, so the default latents_mean/std fit),
  strides 4 x 8 x 8 like the real VAE, 8 base channels.
- ``UMT5EncoderModel`` from a small ``UMT5Config`` (d_model 32, 2 layers).
- ``ByT5Tokenizer``: byte-level, needs no vocabulary file.
- ``UniPCMultistepScheduler`` with Wan's flow settings (shift 3.0).

The other Wan architectures (Wan2.2-TI2V, Wan2.2-A14B, Wan2.2-I2V, and Wan2.1-I2V with its CLIP image encoder)
are tiny diffusers pipelines (:func:`build_tiny_pipeline`); ``python -m pipelines.tiny --architecture wan2.1-i2v
--out DIR`` writes one as a model directory (``save_pretrained``) that ``--model DIR`` and ``DiffusionPipeline.from_pretrained`` load.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .model import MHLAWanTransformer3DModel

# the sizes other modules read without building anything live in .tiny_sizes: importing them from here made
# `import pipelines` import this module, and `python -m pipelines.tiny` then warned that it was run as __main__
# after being imported (runpy's RuntimeWarning)
from .tiny_sizes import TINY_BLOCK_SHAPE as TINY_BLOCK_SHAPE
from .tiny_sizes import TINY_DEFAULTS as TINY_DEFAULTS
from .tiny_sizes import TINY_INFO as TINY_INFO
from .tiny_sizes import TINY_TRANSFORMER as TINY_TRANSFORMER
from .tiny_sizes import WAN_DEFAULTS as WAN_DEFAULTS

TINY_VAE: dict[str, Any] = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=0,
    temperal_downsample=[False, True, True],
)
TINY_TEXT_ENCODER: dict[str, Any] = dict(
    d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8
)


def build_tiny_transformer(seed: int = 0, num_layers: int = 30, **overrides: Any) -> MHLAWanTransformer3DModel:
    """A random-weight Wan transformer of the tiny config (float32, CPU), unconverted (``flash``); its weights are
    those a plain ``WanTransformer3DModel`` of the same config and seed draws."""
    from .model import MHLAWanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MHLAWanTransformer3DModel(**{**TINY_TRANSFORMER, "num_layers": num_layers, **overrides}).eval()


def build_tiny_components(seed: int = 0) -> dict[str, Any]:
    """``tokenizer, text_encoder, vae, scheduler, transformer`` of the tiny model (float32, CPU, eval mode).

    Same ``seed`` -> bit-identical weights. Takes well under a second.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    tokenizer = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TINY_TEXT_ENCODER)).eval()
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLWan(**TINY_VAE).eval()
    transformer = build_tiny_transformer(seed + 2)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": scheduler,
        "transformer": transformer,
    }


# ---- the other Wan architectures, tiny and random: what each differs in from Wan2.1-T2V
# Wan2.2-TI2V-5B: a 48-channel VAE that patches 2x2 before its 8x8 strides (16x in all), the transformer's
# timestep given per token (WanPipeline's expand_timesteps)
TINY_VAE_22: dict[str, Any] = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=48,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=0,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)
# Wan2.1-I2V: a CLIP vision encoder (ViT-H/14 at 224 px in the release: 257 tokens of width 1280) whose penultimate
# hidden state (WanImageToVideoPipeline.encode_image) the transformer's image embedder takes (image_dim = the
# encoder's width) and every cross-attention reads through its own key/value projections (add_k_proj, add_v_proj:
# added_kv_proj_dim = the transformer's inner width, as diffusers' Wan2.1-I2V configs have it). Here 32 px in 8 px
# patches: 16 + 1 tokens of width 32; 3 layers, so the penultimate state is not the last.
TINY_IMAGE_ENCODER: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    projection_dim=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
TINY_ARCHITECTURES = ("wan2.1-t2v", "wan2.2-ti2v", "wan2.2-t2v-a14b", "wan2.2-i2v", "wan2.1-i2v")


def build_tiny_image_encoder(seed: int = 0) -> tuple[Any, Any]:
    """Wan2.1-I2V's image encoder and processor, tiny: a random-weight ``CLIPVisionModel`` of
    :data:`TINY_IMAGE_ENCODER` (float32, eval mode; same ``seed`` -> same weights) and a ``CLIPImageProcessor``
    built here (no download) that resizes and centre-crops to its 32 px input with CLIP's normalisation."""
    import transformers
    from transformers import CLIPVisionConfig, CLIPVisionModel

    size = int(TINY_IMAGE_ENCODER["image_size"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = CLIPVisionModel(CLIPVisionConfig(**TINY_IMAGE_ENCODER)).eval()
    # transformers 5 without torchvision makes every CLIPImageProcessor its PIL one (with a warning): named so
    # directly where it exists, so the folder's model_index.json is the same on every machine
    processor_class = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    processor = processor_class(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return encoder, processor


def build_tiny_pipeline(architecture: str = "wan2.1-t2v", seed: int = 0, num_layers: int = 6) -> Any:
    """A diffusers pipeline of ``architecture`` (:data:`TINY_ARCHITECTURES`) with tiny random parts:

    - ``wan2.1-t2v``: ``WanPipeline`` as :func:`build_tiny_components`;
    - ``wan2.2-ti2v``: ``WanPipeline(expand_timesteps=True)``, the 48-channel VAE (16x spatial), 48-channel transformer;
    - ``wan2.2-t2v-a14b``: ``WanPipeline`` with two experts (``transformer_2``, ``boundary_ratio=0.875``);
    - ``wan2.2-i2v``: ``WanImageToVideoPipeline`` without an image encoder, the transformer taking the noise, the
      first-frame condition and its mask (16 + 16 + 4 = 36 channels);
    - ``wan2.1-i2v``: ``WanImageToVideoPipeline`` with a CLIP image encoder and processor
      (:func:`build_tiny_image_encoder`), the 36-channel transformer with an image embedder (``image_dim``) and
      image key/value projections in every cross-attention (``added_kv_proj_dim``).
    """
    from .compat import quiet_image_processors

    quiet_image_processors()  # diffusers' image-to-video module imports transformers' CLIPImageProcessor
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {TINY_ARCHITECTURES}, got {architecture!r}")
    parts = build_tiny_components(seed)
    parts["transformer"] = build_tiny_transformer(seed + 2, num_layers=num_layers)
    if architecture == "wan2.1-t2v":
        return WanPipeline(**parts)
    if architecture == "wan2.2-ti2v":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            parts["vae"] = AutoencoderKLWan(**TINY_VAE_22).eval()
        parts["transformer"] = build_tiny_transformer(seed + 2, num_layers, in_channels=48, out_channels=48)
        return WanPipeline(**parts, expand_timesteps=True)
    if architecture == "wan2.2-t2v-a14b":
        expert = build_tiny_transformer(seed + 3, num_layers=num_layers)
        return WanPipeline(**parts, transformer_2=expert, boundary_ratio=0.875)
    if architecture == "wan2.2-i2v":
        parts["transformer"] = build_tiny_transformer(seed + 2, num_layers, in_channels=36)
        return WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None)
    encoder, processor = build_tiny_image_encoder(seed + 4)
    inner = TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"]
    parts["transformer"] = build_tiny_transformer(
        seed + 2, num_layers, in_channels=36, image_dim=encoder.config.hidden_size, added_kv_proj_dim=inner
    )
    return WanImageToVideoPipeline(**parts, image_encoder=encoder, image_processor=processor)


def save_tiny_model(architecture: str, out: str | Path, seed: int = 0, num_layers: int = 6) -> Path:
    """Writes the tiny ``architecture`` pipeline (:func:`build_tiny_pipeline`) as a diffusers model directory at
    ``out`` (``save_pretrained``, safetensors, written atomically; an earlier tiny model there is replaced) with
    :data:`TINY_INFO` beside ``model_index.json``. Returns ``out``."""
    from common.errors import BadInputError
    from common.outputs import atomic_dir

    if architecture not in TINY_ARCHITECTURES:
        raise BadInputError(f"--architecture must be one of {', '.join(TINY_ARCHITECTURES)}, got {architecture!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise BadInputError(f"--layers {num_layers!r}: expected a number of transformer layers >= 1")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / TINY_INFO).is_file())):
        raise BadInputError(
            f"--out {str(out)!r} exists and is not an earlier tiny model; expected a new or empty folder"
        )
    pipe = build_tiny_pipeline(architecture, seed=seed, num_layers=num_layers)
    with atomic_dir(out) as tmp:
        pipe.save_pretrained(str(tmp), safe_serialization=True)
        info = {"architecture": architecture, "seed": seed, "num_layers": num_layers, "random_weights": True}
        (tmp / TINY_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipelines.tiny --architecture ARCH --out DIR``: a tiny random-weight model directory."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="pipelines.tiny")


def _main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.tiny",
        description="Write a tiny random-weight Wan model directory (its videos are noise): for tests and smoke runs.",
    )
    p.add_argument("--architecture", required=True, choices=TINY_ARCHITECTURES)
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=6, help="transformer layers (each expert)")
    args = p.parse_args(argv)
    out = save_tiny_model(args.architecture, args.out, args.seed, args.layers)
    print(f"wrote {out} (tiny random-weight {args.architecture}: RANDOM weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

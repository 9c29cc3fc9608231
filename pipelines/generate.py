"""Text-to-video generation with a chosen self-attention variant, with timing; and its command line.

    python -m pipelines.generate --prompt "a red fox running through snow" --variant mhla-hybrid --out fox.mp4

Without ``--model`` the built-in tiny model runs (random weights: its video is noise, and says so).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import mhla

from .attention import VARIANTS, AttentionOptions, parse_layers
from .convert import attention_context, attention_options, convert_self_attention, self_attention_state
from .timing import Timing, format_comparison, format_timing, sync

# Wan2.1's VAE strides (4 in time, 8 in space): with the transformer's patch, the pipeline's input constraints.
TEMPORAL_STRIDE = 4
OUTPUT_TYPES = ("np", "pil", "pt", "latent")
RANDOM_WEIGHTS_NOTE = "built-in tiny model with RANDOM weights: this video is noise, made to test the plumbing"


class NonFiniteLatentsError(FloatingPointError):
    """The denoising produced NaN or inf latents: there is no video to write."""


@dataclass
class GenerationResult:
    """Output of :func:`generate`.

    ``frames``: for ``output_type="np"`` a float32 array ``(num_frames, height, width, 3)`` in [0, 1];
    ``"pil"`` a list of images; ``"pt"`` a tensor ``(num_frames, 3, height, width)``; ``"latent"`` the latents
    ``(1, 16, F, height/8, width/8)``. ``initial_noise`` is the starting latent (same seed -> same noise).
    """

    frames: object
    timing: Timing
    prompt: str
    seed: int
    initial_noise: torch.Tensor
    random_weights: bool


def latent_grid(height: int, width: int, num_frames: int, patch_size=(1, 2, 2), vae_stride=(4, 8, 8)):
    """The latent-token grid ``(F, H, W)`` the transformer's attention sees for a video size."""
    f = (num_frames - 1) // vae_stride[0] + 1
    return (f // patch_size[0], height // vae_stride[1] // patch_size[1], width // vae_stride[2] // patch_size[2])


def validate_request(
    prompt,
    height,
    width,
    num_frames,
    num_inference_steps,
    guidance_scale,
    variant,
    blocks=None,
    negative_prompt=None,
    seed=0,
    output_type="np",
    patch_size=(1, 2, 2),
    vae_stride=(TEMPORAL_STRIDE, 8, 8),
):
    """Checks a request before any heavy work; raises ``ValueError`` naming the bad value and what was expected.

    ``patch_size`` and ``vae_stride`` are the model's (Wan2.1's by default). Returns the latent-token grid
    ``(F, H, W)``.
    """
    temporal_stride, spatial_multiple = vae_stride[0], vae_stride[1] * patch_size[1]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt must be a non-empty string describing the video, got {prompt!r}")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise ValueError(f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}")
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % spatial_multiple:
            raise ValueError(
                f"{name} must be a positive multiple of {spatial_multiple} "
                f"(VAE stride {vae_stride[1]} x patch {patch_size[1]}), got {value!r}"
            )
    if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % temporal_stride:
        raise ValueError(f"num_frames must be of the form {temporal_stride}k+1 (1, 5, 9, ..., 81), got {num_frames!r}")
    if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be an integer >= 1, got {num_inference_steps!r}")
    if not isinstance(guidance_scale, (int, float)) or not math.isfinite(guidance_scale) or guidance_scale < 0:
        raise ValueError(f"guidance_scale must be a finite number >= 0, got {guidance_scale!r}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
    grid = latent_grid(height, width, num_frames, patch_size, vae_stride)
    if blocks is not None and variant not in ("mhla", "mhla-hybrid"):
        raise ValueError(
            f"blocks apply to the 'mhla' and 'mhla-hybrid' variants only, got blocks={blocks!r} for {variant!r}"
        )
    if blocks is not None:
        try:
            mhla.BlockLayout(grid, mhla.parse_blocks(blocks))
        except ValueError as e:
            raise ValueError(
                f"blocks {blocks!r} do not fit {num_frames} frames at {height}x{width}: {e}. "
                "Use fewer blocks on that axis, or leave blocks unset for the default layout"
            ) from None
    return grid


def initial_noise(seed: int, shape: tuple[int, ...], device) -> torch.Tensor:
    """Starting latents from ``seed``: drawn on the CPU in float32 so every variant, dtype and device
    starts from bit-identical noise."""
    generator = torch.Generator("cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)


def _resolve_options(transformer, variant, blocks, grid, block_shape, overrides) -> AttentionOptions:
    options = attention_options(transformer)
    if overrides:
        options = options.replace(**overrides)
    if variant in ("mhla", "mhla-hybrid"):
        has_mhla = bool(self_attention_state(transformer)["parameters"]["mhla"])
        if blocks is not None:
            options = options.replace(blocks=mhla.parse_blocks(blocks))
        elif not has_mhla:
            # a fresh conversion: the default rule on this grid, with the model's target block shape
            options = options.replace(blocks=mhla.default_blocks(grid, block_shape))
    return options


@torch.no_grad()
def generate(
    components,
    prompt: str,
    negative_prompt: str = "",
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
    seed: int = 0,
    variant: str = "flash",
    layers: list[int] | None = None,
    blocks: str | tuple[int, int, int] | None = None,
    attention_options: dict | None = None,
    transformer=None,
    output_type: str = "np",
    max_sequence_length: int | None = None,
    show_progress: bool = True,
) -> GenerationResult:
    """Generates one video with ``variant`` self-attention and times it.

    Args:
        components: :class:`pipelines.loading.WanComponents` (tokenizer, text encoder, VAE shared by all variants).
        prompt, negative_prompt, height, width, num_frames, num_inference_steps, guidance_scale: as diffusers'
            ``WanPipeline``; None takes the model's defaults (``components.defaults``).
        seed: the initial noise (identical for every variant) and nothing else.
        variant: ``flash``, ``linear``, ``mhla`` or ``mhla-hybrid``.
        layers: MHLA layers for ``mhla-hybrid``; default: the model's own split if it has one (it runs as
            ``mhla-hybrid``, or has MHLA parameters in some layers only), else all but 0, 3, 6, ...
        blocks: MHLA block count, e.g. ``"7x3x5"``; must fit this video's token grid. Default: the model's own
            (if it has MHLA parameters), else :func:`mhla.default_blocks` of this grid.
        attention_options: overrides of :class:`pipelines.attention.AttentionOptions` (e.g. ``{"normalize": True}``).
        transformer: the transformer to run (default ``components.transformer``); it is converted in place,
            reusing its variant parameters where it has them.
        output_type: ``"np"``, ``"pil"``, ``"pt"`` or ``"latent"``.
    """
    from diffusers import WanPipeline

    d = components.defaults
    height = d.get("height") if height is None else height
    width = d.get("width") if width is None else width
    num_frames = d.get("num_frames") if num_frames is None else num_frames
    num_inference_steps = d.get("num_inference_steps") if num_inference_steps is None else num_inference_steps
    guidance_scale = d.get("guidance_scale") if guidance_scale is None else guidance_scale
    # text embeddings are padded to this length and not masked in cross-attention: use the model's own
    max_sequence_length = d.get("max_sequence_length", 512) if max_sequence_length is None else max_sequence_length
    transformer = components.transformer if transformer is None else transformer
    vae = components.vae
    patch = tuple(transformer.config.patch_size)
    stride = (vae.config.scale_factor_temporal, vae.config.scale_factor_spatial, vae.config.scale_factor_spatial)
    validate_request(
        prompt, height, width, num_frames, num_inference_steps, guidance_scale, variant, blocks,
        negative_prompt, seed, output_type, patch_size=patch, vae_stride=stride,
    )  # fmt: skip
    grid = latent_grid(height, width, num_frames, patch, stride)
    options = _resolve_options(transformer, variant, blocks, grid, components.block_shape, attention_options)
    state = self_attention_state(transformer)
    if variant == "mhla-hybrid" and layers is None:
        # keep the model's own hybrid split (e.g. from its checkpoint), also after a switch to another variant
        if state["variant"] == "mhla-hybrid":
            layers = state["linear_layers"]
        elif 0 < len(state["parameters"]["mhla"]) < len(transformer.blocks):
            layers = state["parameters"]["mhla"]
    had = state["parameters"]
    convert_self_attention(transformer, variant, layers, options)
    added = {k: sorted(set(v) - set(had[k])) for k, v in self_attention_state(transformer)["parameters"].items()}
    if any(added.values()) and not components.random_weights:
        where = ", ".join(f"{kind} in layers {v}" for kind, v in added.items() if v)
        warnings.warn(
            f"variant {variant!r} added freshly initialised (untrained) attention parameters ({where}); "
            "a softmax-trained checkpoint needs fine-tuning before those layers make good videos",
            stacklevel=3,  # the caller of generate(), past torch.no_grad's wrapper
        )

    device = components.device
    scheduler = type(components.scheduler).from_config(components.scheduler.config)  # fresh state per call
    pipe = WanPipeline(
        tokenizer=components.tokenizer,
        text_encoder=components.text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=not show_progress, desc=f"denoising [{variant}]", leave=False)
    ctx = attention_context(transformer)
    ctx.layouts.clear()
    ctx.softmax_backend = None
    timing = Timing(
        variant=variant, device=str(device), dtype=str(transformer.dtype).replace("torch.", ""),
        random_weights=components.random_weights,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    sync(device)
    t_start = time.perf_counter()
    prompt_embeds, negative_embeds = pipe.encode_prompt(
        prompt=prompt,
        negative_prompt=negative_prompt,
        do_classifier_free_guidance=guidance_scale > 1.0,
        max_sequence_length=max_sequence_length,
        device=device,
    )
    sync(device)
    t_text = time.perf_counter()

    latent_frames = (num_frames - 1) // stride[0] + 1
    shape = (1, transformer.config.in_channels, latent_frames, height // stride[1], width // stride[2])
    noise = initial_noise(seed, shape, device)
    step_ends: list[float] = []

    def on_step_end(_pipe, i, _t, kwargs):
        sync(device)
        step_ends.append(time.perf_counter())
        # cheap (the latents are small): a model or dtype that overflows stops here, not in a black video
        if not bool(torch.isfinite(kwargs["latents"]).all()):
            raise NonFiniteLatentsError(
                f"{variant}: the latents became NaN or inf at denoising step {i + 1} of {num_inference_steps} "
                f"({str(transformer.dtype).replace('torch.', '')} on {device.type}); no video is written. "
                "Check the weights, or try --dtype float32"
            )
        return {}

    ctx.timer.reset(enabled=True)
    try:
        latents = pipe(
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_embeds,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            latents=noise,
            output_type="latent",
            return_dict=False,
            callback_on_step_end=on_step_end,
            max_sequence_length=max_sequence_length,
        )[0]
        sync(device)
        t_denoise = time.perf_counter()
    finally:
        ctx.timer.enabled = False

    if output_type == "latent":
        frames = latents
    else:
        frames = decode_latents(pipe, latents, output_type)[0]
    sync(device)
    t_end = time.perf_counter()

    timing.total = t_end - t_start
    timing.text_encoding = t_text - t_start
    timing.denoising = t_denoise - t_text
    timing.steps = [b - a for a, b in zip([t_text, *step_ends[:-1]], step_ends, strict=True)]
    timing.vae_decode = t_end - t_denoise
    timing.self_attention = ctx.timer.seconds()
    timing.self_attention_calls = ctx.timer.calls
    timing.peak_memory_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    timing.grid = tuple(grid)
    timing.num_tokens = math.prod(grid)
    if variant in ("mhla", "mhla-hybrid"):
        timing.layout = "; ".join(sorted(ctx.layouts)) or "-"
        timing.num_blocks = math.prod(mhla.fit_blocks(options.blocks, grid))
    elif variant == "linear":
        timing.layout = "one global summary (M=1)"
        timing.num_blocks = 1
    timing.softmax_backend = ctx.softmax_backend
    return GenerationResult(
        frames=frames,
        timing=timing,
        prompt=prompt,
        seed=seed,
        initial_noise=noise.cpu(),
        random_weights=components.random_weights,
    )


def decode_latents(pipe, latents: torch.Tensor, output_type: str = "np"):
    """Latents ``(B, 16, F, h, w)`` -> videos, exactly as diffusers' WanPipeline decodes them."""
    vae = pipe.vae
    latents = latents.to(vae.device, vae.dtype)
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents)
    video = vae.decode(latents * std + mean, return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type=output_type)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.generate",
        description="Wan2.1 text-to-video with softmax ('flash'), linear, MHLA or hybrid MHLA self-attention.",
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default="")
    p.add_argument(
        "--variant", default=None,
        help=f"one of {', '.join(VARIANTS)}; a comma list or 'all' generates each (out file gets a _VARIANT suffix); "
        "default: mhla-hybrid, or the saved variant of --transformer",
    )  # fmt: skip
    p.add_argument("--out", default="out.mp4", help="mp4 to write")
    p.add_argument(
        "--model",
        default=None,
        help="local diffusers-format Wan2.1 T2V directory (default: the built-in model; "
        "tiny-random: the tiny random-weight model)",
    )
    p.add_argument(
        "--transformer", default=None,
        help="a saved transformer folder (e.g. a fine-tuning checkpoint's transformer/) to use instead of the "
        "model's own; --variant defaults to the variant it was saved as",
    )  # fmt: skip
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="num_frames, of the form 4k+1")
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps")
    p.add_argument("--guidance", type=float, default=None, help="guidance_scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", default=None, help="MHLA block count FxHxW, e.g. 7x3x5 (default: fitted to the grid)")
    p.add_argument("--layers", default=None, help="MHLA layers of mhla-hybrid, e.g. '1,2,4-5'")
    p.add_argument(
        "--normalizer", choices=("on", "off"), default=None, help="linear-attention normalizer (default off)"
    )
    p.add_argument("--feature-map", choices=sorted(mhla.FEATURE_MAPS), default=None)
    p.add_argument("--output-norm", choices=("rms_head", "none"), default=None)
    p.add_argument("--output-gate", action="store_true", default=None)
    p.add_argument("--softmax-backend", choices=mhla.SOFTMAX_BACKENDS, default=None)
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default="auto")
    p.add_argument("--fps", type=int, default=16)
    p.add_argument("--gif", default=None, help="also write a GIF here")
    p.add_argument("--grid-png", default=None, help="also write a PNG with a grid of frames here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _variants(spec: str) -> list[str]:
    names = list(VARIANTS) if spec == "all" else [v.strip() for v in spec.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; expected one of {', '.join(VARIANTS)} (or 'all')")
    return names or ["mhla-hybrid"]


def _blocks_for(variant: str, blocks: str | None) -> str | None:
    # with several variants, --blocks goes to the MHLA ones; with --variant flash alone it is an error
    return blocks if variant in ("mhla", "mhla-hybrid") else None


def _out_path(out: str, variant: str, many: bool) -> Path:
    path = Path(out)
    return path.with_name(f"{path.stem}_{variant}{path.suffix}") if many else path


def _check_trained_blocks(variant: str, blocks: str | None, transformer_dir) -> None:
    """A fine-tuned MHLA transformer's mixing coefficients are M x M for its own block layout: another
    ``--blocks`` would need new ones, so it is refused before anything loads."""
    if variant not in ("mhla", "mhla-hybrid") or not blocks or transformer_dir is None:
        return
    from .loading import saved_transformer_config

    state = (saved_transformer_config(transformer_dir) or {}).get("self_attention")
    if not state or not state["parameters"]["mhla"]:
        return  # a softmax or linear transformer: converted afresh with the requested blocks
    trained = state["options"].get("blocks")
    if trained is not None and tuple(trained) != mhla.parse_blocks(blocks):
        m = math.prod(trained)
        raise ValueError(
            f"--blocks {blocks}: the {variant} transformer {str(transformer_dir)!r} was fine-tuned with "
            f"{'x'.join(map(str, trained))} blocks (its mixing coefficients are {m}x{m}); leave --blocks unset, "
            "or pass an unconverted (softmax) --transformer to convert it afresh with these blocks"
        )


def main(argv=None) -> int:
    from .builtin import TINY_RANDOM
    from .loading import (
        check_model_dir,
        load_components,
        load_transformer,
        model_num_layers,
        model_patch_size,
        model_settings,
        resolve_device,
        resolve_dtype,
        saved_transformer_config,
    )
    from .video import check_output_path, write_frame_grid, write_gif, write_mp4

    args = _parse_args(argv)
    try:
        # everything cheap is checked before any model is loaded
        if args.transformer:
            saved = saved_transformer_config(args.transformer)
            if saved is None:
                raise FileNotFoundError(
                    f"--transformer {args.transformer!r} has no config.json; expected a folder written by "
                    "save_transformer (e.g. runs/<run>/checkpoints/step-XXXXXXX/transformer)"
                )
            if args.variant is None:
                args.variant = (saved.get("self_attention") or {"variant": "flash"})["variant"]
        args.variant = args.variant or "mhla-hybrid"
        variants = _variants(args.variant)
        if args.model and args.model != TINY_RANDOM:
            check_model_dir(args.model)
        defaults, _, variant_dirs = model_settings(args.model)
        request = dict(
            height=defaults["height"] if args.height is None else args.height,
            width=defaults["width"] if args.width is None else args.width,
            num_frames=defaults["num_frames"] if args.frames is None else args.frames,
            num_inference_steps=defaults["num_inference_steps"] if args.steps is None else args.steps,
            guidance_scale=defaults["guidance_scale"] if args.guidance is None else args.guidance,
        )
        patch = model_patch_size(args.model, args.transformer)  # read from config files, nothing loaded yet
        for v in variants:
            validate_request(
                args.prompt, variant=v, blocks=_blocks_for(v, args.blocks), seed=args.seed, patch_size=patch, **request
            )
        if args.blocks and not any(v in ("mhla", "mhla-hybrid") for v in variants):
            raise ValueError(
                f"--blocks applies to the mhla and mhla-hybrid variants only, got --variant {args.variant}"
            )
        for v in variants:
            _check_trained_blocks(v, args.blocks, args.transformer or variant_dirs.get(v))
        if args.layers is not None and variants != ["mhla-hybrid"]:
            raise ValueError(f"--layers applies to --variant mhla-hybrid only, got --variant {args.variant}")
        layers = None
        if args.layers is not None:
            layers = parse_layers(args.layers, model_num_layers(args.model, args.transformer))
        overrides = {
            k: v
            for k, v in dict(
                normalize=None if args.normalizer is None else args.normalizer == "on",
                feature_map=args.feature_map,
                output_norm=args.output_norm,
                output_gate=args.output_gate,
                softmax_backend=args.softmax_backend,
            ).items()
            if v is not None
        }
        AttentionOptions(**overrides)  # validates the values
        if not str(args.out).lower().endswith(".mp4"):
            raise ValueError(f"--out must end in .mp4, got {args.out!r}")
        many = len(variants) > 1
        for v in variants:  # every file this run will write, before the model loads
            check_output_path(_out_path(args.out, v, many))
            if args.gif:
                check_output_path(_out_path(args.gif, v, many), (".gif",))
            if args.grid_png:
                check_output_path(_out_path(args.grid_png, v, many), (".png",))
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        components = load_components(args.model, dtype=dtype, device=device)
        loaded = load_transformer(args.transformer, dtype=dtype, device=device) if args.transformer else None
    except (ValueError, FileNotFoundError) as e:  # damaged weights or configs, named
        print(f"error: {e}", file=sys.stderr)
        return 2
    if loaded is not None:
        base = components.transformer.config
        keys = ("text_dim", "in_channels", "out_channels")
        if any(loaded.config[k] != base[k] for k in keys):
            print(
                f"error: --transformer {args.transformer!r} does not fit the model {components.source!r}: "
                + ", ".join(f"{k} {loaded.config[k]} vs {base[k]}" for k in keys)
                + "; pass the --model it was trained with (e.g. --model tiny-random)",
                file=sys.stderr,
            )
            return 2
        components.transformer = loaded
        components.source += f" + transformer {args.transformer}"
    print(f"model: {components.source}")
    if components.random_weights:
        print(f"NOTE: {RANDOM_WEIGHTS_NOTE}")
    timings = []
    for v in variants:
        transformer = None  # the base transformer, converted in place
        if not args.transformer and v in components.variant_dirs:  # the model ships a fine-tuned one
            transformer = load_transformer(components.variant_dirs[v], dtype=dtype, device=device)
            print(f"{v}: fine-tuned transformer {components.variant_dirs[v]}")
        try:
            result = generate(
                components,
                args.prompt,
                negative_prompt=args.negative_prompt,
                seed=args.seed,
                variant=v,
                layers=layers,
                blocks=_blocks_for(v, args.blocks),
                attention_options=overrides,
                transformer=transformer,
                show_progress=not args.no_progress,
                **request,
            )
        except NonFiniteLatentsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
        out = _out_path(args.out, v, many)
        comment = f"{v} | seed {args.seed} | {args.prompt}"
        if components.random_weights:
            comment = f"{RANDOM_WEIGHTS_NOTE} | {comment}"
        write_mp4(out, result.frames, fps=args.fps, comment=comment)
        written = [str(out)]
        if args.gif:
            written.append(str(write_gif(_out_path(args.gif, v, many), result.frames, fps=args.fps, comment=comment)))
        if args.grid_png:
            written.append(str(write_frame_grid(_out_path(args.grid_png, v, many), result.frames, comment=comment)))
        print(f"\nwrote {', '.join(written)}  ({len(result.frames)} frames, {request['height']}x{request['width']})")
        print(format_timing(result.timing))
        timings.append(result.timing)
    if len(timings) > 1:
        print("\n" + format_comparison(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The command line of :func:`pipelines.pipeline.generate`: text to video with a chosen self-attention variant.

    python -m pipelines.cli --prompt "a red square moves to the right" --variant mhla --out square.mp4

Without ``--model`` the built-in model runs (``assets/builtin``); ``--model tiny-random`` is the tiny
random-weight model (its video is noise, and says so). ``--model DIR`` runs the pipeline its ``model_index.json``
names: Wan2.1 / Wan2.2 text-to-video (``WanPipeline``: two experts for Wan2.2-A14B, ``--layers-2`` for the
second one's hybrid split), or image-to-video (``WanImageToVideoPipeline``, which needs ``--image``).
Everything cheap is checked before a model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mhla
from common.errors import check_seed, check_text, run_cli
from common.interleave import MAX_REPEATS
from mhla.checks import COMPILE_MODES

from .attention import (
    DEFAULT_VARIANT,
    LAYERS_VARIANTS,
    MHLA_VARIANTS,
    SOFTMAX,
    VARIANTS,
    AttentionOptions,
    check_lora_variant,
    check_transformer_variant,
    parse_layers,
    parse_variants,
    variant_spec,
)
from .caching import parse_cache

# the library's names, for code that imports them from here
from .pipeline import (  # noqa: F401
    RANDOM_WEIGHTS_NOTE,
    GenerationResult,
    NonFiniteLatentsError,
    generate,
    initial_noise,
    model_request,
)
from .request import (  # noqa: F401
    GenerationRequest,
    check_model_inputs,
    check_trained_blocks,
    latent_grid,
    validate_request,
)
from .run import RunPlan, run
from .scale import add_arguments as add_scale_arguments
from .scale import check_scale

if TYPE_CHECKING:
    from .loading import WanComponents


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.cli",
        description="Wan2.1 text-to-video with softmax ('flash'), linear, MHLA or hybrid MHLA self-attention.",
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default="")
    p.add_argument(
        "--variant",
        default=None,
        help=f"one of {', '.join(VARIANTS)}; a comma list or 'all' generates each (out file gets a _VARIANT suffix); "
        "default: mhla-hybrid, or the saved variant of --transformer",
    )
    p.add_argument("--out", default="out.mp4", help="mp4 to write")
    p.add_argument(
        "--model",
        default=None,
        help="local diffusers-format Wan directory: Wan2.1 / Wan2.2 T2V, TI2V or I2V (default: the built-in model; "
        "tiny-random: the tiny random-weight model)",
    )
    p.add_argument(
        "--image",
        default=None,
        help="the first frame (PNG, JPEG, ...): required by an image-to-video model, also taken by Wan2.2-TI2V; "
        "scaled and centre-cropped to the video's size",
    )
    p.add_argument(
        "--transformer",
        default=None,
        help="a saved transformer folder (e.g. a fine-tuning checkpoint's transformer/) to use instead of the "
        "model's own; --variant defaults to the variant it was saved as",
    )
    p.add_argument(
        "--lora",
        default=None,
        help="LoRA adapters to merge into the transformer: a fine-tuning run's final/lora (train.trainable=lora), "
        "or a diffusers Wan LoRA .safetensors file; --variant defaults to the variant it was trained as",
    )
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument(
        "--frames",
        type=int,
        default=None,
        help="num_frames, of the form sk+1 for the VAE's temporal stride s (Wan: 4k+1)",
    )
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps")
    p.add_argument("--guidance", type=float, default=None, help="guidance_scale")
    p.add_argument(
        "--guidance-max-sigma",
        type=float,
        default=None,
        help="guide only the denoising steps whose noise level sigma is at most this, in [0, 1] "
        "(default: the model's; 1 = every step, as WanPipeline)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help=f"timed runs per variant, 1 to {MAX_REPEATS} (as the app's Repeats): more paired steps, a narrower "
        "interval for each speedup vs flash",
    )
    p.add_argument("--blocks", default=None, help="MHLA block count FxHxW, e.g. 7x3x5 (default: fitted to the grid)")
    p.add_argument("--layers", default=None, help="MHLA layers of mhla-hybrid, e.g. '1,2,4-5'")
    p.add_argument(
        "--layers-2",
        default=None,
        help="MHLA layers of mhla-hybrid in the second expert of a two-expert model (Wan2.2-A14B's transformer_2); "
        "default: its own split, else all but 0,3,6,...",
    )
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
    p.add_argument(
        "--frames-npy",
        default=None,
        help="also write the decoded frames here as a float32 .npy array (frames, height, width, 3) in [0, 1]",
    )
    add_speed_arguments(p)  # --cache, --compile (the app's too)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    add_scale_arguments(p)  # --offload, --vae-tiling, --context-parallel, --cp-degree (pipelines/scale.py)
    return p.parse_args(argv)


def add_speed_arguments(p: argparse.ArgumentParser) -> None:
    """``--cache`` and ``--compile``, as this CLI and the app (``run_app.py``) take them: a bad value is refused
    by argparse with a message naming it (``parse_cache`` and the choices)."""
    p.add_argument(
        "--cache",
        type=parse_cache,
        default=None,
        help="diffusers' step cache on the transformer (any variant): none, first-block[:THRESHOLD] "
        "(FirstBlockCache, default 0.05), mag-calibrate, mag:THRESHOLD:RATIOS.json (MagCache); skipped steps "
        "reuse cached residuals: faster, approximate",
    )
    p.add_argument(
        "--compile",
        choices=("none", *COMPILE_MODES),
        default="none",
        help="torch.compile the transformer (the attention kernels as custom ops): its repeated blocks (one "
        "compile for all layers) or the whole forward; the first step of each variant includes the compile",
    )


def _preflight(args: argparse.Namespace) -> RunPlan:
    """Checks everything that needs no model (config files are read, no weights); raises ValueError or
    FileNotFoundError naming the bad value. Returns the plan every later stage is handed."""
    from common.video import check_fps, check_output_path, read_image
    from mhla.softmax import check_backend

    from .devices import resolve_device, resolve_dtype
    from .lora import check_lora_fits, read_lora
    from .memory import check_offload
    from .model_dir import ModelDir, check_transformer_config

    # each file is asked once, in this order: the values alone (text, seed, repeats, the device and dtype, the
    # softmax backend, the offload mode), the model's files, the LoRA, the variant table, the requests, the image
    # and the output files, the processes
    check_text(args.prompt, "--prompt")
    check_text(args.negative_prompt, "--negative-prompt")
    check_seed(args.seed)
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise ValueError(f"--repeats {args.repeats}: expected timed runs per variant from 1 to {MAX_REPEATS}")
    if not str(args.out).lower().endswith(".mp4"):
        raise ValueError(f"--out must end in .mp4, got {args.out!r}")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.softmax_backend is not None:  # a kernel this device lacks would fail at the first softmax layer
        check_backend(args.softmax_backend, device.type, "--softmax-backend")
    check_offload(args.offload, device)

    folder = ModelDir(args.model)  # what the model's files say, each read once
    saved = folder.transformer_config(args.transformer) if args.transformer else None
    if args.transformer:
        if saved is None:
            raise FileNotFoundError(
                f"--transformer {args.transformer!r} has no config.json; expected a folder written by "
                "save_transformer (e.g. runs/<run>/checkpoints/step-XXXXXXX/transformer)"
            )
        check_transformer_config(saved, Path(args.transformer) / "config.json", "--transformer")
    if not folder.tiny_random:
        folder.check()
    shape, defaults, index, stride = folder.shape(args.transformer), folder.defaults, folder.index, folder.vae_stride
    experts_2 = folder.shape(part="transformer_2").num_layers if args.layers_2 is not None else None
    trained = {name: folder.transformer_config(d) for name, d in folder.variant_dirs.items()}
    # the transformer a --lora adapts: --transformer's, else the model's own
    lora_target = (saved if args.transformer else folder.transformer_config()) if args.lora else None

    lora = read_lora(args.lora, "--lora") if args.lora else None  # a folder or file load_lora_weights reads
    if lora is not None:
        if lora.info.get("expert") == "transformer_2":
            raise ValueError(
                f"--lora {args.lora!r} adapts a two-expert model's low-noise expert (transformer_2); this command "
                "merges a LoRA into the first one: expected a LoRA of the transformer (diffusers loads it with "
                "load_lora_weights(..., load_into_transformer_2=True))"
            )
        if lora_target and all(k in lora_target for k in ("num_layers", "num_attention_heads", "attention_head_dim")):
            check_lora_fits(lora, lora_target, "--lora")  # its layers and attention width

    if args.transformer:  # its own variant where none is named
        own = ((saved or {}).get("self_attention") or {"variant": SOFTMAX})["variant"]
        args.variant = args.variant or own
        check_transformer_variant(args.transformer, own, args.variant)
        trained = dict.fromkeys(VARIANTS, saved)
    trained_dirs: dict[str, str | Path | None] = {
        name: args.transformer or folder.variant_dirs.get(name) for name in VARIANTS
    }
    if lora is not None and lora.attention_state is not None:  # trained as this variant, with these blocks
        args.variant = args.variant or lora.variant
        check_lora_variant(args.lora, lora.variant, args.variant)
        trained = dict.fromkeys(VARIANTS, {"self_attention": lora.attention_state})
        trained_dirs = dict.fromkeys(VARIANTS, lora.file)
    elif lora is not None and not args.transformer:
        args.variant = args.variant or lora.variant
    variants = parse_variants(args.variant or DEFAULT_VARIANT)
    takes_blocks = {v: variant_spec(v).blocks for v in variants}
    if args.blocks and not any(takes_blocks.values()):
        raise ValueError(
            f"--blocks applies to the {' and '.join(MHLA_VARIANTS)} variants only, got --variant {args.variant}"
        )
    takes_layers = len(variants) == 1 and variant_spec(variants[0]).layers
    if args.layers is not None and not takes_layers:
        raise ValueError(
            f"--layers applies to --variant {' or '.join(LAYERS_VARIANTS)} only, got --variant {args.variant}"
        )
    if args.layers_2 is not None and not takes_layers:
        raise ValueError(
            f"--layers-2 applies to --variant {' or '.join(LAYERS_VARIANTS)} only, got --variant {args.variant}"
        )
    layers = None if args.layers is None else parse_layers(args.layers, shape.num_layers)
    layers_2 = None
    if args.layers_2 is not None and experts_2 is not None:
        try:
            layers_2 = parse_layers(args.layers_2, experts_2)
        except ValueError as e:
            raise ValueError(f"--layers-2 {args.layers_2!r} (the second expert's): {e}") from None
    overrides = dict(
        normalize=None if args.normalizer is None else args.normalizer == "on",
        feature_map=args.feature_map,
        output_norm=args.output_norm,
        output_gate=args.output_gate,
        softmax_backend=args.softmax_backend,
    )
    overrides = {k: v for k, v in overrides.items() if v is not None}
    AttentionOptions(**overrides)  # validates the values

    model_name = f"model {args.model!r}" if args.model else "the built-in model"
    # --image and --layers-2 against the model, before the image file is read
    check_model_inputs(
        GenerationRequest(args.prompt, image=args.image, layers_2=args.layers_2),
        index,
        model_name,
        image="--image",
        layers_2="--layers-2",
    )
    requests = []
    for v in variants:
        request = GenerationRequest(
            prompt=args.prompt,
            negative_prompt=args.negative_prompt,
            height=args.height,
            width=args.width,
            num_frames=args.frames,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            guidance_max_sigma=args.guidance_max_sigma,
            seed=args.seed,
            variant=v,
            blocks=args.blocks if takes_blocks[v] else None,  # with several variants, the MHLA ones take it
            layers=layers,
            layers_2=layers_2,
        ).with_defaults(defaults)
        request = request.check(shape.patch, stride)  # the image joins it once read (read_image checks it)
        check_trained_blocks(request, trained_dirs[v], trained.get(v))
        requests.append(request)

    image = read_image(args.image, f"--image {args.image!r}") if args.image is not None else None
    try:
        check_fps(args.fps)
    except ValueError:
        raise ValueError(f"--fps {args.fps}: expected a frame rate > 0 (e.g. 16)") from None
    many = len(variants) > 1

    def named(out: str, v: str) -> Path:  # one file per variant: the variant's name before the suffix
        path = Path(out)
        return path.with_name(f"{path.stem}_{v}{path.suffix}") if many else path

    wanted: list[tuple[str | None, tuple[str, ...] | None]] = [
        (args.out, None),
        (args.gif, (".gif",)),
        (args.grid_png, (".png",)),
        (args.frames_npy, (".npy",)),
    ]
    # every file this run will write, per variant: (mp4, gif, grid png, npy), each checked (None: not asked for)
    files = [
        [check_output_path(named(out, v), suffixes) if out else None for out, suffixes in wanted] for v in variants
    ]
    outputs = [(cast(Path, mp4), gif, png) for mp4, gif, png, _ in files]
    frames_npy = [cast(Path, npy) for *_, npy in files] if args.frames_npy else None
    if image is not None:
        requests = [replace(r, image=image) for r in requests]

    scale = check_scale(args, requests, device, shape.num_heads)
    device = scale.run_device(device)
    fine_tuned = {} if args.transformer or args.lora else folder.variant_dirs
    return RunPlan(
        requests,
        outputs,
        overrides,
        device,
        dtype,
        load_device=scale.load_device(device),
        scale=scale,
        frames_npy=frames_npy,
        folder=folder,
        transformer=args.transformer,
        transformer_config=saved,
        lora=lora,
        lora_name=args.lora,
        fine_tuned=fine_tuned,
        repeats=args.repeats,
        fps=args.fps,
        compile=args.compile,
        cache=args.cache,
        show_progress=not args.no_progress,
    )


def _load(plan: RunPlan) -> WanComponents:
    """The model's components as ``plan`` asks: its own, or ``--transformer``'s in its place (ValueError when it
    does not fit), ``--lora`` merged; on the plan's load device (the CPU when offloaded)."""
    from .loading import load_components

    return load_components(
        plan.folder,
        dtype=plan.dtype,
        device=plan.load_device,
        transformer=plan.transformer,
        transformer_config=plan.transformer_config,
        lora=plan.lora,
        lora_name=plan.lora_name,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    return run_cli(_main, argv, prog="pipelines.cli")


def _main(argv: Sequence[str]) -> int:
    args = _parse_args(argv)
    plan = _preflight(args)  # bad input: named before any model loads
    plan.scale.start(plan.device)  # context parallelism: this process joins the others (torchrun)
    try:
        components = _load(plan)
        attached = plan.scale.attach(components, plan.device)  # offload hooks, VAE tiling: once
        say = print if plan.scale.main else _quiet  # only process 0 prints and writes files
        say(f"model: {components.source} ({components.index.describe()})")
        if attached:
            say(attached)
        if components.random_weights:
            say(f"NOTE: {RANDOM_WEIGHTS_NOTE}")
        if plan.cache is not None:
            say(f"cache: {plan.cache.describe()}")
        if plan.compile != "none":
            say(f"torch.compile: {plan.compile}")
        return run(plan, components, say)
    finally:
        plan.scale.close()


def _quiet(*_args: Any, **_kwargs: Any) -> None:
    """print() of the processes other than 0 under context parallelism."""


if __name__ == "__main__":
    if "WORLD_SIZE" not in os.environ:  # torchrun's processes share the cores as it set them
        from common.threads import enable_auto

        enable_auto()  # torch's threads: the cores other work leaves, unless OMP_NUM_THREADS is set
    code = main()
    if "WORLD_SIZE" in os.environ:  # started by torchrun: gloo's threads may abort the teardown of a finished run
        from pipelines.context_parallel import exit_process

        exit_process(code)
    sys.exit(code)

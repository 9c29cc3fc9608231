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
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mhla
from common.errors import ModelError, check_seed, check_text, run_cli
from common.interleave import MAX_REPEATS, StepClock, format_paired_comparison, take_turns
from common.timing import Timing, format_timing
from mhla.checks import COMPILE_MODES

from .attention import (
    DEFAULT_VARIANT,
    LAYERS_VARIANTS,
    MHLA_VARIANTS,
    SOFTMAX,
    VARIANTS,
    AttentionOptions,
    parse_layers,
    parse_variants,
    variant_spec,
)
from .caching import cached, parse_cache

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
from .scale import Scale, check_scale
from .scale import add_arguments as add_scale_arguments

if TYPE_CHECKING:
    import torch

    from .loading import WanComponents
    from .lora import LoraAdapters
    from .model_dir import ModelDir


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


def _out_path(out: str, variant: str, many: bool) -> Path:
    path = Path(out)
    return path.with_name(f"{path.stem}_{variant}{path.suffix}") if many else path


@dataclass
class _Plan:
    """What a command line asks for, checked before any model loads."""

    requests: list[GenerationRequest]
    outputs: list[tuple[Path, Path | None, Path | None]]  # (mp4, gif, grid png) per request
    overrides: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    scale: Scale | None = None  # offload, VAE tiling, context parallelism (pipelines/scale.py)
    frames_npy: list[Path] | None = None  # per request, with --frames-npy
    lora: LoraAdapters | None = None  # --lora, read and checked
    folder: ModelDir | None = None  # the model's files as read (once) and checked: loading reads none again


def _preflight(args: argparse.Namespace) -> _Plan:
    """Checks everything that needs no model (config files are read, no weights); raises ValueError or
    FileNotFoundError naming the bad value."""
    from common.video import check_fps, check_output_path, read_image

    from .loading import resolve_device, resolve_dtype
    from .model_dir import ModelDir, check_transformer_config

    # each file is asked once, in this order: the values alone, the model's files, the variant table, the
    # request's checks, the image, the output paths, the device
    check_text(args.prompt, "--prompt")
    check_text(args.negative_prompt, "--negative-prompt")
    check_seed(args.seed)
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise ValueError(f"--repeats {args.repeats}: expected timed runs per variant from 1 to {MAX_REPEATS}")
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
    if args.transformer:  # its own variant where none is named
        own = ((saved or {}).get("self_attention") or {"variant": SOFTMAX})["variant"]
        args.variant = args.variant or own
        check_transformer_variant(args.transformer, own, args.variant)
        trained = dict.fromkeys(VARIANTS, saved)
    trained_dirs: dict[str, str | Path | None] = {
        name: args.transformer or folder.variant_dirs.get(name) for name in VARIANTS
    }
    lora = _check_lora(args, folder) if args.lora else None
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
    names = dict(image="--image", layers_2="--layers-2")
    # --image and --layers-2 against the model, before the image file is read (the request is checked again below)
    check_model_inputs(
        GenerationRequest(args.prompt, image=args.image, layers_2=args.layers_2), index, model_name, **names
    )
    image = read_image(args.image, f"--image {args.image!r}") if args.image is not None else None
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
            image=image,
        ).with_defaults(defaults)
        request = request.check(shape.patch, stride)
        check_model_inputs(request, index, model_name, **names)
        check_trained_blocks(request, trained_dirs[v], trained.get(v))
        requests.append(request)

    if not str(args.out).lower().endswith(".mp4"):
        raise ValueError(f"--out must end in .mp4, got {args.out!r}")
    many = len(variants) > 1
    paths = [
        (
            _out_path(args.out, v, many),
            _out_path(args.gif, v, many) if args.gif else None,
            _out_path(args.grid_png, v, many) if args.grid_png else None,
            _out_path(args.frames_npy, v, many) if args.frames_npy else None,
        )
        for v in variants
    ]
    try:
        check_fps(args.fps)
    except ValueError:
        raise ValueError(f"--fps {args.fps}: expected a frame rate > 0 (e.g. 16)") from None
    outputs = [  # every file this run will write
        (
            check_output_path(mp4),
            check_output_path(gif, (".gif",)) if gif else None,
            check_output_path(png, (".png",)) if png else None,
        )
        for mp4, gif, png, _ in paths
    ]
    frames_npy = [check_output_path(npy, (".npy",)) for *_, npy in paths if npy is not None] or None
    device = resolve_device(args.device)
    scale = check_scale(args, requests, device, shape.num_heads)
    device = scale.run_device(device)
    if args.softmax_backend is not None:  # a kernel this device lacks would fail at the first softmax layer
        from mhla.softmax import check_backend

        check_backend(args.softmax_backend, device.type, "--softmax-backend")
    dtype = resolve_dtype(args.dtype, device)
    return _Plan(requests, outputs, overrides, device, dtype, scale, frames_npy, lora, folder)


def _check_lora(args: argparse.Namespace, folder: Any) -> LoraAdapters:
    """``--lora`` read (a folder or file diffusers' ``load_lora_weights`` reads) and checked against the
    transformer's config (its layers and attention width) where the model has one."""
    from .lora import check_lora_fits, read_lora

    lora = read_lora(args.lora, "--lora")
    if lora.info.get("expert") == "transformer_2":
        raise ValueError(
            f"--lora {args.lora!r} adapts a two-expert model's low-noise expert (transformer_2); this command merges "
            "a LoRA into the first one: expected a LoRA of the transformer (diffusers loads it with "
            "load_lora_weights(..., load_into_transformer_2=True))"
        )
    config = folder.transformer_config(args.transformer) if args.transformer else folder.transformer_config()
    if config and all(k in config for k in ("num_layers", "num_attention_heads", "attention_head_dim")):
        check_lora_fits(lora, config, "--lora")
    return lora


def check_lora_variant(lora: str, own: str, spec: str) -> None:
    """A LoRA trained with a converted variant's own attention parameters (MHLA, linear) runs as that variant
    only, as a ``--transformer`` fine-tuned as it does (:func:`check_transformer_variant`)."""
    others = [v for v in parse_variants(spec) if v != own]
    if others:
        raise ValueError(
            f"--variant {spec}: --lora {lora!r} was trained as variant {own!r} with its own attention parameters; "
            f"running it as {', '.join(others)} would put other attention on them. Expected --variant {own} "
            "(or no --variant)"
        )


def check_transformer_variant(transformer: str, own: str, spec: str) -> None:
    """A ``--transformer`` fine-tuned as a converted variant (MHLA, linear, hybrid: its attention weights were
    trained for that attention, and its own parameters belong to it) runs as that variant only: another one would
    silently run other attention on its weights, so it is refused naming the checkpoint's variant. A softmax
    (``flash``) transformer serves every variant (it is converted afresh)."""
    if own == SOFTMAX:
        return
    others = [v for v in parse_variants(spec) if v != own]
    if others:
        raise ValueError(
            f"--variant {spec}: --transformer {transformer!r} was fine-tuned as variant {own!r} (its "
            f"attention weights were trained for {own}); running it as {', '.join(others)} would put other "
            f"attention on them. Expected --variant {own} (or no --variant), or a softmax (flash) --transformer to "
            "convert afresh"
        )


def _load(args: argparse.Namespace, plan: _Plan) -> WanComponents:
    """The model's components, with ``--transformer`` in place of its own; raises ValueError when it does
    not fit."""
    from .loading import load_components, load_transformer

    device = plan.scale.load_device(plan.device) if plan.scale else plan.device  # the CPU when offloaded
    components = load_components(plan.folder or args.model, dtype=plan.dtype, device=device)
    if args.transformer:
        loaded = load_transformer(args.transformer, dtype=plan.dtype, device=device)
        base = components.transformer.config
        keys = ("text_dim", "in_channels", "out_channels")
        if any(loaded.config[k] != base[k] for k in keys):
            raise ValueError(
                f"--transformer {args.transformer!r} does not fit the model {components.source!r}: "
                + ", ".join(f"{k} {loaded.config[k]} vs {base[k]}" for k in keys)
                + "; pass the --model it was trained with (e.g. --model tiny-random)"
            )
        components.transformer = loaded
        components.source += f" + transformer {args.transformer}"
    if plan.lora is not None:
        from .lora import apply_lora

        apply_lora(components.transformer, plan.lora, "--lora")  # merged: it then runs as without a LoRA
        components.source += f" + LoRA {args.lora} ({plan.lora.describe()})"
    return components


def main(argv: Sequence[str] | None = None) -> int:
    """The command, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    return run_cli(_main, argv, prog="pipelines.cli")


def _main(argv: Sequence[str]) -> int:
    args = _parse_args(argv)
    plan = _preflight(args)  # bad input: named before any model loads
    scale = plan.scale or Scale()
    scale.start(plan.device)  # context parallelism: this process joins the others (torchrun)
    try:
        return _run(args, plan, scale)
    finally:
        scale.close()


def _run(args: argparse.Namespace, plan: _Plan, scale: Scale) -> int:
    say = print if scale.main else _quiet  # only process 0 prints and writes files
    components = _load(args, plan)
    scale.attach(components, plan.device)  # offload hooks and VAE tiling, once
    say(f"model: {components.source} ({components.index.describe()})")
    if scale.describe():
        say(scale.describe())
    if components.random_weights:
        say(f"NOTE: {RANDOM_WEIGHTS_NOTE}")
    if args.cache is not None:
        say(f"cache: {args.cache.describe()}")
    if args.compile != "none":
        say(f"torch.compile: {args.compile}")
    if len(plan.requests) > 1:
        return _run_in_turns(args, plan, scale, components, say)
    request, outputs = plan.requests[0], plan.outputs[0]
    transformer = _fine_tuned(args, plan, scale, components, request.variant, say)
    runs = [
        _generate_once(
            args, plan, scale, components, request, transformer, None, not args.no_progress and scale.main, drop=last
        )
        for last in [False] * (args.repeats - 1) + [True]
    ]
    if scale.main:
        _report(args, plan, 0, request, outputs, runs[-1], components)
        if len(runs) > 1:
            steps = [s for r in runs for s in r.timing.warm_steps]
            print(
                f"step over {len(runs)} runs: {statistics.median(steps):.3f} s (median of {len(steps)} steps, each "
                "run's first left out)"
            )
    return 0


def _fine_tuned(
    args: argparse.Namespace, plan: _Plan, scale: Scale, components: WanComponents, variant: str, say: Any
) -> Any:
    """The fine-tuned transformer the model ships for ``variant`` (the built-in model's ``variants/``), loaded;
    None where the variant runs on the base transformer, converted in place (a ``--transformer`` or a ``--lora``
    runs as given)."""
    from .loading import load_transformer

    if args.transformer or args.lora or variant not in components.variant_dirs:
        return None
    transformer = load_transformer(
        components.variant_dirs[variant], dtype=plan.dtype, device=scale.load_device(plan.device)
    )
    say(f"{variant}: fine-tuned transformer {components.variant_dirs[variant]}")
    return transformer


def _generate_once(
    args: argparse.Namespace,
    plan: _Plan,
    scale: Scale,
    components: WanComponents,
    request: GenerationRequest,
    transformer: Any,
    transformer_2: Any,
    show_progress: bool,
    drop: bool = True,
) -> GenerationResult:
    """One generation of ``request`` on ``transformer`` (None: the base one, converted in place) and
    ``transformer_2`` (None: the model's second expert, if any), with the command line's scale, compile and cache;
    ``drop``: a loaded ``transformer`` is unhooked after it (its last run)."""
    running = components.transformer if transformer is None else transformer
    scale.before_run(components, request, running, plan.overrides)  # converted under the hooks; parallel
    if args.compile != "none":
        from mhla.compiled import compile_transformer

        compile_transformer(running, args.compile)
    try:
        with cached(running, args.cache, request.num_inference_steps or 1):  # validated: an int
            return generate(
                components,
                request,
                attention_options=plan.overrides,
                transformer=transformer,
                transformer_2=transformer_2,
                show_progress=show_progress,
            )
    except NonFiniteLatentsError as e:
        raise ModelError(str(e)) from e
    finally:
        scale.after_run(running, drop=drop and transformer is not None)


def _report(
    args: argparse.Namespace,
    plan: _Plan,
    i: int,
    request: GenerationRequest,
    outputs: tuple[Path, Path | None, Path | None],
    result: GenerationResult,
    components: WanComponents,
    timing: Timing | None = None,
) -> None:
    """Writes request ``i``'s files (each atomically and checked: a failed writer raises, and nothing says
    "wrote") and prints them with the run's timing table (``timing``, default the result's: with the variants in
    turns, the clock's, which leaves out the waits for the turn)."""
    from common.video import write_frame_grid, write_gif, write_mp4

    mp4, gif, png = outputs
    comment = f"{request.variant} | seed {request.seed} | {request.prompt}"
    if components.random_weights:
        comment = f"{RANDOM_WEIGHTS_NOTE} | {comment}"
    written = [str(write_mp4(mp4, result.frames, fps=args.fps, comment=comment))]
    if gif:
        written.append(str(write_gif(gif, result.frames, fps=args.fps, comment=comment)))
    if png:
        written.append(str(write_frame_grid(png, result.frames, comment=comment)))
    if plan.frames_npy:
        written.append(str(_write_npy(plan.frames_npy[i], result.frames)))
    print(
        f"\nwrote {', '.join(written)}  ({len(result.frames)} frames, {request.height}x{request.width}, "
        f"{result.pipeline_class})"
    )
    print(format_timing(result.timing if timing is None else timing))


# at most this share of the free memory goes to a transformer per variant (the rest: activations, the VAE)
COPY_SHARE = 0.5


def _module_bytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device``: the GPU's free memory, the CPU's MemAvailable (None: unknown)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_transformers(
    args: argparse.Namespace, plan: _Plan, scale: Scale, components: WanComponents, say: Any
) -> dict[str, tuple[Any, Any]] | None:
    """Each variant's own transformers ``(transformer, transformer_2)``, so that the variants can take turns
    step by step (a transformer is converted in place to its variant: two variants cannot share one while both
    run): the model's fine-tuned ones loaded, the others deep copies of the base (which itself runs the last
    variant that uses it). None, said why, when they cannot: offloading or context parallelism (their hooks
    hold one transformer), or too little free memory for the copies (:data:`COPY_SHARE` of it)."""
    import copy

    names = [r.variant for r in plan.requests]
    if scale.offload != "none" or scale.context_parallel:
        say(
            "the variants run one after another (--offload and --context-parallel hold one transformer at a time): "
            "a change of machine load between them shows up as a speedup"
        )
        return None
    experts = [t for t in (components.transformer, components.transformer_2) if t is not None]
    need = (len(names) - 1) * sum(_module_bytes(t) for t in experts)
    free = _free_bytes(plan.device)
    if free is None or need > COPY_SHARE * free:
        free_text = "an unknown amount" if free is None else f"{free / 2**30:.1f} GiB"
        say(
            f"the variants run one after another: a transformer per variant needs {need / 2**30:.1f} GiB more and "
            f"{free_text} is free (at most {COPY_SHARE:.0%} of it goes to them), so a change of machine load between "
            "them shows up as a speedup"
        )
        return None
    fine_tuned = {v: _fine_tuned(args, plan, scale, components, v, say) for v in names}
    base_users = [v for v in names if fine_tuned[v] is None]
    second = components.transformer_2
    own: dict[str, tuple[Any, Any]] = {}
    for v in names:
        last = v == names[-1]  # the model's own second expert runs the last variant (the others: copies)
        t2 = None if second is None or last else copy.deepcopy(second)
        if fine_tuned[v] is not None:
            own[v] = (fine_tuned[v], t2)
        elif v == base_users[-1]:  # the base transformer itself, converted in place as a single run does
            own[v] = (None, t2)
        else:
            own[v] = (copy.deepcopy(components.transformer), t2)
    return own


def _run_in_turns(args: argparse.Namespace, plan: _Plan, scale: Scale, components: WanComponents, say: Any) -> int:
    """Several variants, timed by the app's rule (:mod:`common.interleave`): they take turns one denoising step
    each, round-robin, each on its own transformer (:func:`_own_transformers`), so a change of machine load hits
    all of them alike; ``--repeats`` runs each that many times; the table pairs step ``k`` of each variant with
    flash's step ``k`` and reports the median ratio with its 95% interval, "noisy" past +-10%. Each variant's
    files are written in its turn as it finishes; a variant that fails does not stop the others (its error is
    raised once they are done)."""
    import time

    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    names = [r.variant for r in plan.requests]
    own = _own_transformers(args, plan, scale, components, say)
    interleaved = own is not None
    first = plan.requests[0]
    per_step = 2 if (first.guidance_scale or 0.0) > 1.0 else 1  # WanPipeline: conditional and unconditional calls
    steps = first.num_inference_steps or 1
    loaded: dict[str, tuple[Any, Any]] = {}

    def modules_of(name: str) -> list[Any]:
        # interleaved: the variant's own; else loaded now, in its turn (one fine-tuned transformer at a time)
        loaded[name] = own[name] if own is not None else (_fine_tuned(args, plan, scale, components, name, say), None)
        t, t2 = loaded[name]
        second = components.transformer_2 if t2 is None else t2
        return [components.transformer if t is None else t] + ([] if second is None else [second])

    def work(name: str, clock: StepClock) -> tuple[GenerationResult, list[Timing]]:
        i = names.index(name)
        t, t2 = loaded[name]
        timings = []
        for r in range(args.repeats):
            clock.check()
            clock.begin()
            start = time.perf_counter()
            result = _generate_once(
                args, plan, scale, components, plan.requests[i], t, t2, False, drop=r == args.repeats - 1
            )
            timings.append(clock.timing(result.timing, start, time.perf_counter()))
        if scale.main:  # in this variant's turn: writing never competes with another variant's step
            bar.clear()
            _report(args, plan, i, plan.requests[i], plan.outputs[i], result, components, timings[-1])
        return result, timings

    bar = tqdm(
        total=len(names) * args.repeats * steps,
        desc="denoising, the variants in turns" if interleaved else "denoising, one variant after another",
        unit="step",
        disable=args.no_progress or not scale.main,
        leave=False,
    )
    timings: dict[str, list[Timing]] = {}
    errors: list[BaseException] = []
    try:
        for outcome in take_turns(
            names,
            modules_of,
            work,
            per_step,
            interleaved,
            on_step=lambda _n, _k, finished: bar.update(1) if finished else None,
            device=plan.device,
            thread_name="variant",
        ):
            if outcome.error is not None:
                errors.append(outcome.error)
            else:
                timings[outcome.name] = outcome.value[1]
    finally:
        bar.close()
    if len(timings) > 1:
        say("\n" + format_paired_comparison({n: timings[n] for n in names if n in timings}, interleaved, args.repeats))
    if errors:
        raise errors[0]
    return 0


def _quiet(*_args: Any, **_kwargs: Any) -> None:
    """print() of the processes other than 0 under context parallelism."""


def _write_npy(path: Path, frames: Any) -> Path:
    """``frames`` as a float32 .npy array, written atomically."""
    import numpy as np

    from common.outputs import atomic_write

    with atomic_write(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(frames, dtype=np.float32))
    return path


if __name__ == "__main__":
    code = main()
    if "WORLD_SIZE" in os.environ:  # started by torchrun: gloo's threads may abort the teardown of a finished run
        from pipelines.context_parallel import exit_process

        exit_process(code)
    sys.exit(code)

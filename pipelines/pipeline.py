"""``generate()``: one video from a prompt with a chosen self-attention variant, timed stage by stage.

The command line is :mod:`pipelines.cli`; the app and the training recipe's validation videos call
:func:`generate` directly.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

import mhla
from common.timing import Timing, sync
from mhla.mixing import reuse_constrained_mixing

from .attention import LAYERS_VARIANTS, AttentionOptions
from .request import GenerationRequest, check_model_inputs

if TYPE_CHECKING:
    from .loading import WanComponents
    from .model import MHLAWanTransformer3DModel

RANDOM_WEIGHTS_NOTE = (
    "tiny random-weight model (tiny-random) with RANDOM weights: this video is noise, made to test the plumbing"
)


# the text length Wan's cross-attention assumes when the image encoder's tokens come first (Wan2.1-I2V:
# diffusers' WanAttnProcessor takes all but the last 512 tokens as the image's)
WAN_TEXT_LENGTH = 512


class NonFiniteLatentsError(FloatingPointError):
    """The denoising produced NaN or inf latents: there is no video to write."""


@dataclass
class GenerationResult:
    """Output of :func:`generate`.

    ``frames``: for ``output_type="np"`` a float32 array ``(num_frames, height, width, 3)`` in [0, 1];
    ``"pil"`` a list of images; ``"pt"`` a tensor ``(num_frames, 3, height, width)``; ``"latent"`` the latents
    ``(1, C, F, height/s, width/s)`` (C: the VAE's latent channels, 16 or 48; s: its spatial stride, 8 or 16).
    ``initial_noise`` is the starting latent (same seed -> same noise). ``pipeline_class``: the diffusers
    pipeline that ran (``WanPipeline`` or ``WanImageToVideoPipeline``).
    """

    frames: Any  # by output_type, as above
    timing: Timing
    prompt: str
    seed: int
    initial_noise: torch.Tensor
    random_weights: bool
    pipeline_class: str = "WanPipeline"


def initial_noise(seed: int, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Starting latents from ``seed``: drawn on the CPU in float32 so every variant, dtype and device
    starts from bit-identical noise."""
    generator = torch.Generator("cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)


def model_request(
    components: WanComponents, request: GenerationRequest, transformer: MHLAWanTransformer3DModel | None = None
) -> GenerationRequest:
    """``request`` checked for this model: unset (None) sizes, steps and guidance take the model's defaults
    (``components.defaults``), then :meth:`GenerationRequest.check` against its patch (``transformer``'s, default
    ``components.transformer``) and VAE strides, and :func:`check_model_inputs` against its architecture (an
    image for an image-to-video model, none for a text-to-video one; ``layers_2`` for a second expert)."""
    transformer = components.transformer if transformer is None else transformer
    checked = request.with_defaults(components.defaults).check(
        tuple(transformer.config.patch_size), components.vae_stride
    )
    check_model_inputs(checked, components.index, f"model {components.source!r}")
    return checked


def _attention_options(
    transformer: MHLAWanTransformer3DModel,
    request: GenerationRequest,
    block_shape: tuple[int, int, int],
    overrides: dict[str, Any] | None,
) -> tuple[AttentionOptions, mhla.ResolvedBlocks | None]:
    """The options to convert with, and for an MHLA variant the block rule's answer on the request's grid
    (the model's ``resolve_blocks``: the request's blocks, else the model's own, else the default)."""
    options = transformer.conversion.options
    if overrides:
        options = options.replace(**overrides)
    if not request.uses_blocks:
        return options, None
    grid = cast(tuple[int, int, int], request.grid)  # generate() checks requests first
    resolved = transformer.resolve_blocks(grid, request.blocks, block_shape)
    return options.replace(blocks=resolved.blocks), resolved


def _hybrid_layers(
    transformer: MHLAWanTransformer3DModel, request: GenerationRequest, layers: list[int] | None
) -> list[int] | None:
    """The MHLA layers of mhla-hybrid: ``layers`` (the request's for this expert), else the model's own split
    (from its checkpoint, kept across switches to other variants), else None (the default split)."""
    if request.variant not in LAYERS_VARIANTS or layers is not None:
        return layers
    conversion = transformer.conversion
    if conversion.explicit_layers is not None:  # it runs a variant of an explicit layer list now
        return conversion.explicit_layers
    if 0 < len(conversion.parameters["mhla"]) < len(transformer.blocks):
        return list(conversion.parameters["mhla"])
    return None


def convert_for_request(
    components: WanComponents,
    transformer: MHLAWanTransformer3DModel,
    request: GenerationRequest,
    overrides: dict[str, Any] | None,
    layers: list[int] | None = None,
    name: str = "transformer",
) -> mhla.ResolvedBlocks | None:
    """Converts ``transformer`` in place to the request's variant (``layers``: mhla-hybrid's MHLA layers for
    this transformer); warns when that adds untrained parameters to a real (non-random) model. Returns the
    MHLA blocks it runs with (None for other variants)."""
    hybrid = _hybrid_layers(transformer, request, layers)
    options, resolved = _attention_options(transformer, request, components.block_shape, overrides)
    before = transformer.conversion.parameters
    transformer.convert(request.variant, hybrid, options)
    added = {k: sorted(set(v) - set(before[k])) for k, v in transformer.conversion.parameters.items()}
    if any(added.values()) and not components.random_weights:
        where = ", ".join(f"{kind} in layers {v}" for kind, v in added.items() if v)
        warnings.warn(
            f"variant {request.variant!r} added freshly initialised (untrained) attention parameters to {name} "
            f"({where}); "
            "a softmax-trained checkpoint needs fine-tuning before those layers make good videos",
            stacklevel=4,  # the caller of generate(), past torch.no_grad's wrapper
        )
    return resolved


def _guided_steps(scheduler: Any, request: GenerationRequest) -> list[bool]:
    """Per denoising step, whether classifier-free guidance applies: every step without a
    ``guidance_max_sigma`` (or without guidance), else the steps whose sigma is at most it."""
    steps = cast(int, request.num_inference_steps)  # a checked request has its sizes, steps and guidance
    if request.guidance_max_sigma is None or cast(float, request.guidance_scale) <= 1.0:
        return [True] * steps
    probe = type(scheduler).from_config(scheduler.config)  # the schedule the pipeline will set
    probe.set_timesteps(steps)
    return [float(s) <= request.guidance_max_sigma for s in probe.sigmas[:steps]]


def fit_image(image: Any, width: int, height: int) -> Any:
    """``image`` (a PIL image) as the RGB first frame of a ``width x height`` video: scaled to cover it and
    centre-cropped, so its aspect ratio is kept (diffusers' own preprocessing would stretch it)."""
    from PIL import Image, ImageOps

    return ImageOps.fit(image.convert("RGB"), (width, height), Image.Resampling.LANCZOS)


def _build_pipeline(
    components: WanComponents,
    scheduler: Any,
    transformer: MHLAWanTransformer3DModel,
    transformer_2: MHLAWanTransformer3DModel | None,
    image: bool,
) -> Any:
    """The model's diffusers pipeline over the shared parts: ``WanImageToVideoPipeline`` for an image (an
    image-to-video model, or Wan2.2-TI2V's image mode), else ``WanPipeline``; both with the model's second
    expert, ``boundary_ratio`` and ``expand_timesteps``."""
    from .compat import quiet_image_processors

    quiet_image_processors()  # diffusers' image-to-video module imports transformers' CLIPImageProcessor
    from diffusers import WanImageToVideoPipeline, WanPipeline

    index = components.index
    parts: dict[str, Any] = dict(
        tokenizer=components.tokenizer,
        text_encoder=components.text_encoder,
        vae=components.vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=index.boundary_ratio if transformer_2 is not None else None,
        expand_timesteps=index.expand_timesteps,
    )
    if image:
        return WanImageToVideoPipeline(
            **parts, image_encoder=components.image_encoder, image_processor=components.image_processor
        )
    return WanPipeline(**parts)


@torch.no_grad()
def generate(
    components: WanComponents,
    request: GenerationRequest,
    *,
    transformer: MHLAWanTransformer3DModel | None = None,
    transformer_2: MHLAWanTransformer3DModel | None = None,
    attention_options: dict[str, Any] | None = None,
    max_sequence_length: int | None = None,
    show_progress: bool = True,
    on_step: Callable[[int, torch.Tensor, Any], None] | None = None,
) -> GenerationResult:
    """Generates one video as ``request`` asks (prompt, size, steps, guidance, seed, variant, blocks, ...) and
    times it::

        generate(components, GenerationRequest(prompt="a red square moves to the right", variant="mhla", seed=0))

    Args:
        components: :class:`pipelines.loading.WanComponents` (tokenizer, text encoder, VAE shared by all variants).
        request: a :class:`GenerationRequest`. An unchecked one (``grid`` None) is checked here, once, by
            :func:`model_request` (unset sizes, steps and guidance take the model's defaults); a checked one
            (the CLI checks before loading a model) is used as it is. Its ``blocks`` default to the model's own
            (if it has MHLA parameters), else :func:`mhla.default_blocks` of the grid (:func:`mhla.resolve_blocks`);
            its ``layers`` (mhla-hybrid) to the model's own split, else all but 0, 3, 6, ...
        transformer: the transformer to run (default ``components.transformer``); it is converted in place,
            reusing its variant parameters where it has them.
        transformer_2: a two-expert model's low-noise expert (default ``components.transformer_2``), converted
            the same way with the request's ``layers_2``; it keeps its own fine-tuned parameters.
        attention_options: overrides of :class:`pipelines.attention.AttentionOptions` (e.g. ``{"normalize": True}``).
        max_sequence_length: text tokens (default: the model's own, else 512).
        show_progress: a progress bar over the denoising steps.
        on_step: called after each denoising step ``i`` (0-based) with ``(i, latents, scheduler)``: the latents
            ``(1, C, F, H, W)`` after the step, as the pipeline holds them (normalised), and the scheduler (a
            multistep one keeps its latest denoised estimate); the app's live previews.
    The pipeline is the model's (:attr:`WanComponents.pipeline_class`): ``WanPipeline`` (with ``transformer_2``
    and ``boundary_ratio`` for Wan2.2-A14B, ``expand_timesteps`` for Wan2.2-TI2V) or, when the request has an
    ``image``, ``WanImageToVideoPipeline`` (the image fitted to the video's size, centre-cropped to its aspect).

    Raises:
        ValueError: a bad request, before any model work. :class:`NonFiniteLatentsError`: the latents became
            NaN or inf (checked after every denoising step; nothing is decoded).
    """
    if not isinstance(request, GenerationRequest):
        raise TypeError(
            "generate() takes a GenerationRequest, e.g. generate(components, GenerationRequest(prompt='a red "
            f"square moves to the right', variant='mhla')); got {type(request).__name__}"
        )
    transformer = components.transformer if transformer is None else transformer
    transformer_2 = components.transformer_2 if transformer_2 is None else transformer_2
    if request.grid is None:
        request = model_request(components, request, transformer)
    else:  # checked without the model (the CLI's preflight): its image and experts are checked here
        check_model_inputs(request, components.index, f"model {components.source!r}")
    grid = cast(tuple[int, int, int], request.grid)  # a checked request has its grid, sizes, steps and guidance
    height, width, num_frames = cast(int, request.height), cast(int, request.width), cast(int, request.num_frames)
    do_guidance = cast(float, request.guidance_scale) > 1.0
    # text embeddings are padded to this length and not masked in cross-attention: use the model's own
    if max_sequence_length is None:
        max_sequence_length = components.defaults.get("max_sequence_length", 512)
    if transformer.config.get("added_kv_proj_dim") is not None and max_sequence_length != WAN_TEXT_LENGTH:
        # diffusers' Wan cross-attention splits [image tokens, text tokens] by taking the last 512 as the text
        raise ValueError(
            f"max_sequence_length={max_sequence_length}: model {components.source!r} reads an image encoder's "
            f"tokens in cross-attention, which diffusers' WanAttnProcessor separates from the text by assuming "
            f"{WAN_TEXT_LENGTH} text tokens; use {WAN_TEXT_LENGTH}"
        )
    resolved = convert_for_request(components, transformer, request, attention_options, request.layers)
    experts = [transformer]
    if transformer_2 is not None:  # each expert keeps its own parameters, blocks and hybrid split
        convert_for_request(components, transformer_2, request, attention_options, request.layers_2, "transformer_2")
        experts.append(transformer_2)

    device = components.device
    # the pipeline is only a container of the shared parts: built per call for this variant's transformer(s)
    # and a fresh scheduler state
    scheduler = type(components.scheduler).from_config(components.scheduler.config)
    pipe = _build_pipeline(components, scheduler, transformer, transformer_2, image=request.image is not None)
    pipe.set_progress_bar_config(disable=not show_progress, desc=f"denoising [{request.variant}]", leave=False)
    stride = components.vae_stride
    latent_frames = (num_frames - 1) // stride[0] + 1
    # the latents the pipeline denoises: WanPipeline's have the transformer's input channels; an
    # image-to-video transformer takes more (the image's latents and a mask concatenated), so there the VAE's
    channels = components.latent_channels if request.image is not None else transformer.config.in_channels
    shape = (1, channels, latent_frames, height // stride[1], width // stride[1])
    # the starting latents, the first frame and the guided steps are made before the clock starts, as the
    # pipeline is: the clock times the text encoding, the denoising and the decoding alone
    noise = initial_noise(request.seed, shape, device)
    image_input = {} if request.image is None else {"image": fit_image(request.image, width, height)}
    guided = _guided_steps(scheduler, request)
    contexts = [t.attention_context for t in experts]
    for ctx in contexts:
        ctx.layouts.clear()
        ctx.softmax_backend = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    sync(device)
    t_start = time.perf_counter()
    prompt_embeds, negative_embeds = pipe.encode_prompt(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        do_classifier_free_guidance=do_guidance,
        max_sequence_length=max_sequence_length,
        device=device,
    )
    sync(device)
    t_text = time.perf_counter()
    step_ends: list[float] = []
    step_starts: list[float] = []  # each step's start: the last one's end, or after ``on_step`` where it ran

    def embeds_for(step: int) -> torch.Tensor:
        # a guidance interval through WanPipeline's own hook: at an unguided step the "unconditional" pass gets
        # the prompt's embeddings, so uncond == cond and uncond + g * (cond - uncond) is cond exactly (the pass
        # still runs: the cost per step is unchanged)
        return negative_embeds if guided[step] else prompt_embeds

    def on_step_end(_pipe: Any, i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        sync(device)
        step_ends.append(time.perf_counter())
        # cheap (the latents are small): a model or dtype that overflows stops here, not in a black video
        if not bool(torch.isfinite(kwargs["latents"]).all()):
            raise NonFiniteLatentsError(
                f"{request.variant}: the latents became NaN or inf at denoising step {i + 1} of "
                f"{request.num_inference_steps} ({str(transformer.dtype).replace('torch.', '')} on {device.type}); "
                "no video is written. Check the weights, or try --dtype float32"
            )
        if on_step is not None:  # after the step's clock read, and the next step starts after it: in neither
            on_step(i, kwargs["latents"], _pipe.scheduler)
            sync(device)
        step_starts.append(time.perf_counter() if on_step is not None else step_ends[-1])
        if not all(guided) and i + 1 < len(guided):
            return {"negative_prompt_embeds": embeds_for(i + 1)}
        return {}

    for ctx in contexts:
        ctx.timer.reset(enabled=True)
    try:
        # the pipeline denoises and decodes; the last step's end splits denoising from VAE decoding; its
        # weights are fixed, so each MHLA layer's constrained mixing is computed once per call
        with reuse_constrained_mixing():
            frames = pipe(
                **image_input,
                prompt_embeds=prompt_embeds,
                negative_prompt_embeds=negative_embeds if all(guided) else embeds_for(0),
                height=request.height,
                width=request.width,
                num_frames=request.num_frames,
                num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale,
                latents=noise,
                output_type=request.output_type,
                return_dict=False,
                callback_on_step_end=on_step_end,
                callback_on_step_end_tensor_inputs=["latents", "negative_prompt_embeds"],
                max_sequence_length=max_sequence_length,
            )[0]
        if request.output_type != "latent":
            frames = frames[0]
        sync(device)
        t_end = time.perf_counter()
    finally:
        for ctx in contexts:
            ctx.timer.enabled = False
    t_denoise = step_ends[-1]

    timing = Timing(
        variant=request.variant,
        device=str(device),
        dtype=str(transformer.dtype).replace("torch.", ""),
        random_weights=components.random_weights,
    )
    timing.total = t_end - t_start
    timing.text_encoding = t_text - t_start
    timing.denoising = t_denoise - t_text
    timing.steps = [b - a for a, b in zip([t_text, *step_starts[:-1]], step_ends, strict=True)]
    timing.vae_decode = t_end - t_denoise
    timing.self_attention = sum(ctx.timer.seconds() for ctx in contexts)
    timing.self_attention_calls = sum(ctx.timer.calls for ctx in contexts)
    timing.peak_memory_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    timing.grid = grid
    timing.num_tokens = math.prod(grid)
    if resolved is not None:
        timing.layout = "; ".join(sorted(set().union(*(ctx.layouts for ctx in contexts)))) or "-"
        timing.num_blocks = resolved.layout.num_blocks
    elif transformer.conversion.linear_layers:  # vanilla linear attention (no blocks) in every layer
        timing.layout = "one global summary (M=1)"
        timing.num_blocks = 1
    timing.softmax_backend = next((ctx.softmax_backend for ctx in contexts if ctx.softmax_backend), None)
    return GenerationResult(
        frames=frames,
        timing=timing,
        prompt=request.prompt,
        seed=request.seed,
        initial_noise=noise.cpu(),
        random_weights=components.random_weights,
        pipeline_class=type(pipe).__name__,
    )

"""One generation request, checked once: what the CLI, the app and ``generate()`` all pass on.

The latent-token grid of a video size is written here and nowhere else (:func:`latent_grid`), and so
are the checks of a variant's blocks and layers against its spec (:data:`pipelines.attention.VARIANT_SPECS`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mhla

from .attention import LAYERS_VARIANTS, MHLA_VARIANTS, SOFTMAX, VARIANTS
from .conversion import CONFIG_KEY, Conversion

if TYPE_CHECKING:
    from .model_dir import ModelIndex

# Wan2.1's VAE strides (4 in time, 8 in space); with the transformer's patch they fix the token grid.
VAE_STRIDE = (4, 8, 8)
OUTPUT_TYPES = ("np", "pil", "pt", "latent")
# the fields a model gives a default to (None in a request: the model's)
DEFAULTED = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale", "guidance_max_sigma")


def latent_grid(
    height: int,
    width: int,
    num_frames: int,
    patch_size: Sequence[int] = (1, 2, 2),
    vae_stride: Sequence[int] = VAE_STRIDE,
) -> tuple[int, int, int]:
    """The latent-token grid ``(F, H, W)`` the transformer's attention sees for a video size."""
    f = (num_frames - 1) // vae_stride[0] + 1
    return (f // patch_size[0], height // vae_stride[1] // patch_size[1], width // vae_stride[2] // patch_size[2])


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate, in diffusers' argument names: what ``generate()`` takes, e.g.
    ``GenerationRequest(prompt="a red square moves to the right", variant="mhla", seed=3)``.

    Sizes, steps and guidance left None take the model's defaults (:meth:`with_defaults`). :meth:`check`
    validates the request for a model's patch and VAE strides before any heavy work; a checked request carries
    its token ``grid``, and its ``blocks`` (when given) parsed to ``(bf, bh, bw)``."""

    prompt: str
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    variant: str = SOFTMAX
    # classifier-free guidance only at the steps whose noise level sigma (1 = pure noise, 0 = clean) is at
    # most this; the earlier, noisier steps take the conditional prediction alone (a guidance interval,
    # Kynkäänniemi et al., 2024). None: guidance at every step, as diffusers' WanPipeline.
    guidance_max_sigma: float | None = None
    negative_prompt: str | None = ""  # None reads as "" (check() makes it a string)
    seed: int = 0
    blocks: str | tuple[int, int, int] | None = None
    layers: list[int] | None = None
    # mhla-hybrid's MHLA layers in the second expert (Wan2.2-A14B's transformer_2); None: its own, else the default
    layers_2: list[int] | None = None
    # the first frame of an image-to-video model (a PIL image; resized to height x width): required by
    # WanImageToVideoPipeline, refused by a text-to-video model (generate() checks it against the model)
    image: Any = None
    output_type: str = "np"
    grid: tuple[int, int, int] | None = None  # set by check()

    def with_defaults(self, defaults: Mapping[str, Any]) -> GenerationRequest:
        """The request with each unset (None) size, step count and guidance taken from ``defaults`` (a model's,
        e.g. ``WanComponents.defaults``)."""
        unset: dict[str, Any] = {key: defaults.get(key) for key in DEFAULTED if getattr(self, key) is None}
        return replace(self, **unset)

    @property
    def uses_blocks(self) -> bool:
        return self.variant in MHLA_VARIANTS

    @property
    def num_tokens(self) -> int:
        return math.prod(self.grid) if self.grid else 0

    def check(self, patch_size: Sequence[int] = (1, 2, 2), vae_stride: Sequence[int] = VAE_STRIDE) -> GenerationRequest:
        """The request with its ``grid`` set; raises ``ValueError`` naming the bad value and what was expected."""
        temporal_stride, spatial_multiple = vae_stride[0], vae_stride[1] * patch_size[1]
        prompt, negative = self.prompt, self.negative_prompt
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt must be a non-empty string describing the video, got {prompt!r}")
        if negative is not None and not isinstance(negative, str):
            raise ValueError(f"negative_prompt must be a string or None, got {type(negative).__name__}")
        for name, value in (("height", self.height), ("width", self.width)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % spatial_multiple:
                raise ValueError(
                    f"{name} must be a positive multiple of {spatial_multiple} "
                    f"(VAE stride {vae_stride[1]} x patch {patch_size[1]}), got {value!r}"
                )
        frames = self.num_frames
        if not isinstance(frames, int) or isinstance(frames, bool) or frames < 1 or (frames - 1) % temporal_stride:
            examples = ", ".join(str(temporal_stride * k + 1) for k in range(3))
            raise ValueError(
                f"num_frames must be of the form {temporal_stride}k+1 ({examples}, ...: the VAE's temporal stride is "
                f"{temporal_stride}), got {frames!r}"
            )
        steps = self.num_inference_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"num_inference_steps must be an integer >= 1, got {steps!r}")
        g = self.guidance_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ValueError(f"guidance_scale must be a finite number >= 0, got {g!r}")
        m = self.guidance_max_sigma
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1):
            raise ValueError(
                f"guidance_max_sigma must be a noise level in [0, 1] (1: guidance at every step) or None, got {m!r}"
            )
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; expected one of {', '.join(VARIANTS)}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {self.output_type!r}")
        takes_layers = self.variant in LAYERS_VARIANTS
        for name, layers in (("layers", self.layers), ("layers_2", self.layers_2)):
            if layers is not None and not takes_layers:
                raise ValueError(
                    f"{name} apply to {' and '.join(map(repr, LAYERS_VARIANTS))} only, "
                    f"got {name}={layers!r} for {self.variant!r}"
                )
        check_image(self.image)
        height, width = cast(int, self.height), cast(int, self.width)  # checked above
        grid = latent_grid(height, width, frames, patch_size, vae_stride)
        blocks = self.blocks
        if blocks is not None:
            if not self.uses_blocks:
                raise ValueError(
                    f"blocks apply to the {' and '.join(map(repr, MHLA_VARIANTS))} variants only, "
                    f"got blocks={blocks!r} for {self.variant!r}"
                )
            try:
                blocks = mhla.resolve_blocks(grid, blocks).blocks  # parsed once, here; must fit the grid
            except ValueError as e:
                raise ValueError(
                    f"blocks {blocks!r} do not fit {frames} frames at {self.height}x{self.width}: {e}. "
                    "Use fewer blocks on that axis, or leave blocks unset for the default layout"
                ) from None
        return replace(self, negative_prompt=negative or "", blocks=blocks, grid=grid)


def check_model_inputs(
    request: GenerationRequest, index: ModelIndex, model: str, image: str = "image", layers_2: str = "layers_2"
) -> None:
    """``request``'s image and second-expert layers against the model's architecture (``index``, read from its
    ``model_index.json``): an image-to-video model needs an image, a text-to-video one (other than Wan2.2-TI2V)
    takes none, ``layers_2`` needs a second expert. ValueError naming the model and what it takes.
    ``model`` names it (e.g. ``model '/models/wan'``); ``image``, ``layers_2``: the arguments' names in messages (``--image``, ``--layers-2`` on the command line)."""
    if index.image_to_video and request.image is None:
        raise ValueError(
            f"{model} is image-to-video ({index.pipeline_class}): it needs {image} (the first frame), "
            "e.g. a PNG or JPEG"
        )
    if request.image is not None and not index.takes_image:
        raise ValueError(
            f"{image} was given, but {model} is text-to-video ({index.describe()}); an image is taken by "
            "image-to-video models (WanImageToVideoPipeline) and Wan2.2-TI2V (expand_timesteps)"
        )
    if request.layers_2 is not None and not index.transformer_2:
        raise ValueError(
            f"{layers_2} {request.layers_2!r}: {model} has one transformer ({index.describe()}); the second "
            "expert's layers apply to two-expert models (Wan2.2-A14B: transformer_2, boundary_ratio)"
        )


def check_image(image: Any, name: str = "image") -> None:
    """``image`` is None or a PIL image with pixels; ValueError naming what it is otherwise."""
    if image is None:
        return
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"{name} must be a PIL image (the first frame), got {type(image).__name__}")
    if image.width < 1 or image.height < 1:
        raise ValueError(f"{name} is {image.width}x{image.height} pixels; expected a non-empty picture")


def validate_request(
    prompt: str,
    height: int,
    width: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    variant: str,
    blocks: str | tuple[int, int, int] | None = None,
    guidance_max_sigma: float | None = None,
    negative_prompt: str | None = None,
    seed: int = 0,
    output_type: str = "np",
    patch_size: Sequence[int] = (1, 2, 2),
    vae_stride: Sequence[int] = VAE_STRIDE,
) -> tuple[int, int, int]:
    """:meth:`GenerationRequest.check` as a function; returns the latent-token grid ``(F, H, W)``."""
    request = GenerationRequest(
        prompt=prompt,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        guidance_max_sigma=guidance_max_sigma,
        variant=variant,
        negative_prompt=negative_prompt,
        seed=seed,
        blocks=blocks,
        output_type=output_type,
    )
    # check() always sets the grid
    return cast(tuple[int, int, int], request.check(patch_size, vae_stride).grid)


def check_trained_blocks(
    request: GenerationRequest, transformer_dir: str | Path | None, config: dict[str, Any] | None
) -> None:
    """A fine-tuned MHLA transformer's mixing coefficients are M x M for its own block layout: another
    ``--blocks`` (the checked request's, parsed) would need new ones, so it is refused before anything loads.
    ``config``: ``transformer_dir``'s ``config.json``."""
    if not request.uses_blocks or request.blocks is None or transformer_dir is None:
        return
    config = config or {}
    trained = Conversion.from_config(config.get(CONFIG_KEY), int(config.get("num_layers") or 0)).blocks
    # None: a softmax or linear transformer, converted afresh with the requested blocks
    if trained is not None and tuple(trained) != tuple(request.blocks):
        m = math.prod(trained)
        raise ValueError(
            f"--blocks {'x'.join(map(str, request.blocks))}: the {request.variant} transformer "
            f"{str(transformer_dir)!r} was fine-tuned with "
            f"{'x'.join(map(str, trained))} blocks (its mixing coefficients are {m}x{m}); leave --blocks unset, "
            "or pass an unconverted (softmax) --transformer to convert it afresh with these blocks"
        )

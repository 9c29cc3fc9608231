"""Wan2.1 text-to-video with softmax ("flash"), linear, MHLA or hybrid MHLA self-attention.

Built on diffusers' Wan (``WanTransformer3DModel``, ``AutoencoderKLWan``, UMT5) and the ``mhla`` operator:

- :mod:`pipelines.attention`: the variants as attention processors, and :class:`AttentionOptions`.
- :mod:`pipelines.convert`: :func:`convert_self_attention` / :func:`set_variant` on a transformer, in place;
  :func:`resolve_model_blocks`, the block rule (:func:`mhla.resolve_blocks`) with the model's own blocks.
- :mod:`pipelines.loading`: local Wan2.1 directories, the built-in model, transformer save/load.
- :mod:`pipelines.request`: :class:`GenerationRequest` (checked once, before any model work) and :func:`latent_grid`.
- :mod:`pipelines.pipeline`: ``generate()`` (one video, timed stage by stage).
- :mod:`pipelines.cli`: the command line (``python -m pipelines.cli``).
"""

from mhla import resample_mixing  # re-exported: older code imports it from here

from .attention import (
    MHLA_VARIANTS,
    VARIANT_SPECS,
    VARIANTS,
    AttentionOptions,
    LinearSelfAttention,
    VariantSpec,
    hybrid_layers,
    variant_spec,
)
from .builtin import BUILTIN_DIR, TINY_RANDOM
from .convert import (
    convert_self_attention,
    current_variant,
    model_blocks,
    resolve_model_blocks,
    self_attention_state,
    set_variant,
)
from .loading import WanComponents, load_components, load_transformer, save_transformer
from .model_dir import check_model_dir
from .pipeline import GenerationResult, NonFiniteLatentsError, model_request
from .request import GenerationRequest, latent_grid

__all__ = [
    "BUILTIN_DIR",
    "MHLA_VARIANTS",
    "GenerationRequest",
    "GenerationResult",
    "NonFiniteLatentsError",
    "latent_grid",
    "model_request",
    "TINY_RANDOM",
    "VARIANTS",
    "VARIANT_SPECS",
    "VariantSpec",
    "variant_spec",
    "AttentionOptions",
    "LinearSelfAttention",
    "WanComponents",
    "check_model_dir",
    "convert_self_attention",
    "current_variant",
    "hybrid_layers",
    "load_components",
    "load_transformer",
    "model_blocks",
    "resample_mixing",
    "resolve_model_blocks",
    "save_transformer",
    "self_attention_state",
    "set_variant",
]

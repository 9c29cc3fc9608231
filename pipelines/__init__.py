"""Wan2.1 text-to-video with softmax ("flash"), linear, MHLA or hybrid MHLA self-attention.

Built on diffusers' Wan (``WanTransformer3DModel``, ``AutoencoderKLWan``, UMT5) and the ``mhla`` operator:

- :mod:`pipelines.attention`: the variants as attention processors, and :class:`AttentionOptions`.
- :mod:`pipelines.model`: :class:`MHLAWanTransformer3DModel`, the Wan transformer that owns its conversion
  (``convert``, ``set_variant``, ``conversion``); :func:`convert_self_attention` (a plain diffusers model -> ours),
  :func:`resolve_model_blocks`, the block rule (:func:`mhla.resolve_blocks`) with the model's own blocks. Imported
  on first use of one of its names here: it imports diffusers' models (seconds), which ``import pipelines`` does not.
- :mod:`pipelines.conversion`: :class:`Conversion`, the typed record of a conversion (in a model's config).
- :mod:`pipelines.loading`: local Wan2.1 directories, the built-in model, transformer save/load.
- :mod:`pipelines.request`: :class:`GenerationRequest` (checked once, before any model work) and :func:`latent_grid`.
- :mod:`pipelines.pipeline`: ``generate()`` (one video, timed stage by stage).
- :mod:`pipelines.cli`: the command line (``python -m pipelines.cli``).
"""

from typing import TYPE_CHECKING

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
from .conversion import Conversion
from .loading import WanComponents, load_components, load_transformer, save_transformer
from .model_dir import BUILTIN_DIR, TINY_RANDOM, check_model_dir
from .pipeline import GenerationResult, NonFiniteLatentsError, model_request
from .request import GenerationRequest, latent_grid

if TYPE_CHECKING:
    from .model import (
        MHLAWanTransformer3DModel,
        clone_transformer,
        convert_self_attention,
        current_variant,
        model_blocks,
        resolve_model_blocks,
        set_variant,
    )

# pipelines.model's names, imported when first asked for (PEP 562): that module imports diffusers' models
_MODEL_NAMES = (
    "MHLAWanTransformer3DModel",
    "clone_transformer",
    "convert_self_attention",
    "current_variant",
    "model_blocks",
    "resolve_model_blocks",
    "set_variant",
)


def __getattr__(name: str) -> object:
    if name in _MODEL_NAMES:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Conversion",
    "MHLAWanTransformer3DModel",
    "clone_transformer",
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
    "set_variant",
]

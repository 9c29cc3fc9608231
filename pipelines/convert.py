"""Converting a diffusers ``WanTransformer3DModel`` between self-attention variants, in place.

The conversion travels in the model's config under :data:`CONFIG_KEY` (so ``save_pretrained`` writes it
to ``config.json``)::

    "self_attention": {
        "variant": "mhla-hybrid",                 # what runs now
        "linear_layers": [1, 2, 4, 5, ...],       # layers running linear attention now
        "parameters": {"mhla": [...], "linear": [...]},  # layers owning new parameters, by kind
        "options": {...}                          # AttentionOptions.to_dict()
    }

``parameters`` can be wider than ``linear_layers``: a model converted to ``mhla`` and switched back to
``flash`` keeps its mixing matrices, so it can switch again without reloading weights.

The layers are converted by :mod:`pipelines.conversion`; this module adds the switch of a plain model's class
to :class:`pipelines.model.MHLAWanTransformer3DModel` (which builds on :mod:`pipelines.conversion`, not on this
module), so ``save_pretrained`` names the class that restores the conversion.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from .attention import AttentionOptions, variant_spec
from .conversion import (
    _CONTEXT_ATTR,
    _HOOK_ATTR,
    CONFIG_KEY,
    add_attention_parameters,
    attention_context,
    attention_options,
    convert_layers,
    current_variant,
    model_blocks,
    resolve_model_blocks,
    self_attention_state,
)

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel

__all__ = [
    "CONFIG_KEY",
    "add_attention_parameters",
    "attention_context",
    "attention_options",
    "clone_transformer",
    "convert_self_attention",
    "current_variant",
    "model_blocks",
    "resolve_model_blocks",
    "self_attention_state",
    "set_variant",
]


def convert_self_attention(
    transformer: WanTransformer3DModel,
    variant: str,
    layers: list[int] | None = None,
    options: AttentionOptions | None = None,
    allow_new_parameters: bool = True,
) -> WanTransformer3DModel:
    """Makes ``transformer``'s self-attention run as ``variant``, in place; returns ``transformer``.

    Arguments and behaviour as :func:`pipelines.conversion.convert_layers` (variants, hybrid layers, options,
    reuse of existing parameters). A plain ``WanTransformer3DModel`` becomes a
    :class:`pipelines.model.MHLAWanTransformer3DModel` (its class is switched in place; that subclass adds no
    state of its own), so ``save_pretrained`` names the class that restores the conversion and diffusers'
    ``from_pretrained`` loads it back as it was saved.
    """
    convert_layers(transformer, variant, layers, options, allow_new_parameters)
    _own_class(transformer)
    return transformer


def _own_class(transformer: WanTransformer3DModel) -> None:
    from diffusers import WanTransformer3DModel

    from .model import MHLAWanTransformer3DModel

    if type(transformer) is WanTransformer3DModel:
        transformer.__class__ = MHLAWanTransformer3DModel


def clone_transformer(transformer: WanTransformer3DModel) -> WanTransformer3DModel:
    """An independent copy of a (converted) transformer: same weights, variant and options, its own
    processors, context and grid hook. For keeping one transformer per variant while sharing the rest."""
    ctx = transformer.__dict__.pop(_CONTEXT_ATTR, None)
    handle = transformer.__dict__.pop(_HOOK_ATTR, None)
    try:
        clone = copy.deepcopy(transformer)
    finally:
        if ctx is not None:
            object.__setattr__(transformer, _CONTEXT_ATTR, ctx)
        if handle is not None:
            object.__setattr__(transformer, _HOOK_ATTR, handle)
    if handle is not None:
        clone._forward_pre_hooks.pop(handle.id, None)  # the copied hook would write to the original's context
        clone._forward_pre_hooks_with_kwargs.pop(handle.id, None)
    state = self_attention_state(transformer)
    layers = state["linear_layers"] if variant_spec(state["variant"]).layers else None
    options = AttentionOptions.from_dict(state["options"])
    return convert_self_attention(clone, state["variant"], layers, options, allow_new_parameters=False)


def set_variant(
    transformer: WanTransformer3DModel, variant: str, layers: list[int] | None = None
) -> WanTransformer3DModel:
    """Switches a converted model's variant without creating parameters (e.g. ``mhla`` <-> ``flash``).

    Raises ``ValueError`` naming the layers that lack the variant's parameters.
    """
    return convert_self_attention(transformer, variant, layers, allow_new_parameters=False)

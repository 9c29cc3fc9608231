"""Planning and installing a self-attention conversion of a Wan transformer; nothing else.

:func:`plan` turns a request (a variant, its layers, options) and the model's current :class:`Conversion` into the
next one, refusing what cannot be done (options that would need new parameters, parameters a switch may not
create). :func:`install` makes a transformer's modules match a :class:`Conversion`: the new-parameter modules it
names (:func:`add_attention_parameters`), the processors of every ``attn1``, the options they run with.

The model class owns its conversion (:class:`pipelines.model.MHLAWanTransformer3DModel`: its ``convert``,
``set_variant``, ``conversion``, ``attention_context``); this module knows nothing of that class, so it imports no
diffusers model and nothing here imports it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from .attention import (
    PARAM_ATTRS,
    AttentionOptions,
    LinearSelfAttention,
    LinearSelfAttnProcessor,
    SelfAttentionContext,
    SoftmaxSelfAttnProcessor,
    linear_layers_for,
    parameter_kind,
    variant_spec,
)
from .conversion import Conversion

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel


def parameter_layers(transformer: WanTransformer3DModel) -> dict[str, list[int]]:
    """By kind, the layers whose ``attn1`` owns that kind's :class:`LinearSelfAttention` (what the modules hold)."""
    out: dict[str, list[int]] = {kind: [] for kind in PARAM_ATTRS}
    for i, block in enumerate(transformer.blocks):
        for kind, attr in PARAM_ATTRS.items():
            if isinstance(getattr(block.attn1, attr, None), LinearSelfAttention):
                out[kind].append(i)
    return out


def _check_options(
    existing: AttentionOptions, requested: AttentionOptions, params: Mapping[str, Iterable[int]]
) -> None:
    shaping = []
    if params["mhla"]:
        shaping += ["blocks", "per_head_mixing", "learnable_mixing"]
    if params["mhla"] or params["linear"]:
        shaping += ["output_norm", "output_gate", "cpe"]
    for name in shaping:
        a, b = getattr(existing, name), getattr(requested, name)
        if name == "cpe" and not a:  # a zero-initialised convolution joins a converted layer exactly
            continue
        if a != b:
            raise ValueError(
                f"this model's linear-attention layers were built with {name}={a!r}; "
                f"{name}={b!r} would need new parameters (reload the unconverted model to change it)"
            )


def add_attention_parameters(
    transformer: WanTransformer3DModel, kind: str, layers: Iterable[int], options: AttentionOptions
) -> None:
    """Adds a freshly initialised :class:`LinearSelfAttention` of ``kind`` to ``attn1`` of each of ``layers``
    that lacks one (locality-initialised mixing, RMSNorm weight 1, zero gate). Processors are not changed."""
    if kind not in PARAM_ATTRS:
        raise ValueError(f"kind must be one of {tuple(PARAM_ATTRS)}, got {kind!r}")
    for i in layers:
        attn = transformer.blocks[i].attn1
        if isinstance(getattr(attn, PARAM_ATTRS[kind], None), LinearSelfAttention):
            continue
        head_dim = attn.inner_dim // attn.heads
        ref = attn.to_q.weight
        module = LinearSelfAttention(kind, attn.to_q.in_features, attn.heads, head_dim, options)
        # the mixing matrix stays float32 (it is tiny and sums many summaries); the rest follows the layer
        for name, p in module.named_parameters():
            p.data = p.data.to(ref.device, torch.float32 if name.startswith("mhla.") else ref.dtype)
        setattr(attn, PARAM_ATTRS[kind], module)


def plan(
    current: Conversion,
    num_layers: int,
    variant: str,
    layers: Iterable[int] | None = None,
    options: AttentionOptions | None = None,
    allow_new_parameters: bool = True,
) -> Conversion:
    """The conversion that runs ``variant`` on a model of ``num_layers`` layers whose conversion is ``current``.

    Args:
        variant: one of :data:`pipelines.attention.VARIANTS`.
        layers: the MHLA layers of ``mhla-hybrid`` (default :func:`pipelines.attention.hybrid_layers`).
        options: :class:`AttentionOptions`; default: the model's own. Options that shape parameters (blocks, output
            norm, gate) cannot change once a layer has them.
        allow_new_parameters: the layers that lack the variant's parameters get new ones. ``False`` only switches
            between variants whose parameters the model already has, and raises naming the layers otherwise.

    Parameters the model has are kept (``flash -> mhla -> flash -> mhla`` keeps trained mixing matrices).
    """
    variant_spec(variant)  # a known variant, or a ValueError naming it
    targets = linear_layers_for(variant, num_layers, layers)
    options = current.options if options is None else options
    _check_options(current.options, options, current.parameters)
    kind = parameter_kind(variant)
    missing = [i for i in targets if i not in current.parameters[kind]]
    if missing and not allow_new_parameters:
        raise ValueError(
            f"variant {variant!r} needs {kind} parameters in layers {missing}, which this model does not have; "
            "convert with allow_new_parameters=True (new, untrained parameters) or load a checkpoint that has them"
        )
    params = {k: (*v, *missing) if k == kind else v for k, v in current.parameters.items()}
    return Conversion(variant, tuple(targets), params, options)


def install(transformer: WanTransformer3DModel, conversion: Conversion, context: SelfAttentionContext) -> None:
    """Makes ``transformer``'s modules run ``conversion``: adds the new-parameter modules it names (existing ones are
    kept, never re-initialised), sets every ``attn1`` processor (sharing ``context``) and the options the layers run
    with. ``attn2`` keeps its processor and nothing else in the model is touched. Refuses a model holding parameter
    modules the conversion does not name (they would be saved without a record)."""
    for kind, layers in conversion.parameters.items():
        add_attention_parameters(transformer, kind, layers, conversion.options)
    held = parameter_layers(transformer)
    if any(list(conversion.parameters[k]) != held[k] for k in PARAM_ATTRS):
        raise ValueError(
            f"the model's layers hold new parameters {held}, its conversion names {dict(conversion.parameters)}; "
            "expected the same layers (were modules added by hand?)"
        )
    targets = set(conversion.linear_layers)
    options = conversion.options
    processors: dict[str, object] = {}  # by name: ours for attn1, the model's own elsewhere
    for name, proc in transformer.attn_processors.items():
        # keys look like "blocks.12.attn1.processor"
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blocks" and parts[2] == "attn1":
            i = int(parts[1])
            if i in targets:
                processors[name] = LinearSelfAttnProcessor(context, i, conversion.variant)
            else:
                processors[name] = SoftmaxSelfAttnProcessor(context, i, options.softmax_backend)
        else:
            processors[name] = proc  # cross-attention and anything else stays as it is
    transformer.set_attn_processor(processors)

    # keep the non-shaping options (normalizer, feature map, RoPE, backend) in every layer in step
    for block in transformer.blocks:
        for attr in PARAM_ATTRS.values():
            mod = getattr(block.attn1, attr, None)
            if isinstance(mod, LinearSelfAttention):
                mod.options = options
                if options.cpe and mod.cpe is None:  # turned on in a converted model: zero, so exact
                    mod.add_cpe(block.attn1.inner_dim)
                if mod.mhla is not None:
                    mod.mhla.feature_map, mod.mhla.normalize, mod.mhla.eps = (
                        options.feature_map,
                        options.normalize,
                        options.eps,
                    )
                    mod.mhla.mixing.constrain = options.constrain_mixing


__all__ = ["add_attention_parameters", "install", "parameter_layers", "plan"]

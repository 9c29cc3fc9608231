"""The conversion's core: a Wan transformer's self-attention layers switched between variants, in place.

:func:`convert_layers` installs the processors and the new parameters and records the conversion in the
config; :mod:`pipelines.convert` (the public API) adds the class switch to
:class:`pipelines.model.MHLAWanTransformer3DModel`, which itself rebuilds through this module. Split so that
the model class and the public conversion do not import each other.

The config record it writes (``self_attention``) is described in :mod:`pipelines.convert`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

import mhla
from mhla.layout import Grid

from .attention import (
    PARAM_ATTRS,
    SOFTMAX,
    AttentionOptions,
    LinearSelfAttention,
    LinearSelfAttnProcessor,
    SelfAttentionContext,
    SoftmaxSelfAttnProcessor,
    linear_layers_for,
    parameter_kind,
    variant_spec,
)

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel

CONFIG_KEY = "self_attention"
_CONTEXT_ATTR = "_self_attention_context"
_HOOK_ATTR = "_self_attention_grid_hook"


def attention_context(transformer: WanTransformer3DModel) -> SelfAttentionContext:
    """The :class:`SelfAttentionContext` of ``transformer``, created (with its grid hook) on first use."""
    ctx = getattr(transformer, _CONTEXT_ATTR, None)
    if ctx is None:
        ctx = SelfAttentionContext()
        object.__setattr__(transformer, _CONTEXT_ATTR, ctx)  # a plain attribute, not a submodule
    if getattr(transformer, _HOOK_ATTR, None) is None:
        handle = transformer.register_forward_pre_hook(_record_grid, with_kwargs=True)
        object.__setattr__(transformer, _HOOK_ATTR, handle)
    return ctx


def _record_grid(module: WanTransformer3DModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # hidden_states is (B, C, T, H, W) before patching; the token grid is that divided by the patch size.
    hidden_states = kwargs.get("hidden_states", args[0] if args else None)
    if hidden_states is None or hidden_states.dim() != 5:
        raise ValueError("the Wan transformer expects hidden_states shaped (batch, channels, frames, height, width)")
    p_t, p_h, p_w = module.config.patch_size
    _, _, t, h, w = hidden_states.shape
    getattr(module, _CONTEXT_ATTR).grid = (t // p_t, h // p_h, w // p_w)


def self_attention_state(transformer: WanTransformer3DModel) -> dict[str, Any]:
    """The model's conversion record (see the module docstring); ``flash`` with no parameters if unconverted."""
    state = transformer.config.get(CONFIG_KEY) if hasattr(transformer.config, "get") else None
    if not state:
        return {
            "variant": SOFTMAX,
            "linear_layers": [],
            "parameters": {kind: [] for kind in PARAM_ATTRS},
            "options": AttentionOptions().to_dict(),
        }
    return copy.deepcopy(dict(state))


def attention_options(transformer: WanTransformer3DModel) -> AttentionOptions:
    return AttentionOptions.from_dict(self_attention_state(transformer)["options"])


def model_blocks(transformer: WanTransformer3DModel) -> Grid | None:
    """The transformer's own MHLA block count (its mixing matrices are ``M x M`` for it), or None when no
    layer has MHLA parameters (a softmax or linear-only model: a conversion is free to choose)."""
    state = self_attention_state(transformer)
    return mhla.parse_blocks(state["options"]["blocks"]) if state["parameters"]["mhla"] else None


def resolve_model_blocks(
    transformer: WanTransformer3DModel,
    grid: Sequence[int],
    requested: str | Sequence[int] | None = None,
    block_shape: Grid = mhla.PAPER_BLOCK_SHAPE,
) -> mhla.ResolvedBlocks:
    """The block rule (:func:`mhla.resolve_blocks`) for this transformer on ``grid``: ``requested``, else the
    model's own blocks (:func:`model_blocks`), else the default for ``block_shape`` (the model's target block
    shape in tokens, ``WanComponents.block_shape``)."""
    return mhla.resolve_blocks(grid, requested, model_blocks(transformer), block_shape)


def _param_layers(transformer: WanTransformer3DModel) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {kind: [] for kind in PARAM_ATTRS}
    for i, block in enumerate(transformer.blocks):
        for kind, attr in PARAM_ATTRS.items():
            if isinstance(getattr(block.attn1, attr, None), LinearSelfAttention):
                out[kind].append(i)
    return out


def _check_options(existing: AttentionOptions, requested: AttentionOptions, params: dict[str, list[int]]) -> None:
    shaping = []
    if params["mhla"]:
        shaping += ["blocks", "per_head_mixing", "learnable_mixing"]
    if params["mhla"] or params["linear"]:
        shaping += ["output_norm", "output_gate"]
    for name in shaping:
        a, b = getattr(existing, name), getattr(requested, name)
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


def convert_layers(
    transformer: WanTransformer3DModel,
    variant: str,
    layers: list[int] | None = None,
    options: AttentionOptions | None = None,
    allow_new_parameters: bool = True,
) -> WanTransformer3DModel:
    """Makes ``transformer``'s self-attention run as ``variant``, in place; returns ``transformer``.

    Args:
        transformer: a diffusers ``WanTransformer3DModel``.
        variant: one of :data:`pipelines.attention.VARIANTS`.
        layers: the MHLA layers of ``mhla-hybrid`` (default :func:`pipelines.attention.hybrid_layers`).
        options: :class:`AttentionOptions`; default: the model's own (if converted before) or the paper's.
            Options that shape parameters (blocks, output norm, gate) cannot change once a layer has them.
        allow_new_parameters: create the new parameters (locality-initialised mixing, RMSNorm weight 1,
            zero gate) of layers that lack them. ``False`` only switches between variants whose parameters
            the model already has, and raises otherwise.

    Existing new-parameter modules are reused, never re-initialised, so ``flash -> mhla -> flash -> mhla``
    keeps trained mixing matrices. Only ``attn1`` processors change; ``attn2`` keeps its processor and
    nothing else in the model is touched.

    The model's class is left as it is: :func:`pipelines.convert.convert_self_attention` is this plus the
    switch to :class:`pipelines.model.MHLAWanTransformer3DModel`.
    """
    variant_spec(variant)  # a known variant, or a ValueError naming it
    num_layers = len(transformer.blocks)
    targets = linear_layers_for(variant, num_layers, layers)
    state = self_attention_state(transformer)
    params = _param_layers(transformer)
    existing = AttentionOptions.from_dict(state["options"])
    options = existing if options is None else options
    _check_options(existing, options, params)

    param_kind = parameter_kind(variant)
    missing = [i for i in targets if i not in params[param_kind]]
    if missing and not allow_new_parameters:
        raise ValueError(
            f"variant {variant!r} needs {param_kind} parameters in layers {missing}, which this model does not have; "
            "convert with allow_new_parameters=True (new, untrained parameters) or load a checkpoint that has them"
        )
    add_attention_parameters(transformer, param_kind, missing, options)
    params = _param_layers(transformer)

    ctx = attention_context(transformer)
    processors: dict[str, object] = {}  # by name: ours for attn1, the model's own elsewhere
    for name, proc in transformer.attn_processors.items():
        # keys look like "blocks.12.attn1.processor"
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blocks" and parts[2] == "attn1":
            i = int(parts[1])
            if i in targets:
                processors[name] = LinearSelfAttnProcessor(ctx, i, variant)
            else:
                processors[name] = SoftmaxSelfAttnProcessor(ctx, i, options.softmax_backend)
        else:
            processors[name] = proc  # cross-attention and anything else stays as it is
    transformer.set_attn_processor(processors)

    # keep the non-shaping options (normalizer, feature map, RoPE, backend) in every layer in step
    for block in transformer.blocks:
        for attr in PARAM_ATTRS.values():
            mod = getattr(block.attn1, attr, None)
            if isinstance(mod, LinearSelfAttention):
                mod.options = options
                if mod.mhla is not None:
                    mod.mhla.feature_map, mod.mhla.normalize, mod.mhla.eps = (
                        options.feature_map,
                        options.normalize,
                        options.eps,
                    )
                    mod.mhla.mixing.constrain = options.constrain_mixing

    transformer.register_to_config(
        **{
            CONFIG_KEY: {
                "variant": variant,
                "linear_layers": targets,
                "parameters": {k: sorted(v) for k, v in params.items()},
                "options": options.to_dict(),
            }
        }
    )
    return transformer


def current_variant(transformer: WanTransformer3DModel) -> str:
    return self_attention_state(transformer)["variant"]

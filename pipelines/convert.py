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

The whole conversion lives here: :func:`convert_layers` installs the processors and the new parameters and
records the conversion in the config; :func:`convert_self_attention` (the public API) adds the switch of a plain
model's class to :class:`pipelines.model.MHLAWanTransformer3DModel`, so ``save_pretrained`` names the class that
restores the conversion. The class has a file of its own because it imports diffusers at load time (seconds),
which the app's page start and the configs-only readers here must not pay.
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

    Arguments and behaviour as :func:`convert_layers` (variants, hybrid layers, options,
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

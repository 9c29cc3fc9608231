"""``MHLAWanTransformer3DModel``: diffusers' Wan transformer that owns its self-attention conversion.

Every transformer this project builds or loads is an instance of this class: the tiny and random-weight models, a
model folder (a plain Wan folder loads as ``flash``), an imported checkpoint. The class owns its conversion as
diffusers' models own their processors:

- :attr:`~MHLAWanTransformer3DModel.conversion`: the typed, frozen record (:class:`pipelines.conversion.Conversion`),
  written into the config under ``"self_attention"`` at every change, so ``save_pretrained`` writes it and
  ``"_class_name": "MHLAWanTransformer3DModel"`` into ``config.json`` and a pipeline's ``model_index.json`` names
  the class as ``["pipelines.model", "MHLAWanTransformer3DModel"]``;
- :meth:`~MHLAWanTransformer3DModel.convert` / :meth:`~MHLAWanTransformer3DModel.set_variant`: in place, through
  :func:`pipelines.convert.plan` and :func:`pipelines.convert.install`;
- :attr:`~MHLAWanTransformer3DModel.attention_context`: the state its processors share; :meth:`forward` records the
  latent-token grid in it before diffusers' forward runs.

Loading goes through diffusers' own ``from_pretrained``, which builds the model from its config (``__init__`` below
rebuilds the variant's parameters and processors) and then loads every weight: sharded or not, ``variant=`` files,
any ``dtype`` (the MHLA mixing matrices stay float32 through ``_keep_in_fp32_modules``)::

    from diffusers import DiffusionPipeline
    from pipelines.model import MHLAWanTransformer3DModel

    transformer = MHLAWanTransformer3DModel.from_pretrained("ckpt/wan-mhla/transformer", dtype=torch.bfloat16)
    pipe = DiffusionPipeline.from_pretrained("ckpt/wan-mhla", dtype=torch.bfloat16)  # model_index.json names the class

A plain ``diffusers.WanTransformer3DModel`` (one a user loaded with diffusers) is never changed in place:
:func:`convert_self_attention` returns a new ``MHLAWanTransformer3DModel`` that shares its weights
(:meth:`~MHLAWanTransformer3DModel.from_transformer`). Loading a converted folder as a plain
``WanTransformer3DModel`` gives softmax attention: diffusers only logs that the ``self_attention`` config key and the
new weights were not used (it offers no hook to refuse), so use this class, :func:`pipelines.load_transformer` or a
pipeline folder whose ``model_index.json`` names it.

This module imports diffusers' models (seconds): the app's page start and the configs-only readers import
:mod:`pipelines.conversion` instead, and ``pipelines`` re-exports the names here on first use.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from diffusers import ModelMixin, WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

import mhla
from mhla.layout import Grid

from .attention import AttentionOptions, SelfAttentionContext
from .conversion import CONFIG_KEY, Conversion
from .convert import install, plan

# diffusers resolves a model_index.json entry ["pipelines.model", "MHLAWanTransformer3DModel"] by importing this
# module and finding its loading method through the base classes it names here: ModelMixin must be one of them
__all__ = [
    "MHLAWanTransformer3DModel",
    "ModelMixin",
    "PaddingMaskedCrossAttnProcessor",
    "clone_transformer",
    "convert_self_attention",
    "current_variant",
    "model_blocks",
    "model_index_entry",
    "resolve_model_blocks",
    "set_variant",
    "text_padding_mask",
]


class MHLAWanTransformer3DModel(WanTransformer3DModel):  # type: ignore[misc]  # diffusers is untyped here
    """``WanTransformer3DModel`` whose self-attention runs as flash, linear, MHLA or the MHLA hybrid.

    Args: those of ``WanTransformer3DModel``, and ``self_attention``: the conversion record
    (:meth:`pipelines.conversion.Conversion.to_config`); ``None`` is the unconverted model, running softmax through
    the project's processor. The new parameters it names are created (locality-initialised) here and overwritten by
    ``from_pretrained``.
    """

    # the mixing matrices sum many block summaries and are tiny: kept in float32 at any dtype, as at conversion
    _keep_in_fp32_modules = [*(WanTransformer3DModel._keep_in_fp32_modules or []), "mixing"]

    @register_to_config  # type: ignore[untyped-decorator]
    def __init__(
        self,
        patch_size: tuple[int, ...] = (1, 2, 2),
        num_attention_heads: int = 40,
        attention_head_dim: int = 128,
        in_channels: int = 16,
        out_channels: int = 16,
        text_dim: int = 4096,
        freq_dim: int = 256,
        ffn_dim: int = 13824,
        num_layers: int = 40,
        cross_attn_norm: bool = True,
        qk_norm: str | None = "rms_norm_across_heads",
        eps: float = 1e-6,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        rope_max_seq_len: int = 1024,
        pos_embed_seq_len: int | None = None,
        self_attention: dict[str, Any] | None = None,
        mask_text_padding: bool = False,
    ) -> None:
        super().__init__(
            patch_size=patch_size,
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=in_channels,
            out_channels=out_channels,
            text_dim=text_dim,
            freq_dim=freq_dim,
            ffn_dim=ffn_dim,
            num_layers=num_layers,
            cross_attn_norm=cross_attn_norm,
            qk_norm=qk_norm,
            eps=eps,
            image_dim=image_dim,
            added_kv_proj_dim=added_kv_proj_dim,
            rope_max_seq_len=rope_max_seq_len,
            pos_embed_seq_len=pos_embed_seq_len,
        )
        self.attention_context = SelfAttentionContext()  # shared by this model's attention processors
        self._install(Conversion.from_config(self_attention, num_layers))
        self.set_text_padding_mask(mask_text_padding)

    def _install(self, conversion: Conversion) -> None:
        install(self, conversion, self.attention_context)
        self._conversion = conversion
        self.register_to_config(**{CONFIG_KEY: conversion.to_config()})

    @property
    def conversion(self) -> Conversion:
        """The self-attention conversion this model runs (also in its config, under ``"self_attention"``)."""
        return self._conversion

    def convert(
        self,
        variant: str,
        layers: Iterable[int] | None = None,
        options: AttentionOptions | None = None,
        allow_new_parameters: bool = True,
    ) -> MHLAWanTransformer3DModel:
        """Makes the self-attention run as ``variant``, in place; returns the model.

        Args:
            variant: one of :data:`pipelines.attention.VARIANTS`.
            layers: the MHLA layers of ``mhla-hybrid`` (default :func:`pipelines.attention.hybrid_layers`).
            options: :class:`AttentionOptions`; default: the model's own (if converted before) or the paper's.
                Options that shape parameters (blocks, output norm, gate) cannot change once a layer has them.
            allow_new_parameters: create the new parameters (locality-initialised mixing, RMSNorm weight 1, zero
                gate) of layers that lack them. ``False`` only switches between variants whose parameters the
                model already has, and raises naming the layers otherwise.

        Existing new-parameter modules are reused, never re-initialised, so ``flash -> mhla -> flash -> mhla``
        keeps trained mixing matrices. Only ``attn1`` processors change; ``attn2`` keeps its processor.
        """
        conversion = plan(self.conversion, len(self.blocks), variant, layers, options, allow_new_parameters)
        self._install(conversion)
        return self

    def set_variant(self, variant: str, layers: Iterable[int] | None = None) -> MHLAWanTransformer3DModel:
        """Switches the variant without creating parameters (e.g. ``mhla`` <-> ``flash``); ``ValueError`` naming the
        layers that lack the variant's parameters."""
        return self.convert(variant, layers, allow_new_parameters=False)

    def set_text_padding_mask(self, enabled: bool) -> MHLAWanTransformer3DModel:
        """Makes the cross-attention (``attn2``) ignore the caption's padding, in place; returns the model.

        Wan's pipeline pads every caption's embeddings with zero rows up to ``max_sequence_length`` and diffusers'
        cross-attention reads them all: the text embedder maps every zero row to one shared key, a null token whose
        weight grows as the caption shortens (the built-in model gives its 5 padding rows about 30% of the
        cross-attention, its shape word 4%). Enabled, :meth:`forward` marks the rows of ``encoder_hidden_states``
        that are all zero and the cross-attention's softmax skips them (a caption with no non-zero row reads all of
        them, as before). A model trained one way runs that way: the setting is in its config
        (``mask_text_padding``), so ``save_pretrained`` / ``from_pretrained`` keep it. Text-to-video models only:
        an image-to-video transformer's cross-attention also reads image tokens (``added_kv_proj_dim``)."""
        enabled = bool(enabled)
        if enabled and self.config.added_kv_proj_dim is not None:
            raise ValueError(
                f"mask_text_padding=True: this transformer's cross-attention also reads image tokens "
                f"(added_kv_proj_dim={self.config.added_kv_proj_dim}); the padding mask is for text-to-video models"
            )
        for block in self.blocks:
            processor = PaddingMaskedCrossAttnProcessor(self.attention_context) if enabled else WanAttnProcessor()
            block.attn2.set_processor(processor)
        self.register_to_config(mask_text_padding=enabled)
        return self

    def resolve_blocks(
        self,
        grid: Sequence[int],
        requested: str | Sequence[int] | None = None,
        block_shape: Grid = mhla.PAPER_BLOCK_SHAPE,
    ) -> mhla.ResolvedBlocks:
        """The block rule for this model on ``grid`` (:meth:`pipelines.conversion.Conversion.resolve_blocks`)."""
        return self.conversion.resolve_blocks(grid, requested, block_shape)

    def clone(self) -> MHLAWanTransformer3DModel:
        """An independent copy: the same weights (copied), variant and options, its own processors and context. For
        keeping one transformer per variant while sharing the rest of a pipeline."""
        return copy.deepcopy(self)  # the processors' shared context is copied once (SelfAttentionContext.__deepcopy__)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """diffusers' forward, after recording the latent-token grid ``(F, H, W)`` that the self-attention processors
        read: ``hidden_states`` is ``(batch, channels, frames, height, width)`` before patching."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 5:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
            raise ValueError(
                f"the Wan transformer expects hidden_states shaped (batch, channels, frames, height, width), got {shape}"
            )
        p_t, p_h, p_w = self.config.patch_size
        _, _, t, h, w = hidden_states.shape
        self.attention_context.grid = (t // p_t, h // p_h, w // p_w)
        text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
        self.attention_context.text_mask = (
            text_padding_mask(text) if self.config.get("mask_text_padding") and text is not None else None
        )
        return super().forward(hidden_states, *args, **kwargs)

    @classmethod
    def from_transformer(cls, transformer: WanTransformer3DModel) -> MHLAWanTransformer3DModel:
        """A model of this class sharing ``transformer``'s weights and buffers (no copy), unconverted, in the same
        train/eval mode. ``transformer`` itself is left as it was (its processors included)."""
        if isinstance(transformer, cls):
            return transformer
        config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
        with torch.device("meta"):
            model = cls.from_config(config)
        for name, tensor in [*transformer.named_parameters(), *transformer.named_buffers()]:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            table = module._parameters if leaf in module._parameters else module._buffers
            table[leaf] = tensor
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"{type(transformer).__name__} lacks tensors this model has, e.g. {left[:4]}")
        model.train(transformer.training)
        return model


def text_padding_mask(text: torch.Tensor) -> torch.Tensor:
    """``(B, L, C)`` caption embeddings -> ``(B, 1, 1, L)`` bool: True where a row is not all zero (a token, not
    the pipeline's padding). A caption with no such row keeps every row (it reads them all, as unmasked)."""
    if text.dim() != 3:
        raise ValueError(f"encoder_hidden_states must be (batch, tokens, channels), got {tuple(text.shape)}")
    keep = text.ne(0).any(-1)
    keep = keep | ~keep.any(-1, keepdim=True)
    return keep[:, None, None, :]


class PaddingMaskedCrossAttnProcessor(WanAttnProcessor):  # type: ignore[misc]  # diffusers is untyped here
    """diffusers' Wan attention processor for ``attn2`` that passes the model's caption mask
    (:attr:`pipelines.attention.SelfAttentionContext.text_mask`, set by the model's ``forward``) as the
    cross-attention's mask. The attention itself, its backend and everything else are diffusers'."""

    def __init__(self, context: SelfAttentionContext) -> None:
        super().__init__()
        self.context = context

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        if attention_mask is None and encoder_hidden_states is not None:
            attention_mask = self.context.text_mask
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


def convert_self_attention(
    transformer: WanTransformer3DModel,
    variant: str,
    layers: Iterable[int] | None = None,
    options: AttentionOptions | None = None,
    allow_new_parameters: bool = True,
) -> MHLAWanTransformer3DModel:
    """Makes ``transformer``'s self-attention run as ``variant``; returns the converted model.

    An :class:`MHLAWanTransformer3DModel` (every model this project builds or loads) is converted in place
    (:meth:`MHLAWanTransformer3DModel.convert`: arguments and rules there). A plain diffusers
    ``WanTransformer3DModel`` is left as it is and a new model sharing its weights is returned: use the result.
    """
    model = MHLAWanTransformer3DModel.from_transformer(transformer)
    return model.convert(variant, layers, options, allow_new_parameters)


def set_variant(
    transformer: MHLAWanTransformer3DModel, variant: str, layers: Iterable[int] | None = None
) -> MHLAWanTransformer3DModel:
    """:meth:`MHLAWanTransformer3DModel.set_variant`: a switch that creates no parameters, in place."""
    return _ours(transformer).set_variant(variant, layers)


def clone_transformer(transformer: MHLAWanTransformer3DModel) -> MHLAWanTransformer3DModel:
    """:meth:`MHLAWanTransformer3DModel.clone`."""
    return _ours(transformer).clone()


def current_variant(transformer: Any) -> str:
    """The variant ``transformer`` runs (a plain diffusers model: ``flash``)."""
    return conversion_of(transformer).variant


def conversion_of(transformer: Any) -> Conversion:
    """The :class:`Conversion` of any Wan transformer: its own for this class, read from the config otherwise."""
    if isinstance(transformer, MHLAWanTransformer3DModel):
        return transformer.conversion
    return Conversion.from_config(transformer.config.get(CONFIG_KEY), len(transformer.blocks))


def model_blocks(transformer: Any) -> Grid | None:
    """:attr:`pipelines.conversion.Conversion.blocks` of ``transformer``."""
    return conversion_of(transformer).blocks


def resolve_model_blocks(
    transformer: Any,
    grid: Sequence[int],
    requested: str | Sequence[int] | None = None,
    block_shape: Grid = mhla.PAPER_BLOCK_SHAPE,
) -> mhla.ResolvedBlocks:
    """:meth:`pipelines.conversion.Conversion.resolve_blocks` of ``transformer``'s conversion."""
    return conversion_of(transformer).resolve_blocks(grid, requested, block_shape)


def _ours(transformer: Any) -> MHLAWanTransformer3DModel:
    if not isinstance(transformer, MHLAWanTransformer3DModel):
        raise TypeError(
            f"expected a converted model (MHLAWanTransformer3DModel), got {type(transformer).__name__}; "
            "convert it first: model = convert_self_attention(transformer, variant)"
        )
    return transformer


def model_index_entry() -> list[str]:
    """How a pipeline's ``model_index.json`` names this class: ``["pipelines.model", "MHLAWanTransformer3DModel"]``
    (what diffusers' ``save_pretrained`` writes for it; its ``from_pretrained`` imports the module)."""
    return [MHLAWanTransformer3DModel.__module__, MHLAWanTransformer3DModel.__name__]

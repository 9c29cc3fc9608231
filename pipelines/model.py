"""``MHLAWanTransformer3DModel``: diffusers' Wan transformer that owns its self-attention conversion.

A converted model is an instance of this class (:func:`pipelines.convert_self_attention` makes it one), so
``save_pretrained`` writes ``"_class_name": "MHLAWanTransformer3DModel"`` and the conversion record
(``"self_attention"``, see :mod:`pipelines.convert`) into ``config.json``, and a pipeline's
``model_index.json`` names it as ``["pipelines.model", "MHLAWanTransformer3DModel"]``. Loading goes through
diffusers' own ``from_pretrained``, which builds the model from its config (``__init__`` below rebuilds the
variant's parameters and processors) and then loads every weight: sharded or not, ``variant=`` files, any
``dtype`` (the MHLA mixing matrices stay float32 through ``_keep_in_fp32_modules``)::

    from diffusers import DiffusionPipeline
    from pipelines.model import MHLAWanTransformer3DModel

    transformer = MHLAWanTransformer3DModel.from_pretrained("ckpt/wan-mhla/transformer", dtype=torch.bfloat16)
    pipe = DiffusionPipeline.from_pretrained("ckpt/wan-mhla", dtype=torch.bfloat16)  # model_index.json names the class

Loading such a folder as a plain ``diffusers.WanTransformer3DModel`` gives softmax attention: diffusers only
logs that the ``self_attention`` config key and the new weights were not used (it offers no hook to refuse),
so use this class, :func:`pipelines.load_transformer` or a pipeline folder whose ``model_index.json`` names it.
"""

from __future__ import annotations

from typing import Any

from diffusers import ModelMixin, WanTransformer3DModel
from diffusers.configuration_utils import register_to_config

from .attention import SOFTMAX, AttentionOptions, variant_spec
from .convert import CONFIG_KEY, add_attention_parameters, convert_layers

# diffusers resolves a model_index.json entry ["pipelines.model", "MHLAWanTransformer3DModel"] by importing this
# module and finding its loading method through the base classes it names here: ModelMixin must be one of them
__all__ = ["MHLAWanTransformer3DModel", "ModelMixin", "check_state", "model_index_entry"]


class MHLAWanTransformer3DModel(WanTransformer3DModel):  # type: ignore[misc]  # diffusers is untyped here
    """``WanTransformer3DModel`` whose self-attention runs as flash, linear, MHLA or the MHLA hybrid.

    Args: those of ``WanTransformer3DModel``, and ``self_attention``: the conversion record that
    :func:`pipelines.convert_self_attention` writes (``variant``, ``linear_layers``, ``parameters``,
    ``options``); ``None`` is the unconverted model, running softmax through the project's processor.
    The new parameters are created (locality-initialised) here and overwritten by ``from_pretrained``.
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
        state = check_state(self_attention, num_layers)
        if state is None:
            convert_layers(self, SOFTMAX)
            return
        options = AttentionOptions.from_dict(state["options"])
        # every parameter holder the record names (a model switched back to flash keeps its mixing matrices)
        for kind, layers in state["parameters"].items():
            add_attention_parameters(self, kind, layers, options)
        layers = state["linear_layers"] if variant_spec(state["variant"]).layers else None
        convert_layers(self, state["variant"], layers, options, allow_new_parameters=False)


_STATE_KEYS = ("variant", "linear_layers", "parameters", "options")


def check_state(state: Any, num_layers: int) -> dict[str, Any] | None:
    """The ``self_attention`` config entry, checked: ``None`` (or empty) for an unconverted model, else a dict
    with ``variant``, ``linear_layers``, ``parameters`` (``{"mhla": [...], "linear": [...]}``) and ``options``.
    A malformed entry raises ``ValueError`` naming what is wrong, before any weight is read."""
    if not state:
        return None
    if not isinstance(state, dict):
        raise ValueError(f"config {CONFIG_KEY!r} must be a JSON object, got {type(state).__name__}")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"config {CONFIG_KEY!r} lacks {missing}; expected the keys {list(_STATE_KEYS)}")
    params = state["parameters"]
    if not isinstance(params, dict) or set(params) - {"mhla", "linear"}:
        raise ValueError(f"config {CONFIG_KEY!r}.parameters must map 'mhla'/'linear' to layer lists, got {params!r}")
    for kind, layers in params.items():
        bad = [i for i in layers if not (isinstance(i, int) and 0 <= i < num_layers)]
        if bad:
            raise ValueError(
                f"config {CONFIG_KEY!r}.parameters[{kind!r}] names layers {bad} outside 0 ... {num_layers - 1}"
            )
    return dict(state)


def model_index_entry() -> list[str]:
    """How a pipeline's ``model_index.json`` names this class: ``["pipelines.model", "MHLAWanTransformer3DModel"]``
    (what diffusers' ``save_pretrained`` writes for it; its ``from_pretrained`` imports the module)."""
    return [MHLAWanTransformer3DModel.__module__, MHLAWanTransformer3DModel.__name__]

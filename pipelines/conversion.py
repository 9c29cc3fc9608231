"""The conversion record of a Wan transformer: which self-attention variant runs, where, and with what.

:class:`Conversion` is typed and frozen. A converted model (:class:`pipelines.model.MHLAWanTransformer3DModel`)
holds one and writes it into its config under :data:`CONFIG_KEY`, so ``save_pretrained`` puts it in
``config.json`` and ``from_pretrained`` rebuilds the model from it::

    "self_attention": {
        "variant": "mhla-hybrid",                 # what runs now
        "linear_layers": [1, 2, 4, 5, ...],       # layers running linear attention now
        "parameters": {"mhla": [...], "linear": [...]},  # layers owning new parameters, by kind
        "options": {...}                          # AttentionOptions.to_dict()
    }

``parameters`` can be wider than ``linear_layers``: a model converted to ``mhla`` and switched back to ``flash``
keeps its mixing matrices, so it can switch again without reloading weights.

:meth:`Conversion.from_config` is the one check of that entry (a saved folder's, before any weight is read);
readers that must not import diffusers (the app's page start, a model folder's description) use it on the JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import mhla
from mhla.layout import Grid

from .attention import PARAM_ATTRS, SOFTMAX, AttentionOptions, variant_spec

CONFIG_KEY = "self_attention"
_KEYS = ("variant", "linear_layers", "parameters", "options")


def _no_parameters() -> Mapping[str, tuple[int, ...]]:
    return MappingProxyType({kind: () for kind in PARAM_ATTRS})


@dataclass(frozen=True)
class Conversion:
    """A transformer's self-attention conversion (see the module docstring).

    Args:
        variant: the variant that runs, one of :data:`pipelines.attention.VARIANTS`.
        linear_layers: the layers that run linear attention (MHLA or vanilla) now, ascending.
        parameters: by kind (a key of :data:`pipelines.attention.PARAM_ATTRS`), the layers that own that kind's new
            parameters, ascending; every kind is present.
        options: the layers' :class:`AttentionOptions`.
    """

    variant: str = SOFTMAX
    linear_layers: tuple[int, ...] = ()
    parameters: Mapping[str, tuple[int, ...]] = field(default_factory=_no_parameters)
    options: AttentionOptions = field(default_factory=AttentionOptions)

    def __post_init__(self) -> None:
        variant_spec(self.variant)  # a known variant, or a ValueError naming it
        unknown = set(self.parameters) - set(PARAM_ATTRS)
        if unknown:
            raise ValueError(f"parameter kinds {sorted(unknown)} are unknown; expected some of {list(PARAM_ATTRS)}")
        params = {kind: tuple(sorted({int(i) for i in self.parameters.get(kind, ())})) for kind in PARAM_ATTRS}
        object.__setattr__(self, "parameters", MappingProxyType(params))
        object.__setattr__(self, "linear_layers", tuple(sorted({int(i) for i in self.linear_layers})))

    def __deepcopy__(self, memo: dict[int, Any]) -> Conversion:
        return self  # frozen, all the way down: a copied model shares its record

    @property
    def converted(self) -> bool:
        """Whether any layer runs linear attention or owns new parameters."""
        return bool(self.linear_layers) or any(self.parameters.values())

    @property
    def blocks(self) -> Grid | None:
        """The model's own MHLA block count (its mixing matrices are ``M x M`` for it), or None when no layer has
        MHLA parameters (a softmax or linear-only model: a conversion is free to choose)."""
        return self.options.blocks if self.parameters["mhla"] else None

    @property
    def explicit_layers(self) -> list[int] | None:
        """The layer list to pass to a conversion that restores this one: the linear layers of a variant that takes
        an explicit list (``mhla-hybrid``), else None (the variant decides)."""
        return list(self.linear_layers) if variant_spec(self.variant).layers else None

    def to_config(self) -> dict[str, Any]:
        """The JSON form written under :data:`CONFIG_KEY` (lists, the options as a dict)."""
        return {
            "variant": self.variant,
            "linear_layers": list(self.linear_layers),
            "parameters": {kind: list(layers) for kind, layers in self.parameters.items()},
            "options": self.options.to_dict(),
        }

    @classmethod
    def from_config(cls, entry: Any, num_layers: int) -> Conversion:
        """The :data:`CONFIG_KEY` entry of a config, checked: ``None`` or empty is the unconverted model; anything
        malformed (not an object, keys missing, unknown kinds or options, layers outside ``0 ... num_layers - 1``)
        raises ``ValueError`` naming what is wrong."""
        if not entry:
            return cls()
        if not isinstance(entry, Mapping):
            raise ValueError(f"config {CONFIG_KEY!r} must be a JSON object, got {type(entry).__name__}")
        missing = [k for k in _KEYS if k not in entry]
        if missing:
            raise ValueError(f"config {CONFIG_KEY!r} lacks {missing}; expected the keys {list(_KEYS)}")
        params = entry["parameters"]
        if not isinstance(params, Mapping) or set(params) - set(PARAM_ATTRS):
            raise ValueError(
                f"config {CONFIG_KEY!r}.parameters must map {'/'.join(map(repr, PARAM_ATTRS))} to layer lists, "
                f"got {params!r}"
            )
        for name, layers in [("linear_layers", entry["linear_layers"]), *params.items()]:
            where = name if name == "linear_layers" else f"parameters[{name!r}]"
            if not isinstance(layers, Sequence) or isinstance(layers, str):
                raise ValueError(f"config {CONFIG_KEY!r}.{where} must be a list of layer indices, got {layers!r}")
            bad = [i for i in layers if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers)]
            if bad:
                raise ValueError(f"config {CONFIG_KEY!r}.{where} names layers {bad} outside 0 ... {num_layers - 1}")
        options = entry["options"]
        if not isinstance(options, Mapping):
            raise ValueError(f"config {CONFIG_KEY!r}.options must be a JSON object, got {options!r}")
        return cls(entry["variant"], tuple(entry["linear_layers"]), params, AttentionOptions.from_dict(dict(options)))

    def resolve_blocks(
        self,
        grid: Sequence[int],
        requested: str | Sequence[int] | None = None,
        block_shape: Grid = mhla.PAPER_BLOCK_SHAPE,
    ) -> mhla.ResolvedBlocks:
        """The block rule (:func:`mhla.resolve_blocks`) for this model on ``grid``: ``requested``, else the model's
        own blocks (:attr:`blocks`), else the default for ``block_shape`` (the model's target block shape in
        tokens)."""
        return mhla.resolve_blocks(grid, requested, self.blocks, block_shape)


__all__ = ["CONFIG_KEY", "Conversion"]

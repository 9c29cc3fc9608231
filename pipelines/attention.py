"""Self-attention variants of diffusers' Wan transformer, as attention processors.

Four variants (``VARIANTS``; what each takes and runs: ``VARIANT_SPECS``):

- ``flash``: softmax attention through diffusers' ``dispatch_attention_fn`` (its backends: torch SDPA by default,
  FlashAttention, xformers, ... chosen with ``set_attention_backend`` or ``AttentionOptions.softmax_backend``).
- ``linear``: vanilla linear attention in every self-attention layer.
- ``mhla``: 3D spatiotemporal multi-head linear attention in every self-attention layer.
- ``mhla-hybrid``: MHLA in the layers of :func:`hybrid_layers` (default: all but 0, 3, 6, ...), softmax elsewhere.

A processor reuses the layer's ``to_q / to_k / to_v / to_out`` and ``norm_q / norm_k`` unchanged. The new
parameters of a linear-attention layer live in a :class:`LinearSelfAttention` submodule added to that
layer's ``attn1`` (``attn1.mhla`` or ``attn1.linear_attn``), so they train, save and load with the model.
Cross-attention (``attn2``) is never touched.

Nothing in a processor's traced path has a Python side effect: the per-call timer and the notes of what ran
(layout, backend) run in eager mode only, and MHLA / linear attention enter a compiled graph as custom ops
(:mod:`mhla.compiled`), so ``torch.compile(fullgraph=True)`` sees no graph break.

Processors do not receive the latent-token grid ``(F, H, W)``; the transformer's ``forward`` records it from
``hidden_states`` ``(B, C, T, H, W)`` into a :class:`SelfAttentionContext` that every processor of the model shares
(see :mod:`pipelines.model`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mhla
from common.timing import AttentionTimer
from mhla.compiled import attention_op
from mhla.layout import Grid
from mhla.rope import Rotary

OUTPUT_NORMS = ("rms_head", "none")
# Which submodule of attn1 holds a layer's new parameters, by kind of linear attention.
PARAM_ATTRS = {"mhla": "mhla", "linear": "linear_attn"}


@dataclass(frozen=True)
class VariantSpec:
    """What a self-attention variant is, for every caller that checks or describes one.

    Args:
        name: the variant's name (``--variant``, ``GenerationRequest.variant``, a saved model's config).
        label: how tables and reports name it for a reader (``"softmax (FA)"``, ``"MHLA-hybrid"``).
        param_kind: the kind of new parameters (a key of :data:`PARAM_ATTRS`) its linear-attention layers run
            on; for a variant without such layers, the kind a switch from it would add.
        linear: which layers run linear attention: ``"none"``, ``"all"`` or ``"hybrid"`` (a chosen list).
        blocks: takes an MHLA block layout.
        layers: takes an explicit list of its linear-attention layers.
    """

    name: str
    label: str
    param_kind: str
    linear: str
    blocks: bool
    layers: bool

    @property
    def softmax_layers(self) -> bool:
        """Keeps softmax self-attention layers."""
        return self.linear != "all"


# the names by role, for code that means one: SOFTMAX is a model as loaded, before any conversion
SOFTMAX, LINEAR, MHLA, HYBRID = "flash", "linear", "mhla", "mhla-hybrid"
# The variants, in the order the CLI and the app list them: the one place their names and rules are written. A new
# variant is a row here (and its processor's branch, if it runs a new kind of attention: docs/architecture.md).
VARIANT_SPECS: dict[str, VariantSpec] = {
    spec.name: spec
    for spec in (
        VariantSpec(SOFTMAX, "softmax (FA)", param_kind="mhla", linear="none", blocks=False, layers=False),
        VariantSpec(LINEAR, "linear", param_kind="linear", linear="all", blocks=False, layers=False),
        VariantSpec(MHLA, "MHLA", param_kind="mhla", linear="all", blocks=True, layers=False),
        VariantSpec(HYBRID, "MHLA-hybrid", param_kind="mhla", linear="hybrid", blocks=True, layers=True),
    )
}
VARIANTS = tuple(VARIANT_SPECS)
DEFAULT_VARIANT = HYBRID  # what the CLI generates when no variant is named
MHLA_VARIANTS = tuple(v for v, spec in VARIANT_SPECS.items() if spec.blocks)  # take a block layout
LAYERS_VARIANTS = tuple(v for v, spec in VARIANT_SPECS.items() if spec.layers)  # take an explicit layer list
SOFTMAX_VARIANTS = tuple(v for v, spec in VARIANT_SPECS.items() if spec.softmax_layers)


def variant_spec(variant: str) -> VariantSpec:
    """The spec of ``variant``; raises ``ValueError`` naming it and the known variants."""
    spec = VARIANT_SPECS.get(variant) if isinstance(variant, str) else None
    if spec is None:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    return spec


def parse_variants(spec: str) -> list[str]:
    """A command line's variant list: one name, names joined by commas, or ``all``; ValueError naming an unknown
    one. Empty: :data:`DEFAULT_VARIANT`."""
    names = list(VARIANTS) if spec == "all" else [v.strip() for v in spec.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; expected one of {', '.join(VARIANTS)} (or 'all')")
    return names or [DEFAULT_VARIANT]


def check_transformer_variant(transformer: str, own: str, spec: str) -> None:
    """A ``--transformer`` fine-tuned as a converted variant (MHLA, linear, hybrid: its attention weights were
    trained for that attention, and its own parameters belong to it) runs as that variant only: another one would
    silently run other attention on its weights, so it is refused naming the checkpoint's variant. A softmax
    (``flash``) transformer serves every variant (it is converted afresh)."""
    if own == SOFTMAX:
        return
    others = [v for v in parse_variants(spec) if v != own]
    if others:
        raise ValueError(
            f"--variant {spec}: --transformer {transformer!r} was fine-tuned as variant {own!r} (its "
            f"attention weights were trained for {own}); running it as {', '.join(others)} would put other "
            f"attention on them. Expected --variant {own} (or no --variant), or a softmax (flash) --transformer to "
            "convert afresh"
        )


def check_lora_variant(lora: str, own: str, spec: str) -> None:
    """A LoRA trained with a converted variant's own attention parameters (MHLA, linear) runs as that variant
    only, as a ``--transformer`` fine-tuned as it does (:func:`check_transformer_variant`)."""
    others = [v for v in parse_variants(spec) if v != own]
    if others:
        raise ValueError(
            f"--variant {spec}: --lora {lora!r} was trained as variant {own!r} with its own attention parameters; "
            f"running it as {', '.join(others)} would put other attention on them. Expected --variant {own} "
            "(or no --variant)"
        )


@dataclass(frozen=True)
class AttentionOptions:
    """How converted self-attention layers compute. Defaults are the paper's Wan settings.

    Args:
        blocks: MHLA block count per axis ``(bf, bh, bw)``; fixed per converted model (the mixing matrix
            is ``M x M`` with ``M = bf * bh * bw``). Paper: 7x3x5 = 105 blocks at 21x30x50 tokens.
        feature_map: ``"relu"`` (relu(x) + 1e-6, paper) or ``"elu"``.
        normalize: divide by ``phi(q) . z``. Off for Wan: the paper drops the normalizer for long
            sequences, and the output RMSNorm takes over the scale.
        output_norm: ``"rms_head"``: RMSNorm over each head's ``head_dim`` channels (one weight shared
            across heads, as the authors' code), applied before ``to_out``; ``"none"``.
        output_gate: multiply the output by ``2 * sigmoid(W x + b)`` of the layer input ``x``; ``W, b``
            start at zero so a freshly converted layer is ungated.
        cpe: add a depthwise 3x3x3 convolution of ``v`` over the latent-token grid to the output (after the
            output norm, before the gate): the paper's CPE (Table 3a), which helps small models, whose linear
            attention has no notion of a token's neighbours. Its weights start at zero, so turning it on in a
            converted model (trained or not) changes nothing until it trains.
        rope: apply Wan's RoPE to ``phi(q), phi(k)`` in the numerator (never the normalizer).
        eps: added to the normalizer.
        mixing_init, learnable_mixing, per_head_mixing: as :class:`mhla.MHLA`.
        constrain_mixing: clamp the mixing matrix to [0, 1] and renormalise its rows on every use (the
            paper's rule). ``False`` uses the stored matrix as it is, as the MHLA authors' code does: only for
            their published checkpoints (see :mod:`pipelines.import_official`), never for our conversions.
        softmax_backend: backend for softmax layers, one of :data:`mhla.SOFTMAX_BACKENDS`, run as the diffusers
            attention backend of :data:`DIFFUSERS_BACKENDS` (``"auto"``: diffusers' active backend, torch's SDPA
            unless ``attention_backend(...)`` says otherwise); ``set_attention_backend`` on the model wins.
    """

    blocks: Grid = mhla.parse_blocks("7x3x5")
    feature_map: str = "relu"
    normalize: bool = False
    output_norm: str = "rms_head"
    output_gate: bool = False
    cpe: bool = False
    rope: bool = True
    eps: float = 1e-6
    mixing_init: str = "locality"
    learnable_mixing: bool = True
    per_head_mixing: bool = False
    softmax_backend: str = "auto"
    constrain_mixing: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", mhla.parse_blocks(self.blocks))
        mhla.get_feature_map(self.feature_map)
        if self.output_norm not in OUTPUT_NORMS:
            raise ValueError(f"output_norm must be one of {OUTPUT_NORMS}, got {self.output_norm!r}")
        if not isinstance(self.cpe, bool):
            raise ValueError(f"cpe must be True or False, got {self.cpe!r}")
        if not isinstance(self.constrain_mixing, bool):
            raise ValueError(f"constrain_mixing must be True or False, got {self.constrain_mixing!r}")
        if self.softmax_backend not in mhla.SOFTMAX_BACKENDS:
            raise ValueError(f"softmax_backend must be one of {mhla.SOFTMAX_BACKENDS}, got {self.softmax_backend!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocks"] = list(self.blocks)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionOptions:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown attention options {sorted(unknown)}; expected some of {sorted(known)}")
        return cls(**d)

    def replace(self, **changes: Any) -> AttentionOptions:
        return replace(self, **changes)


def parameter_kind(variant: str) -> str:
    """The kind of new parameters (a key of :data:`PARAM_ATTRS`) that ``variant``'s linear-attention layers
    run on: ``"linear"`` for ``linear``, ``"mhla"`` for ``mhla`` and ``mhla-hybrid`` (and for ``flash``, which
    has none: the kind a switch from it would add)."""
    return variant_spec(variant).param_kind


def _names(variants: Iterable[str]) -> str:
    return " and ".join(map(repr, variants))


def hybrid_layers(num_layers: int, softmax_every: int = 3) -> list[int]:
    """Default MHLA layers of ``mhla-hybrid``: all but 0, 3, 6, ... (20 of 30 for Wan2.1-1.3B)."""
    return [i for i in range(num_layers) if i % softmax_every != 0]


def linear_layers_for(variant: str, num_layers: int, layers: Iterable[int] | None = None) -> list[int]:
    """Indices of the layers that ``variant`` runs as linear attention (MHLA or vanilla).

    ``layers`` (an explicit list) is accepted for ``mhla-hybrid`` only.
    """
    spec = variant_spec(variant)
    if layers is not None and not spec.layers:
        raise ValueError(
            f"an explicit layer list applies to {_names(LAYERS_VARIANTS)} only, got layers={layers!r} for {variant!r}"
        )
    if spec.linear == "none":
        return []
    if spec.linear == "all":
        return list(range(num_layers))
    if layers is None:
        return hybrid_layers(num_layers)
    out = sorted({int(i) for i in layers})
    if not out:
        raise ValueError(f"{variant} needs at least one MHLA layer, got an empty layer list")
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"layer indices {bad} are out of range for a transformer with {num_layers} layers (0 ... {num_layers - 1})"
        )
    return out


def parse_layers(spec: str, num_layers: int | None = None) -> list[int]:
    """``"1,2,4-6"`` -> ``[1, 2, 4, 5, 6]``. A reversed range (``5-2``), negative indices or an empty list
    are refused; with ``num_layers`` so are indices past the last layer."""
    out = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-"))
                if a > b:
                    raise ValueError(
                        f"layers {spec!r}: the range {part!r} runs backwards; expected low-high, e.g. {b}-{a}"
                    )
                out += list(range(a, b + 1))
            else:
                out.append(int(part))
        except ValueError as e:
            if "backwards" in str(e):
                raise
            raise ValueError(f"layers must look like '1,2,4-6' (non-negative indices), got {spec!r}") from None
    if not out:
        raise ValueError(f"layers {spec!r} names no layer; {HYBRID} needs at least one MHLA layer, e.g. '1,2,4-5'")
    if num_layers is not None:
        linear_layers_for(HYBRID, num_layers, out)  # range check, naming the bad indices
    return sorted(set(out))


class HeadRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over each head's channels that casts its weight to the input's dtype (float16 inputs are
    normalised in float32, see :meth:`LinearSelfAttention.forward`). Called as a module, so diffusers' offload
    and casting hooks on it run (the weight is on the right device and dtype when it is read)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class LinearSelfAttention(nn.Module):
    """The new parameters and the attention core of one converted self-attention layer.

    ``kind="mhla"`` owns an :class:`mhla.MHLA` (mixing matrix, ``.mhla.mixing.weight``);
    ``kind="linear"`` is vanilla linear attention (no mixing). Both optionally own an output
    per-head RMSNorm (``.norm_out``), an output gate (``.gate``) and a depthwise convolution of ``v`` (``.cpe``).
    """

    def __init__(self, kind: str, dim: int, num_heads: int, head_dim: int, options: AttentionOptions):
        super().__init__()
        if kind not in PARAM_ATTRS:
            raise ValueError(f"kind must be one of {tuple(PARAM_ATTRS)}, got {kind!r}")
        self.kind = kind
        self.options = options
        self.mhla = None
        if kind == "mhla":
            self.mhla = mhla.MHLA(
                options.blocks,
                feature_map=options.feature_map,
                normalize=options.normalize,
                eps=options.eps,
                mixing_init=options.mixing_init,
                learnable_mixing=options.learnable_mixing,
                per_head_mixing=options.per_head_mixing,
                num_heads=num_heads,
                constrain_mixing=options.constrain_mixing,
            )
        self.norm_out = HeadRMSNorm(head_dim, eps=1e-6) if options.output_norm == "rms_head" else None
        self.gate = None
        if options.output_gate:
            self.gate = nn.Linear(dim, num_heads * head_dim)
            nn.init.zeros_(self.gate.weight)
            nn.init.zeros_(self.gate.bias)
        self.cpe: nn.Conv3d | None = None
        if options.cpe:
            self.add_cpe(num_heads * head_dim)

    def add_cpe(self, channels: int) -> None:
        """The zero-initialised depthwise 3x3x3 convolution of :attr:`AttentionOptions.cpe` (a layer converted
        without one gets it here: with zero weights the layer computes what it did)."""
        ref = next(self.parameters(), None)
        conv = nn.Conv3d(channels, channels, 3, padding=1, groups=channels)
        nn.init.zeros_(conv.weight)
        nn.init.zeros_(conv.bias)  # type: ignore[arg-type]  # bias=True: never None
        if ref is not None and ref.device.type != "meta":
            dtype = ref.dtype if self.norm_out is None else self.norm_out.weight.dtype
            conv.to(device=ref.device, dtype=dtype)
        self.cpe = conv

    def _positional(self, v: torch.Tensor, grid: Grid | mhla.ResolvedBlocks | None) -> torch.Tensor:
        """The CPE term ``(B, N, H, D)``: ``v`` laid on the token grid ``(F, H, W)`` (tokens in Wan's order,
        frame-major), each channel convolved with its own 3x3x3 kernel, zero-padded."""
        if grid is None:
            raise RuntimeError(
                "cpe needs the latent-token grid (F, H, W); run the layer inside an MHLAWanTransformer3DModel"
            )
        f, h, w = grid.layout.grid if isinstance(grid, mhla.ResolvedBlocks) else grid
        b, n, heads, d = v.shape
        assert self.cpe is not None
        x = v.reshape(b, f, h, w, heads * d).permute(0, 4, 1, 2, 3).to(self.cpe.weight.dtype)
        return self.cpe(x).permute(0, 2, 3, 4, 1).reshape(b, n, heads, d)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: Grid | mhla.ResolvedBlocks | None,
        rotary_emb: Rotary | None = None,
        x: torch.Tensor | None = None,
        parallel: Any = None,
    ) -> torch.Tensor:
        """q, k, v ``(B, N, H, D)``; ``grid`` ``(F, H, W)`` with ``F*H*W == N``, or the MHLA's
        :meth:`mhla.MHLA.resolve` of it (MHLA only);
        ``x`` the layer input ``(B, N, dim)`` (gate only). Returns ``(B, N, H, D)``.
        ``parallel``: diffusers' ``ContextParallelConfig`` when q, k, v are this process's slice of a sequence
        split across processes (``grid`` is then the whole sequence's; see :mod:`pipelines.context_parallel`)."""
        rope = rotary_emb if self.options.rope else None
        out_dtype = q.dtype
        # q, k, v go in as they are (the operator accumulates in float32 and the fused kernels read
        # half precision directly). The un-normalised phi(q) S grows with the token count and could
        # overflow float16 before the RMSNorm, so float16 asks for a float32 output; bfloat16 has
        # float32's range and keeps its own dtype (a float32 output cost ~0.5 ms per layer on the GPU path).
        compute = q.dtype if q.dtype == torch.bfloat16 else torch.promote_types(q.dtype, torch.float32)
        if parallel is not None and self.cpe is not None:
            raise ValueError(
                "cpe (a convolution over the whole token grid) does not run under context parallelism, whose "
                "processes each hold a slice of the sequence; run this model on one device per video"
            )
        if parallel is not None:
            out = self._sequence_parallel(q, k, v, grid, rope, compute, parallel)
        elif self.mhla is None:
            o = self.options
            if torch.compiler.is_compiling():  # one opaque op in the graph (see mhla.compiled); same numbers
                out = attention_op(
                    q, k, v, None, (1, 1, 1), (1, 1, 1), o.feature_map, o.normalize, rope, o.eps, True, compute
                )
            else:
                out = mhla.linear_attention(q, k, v, o.feature_map, o.normalize, rope, o.eps, out_dtype=compute)
        else:
            if grid is None:
                raise RuntimeError(
                    "MHLA needs the latent-token grid (F, H, W) but none was recorded; run it inside an "
                    "MHLAWanTransformer3DModel (pipelines.convert_self_attention), whose forward records it"
                )
            out = self.mhla(q, k, v, grid, rope, out_dtype=compute)  # shrinks its layout to a small grid itself
        if self.norm_out is not None:
            out = self.norm_out(out)  # the module, not its weight: offload hooks must see the call
        if self.cpe is not None:
            out = out + self._positional(v, grid).to(out.dtype)
        if self.gate is not None:
            out = out * (2.0 * torch.sigmoid(self.gate(x))).unflatten(-1, (out.shape[2], -1)).to(out.dtype)
        return out.to(out_dtype)

    def _sequence_parallel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: Grid | mhla.ResolvedBlocks | None,
        rope: Rotary | None,
        compute: torch.dtype,
        config: Any,
    ) -> torch.Tensor:
        """The attention core on this process's slice (Ulysses or ring, as ``config`` says); exact."""
        from mhla.parallel import mhla_attention_sharded

        from .context_parallel import gather_sequence, parallel_kind, ring_start, ulysses

        if grid is None:
            raise RuntimeError("context parallelism needs the latent-token grid; convert the model first")
        kind = parallel_kind(config)
        if kind is None:
            raise RuntimeError("a context-parallel call without ring_degree or ulysses_degree above 1")
        how, group = kind
        whole: Grid = (
            grid.layout.grid if isinstance(grid, mhla.ResolvedBlocks) else (int(grid[0]), int(grid[1]), int(grid[2]))
        )
        o = self.options
        if self.mhla is None:  # linear attention: one block over the whole grid, mixing 1
            layout = mhla.BlockLayout(whole, (1, 1, 1))
            mixing = torch.ones(1, 1, device=q.device)
        else:
            layout = (grid if isinstance(grid, mhla.ResolvedBlocks) else self.mhla.resolve(whole)).layout
            mixing = self.mhla.mixing_for(layout)
        n = layout.num_tokens
        if how == "ring":
            return mhla_attention_sharded(
                q, k, v, layout, mixing, ring_start(n, group), o.feature_map, o.normalize, rope, o.eps, group, compute
            )
        full_rope = None if rope is None else (gather_sequence(rope[0], n, group), gather_sequence(rope[1], n, group))

        def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, heads: slice) -> torch.Tensor:
            m = mixing[heads] if mixing.dim() == 3 else mixing
            return mhla.mhla_attention(
                qh, kh, vh, layout, m, o.feature_map, o.normalize, full_rope, o.eps, out_dtype=compute
            )

        return ulysses(q, k, v, n, group, attend)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


@dataclass
class SelfAttentionContext:
    """State shared by the attention processors of one transformer.

    ``grid``: the latent-token grid of the current forward, set by the transformer's ``forward``.
    ``text_mask``: which caption tokens the cross-attention reads in the current forward, ``(B, 1, 1, L)`` bool, set
    by the transformer's ``forward`` when it masks the caption's padding (``None``: every token, diffusers' way).
    ``timer``: accumulates time inside self-attention when enabled.
    ``softmax_backend``: name of the backend the last softmax layer ran on.
    ``layouts``: the MHLA layout used in the last forward, as text (one entry per distinct layout).
    """

    grid: Grid | None = None
    text_mask: torch.Tensor | None = None
    timer: AttentionTimer = field(default_factory=AttentionTimer)
    softmax_backend: str | None = None
    layouts: set[str] = field(default_factory=set)

    def __deepcopy__(self, memo: dict[int, Any]) -> SelfAttentionContext:
        # a copied model (MHLAWanTransformer3DModel.clone) gets an empty context of its own: its processors, copied
        # in the same deepcopy, all point at this one new context (deepcopy's memo), never at the original's
        return type(self)()


class SelfAttentionProcessor:
    """Base processor for a Wan self-attention layer (``attn1``): projections, q/k norms, heads.

    Subclasses implement :meth:`attend` on ``(B, N, H, D)`` tensors. Called by ``WanAttention`` as
    ``(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)``.
    """

    variant = ""
    # diffusers' enable_parallelism sets this (a ParallelConfig) on processors that have the attribute: set the
    # processors (convert) before enabling parallelism
    _parallel_config: Any = None

    def __init__(self, context: SelfAttentionContext, layer: int):
        self.context = context
        self.layer = layer

    def __call__(
        self,
        attn: Any,  # diffusers' WanAttention
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Rotary | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise ValueError(f"{type(self).__name__} is for self-attention (attn1) only; it got encoder_hidden_states")
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__} does not support an attention_mask (Wan never passes one)")
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        # Wan's q/k RMSNorm spans all heads, so it runs before the head split, as in diffusers' processor.
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if torch.compiler.is_compiling() or not self.context.timer.enabled:
            out = self.attend(attn, query, key, value, rotary_emb, hidden_states)
        else:  # timing asked for, in eager mode only: a compiled graph has no per-call clock
            with self.context.timer.measure(query.device):
                out = self.attend(attn, query, key, value, rotary_emb, hidden_states)
        if not torch.compiler.is_compiling():  # bookkeeping for timing tables; never traced
            self.note(attn)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def note(self, attn: Any) -> None:
        """Records what this layer ran (backend, layout) in the shared context; eager calls only."""

    def attend(
        self,
        attn: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_emb: Rotary | None,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer})"


# the project's softmax backend names (AttentionOptions.softmax_backend) as diffusers' attention backends
DIFFUSERS_BACKENDS = {
    "sdpa": "native",
    "sdpa_cudnn": "_native_cudnn",
    "sdpa_flash": "_native_flash",
    "sdpa_efficient": "_native_efficient",
    "sdpa_math": "_native_math",
    "flash_attn": "flash",
    "flash_attn_3": "_flash_3",
    "xformers": "xformers",
}
_PROJECT_NAMES = {v: k for k, v in DIFFUSERS_BACKENDS.items()}


def diffusers_backend(name: str) -> Any:
    """The diffusers ``AttentionBackendName`` for a project backend name (``None`` for ``"auto"``: diffusers'
    active backend, torch's SDPA unless ``set_attention_backend`` / ``attention_backend(...)`` chose another)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    if name == "auto":
        return None
    if name not in DIFFUSERS_BACKENDS:
        raise ValueError(f"softmax_backend must be one of {mhla.SOFTMAX_BACKENDS}, got {name!r}")
    backend = AttentionBackendName(DIFFUSERS_BACKENDS[name])
    try:  # a package that is missing (flash-attn, xformers) is named now, not at the first forward
        _check_attention_backend_requirements(backend)
    except RuntimeError as e:
        raise ValueError(f"softmax backend {name!r} (diffusers' {backend.value!r}) cannot run here: {e}") from None
    return backend


class SoftmaxSelfAttnProcessor(SelfAttentionProcessor):
    """Softmax self-attention (the ``flash`` variant, and the hybrid's softmax layers) through diffusers'
    ``dispatch_attention_fn``, as diffusers' own ``WanAttnProcessor``.

    The backend: ``_attention_backend`` when diffusers' ``set_attention_backend`` has set it, else the
    options' ``softmax_backend`` (``"auto"``: diffusers' active backend, which ``attention_backend(...)``
    switches; torch's SDPA by default).
    """

    variant = SOFTMAX
    _attention_backend: Any = None  # set by diffusers' ModelMixin.set_attention_backend / reset_attention_backend

    def __init__(self, context: SelfAttentionContext, layer: int, backend: str = "auto"):
        super().__init__(context, layer)
        self.backend = backend
        self._options_backend = diffusers_backend(backend)

    def attend(
        self,
        attn: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_emb: Rotary | None,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if rotary_emb is not None:
            # same rotation as diffusers' WanAttnProcessor, computed in float32, back to the input dtype
            q = mhla.apply_rotary(q, rotary_emb).type_as(v)
            k = mhla.apply_rotary(k, rotary_emb).type_as(v)
        backend = self._attention_backend if self._attention_backend is not None else self._options_backend
        return dispatch_attention_fn(q, k, v, backend=backend, parallel_config=self._parallel_config)

    def backend_name(self) -> str:
        """The backend this layer runs now, in the project's names (``"sdpa"`` for diffusers' ``native``)."""
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        backend = self._attention_backend if self._attention_backend is not None else self._options_backend
        if backend is None:
            backend = _AttentionBackendRegistry.get_active_backend()[0]  # what dispatch_attention_fn does
        name = str(getattr(backend, "value", backend))
        return _PROJECT_NAMES.get(name, name)

    def note(self, attn: Any) -> None:
        self.context.softmax_backend = self.backend_name()


class LinearSelfAttnProcessor(SelfAttentionProcessor):
    """Linear or MHLA self-attention through the layer's :class:`LinearSelfAttention` submodule."""

    def __init__(self, context: SelfAttentionContext, layer: int, variant: str):
        super().__init__(context, layer)
        self.variant = variant
        self.param_kind = parameter_kind(variant)
        self._resolved: mhla.ResolvedBlocks | None = None  # the last eager call's layout, for its note

    def attend(
        self,
        attn: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_emb: Rotary | None,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        module: LinearSelfAttention = getattr(attn, PARAM_ATTRS[self.param_kind])
        grid = self.context.grid
        cp = getattr(self._parallel_config, "context_parallel_config", None)
        if cp is not None:  # this process holds a slice of the sequence: pipelines.context_parallel
            return module(q, k, v, grid, rotary_emb, hidden_states, parallel=cp)
        if module.mhla is None or grid is None or torch.compiler.is_compiling():
            return module(q, k, v, grid, rotary_emb, hidden_states)
        # the block rule, once per call: the run and the note (eager only) share this answer
        self._resolved = module.mhla.resolve(grid)
        return module(q, k, v, self._resolved, rotary_emb, hidden_states)

    def note(self, attn: Any) -> None:
        if self._resolved is not None:
            self.context.layouts.add(str(self._resolved))
            self._resolved = None

"""MHLA and linear attention as ``torch.library`` custom ops, for ``torch.compile(fullgraph=True)``.

The eager operator (:func:`mhla.mhla_attention`, :func:`mhla.linear_attention`) runs its CPU path on a pool of
threads with reused buffers and its GPU path through autotuned Triton kernels: neither can be traced by
TorchDynamo. Wrapped as custom ops they are single nodes of the graph (no graph break), shaped by a fake
implementation, and run the same fast paths. The gradient is a second op that recomputes the forward
through the eager operator's own backward, so a compiled training step pays one extra forward per layer.

:func:`attention_op` is what :class:`mhla.MHLA` and the Wan processors call while compiling; eager calls keep
using the operator directly.
"""

from typing import cast

import torch

from .checks import check_compile_mode
from .layout import Grid, cached_layout, fit_blocks
from .mixing import resample_mixing
from .ops import linear_attention, mhla_attention
from .rope import Rotary


def _eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    grid: list[int],
    blocks: list[int],
    feature_map: str,
    normalize: bool,
    eps: float,
    renormalize: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    rope = None if cos is None or sin is None else (cos, sin)
    if mixing is None:
        return linear_attention(q, k, v, feature_map, normalize, rope, eps, out_dtype=out_dtype)
    layout = cached_layout(cast(Grid, tuple(grid)), cast(Grid, tuple(blocks)))
    return mhla_attention(q, k, v, layout, mixing, feature_map, normalize, rope, eps, out_dtype=out_dtype)


@torch.library.custom_op("mhla::attention", mutates_args=())
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    grid: list[int],
    blocks: list[int],
    feature_map: str,
    normalize: bool,
    eps: float,
    renormalize: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _eager(q, k, v, mixing, cos, sin, grid, blocks, feature_map, normalize, eps, renormalize, out_dtype)


@_attention.register_fake
def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    grid: list[int],
    blocks: list[int],
    feature_map: str,
    normalize: bool,
    eps: float,
    renormalize: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return q.new_empty((*q.shape[:3], v.shape[-1]), dtype=out_dtype)


@torch.library.custom_op("mhla::attention_backward", mutates_args=())
def _attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    grid: list[int],
    blocks: list[int],
    feature_map: str,
    normalize: bool,
    eps: float,
    renormalize: bool,
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Gradients for q, k, v and the mixing matrix (an empty tensor without mixing): the forward recomputed
    through the eager operator's autograd Function (its hand-written backward). Inside a custom op plain
    tensor ops record no autograd graph, so every input here must reach that Function directly: the
    mixing is resampled for a shrunk layout before the op (see :func:`attention_op`), not in it."""
    with torch.enable_grad():
        q1, k1, v1 = (t.detach().requires_grad_(True) for t in (q, k, v))
        m = None if mixing is None else mixing.detach().requires_grad_(True)
        out = _eager(q1, k1, v1, m, cos, sin, grid, blocks, feature_map, normalize, eps, renormalize, out_dtype)
        wrt = [q1, k1, v1] if m is None else [q1, k1, v1, m]
        grads = torch.autograd.grad(out, wrt, grad, allow_unused=True)
    result = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt, strict=True)]
    return result if m is not None else [*result, q.new_empty(0)]


@_attention_backward.register_fake
def _attention_backward_fake(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    grid: list[int],
    blocks: list[int],
    feature_map: str,
    normalize: bool,
    eps: float,
    renormalize: bool,
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    dm = q.new_empty(0) if mixing is None else torch.empty_like(mixing)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dm]


# torch.compile's own modes (its ``mode`` argument), for :func:`compile_transformer`'s ``compile_mode``
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")

_ARGS = ("grid", "blocks", "feature_map", "normalize", "eps", "renormalize", "out_dtype")


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    q, k, v, mixing, cos, sin, *rest = inputs
    ctx.save_for_backward(q, k, v, mixing, cos, sin)  # type: ignore[arg-type]
    ctx.rest = rest  # type: ignore[attr-defined]
    ctx.has_mixing = mixing is not None  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, mixing, cos, sin = ctx.saved_tensors  # type: ignore[attr-defined]
    dq, dk, dv, dm = _attention_backward(grad, q, k, v, mixing, cos, sin, *ctx.rest)  # type: ignore[attr-defined]
    return (dq, dk, dv, dm if ctx.has_mixing else None) + (None,) * (2 + len(_ARGS))  # type: ignore[attr-defined]


_attention.register_autograd(_backward, setup_context=_setup)


def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mixing: torch.Tensor | None,
    grid: Grid,
    blocks: Grid,
    feature_map: str,
    normalize: bool,
    rotary_emb: Rotary | None,
    eps: float,
    renormalize: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """MHLA (``mixing`` ``(M, M)`` or ``(H, M, M)`` of the model's ``blocks``, on the token ``grid``, shrunk as
    :meth:`mhla.MHLA.layout`) or linear attention (``mixing=None``; grid and blocks unused) as one custom op.

    q, k ``(B, N, H, D)``, v ``(B, N, H, E)``; returns ``(B, N, H, E)`` in ``out_dtype``. The same numbers as
    the eager operator. RoPE tables get no gradient (Wan's are constants)."""
    cos, sin = (None, None) if rotary_emb is None else rotary_emb
    if mixing is not None:
        used = fit_blocks(blocks, grid)
        if used != tuple(blocks):  # traced tensor ops (differentiable), as MHLA.mixing_for
            mixing = resample_mixing(mixing, blocks, used, renormalize=renormalize)
        blocks = used
    return _attention(
        q, k, v, mixing, cos, sin, list(grid), list(blocks), feature_map, normalize, eps, renormalize, out_dtype
    )


def compile_transformer(
    model: torch.nn.Module,
    mode: str = "blocks",
    backend: str | None = None,
    fullgraph: bool = False,
    compile_mode: str | None = None,
) -> torch.nn.Module:
    """``torch.compile`` of a diffusers transformer, in place (the pipelines call it as before).

    ``"blocks"``: its repeated blocks (diffusers' ``compile_repeated_blocks``: one compile reused by the 30
    Wan layers, seconds instead of minutes); ``"full"``: the whole forward. The MHLA and linear attention
    inside run as the custom ops above (one graph node each, the fused kernels on a GPU); inductor fuses
    the rest (norms, modulation, activations, residual adds) into fewer kernels. Switching a layer's
    processor afterwards (another variant) recompiles once for it: the recompile limit is raised to allow
    every variant. ``backend``: default inductor, or the environment's ``MHLA_COMPILE_BACKEND`` (tests on a
    CPU use ``aot_eager``: the same graphs, no C++ compiler). ``compile_mode``: torch.compile's own ``mode``
    (``"reduce-overhead"``: CUDA graphs, replayed per block where the shapes are static; the kernels' layer makes
    the tables it keeps inside a graph being captured rather than keeping them, see ``mhla.triton_ops``;
    ``"max-autotune-no-cudagraphs"``, ``"max-autotune"``), for inductor; None: its default. A second call with the
    same arguments does nothing."""
    import os

    import torch._dynamo

    backend = backend or os.environ.get("MHLA_COMPILE_BACKEND", "inductor")
    # (mode, backend, fullgraph), which pipelines.caching reads; torch.compile's mode beside it
    marker = (mode, backend, fullgraph)
    if getattr(model, "_mhla_compiled", None) == marker and getattr(model, "_mhla_compile_mode", None) == compile_mode:
        return model

    check_compile_mode(mode)
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name and the older one
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
    if hasattr(config, "accumulated_cache_size_limit"):
        config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 512)
    if compile_mode is not None and compile_mode not in TORCH_COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(TORCH_COMPILE_MODES)} or None, got {compile_mode!r}")
    extra = {} if compile_mode is None else {"mode": compile_mode}
    if mode == "blocks" and getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(fullgraph=fullgraph, backend=backend, **extra)  # type: ignore[operator]
    else:
        model.compile(fullgraph=fullgraph, backend=backend, **extra)
    model._mhla_compiled = marker  # type: ignore[assignment]
    model._mhla_compile_mode = compile_mode  # type: ignore[assignment]
    return model

"""Fused Triton kernels for MHLA (and linear attention, its M = 1 case), forward and backward.

Three passes, each reading q, k, v where they lie in the ``(batch, tokens, heads, dim)`` layout:
no permuted copy of the token sequence into block order. A program owns one (batch, head, block)
and walks the block's tokens, whose positions it computes from the layout's split points, so
uneven layouts need no index tensors or padding.

    summaries   S_b = sum_{s in b} rope(phi(k_s))^T v_s,  z_b = sum phi(k_s)      (kernel, fp32)
    mixing      S~ = m @ S,  z~ = m @ z        (torch matmuls, M^2 d^2, float32 coefficients)
    output      out_t = rope(phi(q_t)) S~_i  [ / (phi(q_t) . z~_i + eps) ]        (kernel)

The backward pass mirrors it: one kernel over query blocks yields dq and dS~, dz~; torch mixes
them back (dS = m^T dS~, dm = <dS~, S> + <dz~, z>); one kernel over key blocks yields dk, dv.
Channels are processed as two halves (even and odd) so RoPE's interleaved pairs rotate without
shuffles; summaries are stored in that de-interleaved channel order, which the dot products do not
see. Feature map, RoPE and normalizer are fused. Summaries accumulate in float32; inputs and
outputs may be fp16, bf16 or fp32 (fp16 inputs multiply in TF32, see ``_dot_types``).

The kernels are :mod:`mhla.triton_kernels`; this module is the layer over them (launch settings, autotuning,
autograd, input checks). Two versions, timed side by side by ``benchmarks.attention`` (``benchmarks/NOTES.md`` has the
predictions): ``v2`` (default) keeps bf16 inputs' summaries in bf16 between the passes, reads and
writes whole rows (16-byte accesses) and splits the channels in registers, reads half-width RoPE
tables (bf16 for bf16 inputs), and autotunes its launch settings; ``v1`` is the first version (float32 summaries, strided
single-element channel reads, one fixed launch setting).

Outputs and gradients are written with their own strides (q, k, v may be views, e.g. of a fused QKV
projection); offsets that grow with the batch are int64. Linear attention (``mixing`` None inside)
shares one summary per (batch, head) among all query chunks.

The kernels also run on a CPU under ``TRITON_INTERPRET=1`` (slowly), which is how CI checks them
against the dense reference when no GPU is present.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path in ops.py is used
    triton = None

from .checks import check_mixing, check_qkv
from .layout import BlockLayout
from .rope import Rotary, check_rotary
from .triton_kernels import FEATURE_IDS, KERNEL_NAMES, KERNELS, RELU_EPS  # noqa: F401 (re-exported)

# v1 stays only until a GPU run has timed it beside v2 (benchmarks.attention's mhla[triton-v1] row): then
# the slower one goes.
VERSIONS = ("v2", "v1")


def summary_dtype(version: str, dtype: torch.dtype) -> torch.dtype:
    """dtype of the block summaries between the passes: v2 keeps bf16 inputs' summaries (and their
    gradients) in bf16, since the products read them as bf16 operands anyway and it halves their
    traffic; otherwise float32. Sums stay float32 inside the kernels either way."""
    return torch.bfloat16 if version == "v2" and dtype == torch.bfloat16 else torch.float32


def available() -> bool:
    return triton is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(x: int) -> int:
    return max(16, 1 << (int(x) - 1).bit_length())


def _dot_types(dtype: torch.dtype) -> tuple[Any, str]:
    """Operand dtype and precision of the kernels' matrix products for inputs of ``dtype``.

    bf16 inputs multiply in bf16 (float32's range). fp16 inputs multiply as float32 operands on TF32
    tensor cores, not in fp16: the summaries S~ are sums over up to every token and pass fp16's
    65,504 at realistic sizes (8k tokens with values around 30 already do), which the PyTorch path,
    computing in float32, never does. float32 inputs use exact float32 products, or TF32 where
    ``torch.backends.cuda.matmul.allow_tf32`` allows it, as PyTorch's own float32 matrix products (and
    so the PyTorch path) do: the exact products keep tiles in local memory (benchmarks/NOTES.md), TF32
    products run on the tensor cores at about 3e-4 relative error. Triton's interpreter
    computes bf16 products wrongly (Triton 3.9 on a CPU), so there bf16 inputs multiply in float32:
    CPU tests check everything of the bf16 path but the rounding of the products' operands.
    """
    if dtype == torch.bfloat16 and not _interpreted():
        return tl.bfloat16, "tf32"
    if dtype == torch.float16:
        return tl.float32, "tf32"
    return tl.float32, ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")


# Launch settings (tokens per step, warps, pipeline stages) the autotuner times on the first call for
# each shape and keeps; the kernels only store (never accumulate into) their outputs, so timing runs
# leave nothing behind. The candidates are per kernel, from `python -m benchmarks.kernel_resources`
# (compiled for sm_90a, no GPU; bf16, 21x30x50): settings whose kernel spills more than about 100 bytes
# of registers or fits no more programs per SM than a smaller one were left out (backward_query spills
# at every setting with 4 warps). Exact float32 products ("ieee") get the fixed setting only: their
# large settings keep tiles in local memory and took minutes each to compile. The interpreter gets v1's
# setting only (tuning would only multiply its time).
V1_LAUNCH = dict(BLOCK_N=64, num_warps=4, num_stages=2)
# Three stages, not two, where it fits: with two, Triton's loop waits for all its copies at the top
# of each step and issues the next step's after the products, so no load is in flight while the
# tensor cores work (TTGIR: `async_wait {num = 0}`); with three one step's copies stay in flight
# (`num = 4` in the summary kernel). See benchmarks/NOTES.md.
TUNE_CANDIDATES = {
    "summaries": [(16, 8, 2), (16, 8, 3), (32, 4, 2), (32, 8, 3), (64, 8, 2)],
    "output": [(16, 4, 2), (16, 8, 3), (32, 8, 2), (32, 8, 3), (64, 4, 2)],
    "backward_query": [(16, 8, 2), (16, 8, 3), (32, 8, 3)],
    "backward_key": [(16, 4, 2), (16, 8, 2), (16, 8, 3), (32, 8, 3), (64, 8, 2)],
}
# tuned once per shape and per compiled variant (the constants a kernel takes among these); the
# autotuner adds the tensors' dtypes itself
_TUNE_KEY = ["B", "N", "M", "D_HALF", "E", "FEATURE", "USE_ROPE", "NORMALIZE", "SHARED", "PRECISION"]

# MHLA_AUTOTUNE=0 (or AUTOTUNE = False, read at each call) launches v2 with these fixed settings instead:
# per kernel, the bf16 setting of the resource report without spills that fits most programs per SM,
# with three stages where that costs no program per SM.
# Tuning compiles every candidate for each new specialisation, which the GPU tests cannot afford.
AUTOTUNE = os.environ.get("MHLA_AUTOTUNE", "1") != "0"
PROFILE_RANGES = False  # benchmarks.profile_mhla turns on a profiler range per kernel launch
FIXED_LAUNCH = {
    "summaries": dict(BLOCK_N=16, num_warps=8, num_stages=3),
    "output": dict(BLOCK_N=16, num_warps=8, num_stages=3),
    "backward_query": dict(BLOCK_N=16, num_warps=8, num_stages=3),
    "backward_key": dict(BLOCK_N=16, num_warps=8, num_stages=2),  # 3 stages: 1 program per SM instead of 2
}


def _launch_configs(name: str) -> list[Any]:
    if triton is None:
        return []
    if _interpreted():
        return [triton.Config({"BLOCK_N": V1_LAUNCH["BLOCK_N"]}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in TUNE_CANDIDATES[name]]


def _prune_for(name: str) -> Callable[..., list[Any]]:
    """Exact float32 products: the fixed setting only (see above)."""
    fixed = FIXED_LAUNCH[name]

    def prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        if kwargs.get("PRECISION") != "ieee" or len(configs) == 1:
            return configs
        keep = [
            c
            for c in configs
            if c.kwargs["BLOCK_N"] == fixed["BLOCK_N"]
            and (c.num_warps, c.num_stages) == (fixed["num_warps"], fixed["num_stages"])
        ]
        return keep or configs[:1]

    return prune


if triton is not None:
    _TUNED = {
        name: triton.autotune(
            _launch_configs(name),
            key=[k for k in _TUNE_KEY if k in fn.arg_names],
            prune_configs_by={"early_config_prune": _prune_for(name)},
        )(fn)
        for name, fn in KERNELS.items()
    }


def tuned_launches() -> dict[str, dict[str, str]]:
    """Launch settings the autotuner has chosen in this process: ``{kernel: {shape key: settings}}``
    (empty where nothing was tuned: no GPU, or the interpreter's single setting)."""
    out: dict[str, dict[str, str]] = {}
    if triton is None:
        return out
    for name, tuner in _TUNED.items():
        for key, cfg in tuner.cache.items():
            out.setdefault(name, {})[" ".join(map(str, key))] = (
                f"BLOCK_N={cfg.kwargs['BLOCK_N']} num_warps={cfg.num_warps} num_stages={cfg.num_stages}"
            )
    return out


_MIXING_CACHE: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = OrderedDict()
MIXING_CACHE_SIZE = 64  # entries: one per layer and direction (Wan2.1-14B: 40 layers)


def _mixing_operands(
    mixing: torch.Tensor, batch: int, heads: int, transpose: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The batched product's left operands for ``mixing``: ``(m,)`` float32, or ``(hi, lo)`` in ``dtype``,
    each ``(B*H, M, M)`` contiguous. Made on the device, without a host synchronisation, and kept per
    mixing tensor (its identity, storage and version: an in-place update makes them again) while that
    tensor needs no gradient, as in inference, where every call of a layer passes the same matrix: then
    a call launches the products alone instead of 5 more small kernels."""
    m = mixing.float()
    key = (id(mixing), mixing.data_ptr(), mixing._version, batch, heads, transpose, dtype, mixing.device)
    reuse = not mixing.requires_grad
    if reuse:
        hit = _MIXING_CACHE.get(key)
        if hit is not None and hit[0] is mixing:
            _MIXING_CACHE.move_to_end(key)
            return hit[1]
    if transpose:
        m = m.transpose(-1, -2)
    blocks = m.shape[-1]
    m = (m.expand(batch * heads, blocks, blocks) if m.dim() == 2 else m.repeat(batch, 1, 1)).contiguous()
    if dtype == torch.float32:
        made: tuple[torch.Tensor, ...] = (m,)
    else:
        hi = m.to(dtype)
        made = (hi, (m - hi.float()).to(dtype))
    if reuse:
        _MIXING_CACHE[key] = (mixing, made)  # the tensor itself is kept, so its id and memory stay its own
        while len(_MIXING_CACHE) > MIXING_CACHE_SIZE:
            _MIXING_CACHE.popitem(last=False)
    return made


def _mix(mixing: torch.Tensor, x: torch.Tensor, batch: int, heads: int, transpose: bool = False) -> torch.Tensor:
    """Mixes ``x`` ``(B*H, M, ...)`` over blocks with ``(M, M)`` or ``(H, M, M)`` float32 ``mixing``.

    float32 ``x``: one float32 product. bf16 ``x`` (v2's summaries): the coefficients are not rounded
    to bf16 (0.4% each, which the float32 mixing of the normalizer sums would not see): they are split
    into bf16 ``hi + lo`` (16 significant bits together) and both products run on bf16 tensor cores,
    accumulating in float32, the ``lo`` product added into the ``hi`` one's float32 accumulator
    (``baddbmm``) before the one rounding of the result to bf16. Two cheap products instead of one
    float32 product on the FP32 units (benchmarks/NOTES.md, item 3)."""
    flat = x.reshape(batch * heads, x.shape[1], -1)
    operands = _mixing_operands(mixing, batch, heads, transpose, x.dtype)
    if x.dtype == torch.float32:
        return torch.bmm(operands[0], flat).reshape(x.shape)
    hi, lo = operands
    return torch.baddbmm(torch.bmm(lo, flat), hi, flat).reshape(x.shape)


def _mixing_grad(d_mixed: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """``dm_ib = <dS~_i, S_b>`` per (batch x head), ``(B*H, M, M)`` float32: a sum over d*E = 16,384
    products, accumulated and returned in float32 (a bf16 result would round every entry to 0.4%)."""
    a, b = d_mixed.flatten(2), summaries.flatten(2).transpose(1, 2)
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:
        try:  # bf16 tensor cores with a float32 result (PyTorch >= 2.8 on CUDA)
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return torch.bmm(a.float(), b.float())


_rope_cache: dict[Any, Any] = {}  # the last rotary tables seen and their halves (see _rope_halves)


def _rope_halves(rotary_emb: Rotary, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos at even and sin at odd channels, contiguous, in ``dtype``: the halves v2's kernels read
    (bf16 for bf16 inputs: half the bytes every program reads, and the rotated features are rounded
    to bf16 for the products anyway; float32 otherwise).

    Wan passes one (cos, sin) pair to all its layers, forward and backward, so the halves of the last
    pair are kept (with the pair itself, so that its memory cannot be reused by other tables) and made
    once per denoising or training step instead of twice per layer; an in-place change of the pair
    (its version counter) makes them again."""
    cos, sin = rotary_emb
    key = (cos._version, sin._version)
    hit = _rope_cache.get("pair")
    if hit is None or hit[0] is not cos or hit[1] is not sin or _rope_cache["version"] != key:
        _rope_cache.clear()
        _rope_cache.update(pair=(cos, sin), version=key)
    if dtype not in _rope_cache:
        _rope_cache[dtype] = (cos[..., 0::2].to(dtype).contiguous(), sin[..., 1::2].to(dtype).contiguous())
    return _rope_cache[dtype]


def rope_table_dtype(version: str, dtype: torch.dtype) -> torch.dtype:
    """dtype of the RoPE half tables v2 reads for inputs of ``dtype`` (v1 reads float32 full tables)."""
    return torch.bfloat16 if version == "v2" and dtype == torch.bfloat16 else torch.float32


INT32_MAX = 2**31 - 1


def check_offsets(name: str, t: torch.Tensor) -> None:
    """The kernels compute offsets within one batch element in int32 (the batch offset is int64):
    raises ValueError when an element's largest offset passes 2^31 - 1."""
    extent = sum((size - 1) * stride for size, stride in zip(t.shape[1:], t.stride()[1:]))
    if extent > INT32_MAX:
        raise ValueError(
            f"{name} {tuple(t.shape)} with strides {t.stride()} spans {extent} elements per batch element; "
            f"the fused kernels need at most {INT32_MAX} (2^31 - 1): split the tokens or use impl='torch'"
        )


class _Geometry:
    def __init__(
        self, q: torch.Tensor, v: torch.Tensor, layout: BlockLayout, rotary_emb: Rotary | None, version: str
    ) -> None:
        self.B, self.N, self.H, D = q.shape
        self.D_HALF, self.E = D // 2, v.shape[-1]
        self.M = layout.num_blocks
        self.grid_args = (self.B, self.N, self.H, *layout.grid, *layout.blocks, self.M, self.D_HALF, self.E)
        self.launch = (self.B * self.H, self.M)
        self.use_rope = rotary_emb is not None
        if rotary_emb is None:
            self.cos = self.sin = q  # unused pointers
            self.rope_strides = (0, 0)
        else:
            if version != "v1":
                cos, sin = _rope_halves(rotary_emb, rope_table_dtype(version, q.dtype))
            else:  # v1 reads the full tables, both with the same strides
                cos, sin = (t.float() for t in rotary_emb)
                if cos.stride() != sin.stride():
                    cos, sin = cos.contiguous(), sin.contiguous()
            self.cos, self.sin = cos, sin
            self.rope_strides = (cos.stride(1), cos.stride(3))
        self.version = version
        # compile-time arguments fixed by the shape and the version (BLOCK_N comes from the launch setting)
        self.static = dict(BLOCK_D=_pow2(self.D_HALF), BLOCK_E=_pow2(self.E), WIDE=version != "v1")
        self.dot_dtype, self.precision = _dot_types(q.dtype)
        self.summary_dtype = summary_dtype(version, q.dtype)  # the normalizer sums z stay float32 (small)

    def run(self, name: str, *args: Any, **meta: Any) -> None:
        if PROFILE_RANGES:  # a named range per launch, so that a profile shows interpreted kernels too
            with torch.profiler.record_function(f"mhla.{name}"):
                return self._launch(name, *args, **meta)
        return self._launch(name, *args, **meta)

    def _launch(self, name: str, *args: Any, **meta: Any) -> None:
        if _INTERCEPT is not None:  # see intercept_launches
            _INTERCEPT(self, name, args, meta)
            return
        if self.version == "v1":
            KERNELS[name][self.launch](*args, **meta, **self.static, **V1_LAUNCH)
        elif not AUTOTUNE:
            KERNELS[name][self.launch](*args, **meta, **self.static, **FIXED_LAUNCH[name])
        else:
            _TUNED[name][self.launch](*args, **meta, **self.static)


LaunchCallback = Callable[[_Geometry, str, tuple[Any, ...], dict[str, Any]], None]
_INTERCEPT: LaunchCallback | None = None


@contextmanager
def intercept_launches(callback: LaunchCallback) -> Iterator[None]:
    """While active, every kernel launch calls ``callback(geometry, name, args, meta)`` instead of running:
    for tools that need a launch's exact arguments without a GPU (``benchmarks.kernel_resources``
    compiles the kernels ahead of time from them). ``geometry`` has ``static`` (compile-time constants),
    ``launch`` (the program grid), ``version``, ``precision`` and ``dot_dtype``."""
    global _INTERCEPT
    before, _INTERCEPT = _INTERCEPT, callback
    try:
        yield
    finally:
        _INTERCEPT = before


def _dense_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as ``t``; the kernels get its strides separately, since ``t`` may be a view
    (a fused QKV projection split with ``chunk``) whose strides do not fit a buffer of its size."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


class _MHLAFunction(torch.autograd.Function):
    """``mixing`` None: every query block uses the sum of all block summaries (linear attention). The
    mixed summary is then one per (batch, head), ``SHARED`` in the kernels, instead of M equal copies."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mixing: torch.Tensor | None,
        layout: BlockLayout,
        feature: int,
        normalize: bool,
        rotary_emb: Rotary | None,
        eps: float,
        out_dtype: torch.dtype,
        version: str,
    ) -> torch.Tensor:
        g = _Geometry(q, v, layout, rotary_emb, version)
        shared = mixing is None
        summaries = q.new_empty((g.B * g.H, g.M, 2 * g.D_HALF, g.E), dtype=g.summary_dtype)
        z = q.new_empty((g.B * g.H, g.M, 2 * g.D_HALF) if normalize else (1,), dtype=torch.float32)
        common = dict(FEATURE=feature, USE_ROPE=g.use_rope, NORMALIZE=normalize, DOT_DTYPE=g.dot_dtype)
        common["PRECISION"] = g.precision
        g.run(
            "summaries",
            k,
            v,
            g.cos,
            g.sin,
            summaries,
            z,
            *k.stride(),
            *v.stride(),
            *g.rope_strides,
            *g.grid_args,
            **common,
        )
        mixed, mixed_z = _mix_all(mixing, summaries, z, g, normalize)
        out = q.new_empty((g.B, g.N, g.H, g.E), dtype=out_dtype)
        den = q.new_empty((g.B * g.H, g.N), dtype=torch.float32) if normalize else z
        g.run(
            "output",
            *(q, g.cos, g.sin, mixed, mixed_z, out, den),
            *q.stride(),
            *out.stride(),
            *g.rope_strides,
            *g.grid_args,
            eps,
            SHARED=shared,
            **common,
        )
        ctx.save_for_backward(q, k, v, mixing, summaries, z, den)
        ctx.layout, ctx.feature, ctx.normalize, ctx.rotary_emb = layout, feature, normalize, rotary_emb
        ctx.version = version
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, mixing, summaries, z, den = ctx.saved_tensors
        normalize = ctx.normalize
        shared = mixing is None
        g = _Geometry(q, v, ctx.layout, ctx.rotary_emb, ctx.version)
        common = dict(FEATURE=ctx.feature, USE_ROPE=g.use_rope, NORMALIZE=normalize, SHARED=shared)
        common.update(DOT_DTYPE=g.dot_dtype, PRECISION=g.precision)
        mixed, mixed_z = _mix_all(mixing, summaries, z, g, normalize)
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq = _dense_like(q)
        d_mixed = torch.empty_like(summaries)  # per query block, also when the summary is shared
        d_mixed_z = torch.empty_like(summaries[..., 0], dtype=torch.float32) if normalize else z
        g.run(
            "backward_query",
            *(q, grad_out, g.cos, g.sin, mixed, mixed_z, den, dq, d_mixed, d_mixed_z),
            *q.stride(),
            *grad_out.stride(),
            *dq.stride(),
            *g.rope_strides,
            *g.grid_args,
            **common,
        )
        # back through the mixing: dS = m^T dS~, dm_ib = <dS~_i, S_b> (+ <dz~_i, z_b>), all in float32
        if shared:  # dS_b = sum_i dS~_i for every b: one shared sum
            d_summaries = d_mixed.sum(1, keepdim=True, dtype=torch.float32)
            d_z = d_mixed_z.sum(1, keepdim=True) if normalize else z
        else:
            d_summaries = _mix(mixing, d_mixed, g.B, g.H, transpose=True)
            d_z = _mix(mixing, d_mixed_z, g.B, g.H, transpose=True) if normalize else z
        d_mixing = None
        if not shared and ctx.needs_input_grad[3]:
            dm = _mixing_grad(d_mixed, summaries)
            if normalize:
                dm = dm + torch.bmm(d_mixed_z, z.transpose(1, 2))
            dm = dm.reshape(g.B, g.H, g.M, g.M)
            d_mixing = (dm.sum((0, 1)) if mixing.dim() == 2 else dm.sum(0)).to(mixing.dtype)
        dk, dv = _dense_like(k), _dense_like(v)
        g.run(
            "backward_key",
            *(k, v, g.cos, g.sin, d_summaries, d_z, dk, dv),
            *k.stride(),
            *v.stride(),
            *dk.stride(),
            *dv.stride(),
            *g.rope_strides,
            *g.grid_args,
            **common,
        )
        return dq, dk, dv, d_mixing, None, None, None, None, None, None, None


def _mix_all(
    mixing: torch.Tensor | None, summaries: torch.Tensor, z: torch.Tensor, g: _Geometry, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixed summaries S~ and normalizer sums z~ the output and backward kernels read: ``m @ S``,
    or for ``mixing`` None one float32 sum over the blocks per (batch, head)."""
    if mixing is None:
        return summaries.sum(1, keepdim=True, dtype=torch.float32), (z.sum(1, keepdim=True) if normalize else z)
    return _mix(mixing, summaries, g.B, g.H), (_mix(mixing, z, g.B, g.H) if normalize else z)


def mhla_attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    version: str = "v2",
) -> torch.Tensor:
    """Same contract as :func:`mhla.mhla_attention`, run by the fused Triton kernels.

    q, k ``(B, N, H, D)`` with even D, v ``(B, N, H, E)``; any strides with unit stride on the last
    dim. Differentiable in q, k, v and mixing. ``version``: ``"v2"`` (default) keeps bf16 inputs'
    block summaries in bf16 between the passes and autotunes the launch settings on a GPU; ``"v1"``
    keeps every summary in float32 and launches with fixed settings (kept to time the two side by
    side, see benchmarks/NOTES.md).
    """
    check_qkv(q, k, v)
    check_mixing(mixing, layout.num_blocks, q.shape[2], q.device)
    return _fused(q, k, v, layout, mixing.float(), feature_map, normalize, rotary_emb, eps, out_dtype, version)


def _fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    mixing: torch.Tensor | None,
    feature_map: str,
    normalize: bool,
    rotary_emb: Rotary | None,
    eps: float,
    out_dtype: torch.dtype | None,
    version: str,
) -> torch.Tensor:
    """Checks the arguments the kernels rely on and runs them; ``mixing`` None: linear attention."""
    if triton is None:
        raise RuntimeError("the fused kernels need Triton; use mhla.mhla_attention on this machine")
    check_qkv(q, k, v)
    if layout.num_tokens != q.shape[1]:
        g = layout.grid
        raise ValueError(f"token grid {g[0]}x{g[1]}x{g[2]} has {layout.num_tokens} tokens but q has {q.shape[1]}")
    check_rotary(rotary_emb, q.shape[1], q.shape[3])
    if feature_map not in FEATURE_IDS:
        raise ValueError(f"unknown feature map {feature_map!r}; expected one of {sorted(FEATURE_IDS)}")
    if q.shape[-1] % 2:
        raise ValueError(f"the fused kernels need an even head_dim, got {q.shape[-1]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"the fused kernels take fp16, bf16 or fp32 q, k, v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    out_dtype = out_dtype or q.dtype
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    if version not in VERSIONS:
        raise ValueError(f"unknown kernel version {version!r}; expected one of {VERSIONS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_offsets(name, t)
    return _MHLAFunction.apply(
        q, k, v, mixing, layout, FEATURE_IDS[feature_map], normalize, rotary_emb, eps, out_dtype, version
    )


def linear_attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: str = "relu",
    normalize: bool = True,
    rotary_emb: Rotary | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    version: str = "v2",
) -> torch.Tensor:
    """Vanilla linear attention by the fused kernels.

    The tokens are cut into up to 256 chunks of at least 256 tokens so that the summary pass runs on
    many programs at once instead of one per (batch, head); the chunks' summaries are summed into one
    per (batch, head), which every query chunk reads (MHLA with an all-ones mixing, without its M
    copies of the one summary).
    """
    check_qkv(q, k, v)
    n = q.shape[1]
    chunks = max(1, min(256, n // 256))
    layout = BlockLayout((1, 1, n), (1, 1, chunks))
    return _fused(q, k, v, layout, None, feature_map, normalize, rotary_emb, eps, out_dtype, version)

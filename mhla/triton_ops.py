"""Fused Triton kernels for MHLA (and linear attention, its M = 1 case), forward and backward.

Three passes, each reading q, k, v where they lie in the ``(batch, tokens, heads, dim)`` layout:
no permuted copy of the token sequence into block order. A program owns one (batch, head, block)
and walks the block's tokens, whose positions it computes from the layout's split points, so
uneven layouts need no index tensors or padding.

    summaries   S_b = sum_{s in b} rope(phi(k_s))^T v_s,  z_b = sum phi(k_s)      (kernel, fp32)
    mixing      S~ = m @ S,  z~ = m @ z        (M^2 d^2, float32 coefficients: inside the output kernel for
                small M, else the mixing kernel for bf16 summaries and torch products for float32 ones)
    output      out_t = rope(phi(q_t)) S~_i  [ / (phi(q_t) . z~_i + eps) ]        (kernel)

The backward pass mirrors it: one kernel over query blocks yields dq and dS~, dz~; they are mixed
back (dS = m^T dS~: inside the key kernel for small M; dm = <dS~, S> + <dz~, z> by torch); one kernel
over key blocks yields dk, dv. Repeated calls keep their launch geometry and launch the compiled
kernels directly (see DIRECT_LAUNCH); inference calls make no autograd node.
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
import warnings
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
from .layout import BlockLayout, cached_layout
from .rope import Rotary, check_rotary
from .triton_kernels import FEATURE_IDS, KERNEL_NAMES, KERNELS, MIXING_KERNEL, RELU_EPS  # noqa: F401 (re-exported)

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
    # not while a CUDA graph is captured: made inside it, they would live in its memory pool (see _rope_halves)
    reuse = not mixing.requires_grad and not (mixing.is_cuda and torch.cuda.is_current_stream_capturing())
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
    float32 product on the FP32 units (benchmarks/NOTES.md, item 3). Since issue 50 both products run in one
    kernel (:func:`_mix_by_kernel`): one launch, and the float32 result never leaves the registers; the torch
    products stay for float32 ``x`` and while launches are intercepted."""
    flat = x.reshape(batch * heads, x.shape[1], -1)
    if x.dtype == torch.bfloat16 and triton is not None and _INTERCEPT is None:
        return _mix_by_kernel(mixing, flat, heads, transpose).reshape(x.shape)
    operands = _mixing_operands(mixing, batch, heads, transpose, x.dtype)
    if x.dtype == torch.float32:
        return torch.bmm(operands[0], flat).reshape(x.shape)
    hi, lo = operands
    return torch.baddbmm(torch.bmm(lo, flat), hi, flat).reshape(x.shape)


# The mixing kernel's launch setting: all M output rows of a (batch x head) in one program where M <= 128, so
# that the summaries are read once; 128 columns per program (12 heads x 128 x 128 at M = 105: 1,536 programs),
# 16 blocks per step in three stages. Compiled for sm_90a here (bf16, M = 105): 128 registers, no spills, 32 KB
# shared, 2 programs per SM; (128 rows, 64 columns, 32 blocks, 4 warps) spilled at 255 registers, and 32 columns
# per program read the float32 coefficients from L2 four times as often (270 MB instead of 68 MB at M = 105).
MIXING_LAUNCH = dict(BLOCK_N=128, BLOCK_B=16, num_warps=8, num_stages=3)


def _mix_by_kernel(mixing: torch.Tensor, flat: torch.Tensor, heads: int, transpose: bool) -> torch.Tensor:
    """``m @ x`` (``m^T @ x`` with ``transpose``) per (batch x head) for ``flat`` ``(B*H, M, C)`` bf16, by
    :func:`mhla.triton_kernels._mixing_kernel` from the float32 coefficients as they are (no expanded or split
    copies of them): ``(B*H, M, C)`` bf16."""
    flat = flat if flat.is_contiguous() else flat.contiguous()
    bh, blocks, cols = flat.shape
    out = torch.empty_like(flat)
    head = mixing.stride(0) if mixing.dim() == 3 else 0
    rows, cols_stride = mixing.stride(-2), mixing.stride(-1)
    if transpose:
        rows, cols_stride = cols_stride, rows
    block_i = min(128, _pow2(blocks))
    interpreted = _interpreted()  # its bf16 products are wrong (see _dot_types): float32 there
    grid = (bh, triton.cdiv(blocks, block_i), triton.cdiv(cols, MIXING_LAUNCH["BLOCK_N"]))
    meta = dict(SPLIT=not interpreted, PRECISION="ieee", ROUND_BITS=interpreted, BLOCK_I=block_i)
    args = (flat, mixing, out, head, rows, cols_stride, heads, blocks, cols)
    _launch_kernel("mixing", MIXING_KERNEL, MIXING_LAUNCH, grid, args, meta)
    return out


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
    (its version counter) makes them again. While a CUDA graph is captured (``torch.compile``'s
    "reduce-overhead", ``torch.cuda.graph``) they are made inside the graph and not kept: a replay runs no
    Python, so a kept table would be read at its capture-time address, which the graph's memory pool may
    hand to another tensor."""
    cos, sin = rotary_emb
    if cos.is_cuda and torch.cuda.is_current_stream_capturing():
        return cos[..., 0::2].to(dtype).contiguous(), sin[..., 1::2].to(dtype).contiguous()
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


# In-kernel mixing (MIX_IN in the kernels): each program of the output and backward kernels forms its block's
# mixed summary itself, reading all M summaries of its (batch, head) from L2, instead of two torch products
# before it. That saves the products' launches and host work (the fixed cost per call that dominates below
# ~8k tokens) and costs B*H*M^2 summary reads: taken where those stay under this many bytes and M is small
# (M = 9 at 2,048-4,096 tokens: 32 MB at batch 1, 12 heads x 128 in bf16). 0 turns it off (the tests time
# both paths on one shape); see benchmarks/NOTES.md ("The operator's fixed cost").
MIX_IN_KERNEL_BYTES = 64 * 2**20
MIX_IN_KERNEL_BLOCKS = 32


def mix_in_kernel(batch: int, heads: int, blocks: int, head_dim: int, value_dim: int, summary: torch.dtype) -> bool:
    """Whether the kernels mix the block summaries themselves (see MIX_IN_KERNEL_BYTES)."""
    row = head_dim * value_dim * torch.empty((), dtype=summary).element_size()
    return blocks <= MIX_IN_KERNEL_BLOCKS and batch * heads * blocks * blocks * row <= MIX_IN_KERNEL_BYTES


class _Geometry:
    """What the launches need that depends only on the shapes, strides, dtypes, device and version of a call:
    made once per such key and kept (``_geometry``), so that a repeated call (every layer of a model, every
    step) does no Python-side shape work."""

    def __init__(
        self, q: torch.Tensor, v: torch.Tensor, layout: BlockLayout, rotary_emb: Rotary | None, version: str
    ) -> None:
        self.B, self.N, self.H, D = q.shape
        self.D_HALF, self.E = D // 2, v.shape[-1]
        self.M = layout.num_blocks
        self.grid_args = (self.B, self.N, self.H, *layout.grid, *layout.blocks, self.M, self.D_HALF, self.E)
        self.launch = (self.B * self.H, self.M)
        self.use_rope = rotary_emb is not None
        self.version = version
        # compile-time arguments fixed by the shape and the version (BLOCK_N comes from the launch setting)
        self.static = dict(BLOCK_D=_pow2(self.D_HALF), BLOCK_E=_pow2(self.E), WIDE=version != "v1")
        self.dot_dtype, self.precision = _dot_types(q.dtype)
        self.summary_dtype = summary_dtype(version, q.dtype)  # the normalizer sums z stay float32 (small)
        self.summary_shape = (self.B * self.H, self.M, 2 * self.D_HALF, self.E)
        self.table_dtype = rope_table_dtype(version, q.dtype)
        self.mix_in = mix_in_kernel(self.B, self.H, self.M, D, self.E, self.summary_dtype)

    def tables(self, rotary_emb: Rotary | None, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """The RoPE tables the kernels read and their (token, channel) strides; without RoPE, q as an unused
        pointer. v2: the half tables, kept per pair (``_rope_halves``)."""
        if rotary_emb is None:
            return q, q, (0, 0)
        if self.version != "v1":
            cos, sin = _rope_halves(rotary_emb, self.table_dtype)
        else:  # v1 reads the full tables, both with the same strides
            cos, sin = (t.float() for t in rotary_emb)
            if cos.stride() != sin.stride():
                cos, sin = cos.contiguous(), sin.contiguous()
        return cos, sin, (cos.stride(1), cos.stride(3))

    def run(self, name: str, *args: Any, **meta: Any) -> None:
        if PROFILE_RANGES:  # a named range per launch, so that a profile shows interpreted kernels too
            with torch.profiler.record_function(f"mhla.{name}"):
                return self._launch(name, args, meta)
        return self._launch(name, args, meta)

    def _launch(self, name: str, args: tuple[Any, ...], meta: dict[str, Any]) -> None:
        if _INTERCEPT is not None:  # see intercept_launches
            _INTERCEPT(self, name, args, meta)
            return
        if self.version == "v1":
            fn, settings = KERNELS[name], V1_LAUNCH
        elif not AUTOTUNE:
            fn, settings = KERNELS[name], FIXED_LAUNCH[name]
        else:
            fn, settings = _TUNED[name], None
        _launch_kernel(name, fn, settings, self.launch, args, {**meta, **self.static})


def _launch_kernel(
    name: str,
    fn: Any,
    settings: dict[str, Any] | None,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    meta: dict[str, Any],
) -> None:
    """Launches ``fn`` (a JIT kernel with ``settings``, or an autotuner: ``settings`` None) on ``grid``, directly
    through the compiled kernel when one is kept for this specialisation (see DIRECT_LAUNCH)."""
    if DIRECT_LAUNCH:
        # what Triton specialises on: tensors' dtype, device and 16-byte alignment, the other arguments' values
        spec = [(a.dtype, a.device, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args]
        key = (name, id(fn), grid, settings and tuple(settings.values()), tuple(spec), *meta.values())
        hit = _DIRECT.get(key)
        if hit is not None:
            try:
                hit[0][grid](*args, *hit[1])
                return
            except (TypeError, AttributeError, IndexError) as e:  # this Triton's launcher differs: stop trying
                _direct_failed(e)
    if settings is None:
        ran = fn[grid](*args, **meta)
        best = getattr(fn, "best_config", None)
        settings = dict(best.kwargs) if best is not None else {}
    else:
        ran = fn[grid](*args, **meta, **settings)
    if DIRECT_LAUNCH and _is_compiled(ran):
        values = {**meta, **settings}
        names = KERNELS.get(name, fn).arg_names[len(args) :]  # an autotuner's kernel is KERNELS[name]
        if all(n in values for n in names):
            _DIRECT[key] = (ran, tuple(values[n] for n in names))
            while len(_DIRECT) > DIRECT_CACHE_SIZE:
                _DIRECT.pop(next(iter(_DIRECT)))


# Direct launches: Triton's launcher (JITFunction.run) binds and specialises every argument on every call,
# tens of microseconds of host time per launch for these kernels' ~40 arguments. The kernel it compiled is
# kept per specialisation key (the kernel, the pointers' dtypes and 16-byte alignment, every int argument by
# value, the compile-time options) and launched again through its own launcher (``compiled[grid](*args)``,
# the path Triton's ahead-of-time runner uses), all arguments in the kernel's order as JITFunction.run passes
# them. MHLA_DIRECT_LAUNCH=0 turns it off; a launcher that refuses the call turns it off with a warning.
DIRECT_LAUNCH = os.environ.get("MHLA_DIRECT_LAUNCH", "1") != "0"
DIRECT_CACHE_SIZE = 256
_DIRECT: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}


def _is_compiled(ran: Any) -> bool:
    """Whether a JIT launch returned a compiled kernel with its own launcher (not the interpreter's None)."""
    return ran is not None and hasattr(ran, "function") and hasattr(type(ran), "__getitem__")


def _direct_failed(e: Exception) -> None:
    global DIRECT_LAUNCH
    DIRECT_LAUNCH = False
    _DIRECT.clear()
    warnings.warn(
        f"MHLA direct kernel launches turned off ({type(e).__name__}: {e}); using Triton's launcher", stacklevel=4
    )


_GEOMETRY: OrderedDict[tuple[Any, ...], _Geometry] = OrderedDict()
GEOMETRY_CACHE_SIZE = 64


def _geometry(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, rotary_emb: Rotary | None, version: str
) -> _Geometry:
    """The call's :class:`_Geometry`, made (and q, k, v's extents checked) once per shapes, strides, dtype,
    device, layout, version and product precision."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 if q.dtype == torch.float32 else None
    key: tuple[Any, ...] = (q.shape, q.stride(), k.stride(), v.shape, v.stride(), q.dtype, q.device, layout.grid)
    key += (layout.blocks, version, rotary_emb is None, tf32, MIX_IN_KERNEL_BYTES, MIX_IN_KERNEL_BLOCKS)
    g = _GEOMETRY.get(key)
    if g is None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_offsets(name, t)
        g = _GEOMETRY[key] = _Geometry(q, v, layout, rotary_emb, version)
        while len(_GEOMETRY) > GEOMETRY_CACHE_SIZE:
            _GEOMETRY.popitem(last=False)
    return g


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


def _forward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The forward launches: ``(out, summaries, z, den, mix_in)``, the last four what the backward needs."""
    g = _geometry(q, k, v, layout, rotary_emb, version)
    cos, sin, rope_strides = g.tables(rotary_emb, q)
    shared = mixing is None
    summaries = q.new_empty(g.summary_shape, dtype=g.summary_dtype)
    z = q.new_empty(g.summary_shape[:3] if normalize else (1,), dtype=torch.float32)
    common = dict(FEATURE=feature, USE_ROPE=g.use_rope, NORMALIZE=normalize, DOT_DTYPE=g.dot_dtype)
    common["PRECISION"] = g.precision
    g.run("summaries", k, v, cos, sin, summaries, z, *k.stride(), *v.stride(), *rope_strides, *g.grid_args, **common)
    if g.mix_in:
        mixed, mixed_z = summaries, z
    else:
        mixed, mixed_z = _mix_all(mixing, summaries, z, g, normalize)
    out = q.new_empty((g.B, g.N, g.H, g.E), dtype=out_dtype)
    den = q.new_empty((g.B * g.H, g.N), dtype=torch.float32) if normalize else z
    g.run(
        "output",
        *(q, cos, sin, mixed, mixed_z, q if shared else mixing, out, den),
        *q.stride(),
        *out.stride(),
        *rope_strides,
        *_mixing_strides(mixing, transpose=False),
        *g.grid_args,
        eps,
        SHARED=shared,
        MIX_IN=g.mix_in,
        **common,
    )
    return out, summaries, z, den, g.mix_in


class _MHLAFunction(torch.autograd.Function):
    """``mixing`` None: every query block uses the sum of all block summaries (linear attention). The
    mixed summary is then one per (batch, head), ``SHARED`` in the kernels, instead of M equal copies.
    Where :func:`mix_in_kernel` says so, the output and backward kernels mix the summaries themselves
    (``MIX_IN``): two launches forward, two backward, and no torch operation between them."""

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
        out, summaries, z, den, mix_in = _forward(
            q, k, v, mixing, layout, feature, normalize, rotary_emb, eps, out_dtype, version
        )
        ctx.save_for_backward(q, k, v, mixing, summaries, z, den)
        ctx.layout, ctx.feature, ctx.normalize, ctx.rotary_emb = layout, feature, normalize, rotary_emb
        ctx.version, ctx.mix_in = version, mix_in
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, mixing, summaries, z, den = ctx.saved_tensors
        normalize, mix_in = ctx.normalize, ctx.mix_in  # as the forward chose (a setting changed since: ignored)
        shared = mixing is None
        g = _geometry(q, k, v, ctx.layout, ctx.rotary_emb, ctx.version)
        cos, sin, rope_strides = g.tables(ctx.rotary_emb, q)
        common = dict(FEATURE=ctx.feature, USE_ROPE=g.use_rope, NORMALIZE=normalize, SHARED=shared, MIX_IN=mix_in)
        common.update(DOT_DTYPE=g.dot_dtype, PRECISION=g.precision)
        if mix_in:
            mixed, mixed_z = summaries, z
        else:
            mixed, mixed_z = _mix_all(mixing, summaries, z, g, normalize)
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq = _dense_like(q)
        d_mixed = torch.empty_like(summaries)  # per query block, also when the summary is shared
        d_mixed_z = torch.empty_like(summaries[..., 0], dtype=torch.float32) if normalize else z
        g.run(
            "backward_query",
            *(q, grad_out, cos, sin, mixed, mixed_z, q if shared else mixing, den, dq, d_mixed, d_mixed_z),
            *q.stride(),
            *grad_out.stride(),
            *dq.stride(),
            *rope_strides,
            *_mixing_strides(mixing, transpose=False),
            *g.grid_args,
            **common,
        )
        # back through the mixing: dS = m^T dS~, dm_ib = <dS~_i, S_b> (+ <dz~_i, z_b>), all in float32
        if mix_in:  # dS_b = sum_i m_ib dS~_i formed by the key kernel (the mixing's strides transposed)
            d_summaries, d_z = d_mixed, d_mixed_z
        elif shared:  # dS_b = sum_i dS~_i for every b: one shared sum
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
            *(k, v, cos, sin, d_summaries, d_z, q if shared else mixing, dk, dv),
            *k.stride(),
            *v.stride(),
            *dk.stride(),
            *dv.stride(),
            *rope_strides,
            *_mixing_strides(mixing, transpose=True),
            *g.grid_args,
            **common,
        )
        return dq, dk, dv, d_mixing, None, None, None, None, None, None, None


def _mixing_strides(mixing: torch.Tensor | None, transpose: bool) -> tuple[int, int, int]:
    """(head, row, column) strides of the mixing matrix as the kernels index it (head stride 0 when one matrix
    serves every head; row and column swapped for ``m^T``); zeros without one."""
    if mixing is None:
        return (0, 0, 0)
    head = mixing.stride(0) if mixing.dim() == 3 else 0
    rows, cols = mixing.stride(-2), mixing.stride(-1)
    return (head, cols, rows) if transpose else (head, rows, cols)


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
    return fused_attention(q, k, v, layout, mixing.float(), feature_map, normalize, rotary_emb, eps, out_dtype, version)


def fused_attention(
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
    """Checks the arguments the kernels rely on and runs them; ``mixing`` None: linear attention (``layout``
    from :func:`linear_layout`). The caller has checked q, k, v (``check_qkv``) and the mixing matrix
    (``check_mixing``, float32), as :func:`mhla_attention_fused` and :func:`mhla.mhla_attention` do.

    Without a gradient to take (inference, ``torch.no_grad``, or no input that requires one) the launches run
    without an autograd node: nothing is kept for a backward that will not come."""
    if triton is None:
        raise RuntimeError("the fused kernels need Triton; use mhla.mhla_attention on this machine")
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
    feature = FEATURE_IDS[feature_map]
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (mixing is not None and mixing.requires_grad)
    ):
        return _MHLAFunction.apply(q, k, v, mixing, layout, feature, normalize, rotary_emb, eps, out_dtype, version)
    return _forward(q, k, v, mixing, layout, feature, normalize, rotary_emb, eps, out_dtype, version)[0]


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
    layout = linear_layout(q.shape[1])
    return fused_attention(q, k, v, layout, None, feature_map, normalize, rotary_emb, eps, out_dtype, version)


def linear_layout(tokens: int) -> BlockLayout:
    """The chunks linear attention's kernels cut ``tokens`` into: up to 256 chunks of at least 256 tokens (one
    layout per token count, kept)."""
    chunks = max(1, min(256, tokens // 256))
    return cached_layout((1, 1, tokens), (1, 1, chunks))

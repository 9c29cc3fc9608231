"""Softmax attention (the "flash" baseline) through the fastest backend present.

Order tried by ``backend="auto"``: FlashAttention-3 (``flash_attn_interface``, Hopper), FlashAttention-2
(``flash_attn``), xformers, then torch's scaled_dot_product_attention kernels (cuDNN, flash,
memory-efficient, math). Optional packages are used only when installed, on a GPU, with fp16/bf16.
The backend that actually ran is remembered and reported by :func:`last_softmax_backend`, so
benchmarks and the app can name it.
"""

from __future__ import annotations

import importlib
import math
from functools import cache
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_SDPA_KERNELS = {
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
_EXTERNAL = ("flash_attn_3", "flash_attn", "xformers")
SOFTMAX_BACKENDS = ("auto", *_EXTERNAL, "sdpa", *_SDPA_KERNELS)

_last_backend: str | None = None
# (device type, device index, dtype, q head dim, v head dim, needs grad) -> backend that worked for "auto"
_auto_choice: dict[tuple[str, int | None, torch.dtype, int, int, bool], str] = {}


@cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # missing, or built for another torch/CUDA: treat as absent
        return None


def installed_external_backends() -> list[str]:
    """The optional softmax packages importable here (they still need a GPU and fp16/bf16)."""
    names = {"flash_attn_3": "flash_attn_interface", "flash_attn": "flash_attn", "xformers": "xformers.ops"}
    return [b for b, mod in names.items() if _module(mod) is not None]


def last_softmax_backend() -> str | None:
    """Name of the backend that ran the most recent :func:`softmax_attention` call."""
    return _last_backend


def candidate_backends(q: torch.Tensor) -> list[str]:
    """The softmax backends ``"auto"`` tries for ``q``'s device and dtype, fastest first."""
    out = []
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        ext = installed_external_backends()
        if "flash_attn_3" in ext and torch.cuda.get_device_capability(q.device)[0] == 9:
            out.append("flash_attn_3")
        out += [b for b in ("flash_attn", "xformers") if b in ext]
    if q.is_cuda:
        out += ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math"]
    else:
        out += ["sdpa_flash", "sdpa_math"]
    return out


def _run(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    if name == "flash_attn_3":
        # the external modules are used only once installed_external_backends() has found them
        out = cast(ModuleType, _module("flash_attn_interface")).flash_attn_func(q, k, v, softmax_scale=scale)
        return out[0] if isinstance(out, tuple) else out
    if name == "flash_attn":
        return cast(ModuleType, _module("flash_attn")).flash_attn_func(q, k, v, softmax_scale=scale)
    if name == "xformers":
        return cast(ModuleType, _module("xformers.ops")).memory_efficient_attention(q, k, v, scale=scale)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if name == "sdpa":
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    else:
        with sdpa_kernel(_SDPA_KERNELS[name]):
            out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    return out.transpose(1, 2)


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto", scale: float | None = None
) -> torch.Tensor:
    """Softmax attention on ``(batch, tokens, heads, head_dim)`` tensors; returns the same layout.

    ``backend``: one of :data:`SOFTMAX_BACKENDS`. ``"auto"`` tries the fastest first and remembers
    which one worked for this device, dtype and head size; a named backend runs or raises.
    """
    global _last_backend
    if backend not in SOFTMAX_BACKENDS:
        raise ValueError(f"unknown softmax backend {backend!r}; expected one of {SOFTMAX_BACKENDS}")
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "softmax_attention expects q, k shaped (batch, tokens, heads, head_dim) and v with the same "
            f"batch, tokens and heads; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend != "auto":
        if backend in _EXTERNAL and backend not in installed_external_backends():
            raise ValueError(f"softmax backend {backend!r} is not installed here")
        out = _run(backend, q, k, v, scale)
        _last_backend = backend
        return out
    key = (q.device.type, q.device.index, q.dtype, q.shape[-1], v.shape[-1], torch.is_grad_enabled())
    if key in _auto_choice:
        _last_backend = _auto_choice[key]
        return _run(_last_backend, q, k, v, scale)
    errors = []
    for name in candidate_backends(q):
        try:
            out = _run(name, q, k, v, scale)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:  # kernel unsupported here
            errors.append(f"{name}: {str(e).splitlines()[0][:120]}")
            continue
        _auto_choice[key] = _last_backend = name
        return out
    raise RuntimeError("no softmax attention backend could run these inputs:\n" + "\n".join(errors))


def backends_for(device_type: str) -> tuple[str, ...]:
    """The values of ``backend`` that can run on a device type (``"cpu"``, ``"cuda"``): on a CPU only torch's
    flash and math kernels (``"auto"`` and ``"sdpa"`` choose between them; cuDNN, the memory-efficient kernel and
    the optional packages need a GPU); on a GPU every backend but the optional packages not installed here."""
    if device_type == "cuda":
        missing = set(_EXTERNAL) - set(installed_external_backends())
        return tuple(b for b in SOFTMAX_BACKENDS if b not in missing)
    return ("auto", "sdpa", "sdpa_flash", "sdpa_math")


def check_backend(backend: str, device_type: str, name: str = "softmax backend") -> None:
    """``ValueError`` naming ``backend`` and what runs on ``device_type`` when it cannot run there (before a model
    loads: a named kernel that cannot run fails only at the first softmax layer, deep inside generation)."""
    if backend not in SOFTMAX_BACKENDS:
        raise ValueError(f"{name} {backend!r}: unknown; expected one of {', '.join(SOFTMAX_BACKENDS)}")
    usable = backends_for(device_type)
    if backend not in usable:
        why = (
            "is not installed here"
            if backend in _EXTERNAL and device_type == "cuda"
            else f"cannot run on {device_type}"
        )
        raise ValueError(f"{name} {backend!r} {why}; on {device_type} use one of: {', '.join(usable)}")

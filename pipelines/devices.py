"""Where a generation computes and in what precision: the ``--device`` and ``--dtype`` of the command line and the
app, resolved and checked before anything loads (:func:`resolve_device`, :func:`resolve_dtype`).

:mod:`pipelines.loading` loads onto what these resolve (and hands their names on to its callers).
"""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name; expected auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):  # meta holds no data, mps/xpu/... are not what this project runs on
        raise ValueError(f"device {str(device)!r} is not supported; expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for, but CUDA is not available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/None: bfloat16 on GPU, float32 on CPU (CPU half precision is slow and lossy)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {('auto', *DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]

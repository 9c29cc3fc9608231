"""Fails loudly unless ``impl="auto"`` runs the fused Triton kernels on this machine.

    python -m benchmarks.check_fused            # exit 0 and one OK line, or exit 1 and what went wrong

``mhla_attention`` and ``linear_attention`` with ``impl="auto"`` quietly take the PyTorch path when
Triton is missing or when the kernels fail to build (a warning, once). A benchmark would then time
that path under the fused kernels' name. ``benchmarks/run_gpu.sh`` runs this check before every
timing stage and skips them if it fails; it also turns the fallback warning into an error
(``PYTHONWARNINGS``) so that a fallback part-way through a run stops it.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

FALLBACK_WARNING = "MHLA Triton kernels failed"  # the start of ops._run_fused's warning


def check(device: str = "cuda", impl: str = "auto", dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """What keeps ``impl`` from running the fused kernels forward and backward on ``device`` (empty: none)."""
    from mhla import ops, triton_ops

    if device == "cuda" and not torch.cuda.is_available():
        return ["no CUDA device: impl='auto' runs the PyTorch path"]
    if not triton_ops.available():
        return ["Triton is not importable: impl='auto' runs the PyTorch path"]
    problems = []
    tuned, triton_ops.AUTOTUNE = triton_ops.AUTOTUNE, False  # the fixed settings: a check, not a tuning run
    try:
        problems = _run(device, impl, dtype)
    finally:
        triton_ops.AUTOTUNE = tuned
    if ops._fused_failed:
        problems.append("mhla.ops._fused_failed is set: impl='auto' uses the PyTorch path for the rest of the process")
    return problems


def _run(device: str, impl: str, dtype: torch.dtype) -> list[str]:
    from mhla import BlockLayout, linear_attention, locality_init, mhla_attention, triton_ops

    problems = []
    layout = BlockLayout((2, 4, 8), (1, 2, 2))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, layout.num_tokens, 2, 32, generator=gen).to(device, dtype) for _ in range(3))
    mixing = locality_init(layout).to(device)
    for name, run in (
        ("mhla_attention", lambda *x: mhla_attention(*x, layout, mixing, impl=impl)),
        ("linear_attention", lambda *x: linear_attention(*x, impl=impl)),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = run(*leaves)
                out.float().square().sum().backward()
                with torch.no_grad():  # again: the kernels kept by the first call, launched directly on a GPU
                    again = run(*leaves)
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                problems.append(f"{name}(impl={impl!r}) raised {type(e).__name__}: {e}")
                continue
        fused = getattr(out.grad_fn, "_forward_cls", None) is triton_ops._MHLAFunction
        if fused and not torch.equal(again, out.detach()):  # deterministic kernels: a launch that differs is wrong
            problems.append(
                f"{name}(impl={impl!r}): the second call (direct launches: "
                f"{'on' if triton_ops.DIRECT_LAUNCH else 'off'}) differs from the first; MHLA_DIRECT_LAUNCH=0 "
                "launches through Triton's launcher every time"
            )
        for w in caught:
            if str(w.message).startswith(FALLBACK_WARNING):
                problems.append(f"{name}(impl={impl!r}) fell back to the PyTorch path: {w.message}")
        # the PyTorch path has an autograd function of its own: compare the class, not its name
        ran = getattr(out.grad_fn, "_forward_cls", None)
        if ran is not triton_ops._MHLAFunction:
            where = f"{ran.__module__}.{ran.__qualname__}" if ran is not None else type(out.grad_fn).__name__
            problems.append(
                f"{name}(impl={impl!r}) ran the PyTorch path (its output came from {where}, "
                "expected mhla.triton_ops._MHLAFunction)"
            )
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--impl", default="auto", choices=("auto", "triton"))
    args = p.parse_args(argv)
    problems = check(args.device, args.impl)
    if problems:
        for line in problems:
            print(f"FUSED PATH NOT TAKEN: {line}", file=sys.stderr)
        return 1
    from mhla import triton_ops

    direct = f"on, {len(triton_ops._DIRECT)} compiled kernels kept" if triton_ops.DIRECT_LAUNCH else "OFF"
    print(
        f"fused path OK: impl={args.impl!r} runs the Triton kernels forward and backward on {args.device} "
        f"(benchmarks autotune: {'on' if triton_ops.AUTOTUNE else 'off'}; direct launches: {direct})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

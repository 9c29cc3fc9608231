"""Launches and host work per call of the fused operator, counted on any machine (no timing).

    python -m benchmarks.launch_count            # CPU: Triton's interpreter (TRITON_INTERPRET=1 is set here)

Per call, after a first (warm-up) call: the Triton kernel launches; the PyTorch operations that would each
launch a GPU kernel (aten operations under a dispatch mode, less views, allocations and other metadata
operations); the operations that synchronise the host with the GPU (``item``, ``is_nonzero``, ...); and the
Python function calls on the host path (``sys.setprofile``, kernels intercepted so that the interpreter's own
work is not counted). Three callers: the operator with a fixed mixing tensor (as ``benchmarks.attention``
times it), an ``mhla.MHLA`` module under ``torch.no_grad`` and ``reuse_constrained_mixing`` (as a Wan layer in
a pipeline call: its mixing matrix constrained once), and linear attention. A GPU launch costs a few microseconds of host time plus the
launcher's Python work; fewer of both is the fixed cost per call the H100 run measured (~0.5 ms).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze", "slice",
    "select", "as_strided", "alias", "detach", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh",
    "_reshape_alias", "split", "chunk", "unbind", "view_as", "expand_as", "contiguous", "to", "_to_copy_noop",
}  # fmt: skip
SYNC = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "_assert_async"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False  # inside an interpreted Triton kernel: its own copies are not the call's launches

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launches(self) -> dict[str, int]:
        return {k: n for k, n in self.ops.items() if k not in NO_LAUNCH and k not in SYNC}

    def syncs(self) -> dict[str, int]:
        return {k: n for k, n in self.ops.items() if k in SYNC}


class StubCompiled:
    """Stands in for the compiled kernel a GPU launch returns (``triton.compiler.CompiledKernel``): its
    ``[grid](*args)`` takes every argument in the kernel's order, as the direct launches in
    :mod:`mhla.triton_ops` call it. ``run_by_name``: runs the interpreted kernel with the arguments bound by name,
    so that arguments in a wrong order give wrong numbers (tests); otherwise a no-op (counting the host path)."""

    def __init__(self, kernel: Any, run_by_name: bool) -> None:
        self.kernel, self.run_by_name, self.launches = kernel, run_by_name, 0
        self.function = object()

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def runner(*args: Any) -> None:
            if len(args) != len(self.kernel.arg_names):
                raise TypeError(f"{len(args)} arguments for {len(self.kernel.arg_names)} parameters")
            self.launches += 1
            if self.run_by_name:
                self.kernel[grid](**dict(zip(self.kernel.arg_names, args)))

        return runner


class StubKernel:
    """A kernel whose launch returns a :class:`StubCompiled` (as a compiled GPU launch does; the interpreter's
    returns nothing), running the interpreted kernel first when ``run_by_name``."""

    def __init__(self, kernel: Any, run_by_name: bool) -> None:
        self.kernel, self.run_by_name = kernel, run_by_name
        self.arg_names = kernel.arg_names
        self.compiled = StubCompiled(kernel, run_by_name)
        self.jit_launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., StubCompiled]:
        def launch(*args: Any, **kwargs: Any) -> StubCompiled:
            self.jit_launches += 1
            if self.run_by_name:
                self.kernel[grid](*args, **kwargs)
            return self.compiled

        return launch


@contextmanager
def stub_kernels(run_by_name: bool) -> Iterator[dict[str, StubKernel]]:
    """Every kernel (the mixing kernel too) replaced by a :class:`StubKernel`, fixed launch settings, direct launches on and their cache
    empty; restored after."""
    from mhla import triton_ops

    saved = dict(triton_ops.KERNELS), triton_ops.MIXING_KERNEL, triton_ops.AUTOTUNE, triton_ops.DIRECT_LAUNCH
    stubs = {name: StubKernel(k, run_by_name) for name, k in saved[0].items()}
    triton_ops.KERNELS.update(stubs)
    stubs["mixing"] = triton_ops.MIXING_KERNEL = StubKernel(saved[1], run_by_name)
    triton_ops.AUTOTUNE, triton_ops.DIRECT_LAUNCH = False, True
    triton_ops._DIRECT.clear()
    try:
        yield stubs
    finally:
        triton_ops.KERNELS.update(saved[0])
        triton_ops.MIXING_KERNEL, triton_ops.AUTOTUNE, triton_ops.DIRECT_LAUNCH = saved[1:]
        triton_ops._DIRECT.clear()


def host_calls(fn: Callable[[], Any]) -> int:
    """Python function calls (``sys.setprofile``'s call events) while ``fn`` runs."""
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def count_call(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn`` once (warm-up), then counted: Triton launches, torch launches by op, syncs, host Python calls (the
    launches intercepted: the operator's own host path), and the same with the direct launches a GPU takes from
    the second call on (compiled kernels stubbed: the launcher's own call counted as one)."""
    from mhla import triton_ops

    fn()
    names: list[str] = []
    real = triton_ops._launch_kernel
    ops = OpCounter()

    def counted(name: str, *args: Any) -> None:
        names.append(name)
        ops.paused = True
        try:
            real(name, *args)
        finally:
            ops.paused = False

    triton_ops._launch_kernel = counted  # type: ignore[assignment]
    try:
        with ops:
            fn()
    finally:
        triton_ops._launch_kernel = real  # type: ignore[assignment]
    with triton_ops.intercept_launches(lambda *a: None):  # the host path alone, no interpreted kernel
        calls = host_calls(fn)
    with stub_kernels(run_by_name=False) as stubs:
        fn()  # the first launch of each kernel goes through Triton's launcher and is kept

        def launched() -> tuple[int, int]:
            return sum(s.jit_launches for s in stubs.values()), sum(s.compiled.launches for s in stubs.values())

        before = launched()
        direct = host_calls(fn)
        jit, kept = (after - was for after, was in zip(launched(), before))
    torch_launches = ops.launches()
    return {
        "triton": names,
        "torch": torch_launches,
        "launches": len(names) + sum(torch_launches.values()),
        "syncs": ops.syncs(),
        "python_calls": calls,
        "python_calls_direct": direct,
        "direct_launches": kept,
        "jit_launches": jit,
    }


def cases(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, Callable[[], Any]]:
    import mhla
    from mhla import BlockLayout, locality_init

    gen = torch.Generator().manual_seed(seed)
    layout = BlockLayout((2, 4, 4), (1, 2, 2))
    n, h, d = layout.num_tokens, 2, 16
    q, k, v = (torch.randn(1, n, h, d, generator=gen).to(dtype) for _ in range(3))
    angles = (torch.rand(1, n, 1, d // 2, generator=gen) * 6.28).repeat_interleave(2, -1)
    rope = (angles.cos(), angles.sin())
    mixing = locality_init(layout).float()
    module = mhla.MHLA(blocks=(1, 2, 2), normalize=False)

    def op() -> Any:
        return mhla.mhla_attention(q, k, v, layout, mixing, normalize=False, rotary_emb=rope, impl="triton")

    from mhla import mixing as mixing_module

    scope = next(mixing_module._SCOPES)  # one pipeline call's reuse_constrained_mixing(), over every step

    def layer() -> Any:
        before, mixing_module._REUSE_SCOPE[0] = mixing_module._REUSE_SCOPE[0], scope
        try:
            return _layer()
        finally:
            mixing_module._REUSE_SCOPE[0] = before

    def _layer() -> Any:
        with torch.no_grad():
            return mhla.mhla_attention(
                q, k, v, layout, module.mixing(), normalize=False, rotary_emb=rope, impl="triton"
            )

    def linear() -> Any:
        return mhla.linear_attention(q, k, v, normalize=False, rotary_emb=rope, impl="triton")

    return {"operator, fixed mixing": op, "layer in inference (MHLA module's mixing)": layer, "linear": linear}


def main() -> int:
    print(
        "| call (bf16, 32 tokens, 4 blocks, no normalizer) | Triton launches | torch launches | syncs | Python calls "
        "(launches intercepted) | Python calls with direct launches |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, fn in cases().items():
        c = count_call(fn)
        torch_ops = ", ".join(f"{k} {n}" for k, n in sorted(c["torch"].items()))
        print(f"| {name} | {len(c['triton'])} | {sum(c['torch'].values())} ({torch_ops}) | {len(c['syncs'])} | "
              f"{c['python_calls']} | {c['python_calls_direct']} ({c['direct_launches']} direct, "
              f"{c['jit_launches']} through Triton's launcher) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

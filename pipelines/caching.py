"""diffusers' step caches on any variant's transformer: FirstBlockCache and MagCache (the model's ``CacheMixin``).

    python -m pipelines.cli ... --cache first-block:0.05     # skip the other blocks when block 0 barely moved
    python -m pipelines.cli ... --cache mag-calibrate        # MagCache: no skipping, prints the model's ratios
    python -m pipelines.cli ... --cache mag:0.06:ratios.json # MagCache with those ratios (a JSON list)

Both hook the transformer's blocks, not its attention: softmax, linear, MHLA and hybrid layers are cached
alike (tests/pipelines/test_caching.py: equal to the uncached run when nothing is skipped, and skipping as
configured). ``WanPipeline`` keeps one cache per CFG branch (its ``cache_context("cond")`` / ``("uncond")``).
A skipped step reuses the last residual of the skipped blocks: faster, and an approximation, which the
threshold bounds; the paper's numbers are without it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_KINDS = ("first-block", "mag", "mag-calibrate")
FIRST_BLOCK_THRESHOLD = 0.05  # diffusers' default


@dataclass(frozen=True)
class CacheSpec:
    kind: str
    threshold: float = FIRST_BLOCK_THRESHOLD
    mag_ratios: tuple[float, ...] | None = None

    def describe(self) -> str:
        if self.kind == "mag-calibrate":
            return "MagCache calibration (nothing skipped)"
        name = "FirstBlockCache" if self.kind == "first-block" else "MagCache"
        return f"{name}, threshold {self.threshold:g}"


def parse_cache(spec: str) -> CacheSpec | None:
    """``none``, ``first-block[:THRESHOLD]``, ``mag-calibrate`` or ``mag:THRESHOLD:RATIOS.json``; argparse's
    ``type``: a bad spec is an ``ArgumentTypeError`` naming the forms."""
    forms = "none, first-block[:THRESHOLD], mag-calibrate, mag:THRESHOLD:RATIOS.json"
    parts = spec.strip().split(":")
    kind = parts[0]
    try:
        if kind == "none" and len(parts) == 1:
            return None
        if kind == "mag-calibrate" and len(parts) == 1:
            return CacheSpec(kind, 0.0)
        if kind == "first-block" and len(parts) <= 2:
            threshold = float(parts[1]) if len(parts) == 2 else FIRST_BLOCK_THRESHOLD
            return CacheSpec(kind, _threshold(threshold))
        if kind == "mag" and len(parts) == 3:
            ratios = json.loads(Path(parts[2]).read_text())
            if not isinstance(ratios, list) or len(ratios) < 2 or not all(isinstance(r, (int, float)) for r in ratios):
                raise ValueError(f"{parts[2]}: expected a JSON list of numbers (from --cache mag-calibrate)")
            return CacheSpec(kind, _threshold(float(parts[1])), tuple(float(r) for r in ratios))
    except (ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(f"--cache {spec!r}: {e}") from e
    raise argparse.ArgumentTypeError(f"--cache {spec!r}: expected one of {forms}")


def _threshold(value: float) -> float:
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"threshold must be a finite number >= 0, got {value}")
    return value


def cache_config(spec: CacheSpec, num_inference_steps: int) -> Any:
    """The diffusers config object for ``spec``."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig

    if spec.kind == "first-block":
        return FirstBlockCacheConfig(threshold=spec.threshold)
    if spec.kind == "mag-calibrate":
        return MagCacheConfig(num_inference_steps=num_inference_steps, calibrate=True)
    return MagCacheConfig(
        threshold=spec.threshold, num_inference_steps=num_inference_steps, mag_ratios=list(spec.mag_ratios or ())
    )


@contextmanager
def cached(transformer: Any, spec: CacheSpec | None, num_inference_steps: int) -> Iterator[None]:
    """``transformer.enable_cache(...)`` for the block, then ``disable_cache()`` (also on error), so the next
    variant or request starts uncached; ``spec`` None: nothing."""
    if spec is None:
        yield
        return
    transformer.enable_cache(cache_config(spec, num_inference_steps))
    try:
        _compiled_under_cache(transformer)
        yield
    finally:
        transformer.disable_cache()


# one torch.compile'd block forward per (block class, backend, fullgraph, torch.compile mode), shared by every block
# and transformer: TorchDynamo then compiles one graph for all the layers, as diffusers' compile_repeated_blocks does
_COMPILED_FORWARDS: dict[tuple[type, str, bool, str | None], Any] = {}
_MAG_HOOKS = ("mag_cache_leader_block_hook", "mag_cache_block_hook")  # diffusers.hooks.mag_cache's names
_FBC_HOOKS = ("fbc_leader_block_hook", "fbc_block_hook")  # diffusers.hooks.first_block_cache's


def _compiled_under_cache(transformer: Any) -> int:
    """A compiled transformer (:func:`mhla.compiled.compile_transformer`) keeps its blocks compiled, and compiled
    once, under the step cache's hooks.

    diffusers' MagCache hooks run each block's forward inside ``torch.compiler.disable`` (their ``new_forward``), and
    a disabled frame runs everything it calls eagerly: with ``compile_repeated_blocks`` (``--compile blocks``) every
    block ran EAGER whenever MagCache was on. FirstBlockCache's hooks are traced instead, so TorchDynamo guards on
    them: anything that changes them (a wrapper, new hook objects) recompiles the blocks during the run. Here every
    cache hook runs outside TorchDynamo (FirstBlockCache's made ``torch.compiler.disable`` too, as MagCache's are) and
    calls the block's forward under ``torch.compile`` (the transformer's own backend and mode, e.g. reduce-overhead's
    CUDA graphs): the computed steps run
    compiled, one graph for every block, and re-enabling the cache compiles nothing. Returns the hooks rewired (0
    for an uncompiled model)."""
    compiled = getattr(transformer, "_mhla_compiled", None)
    if not compiled:
        return 0
    import functools

    import torch

    _, backend, fullgraph = compiled
    mode = getattr(transformer, "_mhla_compile_mode", None)  # torch.compile's mode (None: its default)
    extra = {} if mode is None else {"mode": mode}
    rewired = 0
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None or module is transformer:
            continue
        for name in (*_MAG_HOOKS, *_FBC_HOOKS):
            hook = registry.get_hook(name)
            if hook is None:
                continue
            key = (type(module), backend, fullgraph, mode)
            if key not in _COMPILED_FORWARDS:
                forward = type(module).forward
                _COMPILED_FORWARDS[key] = torch.compile(forward, backend=backend, fullgraph=fullgraph, **extra)
            if name in _FBC_HOOKS:
                hook.fn_ref.forward = torch.compiler.disable(hook.fn_ref.forward)
            hook.fn_ref.original_forward = functools.partial(_COMPILED_FORWARDS[key], module)
            rewired += 1
    return rewired

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
        yield
    finally:
        transformer.disable_cache()

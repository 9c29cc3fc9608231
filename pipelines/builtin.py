"""The built-in model: a small Wan2.1-architecture text-to-video model trained by this project.

It ships in ``assets/builtin/`` as a complete diffusers-format Wan2.1 T2V directory (tokenizer, text
encoder, VAE, scheduler, the softmax-attention transformer) plus one fine-tuned transformer per
converted variant in ``assets/builtin/variants/<variant>/``. It was trained on the synthetic
moving-shapes world of :mod:`world.synthetic` (see ``factory/build.py`` and README, "Built-in
model"): it makes videos of coloured shapes moving on plain or textured backgrounds, nothing else.

``builtin.json`` beside it records how it was made (data, steps, time, machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .model_dir import missing_model_files

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "assets" / "builtin"
VARIANTS_SUBDIR = "variants"
# 17 frames at 128x160 -> 5x16x20 latent cells; the transformer's patch is (1, 1, 1), so 1,600 tokens.
BUILTIN_DEFAULTS = {
    "height": 128,
    "width": 160,
    "num_frames": 17,
    "num_inference_steps": 20,
    "guidance_scale": 4.0,
    "max_sequence_length": 32,
}
# target block shape in tokens for the default MHLA layout: 5x16x20 -> 2x4x5 blocks (M = 40, M*M = N)
BUILTIN_BLOCK_SHAPE = (2, 4, 4)
# the name that asks for the random-weight tiny model (tests, smoke runs)
TINY_RANDOM = "tiny-random"


def builtin_available(root: str | Path = BUILTIN_DIR) -> bool:
    """Whether the trained built-in model is present (its base directory and ``builtin.json``)."""
    root = Path(root)
    return (root / "builtin.json").is_file() and not missing_model_files(root)


def builtin_info(root: str | Path = BUILTIN_DIR) -> dict[str, Any]:
    """Contents of ``builtin.json``: how the built-in model was trained."""
    return json.loads((Path(root) / "builtin.json").read_text())


def builtin_examples(root: str | Path = BUILTIN_DIR) -> list[str]:
    """The example prompts ``builtin.json`` records (chosen from an evaluation by
    ``python -m factory.examples``); [] when it has none."""
    path = Path(root) / "builtin.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text()).get("example_prompts")
    prompts = record.get("prompts") if isinstance(record, dict) else None
    return [p for p in prompts if isinstance(p, str) and p.strip()] if isinstance(prompts, list) else []


def builtin_variant_dirs(root: str | Path = BUILTIN_DIR) -> dict[str, Path]:
    """Fine-tuned transformer folders of the converted variants, by variant name."""
    folder = Path(root) / VARIANTS_SUBDIR
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "config.json").is_file()}

"""A comparison request: the presets, the checks a request passes before anything runs, the prompt's words
the model does not know, and the permalink that restores a request."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.interleave import MAX_REPEATS  # the page's Repeats and the CLI's --repeats
from common.timing import device_name
from pipelines import VARIANTS
from pipelines.attention import MHLA, MHLA_VARIANTS

from .. import inputs
from ..models import AppModels

log = logging.getLogger(__name__)

# (num_frames, height, width); the token grid is pipelines.latent_grid's (the model's patch and VAE strides)
PRESETS = (
    (5, 32, 48),  # quick on a CPU
    (9, 64, 80),  # the built-in model's third design (factory.v3): 5x8x10 = 400 tokens (VAE 2x4x4, patch 1x2x2)
    (9, 64, 96),  # the tiny random model's default size
    (17, 128, 160),  # the shipped built-in model's size: 5x16x20 = 1,600 tokens; the third design's long one: 2,880
    (17, 128, 192),
    (33, 240, 416),
    (17, 480, 832),
    (81, 480, 800),  # the paper's setting: 21x30x50 = 31,500 tokens, M = 105 (Wan2.1's patch)
    (81, 480, 832),  # Wan2.1's own default: 21x30x52 = 32,760 tokens
)
# On a CPU the wall time of a run grows fast with tokens; above this a request is refused with a
# message instead of tying up the (single) queue for hours. --max-tokens changes it.
CPU_MAX_TOKENS = 8192
MAX_STEPS = 100
MAX_GUIDANCE = 30.0
MAX_PROMPT_CHARS = 2000  # the text encoder reads at most a few hundred tokens; more is a mistake or abuse


def preset_key(preset: tuple[int, int, int]) -> str:
    return "x".join(map(str, preset))


def preset_label(models: AppModels, preset: tuple[int, int, int]) -> str:
    """E.g. ``17x128x160: 1,600 tokens (5x16x20), M=40`` (frames x height x width): the tokens and the M that a run of this
    preset gets with the loaded model (its patch, and the MHLA layout generate() uses, shrunk to fit)."""
    frames, height, width = preset
    grid = models.grid(height, width, frames)
    ms = {v: models.num_blocks(grid, v) for v in MHLA_VARIANTS}
    m = str(ms[MHLA]) if len(set(ms.values())) == 1 else ", ".join(f"{n} ({v})" for v, n in ms.items())
    # short enough for a phone's dropdown: frames x height x width as the dropdown's title says, as permalinks
    return f"{frames}x{height}x{width}: {math.prod(grid):,} tokens ({'x'.join(map(str, grid))}), M={m}"


def preset_tokens(models: AppModels, preset: tuple[int, int, int]) -> int:
    return math.prod(models.grid(preset[1], preset[2], preset[0]))


def preset_choices(models: AppModels, max_tokens: int | None = None) -> list[tuple[str, str]]:
    """``(label, key)`` of the presets this device accepts (at most ``max_tokens`` tokens)."""
    return [
        (preset_label(models, p), preset_key(p))
        for p in PRESETS
        if models.fits(p[1], p[2]) and (max_tokens is None or preset_tokens(models, p) <= max_tokens)
    ]


def presets_left_out(models: AppModels, max_tokens: int | None) -> str | None:
    """Why the larger presets are not offered here, or None when every preset is."""
    if max_tokens is None:
        return None
    out = [p for p in PRESETS if preset_tokens(models, p) > max_tokens]
    if not out:
        return None
    sizes = ", ".join(f"{preset_key(p)} ({preset_tokens(models, p):,} tokens)" for p in out)
    return (
        f"Not offered on this device (more than {max_tokens:,} tokens; start the app with --max-tokens to change): "
        f"{sizes}."
    )


def parse_preset(key) -> tuple[int, int, int]:
    """Only the listed presets are accepted: the value comes from the browser and is not trusted."""
    for p in PRESETS:
        if key == preset_key(p):
            return p
    raise ValueError(f"unknown resolution preset {key!r}; expected one of {', '.join(preset_key(p) for p in PRESETS)}")


def _as_int(name: str, value, lo: int, hi: int) -> int:
    # gr.Number sends floats; an integral float is fine, 2.5 steps is not (refused, never rounded)
    return inputs.whole_number(name, value, lo, hi)


@dataclass
class CompareRequest:
    prompt: str
    negative_prompt: str
    seed: int
    num_inference_steps: int
    guidance_scale: float
    preset: tuple[int, int, int]
    variants: list[str]
    repeats: int = 1
    unknown_words: list[str] = field(default_factory=list)  # words of the prompt the model does not know
    image: Any = None  # the first frame (a PIL image) for a model that takes one; never stored with a result

    @property
    def num_frames(self) -> int:
        return self.preset[0]

    @property
    def height(self) -> int:
        return self.preset[1]

    @property
    def width(self) -> int:
        return self.preset[2]


def check_request(
    models: AppModels,
    prompt,
    negative_prompt,
    seed,
    steps,
    guidance,
    preset,
    variants,
    max_tokens: int | None = None,
    repeats=1,
    image=None,
    upload_dirs: list[Path] | None = None,
) -> CompareRequest:
    """Validates everything the page sends before any model work; ``ValueError`` names the bad value.
    Out-of-range values are refused, never clamped or rounded. ``image``: the uploaded first frame (gradio's
    file data, checked to lie in ``upload_dirs``, or a PIL image), required by an image-to-video model and
    refused by a model that takes none."""
    # types first (a list is not a prompt), then control characters (a NUL would fail every variant's write)
    prompt = inputs.text("prompt", prompt, MAX_PROMPT_CHARS)
    negative_prompt = inputs.text("negative prompt", negative_prompt, MAX_PROMPT_CHARS)
    if not prompt.strip():
        raise ValueError(f"the prompt is empty: describe the video to generate, e.g. '{models.example_prompt}'")
    variants = inputs.choices("variants", variants, VARIANTS)
    seed = _as_int("seed", seed, 0, 2**63 - 1)
    steps = _as_int("steps", steps, 1, MAX_STEPS)
    repeats = _as_int("repeats", repeats, 1, MAX_REPEATS)
    if (
        isinstance(guidance, bool)
        or not isinstance(guidance, (int, float))
        or not math.isfinite(guidance)
        or not 0 <= guidance <= MAX_GUIDANCE
    ):
        raise ValueError(f"guidance must be a number between 0 and {MAX_GUIDANCE:g}, got {guidance!r}")
    chosen = list(variants or [])
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; expected some of {', '.join(VARIANTS)}")
    if not chosen:
        raise ValueError(f"no variant chosen: tick at least one of {', '.join(VARIANTS)}")
    preset = parse_preset(preset)
    if not models.fits(preset[1], preset[2]):
        raise ValueError(
            f"preset {preset_key(preset)} does not divide into this model's tokens (height and width must be "
            f"multiples of {models.vae_stride[1] * models.patch[1]}); pick another size"
        )
    first_frame = inputs.image("first frame", image, upload_dirs or [])
    if models.needs_image and first_frame is None:
        raise ValueError("this model makes a video from an image: upload the first frame (PNG, JPEG or WebP)")
    if first_frame is not None and not models.takes_image:
        raise ValueError("this model is text-to-video: it takes no image (remove the upload)")
    tokens = preset_tokens(models, preset)
    if max_tokens is not None and tokens > max_tokens:
        raise ValueError(
            f"preset {preset_label(models, preset)} is too large for this device ({device_name(models.device)}): "
            f"{tokens:,} tokens, this app allows at most {max_tokens:,} here (start it with --max-tokens to change)"
        )
    return CompareRequest(
        unknown_words=unknown_words(models, prompt),
        prompt=prompt.strip(),
        negative_prompt=(negative_prompt or "").strip(),
        seed=seed,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        preset=preset,
        variants=[v for v in VARIANTS if v in chosen],  # canonical order (flash first), no duplicates
        repeats=repeats,
        image=first_frame,
    )


def unknown_words(models: AppModels, prompt: str) -> list[str]:
    """The words of ``prompt`` that the model's tokenizer reads as its unknown token (each once, in order):
    the built-in model knows only the few dozen words of its world; a large model's tokenizer knows nearly
    every word, and this is then empty."""
    tokenizer = models.components.tokenizer
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not isinstance(prompt, str):
        return []
    out: list[str] = []
    for word in re.findall(r"\w+", prompt.lower()):
        if word not in out and unk in tokenizer(word, add_special_tokens=False).input_ids:
            out.append(word)
    return out


def vocabulary_note(models: AppModels, words: list[str]) -> str:
    """The warning for a prompt with words outside the model's vocabulary ('' when there are none)."""
    if not words:
        return ""
    what = (
        "the built-in model knows only its world's words (colours, shapes, sizes, motions, backgrounds)"
        if models.builtin
        else "the model's tokenizer does not know them"
    )
    return f"⚠ Not in the model's vocabulary: **{', '.join(words)}**; {what}, so these are ignored."


# ---- a link that reproduces a request --------------------------------------------------------------------
PERMALINK_KEYS = ("prompt", "seed", "steps", "variants", "guidance", "preset")


def permalink_query(request: CompareRequest) -> str:
    """The URL query that restores ``request`` on the page: ``?prompt=...&seed=0&steps=20&variants=flash,mhla``
    (guidance and preset too)."""
    from urllib.parse import urlencode

    return "?" + urlencode(
        {
            "prompt": request.prompt,
            "seed": request.seed,
            "steps": request.num_inference_steps,
            "variants": ",".join(request.variants),
            "guidance": f"{request.guidance_scale:g}",
            "preset": preset_key(request.preset),
        }
    )


def request_key(source: str, prompt: str, seed: int, steps: int, guidance: float, preset: str, variants) -> str:
    """The hash a finished run is kept under on this server, so that its permalink opens with its results:
    the model (``source``) and every field the link carries (a run with a negative prompt, a first frame or
    repeats is not kept: its link could not name it)."""
    import hashlib

    fields = [source, prompt, int(seed), int(steps), float(guidance), preset, list(variants)]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:24]


def parse_permalink(params) -> tuple[dict, list[str]]:
    """The page's fields from a URL query (a mapping of str to str, from the browser: not trusted):
    ``({"prompt": ..., "seed": int, "steps": int, "variants": [...], "guidance": float, "preset": key},
    problems)``; a bad value is left out and named in ``problems``, never passed on."""
    out: dict = {}
    problems = []
    get = {k: params.get(k) for k in PERMALINK_KEYS if isinstance(params.get(k), str)}
    if "prompt" in get:
        if len(get["prompt"]) <= MAX_PROMPT_CHARS and get["prompt"].strip():
            out["prompt"] = get["prompt"]
        else:
            problems.append("prompt")
    for key, lo, hi in (("seed", 0, 2**63 - 1), ("steps", 1, MAX_STEPS)):
        if key in get:
            try:
                out[key] = _as_int(key, int(get[key]), lo, hi)
            except ValueError:
                problems.append(key)
    if "guidance" in get:
        try:
            g = float(get["guidance"])
            if not (math.isfinite(g) and 0 <= g <= MAX_GUIDANCE):
                raise ValueError(g)
            out["guidance"] = g
        except ValueError:
            problems.append("guidance")
    if "variants" in get:
        chosen = [v for v in get["variants"].split(",") if v]
        if chosen and all(v in VARIANTS for v in chosen):
            out["variants"] = [v for v in VARIANTS if v in chosen]
        else:
            problems.append("variants")
    if "preset" in get:
        try:
            out["preset"] = preset_key(parse_preset(get["preset"]))
        except ValueError:
            problems.append("preset")
    return out, problems

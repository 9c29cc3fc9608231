"""The app's edge: values from the page or the API are checked for type here, never coerced (a list is not a
prompt, 2.7 is not a repeat count), and a refused value is one line in the server's log, not a traceback.

The handlers get the raw values (``preprocess=False`` on their events): gradio's own preprocessing would turn
a list into its text and round or truncate numbers before any check could see them.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from common.errors import check_text
from common.video import read_image

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger("app")


def text(name: str, value: object, max_chars: int) -> str:
    """``value`` as text: a str (not a list, number or dict) without control characters (NUL, escape; tab
    and newlines are fine), at most ``max_chars`` characters; ValueError naming it otherwise."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"the {name} must be text, got {type(value).__name__} {_short(value)}")
    try:
        check_text(value, f"the {name}", max_chars)
    except ValueError as e:
        raise ValueError(str(e)) from None
    return value


def whole_number(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``: an int or an integral float (gr.Number sends floats); 2.5 is
    refused, never rounded or truncated, as is a bool or text."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value != int(value):
        raise ValueError(f"{name} must be a whole number, got {_short(value)}")
    number = int(value)
    if not lo <= number <= hi:
        raise ValueError(f"{name} must be between {lo} and {hi:,}, got {number:,}")
    return number


def choices(name: str, value: object, allowed: tuple[str, ...] | list[str]) -> list[str]:
    """``value`` as a list of strings from ``allowed`` (a CheckboxGroup's value); ValueError otherwise."""
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of names (some of {', '.join(allowed)}), got {_short(value)}")
    unknown = [v for v in value if v not in allowed]
    if unknown:
        raise ValueError(f"unknown {name} {unknown}; expected some of {', '.join(allowed)}")
    return list(value)


def image(name: str, value: object, upload_dirs: list[Path]) -> Image.Image | None:
    """The page's uploaded image as an RGB PIL image, or None when there is none.

    ``value`` is what gradio hands a handler without preprocessing: its own upload's file data (``{"path": ...}``,
    already copied into gradio's cache by gradio's upload route), or a PIL image from Python. The path is not
    trusted: it must lie inside one of ``upload_dirs`` (gradio's cache), be a file, decode as a picture and hold
    at most :data:`common.video.MAX_IMAGE_PIXELS`; ValueError naming what is wrong otherwise (never the server's path)."""
    from PIL import Image

    if value is None:
        return None
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    raw = value.get("path") if isinstance(value, dict) else getattr(value, "path", None)
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"the {name} must be an uploaded image file, got {_short(type(value).__name__)}")
    path = Path(raw).resolve()
    if not any(path.is_relative_to(Path(d).resolve()) for d in upload_dirs) or not path.is_file():
        raise ValueError(f"the {name} is not an upload of this page; upload the image again")
    return read_image(path, f"the {name}", detail=False)  # never the server's path or the decoder's words


def refused(message: str, title: str = "Bad input"):
    """The ``gr.Error`` for a refused input, after one line in the server's log (gradio prints no traceback
    for it: ``print_exception=False``)."""
    import gradio as gr

    log.warning("refused input: %s", " ".join(message.split())[:500])
    return gr.Error(message, title=title, print_exception=False)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

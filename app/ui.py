"""The page: one ``gr.Blocks`` wiring the tabs (:mod:`app.compare_tab`, :mod:`app.benchmark_tab`), each a module of its
own over :mod:`app.compare` and :mod:`app.bench`, with its own state. No model code here.

Here: the page's theme and style, the header and the warm-up line, and the guard every refused input passes
(:class:`GuardedBlocks`: one sentence to the client, one log line).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gradio as gr
from gradio.exceptions import InvalidPathError

from common.timing import device_name

from . import compare, gpu_results, inputs, preview
from .benchmark_tab import benchmark_tab
from .compare import VARIANT_COLOURS
from .compare_tab import compare_tab
from .models import AppModels, ModelFacts
from .page import PageSource

# System fonts: the default theme pulls Google Fonts, and the app must work with no network at all.
THEME = gr.themes.Default(
    font=[gr.themes.Font("system-ui"), "sans-serif"], font_mono=[gr.themes.Font("ui-monospace"), "monospace"]
)
CSS = (
    """
.random-note {border: 2px solid #d62728; border-radius: 6px; padding: 4px 10px; background: #fff3f3}
/* table headers wrap between words, never inside one ("varian/t") */
#table th, #table th * {word-break: normal !important; overflow-wrap: normal !important; hyphens: none}
/* a failed variant's block reads as an error */
.variant-info blockquote {border-left: 4px solid #d62728; background: #fff3f3; padding: 4px 10px; margin: 0}
/* the compact table fits 1400 px; on a phone it keeps variant, verdict, speedup and end-to-end speedup */
#table table {width: 100%}
@media (max-width: 700px) {
  #table th:nth-child(4), #table td:nth-child(4), #table th:nth-child(6), #table td:nth-child(6) {display: none}
  #table table {font-size: 0.75rem}
  #table th, #table td {padding: 4px !important; overflow-wrap: anywhere}
}
#prompt-note {min-height: 1.2em; font-size: 0.85rem}
/* a phone's width: the preset's label (frames, size, tokens, grid, M) fits the dropdown in a smaller font */
@media (max-width: 500px) {#preset input {font-size: 0.72rem}}
"""
    # one colour per variant everywhere: a bar over each column, as in the chart and the side-by-side video
    + "".join(
        f"#col-{name} {{border-top: 5px solid {colour}; padding-top: 4px}}\n"
        for name, colour in VARIANT_COLOURS.items()
    )
)
QUEUE_SIZE = 16  # requests waiting at most; more are refused with gradio's "queue is full"
# browser sessions (a tab, each page load) whose page state gradio keeps in memory, the least recently used dropped
# (launch's state_session_capacity): gradio's default keeps 10,000, about 0.3 MB each with this page, never freed
# otherwise (3 GB on a server left up; the soak test found it). The app keeps nothing of its own in them.
SESSIONS_KEPT = 64


def header_markdown(models: AppModels | ModelFacts) -> str:
    lines = [
        "# Wan2.1 text-to-video: FlashAttention vs linear attention vs MHLA",
        f"Model: **{models.source}** · device: **{device_name(models.device)}** · dtype: "
        f"{str(models.dtype).replace('torch.', '')}"
        + (f" · memory: {models.memory}" if models.memory else "")
        + (f" · {models.speed}" if models.speed else ""),
    ]
    lines += [f"_{n}_" for n in models.notes]
    return "\n\n".join(lines)


_refused = inputs.refused  # the handlers' parameter named inputs shadows the module below


class GuardedBlocks(gr.Blocks):
    """``gr.Blocks`` whose every refused input reaches the client as one sentence and the server's log as one
    ``refused input:`` line, whichever layer refuses it: gradio refuses a file path that was not uploaded through
    the page before the handlers (and :mod:`app.inputs`) see it, with a ValueError the client gets as
    ``{"error": null}`` and a traceback in the log per request. A session's page state keeps the page's components
    once each, not one more per run (:func:`_drop_fresh_ids`)."""

    async def preprocess_data(self, block_fn, inputs, state, explicit_call=False):
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except (InvalidPathError, gr.Error) as e:
            if isinstance(e, gr.Error) and "cannot be accessed" not in str(e):
                raise  # gradio's other refusals already reach the client as they are
            names = [_input_name(block) for block, value in zip(block_fn.inputs, inputs) if _names_a_file(value)]
            which = names[0] if len(names) == 1 else "a file input"
            raise _refused(
                f"{which} is not an upload of this page (it names a file on the server); upload it again"
            ) from None

    async def postprocess_data(self, block_fn, predictions, state):
        try:
            return await super().postprocess_data(block_fn, predictions, state)
        finally:
            _drop_fresh_ids(state, self.default_config.blocks)


def _drop_fresh_ids(state, page_blocks: dict) -> None:
    """gradio (6.31) keeps a component that a handler updated (``gr.skip()`` counts) in the session's state under its
    new instance's fresh id as well as the page's id, and never drops it: a session grew by about 13 components
    (~0.15 MB) a run (the soak test found it). The entries under ids the page does not have are dropped here; a
    gradio without these attributes is left alone."""
    config = getattr(state, "blocks_config", None)
    for table in (getattr(config, "blocks", None), getattr(state, "config_values", None)):
        if isinstance(table, dict):
            for key in [k for k in table if k not in page_blocks]:
                del table[key]


def _names_a_file(value) -> bool:
    """Whether a raw input value carries a file reference (gradio's FileData: a dict with a path or url)."""
    if isinstance(value, dict):
        return bool(value.get("path") or value.get("url")) or any(_names_a_file(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_names_a_file(v) for v in value)
    return False


def _input_name(block) -> str:
    label = (getattr(block, "label", None) or "").split(" (")[0].strip().lower()  # "First frame (required)"
    return f"the {label}" if label else f"the {type(block).__name__} input"


def build_demo(
    models: AppModels | ModelFacts,
    max_tokens: int | None = None,
    max_bench_tokens: int | None = None,
    out_root: Path | None = None,
    warmup: compare.Warmup | None = None,
    preview_every: int = preview.PREVIEW_EVERY,
) -> gr.Blocks:
    """The app's page. ``models``: the loaded models, or their :class:`~app.models.ModelFacts` while ``warmup``
    loads them in the background (the page is built from either; runs wait for the loaded ones).
    ``max_tokens``/``max_bench_tokens``: largest request accepted (None: no limit).
    ``out_root``: where videos and benchmark files are written (a fresh temporary folder by default).
    ``warmup``: the background warm-up the server started with (runs wait for it; the page says it is going).
    ``preview_every``: a live preview in each running variant's column every this many steps (0: none)."""
    if preview_every < 0:
        raise ValueError(f"preview_every {preview_every}: expected 0 (no previews) or a number of steps")
    if isinstance(models, ModelFacts) and warmup is None:
        raise ValueError("a page built from a model's facts needs the Warmup that loads the model")
    out_root = Path(out_root or tempfile.mkdtemp(prefix="mhla-app-"))
    source = PageSource(models, warmup, out_root, gpu_results.load())

    # delete_cache: gradio copies every returned video into its cache; drop copies older than a day, hourly
    with GuardedBlocks(title="MHLA video: attention variants side by side", delete_cache=(3600, 86400)) as demo:
        gr.Markdown(header_markdown(models))
        warmup_line(demo, warmup)
        if models.random_note:
            gr.Markdown(f"**{models.random_note}.**", elem_classes="random-note", elem_id="random-note")
        compare_tab(demo, source, max_tokens, preview_every)
        benchmark_tab(source, max_bench_tokens)
    return demo


def warmup_line(demo: gr.Blocks, warmup: compare.Warmup | None) -> None:
    """While the background warm-up runs: a visible line, refreshed each second until it is done."""
    warm_note = gr.Markdown(warmup.note() if warmup else "", elem_id="warmup-note")
    if warmup is None:
        return
    warm_timer = gr.Timer(1.0, active=not warmup.done)

    def on_warm_tick():
        return warmup.note(), gr.Timer(active=not warmup.done)

    warm_timer.tick(on_warm_tick, None, [warm_note, warm_timer], queue=False, api_visibility="private")
    demo.load(
        on_warm_tick, None, [warm_note, warm_timer], queue=False, api_visibility="private", show_progress="hidden"
    )


__all__ = ["CSS", "QUEUE_SIZE", "SESSIONS_KEPT", "THEME", "GuardedBlocks", "build_demo", "header_markdown"]

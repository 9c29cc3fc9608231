"""What every tab of the page is built from and shows alike: :class:`PageSource` (the models or their facts, the
warm-up, the output folder, the committed GPU results) and the GPU results panel."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from . import compare, gpu_results
from .models import AppModels, ModelFacts


def gpu_panel(tables: list[gpu_results.GpuTable], tab: str) -> None:
    """The committed GPU results in their own closed accordion, apart from the live timings."""
    text = gpu_results.panel_markdown(tables)
    if text:
        with gr.Accordion(
            f"Measured on a GPU ({tables[0].device}, {tables[0].date[:10]}): committed results, not this machine",
            open=False,
            elem_id=f"gpu-results-{tab}",
        ):
            gr.Markdown(text, elem_id=f"gpu-results-text-{tab}")


@dataclass
class PageSource:
    """What every tab is built from: the models (or their :class:`~app.models.ModelFacts` while ``warmup`` loads
    them), the warm-up, the folder files are written to, the committed GPU results (read once)."""

    models: AppModels | ModelFacts
    warmup: compare.Warmup | None
    out_root: Path
    gpu_tables: list[gpu_results.GpuTable]

    def loaded(self) -> AppModels | None:
        """The loaded models (None while they load, or when loading failed: ``warmup.error``)."""
        if isinstance(self.models, AppModels):
            return self.models
        return self.warmup.models if self.warmup is not None and self.warmup.loaded else None

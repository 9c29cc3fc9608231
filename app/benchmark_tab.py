"""The Benchmark tab: operator and transformer-forward latency against sequence length, measured live
(:mod:`app.bench`); the committed GPU results beside it."""

from __future__ import annotations

import uuid

import gradio as gr

from pipelines import VARIANTS
from pipelines.attention import MHLA, SOFTMAX

from . import bench, inputs
from .page import PageSource, gpu_panel


def benchmark_tab(source: PageSource, max_bench_tokens: int | None) -> None:
    """The Benchmark tab: operator and transformer-forward latency against sequence length, measured live.
    ``max_bench_tokens``: largest grid accepted."""
    page, warmup, out_root, loaded = source.models, source.warmup, source.out_root, source.loaded

    def on_bench(grids, levels, variants, repeats, progress=gr.Progress()):  # noqa: B008
        if warmup is not None and not warmup.done:
            progress(None, desc="waiting for the warm-up to finish")
            warmup.wait()
        models = loaded()
        if models is None:
            raise gr.Error(warmup.note() if warmup else "the model is not loaded", print_exception=False)
        try:
            result = bench.run_benchmark(
                models,
                grids,
                levels=levels,
                variants=variants or [],
                max_tokens=max_bench_tokens,
                repeats=repeats,
                progress=lambda desc: progress(None, desc=desc),
            )
        except ValueError as e:
            raise inputs.refused(str(e)) from None  # one line in the server's log, no traceback
        files = bench.save(result, out_root / "bench" / uuid.uuid4().hex[:12])
        m = result["meta"]
        status = (
            f"Done in {m['seconds']:.1f} s on {m['device']} ({m['dtype']}), operator at the model's "
            f"{m['heads']} heads x {m['head_dim']}, transformer forward = {m['layers']} blocks, batch 1, no CFG."
        )
        return status, bench.figure(result), bench.table(result), [str(f) for f in files]

    with gr.Tab("Benchmark"):
        gr.Markdown(
            "Latency against sequence length, measured live here: the attention operator alone (softmax "
            "through its fastest backend, linear, MHLA) and one forward of the loaded transformer per variant. "
            "Sizes are latent-token grids `FxHxW`; a size that does not fit ends its series."
        )
        with gr.Row():
            grids = gr.Textbox(bench.default_grids(page.device), label="Token grids (FxHxW, comma-separated)")
            levels = gr.CheckboxGroup(
                ["operator", "transformer forward"], value=["operator", "transformer forward"], label="Levels"
            )
            bench_variants = gr.CheckboxGroup(list(VARIANTS), value=[SOFTMAX, MHLA], label="Transformer variants")
            bench_repeats = gr.Slider(1, 20, 3 if page.device.type == "cpu" else 10, step=1, label="Repeats (median)")
        bench_button = gr.Button("Run benchmark", variant="primary", elem_id="bench")
        bench_status = gr.Markdown(label="status", elem_id="bench-status", min_height=70, container=True, padding=True)
        bench_plot = gr.Plot(label="Latency vs tokens (log-log)")
        bench_table = gr.Dataframe(headers=list(bench.FIELDS), label="Results", elem_id="bench-table")
        bench_files = gr.File(label="Download JSON / CSV", file_count="multiple", interactive=False)
        gpu_panel(source.gpu_tables, "bench")
        bench_button.click(
            on_bench,
            [grids, levels, bench_variants, bench_repeats],
            [bench_status, bench_plot, bench_table, bench_files],
            concurrency_id="device",
            concurrency_limit=1,
            show_progress_on=[bench_status],
            api_name="benchmark",
            preprocess=False,  # raw values reach the checks: repeats=2.7 is refused, not truncated
        )

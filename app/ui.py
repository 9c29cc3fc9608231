"""The page: one ``gr.Blocks`` over :mod:`app.compare` and :mod:`app.bench`. No model code here.

Handlers turn the page's values into a request, call the logic, and turn its result (or its
``ValueError``) into component values. Errors go into the status line, so the page shows them and the
server goes on serving.
"""

from __future__ import annotations

import math
import tempfile
import uuid
from pathlib import Path

import gradio as gr

from pipelines import VARIANTS

from . import bench, compare
from .models import AppModels, device_name

EXAMPLE_PROMPTS = [
    "a red fox running through fresh snow, golden hour, cinematic",
    "a paper boat drifting down a rainy street gutter, close-up",
    "an astronaut riding a horse across a desert at sunset",
    "time-lapse of clouds rolling over snowy mountains",
]
# what the built-in model knows: coloured shapes moving on plain or textured backgrounds
BUILTIN_PROMPTS = [
    "a large red square moves to the right on a grey background",
    "a small yellow circle bounces up and down on a black background",
    "a large blue triangle moves diagonally up and to the left on a checkered background",
    "a small green diamond moves up and a large purple circle stays still on a white background",
]


def example_prompts(models: AppModels) -> list[str]:
    return BUILTIN_PROMPTS if models.components.source.startswith("built-in model") else EXAMPLE_PROMPTS


# System fonts: the default theme pulls Google Fonts, and the app must work with no network at all.
THEME = gr.themes.Default(
    font=[gr.themes.Font("system-ui"), "sans-serif"], font_mono=[gr.themes.Font("ui-monospace"), "monospace"]
)
CSS = ".random-note {border: 2px solid #d62728; border-radius: 6px; padding: 4px 10px; background: #fff3f3}"


def _default_preset(models: AppModels, max_tokens: int | None) -> str:
    """The model's own default size when it is a preset and allowed here, else the smallest preset."""
    d = models.components.defaults
    own = (d.get("num_frames"), d.get("height"), d.get("width"))
    if own in compare.PRESETS:
        if max_tokens is None or math.prod(compare.preset_grid(own, models.patch)) <= max_tokens:
            return compare.preset_key(own)
    return compare.preset_key(compare.PRESETS[0])


def header_markdown(models: AppModels) -> str:
    c = models.components
    lines = [
        "# Wan2.1 text-to-video: FlashAttention vs linear attention vs MHLA",
        f"Model: **{c.source}** · device: **{device_name(models.device)}** · dtype: {str(c.dtype).replace('torch.', '')}",
    ]
    lines += [f"_{n}_" for n in models.notes]
    return "\n\n".join(lines)


def build_demo(models: AppModels, max_tokens: int | None = None, max_bench_tokens: int | None = None,
               out_root: Path | None = None) -> gr.Blocks:  # fmt: skip
    """The app's page. ``max_tokens``/``max_bench_tokens``: largest request accepted (None: no limit).
    ``out_root``: where videos and benchmark files are written (a fresh temporary folder by default)."""
    out_root = Path(out_root or tempfile.mkdtemp(prefix="mhla-app-"))
    defaults = models.components.defaults

    def on_compare(prompt, negative, seed, steps, guidance, preset, variants, progress=gr.Progress(track_tqdm=True)):  # noqa: B008 (gradio's way)
        try:
            request = compare.check_request(
                models, prompt, negative, seed, steps, guidance, preset, variants, max_tokens
            )
        except ValueError as e:
            # columns and table keep the previous run; only the status line changes
            return [f"**Error:** {e}"] + [gr.skip()] * (3 * len(VARIANTS) + 3)
        result = compare.run_compare(
            models, request, out_root / "compare",
            progress=lambda i, n, desc: progress((i, n), desc=f"variant {desc}", unit="variants"),
        )  # fmt: skip
        failed = [r.variant for r in result.runs if r.error]
        status = (
            f"**Error** in {', '.join(failed)}: see the column(s) below; the app is still serving."
            if failed
            else f"Done: {len(result.runs)} variant(s), same seed {request.seed}."
        )
        outs = [status]
        for name in VARIANTS:
            run = result.run(name)
            outs += [
                gr.Column(visible=run is not None),
                str(run.video) if run and run.video else None,
                compare.variant_markdown(run) if run else "",
            ]
        outs += [compare.summary_markdown(result), compare.table_rows(result), compare.speedup_figure(result)]
        return outs

    def on_bench(grids, levels, variants, repeats, progress=gr.Progress()):  # noqa: B008
        try:
            result = bench.run_benchmark(
                models, grids, levels=levels, variants=variants or [], max_tokens=max_bench_tokens,
                repeats=repeats, progress=lambda desc: progress(None, desc=desc),
            )  # fmt: skip
        except ValueError as e:
            return f"**Error:** {e}", gr.skip(), gr.skip(), gr.skip()
        files = bench.save(result, out_root / "bench" / uuid.uuid4().hex[:12])
        m = result["meta"]
        status = (
            f"Done in {m['seconds']:.1f} s on {m['device']} ({m['dtype']}), operator at the model's "
            f"{m['heads']} heads x {m['head_dim']}, transformer forward = {m['layers']} blocks, batch 1, no CFG."
        )
        return status, bench.figure(result), bench.table(result), [str(f) for f in files]

    # delete_cache: gradio copies every returned video into its cache; drop copies older than a day, hourly
    with gr.Blocks(title="MHLA video: attention variants side by side", delete_cache=(3600, 86400)) as demo:
        gr.Markdown(header_markdown(models))
        if models.random_note:
            gr.Markdown(f"**{models.random_note}.**", elem_classes="random-note", elem_id="random-note")
        with gr.Tab("Compare"):
            with gr.Row():
                with gr.Column(scale=3):
                    prompt = gr.Textbox(
                        label="Prompt", lines=2, elem_id="prompt", placeholder=example_prompts(models)[0]
                    )
                    negative = gr.Textbox(label="Negative prompt", lines=1, elem_id="negative")
                    gr.Examples(example_prompts(models), inputs=[prompt], label="Example prompts")
                with gr.Column(scale=2):
                    preset = gr.Dropdown(
                        compare.preset_choices(models.patch, models.components.block_shape), value=_default_preset(models, max_tokens),
                        label="Frames and resolution (latent tokens, MHLA blocks M)", elem_id="preset",
                    )  # fmt: skip
                    variants = gr.CheckboxGroup(
                        list(VARIANTS), value=list(VARIANTS), label="Variants", elem_id="variants"
                    )
                    with gr.Row():
                        seed = gr.Number(0, label="Seed", precision=0, elem_id="seed")
                        steps = gr.Slider(1, compare.MAX_STEPS, defaults["num_inference_steps"], step=1, label="Steps")
                        guidance = gr.Slider(
                            0, compare.MAX_GUIDANCE, defaults["guidance_scale"], step=0.5, label="Guidance"
                        )
            run_button = gr.Button("Generate with each variant", variant="primary", elem_id="generate")
            status = gr.Markdown(elem_id="status", min_height=70, container=True, padding=True)
            columns = []
            with gr.Row(equal_height=False):
                for name in VARIANTS:
                    with gr.Column(min_width=200, elem_id=f"col-{name}") as col:
                        video = gr.Video(
                            label=name, autoplay=True, loop=True, interactive=False, height=260, elem_id=f"video-{name}"
                        )
                        md = gr.Markdown(f"### {name}\n_{models.variants[name].note}_", elem_id=f"latency-{name}")
                    columns += [col, video, md]
            summary = gr.Markdown(elem_id="summary")
            table = gr.Dataframe(headers=compare.TABLE_HEADERS, label="Latency by variant", elem_id="table", wrap=True)
            chart = gr.Plot(label="Per-step latency and speedup vs flash", elem_id="chart")
            run_button.click(
                on_compare,
                [prompt, negative, seed, steps, guidance, preset, variants],
                [status, *columns, summary, table, chart],
                concurrency_id="device",  # one run at a time: compare and benchmark share the device
                concurrency_limit=1,
                # one progress bar (variant i/n, then its denoising steps) in the status box, not over every video
                show_progress_on=[status],
                api_name="compare",
            )
        with gr.Tab("Benchmark"):
            gr.Markdown(
                "Latency against sequence length, measured live here: the attention operator alone (softmax "
                "through its fastest backend, linear, MHLA) and one forward of the loaded transformer per variant. "
                "Sizes are latent-token grids `FxHxW`; a size that does not fit ends its series."
            )
            with gr.Row():
                grids = gr.Textbox(bench.default_grids(models.device), label="Token grids (FxHxW, comma-separated)")
                levels = gr.CheckboxGroup(
                    ["operator", "transformer forward"], value=["operator", "transformer forward"], label="Levels"
                )
                bench_variants = gr.CheckboxGroup(list(VARIANTS), value=["flash", "mhla"], label="Transformer variants")
                repeats = gr.Slider(1, 20, 3 if models.device.type == "cpu" else 10, step=1, label="Repeats (median)")
            bench_button = gr.Button("Run benchmark", variant="primary", elem_id="bench")
            bench_status = gr.Markdown(elem_id="bench-status", min_height=70, container=True, padding=True)
            bench_plot = gr.Plot(label="Latency vs tokens (log-log)")
            bench_table = gr.Dataframe(headers=list(bench.FIELDS), label="Results", elem_id="bench-table")
            bench_files = gr.File(label="Download JSON / CSV", file_count="multiple", interactive=False)
            bench_button.click(
                on_bench,
                [grids, levels, bench_variants, repeats],
                [bench_status, bench_plot, bench_table, bench_files],
                concurrency_id="device",
                concurrency_limit=1,
                show_progress_on=[bench_status],
                api_name="benchmark",
            )
    return demo

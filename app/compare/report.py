"""A comparison result presented: each variant's column, the tables, the headline and summary, the chart."""

from __future__ import annotations

import logging
import math

from common.interleave import NOISY, PairedSpeedup, median_rank, speedup_text
from common.timing import Timing
from pipelines.attention import SOFTMAX

from .. import quality
from .chart import CHART_INK, latency_chart  # noqa: F401 - CHART_INK: the package's name too
from .engine import VARIANT_COLOURS, CompareResult, VariantRun

log = logging.getLogger(__name__)

# ---- presenting a result ------------------------------------------------------------------------------


def _peak(t: Timing) -> str:
    return "n/a (CPU)" if t.peak_memory_bytes is None else f"{t.peak_memory_bytes / 2**30:.2f} GiB"


def attention_share(t: Timing) -> float:
    """Fraction of denoising time spent inside self-attention."""
    return t.self_attention / t.denoising if t.denoising > 0 else 0.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _speedup(x: PairedSpeedup | None) -> str:
    """The table's cell, worded as the CLI's (:func:`common.interleave.speedup_text`)."""
    return speedup_text(x)


def agreement_text(run: VariantRun) -> str:
    """PSNR and SSIM against flash's video ('' without one)."""
    if run.psnr is None:
        return ""
    psnr = "identical" if math.isinf(run.psnr) else f"{run.psnr:.1f} dB"
    return f"{psnr} / {run.ssim:.3f}"


AGREEMENT_NOTE = (
    "Agreement with flash (PSNR, SSIM) says how close a video is to flash's for the same seed, not whether it "
    "shows the prompt: a blank video can agree well with a dark one."
)


def variant_markdown(run: VariantRun, result: CompareResult | None = None) -> str:
    """The block under a variant's video: what it shows, speed, agreement with flash, where the time went."""
    head = f"### {run.variant}\n_{run.note}_\n\n"
    if run.error:
        return head + f"> **✖ {run.variant} failed:** {run.error}"
    t, s = run.timing, run.steps
    lines = []
    if run.degenerate:
        lines.append(f"- **⚠ degenerate: {run.degenerate} video** (ranked last whatever its agreement with flash)")
    if run.attributes is not None:
        lines.append(
            f"- against the prompt: **{quality.verdict_text(run.attributes)}** "
            f"({quality.attribute_marks(run.attributes)})"
        )
    elif run.judged:
        lines.append(f"- against the prompt: {quality.NOT_JUDGED}")
    lines.append(f"- denoising step: **{_ms(s.median)}** median, ±{s.relative:.0%} ({s.n} steps)")
    if result is not None and run.variant != SOFTMAX:
        den, e2e = result.speedups(run)
        if den is not None:
            lines.append(
                f"- vs flash: **{den.estimate:.2f}x** per denoising step (95% interval "
                f"{den.low:.2f}-{den.high:.2f}, {den.n} paired steps)"
                + (" · _noisy_" if den.noisy else "")
                + (f", {e2e:.2f}x end to end" if e2e is not None else "")
            )
    agreement = agreement_text(run)
    if agreement:
        lines.append(f"- agreement with flash (PSNR / SSIM): {agreement}")
    lines += [
        f"- own time: {run.stage('total').median:.2f} s = text encoding {run.stage('text_encoding').median:.2f} s"
        f" + denoising {run.stage('denoising').median:.2f} s + VAE decoding {run.stage('vae_decode').median:.2f} s",
        f"- self-attention: {attention_share(t):.0%} of denoising; peak memory: {_peak(t)}",
        f"- tokens: {t.num_tokens:,}; layout: {t.layout}",
    ]
    return head + "\n".join(lines)


# the table a person reads at a glance (the page shows fewer of these on a phone); details on demand below
TABLE_HEADERS = [
    "variant",
    "against the prompt",
    "speedup per step vs flash (95% interval)",
    "end-to-end s",
    "end-to-end speedup",
    "agreement with flash (PSNR / SSIM)",
]
DETAIL_HEADERS = [
    "variant",
    "step ms (median)",
    "step spread",
    "paired steps",
    "ratio spread",
    "tokens",
    "M",
    "text encoding s",
    "denoising s",
    "VAE decoding s",
    "self-attention share",
    "weights",
    "peak memory",
    "softmax backend",
]


def table_rows(result: CompareResult) -> list[list]:
    """One row per finished variant, best against the prompt first (failed ones last, saying why)."""
    rows = []
    for r in [*result.ranking(), *(r for r in result.runs if r.error)]:
        if r.error:
            rows.append([r.variant, f"error: {r.error}"] + [""] * (len(TABLE_HEADERS) - 2))
            continue
        den, e2e = result.speedups(r)
        rows.append(
            [
                r.variant,
                r.verdict or "video (this model has no analyser)",
                "reference" if r.variant == SOFTMAX else _speedup(den),
                round(r.stage("total").median, 2),
                "reference" if r.variant == SOFTMAX else ("-" if e2e is None else f"{e2e:.2f}x"),
                agreement_text(r) or ("reference" if r.variant == SOFTMAX else "-"),
            ]
        )
    return rows


def table_markdown(result: CompareResult) -> str:
    """:func:`table_rows` as a Markdown table: a real HTML table on the page, whose less important columns a
    phone's narrow screen hides (end-to-end seconds, agreement with flash)."""
    lines = ["| " + " | ".join(TABLE_HEADERS) + " |", "|" + "---|" * len(TABLE_HEADERS)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in table_rows(result)]
    return "\n".join(lines)


ALL_HEADERS = TABLE_HEADERS + DETAIL_HEADERS[1:]


def detail_rows(result: CompareResult) -> list[list]:
    """Everything measured (:data:`ALL_HEADERS`: the table's columns, then the details), one row per variant,
    in the table's order."""
    rows = []
    compact = {row[0]: row for row in table_rows(result)}
    for r in [*result.ranking(), *(r for r in result.runs if r.error)]:
        if r.error:
            rows.append(compact[r.variant] + [""] * (len(DETAIL_HEADERS) - 1))
            continue
        t, s = r.timing, r.steps
        den, _ = result.speedups(r)
        rows.append(
            compact[r.variant]
            + [
                round(s.median * 1e3, 2),
                f"±{s.relative:.0%} (n={s.n})",
                len(r.paired_steps),
                "-" if den is None else f"±{den.ratio_spread:.0%}",
                t.num_tokens,
                "-" if t.num_blocks is None else t.num_blocks,
                round(r.stage("text_encoding").median, 3),
                round(r.stage("denoising").median, 3),
                round(r.stage("vae_decode").median, 3),
                f"{attention_share(t):.0%}",
                r.kind,
                _peak(t),
                t.softmax_backend or "-",
            ]
        )
    return rows


def noise_warning(result: CompareResult) -> str | None:
    """A warning when a speedup's interval is wider than ±10% (or the variants could not interleave)."""
    noisy = []
    for r in result.runs:
        den, _ = result.speedups(r)
        if den is not None and den.noisy:
            few = "one pair" if den.n < 2 else f"{den.n} pairs, too few for one"
            noisy.append(f"{r.variant} ({den.width_text if median_rank(den.n) else few})")
    parts = []
    if noisy:
        parts.append(f"the 95% intervals of {', '.join(noisy)} are wider than ±{NOISY:.0%}")
    if not result.interleaved and len(result.runs) > 1:
        parts.append(
            "the variants share one transformer (converted in place), so they ran one after another and a change "
            "of machine load between them shows up as a speedup"
        )
    if not parts:
        return None
    return (
        "⚠ **Noisy timings:** "
        + "; ".join(parts)
        + ". Raise **Repeats**, use more steps, or run on a quieter machine"
        + (f" ({result.load})." if result.load else ".")
    )


def headline_markdown(result: CompareResult) -> str:
    """The two lines a person takes away: the speedups with their intervals (flagged when noisy), and which
    video shows the prompt (a degenerate one labelled, never first)."""
    speed = []
    for r in result.runs:
        den, _ = result.speedups(r)
        if den is not None:
            flag = " ⚠ noisy" if den.noisy else ""
            speed.append(f"**{r.variant} {den.estimate:.2f}x**" + (f" ({den.low:.2f}-{den.high:.2f}){flag}"))
    lines = []
    if speed:
        lines.append("### Speedup per denoising step vs flash (95% interval): " + " · ".join(speed))
    ranked = result.ranking()
    if ranked:
        # one line first: which variants drew the prompt, or that none did (a degenerate video never counts)
        summary = quality.summary_line(
            {r.variant: None if r.degenerate else r.attributes for r in ranked}, any(r.judged for r in ranked)
        )
        per = [f"{r.variant}: {r.verdict}" for r in ranked if r.attributes is not None or r.degenerate]
        parts = [summary] if summary else []
        if per:
            parts.append("Against the prompt (best first): " + " · ".join(per))
        if parts:
            lines.append(" ".join(parts))
    return "\n\n".join(lines)


def summary_markdown(result: CompareResult) -> str:
    req = result.request
    tokens = next((r.timing.num_tokens for r in result.runs if r.timing), None)
    lines = []  # the headline and the noise warning are the page's first lines (headline_markdown, noise_warning)
    if result.measured:
        lines.append(f"**Precomputed result** ({result.measured}); press Generate for a fresh run on this machine.")
    how = (
        "the variants took turns, one denoising step each (round-robin), so a change of machine load hits all "
        "alike; each speedup is the median of the paired per-step ratios flash/variant with a distribution-free "
        "95% interval (each run's first step is a warm-up, not counted)"
        if result.interleaved
        else "the variants ran one after another (they share one transformer); speedups pair step k of each run"
    )
    lines += [
        f"**Device:** {result.device}"
        + (f" ({result.load} at the start)" if result.load else "")
        + f" · **softmax backend that ran:** {result.softmax_backend}",
        f"**Request:** {req.num_frames} frames at {req.height}x{req.width}"
        + (f" ({tokens:,} tokens)" if tokens else "")
        + f", {req.num_inference_steps} steps, guidance {req.guidance_scale:g}, **seed used: {req.seed}** "
        f"(same noise for every variant), {req.repeats} timed run(s) per variant",
        f"**Timing:** {how}. End to end is each variant's own time: text encoding + denoising + VAE decoding. "
        + AGREEMENT_NOTE,
    ]
    failed = [r.variant for r in result.runs if r.error]
    if failed:
        lines.append(f"**Failed:** {', '.join(failed)} (see their columns); the app is still serving.")
    if result.stopped:
        done = [r.variant for r in result.runs]
        lines.append(f"**Stopped** by the user after {', '.join(done) or 'no variant'}.")
    if result.random_note:
        lines.append(f"**{result.random_note}.**")
    return "\n\n".join(x for x in lines if x)


def speedup_figure(result: CompareResult):
    """Median denoising-step latency by variant (one colour per variant, interquartile bars), each bar
    labelled with its paired speedup over flash; transparent, with mid-grey ink for light and dark pages
    (:func:`app.compare.chart.latency_chart`)."""
    done = [r for r in result.runs if r.timings]
    stats = [r.steps for r in done]
    labels = []
    for r in done:
        den, _ = result.speedups(r)
        label = SOFTMAX if r.variant == SOFTMAX else (f"{den.estimate:.2f}x" if den else "")
        labels.append(label + "?" if den is not None and den.noisy else label)
    noisy = any((d := result.speedups(r)[0]) is not None and d.noisy for r in done)
    # two lines when noisy: on one, "...; ? = noisy, interval over ±10%)" ran past the figure's edge and was cut
    title = "step latency (median; label: speedup vs flash)"
    if noisy:
        title += f"\n? = noisy: the 95% interval is wider than ±{NOISY:.0%}"
    return latency_chart(
        [r.variant for r in done],
        [s.median * 1e3 for s in stats],
        ([(s.median - s.low) * 1e3 for s in stats], [(s.high - s.median) * 1e3 for s in stats]),
        labels,
        [VARIANT_COLOURS.get(r.variant, "#888888") for r in done],
        title,
    )

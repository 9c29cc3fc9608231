"""The step-latency chart: one bar per variant (its median denoising-step time, interquartile error bars), each
labelled (flash by name, the others by their speedup over it). :func:`app.compare.report.speedup_figure` draws it
for a finished comparison; the warm-up draws it once with placeholder numbers, so that the chart library's first
use (its import and fonts: 0.4 s on the 2-core CPU) is not paid by the first run. One function for both: the warm-up
pays exactly the calls a run makes."""

from __future__ import annotations

from collections.abc import Sequence

# mid grey reads on a white page and on a dark one: the chart has no background of its own
CHART_INK = "#8a8a8a"


def latency_chart(
    names: Sequence[str],
    medians_ms: Sequence[float],
    errors_ms: tuple[Sequence[float], Sequence[float]],
    labels: Sequence[str],
    colours: Sequence[str],
    title: str,
):
    """A closed matplotlib figure (gradio renders the object; pyplot's registry does not grow per request):
    ``errors_ms`` the bars' (below, above) extents, ``labels`` written above each bar's top error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    fig.patch.set_alpha(0.0)
    ax.set_facecolor("none")
    ax.bar(list(names), list(medians_ms), color=list(colours))
    ax.errorbar(
        list(names),
        list(medians_ms),
        yerr=[list(e) for e in errors_ms],
        fmt="none",
        ecolor=CHART_INK,
        capsize=6,
        lw=1.2,
    )
    for x, (label, median, above) in enumerate(zip(labels, medians_ms, errors_ms[1], strict=True)):
        ax.annotate(
            label, (x, median + above), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
            fontsize=12, color=CHART_INK, fontweight="bold",
        )  # fmt: skip
    ax.set_ylabel("ms per denoising step", fontsize=11, color=CHART_INK)
    ax.set_title(title, fontsize=10, color=CHART_INK)
    ax.tick_params(colors=CHART_INK, labelsize=11)
    for spine in ax.spines.values():
        spine.set_color(CHART_INK)
    ax.margins(y=0.25)
    fig.tight_layout()
    plt.close(fig)
    return fig


def warm_chart(names: Sequence[str], colours: Sequence[str]) -> None:
    """The chart drawn once with placeholder numbers (the warm-up's)."""
    n = len(names)
    latency_chart(names, [1.0 + i for i in range(n)], ([0.1] * n, [0.1] * n), ["1.00x"] * n, colours, "step latency")

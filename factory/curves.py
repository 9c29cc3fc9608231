"""A training run's curves from its ``metrics.jsonl``: the loss, the held-out loss and the conditioning probe.

    python -m factory.curves runs/builtin-v2/base/metrics.jsonl --out assets/builtin-next/curves/base.png

Three panels: the training loss (a running mean over ``--window`` steps), the held-out loss (raw weights and
EMA), and the probe's swap ratio per attribute (mean over its sigmas; EMA dashed). A ratio near 1 means the
model ignores that word (the probe's gate). ``--summary`` also writes the probe rows as a small JSON beside the
plot (step, held-out losses, ratios), the record a later session can read without the run. ``--earlier`` takes
such a summary of the run's earlier part (a run that went on from a stage's committed weights on another machine,
``train.start_step``: its metrics begin there): its rows before the metrics' first step are drawn and summarised
with them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from common.errors import run_cli
from common.outputs import atomic_write, write_text_atomic
from common.video import check_output_path


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``, in order; a line that is not JSON is named with its number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist; expected a run's metrics.jsonl")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n} is not a JSON row: {line[:60]!r}") from None
    if not rows:
        raise ValueError(f"{str(path)!r} has no rows")
    return rows


def probe_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows with a probe: ``{"step", "eval_loss", "eval_loss_ema", "ratio", "ratio_ema"}`` (ratios: mean
    over sigmas per attribute; the EMA entries None when the run has no EMA), and ``ratio_by_sigma`` (attribute ->
    sigma -> ratio, the raw weights') when the probe kept them: the issue's shape target is read at sigma 0.9."""
    out = []
    for r in rows:
        if "probe" not in r:
            continue
        out.append(
            {
                "step": r["step"],
                "eval_loss": r.get("eval_loss"),
                "eval_loss_ema": r.get("eval_loss_ema"),
                "ratio": r["probe"]["mean_ratio"],
                "ratio_ema": r["probe_ema"]["mean_ratio"] if "probe_ema" in r else None,
            }
        )
        if isinstance(r["probe"].get("ratio"), dict):
            out[-1]["ratio_by_sigma"] = r["probe"]["ratio"]
    return out


def earlier_rows(summary: str | Path, rows: Sequence[dict]) -> list[dict]:
    """The probe rows of a summary (``--summary``'s JSON) at steps before the first of ``rows`` (a metrics file's):
    the part of the run its metrics no longer hold."""
    path = Path(summary)
    if not path.is_file():
        raise FileNotFoundError(f"--earlier {str(path)!r} does not exist; expected a --summary JSON of this run")
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--earlier {str(path)!r} is not JSON ({e.msg}); expected a --summary JSON") from None
    if not isinstance(earlier, list) or not all(isinstance(r, dict) and "step" in r and "ratio" in r for r in earlier):
        raise ValueError(f"--earlier {str(path)!r}: expected a list of probe rows (step, ratio, ...) from --summary")
    first = min(r["step"] for r in rows)
    return [r for r in earlier if r["step"] < first]


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(
    rows: Sequence[dict], out: str | Path, title: str = "", window: int = 50, earlier: Sequence[dict] = ()
) -> Path:
    """The three panels of a run's ``rows``; ``earlier``: probe rows before them (:func:`earlier_rows`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = check_output_path(out, (".png",))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    probes = [*earlier, *probe_rows(rows)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    if train:
        steps, losses = zip(*train, strict=True)
        ax.plot(steps, losses, color="0.8", lw=0.5, label="loss")
        ax.plot(steps, running_mean(losses, window), color="C0", label=f"mean of {window}")
    ax.set(title="training loss", xlabel="step")
    ax.legend()
    ax = axes[1]
    for key, style in (("eval_loss", "-"), ("eval_loss_ema", "--")):
        pts = [(p["step"], p[key]) for p in probes if p[key] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=key.replace("eval_loss", "held-out"))
    ax.set(title="held-out loss", xlabel="step")
    if probes:
        ax.legend()
    ax = axes[2]
    attributes = sorted({a for p in probes for a in p["ratio"]})
    for i, a in enumerate(attributes):
        ax.plot([p["step"] for p in probes], [p["ratio"][a] for p in probes], color=f"C{i}", marker="o", ms=3, label=a)
        ema = [(p["step"], p["ratio_ema"][a]) for p in probes if p["ratio_ema"]]
        if ema:
            ax.plot(*zip(*ema, strict=True), "--", color=f"C{i}")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set(title="swap ratio (1 = word ignored; EMA dashed)", xlabel="step")
    if attributes:
        ax.legend()
    if title:
        fig.suptitle(title)
    return save_png(fig, out, dpi=90)


def save_png(fig, out: Path, dpi: int = 80) -> Path:
    """``fig`` laid out tightly and written to ``out`` as PNG atomically (a kill leaves the old plot or the new
    one), then closed: the factory's plots end here."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_write(out) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv, prog="factory.curves")


def _main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.curves", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    p.add_argument("--window", type=int, default=50, help="steps in the training loss's running mean")
    p.add_argument("--summary", default=None, help="also write the probe rows here (JSON)")
    p.add_argument(
        "--earlier",
        default=None,
        help="a --summary JSON of the run's earlier part (its rows before the metrics' first step are kept)",
    )
    args = p.parse_args(argv)
    if args.window < 1:
        raise ValueError(f"--window must be >= 1, got {args.window}")
    summary = check_output_path(args.summary, (".json",)) if args.summary else None
    rows = read_metrics(args.metrics)
    earlier = earlier_rows(args.earlier, rows) if args.earlier else []
    print(f"wrote {plot(rows, args.out, args.title, args.window, earlier)}")
    probes = [*earlier, *probe_rows(rows)]
    if summary is not None:
        write_text_atomic(summary, json.dumps(probes, indent=1) + "\n")
        print(f"wrote {summary}")
    for r in probes[-3:]:
        ratios = " ".join(f"{a} {v:.3f}" for a, v in r["ratio"].items())
        print(f"step {r['step']}: held-out {r['eval_loss']:.4f}  swap ratios {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

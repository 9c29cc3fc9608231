"""Short A/B arms of the base's recipe judged side by side (issue 49's shape levers).

    python -m factory.arms control=runs/builtin-v3/joint/metrics.jsonl logit05=runs/ab-noise/logit05/metrics.jsonl \\
        --from 7000 --to 7250 [--control control] [--sigma 0.9] \\
        [--diagnosis logit05=runs/ab-noise/logit05-uncond.json ...] --out assets/builtin-next/v3/curves/arms-step7000

An arm resumes the same checkpoint as the base's own run (``resume=CHECKPOINT``, optimiser and all) with one
setting changed, and logs the conditioning probe (``training.probe``) every ``validation.probe_every`` steps into
its ``metrics.jsonl``; the control is the base's own steps from the same checkpoint. Each arm is read over the
steps ``(--from, --to]``: the probe's swap ratio per attribute at ``--sigma`` (the loss with the word swapped over
the loss with the true word: 1 = ignored), its mean over the window and its least-squares slope per 250 steps, and
the probe's flow losses at each of its sigmas. A single probe of 8 clips moves by about 0.1 from one probe to the
next, so an arm's mean is set against the control's with the standard error of the difference (the residuals
about each arm's fitted line); only a difference over two standard errors is called a change.
Beside them the EMA's probe (``probe_ema``, where the run keeps an EMA): smooth, so its slope over the window
is the clearer trend, but its rows are not independent (each averages the last ~500 steps), so no verdict is
drawn from them. ``--diagnosis NAME=JSON`` adds a ``factory.shape_probe`` record of that arm (``unconditional``: the shape rate and
the frames holding an object; ``uncaptioned``: the clips keeping their shape, colour and background per sigma;
``swap``: the clips keeping their shape with the true caption and following a swapped shape word, per sigma).

``--out OUT`` writes ``OUT.json`` (every figure), ``OUT.md`` (a table per arm) and ``OUT.png`` (the shape ratio
against the step, one line per arm).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.errors import run_cli
from common.outputs import write_text_atomic
from common.video import check_output_path
from factory import write_json
from factory.curves import read_metrics, save_png

ATTRIBUTES = ("shape", "colour", "motion", "background")
SLOPE_PER = 250  # the slope's unit, in steps: the base's probe interval


def _pairs(specs: Sequence[str], what: str) -> dict[str, str]:
    """``NAME=VALUE`` arguments as an ordered dict; a malformed or repeated one is named."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{what} {spec!r}: expected NAME=PATH, e.g. control=runs/builtin-v3/joint/metrics.jsonl")
        if name in out:
            raise ValueError(f"{what} names {name!r} twice")
        out[name] = value
    return out


def probe_rows(rows: Sequence[Mapping], start: int, end: int, key: str = "probe") -> list[dict]:
    """The rows with a probe (``key``: ``probe``, the raw weights'; ``probe_ema``, the EMA's) in ``(start, end]``,
    in step order, each as ``{"step", "probe"}``; a step logged twice (a run resumed over steps it had already
    taken) keeps its last row."""
    by_step: dict[int, dict] = {}
    for r in rows:
        step = r.get("step")
        if isinstance(step, int) and start < step <= end and isinstance(r.get(key), Mapping):
            by_step[step] = {"step": step, "probe": r[key]}
    return [by_step[s] for s in sorted(by_step)]


def fit(points: Sequence[tuple[float, float]]) -> dict:
    """Mean, least-squares slope (per :data:`SLOPE_PER` steps) and the standard error of the mean from the
    residuals about the line (about the mean for fewer than 3 points)."""
    n = len(points)
    if n == 0:
        raise ValueError("no points to fit")
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if n > 1 and sxx > 0 else 0.0
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys, strict=True)]
    dof = n - 2 if n > 2 else n - 1
    sd = math.sqrt(sum(e * e for e in resid) / dof) if dof > 0 else float("nan")
    return {"n": n, "mean": my, "slope": slope * SLOPE_PER, "se": sd / math.sqrt(n), "last": ys[-1]}


def arm_summary(rows: Sequence[Mapping], sigma: str) -> dict:
    """One arm's window: per attribute the ratio at ``sigma`` fitted (:func:`fit`), and the probe's mean flow loss
    at each of its sigmas."""
    if not rows:
        raise ValueError("no probe rows in the window")
    ratios = {}
    for a in ATTRIBUTES:
        pts = [(r["step"], r["probe"]["ratio"][a][sigma]) for r in rows if sigma in r["probe"]["ratio"].get(a, {})]
        if pts:
            ratios[a] = fit(pts)
    if "shape" not in ratios:
        raise ValueError(f"the probe rows have no shape ratio at sigma {sigma}")
    sigmas = sorted({s for r in rows for s in r["probe"].get("loss", {})}, key=float)
    loss = {s: sum(r["probe"]["loss"][s] for r in rows) / len(rows) for s in sigmas}
    return {"steps": [r["step"] for r in rows], "ratio": ratios, "loss": loss}


def compare(arms: Mapping[str, dict], control: str) -> dict[str, dict]:
    """Each arm's shape ratio against the control's: the difference of the window means, its standard error, and
    the verdict (``higher``/``lower`` past two standard errors, else ``no change``)."""
    base = arms[control]["ratio"]["shape"]
    out = {}
    for name, arm in arms.items():
        if name == control:
            continue
        s = arm["ratio"]["shape"]
        diff, se = s["mean"] - base["mean"], math.hypot(s["se"], base["se"])
        verdict = "no change" if not se > 0 or abs(diff) <= 2 * se else ("higher" if diff > 0 else "lower")
        out[name] = {"shape_diff": diff, "se": se, "verdict": verdict}
    return out


def _unconditional_cell(record: Mapping | None) -> str:
    return (
        f"{record['shape_rate']:.2f} ({record.get('object_rate', float('nan')):.2f} hold an object)" if record else ""
    )


def _uncaptioned_cell(record: Mapping | None) -> str:
    rows = (record or {}).get("sigmas") or {}
    return "; ".join(f"{s}: {r['shape']}/{r['colour']}/{r['background']}" for s, r in rows.items())


def _swap_cell(record: Mapping | None) -> str:
    rows = (record or {}).get("sigmas") or {}
    return "; ".join(f"{s}: {r['kept']}/{r['follows']} of {r['clips']}" for s, r in rows.items())


def diagnosis_kind(record: Mapping) -> str | None:
    """Which ``factory.shape_probe`` record this is: ``unconditional`` (a shape rate), ``swap`` (per sigma: kept,
    follows) or ``uncaptioned`` (per sigma: shape, colour, background); None for anything else."""
    if "shape_rate" in record:
        return "unconditional"
    rows = record.get("sigmas")
    if not isinstance(rows, Mapping) or not rows or not all(isinstance(r, Mapping) for r in rows.values()):
        return None
    if all({"kept", "follows", "clips"} <= set(r) for r in rows.values()):
        return "swap"
    if all({"shape", "colour", "background"} <= set(r) for r in rows.values()):
        return "uncaptioned"
    return None


def table(res: Mapping) -> str:
    sigma, control = res["sigma"], res["control"]
    losses = sorted({s for a in res["arms"].values() for s in a["loss"]}, key=float)
    lines = [
        f"Arms from step {res['from']} to {res['to']} (`python -m factory.arms`): the probe's swap ratio at sigma "
        f"{sigma} (mean over the window ± standard error; slope per {SLOPE_PER} steps), the probe's flow loss per "
        f"sigma (mean), against the control `{control}`; the EMA's shape ratio at the window's end and its slope "
        "(no verdict: its rows are not independent). Diagnoses: unconditional shape rate; uncaptioned clips "
        "keeping shape/colour/background per sigma; swap: clips keeping their shape / following a swapped word.",
        "",
        "| arm | probes | shape ratio | slope | vs control | colour | motion | background | "
        + " | ".join(f"loss {s}" for s in losses)
        + " | EMA shape ratio (last) | EMA slope | unconditional | uncaptioned | swap |",
        "|---|---:|---:|---:|---|---:|---:|---:|" + "---:|" * len(losses) + "---:|---:|---|---|---|",
    ]
    for name, a in res["arms"].items():
        r = a["ratio"]
        shape = r["shape"]
        vs = (
            "control"
            if name == control
            else "{verdict} ({shape_diff:+.3f} ± {se:.3f})".format(**res["vs_control"][name])
        )
        other = [f"{r[k]['mean']:.2f}" if k in r else "" for k in ("colour", "motion", "background")]
        loss = [f"{a['loss'][s]:.4f}" if s in a["loss"] else "" for s in losses]
        diagnosis = res["diagnosis"].get(name, {})
        unc, uncap, swap = (
            _unconditional_cell(diagnosis.get("unconditional")),
            _uncaptioned_cell(diagnosis.get("uncaptioned")),
            _swap_cell(diagnosis.get("swap")),
        )
        lines.append(
            f"| {name} | {shape['n']} | {shape['mean']:.3f} ± {shape['se']:.3f} | {shape['slope']:+.3f} | {vs} | "
            + " | ".join(other + loss)
            + (
                f" | {a['ema']['ratio']['shape']['last']:.3f} | {a['ema']['ratio']['shape']['slope']:+.3f}"
                if "ema" in a
                else " | | "
            )
            + f" | {unc} | {uncap} | {swap} |"
        )
    return "\n".join(lines) + "\n"


def plot(series: Mapping[str, Sequence[tuple[int, float]]], sigma: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, pts) in enumerate(series.items()):
        ax.plot(*zip(*pts, strict=True), marker="o", color=f"C{i}", label=name)
    ax.set(title=f"probe shape swap ratio at sigma {sigma}", xlabel="step", ylabel="ratio (1 = word ignored)")
    ax.legend()
    return save_png(fig, out)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv, prog="factory.arms")


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.arms", description=__doc__.split("\n\n")[0])
    p.add_argument("arms", nargs="+", help="NAME=METRICS: an arm's metrics.jsonl (the control's among them)")
    p.add_argument("--from", dest="start", type=int, required=True, help="the checkpoint's step every arm resumed")
    p.add_argument("--to", dest="end", type=int, required=True, help="the window's last step")
    p.add_argument("--control", default=None, help="the control arm's name (default: the first)")
    p.add_argument("--sigma", default="0.9", help="the probe sigma judged (default: %(default)s)")
    p.add_argument("--diagnosis", action="append", default=[], help="NAME=JSON: a factory.shape_probe record")
    p.add_argument("--out", required=True, help="writes OUT.json, OUT.md and OUT.png")
    args = p.parse_args(argv)
    if args.end <= args.start:
        p.error(f"--to must be past --from, got --from {args.start} --to {args.end}")
    metrics = _pairs(args.arms, "arm")
    if len(metrics) < 2:
        p.error(f"expected a control and at least one arm, got {list(metrics)}")
    control = args.control or next(iter(metrics))
    if control not in metrics:
        p.error(f"--control {control!r} is not one of the arms {list(metrics)}")
    diagnosis: dict[str, dict] = {}
    for spec in args.diagnosis:
        arm, sep, path = spec.partition("=")
        if not sep or arm not in metrics:
            p.error(f"--diagnosis {spec!r}: expected NAME=JSON with NAME one of the arms {list(metrics)}")
        record = json.loads(Path(path).read_text())
        kind = diagnosis_kind(record)
        if kind is None:
            raise ValueError(f"--diagnosis {path!r} is not a factory.shape_probe unconditional/uncaptioned/swap record")
        diagnosis.setdefault(arm, {})[kind] = {
            k: record[k] for k in ("shape_rate", "object_rate", "sigmas") if k in record
        }
    outs = {suffix: check_output_path(args.out + suffix, (suffix,)) for suffix in (".json", ".md", ".png")}
    arms, series = {}, {}
    for name, path in metrics.items():
        logged = read_metrics(path)
        rows = probe_rows(logged, args.start, args.end)
        if not rows:
            raise ValueError(
                f"arm {name!r} ({path}) has no probe rows in steps ({args.start}, {args.end}]; expected "
                "validation.probe_every within the window"
            )
        arms[name] = arm_summary(rows, args.sigma)
        ema = probe_rows(logged, args.start, args.end, key="probe_ema")
        if ema:
            arms[name]["ema"] = arm_summary(ema, args.sigma)
        series[name] = [(r["step"], r["probe"]["ratio"]["shape"][args.sigma]) for r in rows]
    res = {
        "what": "short A/B arms of the base's recipe from one checkpoint: the probe's swap ratios and losses",
        "from": args.start,
        "to": args.end,
        "sigma": args.sigma,
        "control": control,
        "metrics": metrics,
        "arms": arms,
        "vs_control": compare(arms, control),
        "diagnosis": diagnosis,
    }
    text = table(res)
    write_json(outs[".json"], res)
    write_text_atomic(outs[".md"], text)
    plot(series, args.sigma, outs[".png"])
    print(text, end="")
    print(f"wrote {args.out}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The built-in model's progress across its stages, from the records committed beside its evaluations (issue 49).

    python -m factory.progress [--curves assets/builtin-next/v3/curves] [--out assets/builtin-next/v3/curves/progress]

Each re-ship and diagnosis leaves a record named by its stage label in the curves folder (``runs/`` is not
committed): ``v3-eval-LABEL.json`` (``factory.evaluate``), ``shape-unconditional-LABEL.json`` and
``shape-swap-LABEL.json`` (``factory.shape_probe``), and the probe rows of the base's runs (``base-metrics.jsonl``,
the latest ``joint-probe-stepN.json``). A label names the base's training step: ``stepN`` is step N of the first
stage (``factory/configs/v3/base.yaml``), ``joint-stepN`` step N of the joint image-video stage, which started from
the first stage's step 3,000 (``factory/configs/v3/joint.yaml``), so the base's step 3,000 + N; a suffix
(``-conv600``, ``-cpe``) names the conversions' recipe. This draws, against the base's step, the four curves the
issue's targets are judged by, each with its target:

1. the probe's shape swap ratio at sigma 0.9 (the loss with the shape word swapped over the loss with the true
   word, on held-out clips: 1 = the word is ignored), colour and motion beside it for scale;
2. the unconditional shape rate (target 0.80);
3. the noised-real-clip swap test at sigma 0.9: clips of 16 that follow a swapped shape word (target 12) and keep
   their own;
4. the 48x3 evaluation's overall per variant (flash target 0.80; MHLA and hybrid within 0.10 of flash).

``--out OUT`` writes ``OUT.png`` and ``OUT.md`` (a table per label with the targets' row).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import run_cli
from common.outputs import write_text_atomic
from common.video import check_output_path
from factory.curves import read_metrics, save_png

ROOT = Path(__file__).resolve().parents[1]
CURVES = ROOT / "assets" / "builtin-next" / "v3" / "curves"
JOINT_START = 3000  # the joint stage's step 0 is the first stage's step 3,000 (factory/configs/v3/joint.yaml)
SIGMA = "0.9"
VARIANTS = ("flash", "linear", "mhla", "mhla-hybrid")
TARGETS = {"unconditional": 0.80, "follows": 12, "flash": 0.80, "gap": 0.10}
_LABEL = re.compile(r"^(joint-)?step(\d+)((?:-[a-z0-9]+)*)$")


def _parse(label: str) -> re.Match:
    m = _LABEL.match(label)
    if m is None:
        raise ValueError(
            f"stage label {label!r} is not 'stepN' or 'joint-stepN' with an optional '-recipe' suffix "
            "(e.g. 'step3000', 'joint-step5400-cpe')"
        )
    return m


def stage_step(label: str) -> int:
    """The step of its own stage's run a label names: ``joint-step5400-cpe`` -> 5400."""
    return int(_parse(label).group(2))


def base_step(label: str) -> int:
    """The base's training step a stage label names: ``step3000`` -> 3000, ``joint-step5400-cpe`` -> 8400."""
    m = _parse(label)
    return int(m.group(2)) + (JOINT_START if m.group(1) else 0)


@dataclass
class Stage:
    """What the records say about one stage label."""

    label: str
    step: int
    unconditional: float | None = None
    swap: dict | None = None  # {"kept": int, "follows": int, "clips": int} at SIGMA
    overall: dict = field(default_factory=dict)  # variant -> overall


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno})") from None


def stages(curves: Path) -> list[Stage]:
    """Every stage label with an evaluation or a diagnosis record in ``curves``, ordered by base step."""
    found: dict[str, Stage] = {}

    def stage(label: str) -> Stage:
        if label not in found:
            found[label] = Stage(label, base_step(label))
        return found[label]

    for path in sorted(curves.glob("shape-unconditional-*.json")):
        stage(path.stem.removeprefix("shape-unconditional-")).unconditional = float(_read_json(path)["shape_rate"])
    for path in sorted(curves.glob("shape-swap-*.json")):
        at = _read_json(path)["sigmas"].get(SIGMA)
        if at is not None:
            stage(path.stem.removeprefix("shape-swap-")).swap = {k: int(at[k]) for k in ("kept", "follows", "clips")}
    for path in sorted(curves.glob("v3-eval-*.json")):
        variants = _read_json(path)["variants"]
        stage(path.stem.removeprefix("v3-eval-")).overall = {
            v: float(variants[v]["overall"]) for v in VARIANTS if v in variants
        }
    return sorted(found.values(), key=lambda s: (s.step, s.label))


def _probe_rows(rows: Sequence[dict], offset: int) -> list[tuple[int, dict]]:
    """(base step, {attribute: ratio at SIGMA}) from metrics rows or probe summaries that keep the ratios per
    sigma (``factory.curves --summary``'s ``ratio_by_sigma``; a metrics row's ``probe.ratio``); rows with only the
    mean over sigmas are skipped."""
    out = []
    for r in rows:
        if "probe" in r:
            by_sigma = r["probe"].get("ratio")
        else:
            by_sigma = r.get("ratio_by_sigma")
            if by_sigma is None and isinstance(next(iter(r.get("ratio", {}).values()), None), dict):
                by_sigma = r["ratio"]  # an early summary that kept the sigmas under "ratio"
        if not by_sigma or not all(isinstance(v, dict) and SIGMA in v for v in by_sigma.values()):
            continue
        out.append((offset + int(r["step"]), {a: float(v[SIGMA]) for a, v in by_sigma.items()}))
    return out


def probe_series(curves: Path) -> list[tuple[int, dict]]:
    """The probe's ratios at SIGMA against the base's step: the first stage's ``base-metrics.jsonl``, then the
    joint stage's latest ``joint-probe-stepN.json`` (by N); a step both cover keeps the later stage's row."""
    series: dict[int, dict] = {}
    base = curves / "base-metrics.jsonl"
    if base.is_file():
        series.update(_probe_rows(read_metrics(base), 0))
    joint = sorted(curves.glob("joint-probe-step*.json"), key=lambda p: int(p.stem.rsplit("step", 1)[1]))
    if joint:
        data = _read_json(joint[-1])
        rows = data["rows"] if isinstance(data, dict) else data
        series.update(_probe_rows(rows, JOINT_START))
    return sorted(series.items())


def table(found: Sequence[Stage]) -> str:
    def num(x, fmt="{:.2f}"):
        return "" if x is None else fmt.format(x)

    lines = [
        f"The built-in model's stages (`python -m factory.progress`): the base's step (the joint stage from step "
        f"{JOINT_START:,}), the unconditional shape rate, the noised-real-clip swap test at sigma {SIGMA} (of 16 "
        f"clips: kept with the true caption, follows a swapped shape word), and the 48x3 evaluation's overall.",
        "",
        "| stage | base step | unconditional shape | swap kept | swap follows | flash | linear | MHLA | hybrid |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in found:
        kept = follows = ""
        if s.swap:
            kept = f"{s.swap['kept']}/{s.swap['clips']}"
            follows = f"{s.swap['follows']}/{s.swap['clips']}"
        overall = [num(s.overall.get(v)) for v in VARIANTS]
        lines.append(
            f"| {s.label} | {s.step:,} | {num(s.unconditional)} | {kept} | {follows} | " + " | ".join(overall) + " |"
        )
    t = TARGETS
    lines.append(
        f"| *target* | | >= {t['unconditional']:.2f} | | >= {t['follows']}/16 | >= {t['flash']:.2f} | | "
        f"flash - {t['gap']:.2f} | flash - {t['gap']:.2f} |"
    )
    return "\n".join(lines) + "\n"


def plot(found: Sequence[Stage], probes: Sequence[tuple[int, dict]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    ax = axes[0]
    for i, a in enumerate(("shape", "colour", "motion")):
        pts = [(s, r[a]) for s, r in probes if a in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), color=f"C{i}", lw=2 if a == "shape" else 0.8, label=a)
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.axvline(JOINT_START, color="0.7", ls=":", lw=0.8)
    ax.set(title=f"probe swap ratio at sigma {SIGMA} (1 = word ignored)", xlabel="base step")
    ax.legend()

    def points(key):
        return [(s.step, key(s)) for s in found if key(s) is not None]

    ax = axes[1]
    pts = points(lambda s: s.unconditional)
    if pts:
        ax.plot(*zip(*pts, strict=True), marker="o", color="C0")
    ax.axhline(TARGETS["unconditional"], color="C3", ls="--", lw=1, label="target")
    ax.set(title="unconditional frames read as a shape", xlabel="base step", ylim=(0, 1.02))
    ax.legend()
    ax = axes[2]
    for key, colour in (("follows", "C0"), ("kept", "C2")):
        pts = points(lambda s, k=key: None if s.swap is None else s.swap[k])
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", color=colour, label=key)
    ax.axhline(TARGETS["follows"], color="C3", ls="--", lw=1, label="target (follows)")
    ax.set(title=f"noised real clips at sigma {SIGMA} (of 16)", xlabel="base step", ylim=(0, 16.5))
    ax.legend()
    ax = axes[3]
    for i, v in enumerate(VARIANTS):
        pts = points(lambda s, v=v: s.overall.get(v))
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ls="" if v != "flash" else "-", color=f"C{i}", label=v)
    ax.axhline(TARGETS["flash"], color="C3", ls="--", lw=1, label="target (flash)")
    ax.set(title="48x3 evaluation: overall", xlabel="base step", ylim=(0, 1.02))
    ax.legend(fontsize=8)
    return save_png(fig, out)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv, prog="factory.progress")


def _main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.progress", description=__doc__.split("\n\n")[0])
    p.add_argument("--curves", default=str(CURVES), help="the folder of committed records (default: %(default)s)")
    p.add_argument("--out", default=None, help="writes OUT.png and OUT.md (default: CURVES/progress)")
    args = p.parse_args(argv)
    curves = Path(args.curves)
    if not curves.is_dir():
        raise FileNotFoundError(f"--curves {str(curves)!r} is not a folder; expected the built-in model's curves")
    out = Path(args.out) if args.out else curves / "progress"
    png = check_output_path(str(out) + ".png", (".png",))
    md = check_output_path(str(out) + ".md", (".md",))
    found = stages(curves)
    if not found:
        raise ValueError(
            f"{str(curves)!r} has no v3-eval-*.json, shape-unconditional-*.json or shape-swap-*.json records"
        )
    text = table(found)
    plot(found, probe_series(curves), png)
    write_text_atomic(md, text)
    print(text, end="")
    print(f"wrote {png} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

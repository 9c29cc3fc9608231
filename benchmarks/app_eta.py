"""The page's time-left estimate against the time a run really took, through the page's own handler.

    python -m benchmarks.app_eta                        # the built-in model, its defaults, 4 variants, 2 requests
    python -m benchmarks.app_eta --model tiny-random --requests 1
    python -m benchmarks.app_eta --out benchmarks/results/app_eta_cpu      # also <out>.json and <out>.md

Loads the models and warms up as ``run_app.py`` does (the warm-up's decode is the first decode estimate), then
sends identical requests through the Compare handler of the page (``app.ui.build_demo``), reading every status
line's "about N s left" with the second it was shown. When the run is over, each estimate is set against the
time that was really left: printed at 10%, 25%, 50%, 75% and 90% of the run, with the largest relative error
while a tenth of the run or more was left and the largest in seconds. A benchmark prints; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import tempfile
import time
from types import SimpleNamespace

LEFT = re.compile(r"about (\d+) s left|(finishing)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.app_eta", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as run_app.py --model (default: the built-in model)")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--prompt", default="a small red triangle moves down on a black background")
    p.add_argument("--out", default=None, help="also write <out>.json and <out>.md (a path without extension)")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error(f"--requests {args.requests}: expected at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from app import compare
    from app.models import load_app_models
    from app.ui import build_demo

    models = load_app_models(args.model)
    warmup = compare.Warmup(models).start()
    warmup.wait()
    d = models.defaults
    preset = compare.preset_key((d["num_frames"], d["height"], d["width"]))
    demo = build_demo(models, out_root=tempfile.mkdtemp(prefix="app-eta-"), warmup=warmup)
    on_compare = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_compare")
    print(f"model: {models.source}; preset {preset}, {d['num_inference_steps']} steps, every variant")
    rows: list[dict] = []
    for i in range(args.requests):
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
        shown: list[tuple[float, float]] = []  # (second of the run, seconds said to be left)
        started = time.monotonic()
        for page in on_compare(
            args.prompt,
            "",
            i,
            d["num_inference_steps"],
            d["guidance_scale"],
            preset,
            list(models.variants),
            1,
            request=SimpleNamespace(session_hash=f"eta{i}", query_params={}),
        ):
            m = LEFT.search(page[0]) if isinstance(page[0], str) else None
            if m and page[0].startswith("**Running"):
                shown.append((time.monotonic() - started, 0.0 if m.group(2) else float(m.group(1))))
        total = time.monotonic() - started
        print(f"request {i + 1}: {total:.1f} s, load {load:.2f} per core at its start; {len(shown)} estimates")
        row = {"request": i + 1, "seconds": round(total, 1), "load_per_core": round(load, 2), "estimates": len(shown)}
        rows.append(row)
        if not shown:
            continue
        errors = [(t, left, total - t) for t, left in shown]
        row["at"] = []
        for share in (0.1, 0.25, 0.5, 0.75, 0.9):
            t, left, truth = min(errors, key=lambda e: abs(e[0] - share * total))
            print(
                f"  at {t:5.1f} s ({share:.0%}): said {left:4.0f} s left, {truth:5.1f} s were: {left / truth - 1:+.0%}"
            )
            row["at"].append({"share": share, "second": round(t, 1), "said": left, "left": round(truth, 1)})
        # the relative error while a tenth of the run or more was left (over the last seconds any relative error
        # is large: "finishing" with 2 s to go is -100%), and the largest error in seconds over all of it
        early = [e for e in errors if e[2] >= 0.1 * total] or errors
        t, left, truth = max(early, key=lambda e: abs(e[1] - e[2]) / max(e[2], 1.0))
        ta, lefta, trutha = max(errors, key=lambda e: abs(e[1] - e[2]))
        print(
            f"  first estimate at {shown[0][0]:.1f} s; largest error while >= 10% was left at {t:.1f} s: said "
            f"{left:.0f} s, {truth:.1f} s were ({(left - truth) / max(truth, 1.0):+.0%}); largest in seconds at "
            f"{ta:.1f} s: said {lefta:.0f} s, {trutha:.1f} s were"
        )
        row.update(
            first_estimate_s=round(shown[0][0], 1),
            largest_error={"second": round(t, 1), "said": left, "left": round(truth, 1)},
            largest_error_share=round((left - truth) / max(truth, 1.0), 3),
            largest_error_seconds={"second": round(ta, 1), "said": lefta, "left": round(trutha, 1)},
        )
    if args.out:
        write(args, models, preset, rows)
    return 0


def write(args, models, preset: str, rows: list[dict]) -> None:
    """``<out>.json`` (machine, request, rows) and ``<out>.md`` (one line per request)."""
    import torch

    from benchmarks.common import environment, write_results

    meta = {
        **environment(torch.device("cpu")),
        "model": str(models.source),
        "preset": preset,
        "steps": models.defaults["num_inference_steps"],
        "variants": list(models.variants),
        "prompt": args.prompt,
        "command": shlex.join(
            ["python", "-m", "benchmarks.app_eta"] + [f"--{k}={v}" for k, v in vars(args).items() if v is not None]
        ),
    }
    lines = [
        f"# The page's time-left estimate against the time left ({meta['device']}, {meta['date']})",
        "",
        f"Model {meta['model']}, preset {preset}, {meta['steps']} steps, variants {', '.join(meta['variants'])}.",
        "Each row: one request through the page's Compare handler; the estimate shown nearest 10/50/90% of the run,",
        "and the largest relative error while a tenth of the run or more was left (error = (said - left) / left),",
        "and the largest in seconds over the whole run.",
        "",
        "| request | seconds | load/core | first estimate at | at 10% | at 50% | at 90% | largest error | largest in s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        at = {a["share"]: a for a in r.get("at", [])}
        cells = [f"{at[s]['said']:.0f} s said, {at[s]['left']:.0f} s left" if s in at else "-" for s in (0.1, 0.5, 0.9)]
        worst = f"{r['largest_error_share']:+.0%} at {r['largest_error']['second']:.0f} s" if "at" in r else "-"
        if "at" in r:
            e = r["largest_error_seconds"]
            worst += f" | {e['said'] - e['left']:+.1f} s at {e['second']:.0f} s"
        else:
            worst += " | -"
        lines.append(
            f"| {r['request']} | {r['seconds']} | {r['load_per_core']} | {r.get('first_estimate_s', '-')} s | "
            f"{' | '.join(cells)} | {worst} |"
        )
    out = os.path.abspath(args.out)
    write_results(os.path.dirname(out), os.path.basename(out), meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())

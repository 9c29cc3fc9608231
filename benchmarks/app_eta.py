"""The page's time-left estimate against the time a run really took, through the page's own handler.

    python -m benchmarks.app_eta                        # the built-in model, its defaults, 4 variants, 2 requests
    python -m benchmarks.app_eta --model tiny-random --requests 1
    python -m benchmarks.app_eta --out benchmarks/results/app_eta_cpu      # also <out>.json and <out>.md
    python -m benchmarks.app_eta --preset 17x128x160 --record tests/data/app_eta_run.json   # the estimator's events

Loads the models and warms up as ``run_app.py`` does (the warm-up's decode is the first decode estimate), then
sends identical requests through the Compare handler of the page (``app.ui.build_demo``, live previews on as the
app has them), reading every status line's "about N s left" with the second it was shown. When the run is over,
each estimate is set against the time that was really left: printed at 10%, 25%, 50%, 75% and 90% of the run, with
the largest relative error while a tenth of the run or more was left (from the start, and from a quarter of the run
on: issue 52 (4) asks for +-25% there), the largest in seconds, and how long "finishing" was shown before the run
ended. Also the live previews' cost: seconds per preview and per denoising step against the median step (the
previews are made between two timed steps, in the variant's turn), the machine's load during each request (the
1-minute average, absolute: sampled at every status line) and the warm-up's seconds with the tails it measured
(the first request's priors). ``--record`` writes the estimator's inputs of the last request (each step counted and
each video done, with its second, and the priors) for a replay test; ``--label`` names the run set in the results.
Every invocation is a fresh start of the app: its first request is the first after the start. A benchmark prints;
it asserts nothing about time.
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
    p.add_argument("--preset", default=None, help="frames x height x width, e.g. 17x128x160 (default: the model's)")
    p.add_argument("--preview-every", type=int, default=None, help="as run_app.py --preview-every (default: the app's)")
    p.add_argument(
        "--record",
        default=None,
        help="write the last request's estimator inputs here (JSON); a path with {request} in it: every request's",
    )
    p.add_argument("--out", default=None, help="also write <out>.json and <out>.md (a path without extension)")
    p.add_argument("--label", default=None, help="what this run set is (e.g. the estimator's version), in the results")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error(f"--requests {args.requests}: expected at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from app import compare, compare_tab, ui
    from app.models import load_app_models
    from app.preview import PREVIEW_EVERY
    from common.threads import enable_auto

    enable_auto()  # as run_app.py starts: torch's threads from the cores other work leaves, again per request
    every = PREVIEW_EVERY if args.preview_every is None else args.preview_every
    models = load_app_models(args.model)
    if models.builtin:  # as run_app.py composes it: the analyser's verdict is part of each variant's tail
        from world.analyse import strict_verdicts
        from world.synthetic import sample_clips

        models.judge = strict_verdicts
        models.clip_source = sample_clips  # the previews' colour map, fitted on its world's clips
    warmup = compare.Warmup(models, previews=every > 0).start()
    warmup.wait()
    tails = ", ".join(f"{s:.2f} s at {p:,} pixels" for s, p in warmup.decodes)
    ends = "".join(f"; a run's end {s:.2f} s at {p:,} pixels" for s, p in warmup.ends)
    print(f"warm-up: {warmup.seconds or 0:.1f} s; its tails (the first request's priors): {tails or 'none'}{ends}")
    d = models.defaults
    preset = args.preset or compare.preset_key((d["num_frames"], d["height"], d["width"]))
    demo = ui.build_demo(models, out_root=tempfile.mkdtemp(prefix="app-eta-"), warmup=warmup, preview_every=every)
    on_compare = next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_compare")
    estimates = _recording(compare_tab)
    snapshots = _last_snapshot(compare)
    print(
        f"model: {models.source}; preset {preset}, {d['num_inference_steps']} steps, every variant; "
        f"previews every {every} steps"
    )
    rows: list[dict] = []
    for i in range(args.requests):
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
        shown: list[tuple[float, float]] = []  # (second of the run, seconds said to be left)
        loads = [os.getloadavg()[0]]  # the machine's 1-minute load during the request (absolute)
        finishing: float | None = None  # the second "finishing" was first shown
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
            loads.append(os.getloadavg()[0])
            if m and page[0].startswith("**Running"):
                shown.append((time.monotonic() - started, 0.0 if m.group(2) else float(m.group(1))))
                if m.group(2) and finishing is None:
                    finishing = shown[-1][0]
        total = time.monotonic() - started
        load_end = os.getloadavg()[0] / (os.cpu_count() or 1)
        print(
            f"request {i + 1}: {total:.1f} s, load {load:.2f} per core at its start, {load_end:.2f} at its end "
            f"({min(loads):.1f}-{max(loads):.1f} during it, absolute); {len(shown)} estimates"
        )
        row = {
            "request": i + 1,
            "seconds": round(total, 1),
            "load_per_core": round(load, 2),
            "load_per_core_end": round(load_end, 2),
            "load_during": [round(min(loads), 2), round(max(loads), 2)],
            "estimates": len(shown),
            "finishing_s": None if finishing is None else round(total - finishing, 1),
        }
        row.update(_preview_cost(snapshots[-1] if snapshots else None))
        if row.get("previews"):
            print(
                f"  previews: {row['previews']}, {row['preview_ms']:.1f} ms each, {row['preview_ms_per_step']:.2f} ms "
                f"per step against a median step of {row['step_ms']:.0f} ms ({row['preview_share']:.2%})"
            )
        rows.append(row)
        if args.record and estimates:
            path = args.record.replace("{request}", str(i + 1))
            _write_record(path, estimates[-1], started, total, preset, models)
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
        # issue 52 (4): from a quarter of the run on (while a tenth or more is left)
        late = [e for e in early if e[0] >= 0.25 * total] or early
        tq, leftq, truthq = max(late, key=lambda e: abs(e[1] - e[2]) / max(e[2], 1.0))
        print(
            f"  first estimate at {shown[0][0]:.1f} s; largest error while >= 10% was left at {t:.1f} s: said "
            f"{left:.0f} s, {truth:.1f} s were ({(left - truth) / max(truth, 1.0):+.0%}); from 25% of the run on at "
            f"{tq:.1f} s: said {leftq:.0f} s, {truthq:.1f} s were ({(leftq - truthq) / max(truthq, 1.0):+.0%}); "
            f'largest in seconds at {ta:.1f} s: said {lefta:.0f} s, {trutha:.1f} s were; "finishing" shown for '
            + ("never" if finishing is None else f"{total - finishing:.1f} s")
        )
        row.update(
            first_estimate_s=round(shown[0][0], 1),
            largest_error={"second": round(t, 1), "said": left, "left": round(truth, 1)},
            largest_error_share=round((left - truth) / max(truth, 1.0), 3),
            largest_error_from_quarter={"second": round(tq, 1), "said": leftq, "left": round(truthq, 1)},
            largest_error_from_quarter_share=round((leftq - truthq) / max(truthq, 1.0), 3),
            largest_error_seconds={"second": round(ta, 1), "said": lefta, "left": round(trutha, 1)},
        )
    if args.out:
        write(args, models, preset, rows, every, warmup)
    return 0


def _recording(compare_tab) -> list:
    """Every :class:`app.interleave.RunEstimate` the page makes from now on, each keeping its inputs (``calls``)."""
    made: list = []

    class Recording(compare_tab.RunEstimate):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.calls: list[tuple] = []
            # the priors as this run has them (the page updates them once the run is over)
            self.priors = {"tail_prior": _prior(self._tail_prior), "finish_prior": _prior(self._finish_prior)}
            made.append(self)

        def steps(self, now, counts):
            self.calls.append(("steps", now, {n: list(c) for n, c in counts.items()}))
            super().steps(now, counts)

        def finished(self, now, name):
            self.calls.append(("finished", now, name))
            super().finished(now, name)

    compare_tab.RunEstimate = Recording
    return made


PRIOR_STEPS = [round(0.01 * 1.2**i, 5) for i in range(33)]  # 0.01 s to 3.4 s a step


def _prior(f) -> dict | None:
    """A prior as a table: its seconds at no step measured and at each of :data:`PRIOR_STEPS` (a step's seconds; a
    list per step where the prior gives each variant's tail)."""
    return None if f is None else {"none": f(None), "steps": PRIOR_STEPS, "seconds": [f(s) for s in PRIOR_STEPS]}


def _last_snapshot(compare) -> list:
    """Each compare run's snapshots as the page gets them (the last: the whole result, with its preview seconds)."""
    seen: list = []
    inner = compare.iter_compare

    def iter_compare(*a, **k):
        for snapshot in inner(*a, **k):
            seen.append(snapshot)
            yield snapshot

    compare.iter_compare = iter_compare
    return seen


def _preview_cost(result) -> dict:
    """The live previews' seconds against the denoising steps of ``result`` (a whole run's last snapshot)."""
    import statistics

    if result is None or not result.preview_seconds:
        return {}
    spent = [s for v in result.preview_seconds.values() for s in v]
    steps = [s for r in result.runs for t in r.timings for s in t.steps]
    if not spent or not steps:
        return {"previews": len(spent)}
    return {
        "previews": len(spent),
        "preview_ms": round(1000 * statistics.fmean(spent), 2),
        "preview_ms_per_step": round(1000 * sum(spent) / len(steps), 3),
        "step_ms": round(1000 * statistics.median(steps), 1),
        "preview_share": round(sum(spent) / len(steps) / statistics.median(steps), 4),
    }


def _write_record(path: str, estimate, started: float, total: float, preset: str, models) -> None:
    """The estimator's inputs of one request: its settings, its priors (as tables over a step's seconds), every call
    with its second since the run started, and the run's length."""
    import json

    from common.outputs import write_text_atomic

    record = {
        "what": "app.interleave.RunEstimate's inputs during one compare run (benchmarks/app_eta.py --record)",
        "model": str(models.source),
        "preset": preset,
        "variants": estimate.variants,
        "steps_each": estimate.steps_each,
        "repeats": estimate.repeats,
        "interleaved": estimate.interleaved,
        "finish_like_tails": estimate._finish_like_tails,
        **estimate.priors,
        "seconds": round(total, 4),
        "calls": [(kind, round(now - started, 4), arg) for kind, now, arg in estimate.calls],
    }
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")


def write(args, models, preset: str, rows: list[dict], every: int, warmup) -> None:
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
        "preview_every": every,
        "label": args.label,
        "warm_up_s": None if warmup.seconds is None else round(warmup.seconds, 2),
        "warm_up_tails": [[round(s, 3), p] for s, p in warmup.decodes],
        "warm_up_ends": [[round(s, 3), p] for s, p in warmup.ends],
        "command": shlex.join(
            ["python", "-m", "benchmarks.app_eta"] + [f"--{k}={v}" for k, v in vars(args).items() if v is not None]
        ),
    }
    tails = ", ".join(f"{s:.2f} s at {p:,} pixels" for s, p in warmup.decodes) or "none"
    tails += "".join(f"; a run's end {s:.2f} s at {p:,} pixels" for s, p in warmup.ends)
    lines = [
        f"# The page's time-left estimate against the time left ({meta['device']}, {meta['date']})",
        "",
        *([f"Run set: {args.label}.", ""] if args.label else []),
        f"Model {meta['model']}, preset {preset}, {meta['steps']} steps, variants {', '.join(meta['variants'])}, "
        f"live previews every {every} steps. A fresh start: warm-up {meta['warm_up_s']} s, its tails {tails}.",
        "Each row: one request through the page's Compare handler; the estimate shown nearest 10/50/90% of the run,",
        "the largest relative error while a tenth of the run or more was left (error = (said - left) / left), from",
        "the start and from a quarter of the run on, the largest in seconds over the whole run, how long",
        "\"finishing\" was shown before the run ended, and the live previews' cost per denoising step (the machine's",
        "load per core at the request's start and end, and the load's range during it, absolute: 1-minute averages).",
        "",
        "| request | seconds | load/core | load during | first estimate at | at 10% | at 50% | at 90% | largest error | "
        "from 25% on | largest in s | finishing | previews |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        at = {a["share"]: a for a in r.get("at", [])}
        cells = [f"{at[s]['said']:.0f} s said, {at[s]['left']:.0f} s left" if s in at else "-" for s in (0.1, 0.5, 0.9)]
        if "at" in r:
            e = r["largest_error_seconds"]
            worst = (
                f"{r['largest_error_share']:+.0%} at {r['largest_error']['second']:.0f} s | "
                f"{r['largest_error_from_quarter_share']:+.0%} at {r['largest_error_from_quarter']['second']:.0f} s | "
                f"{e['said'] - e['left']:+.1f} s at {e['second']:.0f} s"
            )
        else:
            worst = "- | - | -"
        finishing = "never" if r.get("finishing_s") is None else f"{r['finishing_s']} s"
        previews = (
            f"{r['previews']}: {r['preview_ms']:.1f} ms each, {r['preview_ms_per_step']:.2f} ms/step of a "
            f"{r['step_ms']:.0f} ms step ({r['preview_share']:.2%})"
            if r.get("preview_ms") is not None
            else "-"
        )
        lines.append(
            f"| {r['request']} | {r['seconds']} | {r['load_per_core']}-{r['load_per_core_end']} | "
            f"{r['load_during'][0]:.1f}-{r['load_during'][1]:.1f} | "
            f"{r.get('first_estimate_s', '-')} s | {' | '.join(cells)} | {worst} | {finishing} | {previews} |"
        )
    out = os.path.abspath(args.out)
    write_results(os.path.dirname(out), os.path.basename(out), meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())

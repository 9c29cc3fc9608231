"""The app's Compare, timed end to end through the same code path as the page (``app.compare.iter_compare``).

    python -m benchmarks.app_compare                              # 3 identical 4-variant requests, defaults
    python -m benchmarks.app_compare --decode-dtype float32       # a lever: the VAE in float32
    python -m benchmarks.app_compare --requests 5 --out benchmarks/results/app_compare_cpu

Loads the model as ``run_app.py`` does (the built-in model by default, with its analyser), warms up once
(as the app does at start, timed apart), then sends identical requests one after another and prints, per
request: the wall time to the first and to the last video, the machine load (1-minute average over the
cores) before it, each variant's speedup per denoising step over flash with its 95% interval, its end-to-end
speedup and the share of the denoising speedup that end to end keeps. Writes ``<out>.json`` and ``<out>.md``.
A benchmark prints; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS

VARIANTS = ("flash", "linear", "mhla", "mhla-hybrid")
PROMPT = "a small red triangle moves down on a black background"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.app_compare", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as run_app.py --model (default: the built-in model)")
    p.add_argument("--requests", type=int, default=3, help="identical requests in a row")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--steps", type=int, default=None, help="default: the model's")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--decode-dtype", default="auto", help="the VAE's dtype: auto, float32, bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=str(RESULTS / "app_compare_cpu"), help="output path without extension")
    return p.parse_args(argv)


def load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import run_app
    from app import compare

    t0 = time.perf_counter()
    models = run_app.compose(args.model, {}, None, "auto", "auto", args.decode_dtype)
    loaded = time.perf_counter() - t0
    warm = compare.warm_up(models)
    d = models.components.defaults
    preset = compare.preset_key((d["num_frames"], d["height"], d["width"]))
    steps = args.steps or d["num_inference_steps"]
    req = compare.check_request(
        models, args.prompt, "", 0, steps, d["guidance_scale"], preset, list(VARIANTS), repeats=args.repeats
    )
    rows = []
    out_root = Path(tempfile.mkdtemp(prefix="app-compare-"))
    for i in range(args.requests):
        before = load()
        start = time.perf_counter()
        first, snap = None, None
        for snap in compare.iter_compare(models, req, out_root):  # noqa: B007 - the last snapshot is the result
            first = first if first is not None else time.perf_counter() - start
        assert snap is not None
        wall = time.perf_counter() - start
        row = {
            "request": i + 1,
            "load_before": round(before, 2),
            "first_video_s": round(first or wall, 2),
            "wall_s": round(wall, 2),
            "interleaved": snap.interleaved,
            "variants": {},
        }
        for r in snap.runs:
            den, e2e = snap.speedups(r)
            row["variants"][r.variant] = {
                "step_ms": round(r.steps.median * 1e3, 1),
                "text_s": round(r.stage("text_encoding").median, 3),
                "denoising_s": round(r.stage("denoising").median, 2),
                "decode_s": round(r.stage("vae_decode").median, 2),
                "own_total_s": round(r.stage("total").median, 2),
                "speedup": None if den is None else round(den.estimate, 3),
                "ci": None if den is None else [round(den.low, 3), round(den.high, 3)],
                "noisy": None if den is None else den.noisy,
                "e2e_speedup": None if e2e is None else round(e2e, 3),
                "e2e_share": None if den is None or e2e is None else round(e2e / den.estimate, 3),
                "verdict": r.verdict,
                "degenerate": r.degenerate,
            }
        rows.append(row)
        print(f"request {i + 1}: {wall:.1f} s (first video {row['first_video_s']:.1f} s), load before {before:.1f}")
    record = {
        "what": "app Compare end to end (app.compare.iter_compare), identical requests in a row",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{compare.device_name(models.device)}, {os.cpu_count()} cores, {platform.machine()}",
        "torch": torch.__version__,
        "model": models.components.source,
        "decode_dtype": str(models.components.vae.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "prompt": args.prompt,
        "preset": preset,
        "steps": steps,
        "repeats": args.repeats,
        "load_s": round(loaded, 2),
        "warm_up_s": round(warm, 2),
        "requests": rows,
    }
    md = markdown(record)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(md + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md")
    return 0


def markdown(record: dict) -> str:
    lines = [
        f"# App Compare end to end: {record['machine']}, {record['date']}",
        "",
        f"{record['model']}; {record['preset']}, {record['steps']} steps, {record['repeats']} timed run(s) per "
        f"variant; VAE in {record['decode_dtype']}; {record['threads']} torch threads. Loading {record['load_s']} s "
        f"and one warm-up {record['warm_up_s']} s at start (the app does both before serving).",
        "",
        "| request | load before | first video s | whole s | variant | step ms | denoise s | decode s | own s | "
        "speedup/step (95%) | end-to-end | e2e/den share | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["requests"]:
        for name, v in row["variants"].items():
            e2e = "-" if v["e2e_speedup"] is None else f"{v['e2e_speedup']:.2f}x"
            share = "-" if v["e2e_share"] is None else f"{v['e2e_share']:.0%}"
            sp = "-" if v["speedup"] is None else f"{v['speedup']:.2f}x ({v['ci'][0]:.2f}-{v['ci'][1]:.2f})"
            if v["noisy"]:
                sp += " noisy"
            lines.append(
                f"| {row['request']} | {row['load_before']} | {row['first_video_s']} | {row['wall_s']} | {name} | "
                f"{v['step_ms']} | {v['denoising_s']} | {v['decode_s']} | {v['own_total_s']} | {sp} | "
                f"{e2e} | {share} | {v['verdict']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

"""The app's Compare, timed end to end through the same code path as the page (``app.compare.iter_compare``).

    python -m benchmarks.app_compare                              # 3 identical 4-variant requests, defaults
    python -m benchmarks.app_compare --decode-dtype float32       # a lever: the VAE in float32
    python -m benchmarks.app_compare --requests 5 --out benchmarks/results/app_compare_cpu

Loads the model as the launcher does (``app.models.load_app_models``; the built-in model by default, with its analyser), warms up once
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
from pipelines.attention import VARIANTS

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
    p.add_argument("--levers", action="store_true", help="also time the VAE decode settings against each other")
    p.add_argument("--out", default=str(RESULTS / "app_compare_cpu"), help="output path without extension")
    return p.parse_args(argv)


def decode_levers(models, rounds: int = 3) -> dict:
    """The VAE decode of one video at the model's default size, its settings timed in turn (round-robin, so
    load drift hits all alike): float32, float32 channels-last, bfloat16; and bfloat16's PSNR against float32."""
    import copy
    import math

    d = models.components.defaults
    vae32 = copy.deepcopy(models.components.vae).float()
    cl = copy.deepcopy(vae32)
    for m in cl.modules():  # channels-last for the 3D convolutions' weights (the only rank-5 parameters)
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
    bf = torch.nn.Module.to(copy.deepcopy(vae32), torch.bfloat16)
    stride = models.components.vae_stride
    f = (d["num_frames"] - 1) // stride[0] + 1
    z = torch.randn(1, vae32.config.z_dim, f, d["height"] // stride[1], d["width"] // stride[1])
    z_cl = z.contiguous(memory_format=torch.channels_last_3d)
    settings = {"float32": (vae32, z), "float32 channels-last": (cl, z_cl), "bfloat16": (bf, z.bfloat16())}
    times: dict[str, list[float]] = {k: [] for k in settings}
    outs = {}
    with torch.no_grad():
        for name, (vae, x) in settings.items():  # one untimed call each
            outs[name] = vae.decode(x, return_dict=False)[0].float().clamp(-1, 1)
        for _ in range(rounds):
            for name, (vae, x) in settings.items():
                t0 = time.perf_counter()
                vae.decode(x, return_dict=False)
                times[name].append(time.perf_counter() - t0)
    mse = float(((outs["bfloat16"] - outs["float32"]) / 2).pow(2).mean())
    return {
        "rounds": rounds,
        "seconds_median": {k: round(sorted(v)[len(v) // 2], 3) for k, v in times.items()},
        "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "bf16_psnr_vs_fp32_db": round(10 * math.log10(1 / mse), 1) if mse > 0 else None,
        "load_after": round(load(), 2),
    }


def load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.device_shims import install

    print(install(), flush=True)  # before app.compare imports the mp4 writer
    from app import compare
    from app.models import load_app_models
    from common.timing import device_name
    from world.analyse import strict_verdicts
    from world.synthetic import sample_clips

    t0 = time.perf_counter()
    models = load_app_models(args.model, {}, None, "auto", "auto", args.decode_dtype)
    if models.builtin:  # as the launcher composes the app: the built-in model's world judges its videos
        models.judge = strict_verdicts
        models.clip_source = sample_clips  # the previews' colour map, fitted on its world's clips
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
        cpu = time.process_time()
        start = time.perf_counter()
        first, snap = None, None
        for snap in compare.iter_compare(models, req, out_root):  # noqa: B007 - the last snapshot is the result
            first = first if first is not None else time.perf_counter() - start
        assert snap is not None
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu  # this process's CPU seconds, all threads: about what it needs alone
        row = {
            "request": i + 1,
            "load_before": round(before, 2),
            "first_video_s": round(first or wall, 2),
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            # an idle machine would run about these CPU seconds on all its threads at once
            "idle_estimate_s": round(cpu / torch.get_num_threads(), 1),
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
                "paired_steps_ms": [round(x * 1e3, 1) for x in r.paired_steps],
                "verdict": r.verdict,
                "degenerate": r.degenerate,
            }
        rows.append(row)
        print(
            f"request {i + 1}: {wall:.1f} s (first video {row['first_video_s']:.1f} s), load before {before:.1f}, "
            f"{cpu:.1f} CPU s (idle estimate {row['idle_estimate_s']} s)"
        )
    levers = None
    if args.levers:
        try:
            levers = decode_levers(models)
        except RuntimeError as e:  # a lever that cannot run here is reported, the requests are kept
            levers = {"error": str(e).splitlines()[0]}
    record = {
        "what": "app Compare end to end (app.compare.iter_compare), identical requests in a row",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{device_name(models.device)}, {os.cpu_count()} cores, {platform.machine()}",
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
        "decode_levers": levers,
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
        "Per request: the 1-minute load average before it, the wall time to the first video and to the end, and "
        "this process's CPU seconds over its torch threads: roughly what the request would take alone on an idle "
        "machine (perfect parallelism would make it less; contention, which inflates CPU time, more).",
        "",
        "| request | load before | first video s | whole s | CPU s / threads |",
        "|---|---|---|---|---|",
    ]
    for row in record["requests"]:
        lines.append(
            f"| {row['request']} | {row['load_before']} | {row['first_video_s']} | {row['wall_s']} | "
            f"{row.get('idle_estimate_s', '-')} |"
        )
    lines += [
        "",
        "| request | variant | step ms | denoise s | decode s | own s | speedup/step (95%) | end-to-end | "
        "e2e/den | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["requests"]:
        for name, v in row["variants"].items():
            e2e = "-" if v["e2e_speedup"] is None else f"{v['e2e_speedup']:.2f}x"
            share = "-" if v["e2e_share"] is None else f"{v['e2e_share']:.0%}"
            sp = "-" if v["speedup"] is None else f"{v['speedup']:.2f}x ({v['ci'][0]:.2f}-{v['ci'][1]:.2f})"
            if v["noisy"]:
                sp += " noisy"
            lines.append(
                f"| {row['request']} | {name} | {v['step_ms']} | {v['denoising_s']} | {v['decode_s']} | "
                f"{v['own_total_s']} | {sp} | {e2e} | {share} | {v['verdict']} |"
            )
    levers = record.get("decode_levers")
    if levers and "error" in levers:
        lines += ["", f"VAE decode levers: not measured ({levers['error']})."]
    elif levers:
        lines += [
            "",
            f"VAE decode of one video, settings in turn over {levers['rounds']} rounds (median s): "
            + ", ".join(f"{k} {v}" for k, v in levers["seconds_median"].items())
            + f"; bfloat16 against float32: {levers['bf16_psnr_vs_fp32_db']} dB PSNR"
            + (f" ({record['decode_levers_note']})." if record.get("decode_levers_note") else "."),
        ]
    for earlier in record.get("earlier_runs", []):
        lines += ["", f"Earlier run, {earlier['date']} ({earlier['note']}):", ""]
        for r in earlier["requests"]:
            sp = ", ".join(f"{k} {v}x" for k, v in r["speedup"].items() if v is not None)
            dec = ", ".join(f"{k} {v} s" for k, v in r["decode_s"].items())
            lines.append(f"- request {r['request']} (load {r['load_before']}): {r['wall_s']} s; {sp}; decode {dec}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

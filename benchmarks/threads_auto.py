"""The CLI's time on a CPU that other work shares: torch's threads fixed at every core against chosen by
``common.threads`` (the default when OMP_NUM_THREADS is not set).

Starts ``--busy`` processes that each keep a core busy (a plain Python loop; 0 = the machine as it is), then runs
``python -m pipelines.cli`` on the built-in model ``--runs`` times each way, alternating, and writes the
denoising and VAE times to ``<out>.json`` and ``.md``. Reported, never asserted.

    python -m benchmarks.threads_auto --busy 1 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common.outputs import write_text_atomic
from common.threads import usable_cores

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"
DENOISE = re.compile(r"^denoising\s+([\d.]+) s", re.M)
DECODE = re.compile(r"^VAE decode\s+([\d.]+) s", re.M)


def _cli(prompt: str, out: Path, threads: int | None) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    argv = [sys.executable, "-m", "pipelines.cli", "--prompt", prompt, "--variant", "flash", "--out", str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    found = DENOISE.search(done.stdout), DECODE.search(done.stdout)
    if not all(found):
        raise RuntimeError(f"no timing lines in the CLI's output:\n{done.stdout[-2000:]}")
    return {"denoise_s": float(found[0].group(1)), "decode_s": float(found[1].group(1)), "load": os.getloadavg()[0]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.threads_auto", description=__doc__.splitlines()[0])
    p.add_argument("--busy", type=int, default=1, help="processes that each keep a core busy beside the CLI")
    p.add_argument("--runs", type=int, default=3, help="CLI runs each way")
    p.add_argument("--prompt", default="a red square moves to the right")
    p.add_argument("--out", default="benchmarks/results/cpu_threads_auto", help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    if args.busy < 0 or args.runs < 1:
        p.error(f"--busy must be >= 0 and --runs >= 1, got {args.busy} and {args.runs}")
    cores = usable_cores()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=3600)]) for _ in range(args.busy)]
    rows: dict[str, list[dict]] = {f"fixed {cores}": [], "auto": []}
    try:
        time.sleep(2 if spinners else 0)
        for i in range(args.runs):
            for name, threads in ((f"fixed {cores}", cores), ("auto", None)):
                rows[name].append(_cli(args.prompt, Path(f"/tmp/threads_auto_{i}.mp4"), threads))
                print(name, rows[name][-1], flush=True)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    res = {
        "what": "python -m pipelines.cli on the built-in model (flash, its defaults) beside --busy busy processes",
        "cores": cores,
        "busy": args.busy,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    out = Path(args.out)
    write_text_atomic(out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    lines = [
        f"CLI on the built-in model beside {args.busy} busy process(es), {cores} cores, {res['date']} "
        f"(`python -m benchmarks.threads_auto --busy {args.busy} --runs {args.runs}`); median (min-max) of "
        f"{args.runs} runs each, alternating.",
        "",
        "| threads | denoising s (20 steps) | VAE decode s | load (1 min) |",
        "|---|---:|---:|---:|",
    ]
    for name, rs in rows.items():
        d, v = [r["denoise_s"] for r in rs], [r["decode_s"] for r in rs]
        lines.append(
            f"| {name} | {statistics.median(d):.2f} ({min(d):.2f}-{max(d):.2f}) | {statistics.median(v):.2f} "
            f"({min(v):.2f}-{max(v):.2f}) | {statistics.median(r['load'] for r in rs):.1f} |"
        )
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()

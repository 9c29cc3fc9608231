"""How long ``python run_app.py`` takes until its page answers, launched as a person launches it.

    python -m benchmarks.app_start                         # 5 starts of this checkout's app (the built-in model)
    python -m benchmarks.app_start --vs /path/to/other     # alternated with another checkout's (A B A B ...)
    python -m benchmarks.app_start --runs 3 -- --model tiny-random   # arguments after -- go to run_app.py
    python -m benchmarks.app_start --out benchmarks/results/app_start_cpu   # also <out>.json and <out>.md

Each start: a free 127.0.0.1 port, ``run_app.py`` in a fresh process, ``GET /`` every 0.1 s until it answers
200 (the seconds to that are the figure), then, where the app prints it, the second at which the model is
loaded; then SIGTERM. Prints every start with the 1-minute load average over the cores at its end, and the
median per checkout. A benchmark prints; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADED = "model loaded in"  # run_app.py's line once the background load is done


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.app_start", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="starts per checkout")
    p.add_argument("--vs", type=Path, default=None, help="a second checkout, started in turn with this one")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds a start may take before it counts failed")
    p.add_argument("--out", default=None, help="also write <out>.json and <out>.md (a path without extension)")
    p.add_argument("app_args", nargs="*", help="after --: arguments for run_app.py")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs {args.runs}: expected at least 1")
    if args.vs is not None and not (args.vs / "run_app.py").is_file():
        p.error(f"--vs {str(args.vs)!r} has no run_app.py")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_once(root: Path, app_args: list[str], timeout: float) -> tuple[float, float | None]:
    """``(seconds until GET / answered, seconds until the model was loaded or None)`` of one start."""
    port = _free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    with tempfile.TemporaryDirectory(prefix="app-start-") as tmp:
        log = Path(tmp) / "server.log"
        env["GRADIO_TEMP_DIR"] = str(Path(tmp) / "gradio")
        with open(log, "w") as out:
            started = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "run_app.py", "--port", str(port), *app_args],
                cwd=root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            page = loaded = None
            while time.monotonic() - started < timeout and proc.poll() is None:
                if page is None:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                            if r.status == 200:
                                page = time.monotonic() - started
                    except OSError:
                        pass
                if loaded is None and LOADED in log.read_text(errors="replace"):
                    loaded = time.monotonic() - started
                if page is not None and (loaded is not None or LOADED not in _source(root)):
                    break
                time.sleep(0.1)
            if page is None:
                raise RuntimeError(
                    f"{root}/run_app.py did not serve within {timeout:.0f} s:\n{log.read_text()[-2000:]}"
                )
            return page, loaded
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _source(root: Path) -> str:
    return (root / "run_app.py").read_text()


def main(argv=None) -> int:
    args = parse_args(argv)
    roots = [ROOT] + ([args.vs.resolve()] if args.vs is not None else [])
    times: dict[Path, list[float]] = {r: [] for r in roots}
    rows: list[dict] = []
    print(f"{'run':>3}  {'checkout':<40} {'page s':>7} {'loaded s':>9} {'load/core':>9}")
    for i in range(args.runs):
        for root in roots:
            page, loaded = start_once(root, args.app_args, args.timeout)
            times[root].append(page)
            load = os.getloadavg()[0] / (os.cpu_count() or 1)
            shown = f"{loaded:9.1f}" if loaded is not None else f"{'-':>9}"
            print(f"{i + 1:>3}  {str(root)[-40:]:<40} {page:7.1f} {shown} {load:9.2f}", flush=True)
            rows.append(
                {
                    "start": i + 1,
                    "checkout": "this checkout" if root == ROOT else str(root),
                    "page_s": round(page, 2),
                    "loaded_s": None if loaded is None else round(loaded, 2),
                    "load_per_core": round(load, 2),
                }
            )
    for root in roots:
        t = times[root]
        print(f"median {statistics.median(t):.1f} s (min {min(t):.1f}, max {max(t):.1f}) over {len(t)}: {root}")
    print(f"machine: {os.cpu_count()} cores; load average now {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.out:
        write(args, roots, times, rows)
    return 0


def write(args, roots: list[Path], times: dict[Path, list[float]], rows: list[dict]) -> None:
    """``<out>.json`` (machine, every start) and ``<out>.md`` (every start, the median per checkout)."""
    import torch

    from benchmarks.common import environment, write_results

    meta = {
        **environment(torch.device("cpu")),
        "cores": os.cpu_count(),
        "app_args": args.app_args,
        "command": shlex.join(
            ["python", "-m", "benchmarks.app_start", f"--runs={args.runs}"]
            + ([f"--vs={args.vs}"] if args.vs else [])
            + (["--", *args.app_args] if args.app_args else [])
        ),
        "median_page_s": {
            ("this checkout" if r == ROOT else str(r)): round(statistics.median(times[r]), 2) for r in roots
        },
    }
    lines = [
        f"# Seconds until run_app.py's page answers ({os.cpu_count()}-core {meta['device']}, {meta['date']})",
        "",
        f"`{meta['command']}`: a fresh process per start, GET / every 0.1 s until 200.",
        "",
        "| start | checkout | page answers (s) | model loaded (s) | load per core |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        loaded = "-" if r["loaded_s"] is None else f"{r['loaded_s']:.1f}"
        lines.append(f"| {r['start']} | {r['checkout']} | {r['page_s']:.1f} | {loaded} | {r['load_per_core']} |")
    lines.append("")
    for root in roots:
        t = times[root]
        name = "this checkout" if root == ROOT else root
        lines.append(f"Median {statistics.median(t):.1f} s (min {min(t):.1f}, max {max(t):.1f}) over {len(t)}: {name}")
    out = os.path.abspath(args.out)
    write_results(Path(out).parent, Path(out).name, meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""What the app's per-video checks cost on this machine: PSNR, SSIM and the degenerate checks
(``app.quality``) of one generated video against another, at the sizes people generate.

    python -m benchmarks.video_checks                             # 81x480x832 (Wan2.1's default), 1 thread
    python -m benchmarks.video_checks --sizes 9x64x80,33x128x160 --threads 2

The frames are random uint8 noise, the worst case for nothing here (the measures cost the same for any
content). Each check runs ``--repeats`` times; the median is reported with the peak resident memory of the
process (``ru_maxrss``), so a check that copies whole videos shows up. Writes ``video_checks_<device>.json``
and ``.md`` to ``benchmarks/results/`` (``--out`` to change). A benchmark prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from app import quality

from .common import RESULTS, environment, write_results

CHECKS = {
    "degenerate": lambda a, b: quality.degenerate(a),
    "psnr": lambda a, b: quality.psnr(a, b),
    "ssim": lambda a, b: quality.ssim(a, b),
}


def parse_size(text: str) -> tuple[int, int, int]:
    try:
        f, h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"a size is FRAMESxHEIGHTxWIDTH, e.g. 81x480x832; got {text!r}") from None
    if min(f, h, w) < 1:
        raise SystemExit(f"a size's frames, height and width must be >= 1, got {text!r}")
    return f, h, w


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.video_checks", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="81x480x832", help="comma list of FRAMESxHEIGHTxWIDTH")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the app's checks share a core)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "video_checks_cpu"), help="output path without extension")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        raise SystemExit(f"--threads and --repeats must be >= 1, got {args.threads} and {args.repeats}")
    sizes = [parse_size(s.strip()) for s in args.sizes.split(",") if s.strip()]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, sizes)
    finally:
        torch.set_num_threads(threads)  # a caller's process keeps its own setting


def _run(args: argparse.Namespace, sizes: list[tuple[int, int, int]]) -> dict:
    rng = np.random.default_rng(0)
    rows = []
    for f, h, w in sizes:
        a = rng.integers(0, 256, (f, h, w, 3), dtype=np.uint8)
        b = rng.integers(0, 256, (f, h, w, 3), dtype=np.uint8)
        for name, check in CHECKS.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                check(a, b)
                times.append(time.perf_counter() - start)
            row = {
                "size": f"{f}x{h}x{w}",
                "check": name,
                "s": round(statistics.median(times), 3),
                "s_min": round(min(times), 3),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
            rows.append(row)
            print(
                f"{row['size']:>12} {name:>10} {row['s']:8.3f} s (min {row['s_min']:.3f})  peak RSS {row['peak_rss_mib']} MiB"
            )
    meta = {
        "benchmark": "video_checks",
        **environment(torch.device("cpu")),
        "threads": args.threads,
        "repeats": args.repeats,
        "frames": "random uint8",
    }
    lines = [
        f"App per-video checks (app.quality), {meta['device']}, {args.threads} thread(s), median of {args.repeats}, "
        f"{meta['date']}; random uint8 frames. Peak RSS is the process's high-water mark so far (it only grows).",
        "",
        "| size | check | s | min s | peak RSS MiB |",
        "|---|---|---:|---:|---:|",
        *(f"| {r['size']} | {r['check']} | {r['s']:.3f} | {r['s_min']:.3f} | {r['peak_rss_mib']} |" for r in rows),
    ]
    out = Path(args.out)
    write_results(out.parent, out.name, meta, rows, "\n".join(lines) + "\n")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()

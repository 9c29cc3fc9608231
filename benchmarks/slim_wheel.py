"""diffusers' wheel cut down to what this project runs, as a zip that Python imports from (PYTHONPATH).

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 -d /tmp/whl diffusers==0.42.1
    python3 -m benchmarks.slim_wheel /tmp/whl/diffusers-0.42.1-py3-none-any.whl .whl/diffusers-slim.zip

Why: the device call takes 64 MiB with the working tree, the tracked tree is about 62 MB and diffusers'
wheel 6.4 MB. Dropped: every pipeline package but ``wan`` (``diffusers/pipelines/<name>/``) and every
modular-pipeline package (``diffusers/modular_pipelines/<name>/``); diffusers imports those lazily, by name,
so nothing this project calls reaches them. Kept: the rest (models, hooks, schedulers, loaders, utils, the
``.dist-info`` for its version). ``benchmarks/run_gpu.sh`` puts ``.whl/*.zip`` on PYTHONPATH.
"""

from __future__ import annotations

import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

KEEP_PIPELINES = {"wan"}


def keep(name: str) -> bool:
    parts = name.split("/")
    if len(parts) >= 4 and parts[0] == "diffusers" and parts[1] == "pipelines":
        return parts[2] in KEEP_PIPELINES
    if len(parts) >= 4 and parts[0] == "diffusers" and parts[1] == "modular_pipelines":
        return False
    return not name.endswith(".pyc")


def slim(wheel: str | Path, out: str | Path) -> tuple[int, int]:
    """Writes the cut-down zip; returns (files kept, files dropped)."""
    kept = dropped = 0
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if keep(info.filename):
                dst.writestr(info.filename, src.read(info.filename))
                kept += 1
            else:
                dropped += 1
    return kept, dropped


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(__doc__)
        return 2
    kept, dropped = slim(args[0], args[1])
    print(f"wrote {args[1]} ({Path(args[1]).stat().st_size / 2**20:.2f} MiB): {kept} files kept, {dropped} dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

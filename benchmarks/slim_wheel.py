"""diffusers' wheel cut down to what this project runs, as a zip that Python imports from (PYTHONPATH).

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 -d /tmp/whl diffusers==0.42.1
    python3 -m benchmarks.slim_wheel /tmp/whl/diffusers-0.42.1-py3-none-any.whl .whl/diffusers-slim.zip

or, with no download, from the packages installed here (pure Python, so this machine's Python version does
not matter; omegaconf, which ``factory`` needs, is not in the device's image either):

    python3 -m benchmarks.slim_wheel --installed diffusers .whl/diffusers-slim.zip
    python3 -m benchmarks.slim_wheel --installed omegaconf .whl/omegaconf.zip

Why: the device call takes 64 MiB with the working tree, the tracked tree is about 53 MB (50.8 MiB) and
diffusers' wheel 6.4 MB. Dropped: every pipeline package but ``wan`` (``diffusers/pipelines/<name>/``) and every
modular-pipeline package (``diffusers/modular_pipelines/<name>/``); diffusers imports those lazily, by name,
so nothing this project calls reaches them. Kept: the rest (models, hooks, schedulers, loaders, utils, the
``.dist-info`` for its version). ``benchmarks/run_gpu.sh`` puts ``.whl/*.zip`` on PYTHONPATH.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from collections.abc import Sequence
from importlib import metadata
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


def zip_installed(dist: str, out: str | Path) -> int:
    """Writes the installed distribution ``dist``'s files (its RECORD: the package and its ``.dist-info``,
    no ``.pyc``) as a zip laid out like its wheel; returns the number of files."""
    files = [f for f in metadata.distribution(dist).files or () if not str(f).endswith(".pyc")]
    files = [f for f in files if not str(f).startswith("..") and Path(f.locate()).is_file()]
    if not files:
        raise FileNotFoundError(f"{dist}: no installed files listed in its RECORD")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for f in files:
            z.write(f.locate(), f.as_posix())
    return len(files)


def slim_installed(dist: str, out: str | Path) -> tuple[int, int]:
    """``slim`` of the installed distribution ``dist`` (``zip_installed`` first)."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(tmp) / f"{dist}.whl"
        zip_installed(dist, wheel)
        return slim(wheel, out)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    installed = bool(args) and args[0] == "--installed"
    if installed:
        args = args[1:]
    if len(args) != 2:
        print(__doc__)
        return 2
    kept, dropped = (slim_installed if installed else slim)(args[0], args[1])
    print(f"wrote {args[1]} ({Path(args[1]).stat().st_size / 2**20:.2f} MiB): {kept} files kept, {dropped} dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

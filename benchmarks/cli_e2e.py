"""``python -m pipelines.cli`` end to end on a machine without imageio-ffmpeg (the GPU machine).

    python -m benchmarks.cli_e2e --model /tmp/wan2.1-1.3b-RANDOM --variant all --prompt "..." \
        --frames 81 --height 480 --width 832 --steps 4 --out /tmp/cli.mp4 --no-progress

The same arguments as the CLI; :func:`benchmarks.device_shims.install` first (an OpenCV mp4 writer stands
in where imageio-ffmpeg is missing, and says so). The CLI prints each variant's text encoding, denoising and
VAE decode times and the comparison table.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.device_shims import install

    print(install(), flush=True)
    from pipelines.cli import main as cli

    return cli(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())

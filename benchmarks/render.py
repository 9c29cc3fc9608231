"""Re-renders a benchmark's markdown table and PNG from its JSON, e.g. from the partial JSON of a run
that was stopped part-way:

    python -m benchmarks.render benchmarks/results/wan_step_1.3b_h100_20261201.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import attention, wan_step
from .common import write_results

MODULES = {"attention": attention, "wan_step": wan_step}


def render(path: str | Path) -> list[Path]:
    path = Path(path)
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    name = meta.get("benchmark")
    if name not in MODULES:
        raise ValueError(
            f"{path} is not a benchmark result (meta.benchmark {name!r}, expected one of {sorted(MODULES)})"
        )
    module = MODULES[name]
    module.add_speedups(rows)
    table = module.markdown(rows, meta)
    if not meta.get("complete", True):
        table = f"PARTIAL RUN: stopped after {len(rows)} rows.\n\n" + table
    meta = {k: v for k, v in meta.items() if k != "complete"}
    written = write_results(path.parent, path.stem, meta, rows, table, lambda plt: module.plot(plt, rows, meta))
    if not data["meta"].get("complete", True):  # keep the record that the run was cut short
        written[0].write_text(json.dumps({"meta": {**meta, "complete": False}, "rows": rows}, indent=2) + "\n")
    return written


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for arg in sys.argv[1:]:
        render(arg)

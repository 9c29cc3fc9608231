"""The "measured on a GPU" panel: tables read from the committed benchmark result files (``benchmarks/results/*/
wan_step_*.json`` written on a CUDA device by ``python -m benchmarks.wan_step``), each with its device, date,
software and what the folder's README says about how it was run. Never live numbers and never mixed with the
CPU timings of the page: they come from another machine, another day, a 1.3B transformer at 31,500+ tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@dataclass
class GpuTable:
    """One committed result file: where it came from and its rows."""

    file: str  # relative to the results folder, e.g. "h100-2026-11-26/wan_step_1.3b_h100_20261126.json"
    device: str
    date: str
    software: str
    model: str
    how: str  # the folder README's line about this file ('' when it has none)
    rows: list[dict] = field(default_factory=list)


def load(results: Path = RESULTS) -> list[GpuTable]:
    """Every complete ``wan_step`` result measured on a CUDA device under ``results``, newest first. A file that
    is not such a result (another benchmark, a CPU run, an unfinished run, bad JSON) is left out."""
    tables = []
    for path in sorted(Path(results).glob("*/wan_step_*.json")):
        try:
            data = json.loads(path.read_text())
            meta, rows = data["meta"], data["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if meta.get("device_type") != "cuda" or not meta.get("complete") or not rows:
            continue
        software = ", ".join(
            f"{name} {meta[key]}"
            for name, key in (("torch", "torch"), ("Triton", "triton"), ("diffusers", "diffusers"))
            if meta.get(key)
        )
        layers = (meta.get("transformer") or {}).get("num_layers")
        model = f"Wan2.1 {meta.get('config', '?')} transformer" + (f" ({layers} layers)" if layers else "")
        model += f", {meta.get('weights', 'weights unknown')}, {meta.get('dtype', '?')}"
        compiled = meta.get("compile")
        model += f", torch.compile {compiled} (every variant)" if compiled and compiled != "none" else ", eager"
        tables.append(
            GpuTable(
                file=str(path.relative_to(results)),
                device=str(meta.get("device", "?")),
                date=str(meta.get("date", "?"))[:16].replace("T", " ") + " UTC",
                software=software,
                model=model,
                how=_readme_line(path),
                rows=rows,
            )
        )
    return sorted(tables, key=lambda t: t.date, reverse=True)


def _readme_items(text: str) -> list[str]:
    """A README's lines as items: a bullet with the indented lines that continue it (one command wrapped over
    several lines stays one), joined by spaces and without the bullet; any other line is an item of its own."""
    items: list[list[str]] = []
    bullet = False
    for line in text.splitlines():
        if re.match(r"\s*[-*+]\s", line):
            items.append([line.strip().lstrip("-*+").strip()])
            bullet = True
        elif bullet and line.strip() and line[:1].isspace():
            items[-1].append(line.strip())
        else:
            items.append([line.strip()])
            bullet = False
    return [" ".join(parts) for parts in items]


def _readme_line(path: Path) -> str:
    """The item of the folder's README.md that names this file (directly or as ``stem.*``) in its first line,
    whole (a command wrapped over several lines is shown to its end), without its bullet."""
    readme = path.parent / "README.md"
    if not readme.is_file():
        return ""
    stem = path.stem
    for item in _readme_items(readme.read_text()):
        lead = re.findall(r"`([^`]+)`", item.split("`:", 1)[0] + "`")  # the names before the item's first colon
        if any(n == path.name or (n.endswith(".*") and stem == n[:-2]) for n in lead):
            return item
    return ""


def table_markdown(table: GpuTable) -> str:
    """One file's table under a line naming its device, date, software and how it was run."""
    head = [
        f"**{table.device}**, measured {table.date} ({table.software}); {table.model}; file "
        f"`benchmarks/results/{table.file}`.",
    ]
    if table.how:
        head.append(f"How it was run (the folder's README): {table.how}")
    lines = [
        "| pass | size (FxHxW) | tokens | variant | ms per forward | vs flash | softmax backend |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for r in table.rows:
        speedup = r.get("speedup_vs_flash")
        lines.append(
            f"| {r.get('pass', '?')} | {r.get('size', '?')} | {r.get('tokens', '?'):,} | {r.get('variant', '?')} | "
            f"{float(r.get('ms', 0.0)):.1f} | {'-' if speedup is None else f'{float(speedup):.2f}x'} | "
            f"{r.get('softmax_backend') or '-'} |"
        )
    return "\n\n".join(head) + "\n\n" + "\n".join(lines)


def panel_markdown(tables: list[GpuTable]) -> str:
    """The whole panel: what these numbers are, then each file's table ('' when there are none)."""
    if not tables:
        return ""
    intro = (
        "These numbers were **measured on a GPU, not on this machine and not now**: committed result files of "
        "`python -m benchmarks.wan_step` (one transformer forward at batch 2 = classifier-free guidance, and "
        "forward+backward at batch 1), read as they are. \"vs flash\" is flash's time over the row's, same size "
        "and pass. The page's own timings above are this machine's, live."
    )
    return "\n\n".join([intro, *(table_markdown(t) for t in tables)])

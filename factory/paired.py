"""Two evaluations of :mod:`factory.evaluate` compared on the videos they share: the same prompt and seed.

    python -m factory.paired assets/builtin-next/curves/eval-v2.json assets/builtin-next/curves/eval-shipped-v2.json \
        --labels "the second design" shipped

Two models judged on different prompt counts or seeds are compared only where both drew the same validation
prompt (its index and caption: the same ``--data-seed`` and world) with the same seed: per variant present in both, each attribute and ``overall`` by :func:`world.analyse.score`
over those videos. Prints a Markdown table (``colour / shape / count / motion, overall`` per evaluation).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from factory.evaluate import NAMES
from world.analyse import ATTRIBUTES, score


def paired(a: dict, b: dict) -> dict[str, tuple[dict, dict]]:
    """Per variant in both evaluations: ``(score of a, score of b)`` over their common (prompt, caption, seed)
    videos (a validation split can hold one caption twice: the index tells them apart)."""
    out = {}
    for variant in (v for v in a["variants"] if v in b["variants"]):
        videos_a, videos_b = (
            {(x["prompt"], x["caption"], x["seed"]): x for x in r["variants"][variant]["per_video"]} for r in (a, b)
        )
        common = [k for k in videos_a if k in videos_b]
        if common:
            out[variant] = (score([videos_a[k] for k in common]), score([videos_b[k] for k in common]))
    return out


def markdown(pairs: dict[str, tuple[dict, dict]], labels: tuple[str, str]) -> str:
    def cell(s: dict) -> str:
        attrs = " / ".join("n/a" if s[k] is None else f"{s[k]:.2f}" for k in ATTRIBUTES)
        return f"{attrs}, {s['overall']:.2f}"

    lines = [
        f"{' / '.join(ATTRIBUTES)}, overall; on the videos both evaluations drew (same prompt and seed)",
        "",
        f"| variant | videos | {labels[0]} | {labels[1]} |",
        "|---|---:|---|---|",
    ]
    lines += [f"| {NAMES.get(v, v)} | {a['videos']} | {cell(a)} | {cell(b)} |" for v, (a, b) in pairs.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.paired", description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="an evaluation's JSON (factory.evaluate --out)")
    p.add_argument("b")
    p.add_argument("--labels", nargs=2, default=None, help="column names (default: the files' names)")
    args = p.parse_args(argv)
    try:
        a, b = (json.loads(Path(f).read_text()) for f in (args.a, args.b))
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pairs = paired(a, b)
    if not pairs:
        print(f"error: {args.a} and {args.b} share no video (variant, prompt and seed)", file=sys.stderr)
        return 2
    print(markdown(pairs, tuple(args.labels or (Path(args.a).stem, Path(args.b).stem))), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

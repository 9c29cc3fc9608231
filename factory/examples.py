"""Choose the app's example prompts for the built-in model from a committed evaluation: the prompts it draws best.

    python -m factory.examples --from benchmarks/results/builtin_eval_cpu.json
    python -m factory.examples --from EVAL.json --model runs/builtin/model --count 6

Reads the per-video verdicts of :mod:`factory.evaluate` (``variants.<v>.per_video``) and ranks its
validation prompts by how the softmax base (``--variant``, default flash) drew them over the evaluation's
seeds: first the number of videos with every named attribute right, then the fraction of attributes right,
then the same fraction over every evaluated variant (a prompt all of them draw shows the comparison best).
The best ``--count`` are kept, at most one per colour of the first object while others are left. They are
written into the model directory's ``builtin.json`` as ``example_prompts`` (the prompts, each one's scores,
the evaluation they came from), atomically; ``python run_app.py`` offers them as its examples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.outputs import write_text_atomic
from factory import dump_json
from pipelines import BUILTIN_DIR
from pipelines.attention import SOFTMAX
from world.analyse import ATTRIBUTES, parse_caption


def prompt_scores(videos: list[dict]) -> dict[str, dict]:
    """Per caption: ``{"videos", "all_right", "attributes_right"}`` over its videos (seeds); an attribute
    the caption does not name (None) is left out of the fraction."""
    out: dict[str, dict] = {}
    for v in videos:
        s = out.setdefault(v["caption"], {"videos": 0, "all_right": 0, "right": 0, "named": 0})
        named = [v[a] for a in ATTRIBUTES if v[a] is not None]
        s["videos"] += 1
        s["all_right"] += all(named)
        s["right"] += sum(bool(x) for x in named)
        s["named"] += len(named)
    return {
        c: {"videos": s["videos"], "all_right": s["all_right"], "attributes_right": s["right"] / max(1, s["named"])}
        for c, s in out.items()
    }


def choose(evaluation: dict, variant: str = SOFTMAX, count: int = 4) -> list[dict]:
    """The ``count`` best prompts of an evaluation for ``variant`` (see the module's docstring), best first."""
    rows = evaluation.get("variants", {})
    if variant not in rows or "per_video" not in rows[variant]:
        have = [v for v, r in rows.items() if "per_video" in r]
        raise ValueError(
            f"the evaluation has no per-video verdicts for {variant!r} (it has them for {have}); "
            "re-run python -m factory.evaluate with this version"
        )
    base = prompt_scores(rows[variant]["per_video"])
    others = [prompt_scores(r["per_video"]) for r in rows.values() if "per_video" in r]
    ranked = []
    for caption, s in base.items():
        across = sum(o[caption]["attributes_right"] for o in others if caption in o) / len(others)
        ranked.append({"prompt": caption, **s, "attributes_right_all_variants": across})
    ranked.sort(key=lambda r: (-r["all_right"], -r["attributes_right"], -r["attributes_right_all_variants"]))
    chosen: list[dict] = []
    colours: set[str] = set()
    for r in ranked:  # one per colour first, then the best of the rest
        colour = (parse_caption(r["prompt"])["objects"] or [{}])[0].get("colour")
        if colour not in colours:
            chosen.append(r)
            colours.add(colour)
        if len(chosen) == count:
            return chosen
    return chosen + [r for r in ranked if r not in chosen][: count - len(chosen)]


def write_examples(model_dir: Path, chosen: list[dict], source: str, evaluation: dict, variant: str) -> Path:
    """Records the chosen prompts in ``model_dir/builtin.json`` (atomically; paths :func:`factory.portable`)."""
    path = model_dir / "builtin.json"
    info = json.loads(path.read_text())
    info["example_prompts"] = {
        "prompts": [r["prompt"] for r in chosen],
        "scores": chosen,
        "chosen_from": source,
        "variant": variant,
        "seeds": evaluation.get("seeds"),
        "analyser_version": evaluation.get("analyser_version"),
        "rule": "most videos with every named attribute right over the seeds, then the fraction of attributes "
        "right, then that fraction over every variant; one per colour first",
    }
    return write_text_atomic(path, dump_json(info))  # a path inside the checkout is recorded relative to it


def main(argv=None) -> int:
    """``python -m factory.examples``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.examples")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.examples", description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", required=True, help="an evaluation JSON of factory.evaluate")
    p.add_argument(
        "--model", default=None, help="model directory whose builtin.json gets them (default: assets/builtin)"
    )
    p.add_argument("--variant", default=SOFTMAX, help="the variant whose videos rank the prompts")
    p.add_argument("--count", type=int, default=4)
    args = p.parse_args(argv)
    if args.count < 1:
        p.error(f"--count must be >= 1, got {args.count}")
    model_dir = Path(args.model) if args.model else BUILTIN_DIR
    if not (model_dir / "builtin.json").is_file():
        p.error(f"{model_dir} has no builtin.json: --model must be a built-in-layout model directory")
    source = Path(args.source)
    try:
        evaluation = json.loads(source.read_text())
        chosen = choose(evaluation, args.variant, args.count)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        p.error(f"{source}: {e}")
    path = write_examples(model_dir, chosen, args.source, evaluation, args.variant)
    for r in chosen:
        print(
            f"{r['all_right']}/{r['videos']} all right, {r['attributes_right']:.2f} of attributes "
            f"({r['attributes_right_all_variants']:.2f} over the variants): {r['prompt']}"
        )
    print(f"wrote example_prompts into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

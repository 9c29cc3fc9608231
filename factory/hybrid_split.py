"""Which layers of the built-in model's ``mhla-hybrid`` stay softmax: short arms, one per split, judged side by side.

    nohup nice -n 5 python -m factory.hybrid_split --splits 0,3 4,5 0,1 --steps 400 \\
        --work runs/builtin-v3/split --out assets/builtin-next/v3/curves/hybrid-split > runs/builtin-v3/split.log 2>&1 &

Issue 49: the hybrid (softmax in layers 0 and 3 of 6, :func:`pipelines.attention.hybrid_layers`) matched the full
MHLA conversion's held-out loss yet drew about half its triangles. More steps did not close it, so the split is the
suspect. Every arm starts the same way, so that only the split differs: the shipped MHLA conversion (every layer
MHLA, trained longest) with the softmax layers' self-attention (``attn1``: its projections and q/k norms) taken from
the shipped softmax base, the weights those projections were trained for under softmax. Each arm then fine-tunes
with the committed hybrid recipe (``factory/configs/v3/mhla-hybrid.yaml``) for ``--steps`` and is evaluated, its
hybrid only, on the committed evaluation's prompts (``factory.evaluate``: 48 prompts x ``--seeds``). An arm's
stages are kept in ``--work/s<split>/`` (start, the training run, a model folder, the evaluation) and a killed
run resumes at the first stage not done.

``--out OUT`` writes ``OUT.json`` and ``OUT.md``: per arm the split, the start's and the end's held-out flow loss,
the evaluation's overall and shape rates, and how many videos asking for each shape drew it; beside them the
shipped hybrid's row from the evaluation its ``builtin.json`` names, or ``--control``'s (the same prompts and seeds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from common.errors import run_cli
from common.outputs import atomic_dir, write_text_atomic
from factory import ROOT, output_path, portable, run_command, write_json
from factory.curves import read_metrics
from factory.v3 import WORLD
from world.synthetic import SHAPES

HYBRID = "mhla-hybrid"
CONFIG = ROOT / "factory" / "configs" / "v3" / f"{HYBRID}.yaml"
ATTN1 = ".attn1."


def parse_split(spec: str, num_layers: int) -> list[int]:
    """``"0,3"`` -> ``[0, 3]``: the layers that stay softmax. At least one and not all (a hybrid has both kinds)."""
    from pipelines.attention import parse_layers

    layers = parse_layers(spec, num_layers)
    if len(layers) >= num_layers:
        raise ValueError(f"split {spec!r} keeps every layer softmax; a hybrid needs at least one MHLA layer")
    return layers


def split_name(softmax: Sequence[int]) -> str:
    return "s" + "".join(str(i) for i in softmax)


def build_start(softmax: Sequence[int], mhla: Path, base: Path | None, out: Path) -> dict:
    """The arm's start in ``out``: ``mhla`` (a full MHLA conversion) as a hybrid whose ``softmax`` layers run
    softmax with ``base``'s self-attention weights (``None``: with the conversion's own); every other weight is the
    conversion's. Returns what moved."""
    import torch
    from safetensors.torch import load_file

    from pipelines.loading import load_transformer, save_transformer

    model = load_transformer(mhla, dtype=torch.float32, device="cpu")
    num_layers = len(model.blocks)
    mhla_layers = [i for i in range(num_layers) if i not in set(softmax)]
    base_weights = {} if base is None else load_file(str(base / "diffusion_pytorch_model.safetensors"))
    state = model.state_dict()
    moved = []
    for i in softmax if base is not None else ():
        prefix = f"blocks.{i}{ATTN1}"
        for key, value in base_weights.items():
            if key.startswith(prefix) and key in state:
                if state[key].shape != value.shape:
                    raise ValueError(f"{key}: {tuple(value.shape)} in {base}, {tuple(state[key].shape)} in {mhla}")
                state[key] = value.float()
                moved.append(key)
    if base is not None and not moved:
        raise ValueError(f"{base} shares no self-attention weight of layers {list(softmax)} with {mhla}")
    model.load_state_dict(state)
    model.convert(HYBRID, mhla_layers)
    save_transformer(model, out)
    return {"softmax": list(softmax), "mhla": mhla_layers, "moved": len(moved)}


def row(evaluation: dict, variant: str = HYBRID, seeds: Sequence[int] | None = None) -> dict:
    """An evaluation's ``variant`` over ``seeds`` (None: all), scored as the evaluation scores
    (:func:`world.analyse.score`) with its per-shape table (:func:`factory.evaluate.shape_readings`)."""
    from factory.evaluate import shape_readings
    from world.analyse import score

    v = evaluation["variants"][variant]
    videos = [p for p in v["per_video"] if seeds is None or p.get("seed") in seeds]
    scored = score(videos)
    readings = shape_readings(videos)
    return {
        "overall": scored["overall"],
        "shape": scored["shape"],
        "videos": len(videos),
        "flow_loss": v.get("flow_loss"),
        "shapes": {k: [r["right"], r["asked"]] for k, r in readings.items()},
    }


def screen(splits: Sequence[Sequence[int]], mhla: Path, base: Path, work: Path, batches: int = 2) -> list[dict]:
    """Each split's start held-out flow loss (the committed hybrid config's validation loss: fixed clips and
    noise), with the softmax layers' self-attention from ``base`` and with the conversion's own: which starts
    are near a trained model before any step. One process, the validation clips rendered once."""
    from factory.reship import HeldOutLoss

    measure = HeldOutLoss(batches, configs=CONFIG.parent)
    rows = []
    for softmax in splits:
        for recipe, weights in (("base", base), ("conversion", None)):
            folder = work / "screen" / f"{recipe}-{split_name(softmax)}"
            if not (folder / "config.json").is_file():
                build_start(softmax, mhla, weights, folder)
            loss = measure(HYBRID, folder)
            rows.append({"split": split_name(softmax), "softmax": list(softmax), "weights": recipe, "loss": loss})
            print(f"[hybrid_split] screen {rows[-1]['split']} {recipe}: {loss:.4f}", flush=True)
    return rows


class Arm:
    def __init__(
        self,
        softmax: list[int],
        work: Path,
        steps: int,
        seeds: list[int],
        num_prompts: int,
        mhla: Path,
        base: Path | None,
        builtin: Path,
    ) -> None:
        self.softmax, self.steps, self.seeds, self.num_prompts = softmax, steps, seeds, num_prompts
        self.mhla, self.base, self.builtin = mhla, base, builtin
        self.name = split_name(softmax) + ("" if base is not None else "-own")
        self.dir = work / self.name

    def __call__(self) -> dict:
        start, run_dir, model = self.dir / "start", self.dir / "run", self.dir / "model"
        record = self.dir / "start.json"
        if not (start / "config.json").is_file():
            write_json(record, build_start(self.softmax, self.mhla, self.base, start))
        info = json.loads(record.read_text())
        if not (run_dir / "final" / "finished.json").is_file():
            layers = "[" + ",".join(str(i) for i in info["mhla"]) + "]"
            run_command(
                [
                    sys.executable,
                    "-m",
                    "training.finetune",
                    "--config",
                    str(CONFIG),
                    f"run_dir={run_dir}",
                    f"model.transformer={start}",
                    f"model.layers={layers}",
                    f"train.steps={self.steps}",
                ]
            )
        if not (model / "builtin.json").is_file():
            from factory.next import save_variant

            with atomic_dir(model) as tmp:
                shutil.copytree(self.builtin, tmp, dirs_exist_ok=True)
                shutil.rmtree(tmp / "variants" / HYBRID)
                save_variant(HYBRID, run_dir / "final", tmp)
        evaluation = self.dir / f"eval-{self.name}"
        if not output_path(evaluation, ".json").is_file():
            run_command(
                [
                    sys.executable,
                    "-m",
                    "factory.evaluate",
                    "--model",
                    str(model),
                    "--variants",
                    HYBRID,
                    "--world",
                    WORLD,
                    "--num-prompts",
                    str(self.num_prompts),
                    "--seeds",
                    *map(str, self.seeds),
                    "--out",
                    str(evaluation),
                ]
            )
        result = row(json.loads(output_path(evaluation, ".json").read_text()))
        metrics = read_metrics(run_dir / "metrics.jsonl")
        start_loss = next((r["eval_loss"] for r in metrics if "eval_loss" in r), None)
        end_loss = [r.get("eval_loss_ema", r.get("eval_loss")) for r in metrics if "eval_loss" in r]
        probes = [r["probe_ema"] for r in metrics if isinstance(r.get("probe_ema"), dict)]
        shape_ratio = probes[-1]["ratio"]["shape"].get("0.9") if probes else None
        return {
            "split": self.name,
            **info,
            "steps": self.steps,
            "eval_loss_start": start_loss,
            "eval_loss_end_ema": end_loss[-1] if end_loss else None,
            "probe_shape_ratio_09_ema": shape_ratio,
            **result,
        }


def table(arms: list[dict], shipped: dict | None) -> str:
    lines = [
        "| arm | softmax layers | steps | cache-eval loss, start -> end (EMA) | probe shape ratio at 0.9 (EMA) "
        "| held-out loss | overall | shape | " + " | ".join(SHAPES) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(SHAPES),
    ]
    label = "shipped" if shipped and "softmax" in shipped else Path(shipped["evaluation"]).stem if shipped else ""
    rows = ([(label, shipped)] if shipped else []) + [(a["split"], a) for a in arms]
    for name, r in rows:
        cells = [f"{r['shapes'][s][0]}/{r['shapes'][s][1]}" if s in r["shapes"] else "" for s in SHAPES]
        loss = r.get("flow_loss")
        cache = (
            f"{r['eval_loss_start']:.4f} -> {r['eval_loss_end_ema']:.4f}"
            if r.get("eval_loss_start") is not None and r.get("eval_loss_end_ema") is not None
            else ""
        )
        ratio = r.get("probe_shape_ratio_09_ema")
        lines.append(
            f"| {name} | {r.get('softmax', '')} | {r.get('steps', '')} | {cache} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | "
            f"{'' if loss is None else f'{loss:.4f}'} | {r['overall']:.2f} | {r['shape']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_cli(_main, argv)


def _main(argv=None) -> int:
    from pipelines.model_dir import BUILTIN_DIR

    p = argparse.ArgumentParser(prog="python -m factory.hybrid_split", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--splits", nargs="+", required=True, help="each arm's softmax layers, e.g. 0,3 4,5; pairs: every two layers"
    )
    p.add_argument(
        "--softmax-weights",
        choices=("base", "conversion"),
        default="base",
        help="the softmax layers' self-attention: the shipped base's (default) or the MHLA conversion's own",
    )
    p.add_argument(
        "--screen",
        action="store_true",
        help="only each split's start loss, with either weights (no training): OUT-screen.json and .md",
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "builtin-v3" / "split")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--control",
        type=Path,
        help="the evaluation whose hybrid the arms are set against (default: the one the model's builtin.json names)",
    )
    p.add_argument(
        "--model", type=Path, default=BUILTIN_DIR, help="the shipped model whose mhla and base it starts from"
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    builtin = json.loads((args.model / "builtin.json").read_text())
    num_layers = json.loads((args.model / "transformer" / "config.json").read_text())["num_layers"]
    if args.splits == ["pairs"]:
        args.splits = [f"{i},{j}" for i in range(num_layers) for j in range(i + 1, num_layers)]
    splits = [parse_split(s, num_layers) for s in args.splits]  # every split checked before any work
    mhla, base = args.model / "variants" / "mhla", args.model / "transformer"
    if args.screen:
        rows = screen(splits, mhla, base, args.work)
        out = Path(str(args.out) + "-screen")
        write_json(output_path(out, ".json"), portable({"model": str(args.model), "rows": rows}))
        lines = ["| softmax layers | base's attn1 | conversion's attn1 |", "|---|---:|---:|"]
        for softmax in splits:
            got = {r["weights"]: r["loss"] for r in rows if r["softmax"] == list(softmax)}
            lines.append(f"| {list(softmax)} | {got['base']:.4f} | {got['conversion']:.4f} |")
        write_text_atomic(output_path(out, ".md"), "\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    arms = []
    for softmax in splits:
        weights = base if args.softmax_weights == "base" else None
        arm = Arm(softmax, args.work, args.steps, args.seeds, args.num_prompts, mhla, weights, args.model)
        arms.append(arm())
        print(
            f"[hybrid_split] {arms[-1]['split']}: overall {arms[-1]['overall']:.2f}, shapes {arms[-1]['shapes']}",
            flush=True,
        )
    shipped = None
    control = args.control or (ROOT / builtin["evaluation"] if builtin.get("evaluation") else None)
    if control is not None and Path(control).is_file():
        shipped = row(json.loads(Path(control).read_text()), seeds=args.seeds)
        shipped["evaluation"] = str(control)
        if args.control is None:  # the shipped model's own evaluation: its hybrid's split is the shipped one
            config = json.loads((args.model / "variants" / HYBRID / "config.json").read_text())
            linear = config["self_attention"]["linear_layers"]
            shipped["softmax"] = [i for i in range(num_layers) if i not in linear]
    record = {
        "steps": args.steps,
        "seeds": args.seeds,
        "num_prompts": args.num_prompts,
        "shipped": shipped,
        "arms": arms,
    }
    write_json(output_path(args.out, ".json"), portable(record))
    write_text_atomic(output_path(args.out, ".md"), table(arms, shipped))
    print(table(arms, shipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny-scale study: recovering a softmax model after conversion, with and without attention transfer.

    python -m factory.transfer_study                     # CPU, a few minutes
    python -m factory.transfer_study --base-steps 400 --steps 100 --transfer-steps 30

1. Train the tiny random-weight Wan2.1 (softmax, ``flash``) from its random weights on the synthetic shapes:
   this is the "pretrained" base.
2. Convert copies of it to ``mhla`` and ``linear`` and fine-tune each with ``training/finetune.py``
   for the same number of end-to-end steps, once directly and once after an attention-transfer stage.
3. Report the evaluation flow loss (synthetic validation split, fixed noise) of the base, of each
   converted model before fine-tuning, after transfer, and at the end, and the first end-to-end step
   at which each run comes within 5% of the base's loss.

Writes ``benchmarks/results/transfer_tiny_<device>.{json,md}``. The tiny model is small and its
training short, so the numbers say whether the recipe works, not how Wan2.1-1.3B will behave.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from factory import ROOT, run_command
from pipelines.attention import LINEAR, MHLA

RESULTS = ROOT / "benchmarks" / "results"


def run(run_dir: Path, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable,
        str(ROOT / "training" / "finetune.py"),
        "--config",
        str(ROOT / "configs/finetune/tiny.yaml"),
        f"run_dir={run_dir}",
        "log.tensorboard=false",
        "checkpoint.keep=1",
        *overrides,
    ]
    run_command(cmd, quiet=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> int:
    """``python -m factory.transfer_study``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.transfer_study")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=60, help="end-to-end fine-tuning steps of each converted model")
    p.add_argument("--transfer-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--work-dir", default="runs/transfer_study")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    work = ROOT / args.work_dir
    common = [f"train.lr={args.lr}", "validation.loss_batches=4", "data.num_samples=256"]

    base_rows = run(
        work / "base",
        "model.variant=flash",
        f"train.steps={args.base_steps}",
        f"checkpoint.every={args.base_steps}",
        *common,
    )
    base_loss = base_rows[-1]["eval_loss"]
    base = work / "base" / "checkpoints" / f"step-{args.base_steps:07d}" / "transformer"

    rows = []
    for variant in (MHLA, LINEAR):
        for transfer in (0, args.transfer_steps):
            name = f"{variant}{'+transfer' if transfer else ''}"
            m = run(
                work / name,
                f"model.variant={variant}",
                f"model.transformer={base}",
                f"train.steps={args.steps}",
                f"transfer.steps={transfer}",
                f"transfer.lr={args.lr}",
                "checkpoint.every=0",
                *common,
            )
            evals = [r["eval_loss"] for r in m if "eval_loss" in r]
            e2e = [r for r in m if r.get("stage") == "train"]
            reach = next((i + 1 for i, r in enumerate(e2e) if r["loss"] <= 1.05 * base_loss), None)
            rows.append(
                {
                    "run": name,
                    "converted_start": evals[0],
                    "end": evals[-1],
                    "transfer_final_mse": next((r["loss"] for r in reversed(m) if r.get("stage") == "transfer"), None),
                    "first_train_loss": e2e[0]["loss"],
                    "last_train_loss": e2e[-1]["loss"],
                    "e2e_step_within_5pct_of_base": reach,
                }
            )
    meta = {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "base_steps": args.base_steps,
        "steps": args.steps,
        "transfer_steps": args.transfer_steps,
        "lr": args.lr,
        "base_eval_loss": base_loss,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
    }
    lines = [
        f"Tiny Wan2.1 on synthetic shapes ({meta['device']}): softmax base trained {args.base_steps} steps "
        f"(eval flow loss {base_loss:.4f}); each converted copy fine-tuned {args.steps} end-to-end steps, "
        f"with or without {args.transfer_steps} attention-transfer steps first. Eval loss: synthetic validation "
        "split, fixed noise. Training loss of a single step is noisy (random timesteps).",
        "",
        "| run | eval loss after conversion | eval loss at end | transfer MSE at end | first / last train loss | "
        "first e2e step within 5% of base |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mse = "" if r["transfer_final_mse"] is None else f"{r['transfer_final_mse']:.4f}"
        lines.append(
            f"| {r['run']} | {r['converted_start']:.4f} | {r['end']:.4f} | {mse} | "
            f"{r['first_train_loss']:.4f} / {r['last_train_loss']:.4f} | {r['e2e_step_within_5pct_of_base'] or '-'} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        tag = f"transfer_tiny_{meta['device']}"
        (RESULTS / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        (RESULTS / f"{tag}.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training checkpoints: written atomically, found again by ``resume=latest``, loaded without pickles.

A checkpoint is a folder ``<run>/checkpoints/step-0000100/`` holding

- ``transformer/``: the model in the pipeline's save format (safetensors + the attention variant in
  ``config.json``), loadable by ``pipelines.load_transformer`` and ``python -m pipelines.generate --transformer``;
- ``training_state.pt``: optimizer, LR schedule and step; ``rank<r>.pt``: each process's random
  generator and data position (plain tensors and numbers, read back with ``torch.load(weights_only=True)``);
- ``config.yaml``: the resolved run configuration.

It is written under a temporary name and renamed into place only when complete, so a crash while
saving never spoils the last good checkpoint; ``latest`` only ever sees complete ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

STATE_FILE = "training_state.pt"
_NAME = re.compile(r"^step-(\d{7})$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def resolve_resume(resume: str | None, run_dir: str | Path) -> Path | None:
    """``None`` -> no resume; ``"latest"`` -> newest complete checkpoint of the run (or None if there is
    none yet, so a fresh run and a restarted one use the same command); a path -> that checkpoint."""
    if not resume:
        return None
    if resume == "latest":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume={str(path)!r} is not a complete checkpoint (no {STATE_FILE} inside)")
    return path


def begin_checkpoint(run_dir, step: int) -> Path:
    """The temporary folder checkpoint ``step`` is assembled in (the same path on every rank).

    Only the main process calls this (it clears a stale folder left by a crash); the others use
    :func:`pending_dir` after a barrier.
    """
    tmp = pending_dir(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def pending_dir(run_dir, step: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    return final.parent / f".{final.name}.tmp"


def finish_checkpoint(run_dir, step: int, keep: int | None = None) -> Path:
    """Renames the assembled folder into place, then drops all but the newest ``keep`` checkpoints."""
    final = checkpoint_dir(run_dir, step)
    tmp = pending_dir(run_dir, step)
    if final.exists():  # a re-run of the same step replaces it, still without a window of no checkpoint
        old = final.parent / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    if keep:
        for stale in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def save_state(state: dict, path: str | Path) -> None:
    torch.save(state, path)


def load_state(path: str | Path) -> dict:
    """A state file of a checkpoint; only tensors, numbers, strings and containers are accepted."""
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_optimizer(optimizer, scheduler, state: dict) -> None:
    """Load a checkpoint's optimizer and LambdaLR state, keeping the learning rates the config gives now.

    The schedule's position (``last_epoch``) and Adam's moments come from the checkpoint; the base rates
    come from the freshly built ``scheduler``, so a run resumed with a changed ``train.lr`` uses it
    from its first resumed step (torch would otherwise restore the old rates with the schedule).
    """
    base = list(scheduler.base_lrs)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])
    scheduler.base_lrs = base
    for group, lr, factor in zip(optimizer.param_groups, base, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def trim_metrics(path: str | Path, step: int) -> int:
    """A resumed run drops the ``metrics.jsonl`` rows logged after its checkpoint's ``step`` (the part of the
    interrupted run that is redone), so every step appears once. Atomic; returns the number of rows dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    kept = [x for x in lines if json.loads(x).get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)
    return len(lines) - len(kept)

"""Kill a fine-tuning run at a chosen moment: inside a step, inside a checkpoint save, inside a metrics write, or
at the end of the run (issue 53, item 4; used by ``test_killed_anywhere.py``).

``python -c "from tests.training.killpoints import serve; serve()"`` imports the recipe once, then reads one job
per line on stdin (JSON: ``argv`` of ``training.finetune``, ``log`` file, ``journal`` file, ``plan`` or null) and
runs each in a fork of itself, so twenty runs do not pay twenty interpreter and torch start-ups; it answers each
with a line ``{"pid": ..., "exit": ...}`` (``exit``: the exit code, ``-9`` for a SIGKILL).

A ``plan`` (:func:`arm`) says where the forked run kills itself with SIGKILL (no clean-up, as the kernel or a
power cut would), in terms of the run's absolute steps:

- ``{"kind": "step", "step": k, "point": "forward" | "update" | "timer"}``: inside step ``k``: while its loss is
  computed, just after the optimizer updated the parameters (the step not yet logged), or after a random delay
  (``delay`` seconds) from its forward (at the latest when its metrics row is about to be written);
- ``{"kind": "metrics", "step": k, "cut": f}``: while the metrics row of step ``k`` (0: the start's evaluation
  row) is appended: the first ``f`` of its bytes are written (``f`` = 1.0: all but the line end);
- ``{"kind": "save", "step": k, "point": ...}``: inside the checkpoint save of step ``k``: a state file
  (``rank-state``, ``training-state``) or the weights (``weights``) written up to ``cut`` of their bytes, the
  manifest half written (``manifest``), the folder renamed into place but older ones not yet pruned
  (``renamed``), an older checkpoint half removed by pruning (``pruning``), or a random delay into the save
  (``timer``; at the latest when the save returns);
- ``{"kind": "end", "point": "final-weights" | "after-final-model" | "end-row"}``: at the end of the run: the
  final model's weights half written, just after the final model was saved, the end-of-run evaluation row half
  appended.

Before it dies the run appends ``{"event": "killed", ...}`` to the journal (and ``{"event": "saved", "step": k}``
after each checkpoint it completed), so the test knows that the kill happened where it was planned.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def serve() -> None:
    import training.finetune  # noqa: F401 - imported once, before the forks

    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(job)  # never returns
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(job: dict) -> None:
    code = 1
    try:
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout.reconfigure(line_buffering=True)  # what was printed is in the log when the kill comes
        sys.stderr.reconfigure(line_buffering=True)
        if job.get("plan"):
            arm(job["plan"], Path(job["journal"]))
        from training.finetune import main

        code = main(job["argv"])
    except BaseException as e:  # noqa: BLE001 - reported as the child's exit code; main has its own boundary
        print(f"killpoints: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _note(journal: Path, event: dict) -> None:
    with journal.open("a") as f:
        f.write(json.dumps(event) + "\n")


def _cut_file(path: Path, fraction: float) -> int:
    """Truncates ``path`` to ``fraction`` of its bytes (at least one fewer than it has): a write cut short."""
    size = path.stat().st_size
    keep = max(0, min(size - 1, int(size * fraction)))
    os.truncate(path, keep)
    return keep


def arm(plan: dict, journal: Path) -> None:
    """Installs ``plan``'s kill in this (forked) process: patches of the recipe's functions and of the writers it
    calls, each of which passes through to the real one except at the planned moment."""
    import shutil

    import safetensors.torch
    import torch

    from training import checkpoint as ckpt
    from training import finetune
    from training.flow import FlowMatching

    kind, point, at = plan["kind"], plan.get("point"), plan.get("step")
    state = {"last": plan["start"], "save": None, "final": False, "timer": None}

    def die(where: str, **info) -> None:
        _note(journal, {"event": "killed", "kind": kind, "point": where, "step": at, **info})
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is on its way

    def in_step() -> bool:
        return kind == "step" and state["last"] + 1 == at and not state["final"]

    def in_save() -> bool:
        return kind == "save" and state["save"] == at

    def start_timer(delay: float, where: str) -> None:
        timer = threading.Timer(delay, die, args=(where,), kwargs={"delay": delay})
        timer.daemon = True
        state["timer"] = timer
        timer.start()

    def late_timer(where: str) -> None:
        if state["timer"] is not None:
            state["timer"].cancel()
            die(where, delay=plan.get("delay"))

    real_loss = FlowMatching.loss

    def loss(self, *args, **kwargs):
        value = real_loss(self, *args, **kwargs)
        if in_step() and point == "forward":
            die("forward")
        if in_step() and point == "timer" and state["timer"] is None:
            start_timer(plan["delay"], "timer")
        return value

    FlowMatching.loss = loss

    real_adam_step = torch.optim.AdamW.step

    def adam_step(self, *args, **kwargs):
        out = real_adam_step(self, *args, **kwargs)
        if in_step() and point == "update":
            die("update")
        return out

    torch.optim.AdamW.step = adam_step

    real_write = finetune.Metrics.write

    def write(self, row: dict) -> None:
        training_row = "loss" in row
        if kind == "step" and training_row and row["step"] == at:
            late_timer("timer (at the step's metrics row)")
        planned = (kind == "metrics" and row["step"] == at and not state["final"] and (training_row or at == 0)) or (
            kind == "end" and point == "end-row" and state["final"] and not training_row
        )
        if planned:
            data = (json.dumps(row) + "\n").encode()
            keep = len(data) - 1 if plan["cut"] >= 1 else max(1, int(len(data) * plan["cut"]))
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(fd, data[:keep])
            os.close(fd)
            die("metrics row" if kind == "metrics" else "end-row", bytes=keep, of=len(data))
        real_write(self, row)
        if training_row:
            state["last"] = row["step"]

    finetune.Metrics.write = write

    real_save = finetune.save

    def save(accelerator, cfg, run_dir, step, *args, **kwargs):
        state["save"] = step
        if in_save() and point == "timer":
            start_timer(plan["delay"], "timer")
        real_save(accelerator, cfg, run_dir, step, *args, **kwargs)
        state["save"] = None
        _note(journal, {"event": "saved", "step": step})
        if kind == "save" and step == at:
            late_timer("timer (at the end of the save)")
            die(f"{point}: not reached, after the save")  # a planned point the save did not pass

    finetune.save = save

    real_save_state = ckpt.save_state

    def save_state(data, path):
        real_save_state(data, path)
        name = Path(path).name
        if in_save() and (point, name) in (("rank-state", "rank0.pt"), ("training-state", ckpt.STATE_FILE)):
            die(point, file=name, bytes=_cut_file(Path(path), plan["cut"]))

    ckpt.save_state = save_state

    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        real_save_file(tensors, filename, *args, **kwargs)
        if (in_save() and point == "weights") or (kind == "end" and point == "final-weights" and state["final"]):
            die(point, file=str(filename), bytes=_cut_file(Path(filename), plan["cut"]))

    safetensors.torch.save_file = save_file

    real_manifest = ckpt.write_manifest

    def write_manifest(folder):
        real_manifest(folder)
        if in_save() and point == "manifest":
            folder = Path(folder)
            data = (folder / ckpt.MANIFEST).read_bytes()
            (folder / ckpt.MANIFEST).unlink()  # as it was mid-write: the temporary, cut short, not yet renamed
            keep = max(1, int(len(data) * plan["cut"]))
            (folder / (ckpt.MANIFEST + ".tmp")).write_bytes(data[:keep])
            die(point, bytes=keep, of=len(data))

    ckpt.write_manifest = write_manifest

    real_replace = ckpt.replace_dir

    def replace_dir(src, dst):
        real_replace(src, dst)
        if in_save() and point == "renamed":
            die(point, folder=str(dst))

    ckpt.replace_dir = replace_dir

    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        path = Path(path)
        if in_save() and point == "pruning" and path.parent.name == "checkpoints" and "step-" in path.name:
            files = sorted(p for p in path.rglob("*") if p.is_file())
            gone = files[: max(1, len(files) // 2)]
            for p in gone:
                p.unlink()
            die(point, folder=str(path), removed=[str(p.relative_to(path)) for p in gone])
        return real_rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree

    real_final = finetune.save_final_model

    def save_final_model(*args, **kwargs):
        state["final"] = True
        out = real_final(*args, **kwargs)
        if kind == "end" and point == "after-final-model":
            die(point)
        return out

    finetune.save_final_model = save_final_model

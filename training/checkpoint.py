"""Training checkpoints: written atomically, found again by ``resume=latest``, loaded without pickles.

A checkpoint is a folder ``<run>/checkpoints/step-0000100/`` holding

- ``transformer/``: the model in the pipeline's save format (safetensors + the attention variant in
  ``config.json``), loadable by ``pipelines.load_transformer`` and ``python -m pipelines.cli --transformer``;
  ``transformer_2/`` instead for a Wan2.2-A14B run of the low-noise expert (``model.expert``: the folder the
  trained expert has in the model directory);
- ``training_state.pt``: optimizer, LR schedule and step; ``rank<r>.pt``: each process's random
  generator and data position (plain tensors and numbers, read back with ``torch.load(weights_only=True)``);
- ``config.yaml``: the resolved run configuration.

At the end of every run, whatever the checkpoint schedule, the trained model is also saved as
``<run>/final/transformer/`` (``transformer_2/`` for the low-noise expert; written atomically, never pruned)
and, for a LoRA run, its adapters in diffusers' format as ``lora/`` (in each checkpoint too; :mod:`pipelines.lora`),
with ``final/finished.json`` saying at which step: ``resume=latest`` on a finished run says so and exits.

It is written under a temporary name and renamed into place only when complete, so a crash while
saving never spoils the last good checkpoint. ``manifest.json`` is written last, with the size and
SHA-256 of every other file: a checkpoint counts only when its manifest is there, and ``resume=latest``
checks the files against it, skipping a damaged checkpoint (a truncated file, a disk error) with a
warning that names it, for the newest good one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from common.outputs import normalize_modes, replace_dir

STATE_FILE = "training_state.pt"
LOCK_FILE = ".lock"  # training.lock's file, kept by clear_run
MANIFEST = "manifest.json"
FINAL = "final"  # <run>/final/<transformer folder>: the model at the end of the run
FINISHED = "finished.json"  # <run>/final/finished.json: {"step": ..., "model": folder name}, written last
LORA = "lora"  # <checkpoint>/lora, <run>/final/lora: a LoRA run's adapters in diffusers' format (pipelines/lora.py)
_NAME = re.compile(r"^step-(\d{7})$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints of a run that were completed (their manifest written), oldest first. Their files are
    not checked here: :func:`damage` does that."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: str | Path) -> int:
    found = _NAME.match(Path(path).name)
    if found is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint folder name (step-XXXXXXX)")
    return int(found.group(1))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: str | Path) -> None:
    """Records size and SHA-256 of every file in ``folder`` in ``manifest.json``; call it last."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": entries}, indent=1))
    os.replace(tmp, folder / MANIFEST)


def damage(folder: str | Path) -> str | None:
    """Why the checkpoint ``folder`` cannot be trusted (naming the file), or None when every file matches
    its manifest."""
    folder = Path(folder)
    try:
        entries = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{folder / MANIFEST} is missing (the checkpoint was never completed)"
    except (ValueError, KeyError, TypeError):
        return f"{folder / MANIFEST} is not a readable manifest"
    if STATE_FILE not in entries:
        return f"{folder / MANIFEST} lists no {STATE_FILE}"
    for name, entry in entries.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated or changed)"
        if _sha256(path) != entry["sha256"]:
            return f"{path} does not match its SHA-256 in the manifest (corrupted or changed)"
    return None


def resolve_resume(resume: str | None, run_dir: str | Path) -> Path | None:
    """``None`` -> no resume; ``"latest"`` -> newest checkpoint of the run whose files match its manifest
    (None if there is none yet, so a fresh run and a restarted one use the same command; damaged ones
    are skipped with a warning naming them); a path -> that checkpoint, which must be intact."""
    if not resume:
        return None
    if resume == "latest":
        for path in reversed(list_checkpoints(run_dir)):
            why = damage(path)
            if why is None:
                return path
            warnings.warn(f"skipping damaged checkpoint {path}: {why}", stacklevel=2)
        return None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={str(path)!r}: no such checkpoint folder")
    why = damage(path)
    if why is not None:
        raise ValueError(f"resume={str(path)!r} is not an intact checkpoint: {why}")
    return path


RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml")
RUN_MANIFEST = "run_files.json"  # what a run wrote in its run_dir: all that overwrite=true may remove
# names a new run writes whatever it is given: one not written by the earlier run is never replaced
_FIXED = ("config.yaml", "metrics.jsonl", RUN_MANIFEST)


def _read_run_files(run_dir: Path) -> tuple[set[str], set[str]] | None:
    """``(written, folders)`` of ``run_dir``'s run manifest (paths relative to ``run_dir``; ``written``: files
    and folders the run made whole, ``folders``: folders it made to hold them), None when there is none."""
    path = run_dir / RUN_MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        written, folders = data["written"], data["folders"]
        if not all(isinstance(x, str) for x in [*written, *folders]):
            raise TypeError("a path that is not text")
    except (ValueError, KeyError, TypeError) as e:
        from common.errors import BadInputError

        raise BadInputError(
            f"{str(path)!r} is not a readable run manifest ({e}); expected the list of files a run wrote (remove "
            "the earlier run's files yourself, or choose another run_dir)"
        ) from None
    return set(written), set(folders)


def _legacy_run_files(run_dir: Path) -> tuple[set[str], set[str]]:
    """What a run written before run manifests (or by ``training.vae``, which keeps none) wrote at the names
    every run writes: its config, metrics and checkpoint folders (each vouched for by its own manifest)."""
    written = {name for name in ("config.yaml", "metrics.jsonl") if (run_dir / name).is_file()}
    root = run_dir / "checkpoints"
    if root.is_dir():
        written |= {f"checkpoints/{p.name}" for p in list_checkpoints(run_dir)}
        written |= {f"checkpoints/{p.name}" for p in root.glob(".step-*.tmp")}
    folders = {"checkpoints"} if root.is_dir() else set()
    if (run_dir / "final" / "vae" / "trained.json").is_file():  # training.vae's result
        written.add("final/vae")
        folders.add("final")
    return written, folders


def record_run_files(run_dir: str | Path, *written: str, folders: tuple[str, ...] = ()) -> None:
    """Adds paths (relative to ``run_dir``) to the run manifest before they are written, so that a crash never
    leaves a file of the run unlisted. ``folders``: folders made to hold them (removed only when empty). Only
    the main process calls it."""
    from common.outputs import write_text_atomic

    run_dir = Path(run_dir)
    found = _read_run_files(run_dir)
    if found is None:
        found = _legacy_run_files(run_dir)
    have_written, have_folders = found
    if set(written) <= have_written and set(folders) <= have_folders and (run_dir / RUN_MANIFEST).is_file():
        return
    data = {"written": sorted(have_written | set(written)), "folders": sorted(have_folders | set(folders))}
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / RUN_MANIFEST, json.dumps(data, indent=1) + "\n")


def _unlisted(run_dir: Path, written: set[str]) -> list[str]:
    """Files at the names a new run writes (and checkpoint folders, which a new run would prune or resume
    from) that the earlier run did not write."""
    names = [n for n in _FIXED if (run_dir / n).exists()]
    root = run_dir / "checkpoints"
    if root.is_dir():
        names += [f"checkpoints/{p.name}" for p in root.iterdir() if _NAME.match(p.name)]
    return sorted(n for n in names if n not in written and n != RUN_MANIFEST)


def check_new_run(run_dir: str | Path, resume: str | None, overwrite: bool) -> list[Path]:
    """A run without ``resume`` must not start over another run's files in ``run_dir`` (its metrics would be
    emptied and checkpoint pruning would mix the two runs). Returns what ``overwrite=true`` removes: only what
    the earlier run wrote (its run manifest, see :func:`record_run_files`); anything else is left. Raises
    ValueError naming the folder without ``overwrite``, and naming the files when ``overwrite`` would have to
    replace files the earlier run did not write (a config.yaml of one's own, a copied-in checkpoint)."""
    if resume:
        return []
    run_dir = Path(run_dir)
    found = [run_dir / name for name in (*RUN_FILES, RUN_MANIFEST) if (run_dir / name).exists()]
    if found and not overwrite:
        steps = [checkpoint_step(p) for p in list_checkpoints(run_dir)]
        held = f" (checkpoints up to step {max(steps)})" if steps else ""
        raise ValueError(
            f"run_dir {str(run_dir)!r} already holds a run{held}: continue it with resume=latest, "
            "choose a new run_dir, or replace it with overwrite=true"
        )
    if not found:
        return []
    listed = _read_run_files(run_dir)
    written, _ = listed if listed is not None else _legacy_run_files(run_dir)
    foreign = _unlisted(run_dir, written)
    if foreign:
        from common.errors import BadInputError

        raise BadInputError(
            f"overwrite=true would replace files in run_dir {str(run_dir)!r} that the earlier run did not write: "
            f"{', '.join(foreign[:8])}{' ...' if len(foreign) > 8 else ''}; move them away or choose another run_dir"
        )
    return [run_dir / name for name in sorted(written) if (run_dir / name).exists() or (run_dir / name).is_symlink()]


def clear_run(run_dir: str | Path) -> list[str]:
    """Removes an earlier run's files from ``run_dir`` (``overwrite=true``): what its run manifest lists (for a
    run without one, :func:`_legacy_run_files`), then the folders it made when they are left empty. Everything
    else stays (the lock file, notes, data); returns those left, relative to ``run_dir``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    listed = _read_run_files(run_dir)
    written, folders = listed if listed is not None else _legacy_run_files(run_dir)
    for name in sorted(written):
        path = run_dir / name
        if not _inside(path, run_dir):  # a manifest naming ../ or an absolute path: never followed out
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    for name in sorted(folders, key=lambda n: -n.count("/")):  # the deepest first
        path = run_dir / name
        if _inside(path, run_dir) and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
    (run_dir / RUN_MANIFEST).unlink(missing_ok=True)
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != LOCK_FILE and not p.is_dir())


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.parent.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return ".." not in Path(path).relative_to(folder).parts


def begin_checkpoint(run_dir: str | Path, step: int) -> Path:
    """The temporary folder checkpoint ``step`` is assembled in (the same path on every rank).

    Only the main process calls this (it clears a stale folder left by a crash); the others use
    :func:`pending_dir` after a barrier.
    """
    tmp = pending_dir(run_dir, step)
    final = checkpoint_dir(run_dir, step)
    # listed before they exist: overwrite=true removes them, and only them (training.lock: one run per folder)
    record_run_files(run_dir, f"checkpoints/{final.name}", f"checkpoints/{tmp.name}", folders=("checkpoints",))
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def pending_dir(run_dir: str | Path, step: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    return final.parent / f".{final.name}.tmp"


def finish_checkpoint(run_dir: str | Path, step: int, keep: int | None = None) -> Path:
    """Writes the manifest, renames the assembled folder into place, then drops all but the newest ``keep``
    checkpoints (never the one just written)."""
    final = checkpoint_dir(run_dir, step)
    tmp = pending_dir(run_dir, step)
    normalize_modes(tmp)  # safetensors writes its files 0600; a checkpoint reads like the run's other outputs
    write_manifest(tmp)
    replace_dir(tmp, final)  # a re-run of the same step replaces it, still without a window of no checkpoint
    prune_checkpoints(run_dir, keep, spare=final)
    return final


def prune_checkpoints(run_dir: str | Path, keep: int | None, spare: Path | None = None) -> None:
    """Drops all but the newest ``keep`` checkpoints (never ``spare``, the one just written; ``keep`` 0 or None:
    none). After each checkpoint, and at the end of a run (a kill between a checkpoint's rename and its pruning
    left one more)."""
    if keep:
        for stale in list_checkpoints(run_dir)[:-keep]:
            if stale != spare:
                drop_checkpoint(stale)


def drop_checkpoint(path: str | Path) -> None:
    """Removes a checkpoint folder: renamed first to ``.step-NNNNNNN.del`` (no longer a checkpoint, at once), then
    deleted, so a kill while it is deleted never leaves a half-removed folder under a checkpoint's name; the
    hidden one left goes with the next run's :func:`sweep_temporaries`."""
    path = Path(path)
    gone = path.with_name(f".{path.name}.del")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


# the hidden temporaries of common.outputs' atomic writers (.<name>.<pid>.tmp, .<name>.<pid>.old beside <name>) and of
# checkpoints (begin_checkpoint's .step-NNNNNNN.tmp, replace_dir's .old, drop_checkpoint's .del)
_TEMPORARY = re.compile(r"^\.(.+)\.\d+\.(tmp|old)$")
_CHECKPOINT_TEMPORARY = re.compile(r"^\.step-\d{7}\.(tmp|old|del)$")


def sweep_temporaries(run_dir: str | Path) -> list[str]:
    """Removes what writers stopped mid-write without clean-up (SIGKILL, a power cut) left in ``run_dir``: the
    temporaries of the atomic writes of files and folders the run lists (:func:`record_run_files`; for a run
    without the list, :func:`_legacy_run_files`) and the checkpoints' own. Called by the run holding the run
    folder's lock (:mod:`training.lock`) before it writes, so none of them belongs to a live writer. Nothing
    else is touched. Returns what it removed, relative to ``run_dir``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    listed = _read_run_files(run_dir)
    written, _ = listed if listed is not None else _legacy_run_files(run_dir)
    names = {Path(n) for n in (*written, *_FIXED)}
    removed = []
    for folder in sorted({n.parent for n in names} | {Path("checkpoints")}):
        where = run_dir / folder
        if not where.is_dir() or where.is_symlink() or not _inside(where / "x", run_dir):
            continue
        for p in where.iterdir():
            match = _TEMPORARY.match(p.name)
            ours = (match is not None and folder / match.group(1) in names) or (
                folder == Path("checkpoints") and _CHECKPOINT_TEMPORARY.match(p.name) is not None
            )
            if ours:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(str(p.relative_to(run_dir)))
    return sorted(removed)


def save_state(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save``; a full disk (torch's zip writer reports it as a RuntimeError) is an OutputError naming
    ``path`` (exit 4)."""
    from common.errors import OutputError, write_failure

    try:
        torch.save(state, path)
    except (OSError, RuntimeError) as e:
        why = write_failure(e)
        if why is None:
            raise
        raise OutputError(f"could not write {str(path)!r}: {why}") from e


def load_state(path: str | Path) -> dict[str, Any]:
    """A state file of a checkpoint; only tensors, numbers, strings and containers are accepted. A file holding
    anything else (a pickle of objects, which ``weights_only`` refuses) or no readable torch file is a
    BadInputError naming it (exit 2)."""
    import pickle

    from common.errors import BadInputError, unpickling_reason

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        objects, reason = unpickling_reason(e)
        what = (
            "holds objects other than tensors and numbers, which weights_only loading refuses"
            if objects
            else ("is not a readable torch file")
        )
        raise BadInputError(
            f"checkpoint file {str(path)!r} {what} ({reason}); expected a state file this project's training wrote"
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:  # not a zip, truncated, an empty file
        first = " ".join(str(e).split())[:160] or type(e).__name__
        raise BadInputError(
            f"checkpoint file {str(path)!r} is not a readable torch file ({first}); expected a state file this "
            "project's training wrote"
        ) from None
    if not isinstance(state, dict):
        raise BadInputError(f"checkpoint file {str(path)!r} holds a {type(state).__name__}; expected a dict of state")
    return state


def restore_run(
    path: Path, transformer: Any, lora: bool, world: int, rank: int, folder: str = "transformer"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Loads a checkpoint's transformer weights (its ``folder``: ``transformer``, or ``transformer_2`` for an
    A14B low-noise expert) into ``transformer`` (in place; with ``lora`` its ``trainable.safetensors``: adapters
    and new parameters) and returns ``(training_state, rank_state)``.
    Raises ValueError when the checkpoint was written by another number of processes or for another model."""
    from safetensors.torch import load_file

    state = load_state(path / STATE_FILE)
    if state["world_size"] != world:
        raise ValueError(f"checkpoint {path} was written by {state['world_size']} processes, this run has {world}")
    if lora:
        weights = load_file(path / "trainable.safetensors")
    else:
        weights = {}
        files = sorted((path / folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"checkpoint {path} has no {folder}/ weights (was it written for another model.expert?)")
        for f in files:
            weights.update(load_file(f))
    try:
        missing, unexpected = transformer.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a size mismatch: another layout, width or LoRA rank
        first = " ".join(str(e).split())[:400]
        raise ValueError(f"checkpoint {path} does not match this model ({first})") from None
    if unexpected or (not lora and missing):
        raise ValueError(
            f"checkpoint {path} does not match this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return state, load_state(path / f"rank{rank}.pt")


def restore_raw_weights(path: Path, transformer: Any) -> bool:
    """After :func:`restore_run` of a checkpoint written with EMA (its ``transformer/`` holds the averages),
    loads the raw trained values from its ``trainable.safetensors`` into ``transformer``; False when the
    checkpoint has none (written without EMA: ``transformer/`` is already the raw weights)."""
    from safetensors.torch import load_file

    file = Path(path) / "trainable.safetensors"
    if not file.is_file():
        return False
    _, unexpected = transformer.load_state_dict(load_file(file), strict=False)
    if unexpected:
        raise ValueError(f"checkpoint {path} does not match this model: unexpected {unexpected[:3]}")
    return True


def restore_optimizer(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any]
) -> None:
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


def read_metrics(path: str | Path) -> tuple[list[tuple[str, int | float]], bool]:
    """The rows of a run's ``metrics.jsonl`` as ``(line, step)`` and whether its last line is a half-written row
    (a crash mid-append; it is dropped with a warning naming the file). A row is whole only with its line end (it
    is appended in one write with it): a last line without one is half-written even when it parses, else the next
    row would be appended to it. Any other line that is not a JSON object with a numeric ``step`` is a
    BadInputError naming the file and line (exit 2)."""
    from common.errors import BadInputError

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInputError(f"{str(path)!r} is not UTF-8 text (byte {e.start}); expected the run's JSON rows") from None
    lines = text.splitlines()
    rows: list[tuple[str, int | float]] = []
    half = False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        cut_short = number == len(lines) and not text.endswith("\n")  # the row a crash cut short
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
            if cut_short:
                raise ValueError("no line end")
        except ValueError as e:
            if cut_short:
                warnings.warn(
                    f"{str(path)!r}: line {number}, the last, is a half-written row ({e}); dropped, it is redone",
                    stacklevel=3,
                )
                half = True
                continue
            raise BadInputError(
                f"{str(path)!r}: line {number} is not a JSON row ({e}); expected one JSON object per line as the "
                "run wrote them (fix or remove that line, or start a new run_dir)"
            ) from None
        step = row.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int | float):
            raise BadInputError(f"{str(path)!r}: line {number} has step {step!r}; expected a number")
        rows.append((line, step))
    return rows, half


def trim_metrics(path: str | Path, step: int, end_of_run: bool = False) -> int:
    """A resumed run drops the ``metrics.jsonl`` rows logged after its checkpoint's ``step`` (the part of the
    interrupted run that is redone), so every step appears once, and a half-written last row (see
    :func:`read_metrics`). With ``end_of_run`` (a resume from the run's last checkpoint, which redoes only the end
    of the run) also the end-of-run evaluation row at ``step``: a row without a training ``loss`` or a ``probe``,
    logged after that checkpoint. Atomic; returns the number of rows dropped."""
    from common.outputs import write_text_atomic

    path = Path(path)
    if not path.is_file():
        return 0
    rows, half = read_metrics(path)
    kept = [line for line, at in rows if at < step or (at == step and not (end_of_run and _end_row(line)))]
    if len(kept) != len(rows) or half:
        write_text_atomic(path, "".join(x + "\n" for x in kept))
    return len(rows) - len(kept) + int(half)


def _end_row(line: str) -> bool:
    """A ``metrics.jsonl`` row the end of a run logs: its evaluation (neither a step's ``loss`` nor a ``probe``)."""
    row = json.loads(line)
    return "loss" not in row and "probe" not in row


# --------------------------------------------------------------------------- the end of a run


def checkpoint_at(path: str | Path) -> int:
    """The step a checkpoint folder was written at: from its name, else (a folder renamed by hand) its state."""
    path = Path(path)
    if _NAME.match(path.name):
        return checkpoint_step(path)
    return int(load_state(path / STATE_FILE)["step"])


def final_model_dir(run_dir: str | Path, folder: str = "transformer") -> Path:
    return Path(run_dir) / FINAL / folder


def record_final(run_dir: str | Path, folder: str = "transformer") -> None:
    """Lists the final model, a LoRA run's adapters and the marker in the run manifest (overwrite=true removes
    them), before they are written. Main process only."""
    record_run_files(run_dir, f"{FINAL}/{folder}", f"{FINAL}/{LORA}", f"{FINAL}/{FINISHED}", folders=(FINAL,))


def write_finished(run_dir: str | Path, step: int, folder: str = "transformer") -> None:
    """``final/finished.json``, the last thing a run writes: the run ended at ``step`` with its model in
    ``final/<folder>``."""
    from common.outputs import write_text_atomic

    path = Path(run_dir) / FINAL / FINISHED
    write_text_atomic(path, json.dumps({"step": int(step), "model": folder}, indent=1) + "\n")


def read_finished(run_dir: str | Path) -> dict[str, Any] | None:
    """What ``final/finished.json`` says (``step``, ``model``), or None when the run never finished (or the
    file cannot be read: then it is as if it had not finished, with a warning naming it)."""
    path = Path(run_dir) / FINAL / FINISHED
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data.get("step"), bool) or not isinstance(data.get("step"), int):
            raise ValueError(f"step {data.get('step')!r}")
        if not isinstance(data.get("model"), str):
            raise ValueError(f"model {data.get('model')!r}")
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        warnings.warn(f"{str(path)!r} is not readable ({e}); taken as a run that did not finish", stacklevel=2)
        return None
    if not (Path(run_dir) / FINAL / data["model"] / "config.json").is_file():
        return None  # the model it names is gone (removed by hand)
    return data


def final_from_checkpoint(run_dir: str | Path, checkpoint: Path, folder: str = "transformer") -> Path:
    """The final model (and a LoRA run's ``lora/``) copied from ``checkpoint`` (written atomically): for a run
    that saved its last checkpoint and stopped before saving ``final/`` (killed in between)."""
    from common.outputs import atomic_dir, check_replaceable
    from pipelines.loading import MODEL_FILE_PATTERNS

    target = final_model_dir(run_dir, folder)
    record_final(run_dir, folder)
    check_replaceable(target, MODEL_FILE_PATTERNS)
    with atomic_dir(target) as tmp:
        shutil.copytree(checkpoint / folder, tmp, dirs_exist_ok=True)
    if (checkpoint / LORA).is_dir():  # a LoRA run's adapters beside the merged model
        with atomic_dir(Path(run_dir) / FINAL / LORA) as tmp:
            shutil.copytree(checkpoint / LORA, tmp, dirs_exist_ok=True)
    write_finished(run_dir, checkpoint_at(checkpoint), folder)
    return target

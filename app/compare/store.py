"""A comparison result stored and read back: its JSON record, and the example prompts' precomputed results
that ship with a model."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from common.outputs import replace_dir
from common.timing import Timing
from common.video import write_mp4
from pipelines import VARIANTS

from ..models import AppModels
from .engine import CompareResult, VariantRun, run_compare, side_by_side_frames
from .request import CompareRequest, check_request, preset_key

log = logging.getLogger(__name__)

# ---- a result stored and read back (the example prompts' precomputed results) --------------------------


def result_to_dict(result: CompareResult) -> dict:
    """A JSON-ready record of ``result``; videos by file name (they lie beside the record)."""
    req = result.request
    return {
        "request": {**{k: v for k, v in req.__dict__.items() if k != "image"}, "preset": list(req.preset)},
        "device": result.device,
        "random_note": result.random_note,
        "notes": result.notes,
        "interleaved": result.interleaved,
        "load": result.load,
        "measured": result.measured,
        "speed": result.speed,
        "side_by_side": result.side_by_side.name if result.side_by_side else None,
        "runs": [
            {
                **{k: v for k, v in r.__dict__.items() if k not in ("video", "timings")},
                "video": r.video.name if r.video else None,
                "timings": [t.as_dict() for t in r.timings],
            }
            for r in result.runs
        ],
    }


def result_from_dict(record: dict, folder: Path) -> CompareResult:
    """The result :func:`result_to_dict` wrote, its videos looked up in ``folder`` by their bare names."""

    def path(name):
        return None if not name else folder / Path(name).name

    def timing(d: dict) -> Timing:
        return Timing.from_dict(d)

    req = dict(record["request"])
    request = CompareRequest(**{**req, "preset": tuple(req["preset"])})
    runs = [
        VariantRun(**{**r, "video": path(r["video"]), "timings": [timing(t) for t in r["timings"]]})
        for r in record["runs"]
    ]
    return CompareResult(
        request,
        runs,
        record["device"],
        record.get("random_note"),
        list(record.get("notes", [])),
        interleaved=record.get("interleaved", True),
        load=record.get("load", ""),
        side_by_side=path(record.get("side_by_side")),
        measured=record.get("measured", ""),
        speed=record.get("speed", ""),
    )


# ---- precomputed results of the example prompts, stored with the model ---------------------------------
STORED_FILE = "results.json"
STORED_QUALITY = 4  # imageio's 0-10 scale: the stored videos stay small (a few hundred KB for all of them)


def store_examples(
    models: AppModels, folder: Path, prompts: list[str], progress: Callable[[str], None] | None = None
) -> Path:
    """Runs a 4-variant compare at the model's defaults for each prompt and stores the results in ``folder``
    (``results.json`` and small mp4s named ``<example>-<variant>.mp4``), with the machine, load and date they
    were measured on. The page opens with them (:func:`load_stored`)."""

    d = models.components.defaults
    preset = (d["num_frames"], d["height"], d["width"])
    # the new store is built beside the old one and swapped in whole when every example is done: a run that is
    # stopped or fails part-way leaves the stored results (and their videos) as they were
    folder = Path(folder)
    staging = folder.with_name(f".{folder.name}.new")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        _store_into(models, staging, prompts, preset, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_in(staging, folder)
    return folder / STORED_FILE


def _store_into(models: AppModels, staging: Path, prompts: list[str], preset, progress) -> None:
    import datetime as dt

    from common.video import read_video

    d = models.components.defaults
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate(prompts):
            request = check_request(
                models, prompt, "", 0, d["num_inference_steps"], d["guidance_scale"], preset_key(preset), VARIANTS
            )
            if progress is not None:
                progress(f"example {i + 1}/{len(prompts)}: {prompt}")
            result = run_compare(models, request, Path(tmp))
            date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            result.measured = f"measured on {result.device}, {result.load}, {date}"
            for run in result.runs:
                if run.video is not None:
                    small = staging / f"{i}-{run.variant}.mp4"
                    write_mp4(small, read_video(run.video), quality=STORED_QUALITY, comment=f"{run.variant} | {prompt}")
                    run.video = small
            result.side_by_side = None  # a fresh run makes it; stored, it would double the size
            records.append(result_to_dict(result))  # videos by file name: valid in the folder they move to
    (staging / STORED_FILE).write_text(json.dumps({"results": records}, indent=1) + "\n")


def _swap_in(staging: Path, folder: Path) -> None:
    """Puts the complete ``staging`` folder at ``folder``. Files of ``folder`` that are not the store's (anything
    but its mp4s and results file) are carried over; the old folder is removed only after the new one is in
    place (a crash between the two renames leaves it as ``.<name>.old``)."""
    if folder.is_dir():
        for other in folder.iterdir():
            if other.suffix != ".mp4" and other.name != STORED_FILE and not (staging / other.name).exists():
                (shutil.copytree if other.is_dir() else shutil.copy2)(other, staging / other.name)
    replace_dir(staging, folder)


def stored_side_by_side(result: CompareResult, folder: Path, fps: int = 16) -> Path | None:
    """The side-by-side video of a stored result, made from its variants' stored videos into ``folder`` (the
    store keeps only those: the side-by-side would double its size); None when fewer than two videos."""
    from common.video import read_video

    videos = {r.variant: read_video(r.video) for r in result.runs if r.video is not None and r.video.is_file()}
    if len(videos) < 2:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    req = result.request
    return write_mp4(
        folder / "side_by_side.mp4",
        side_by_side_frames(videos),
        fps=fps,
        comment=f"{', '.join(videos)} | seed {req.seed} | {req.prompt} (stored example)",
    )


def load_stored(folder: Path | None) -> dict[str, CompareResult]:
    """The stored results by prompt ({} when there are none, or they cannot be read)."""
    path = None if folder is None else folder / STORED_FILE
    if path is None or not path.is_file():
        return {}
    try:
        records = json.loads(path.read_text())["results"]
        results = [result_from_dict(r, folder) for r in records]
    except (ValueError, KeyError, TypeError) as e:
        log.warning("stored example results in %s cannot be read: %s", folder, e)
        return {}
    return {r.request.prompt: r for r in results if all(x.video is None or x.video.is_file() for x in r.runs)}

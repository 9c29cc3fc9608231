"""Issue 54: ways a fine-tuning run could silently do something other than what was asked, each now refused or
said: a data.path the source ignores, manifest layouts and columns, a run without a saved model, a resume after a
dataset change, clips too short for data.num_frames, a resume of a finished run, a variant that does not match
the --transformer, private checkpoint files, the skipped list, the Ctrl-C note and the eval loss in TensorBoard."""

from __future__ import annotations

import csv
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training.test_training import TINY, finetune, in_process, metrics
from training import checkpoint as ckpt
from training.config import check_data_source, load_config
from world.synthetic import generate_sample, write_mp4


def clip(path: Path, num_frames: int, seed: int = 0) -> None:
    """A small synthetic clip of ``num_frames`` frames (64x64)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_mp4(path, generate_sample(seed, num_frames=num_frames).frames)


def no_model(monkeypatch):
    """Makes loading a model fail the test: what is checked here must stop before any model loads."""
    from training import finetune as ft

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(ft, "build_model", boom)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------- 1: data.path with the synthetic source


def test_a_data_path_with_the_synthetic_source_is_refused_naming_the_sources_that_read_it(tmp_path, monkeypatch):
    no_model(monkeypatch)
    clips = tmp_path / "clips"
    clips.mkdir()
    run = tmp_path / "run"
    proc = finetune(run, f"data.path={clips}", check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"data.path={str(clips)!r} is set but data.source='synthetic'" in proc.stderr
    assert "data.source=folder" in proc.stderr and "data.source=cache" in proc.stderr
    assert not run.exists()  # nothing written
    # the precompute pattern stays valid: its synthetic clips are rendered into the config's cache path
    cfg = load_config(TINY, ["data.source=synthetic", f"data.path={clips}"])
    with pytest.raises(ValueError, match="renders the synthetic world and reads no path"):
        check_data_source(cfg.data)
    check_data_source(load_config(TINY, ["data.source=folder", f"data.path={clips}"]).data)


# --------------------------------------------------------------------------- 2: layouts and columns


def test_layout_and_column_keys_are_checked():
    from training.config import LAYOUTS
    from training.data import LAYOUTS as DATA_LAYOUTS

    assert LAYOUTS == DATA_LAYOUTS
    assert load_config(TINY, ["data.layout=csv"]).data.layout == "csv"
    with pytest.raises(ValueError, match=r"data.layout='xml': expected one of \('auto', 'jsonl', 'csv', 'txt'\)"):
        load_config(TINY, ["data.layout=xml"])
    with pytest.raises(ValueError, match=r"data.video_column=' ': expected null or a manifest column name"):
        load_config(TINY, ["data.video_column=' '"])
    from training.precompute import cache_record  # a cache records which manifest and columns it was read with

    assert cache_record(load_config(TINY, ["data.layout=csv", "data.caption_column=text"]))["data"]["layout"] == "csv"
    assert "layout" not in cache_record(load_config(TINY))["data"]  # earlier caches' records stay matching


@pytest.fixture
def hf_folder(tmp_path) -> Path:
    """Hugging Face's videofolder layout: videos and a metadata.csv (file_name, text), a metadata.jsonl beside
    it with other captions, and a .txt caption beside each video with a third."""
    folder = tmp_path / "hf"
    for i in range(2):
        clip(folder / "videos" / f"v{i}.mp4", 9, seed=i)
        (folder / "videos" / f"v{i}.txt").write_text(f"txt caption {i}")
    with open(folder / "metadata.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file_name", "text", "other"])
        writer.writerows([[f"videos/v{i}.mp4", f"csv caption {i}", "x"] for i in range(2)])
    (folder / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"videos/v{i}.mp4", "text": f"jsonl caption {i}"}) + "\n" for i in range(2))
    )
    return folder


def test_hugging_face_metadata_and_the_layout_key_pick_what_is_read(hf_folder):
    from training.data import build_dataset

    def captions(*overrides):
        cfg = load_config(TINY, ["data.source=folder", f"data.path={hf_folder}", *overrides])
        dataset = build_dataset(cfg.data, cfg.train.seed, cfg.model)
        return sorted(e.caption for e in dataset.entries)

    assert captions() == ["jsonl caption 0", "jsonl caption 1"]  # metadata.jsonl before metadata.csv
    assert captions("data.layout=csv") == ["csv caption 0", "csv caption 1"]
    assert captions("data.layout=txt") == ["txt caption 0", "txt caption 1"]
    assert captions("data.layout=csv", "data.caption_column=other") == ["x", "x"]


def test_named_columns_are_read_and_a_missing_one_is_named(tmp_path):
    from training.data import VideoFolderDataset, build_dataset

    clip(tmp_path / "a.mp4", 9)
    (tmp_path / "list.csv").write_text("clip,description\na.mp4,a red circle\n")
    cfg = load_config(
        TINY,
        [
            "data.source=folder",
            f"data.path={tmp_path / 'list.csv'}",
            "data.video_column=clip",
            "data.caption_column=description",
        ],
    )
    assert [e.caption for e in build_dataset(cfg.data, cfg.train.seed, cfg.model).entries] == ["a red circle"]
    with pytest.raises(ValueError, match=r"no column \['video', 'caption'\].*Hugging Face's 'file_name' and 'text'"):
        VideoFolderDataset(tmp_path / "list.csv")
    with pytest.raises(ValueError, match=r"no column \['caption'\].*data.caption_column=COLUMN"):
        VideoFolderDataset(tmp_path / "list.csv", video_column="clip")


# --------------------------------------------------------------------------- 5: clips too short for num_frames


def short_folder(root: Path, long: int, short: int) -> Path:
    for i in range(long):
        clip(root / f"long{i}.mp4", 17, seed=i)
        (root / f"long{i}.txt").write_text(f"a long clip {i}")
    for i in range(short):
        clip(root / f"short{i}.mp4", 6, seed=10 + i)
        (root / f"short{i}.txt").write_text(f"a short clip {i}")
    return root


def test_most_clips_too_short_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    no_model(monkeypatch)
    data = short_folder(tmp_path / "clips", long=1, short=3)
    run = tmp_path / "run"
    proc = finetune(run, "data.source=folder", f"data.path={data}", check=False)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "data.num_frames=9: 3 of the 4 videos" in err and "too short for a clip of data.num_frames=9" in err
    assert "they have 6-6 frames" in err and "only 1 would train" in err
    assert "lower data.num_frames (data.num_frames=5 fits every readable video)" in err
    assert not (run / "metrics.jsonl").exists()


def test_a_few_clips_too_short_warn_with_the_count(tmp_path):
    from training.data import VideoFolderDataset

    data = short_folder(tmp_path, long=3, short=1)
    dataset = VideoFolderDataset(data, num_frames=9, frame_stride=2)  # 17 frames of the video per clip
    warning = dataset.check_clip_lengths()
    assert warning.startswith("WARNING: 1 of the 4 videos")
    assert "data.frame_stride=2 (17 frames of the video)" in warning and "(3 train)" in warning
    assert "lower data.num_frames (data.num_frames=1 fits every readable video) or data.frame_stride" in warning
    assert dataset.skipped == {"too_few_frames": 1}
    assert VideoFolderDataset(data, num_frames=5).check_clip_lengths() is None
    # a larger dataset: a spread sample is opened (the first and the last of the sorted videos), and it says so
    sampled = VideoFolderDataset(data, num_frames=9, frame_stride=2).check_clip_lengths(limit=2)
    assert sampled.startswith("WARNING: 1 of the 2 videos checked (of 4)"), sampled


# --------------------------------------------------------------------------- 4: resume checks before the model


def fake_checkpoint(tmp_path: Path, **data) -> Path:
    folder = tmp_path / "checkpoints" / "step-0000004"
    folder.mkdir(parents=True)
    state = {"num_samples": 13, "seed": 0, "shuffle": True, "world_size": 1, "samples_consumed": 8, **data}
    ckpt.save_state({"generator": torch.Generator().get_state(), "data": state}, folder / "rank0.pt")
    return folder


def test_a_changed_dataset_is_a_note_and_other_data_changes_are_refused_before_the_model(tmp_path):
    from training.data import ResumableSampler
    from training.finetune import check_resume_data, restore_order

    cfg = load_config(TINY, ["resume=latest"])
    folder = fake_checkpoint(tmp_path)
    notes = check_resume_data(cfg.resume, cfg.train.seed, folder, list(range(14)), None)
    assert len(notes) == 1 and "the dataset changed since step-0000004: 13 clips then, 14 now" in notes[0]
    assert "Resuming at step 4" in notes[0] and "continues from sample 8" in notes[0]
    assert check_resume_data(cfg.resume, cfg.train.seed, folder, list(range(13)), None) == []
    sampler = ResumableSampler(14)
    restore_order(sampler, ckpt.load_state(folder / "rank0.pt")["data"])
    assert sampler.samples_consumed == 8 and sampler.num_samples == 14
    seeded = load_config(TINY, ["resume=latest", "train.seed=5"])
    with pytest.raises(ValueError, match=r"train.seed=5: .* was trained with train.seed=0"):
        check_resume_data(seeded.resume, seeded.train.seed, folder, list(range(13)), None)
    other = fake_checkpoint(tmp_path / "two", world_size=2)
    with pytest.raises(ValueError, match=r"written by 2 process\(es\), this run has 1"):
        check_resume_data(cfg.resume, cfg.train.seed, other, list(range(13)), None)


# --------------------------------------------------------------------------- 7: the CLI's variant against --transformer


@pytest.fixture(scope="module")
def saved_variants(tmp_path_factory):
    from pipelines import convert_self_attention, save_transformer
    from pipelines.tiny import build_tiny_transformer

    root = tmp_path_factory.mktemp("variants")
    save_transformer(build_tiny_transformer(seed=2), root / "flash")
    save_transformer(convert_self_attention(build_tiny_transformer(seed=2), "mhla", options=None), root / "mhla")
    return root


def test_a_converted_transformer_runs_only_as_its_own_variant(saved_variants, tmp_path):
    from pipelines import cli

    def preflight(folder, *variant):
        argv = ["--prompt", "a fox", "--model", "tiny-random", "--transformer", str(folder), *variant]
        return cli._preflight(cli._parse_args([*argv, "--out", str(tmp_path / "x.mp4")]))

    for variant in (["--variant", "flash"], ["--variant", "all"], ["--variant", "mhla,linear"]):
        with pytest.raises(ValueError, match=r"was fine-tuned as variant 'mhla'") as e:
            preflight(saved_variants / "mhla", *variant)
        assert f"--variant {variant[1]}:" in str(e.value) and "Expected --variant mhla" in str(e.value)
    assert [r.variant for r in preflight(saved_variants / "mhla").requests] == ["mhla"]
    assert [r.variant for r in preflight(saved_variants / "mhla", "--variant", "mhla").requests] == ["mhla"]
    # a softmax transformer is converted afresh to whatever is asked
    assert len(preflight(saved_variants / "flash", "--variant", "all").requests) == 4
    out = tmp_path / "refused.mp4"
    argv = ["--prompt", "a fox", "--model", "tiny-random", "--transformer", str(saved_variants / "mhla")]
    proc = in_process(cli.main, [*argv, "--variant", "flash", "--out", str(out)])
    assert proc.returncode == 2 and "fine-tuned as variant 'mhla'" in proc.stderr and not out.exists()


# --------------------------------------------------------------------------- minor: file modes, Ctrl-C


def test_saved_models_and_checkpoints_read_like_other_outputs(saved_variants, tmp_path):
    from safetensors.torch import save_file

    from common.outputs import default_file_mode

    want = default_file_mode()
    for f in (saved_variants / "mhla").iterdir():
        assert mode(f) == want, (f, oct(mode(f)))
    run = tmp_path / "run"
    tmp = ckpt.begin_checkpoint(run, 3)
    save_file({"a": torch.zeros(2)}, tmp / "trainable.safetensors")  # safetensors writes 0600
    ckpt.save_state({"step": 3}, tmp / ckpt.STATE_FILE)
    final = ckpt.finish_checkpoint(run, 3)
    assert {f.name: mode(f) for f in final.iterdir()} == dict.fromkeys(
        ["trainable.safetensors", ckpt.STATE_FILE, ckpt.MANIFEST], want
    )
    assert ckpt.damage(final) is None


def test_an_interrupted_run_names_resume_latest(tmp_path, monkeypatch):
    from training import finetune as ft

    def interrupted(cfg, target=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(ft, "train", interrupted)
    proc = finetune(tmp_path / "run", check=False)
    assert proc.returncode == 130
    assert "the same command with resume=latest" in proc.stderr and "checkpoint.every=15" in proc.stderr
    folder = ckpt.checkpoint_dir(tmp_path / "run", 15)
    folder.mkdir(parents=True)
    (folder / ckpt.MANIFEST).write_text("{}")
    proc = finetune(tmp_path / "run", "resume=latest", check=False)
    assert f"from its newest checkpoint ({folder}) with the same command and resume=latest" in proc.stderr


# --------------------------------------------------------------------------- 3, 6: training runs


def event_tags(run: Path) -> dict[str, list[int]]:
    """TensorBoard scalars of a run: tag -> steps, as TensorBoard shows them (a resume's purge applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "finetune"))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_every_run_ends_with_a_final_model_and_a_finished_run_says_so(tmp_path):
    run = tmp_path / "run"
    finetune(run, "train.steps=2", "checkpoint.every=0", "log.tensorboard=true")
    model = run / "final" / "transformer"
    assert not (run / "checkpoints").exists()
    assert json.loads((run / "final" / "finished.json").read_text()) == {"step": 2, "model": "transformer"}
    from common.outputs import default_file_mode
    from pipelines import load_transformer

    assert all(mode(f) == default_file_mode() for f in model.iterdir())
    assert load_transformer(model, dtype=torch.float32, device="cpu").config["self_attention"]["variant"] == "mhla"
    tags = event_tags(run)
    assert tags["eval_loss"] == [0, 2] and tags["loss"] == [1, 2]
    listed = json.loads((run / ckpt.RUN_MANIFEST).read_text())["written"]
    assert "final/transformer" in listed and "final/finished.json" in listed

    before = (run / "metrics.jsonl").read_bytes()
    again = finetune(run, "train.steps=2", "checkpoint.every=0", "resume=latest")
    assert f"run {str(run)!r} already finished at step 2" in again.stdout
    assert "raise train.steps to train on" in again.stdout and str(model) in again.stdout
    assert (run / "metrics.jsonl").read_bytes() == before
    more = finetune(run, "train.steps=3", "checkpoint.every=0", "resume=latest", check=False)
    assert more.returncode == 2 and "finished at step 2 without a checkpoint to continue from" in more.stderr
    assert f"model.transformer={model}" in more.stderr

    # with checkpoints, keep=1 and a resume that trains on: the final model follows the run
    run = tmp_path / "kept"
    finetune(run, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=1")
    proc = finetune(run, "train.steps=3", "checkpoint.every=1", "checkpoint.keep=1", "resume=latest")
    assert "resumed from" in proc.stdout + proc.stderr
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-0000003"]
    assert json.loads((run / "final" / "finished.json").read_text())["step"] == 3
    before = (run / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in metrics(run) if "eval_loss" in r] == [0, 2, 3]
    # stopped after its last checkpoint, before the end of the run was done (final/finished.json is written last):
    # the resume does the end of the run from that checkpoint, its end-of-run row logged once (issue 53)
    import shutil

    shutil.rmtree(run / "final")
    done = finetune(run, "train.steps=3", "checkpoint.every=1", "checkpoint.keep=1", "resume=latest")
    assert f"resumed from {ckpt.checkpoint_dir(run, 3)} at step 3" in done.stdout + done.stderr
    assert "final model (step 3)" in done.stdout and "already finished" not in done.stdout
    assert (run / "final" / "transformer" / "config.json").is_file()
    assert json.loads((run / "final" / "finished.json").read_text())["step"] == 3
    assert (run / "metrics.jsonl").read_bytes() == before

    # the final model generates with the CLI
    from pipelines.cli import main as generate_main

    out = tmp_path / "final.mp4"
    gen = in_process(
        generate_main,
        ["--prompt", "a red circle", "--model", "tiny-random", "--transformer", str(run / "final" / "transformer")]
        + ["--out", str(out), "--steps", "1", "--no-progress"],
    )
    assert gen.returncode == 0, gen.stderr
    assert out.is_file()


@pytest.mark.slow
def test_a_resume_after_a_caption_is_fixed_continues_with_a_note(tmp_path):
    data = tmp_path / "clips"
    for i in range(3):
        clip(data / f"c{i}.mp4", 11, seed=i)
        if i:
            (data / f"c{i}.txt").write_text(f"clip {i}")
    (data / "c0.txt").write_bytes("un carr\xe9".encode("latin-1"))  # not UTF-8: skipped, named
    run = tmp_path / "run"
    common = ["data.source=folder", f"data.path={data}", "checkpoint.every=2", "train.batch_size=1"]
    finetune(run, *common, "train.steps=2")
    skipped = json.loads((run / "skipped.json").read_text())
    assert skipped["entries"] == 3 and skipped["skipped"] == 1
    assert skipped["by_reason"] == {"bad_caption": [str(data / "c0.txt")]}
    (data / "c0.txt").write_text("clip 0")  # the caption fixed
    proc = finetune(run, *common, "train.steps=4", "resume=latest")
    assert "the dataset changed since step-0000002: 2 clips then, 3 now" in proc.stderr
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3, 4]
    assert ckpt.load_state(ckpt.checkpoint_dir(run, 4) / "rank0.pt")["data"]["num_samples"] == 3
    assert json.loads((run / "skipped.json").read_text())["skipped"] == 0
    assert os.access(run / "final" / "transformer" / "config.json", os.R_OK)
    assert np.isfinite([r["loss"] for r in metrics(run) if "loss" in r]).all()

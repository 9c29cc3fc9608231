"""Folder-of-videos datasets: layouts, clip sampling, resize/crop, bad data, decoders, resumable order."""

from __future__ import annotations

import csv
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from training import data
from training.data import ClipKey, ResumableSampler, VideoFolderDataset, resize_center_crop, validate_num_frames
from world.synthetic import generate_sample, write_dataset, write_mp4

NUM_VIDEOS = 4
BACKENDS = [
    "imageio",
    pytest.param("decord", marks=pytest.mark.skipif(not data.decord_available(), reason="no decord")),
]


@pytest.fixture(scope="module")
def synthetic_folder(tmp_path_factory) -> Path:
    """Four 17-frame 64x64 synthetic clips with manifest.csv, manifest.jsonl and .txt captions."""
    folder = tmp_path_factory.mktemp("synthetic")
    write_dataset(folder, NUM_VIDEOS, seed=3, num_frames=17, height=64, width=64, progress=False)
    return folder


def expected_captions() -> dict[str, str]:
    return {f"train_{i:06d}.mp4": generate_sample(i, seed=3).caption for i in range(NUM_VIDEOS)}


def counting_video(path: Path, num_frames: int, height: int = 32, width: int = 32) -> None:
    """A grey video whose frame i has level 10 * i + 20, so decoded levels tell which frames were taken."""
    levels = 10 * np.arange(num_frames) + 20
    write_mp4(path, np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).astype(np.uint8))


def frame_levels(video: torch.Tensor) -> np.ndarray:
    """Mean level in [0, 255] of each frame of a ``(3, T, H, W)`` clip in [-1, 1]."""
    return ((video.mean(dim=(0, 2, 3)) + 1) * 127.5).numpy()


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("layout", ["auto", "jsonl", "csv", "txt"])
def test_every_layout_loads_videos_with_their_captions(synthetic_folder, layout):
    dataset = VideoFolderDataset(synthetic_folder, layout=layout, num_frames=9, height=32, width=32)
    assert len(dataset) == NUM_VIDEOS
    expected = expected_captions()
    for i in range(NUM_VIDEOS):
        item = dataset[i]
        assert item["caption"] == expected[Path(item["path"]).name]
        assert item["video"].shape == (3, 9, 32, 32) and item["video"].dtype == torch.float32
    assert dataset.skipped == {}
    source = Path(dataset.source)
    assert source == (
        synthetic_folder if layout == "txt" else synthetic_folder / f"manifest.{layout}".replace("auto", "jsonl")
    )


def test_a_manifest_file_can_be_given_directly_with_other_column_names(tmp_path, synthetic_folder):
    manifest = tmp_path / "elsewhere.csv"
    with open(manifest, "w", newline="", encoding="utf-8-sig") as f:  # with a BOM, as spreadsheets write it
        writer = csv.writer(f)
        writer.writerow(["file", "text"])
        for name, caption in expected_captions().items():
            writer.writerow([str(synthetic_folder / "videos" / name), caption])  # absolute paths
    dataset = VideoFolderDataset(manifest, video_column="file", caption_column="text", num_frames=5)
    assert len(dataset) == NUM_VIDEOS and dataset[0]["caption"] == expected_captions()["train_000000.mp4"]
    with pytest.raises(ValueError, match=r"no column \['video', 'caption'\].*found columns \['file', 'text'\]"):
        VideoFolderDataset(manifest)


# --------------------------------------------------------------------------- clips and shapes


@pytest.mark.parametrize("backend", BACKENDS)
def test_frame_count_stride_and_centred_clip(tmp_path, backend):
    counting_video(tmp_path / "count.mp4", 17)
    (tmp_path / "count.txt").write_text("a counting video")
    dataset = VideoFolderDataset(
        tmp_path, num_frames=5, frame_stride=3, height=16, width=24, random_clip=False, backend=backend
    )
    video = dataset[0]["video"]
    assert video.shape == (3, 5, 16, 24)
    # Span 13 of 17 frames, centred: frames 2, 5, 8, 11, 14.
    np.testing.assert_allclose(frame_levels(video), 10 * np.array([2, 5, 8, 11, 14]) + 20, atol=3)


def test_random_clips_are_reproducible_per_epoch_and_vary_across_epochs(tmp_path):
    counting_video(tmp_path / "long.mp4", 41)
    (tmp_path / "long.txt").write_text("a long counting video")
    dataset = VideoFolderDataset(tmp_path, num_frames=5, height=16, width=16, seed=9)
    first_levels = [frame_levels(dataset[ClipKey(0, epoch)]["video"])[0] for epoch in range(6)]
    again = VideoFolderDataset(tmp_path, num_frames=5, height=16, width=16, seed=9)
    assert np.allclose(first_levels, [frame_levels(again[ClipKey(0, e)]["video"])[0] for e in range(6)], atol=0.5)
    assert len({round((level - 20) / 10) for level in first_levels}) > 1, "every epoch took the same clip"
    for epoch in range(6):  # consecutive frames, whatever the start
        assert np.allclose(np.diff(frame_levels(dataset[ClipKey(0, epoch)]["video"])), 10, atol=3)


def test_resize_keeps_aspect_and_crops_the_centre():
    # 48x96 frame: red | green | blue in vertical thirds of 32 columns each... centre half is green.
    frame = np.zeros((1, 48, 96, 3), np.uint8)
    frame[:, :, :24] = (255, 0, 0)
    frame[:, :, 24:72] = (0, 255, 0)
    frame[:, :, 72:] = (0, 0, 255)
    video = resize_center_crop(frame, 24, 24)  # scale 0.5 -> 24x48, keep columns 12..36 = source 24..72
    assert video.shape == (3, 1, 24, 24)
    rgb = (video[:, 0] + 1) * 127.5
    assert torch.all(rgb[1, :, 2:-2] > 250) and torch.all(rgb[0, :, 2:-2] < 5) and torch.all(rgb[2, :, 2:-2] < 5)
    tall = resize_center_crop(np.zeros((2, 100, 30, 3), np.uint8), 32, 48)
    assert tall.shape == (3, 2, 32, 48) and torch.all(tall == -1)


def test_num_frames_must_be_4k_plus_1(synthetic_folder):
    assert validate_num_frames(81) == 81
    for bad in (16, 0, 4):
        with pytest.raises(ValueError, match=rf"4k\+1.*got {bad}"):
            VideoFolderDataset(synthetic_folder, num_frames=bad)


# --------------------------------------------------------------------------- bad data


@pytest.fixture
def messy_folder(tmp_path, synthetic_folder) -> Path:
    """A JSONL manifest over 3 good videos and one of each kind of bad entry."""
    videos = tmp_path / "videos"
    videos.mkdir()
    rows = []
    for i in range(3):
        name = f"good_{i}.mp4"
        (videos / name).write_bytes((synthetic_folder / "videos" / f"train_{i:06d}.mp4").read_bytes())
        rows.append({"video": f"videos/{name}", "caption": f"good video {i}"})
    (videos / "corrupt.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    write_mp4(videos / "short.mp4", generate_sample(0, num_frames=5).frames)
    (videos / "silent.mp4").write_bytes((synthetic_folder / "videos" / "train_000003.mp4").read_bytes())
    rows += [
        {"video": "videos/corrupt.mp4", "caption": "random bytes"},
        {"video": "videos/short.mp4", "caption": "only five frames"},
        {"video": "videos/silent.mp4", "caption": "   "},
        {"video": "videos/gone.mp4", "caption": "a file that is not there"},
    ]
    with open(tmp_path / "manifest.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write("{not json\n")
    return tmp_path


EXPECTED_SKIPS = {"unreadable": 1, "too_few_frames": 1, "empty_caption": 1, "missing_file": 1, "bad_manifest_row": 1}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_videos_are_skipped_counted_and_the_run_continues(messy_folder, num_workers):
    dataset = VideoFolderDataset(messy_folder, num_frames=17, height=32, width=32)
    assert len(dataset) == 5  # corrupt and short ones are only found when decoded
    loader = DataLoader(dataset, batch_size=2, num_workers=num_workers, shuffle=False)
    batches = list(loader)
    assert [len(b["caption"]) for b in batches] == [2, 2, 1]  # every batch full: bad videos were replaced
    assert all(caption.startswith("good video") for b in batches for caption in b["caption"])
    assert all(b["video"].shape[1:] == (3, 17, 32, 32) for b in batches)
    assert dataset.skipped == EXPECTED_SKIPS  # counts from worker processes reach the main one
    summary = dataset.skip_summary()
    assert summary.startswith("skipped 5 of 8 entries")
    for reason, name in [
        ("unreadable", "corrupt.mp4"),
        ("too_few_frames", "short.mp4"),
        ("empty_caption", "silent.mp4"),
        ("missing_file", "gone.mp4"),
    ]:
        assert reason in summary and name in summary
    assert sum(dataset.skipped.values()) == 5  # a bad video is counted once, however often it is drawn
    list(loader)
    assert dataset.skipped == EXPECTED_SKIPS


def test_all_videos_bad_at_decode_time_raises_with_the_summary(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"\x00" * 100)
    (tmp_path / "a.txt").write_text("zeros")
    dataset = VideoFolderDataset(tmp_path, num_frames=5)
    with pytest.raises(RuntimeError, match=r"every video in .* failed to load.*unreadable 1 \(.*a\.mp4\)"):
        dataset[0]


def test_missing_or_empty_datasets_raise_before_training_with_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=rf"dataset path {missing} does not exist; expected a folder"):
        VideoFolderDataset(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"no videos \(.mp4.*\) found under {empty}"):
        VideoFolderDataset(empty)
    header_only = tmp_path / "header.csv"
    header_only.write_text("video,caption\n")
    with pytest.raises(ValueError, match=rf"manifest {header_only} has no rows"):
        VideoFolderDataset(header_only)
    dangling = tmp_path / "dangling.jsonl"
    dangling.write_text(json.dumps({"video": "missing/clip.mp4", "caption": "x"}) + "\n")
    with pytest.raises(ValueError, match=rf"no usable videos in {dangling}.*missing_file: .*missing/clip.mp4"):
        VideoFolderDataset(dangling)
    with pytest.raises(
        FileNotFoundError, match=r"layout='csv' but .* holds none of \['manifest.csv', 'metadata.csv'\]"
    ):
        VideoFolderDataset(empty, layout="csv")


# --------------------------------------------------------------------------- decoders


@pytest.mark.skipif(not data.decord_available(), reason="no decord")
def test_decord_and_imageio_decode_the_same_clip(synthetic_folder):
    kwargs = dict(num_frames=9, frame_stride=2, height=48, width=64, seed=1)
    by_decord = VideoFolderDataset(synthetic_folder, backend="decord", **kwargs)[ClipKey(1, 3)]
    by_imageio = VideoFolderDataset(synthetic_folder, backend="imageio", **kwargs)[ClipKey(1, 3)]
    assert by_decord["path"] == by_imageio["path"]
    assert (by_decord["video"] - by_imageio["video"]).abs().mean() < 0.02


def test_without_decord_auto_falls_back_to_imageio(synthetic_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "decord", None)  # makes `import decord` raise ImportError
    assert not data.decord_available()
    assert data.resolve_backend("auto") == "imageio"
    with pytest.raises(ImportError, match="decord is not installed"):
        data.resolve_backend("decord")
    dataset = VideoFolderDataset(synthetic_folder, num_frames=5, height=32, width=32)
    assert dataset.backend == "imageio" and dataset[2]["video"].shape == (3, 5, 32, 32)
    with pytest.raises(ValueError, match="backend must be one of .* got 'opencv'"):
        VideoFolderDataset(synthetic_folder, backend="opencv")


# --------------------------------------------------------------------------- resumable order


def test_sampler_resumes_mid_epoch_exactly_where_it_stopped():
    full = ResumableSampler(10, seed=4, num_epochs=3)
    keys = list(full)
    assert len(keys) == len(full) == 30
    assert [sorted(k.index for k in keys[e * 10 : (e + 1) * 10]) for e in range(3)] == [list(range(10))] * 3
    assert [k.index for k in keys[:10]] != [k.index for k in keys[10:20]]  # reshuffled each epoch
    state = full.state_dict(samples_consumed=13)
    resumed = ResumableSampler(10, seed=4, num_epochs=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert list(resumed) == keys[13:]
    endless = iter(ResumableSampler(10, seed=4, samples_consumed=25))
    four_epochs = list(ResumableSampler(10, seed=4, num_epochs=4))
    assert four_epochs[:30] == keys
    assert [next(endless) for _ in range(10)] == four_epochs[25:35]  # runs on into epoch 3
    with pytest.raises(ValueError, match="checkpoint has seed=4, this run has 5"):
        ResumableSampler(10, seed=5).load_state_dict(state)


def test_sampler_ranks_share_out_each_epoch():
    ranks = [list(ResumableSampler(7, seed=1, rank=r, world_size=3, num_epochs=1)) for r in range(3)]
    assert [len(r) for r in ranks] == [3, 3, 3]  # padded by wrapping, like DistributedSampler
    assert {k.index for r in ranks for k in r} == set(range(7))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_dataloader_yields_the_same_clips(synthetic_folder, num_workers):
    dataset = VideoFolderDataset(synthetic_folder, num_frames=5, height=16, width=16, seed=2)

    def batches(samples_consumed: int, count: int) -> list[dict]:
        sampler = ResumableSampler(len(dataset), seed=7, samples_consumed=samples_consumed)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=num_workers)
        return list(itertools.islice(loader, count))

    uninterrupted = batches(0, 5)
    resumed = batches(3 * 2, 2)  # stopped after 3 steps of batch 2
    for a, b in zip(uninterrupted[3:], resumed, strict=True):
        assert a["caption"] == b["caption"] and torch.equal(a["video"], b["video"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_finds_bad_videos_before_training(messy_folder, backend):
    dataset = VideoFolderDataset(messy_folder, num_frames=17, height=32, width=32, backend=backend)
    assert dataset.skipped == {"empty_caption": 1, "missing_file": 1, "bad_manifest_row": 1}
    assert dataset.probe() == EXPECTED_SKIPS
    assert dataset[3]["caption"] == "good video 0"  # index 3 is the corrupt video: wraps to the next good one
    for i in range(3):
        (messy_folder / "videos" / f"good_{i}.mp4").write_bytes(b"gone bad")
    with pytest.raises(ValueError, match=r"no usable videos in .*manifest.jsonl.*unreadable 4"):
        VideoFolderDataset(messy_folder, num_frames=17, backend=backend).probe()


# --------------------------------------------------------------------------- bad data at the entry points

TINY_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "finetune" / "tiny.yaml")


@pytest.mark.slow  # runs the precompute CLI
def test_precompute_leaves_unreadable_videos_out_instead_of_repeating_a_good_one(messy_folder, tmp_path, capsys):
    from training import precompute

    cache = tmp_path / "cache"
    argv = ["--config", TINY_CONFIG, "--out", str(cache), "data.source=folder", f"data.path={messy_folder}"]
    assert precompute.main(argv) == 0
    items = json.loads((cache / "index.json").read_text())["items"]
    captions = [it["caption"] for it in items]
    assert sorted(captions) == ["good video 0", "good video 1", "good video 2"]  # each once, nothing substituted
    assert "unreadable" in capsys.readouterr().out


def test_a_dataset_with_no_usable_video_stops_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from training import finetune, precompute

    (tmp_path / "a.mp4").write_bytes(np.random.default_rng(1).bytes(2048))
    (tmp_path / "a.txt").write_text("random bytes, not a video")

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(precompute, "load_components", boom)
    monkeypatch.setattr(finetune, "build_model", boom)
    data = ["data.source=folder", f"data.path={tmp_path}"]
    assert precompute.main(["--config", TINY_CONFIG, "--out", str(tmp_path / "cache"), *data]) == 2
    assert f"no usable videos in {tmp_path}" in capsys.readouterr().err
    run = ["--config", TINY_CONFIG, f"run_dir={tmp_path / 'run'}", "log.tensorboard=false", *data]
    assert finetune.main(run) == 2
    assert f"no usable videos in {tmp_path}" in capsys.readouterr().err

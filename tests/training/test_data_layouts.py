"""Issue 54 (2): the data layouts people have. Images as one-frame samples from a folder (joint image-video training's
own mechanism: data.image_ratio with data.image_path), a trigger word, several datasets with repeats, and frames
taken at a target frame rate from clips of mixed sizes, frame rates and lengths."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.training.test_training import TINY, finetune, in_process, metrics
from training.config import check_data_source, load_config
from training.data import ImageFolderDataset, VideoFolderDataset, build_dataset
from world.synthetic import write_mp4


def counting_clip(path: Path, num_frames: int, fps: float, height: int = 32, width: int = 32) -> None:
    """A grey clip whose frame i has level 20 + 6 * i (up to 39 frames), so decoded levels tell which frames were taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    levels = 20 + 6 * np.arange(num_frames)
    frames = np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).astype(np.uint8)
    write_mp4(path, frames, fps=fps)


def frame_numbers(video: torch.Tensor) -> list[int]:
    """Which source frames of a counting clip a ``(3, T, H, W)`` clip in [-1, 1] holds."""
    levels = ((video.mean(dim=(0, 2, 3)) + 1) * 127.5).numpy()
    return [round((level - 20) / 6) for level in levels]


def image(path: Path, caption: str | None, size=(40, 60), seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)


def clips_of_mixed_sizes_rates_and_lengths(folder: Path) -> list[tuple[str, int, float, int, int]]:
    """A user's folder: clips of several sizes, frame rates and lengths, a .txt caption beside each."""
    made = [
        ("wide_24fps.mp4", 30, 24.0, 64, 112),  # 1.25 s
        ("small_30fps.mp4", 36, 30.0, 48, 64),  # 1.2 s
        ("square_25fps.mp4", 26, 25.0, 64, 64),  # 1.04 s
        ("tall_15fps.mp4", 20, 15.0, 96, 64),  # 1.33 s
    ]
    for name, frames, fps, height, width in made:
        counting_clip(folder / name, frames, fps, height, width)
        (folder / name).with_suffix(".txt").write_text(f"a grey clip {name.split('_')[0]}")
    return made


@pytest.fixture(scope="module")
def user_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("user")
    clips_of_mixed_sizes_rates_and_lengths(root / "clips")
    counting_clip(root / "more" / "long_30fps.mp4", 38, 30.0)
    (root / "more" / "long_30fps.txt").write_text("a long grey clip")
    image(root / "images" / "a.png", "a red square", seed=1)
    image(root / "images" / "b.jpg", "a blue circle", (64, 48), seed=2)
    image(root / "images" / "nested" / "c.webp", "a green triangle", (30, 30), seed=3)
    image(root / "images" / "no_caption.png", None, seed=4)
    (root / "images" / "broken.png").write_bytes(b"not a png at all")
    (root / "images" / "broken.txt").write_text("a broken image")
    return {"root": root, "clips": root / "clips", "more": root / "more", "images": root / "images"}


# --------------------------------------------------------------------------- images from a folder


def test_a_folder_of_images_gives_one_frame_samples_with_their_captions(user_data):
    images = ImageFolderDataset(user_data["images"], height=32, width=48, trigger_word="sks")
    assert len(images) == 4  # broken.png opens as nothing only when read
    assert images.skipped == {"missing_caption": 1}
    captions = set()
    for i in range(len(images)):
        item = images[i]
        assert item["video"].shape == (3, 1, 32, 48) and item["video"].abs().max() <= 1
        captions.add(item["caption"])
    # the broken image was replaced by the next good one, and is counted
    assert captions == {"sks, a red square", "sks, a blue circle", "sks, a green triangle"}
    assert images.skipped == {"missing_caption": 1, "unreadable": 1}
    assert "broken.png" in images.skip_summary()


def test_an_image_manifest_in_the_hugging_face_layout_is_read(tmp_path):
    image(tmp_path / "x.png", None)
    image(tmp_path / "y.webp", None, seed=5)
    with open(tmp_path / "metadata.csv", "w", newline="") as f:
        csv.writer(f).writerows([["file_name", "text"], ["x.png", "a red square"], ["y.webp", "a blue disc"]])
    images = ImageFolderDataset(tmp_path, height=16, width=16)
    assert sorted(images[i]["caption"] for i in range(2)) == ["a blue disc", "a red square"]
    (tmp_path / "metadata.csv").write_text("picture,words\nx.png,a\n")
    with pytest.raises(ValueError, match=r"no column \['image', 'caption'\].*name them 'image' or 'file_name'"):
        ImageFolderDataset(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no images \(.png, .jpg, .jpeg, .webp\) found under"):
        ImageFolderDataset(empty)


def test_image_path_with_a_folder_source_is_the_joint_training_images(user_data):
    clips, images = user_data["clips"], user_data["images"]
    folder = ["data.source=folder", f"data.path={clips}", "data.image_ratio=1"]
    cfg = load_config(TINY, [*folder, f"data.image_path={images}", "data.height=32", "data.width=48"])
    image_set = build_dataset(cfg.data, cfg.train.seed, cfg.model, images=True)
    assert isinstance(image_set, ImageFolderDataset) and image_set[0]["video"].shape == (3, 1, 32, 48)
    # without data.image_path there are no images: said with what would give them
    with pytest.raises(ValueError, match=r"data.image_ratio=1: expected 0 with data.source=folder unless "):
        load_config(TINY, folder)
    with pytest.raises(ValueError, match=r"data.image_path='.*nowhere': expected an existing cache folder of images"):
        load_config(TINY, [*folder, f"data.image_path={images / 'nowhere'}"])
    # the synthetic world renders its own stills: a path beside it would be ignored, so it is refused
    synthetic = load_config(TINY, [f"data.image_path={images}", "data.image_ratio=1"])
    with pytest.raises(ValueError, match=r"data.image_path=.* renders the world's stills and reads no path"):
        check_data_source(synthetic.data)


def test_precompute_images_from_a_folder_is_refused_without_the_folder(user_data, tmp_path):
    from training.precompute import main

    argv = ["--config", TINY, "--out", str(tmp_path / "cache"), "--images", "data.source=folder"]
    proc = in_process(main, [*argv, f"data.path={user_data['clips']}"])
    assert proc.returncode == 2 and "--images with data.source=folder reads data.image_path" in proc.stderr


# --------------------------------------------------------------------------- trigger word, several datasets


def test_a_trigger_word_goes_in_front_of_every_caption_once(user_data, tmp_path):
    dataset = VideoFolderDataset(user_data["clips"], num_frames=5, height=16, width=16, trigger_word="sks")
    assert {e.caption for e in dataset.entries} == {
        "sks, a grey clip wide",
        "sks, a grey clip small",
        "sks, a grey clip square",
        "sks, a grey clip tall",
    }
    counting_clip(tmp_path / "has.mp4", 9, 16)
    (tmp_path / "has.txt").write_text("a sks clip already named")
    assert (
        VideoFolderDataset(tmp_path, num_frames=5, trigger_word="sks").entries[0].caption == "a sks clip already named"
    )
    folder = ["data.source=folder", f"data.path={user_data['clips']}"]
    assert load_config(TINY, [*folder, "data.trigger_word=sks"]).data.trigger_word == "sks"
    with pytest.raises(ValueError, match=r"data.trigger_word='sks': expected null with data.source='synthetic'"):
        load_config(TINY, ["data.trigger_word=sks"])
    with pytest.raises(ValueError, match=r"data.trigger_word=.*expected null with data.source='cache'.*precompute"):
        load_config(TINY, ["data.source=cache", f"data.path={tmp_path}", "data.trigger_word=sks"])
    with pytest.raises(ValueError, match=r"data.trigger_word=' sks': expected null or a word"):
        load_config(TINY, [*folder, "data.trigger_word=' sks'"])


def test_several_datasets_with_repeats_are_one_dataset(user_data):
    clips, more = user_data["clips"], user_data["more"]
    dataset = VideoFolderDataset(clips, num_frames=5, height=16, width=16, extra=[(more, 3)], random_clip=True)
    assert len(dataset) == 4 + 3 and len(dataset.entries) == 5
    assert dataset.source == f"{clips} + {more} (x3)"
    # the three copies of the long clip are three samples, each with its own clip of it
    copies = [dataset[i] for i in range(4, 7)]
    assert {c["caption"] for c in copies} == {"a long grey clip"}
    starts = {frame_numbers(c["video"])[0] for c in copies}
    assert len(starts) > 1, starts
    # without repeats the order and clips are those of one folder, as before
    alone = VideoFolderDataset(clips, num_frames=5, height=16, width=16)
    torch.testing.assert_close(alone[2]["video"], dataset[2]["video"], rtol=0, atol=0)

    folder = ["data.source=folder", f"data.path={clips}"]
    cfg = load_config(TINY, [*folder, f"data.extra=[{{path: {more}, repeats: 3}}]", "data.repeats=2"])
    assert len(build_dataset(cfg.data, cfg.train.seed, cfg.model)) == 2 * 4 + 3
    bad = {
        "data.extra=[{repeats: 2}]": r"data.extra\[0\].path=None: expected an existing folder",
        f"data.extra=[{{path: {more / 'gone'}}}]": r"data.extra\[0\].path='.*gone': expected an existing folder",
        f"data.extra=[{{path: {more}, repeats: 0}}]": r"data.extra\[0\].repeats=0: expected an integer >= 1",
        f"data.extra=[{{path: {more}, weight: 2}}]": r"data.extra\[0\]: unknown key\(s\) \['weight'\]",
        f"data.extra=[{more}]": r"data.extra\[0\]=.*expected a mapping like \{path: DIR, repeats: 2\}",
        "data.repeats=0": r"data.repeats=0: expected a value >= 1",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError, match=message):
            load_config(TINY, [*folder, override])
    with pytest.raises(ValueError, match=r"data.extra=.*expected \[\] with data.source='synthetic'"):
        load_config(TINY, [f"data.extra=[{{path: {more}}}]"])


# --------------------------------------------------------------------------- frame rate


def test_frames_are_taken_at_the_target_rate_whatever_the_clips_own(tmp_path):
    counting_clip(tmp_path / "thirty.mp4", 31, 30.0)
    counting_clip(tmp_path / "fifteen.mp4", 16, 15.0)
    for name in ("thirty", "fifteen"):
        (tmp_path / f"{name}.txt").write_text(name)
    at_15 = VideoFolderDataset(tmp_path, num_frames=5, height=16, width=16, fps=15, random_clip=False)
    by_name = {Path(at_15[i]["path"]).stem: frame_numbers(at_15[i]["video"]) for i in range(2)}
    thirty, fifteen = by_name["thirty"], by_name["fifteen"]
    assert np.diff(thirty).tolist() == [2, 2, 2, 2] and np.diff(fifteen).tolist() == [1, 1, 1, 1]
    strided = VideoFolderDataset(tmp_path, num_frames=5, height=16, width=16, random_clip=False)
    assert all(np.diff(frame_numbers(strided[i]["video"])).tolist() == [1, 1, 1, 1] for i in range(2))
    # 24 fps from 30: the frame nearest each 1/24 s step (1.25 frames): one step in four skips a frame
    at_24 = VideoFolderDataset(tmp_path, num_frames=9, fps=24, random_clip=False)
    thirty = next(at_24[i] for i in range(2) if Path(at_24[i]["path"]).stem == "thirty")
    steps = np.diff(frame_numbers(thirty["video"])).tolist()
    assert sorted(steps) == [1, 1, 1, 1, 1, 1, 2, 2], steps


def test_clips_too_short_at_the_target_rate_are_counted_with_the_rate(tmp_path):
    for i in range(3):
        counting_clip(tmp_path / f"short_{i}.mp4", 12, 30.0)  # 0.37 s
        (tmp_path / f"short_{i}.txt").write_text("short")
    counting_clip(tmp_path / "long.mp4", 40, 30.0)  # 1.3 s
    (tmp_path / "long.txt").write_text("long")
    dataset = VideoFolderDataset(tmp_path, num_frames=9, fps=16)  # 0.5 s
    with pytest.raises(
        ValueError, match=r"data.num_frames=9: 3 of the 4 videos .* data.fps=16 \(0.50 s of the video\)"
    ) as e:
        dataset.check_clip_lengths()
    # 12 frames at 30 fps hold 11 / 30 s: 6 frames at 16 fps, so 5 (4k+1) fit
    assert "data.num_frames=5 fits every readable video" in str(e.value) and "or data.fps" in str(e.value)
    folder = ["data.source=folder", f"data.path={tmp_path}"]
    with pytest.raises(ValueError, match=r"data.fps=16: expected null with data.frame_stride=2"):
        load_config(TINY, [*folder, "data.fps=16", "data.frame_stride=2"])
    with pytest.raises(ValueError, match=r"data.fps=0: expected a value > 0"):
        load_config(TINY, [*folder, "data.fps=0"])
    with pytest.raises(ValueError, match=r"data.fps=16: expected null with data.source='synthetic'"):
        load_config(TINY, ["data.fps=16"])


def test_clips_of_mixed_sizes_rates_and_lengths_all_give_clips_of_the_asked_size(user_data):
    dataset = VideoFolderDataset(user_data["clips"], num_frames=9, height=32, width=48, fps=8)  # 1 s at 8 fps
    assert dataset.check_clip_lengths() is None
    for i in range(len(dataset)):
        item = dataset[i]
        assert item["video"].shape == (3, 9, 32, 48)
        steps = set(np.diff(frame_numbers(item["video"])).tolist())
        native = {"wide": 24, "small": 30, "square": 25, "tall": 15}[item["caption"].split()[-1]]
        assert all(abs(s - native / 8) <= 1 for s in steps), (item["caption"], steps)


# --------------------------------------------------------------------------- the recipe end to end


@pytest.mark.slow
def test_a_run_on_clips_of_two_folders_and_a_folder_of_images(user_data, tmp_path):
    run = tmp_path / "run"
    proc = finetune(
        run,
        "data.source=folder",
        f"data.path={user_data['clips']}",
        f"data.extra=[{{path: {user_data['more']}, repeats: 2}}]",
        f"data.image_path={user_data['images']}",
        "data.image_ratio=1",
        "data.trigger_word=sks",
        "data.fps=12",
        "train.steps=2",
        "checkpoint.every=2",
    )
    assert (
        "joint image-video training: 2 images (1x4x6 tokens) beside each step's 2 clips, from 4 images" in proc.stdout
    )
    rows = [r for r in metrics(run) if "loss" in r]
    assert len(rows) == 2 and all(r["image_loss"] > 0 for r in rows)
    assert "missing_caption 1" in proc.stderr  # the image without a caption, named before training
    skipped = json.loads((run / "skipped.json").read_text())
    assert skipped["entries"] == 5 and f"{user_data['more']} (x2)" in skipped["source"]


@pytest.mark.slow
def test_precompute_caches_a_folder_of_images_that_trains_beside_cached_clips(user_data, tmp_path):
    from training.precompute import main

    common = ["data.source=folder", f"data.path={user_data['clips']}", "data.trigger_word=sks", "data.fps=12"]
    stills, clips = tmp_path / "stills", tmp_path / "clips"
    done = in_process(
        main, ["--config", TINY, "--out", str(stills), "--images", *common, f"data.image_path={user_data['images']}"]
    )
    assert done.returncode == 0, done.stderr
    index = json.loads((stills / "index.json").read_text())
    assert index["video"] == [1, 64, 96] and len(index["items"]) == 3  # the broken image left out, and counted
    assert all(item["caption"].startswith("sks, ") for item in index["items"])
    assert "unreadable 1" in done.stdout
    record = json.loads((stills / "precompute.json").read_text())["data"]
    assert record["image_path"] == str(user_data["images"]) and record["trigger_word"] == "sks"
    assert in_process(main, ["--config", TINY, "--out", str(clips), *common]).returncode == 0
    run = tmp_path / "run"
    cached = ["data.source=cache", f"data.path={clips}", f"data.image_path={stills}", "data.image_ratio=1"]
    finetune(run, *cached, "train.steps=1", "checkpoint.every=1")
    assert all("image_loss" in r for r in metrics(run) if "loss" in r)


# --------------------------------------------------------------------------- length buckets


def test_clips_too_short_for_num_frames_train_at_the_longest_length_they_hold(tmp_path):
    from training.data import batch_groups, collate

    for name, frames in (("long", 20), ("seven", 7), ("six", 6), ("three", 3)):
        counting_clip(tmp_path / f"{name}.mp4", frames, 16)
        (tmp_path / f"{name}.txt").write_text(name)
    skipping = VideoFolderDataset(tmp_path, num_frames=9)
    with pytest.raises(ValueError, match=r"3 of the 4 videos .* or set data.min_frames \(shorter videos then train"):
        skipping.check_clip_lengths()
    dataset = VideoFolderDataset(tmp_path, num_frames=9, min_frames=5, height=16, width=16)
    warning = dataset.check_clip_lengths()
    assert "1 of the 4 videos" in warning and "a clip of data.min_frames=5 at data.frame_stride=1 (5 frames" in warning
    lengths = {
        dataset[i]["caption"]: dataset[i]["video"].shape[1] for i in range(4) if dataset[i]["caption"] != "three"
    }
    assert lengths == {"long": 9, "seven": 5, "six": 5}
    assert dataset.skipped == {"too_few_frames": 1}
    (tmp_path / "three.mp4").unlink()
    note = VideoFolderDataset(tmp_path, num_frames=9, min_frames=5).check_clip_lengths()
    assert note.startswith("note: 2 of the 3 videos") and "train at 5-5 frames" in note, note
    # a batch of two lengths: one group per length, longest first
    batch = collate([dataset[0], dataset[1], dataset[2]])
    groups = batch_groups(batch)
    assert [g["video"].shape[2] for g in groups] == [9, 5] and sum(len(g["caption"]) for g in groups) == 3
    assert batch_groups(collate([dataset[1], dataset[2]]))[0]["video"].shape[0] == 2  # one length: as before

    folder = ["data.source=folder", f"data.path={tmp_path}"]
    with pytest.raises(ValueError, match=r"data.min_frames=7: expected null or 4k\+1 \(e.g. 5, 9\) at most"):
        load_config(TINY, [*folder, "data.min_frames=7"])
    with pytest.raises(ValueError, match=r"data.min_frames=13: expected null or 4k\+1 .* data.num_frames=9"):
        load_config(TINY, [*folder, "data.min_frames=13"])
    with pytest.raises(ValueError, match=r"data.min_frames=5: expected null with data.source='synthetic'"):
        load_config(TINY, ["data.min_frames=5"])


@pytest.mark.slow
def test_a_run_and_a_cache_with_clips_of_several_lengths(tmp_path):
    from training.precompute import main

    clips = tmp_path / "clips"
    for i, frames in enumerate((12, 12, 7, 6, 30)):
        counting_clip(clips / f"c{i}.mp4", frames, 16, 64, 96)
        (clips / f"c{i}.txt").write_text(f"clip {i}")
    data = ["data.source=folder", f"data.path={clips}", "data.min_frames=5"]
    run = tmp_path / "run"
    proc = finetune(run, *data, "train.steps=3", "checkpoint.every=3", "train.batch_size=3")
    assert "note: 2 of the 5 videos" in proc.stderr and "train at 5-5 frames" in proc.stderr
    rows = [r for r in metrics(run) if "loss" in r]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
    cache = tmp_path / "cache"
    done = in_process(main, ["--config", TINY, "--out", str(cache), *data])
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    frames = sorted(load_file(p)["latents"].shape[1] for p in cache.glob("sample_*.safetensors"))
    assert frames == [2, 2, 3, 3, 3]  # 5 frames -> 2 latent frames, 9 -> 3
    finetune(tmp_path / "cached", "data.source=cache", f"data.path={cache}", "train.steps=2", "train.batch_size=3")

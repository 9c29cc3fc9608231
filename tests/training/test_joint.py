"""Joint image-video training (``data.image_ratio``): one-frame stills of the synthetic world beside each step's
clips, from the world on the fly or from a precomputed cache of images; the run resumes exactly."""

import json

import numpy as np
import pytest
import torch

from tests.training.test_training import TINY, digest, finetune, metrics, precompute
from training import checkpoint as ckpt
from training.config import load_config
from world.synthetic import MOTION_PHRASES, SyntheticVideoDataset, image_attributes, sample_attributes, world_named


def test_images_are_stills_of_the_world_whose_captions_name_no_motion():
    world = world_named("v3")
    images = SyntheticVideoDataset(24, seed=5, num_frames=1, height=64, width=80, world=world, images=True)
    clips = SyntheticVideoDataset(24, seed=5, num_frames=9, height=64, width=80, world=world)
    words = {w for phrase in MOTION_PHRASES.values() for w in phrase.split()} - {"to", "the", "and"}
    for i in range(len(images)):
        item = images[i]
        assert item["video"].shape == (3, 1, 64, 80)
        assert not set(item["caption"].split()) & words, item["caption"]
        attributes = images.attributes(i)
        for obj in attributes["objects"]:
            assert obj["motion"] is None and obj["start"] == obj["end"]
            assert obj["shape"] in item["caption"] and obj["colour"] in item["caption"]
        # the object is drawn: pixels of its colour away from the background's grey levels
        frame = item["video"][:, 0]
        saturation = (frame.max(0).values - frame.min(0).values).gt(0.5).float().mean()
        assert saturation > 0.05, (i, float(saturation))
    assert images[3]["caption"] == images[3]["caption"]  # deterministic
    torch.testing.assert_close(images[3]["video"], images[3]["video"], rtol=0, atol=0)
    # other scenes than the clips of the same seed, not the clips' first frames
    same = sum(
        images.attributes(i)["objects"][0]["shape"] == clips.attributes(i)["objects"][0]["shape"]
        and images.attributes(i)["objects"][0]["colour"] == clips.attributes(i)["objects"][0]["colour"]
        for i in range(len(images))
    )
    assert same < len(images) // 2


def test_an_image_lies_on_its_clips_path_at_a_drawn_time():
    world = world_named("v3")
    from world.synthetic import IMAGE_INDEX_OFFSET

    for i in range(20):
        still = image_attributes(0, i, "train", world, aspect=1.25)["objects"][0]
        moving = sample_attributes(0, IMAGE_INDEX_OFFSET + i, "train", world, aspect=1.25)["objects"][0]
        # on the straight segment from start to end (every v3 motion is straight or static)
        a, b = np.asarray(moving["start"], float), np.asarray(moving["end"], float)
        p, seg = np.asarray(still["start"], float), b - a
        t = 0.0 if not seg.any() else float(np.clip((p - a) @ seg / (seg @ seg), 0, 1))
        assert np.abs(a + t * seg - p).max() < 1e-3, (i, moving, still)


def test_an_image_dataset_is_one_frame():
    with pytest.raises(ValueError, match="one frame, got num_frames=9"):
        SyntheticVideoDataset(4, num_frames=9, images=True)


def test_image_settings_are_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"data.image_ratio=1.0: expected 0 with data.source=folder"):
        load_config(TINY, ["data.source=folder", f"data.path={tmp_path}", "data.image_ratio=1.0"])
    with pytest.raises(ValueError, match=r"data.image_path=None: expected a cache of images"):
        load_config(TINY, ["data.source=cache", f"data.path={tmp_path}", "data.image_ratio=1.0"])
    with pytest.raises(ValueError, match=r"data.image_ratio=-1: expected a value >= 0"):
        load_config(TINY, ["data.image_ratio=-1"])
    with pytest.raises(ValueError, match=r"data.image_path='.*nowhere': expected an existing cache folder"):
        load_config(TINY, [f"data.image_path={tmp_path / 'nowhere'}"])


@pytest.mark.slow
def test_joint_training_logs_both_losses_and_resumes_exactly(tmp_path):
    steps = ["train.steps=6", "checkpoint.every=3", "checkpoint.keep=0", "log.param_digest=true", "data.image_ratio=2"]
    straight = tmp_path / "straight"
    proc = finetune(straight, *steps)
    assert "joint image-video training: 4 images (1x4x6 tokens) beside each step's 2 clips" in proc.stdout
    rows = [r for r in metrics(straight) if "loss" in r]
    assert len(rows) == 6 and all(r["image_loss"] > 0 and r["images_per_s"] > 0 for r in rows)
    state = ckpt.load_state(ckpt.checkpoint_dir(straight, 6) / "rank0.pt")
    assert state["images"]["samples_consumed"] == 6 * 4 and state["data"]["samples_consumed"] == 6 * 2

    resumed = tmp_path / "resumed"
    finetune(resumed, *steps, "train.steps=3")
    finetune(resumed, *steps, "resume=latest")
    assert digest(resumed) == digest(straight)  # the images' order resumed where it stopped
    videos_only = tmp_path / "videos"
    finetune(videos_only, *steps, "data.image_ratio=0")
    assert digest(videos_only) != digest(straight)  # the images did train the model


@pytest.mark.slow
def test_a_cache_of_images_trains_beside_a_cache_of_clips(tmp_path):
    clips, stills = tmp_path / "clips", tmp_path / "stills"
    common = ["data.num_samples=4", "data.image_num_samples=6"]
    assert precompute("--out", str(clips), *common).returncode == 0
    # as a joint config is written: it names the images' cache this command is about to write
    done = precompute("--out", str(stills), "--images", *common, f"data.image_path={stills}", "data.image_ratio=4")
    assert done.returncode == 0, done.stderr
    index = json.loads((stills / "index.json").read_text())
    assert index["video"] == [1, 64, 96] and len(index["items"]) == 6
    assert all("moves" not in item["caption"] for item in index["items"])
    # a clip precompute into the images' folder is refused: one folder never mixes two datasets
    mixed = precompute("--out", str(stills), *common)
    assert mixed.returncode == 2 and "data.images: True -> None" in mixed.stderr, mixed.stderr
    run = tmp_path / "run"
    cached = ["data.source=cache", f"data.path={clips}", f"data.image_path={stills}", "data.image_ratio=1"]
    finetune(run, *cached, *common, "train.steps=2", "checkpoint.every=2")
    assert all("image_loss" in r for r in metrics(run) if "loss" in r)
    # the clips' cache named as the images' is refused with the key and both shapes
    wrong = finetune(
        tmp_path / "wrong",
        "data.source=cache",
        f"data.path={clips}",
        f"data.image_path={clips}",
        "data.image_ratio=1",
        "train.steps=1",
        check=False,
    )
    assert wrong.returncode == 2
    assert "data.image_path: cache" in wrong.stderr and "[9, 64, 96], the config asks [1, 64, 96]" in wrong.stderr


@pytest.mark.slow
def test_a_run_goes_on_from_weights_at_their_step_of_the_schedule(tmp_path):
    """train.start_step: a stage's weights (a fresh machine has them, not the run) go on where they were trained
    to: the steps, the data orders and the lr schedule continue the straight run's, after a short re-warm-up."""
    common = [
        "train.steps=8",
        "checkpoint.every=2",
        "checkpoint.keep=0",
        "data.image_ratio=2",
        "train.lr_schedule=cosine",
        "train.warmup_steps=3",
        "log.param_digest=true",
    ]
    straight = tmp_path / "straight"
    finetune(straight, *common)
    on = tmp_path / "on"
    weights = ckpt.checkpoint_dir(straight, 4) / "transformer"
    proc = finetune(on, *common, f"model.transformer={weights}", "train.start_step=4")
    assert "train.start_step=4: the weights of model.transformer go on at step 4 of 8" in proc.stdout
    rows = metrics(on)
    assert rows[0]["step"] == 4 and "eval_loss" in rows[0]  # the start's held-out loss, at its step
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [5, 6, 7, 8]
    assert [p.name for p in ckpt.list_checkpoints(on)] == ["step-0000006", "step-0000008"]
    # the straight run's lr at each step; the first step a third of the way back up (warm-up 3 steps)
    lr = {r["step"]: r["lr"] for r in metrics(straight) if "loss" in r}
    assert trained[0]["lr"] == pytest.approx(lr[5] * 2 / 3)
    assert [r["lr"] for r in trained[1:]] == pytest.approx([lr[6], lr[7], lr[8]])
    # both data orders stand where the straight run's do: 8 steps of 2 clips and 4 stills
    for run in (straight, on):
        state = ckpt.load_state(ckpt.checkpoint_dir(run, 8) / "rank0.pt")
        assert state["data"]["samples_consumed"] == 16 and state["images"]["samples_consumed"] == 32
    # a resume of it (the command without train.start_step) keeps the step the run began at
    again = tmp_path / "again"
    proc = finetune(again, *common, f"model.transformer={weights}", f"resume={ckpt.checkpoint_dir(on, 6)}")
    assert "belongs to a run that began at step 4" in proc.stderr
    assert digest(again) == digest(on)
    with pytest.raises(ValueError, match=r"train.start_step=30: expected a step before train.steps=30"):
        load_config(TINY, ["train.start_step=30"])
    with pytest.raises(ValueError, match=r"train.start_step=2: expected 0 with transfer.steps > 0"):
        load_config(TINY, ["train.start_step=2", "transfer.steps=3"])

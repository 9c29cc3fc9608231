"""Issue 54: clips of mixed sizes train at resolution and aspect buckets (live decoding and the latent cache), a cache
stores several windows of each long video, and TensorBoard shows the eval loss and the validation videos, each step
once after a resume."""

from __future__ import annotations

import io
import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training.test_data_layouts import counting_clip, frame_numbers
from tests.training.test_training import TINY, finetune, metrics, precompute
from training import checkpoint as ckpt
from training.config import load_config
from training.data import (
    BucketBatchSampler,
    CachedLatents,
    ClipKey,
    ResumableSampler,
    aspect_buckets,
    build_dataset,
    data_loader,
    make_sampler,
)


def dataset_of(cfg, images: bool = False):
    """The dataset a run of ``cfg`` reads (as training.finetune builds it)."""
    return build_dataset(cfg.data, cfg.train.seed, cfg.model, images=images)


# name: (frames, fps, height, width): sizes of four aspects (4:3, 3:1, 9:16, 1:1), rates and lengths of a user's folder
MIXED = {
    "land": (30, 24.0, 48, 64),
    "wide": (36, 30.0, 32, 96),
    "tall": (20, 15.0, 64, 36),
    "square": (26, 25.0, 64, 64),
    "short": (7, 16.0, 48, 64),  # too short for 9 frames: 5 with data.min_frames=5
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mixed")
    for name, (frames, fps, height, width) in MIXED.items():
        counting_clip(folder / f"{name}.mp4", frames, fps, height, width)
        (folder / f"{name}.txt").write_text(name)
    return folder


def folder_config(folder: Path, *overrides: str):
    return load_config(TINY, ["data.source=folder", f"data.path={folder}", "data.min_frames=5", *overrides])


def nearest_by_ratio(height: int, width: int, sizes) -> tuple[int, int]:
    """The reference: the bucket whose aspect differs least from the clip's by ratio (larger / smaller), in exact
    fractions."""

    def off(size):
        a, b = Fraction(size[1], size[0]), Fraction(width, height)
        return max(a / b, b / a)

    return min(sizes, key=off)


# --------------------------------------------------------------------------- the bucket set


@pytest.mark.parametrize(
    ("height", "width", "multiple"), [(64, 96, 16), (64, 80, 16), (480, 832, 16), (480, 832, 32), (704, 1280, 32)]
)
def test_buckets_fit_the_model_and_hold_about_the_configured_pixels(height, width, multiple):
    sizes = aspect_buckets(height, width, multiple)
    area = height * width
    assert (height, width) in sizes
    aspects = [w / h for h, w in sizes]
    assert aspects == sorted(aspects) and len(set(aspects)) == len(aspects)
    for h, w in sizes:
        assert h % multiple == 0 and w % multiple == 0, (h, w)
        assert 1 / 4 <= w / h <= 4, (h, w)
        # the long side is the multiple nearest area / short side: off by at most half a multiple of it
        assert abs(h * w - area) <= min(h, w) * multiple / 2 + 1e-9, (h, w)
    assert min(aspects) < 0.6 and max(aspects) > 1.6  # portrait and landscape both
    if area >= 480 * 832:  # enough pixels for fine steps: every common aspect has a bucket within 10%
        for aspect in (9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9, 2.0, 21 / 9):
            assert min(abs(math.log(a / aspect)) for a in aspects) < math.log(1.1), aspect


def test_bucket_sizes_that_do_not_fit_the_model_are_refused_naming_the_bucket(tmp_path):
    from training.preflight import check_model_plan

    folder = ["data.source=folder", f"data.path={tmp_path}"]
    cfg = load_config(TINY, [*folder, "data.bucket_sizes=[[64,96],[72,96]]"])
    with pytest.raises(ValueError, match=r"bucket \[72, 96\] does not fit wan2.1-t2v: expected a height that is a "):
        check_model_plan(cfg)
    check_model_plan(load_config(TINY, [*folder, "data.bucket_sizes=[[64,96],[96,64]]"]))
    with pytest.raises(ValueError, match=r"data.bucket_sizes=\[\[64, 96\], \[96\]\]: expected null or a list of"):
        load_config(TINY, [*folder, "data.bucket_sizes=[[64,96],[96]]"])
    with pytest.raises(ValueError, match=r"data.bucket_sizes=.*: expected null with data.buckets=false"):
        load_config(TINY, [*folder, "data.bucket_sizes=[[64,96]]", "data.buckets=false"])
    with pytest.raises(ValueError, match=r"data.buckets=True: expected null with data.source='synthetic'"):
        load_config(TINY, ["data.buckets=true"])
    with pytest.raises(ValueError, match=r"data.cache_windows=0: expected a value >= 1"):
        load_config(TINY, [*folder, "data.cache_windows=0"])
    with pytest.raises(ValueError, match=r"data.cache_windows=2: expected 1 with data.source='cache'"):
        load_config(TINY, ["data.source=cache", f"data.path={tmp_path}", "data.cache_windows=2"])


# --------------------------------------------------------------------------- the batch sampler


def test_bucket_batches_hold_one_shape_cover_every_sample_and_resume_mid_epoch():
    keys = ["a"] * 5 + ["b"] * 2 + ["c"] * 1 + ["a"] * 3  # 8 a, 2 b, 1 c
    sampler = BucketBatchSampler(keys, 3, seed=4)
    assert sampler.batches_per_epoch == 3 + 1 + 1 and sampler.samples_per_epoch == 15
    for epoch in range(3):
        batches = sampler.epoch_batches(epoch)
        assert all(len(b) == 3 and len({keys[i] for i in b}) == 1 for b in batches)
        assert sorted({i for b in batches for i in b}) == list(range(len(keys)))  # every sample, each epoch
    assert sampler.epoch_batches(0) != sampler.epoch_batches(1)  # a new order each epoch
    straight = iter(sampler)
    first = [next(straight) for _ in range(7)]
    assert all(k.epoch == (0 if n < 5 else 1) for n, batch in enumerate(first) for k in batch)
    resumed = BucketBatchSampler(keys, 3, seed=4)
    resumed.load_state_dict(sampler.state_dict(4 * 3))  # after 4 batches
    later = iter(resumed)
    assert [next(later) for _ in range(3)] == first[4:7]
    # two ranks: the epoch's batches dealt out (one wrapped round to make them even)
    ranks = [BucketBatchSampler(keys, 3, seed=4, rank=r, world_size=2).epoch_batches(0) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    assert set(map(tuple, ranks[0] + ranks[1])) == set(map(tuple, sampler.epoch_batches(0)))


class Shaped(list):
    """A dataset stand-in: its length and the clip shapes of its samples."""

    def __init__(self, keys):
        super().__init__(range(len(keys)))
        self.keys = keys

    def shape_keys(self):
        return self.keys


@pytest.mark.slow  # imports the recipe (accelerate, diffusers): seconds on its own
def test_a_resume_whose_clips_fall_in_other_buckets_says_so(tmp_path):
    from training.finetune import check_resume_data

    folder = tmp_path / "checkpoints" / "step-0000004"
    folder.mkdir(parents=True)
    state = {"num_samples": 4, "seed": 0, "shuffle": True, "world_size": 1, "samples_consumed": 8}
    ckpt.save_state({"generator": torch.Generator().get_state(), "data": state}, folder / "rank0.pt")
    cfg = load_config(TINY, ["resume=latest"])
    assert check_resume_data(cfg.resume, cfg.train.seed, folder, Shaped([(9, 64, 96)] * 4), None) == []
    notes = check_resume_data(cfg.resume, cfg.train.seed, folder, Shaped([(9, 64, 96)] * 3 + [(9, 96, 64)]), None)
    assert len(notes) == 1 and "the clips' shapes changed since step-0000004: 1 bucket(s) then, 2 now" in notes[0]


# --------------------------------------------------------------------------- live decoding


@pytest.mark.slow
def test_clips_of_mixed_sizes_land_in_the_nearest_aspect_bucket_and_a_batch_has_one_shape(mixed):
    dataset = dataset_of(folder_config(mixed))
    said = dataset.probe_shapes()
    assert said.startswith("aspect buckets (data.buckets): 5 clip shapes")
    sizes = dataset.bucket_sizes
    names = [e.caption for e in dataset.entries]
    want = {}
    for name, (frames, _, height, width) in MIXED.items():
        want[name] = (9 if frames >= 9 else 5, *nearest_by_ratio(height, width, sizes))
    assert {names[i]: key for i, key in enumerate(dataset.shape_keys())} == want
    assert len({key[1:] for key in want.values()}) == 4  # four aspects, four buckets
    sampler = make_sampler(dataset, 2, seed=0)
    assert isinstance(sampler, BucketBatchSampler)
    seen = set()
    for batch, _ in zip(data_loader(dataset, sampler, 2), range(2 * sampler.batches_per_epoch)):
        assert "groups" not in batch  # one shape: stacked
        shape = tuple(batch["video"].shape)
        assert {want[c] for c in batch["caption"]} == {(shape[2], shape[3], shape[4])}, (batch["caption"], shape)
        seen.update(batch["caption"])
    assert seen == set(MIXED)
    # resized to cover the bucket and centre-cropped: the wide clip's level rises 20 + 6 per source frame, and
    # each frame is a flat grey, so a crop shows as the frame numbers; and its height fills the bucket exactly
    wide = dataset[names.index("wide")]["video"]
    assert wide.shape == (3, 9, *want["wide"][1:])
    steps = np.diff(frame_numbers(wide))
    assert set(steps.tolist()) == {1}  # data.fps unset: consecutive frames


def test_a_cover_resize_and_centre_crop_to_the_bucket_matches_a_plain_reference(tmp_path):
    """A horizontal ramp (level = column): after the cover resize and centre crop to a bucket of another aspect, each
    output column's level is where its centre falls in the source, computed here from the geometry alone."""
    from world.synthetic import write_mp4

    # 3:1 -> the 48x128 bucket (8:3) of a 64x96 run: scaled by 1.5 to 48x144, 8 columns cut a side
    height, width = 32, 96
    ramp = np.broadcast_to(np.linspace(16, 240, width)[None, None, :, None], (9, height, width, 3)).astype(np.uint8)
    write_mp4(tmp_path / "ramp.mp4", ramp, fps=16)
    (tmp_path / "ramp.txt").write_text("a ramp")
    counting_clip(tmp_path / "b.mp4", 9, 16, 64, 64)  # another aspect: buckets on
    (tmp_path / "b.txt").write_text("square")
    dataset = dataset_of(load_config(TINY, ["data.source=folder", f"data.path={tmp_path}"]))
    dataset.probe_shapes()
    item = dataset[[e.caption for e in dataset.entries].index("a ramp")]
    bh, bw = nearest_by_ratio(height, width, dataset.bucket_sizes)
    assert item["video"].shape == (3, 9, bh, bw) and (bh, bw) == (48, 128)
    scale = max(bh / height, bw / width)
    left = (round(width * scale) - bw) // 2
    source_x = (np.arange(bw) + left + 0.5) / scale - 0.5  # the source column under each output column's centre
    reference = np.interp(source_x, np.arange(width), np.linspace(16, 240, width))
    got = ((item["video"][0, 4].mean(dim=0).numpy() + 1) * 127.5)[2:-2]  # the edge columns blur with the cut
    assert np.abs(got - reference[2:-2]).max() < 6, np.abs(got - reference[2:-2]).max()


def test_clips_of_one_aspect_keep_the_configured_size_and_the_order_they_always_had(tmp_path):
    for i in range(3):
        counting_clip(tmp_path / f"c{i}.mp4", 9, 16, 40, 64)  # 8:5, near the 3:2 of 64x96
        (tmp_path / f"c{i}.txt").write_text(f"clip {i}")
    dataset = dataset_of(load_config(TINY, ["data.source=folder", f"data.path={tmp_path}"]))
    assert dataset.probe_shapes() is None and not dataset.bucketed
    assert set(dataset.shape_keys()) == {(9, 64, 96)}
    sampler = make_sampler(dataset, 2, seed=3)
    assert isinstance(sampler, ResumableSampler)
    assert list(zip(range(6), sampler)) == list(zip(range(6), ResumableSampler(3, seed=3)))
    # data.buckets=true puts them in their bucket even alone: the configured size here, the aspect nearest 8:5
    forced = dataset_of(load_config(TINY, ["data.source=folder", f"data.path={tmp_path}", "data.buckets=true"]))
    forced.probe_shapes()
    assert forced.bucketed and set(forced.shape_keys()) == {(9, 64, 96)}
    off = dataset_of(load_config(TINY, ["data.source=folder", f"data.path={tmp_path}", "data.buckets=false"]))
    assert not off.needs_probe and off.bucket_sizes == [(64, 96)]


def test_a_cache_written_before_buckets_reads_as_it_always_did(tmp_path):
    """A cache without per-item shapes (the built-in model's caches): one shape, the same sampler and order, each
    item's latents as its file holds them."""
    from safetensors.torch import save_file

    latents = [torch.randn(16, 3, 8, 12, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for i, z in enumerate(latents):
        save_file({"latents": z, "text": torch.zeros(4, 8)}, tmp_path / f"sample_{i:07d}.safetensors")
    save_file({"text": torch.zeros(4, 8)}, tmp_path / "empty_text.safetensors")
    items = [{"file": f"sample_{i:07d}.safetensors", "caption": f"c{i}"} for i in range(3)]
    (tmp_path / "index.json").write_text(json.dumps({"video": [9, 64, 96], "items": items}))
    cache = CachedLatents(tmp_path, seed=0)
    assert cache.shape_keys() == [(9, 64, 96)] * 3
    assert isinstance(make_sampler(cache, 2, seed=0), ResumableSampler)
    for epoch in range(3):
        assert torch.equal(cache[ClipKey(1, epoch)]["latents"], latents[1])


# --------------------------------------------------------------------------- the latent cache


@pytest.mark.slow
def test_a_cache_stores_each_clip_at_its_bucket_and_several_windows_of_each_long_video(mixed, tmp_path):
    cache = tmp_path / "cache"
    data = ["data.source=folder", f"data.path={mixed}", "data.min_frames=5"]
    done = precompute("--out", str(cache), *data, "data.cache_windows=3")
    assert done.returncode == 0, done.stderr
    assert "aspect buckets (data.buckets)" in done.stderr
    index = json.loads((cache / "index.json").read_text())
    assert index["video"] == [9, 64, 96]  # the configured shape; each item's own where it differs
    live = dataset_of(folder_config(mixed))
    live.probe_shapes()
    want = {e.caption: key for e, key in zip(live.entries, live.shape_keys())}
    cached = dataset_of(load_config(TINY, ["data.source=cache", f"data.path={cache}"]))
    assert {it["caption"]: key for it, key in zip(cached.items, cached.shape_keys())} == want
    for i, item in enumerate(cached.items):
        frames, height, width = want[item["caption"]]
        assert tuple(cached[i]["latents"].shape) == (16, (frames - 1) // 4 + 1, height // 8, width // 8)
    # the windows: spread evenly over each video (its first and last clip), read one an epoch, each once in 3
    wide = next(i for i, it in enumerate(cached.items) if it["caption"] == "wide")
    assert cached.items[wide]["windows"] == 3
    read = [cached[ClipKey(wide, epoch)]["latents"] for epoch in range(6)]
    from safetensors.torch import load_file

    stored = load_file(cache / cached.items[wide]["file"])
    windows = [stored["latents"], stored["latents.1"], stored["latents.2"]]
    assert all(not torch.equal(windows[a], windows[b]) for a, b in ((0, 1), (1, 2), (0, 2)))
    for cycle in (read[:3], read[3:]):
        assert sorted(next(k for k, w in enumerate(windows) if torch.equal(w, r)) for r in cycle) == [0, 1, 2]
    entry = [e.caption for e in live.entries].index("wide")
    clips = live.load(entry, windows=3)["windows"]
    last = MIXED["wide"][0] - 9  # the last clip's first frame: 36 frames, 9 a clip
    assert [frame_numbers(c)[0] for c in clips] == [0, round(last / 2), last]
    # a batch of the cache has one shape, and a run trains on it
    sampler = make_sampler(cached, 2, seed=0)
    assert isinstance(sampler, BucketBatchSampler)
    for batch, _ in zip(data_loader(cached, sampler, 2), range(sampler.batches_per_epoch)):
        assert "groups" not in batch and len({want[c] for c in batch["caption"]}) == 1
    run = tmp_path / "run"
    finetune(run, "data.source=cache", f"data.path={cache}", "train.steps=2", "checkpoint.every=0")
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in metrics(run) if "loss" in r)


# --------------------------------------------------------------------------- TensorBoard


def event_records(run: Path) -> list[tuple[str, int, object]]:
    """Every summary value in the run's event files, read raw (no purge applied): (tag, step, value)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    out = []
    for path in sorted((run / "finetune").glob("events.out.tfevents.*")):
        for event in LegacyEventFileLoader(str(path)).Load():  # as written (no migration)
            for value in event.summary.value if event.HasField("summary") else []:
                out.append((value.tag, event.step, value))
    return out


@pytest.mark.slow
def test_tensorboard_shows_the_eval_loss_and_validation_videos_and_each_step_once_after_a_resume(mixed, tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    common = [
        "data.source=folder",
        f"data.path={mixed}",
        "data.min_frames=5",
        "log.tensorboard=true",
        "validation.every=2",
        "validation.num_inference_steps=2",
        "checkpoint.every=2",
        "checkpoint.keep=0",
        "train.steps=4",
    ]
    finetune(run, *common)
    shutil.rmtree(ckpt.checkpoint_dir(run, 4))  # stopped after step 4's logs, before its checkpoint
    shutil.rmtree(run / "final")
    proc = finetune(run, *common, "resume=latest")
    assert "resumed from" in proc.stdout + proc.stderr
    # stopped in the end of the run (after the last checkpoint, before final/finished.json): a resume that redoes
    # the end logs its evaluation once
    (run / "final" / "finished.json").unlink()
    finetune(run, *common, "resume=latest")
    records = event_records(run)
    seen = [(tag, step) for tag, step, _ in records]
    assert len(seen) == len(set(seen)), sorted(t for t in seen if seen.count(t) > 1)  # each step once, raw
    steps = {tag: sorted(step for t, step in seen if t == tag) for tag in {t for t, _ in seen}}
    assert steps["loss"] == [1, 2, 3, 4]
    assert steps["eval_loss"] == [0, 2, 4]  # start, validation.every, end
    assert steps["validation/prompt0_seed0"] == [2, 4]
    for tag, step, value in records:
        if tag == "validation/prompt0_seed0":
            gif = Image.open(io.BytesIO(value.image.encoded_image_string))
            assert gif.format == "GIF" and gif.size == (96, 64) and gif.n_frames == 9
            assert (run / "validation" / f"step-{step:07d}" / "prompt0_seed0.mp4").is_file()
    evals = {r["step"]: r["eval_loss"] for r in metrics(run) if "eval_loss" in r}
    assert sorted(evals) == [0, 2, 4]
    acc = EventAccumulator(str(run / "finetune"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    assert {e.step: round(e.value, 5) for e in acc.Scalars("eval_loss")} == {s: round(v, 5) for s, v in evals.items()}
    assert [e.step for e in acc.Images("validation/prompt0_seed0")] == [2, 4]

"""The synthetic moving-shapes world: determinism, captions that match the pixels, splits, mp4 files."""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest

from world.synthetic import (
    COLOURS,
    DEFAULT_HELD_OUT,
    MOTIONS,
    PLAIN_BACKGROUNDS,
    SHAPES,
    SIZES,
    SyntheticVideoDataset,
    SyntheticWorld,
    caption_for,
    generate_sample,
    main,
    sample_attributes,
    sample_caption,
    write_mp4,
)

FRAMES, HEIGHT, WIDTH = 17, 64, 64


def colour_mask(frames: np.ndarray, colour: str, tolerance: float = 45.0) -> np.ndarray:
    """Pixels within ``tolerance`` (RGB distance) of a named colour: ``(..., H, W)`` bool."""
    distance = np.linalg.norm(frames.astype(np.float32) - np.asarray(COLOURS[colour], np.float32), axis=-1)
    return distance < tolerance


def centroid(mask: np.ndarray) -> np.ndarray:
    """(x, y) mean pixel position of a non-empty ``(H, W)`` mask."""
    ys, xs = np.nonzero(mask)
    return np.array([xs.mean(), ys.mean()])


def classify_shape(mask: np.ndarray) -> str:
    """Shape from how much of its bounding box a mask fills, and (triangle) where its mass sits."""
    ys, xs = np.nonzero(mask)
    box_h, box_w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = mask.sum() / (box_h * box_w)
    if fill > 0.88:
        return "square"
    if fill > 0.66:
        return "circle"
    # Triangle and diamond both fill half their box; a triangle pointing up is bottom-heavy.
    offset = (ys.mean() - (ys.min() + ys.max()) / 2) / box_h
    return "triangle" if offset > 0.06 else "diamond"


# Written out independently of the generator's phrase table, so a caption that says the wrong
# direction fails here.
PHRASE_DIRECTION = {
    "moves to the left": (-1, 0),
    "moves to the right": (1, 0),
    "moves up": (0, -1),
    "moves down": (0, 1),
    "moves diagonally up and to the left": (-1, -1),
    "moves diagonally up and to the right": (1, -1),
    "moves diagonally down and to the left": (-1, 1),
    "moves diagonally down and to the right": (1, 1),
    "stays still": (0, 0),
    "grows": (0, 0),
    "bounces up and down": None,
}
CLAUSE = re.compile(
    rf"a (small|large) ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)}) ({'|'.join(PHRASE_DIRECTION)})(?: and | on a )"
)


def parse_caption(caption: str) -> list[dict]:
    """Objects named by a caption: ``[{"size", "colour", "shape", "phrase"}]``."""
    return [dict(zip(("size", "colour", "shape", "phrase"), m.groups(), strict=True)) for m in CLAUSE.finditer(caption)]


def test_same_seed_gives_identical_samples_and_different_seeds_differ():
    a = generate_sample(3, seed=11)
    b = generate_sample(3, seed=11)
    assert np.array_equal(a.frames, b.frames)
    assert a.caption == b.caption and a.attributes == b.attributes
    others = [generate_sample(3, seed=seed) for seed in (12, 13, 14)]
    assert all(not np.array_equal(a.frames, o.frames) for o in others)
    assert a.frames.dtype == np.uint8 and a.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)


def test_a_sample_does_not_depend_on_how_many_are_generated():
    small, large = SyntheticVideoDataset(6, seed=2), SyntheticVideoDataset(500, seed=2)
    assert small[5]["caption"] == large[5]["caption"]
    assert np.array_equal(small[5]["video"].numpy(), large[5]["video"].numpy())
    video = small[0]["video"]
    assert video.shape == (3, FRAMES, HEIGHT, WIDTH) and -1.0 <= video.min() and video.max() <= 1.0


def test_caption_is_built_from_the_attributes():
    sample = generate_sample(0, seed=5, world=SyntheticWorld(max_objects=1))
    obj = sample.attributes["objects"][0]
    words = sample.caption.split()
    assert words[:4] == ["a", obj["size"], obj["colour"], obj["shape"]]
    assert sample.caption.endswith(f"on a {sample.attributes['background']} background")
    two = {
        "background": "grey",
        "objects": [
            {"size": "small", "colour": "red", "shape": "circle", "motion": "left"},
            {"size": "large", "colour": "blue", "shape": "square", "motion": "up"},
        ],
    }
    assert (
        caption_for(two) == "a small red circle moves to the left and a large blue square moves up on a grey background"
    )


def test_short_captions_leave_out_only_the_default_background():
    world = SyntheticWorld(short_captions=0.25, default_background="grey")
    named, unnamed, sizeless = {}, {}, 0
    for i in range(400):
        attrs = sample_attributes(0, i, "train", world)
        caption = sample_caption(0, i, "train", attrs, world)
        bg = attrs["background"]
        (named if caption.endswith(f"on a {bg} background") else unnamed)[bg] = 1 + named.get(bg, 0)
        sizeless += not any(f" {o['size']} " in f" {caption} " for o in attrs["objects"])
    assert set(unnamed) == {"grey"} and named["grey"] > 0 and set(named) == set(world.backgrounds)
    assert 0.35 < unnamed["grey"] / (unnamed["grey"] + named["grey"]) < 0.65  # half of the grey clips
    assert 60 < sizeless < 140  # a quarter of 400 leave the sizes out
    anywhere = SyntheticWorld(short_captions=0.25)  # None: any background may be left out
    left_out = set()
    for i in range(400):
        attrs = sample_attributes(0, i, "train", anywhere)
        if "background" not in sample_caption(0, i, "train", attrs, anywhere):
            left_out.add(attrs["background"])
    assert left_out == set(anywhere.backgrounds)
    with pytest.raises(ValueError, match="default_background must be one of"):
        SyntheticWorld(default_background="pink")


def test_pixels_match_the_caption_colour_shape_size_and_motion():
    """Colour masks on the rendered frames find each object the caption names, with its shape, size and motion."""
    checked = {"colour": 0, "shape": 0, "size": 0, "motion": 0}
    objects_seen = 0
    for index in range(60):
        sample = generate_sample(index, seed=1)
        frames, caption = sample.frames, sample.caption
        named = parse_caption(caption)
        assert len(named) == sample.attributes["num_objects"], caption
        for obj in named:
            objects_seen += 1
            masks = colour_mask(frames, obj["colour"])
            areas = masks.sum(axis=(1, 2))
            assert areas.min() > 10, f"{caption!r}: {obj['colour']} object not found in every frame"
            checked["colour"] += 1
            middle = FRAMES // 2  # growing objects have their nominal size mid-clip
            side = np.sqrt(areas[middle]) / min(HEIGHT, WIDTH)
            assert (side > 0.2) == (obj["size"] == "large"), f"{caption!r}: relative side {side:.2f}"
            checked["size"] += 1
            if obj["size"] == "large":  # small shapes at 64 px are too few pixels to classify reliably
                assert classify_shape(masks[0]) == obj["shape"], caption
                checked["shape"] += 1
            start, mid, end = centroid(masks[0]), centroid(masks[middle]), centroid(masks[-1])
            direction = PHRASE_DIRECTION[obj["phrase"]]
            if direction is None:  # bouncing: falls, then rebounds to where it started
                assert mid[1] - start[1] > 10, f"{caption!r}: does not fall"
                assert abs(end[1] - start[1]) < 2 and abs(end[0] - start[0]) < 2, f"{caption!r}: no rebound"
            else:
                for axis, sign in enumerate(direction):
                    moved = end[axis] - start[axis]
                    if sign:
                        assert moved * sign > 10, f"{caption!r}: moved {moved:.1f} px on axis {axis}"
                    else:
                        assert abs(moved) < 2, f"{caption!r}: drifted {moved:.1f} px on axis {axis}"
            if obj["phrase"] == "grows":
                assert areas[-1] > 3 * areas[0], f"{caption!r}: does not grow"
            checked["motion"] += 1
    assert objects_seen > 60 and checked["shape"] >= 20, checked


def test_backgrounds_are_grey_toned_and_textures_are_textured():
    for background in ("grey", "black", "white", "checkered", "striped"):
        world = SyntheticWorld(backgrounds=(background,), max_objects=1)
        frames = generate_sample(0, seed=4, world=world).frames
        objects = np.any([colour_mask(frames[0], c) for c in COLOURS], axis=0)
        # Grow the object mask by 2 px: anti-aliased edges blend the object into the background.
        for shift in (-2, -1, 1, 2):
            objects = objects | np.roll(objects, shift, 0) | np.roll(objects, shift, 1)
        object_free = ~objects
        pixels = frames[0][object_free].astype(int)
        assert np.all(np.ptp(pixels, axis=-1) <= 2), f"{background}: background pixels are not grey"
        if background in PLAIN_BACKGROUNDS:
            assert np.all(np.abs(pixels - PLAIN_BACKGROUNDS[background]) <= 1), background
        else:
            levels, counts = np.unique(pixels[:, 0], return_counts=True)
            assert len(levels) == 2 and counts.min() > 0.3 * counts.sum(), f"{background}: expected two grey tones"


def test_held_out_combinations_never_appear_in_train_but_every_value_does():
    world = SyntheticWorld()
    train = [sample_attributes(0, i, "train", world) for i in range(400)]
    train_objects = [o for attrs in train for o in attrs["objects"]]
    for obj in train_objects:
        for combination in DEFAULT_HELD_OUT:
            assert not all(obj[k] == v for k, v in combination.items()), f"held-out {combination} in train: {obj}"
    assert all(not attrs["held_out"] for attrs in train)
    # Composition is only testable if each value on its own was seen in training.
    for key, values in (("shape", SHAPES), ("colour", COLOURS), ("size", world.sizes), ("motion", MOTIONS)):
        assert {o[key] for o in train_objects} == set(values), key
    assert {a["num_objects"] for a in train} == {1, 2}
    validation = [sample_attributes(0, i, "validation", world) for i in range(40)]
    for index, attrs in enumerate(validation):
        has_held_out = any(world.is_held_out(o) for o in attrs["objects"])
        assert attrs["held_out"] == has_held_out == (index % 2 == 0), (index, attrs)
    assert {
        tuple(sorted(c.items()))
        for a in validation
        for o in a["objects"]
        for c in DEFAULT_HELD_OUT
        if all(o[k] == v for k, v in c.items())
    } == {tuple(sorted(c.items())) for c in DEFAULT_HELD_OUT}


def test_a_narrowed_world_only_holds_out_what_it_can_draw():
    world = SyntheticWorld(colours=("red", "green"), shapes=("triangle", "square"), max_objects=1)
    assert world.possible_held_out() == ({"colour": "red", "shape": "triangle"}, {"colour": "green", "motion": "right"})
    validation = [sample_attributes(0, i, "validation", world)["objects"][0] for i in range(0, 20, 2)]
    assert all(o["colour"] in world.colours and o["shape"] in world.shapes for o in validation)
    assert all(world.is_held_out(o) for o in validation)
    with pytest.raises(ValueError, match="held-out combinations .* rule out nearly every draw"):
        sample_attributes(0, 1, "train", SyntheticWorld(colours=("red",), shapes=("triangle",), max_objects=1))


def test_two_objects_always_have_different_colours():
    for i in range(100):
        attrs = sample_attributes(3, i, "train")
        colours = [o["colour"] for o in attrs["objects"]]
        assert len(set(colours)) == len(colours) == attrs["num_objects"]


def test_bad_world_and_split_are_rejected_with_the_bad_value():
    with pytest.raises(ValueError, match="hexagon"):
        SyntheticWorld(shapes=("hexagon",))
    with pytest.raises(ValueError, match="'test'"):
        sample_attributes(0, 0, "test")


@pytest.mark.parametrize("backend", ["decord", "imageio"])
def test_mp4_round_trip_keeps_colours_and_shape(tmp_path, backend):
    if backend == "decord":
        pytest.importorskip("decord")
    from training.data import open_video

    sample = generate_sample(2, seed=0, world=SyntheticWorld(max_objects=1, backgrounds=("grey",)))
    path = tmp_path / "clip.mp4"
    write_mp4(path, sample.frames)
    video = open_video(path, backend)
    assert video.num_frames == FRAMES
    decoded = video.read(np.arange(FRAMES))
    assert decoded.shape == sample.frames.shape
    colour = sample.attributes["objects"][0]["colour"]
    # Object interiors (mask eroded by one pixel) keep their colour; edges lose chroma to 4:2:0.
    mask = colour_mask(sample.frames, colour)
    interior = mask & np.roll(mask, 1, 1) & np.roll(mask, -1, 1) & np.roll(mask, 1, 2) & np.roll(mask, -1, 2)
    error = np.abs(decoded[interior].astype(float).mean(0) - np.asarray(COLOURS[colour], float))
    assert error.max() < 12, f"mean {colour} drifted by {error}"
    assert np.abs(decoded.astype(float) - sample.frames).mean() < 3


def test_cli_writes_videos_and_manifests(tmp_path):
    main(
        [
            "--out",
            str(tmp_path),
            "--num",
            "3",
            "--frames",
            "5",
            "--height",
            "32",
            "--width",
            "48",
            "--seed",
            "7",
            "--split",
            "validation",
        ]
    )
    with open(tmp_path / "manifest.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    records = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert len(rows) == len(records) == 3
    for index, (row, record) in enumerate(zip(rows, records, strict=True)):
        expected = generate_sample(index, seed=7, split="validation", num_frames=5, height=32, width=48)
        assert row["caption"] == record["caption"] == expected.caption
        assert record["attributes"] == expected.attributes
        assert row["colour"] == expected.attributes["objects"][0]["colour"] and row["split"] == "validation"
        assert (tmp_path / row["video"]).is_file()
        assert (tmp_path / row["video"]).with_suffix(".txt").read_text().strip() == expected.caption


def test_synthetic_dataset_batches_through_a_dataloader_with_the_resumable_sampler():
    from torch.utils.data import DataLoader

    from training.data import ResumableSampler

    dataset = SyntheticVideoDataset(6, seed=1, num_frames=5, height=32, width=48)
    loader = DataLoader(dataset, batch_size=4, sampler=ResumableSampler(len(dataset), seed=0, num_epochs=1))
    batches = list(loader)
    assert [b["video"].shape for b in batches] == [(4, 3, 5, 32, 48), (2, 3, 5, 32, 48)]
    indices = [i for b in batches for i in b["index"].tolist()]
    assert sorted(indices) == list(range(6))
    assert [c for b in batches for c in b["caption"]] == [caption_for(dataset.attributes(i)) for i in indices]


def test_second_world_is_the_narrow_one_the_issue_asks_for():
    from world.analyse import parse_caption
    from world.synthetic import WORLDS, generate_sample, world_named

    world = WORLDS["v2"]
    assert (
        "cyan" not in world.colours and world.max_objects == 1 and set(world.backgrounds) == {"grey", "black", "white"}
    )
    named_background = 0
    for i in range(40):
        s = generate_sample(i, seed=3, height=128, width=160, world=world)
        assert s.attributes["num_objects"] == 1
        assert not any(size in s.caption.split() for size in SIZES)  # one size: never named
        (obj,) = s.attributes["objects"]
        # 48-64 px across at 128x160: the radius is 0.22 of the short side (56 px across)
        assert 48 <= 2 * SIZES[obj["size"]] * 128 <= 64
        parsed = parse_caption(s.caption)
        assert parsed["objects"][0]["colour"] == obj["colour"] and parsed["objects"][0]["shape"] == obj["shape"]
        if parsed["background"] is None:
            assert s.attributes["background"] == "grey"  # only the default background goes unsaid
        else:
            named_background += 1
    assert 0 < named_background < 40
    assert world_named("v2", short_captions=0.0).short_captions == 0.0
    with pytest.raises(ValueError, match="unknown synthetic world"):
        world_named("v9")

"""The hand-written video analyser that scores the built-in model: right on real clips, wrong on wrong ones."""

import numpy as np
import pytest

from training.analyse import analyse, classify_shape, parse_caption, score
from training.synthetic import generate_sample, render_video


@pytest.fixture(scope="module")
def clips():
    # fresh draws of both splits (every motion, shape, colour, one or two objects, every background)
    seed = int(np.random.default_rng().integers(1 << 30))
    return seed, [
        generate_sample(i, seed=seed, split=split, num_frames=17, height=128, width=160)
        for split in ("train", "validation")
        for i in range(40)
    ]


def test_real_clips_score_perfectly(clips):
    seed, samples = clips
    verdicts = [analyse(s.frames, s.caption) for s in samples]
    wrong = [
        (s.caption, v["found"])
        for s, v in zip(samples, verdicts)
        if not all(v[a] in (True, None) for a in ("count", "colour", "shape", "motion"))
    ]
    assert not wrong, f"seed {seed}: {wrong[:3]}"
    assert score(verdicts)["overall"] == 1.0


def test_wrong_colour_motion_shape_and_count_are_caught():
    attrs = {"background": "grey", "num_objects": 1, "held_out": False,
             "objects": [{"shape": "square", "colour": "red", "size": "large", "motion": "right",
                          "start": [0.3, 0.5], "end": [0.7, 0.5]}]}  # fmt: skip
    frames = render_video(attrs, 17, 128, 160)
    good = analyse(frames, "a red square moves to the right")
    assert good["colour"] and good["shape"] and good["motion"] and good["count"]
    assert analyse(frames[::-1], "a red square moves to the right")["motion"] is False  # played backwards: left
    assert analyse(frames, "a blue square moves to the right")["colour"] is False
    assert analyse(frames, "a red circle moves to the right")["shape"] is False
    assert analyse(frames, "a red square moves to the right and a blue circle stays still")["count"] is False
    grey = np.full_like(frames, 128)
    assert analyse(grey, "a red square moves to the right")["colour"] is False  # nothing there at all


def test_shapes_from_masks():
    yy, xx = np.mgrid[0:40, 0:40]
    assert classify_shape((xx - 20) ** 2 + (yy - 20) ** 2 <= 144) == "circle"
    assert classify_shape((abs(xx - 20) <= 10) & (abs(yy - 20) <= 10)) == "square"
    assert classify_shape(abs(xx - 20) + abs(yy - 20) <= 12) == "diamond"
    assert classify_shape((yy <= 30) & (yy >= 10 + 2 * abs(xx - 20))) == "triangle"
    assert classify_shape(np.zeros((40, 40), bool)) is None


def test_parse_caption_reads_full_and_short_forms():
    full = parse_caption(
        "a large blue square moves diagonally up and to the left and a small red circle grows on a striped background"
    )
    assert full["background"] == "striped"
    assert full["objects"] == [
        {"colour": "blue", "shape": "square", "size": "large", "motion": "up_left"},
        {"colour": "red", "shape": "circle", "size": "small", "motion": "growing"},
    ]
    assert parse_caption("A red square moves to the right.")["objects"] == [
        {"colour": "red", "shape": "square", "motion": "right"}
    ]


def test_bad_frames_are_named():
    with pytest.raises(ValueError, match=r"frames must be \(T, H, W, 3\)"):
        analyse(np.zeros((4, 8, 8)), "a red square")

"""Issue 38 (2): the verdict a person would agree with, on synthetic frames. The world's own rendering of the
prompt is judged as drawing it; a horizontal band is not a square, a swarm of dots is not one square (count
compares objects, not colours), a blob in a corner misses shape and motion; the page says which attributes a
video misses, whether any variant drew the prompt, and says so plainly for a prompt the analyser cannot read."""

import numpy as np
import pytest

from app import quality
from world.analyse import prompt_verdicts, strict_verdicts
from world.synthetic import COLOURS, render_video

T, H, W = 9, 64, 96
RED, YELLOW = COLOURS["red"], COLOURS["yellow"]


def _square_moving_right() -> np.ndarray:
    obj = {"shape": "square", "colour": "red", "size": "large", "motion": "right", "start": [0.3, 0.5]}
    obj["end"] = [0.7, 0.5]
    return render_video({"background": "white", "objects": [obj]}, T, H, W)


def _blank() -> np.ndarray:
    return np.full((T, H, W, 3), 255, np.uint8)


def _band() -> np.ndarray:
    """A red horizontal band (most of the width, a sixth of the height) drifting right."""
    frames = _blank()
    for t in range(T):
        frames[t, 28:38, 4 + t : 80 + t] = RED
    return frames


def _swarm(colour=RED) -> np.ndarray:
    """About 20 dots of one colour scattered over the frame, drifting right."""
    rng = np.random.default_rng(0)
    ys, xs = rng.integers(4, H - 6, 20), rng.integers(4, W - 20, 20)
    frames = _blank()
    for t in range(T):
        for y, x in zip(ys, xs):
            frames[t, y : y + 3, x + t : x + t + 3] = colour
    return frames


def _corner_blob() -> np.ndarray:
    frames = _blank()
    yy, xx = np.mgrid[0:H, 0:W]
    frames[:, (yy - 6) ** 2 / 36 + (xx - 8) ** 2 / 100 <= 1] = RED  # a still ellipse in the top-left corner
    return frames


PROMPT = "a red square moves to the right"


def test_the_world_s_own_rendering_draws_the_prompt():
    verdict = strict_verdicts(_square_moving_right(), PROMPT)
    assert verdict == {"count": True, "colour": True, "shape": True, "motion": True}
    assert quality.verdict_text(verdict) == "draws the prompt"


def test_a_band_is_neither_a_square_nor_a_motion():
    verdict = strict_verdicts(_band(), PROMPT)
    assert verdict["shape"] is False and verdict["colour"] is True and verdict["motion"] is False
    assert quality.verdict_text(verdict) == "misses: shape, motion"
    assert prompt_verdicts(_band(), PROMPT) == verdict  # the evaluations judge as the page does (analyser 4)


def test_a_swarm_is_not_one_object():
    assert prompt_verdicts(_swarm(), PROMPT)["count"] is False  # twenty dots of one colour are not one object
    verdict = strict_verdicts(_swarm(), PROMPT)
    assert verdict["count"] is False and verdict["shape"] is False
    assert quality.verdict_text(verdict).startswith("misses: count")


def test_a_blob_in_a_corner_misses_shape_and_motion():
    verdict = strict_verdicts(_corner_blob(), PROMPT)
    assert verdict["motion"] is False and verdict["shape"] is False and verdict["colour"] is True


def test_a_missing_colour_misses_everything_it_names():
    verdict = strict_verdicts(_swarm(YELLOW), PROMPT)
    assert verdict == {"count": False, "colour": False, "shape": False, "motion": False}


def test_out_of_vocabulary_prompt_is_not_judged():
    assert strict_verdicts(_square_moving_right(), "a cat on a sofa") is None


@pytest.mark.parametrize(
    "verdicts, line",
    [
        ({"a": None, "b": None}, "the prompt names nothing the analyser knows"),
        ({"a": {"shape": False}, "b": {"count": False, "shape": True}}, "No variant drew the prompt"),
        ({"a": {"shape": True}, "b": {"shape": False}}, "Drew the prompt: a (1 of 2)"),
    ],
)
def test_one_line_summary(verdicts, line):
    assert line in quality.summary_line(verdicts, judged=True)


def test_no_summary_without_an_analyser():
    assert quality.summary_line({"a": None}, judged=False) == ""

"""What makes a comparison trustworthy, on planted data: paired speedups with intervals, turn-taking, a
countdown that never rises, degenerate videos, the permalink, the vocabulary warning."""

import random
import threading
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import pytest

from app import compare, quality
from app.interleave import NOISY, Countdown, Turns, median_rank, paired_speedup
from pipelines.model_dir import BUILTIN_DIR, builtin_available

# ---- paired speedups --------------------------------------------------------------------------------------


def test_paired_speedup_cancels_load_drift_that_hits_both_sides():
    rng = random.Random(0)
    load = [1 + 2 * rng.random() for _ in range(19)]  # the machine's load changes 3x between rounds
    flash = [0.4 * x for x in load]
    mhla = [0.2 * x * (1 + 0.01 * rng.uniform(-1, 1)) for x in load]  # 2x, 1% jitter of its own
    s = paired_speedup(flash, mhla)
    assert s.n == 19 and s.estimate == pytest.approx(2.0, rel=0.01)
    assert s.low < s.estimate < s.high and s.half_width < 0.01 and not s.noisy
    # the same times unpaired (mhla's rounds shuffled): the drift no longer cancels and the interval says so
    shuffled = mhla[:]
    rng.shuffle(shuffled)
    assert paired_speedup(flash, shuffled).half_width > NOISY


def test_paired_speedup_interval_by_hand():
    # ratios 1..9 (9 pairs): median 5; below the median lie Binomial(9, 1/2) of them, and P(B <= 1) = 10/512
    # <= 0.025 < P(B <= 2) = 46/512, so the 95% interval is [x_(2), x_(8)] = [2, 8] (coverage 1 - 20/512)
    s = paired_speedup([float(r) for r in range(1, 10)], [1.0] * 9)
    assert (s.estimate, s.low, s.high, s.n) == (5.0, 2.0, 8.0, 9)
    assert s.noisy and s.text() == "5.00x (2.00-8.00)" and s.ratio_spread == pytest.approx((7 - 3) / 2 / 5)
    # a burst of load that hits one variant's step of a round moves the median by one rank, not the estimate
    steady = paired_speedup([2.0] * 18 + [2.0, 2.0], [1.0] * 18 + [0.2, 5.0])
    assert steady.estimate == 2.0 and steady.low == steady.high == 2.0 and not steady.noisy
    one = paired_speedup([3.0], [1.0])
    assert one.estimate == one.low == one.high == 3.0 and one.n == 1 and one.noisy
    assert "no interval" in one.text()
    # five pairs cannot make a 95% interval for a median (2 / 2^5 > 5%): min-max, and called noisy
    assert median_rank(5) == 0 and median_rank(6) == 1 and median_rank(9) == 2 and median_rank(19) == 5
    five = paired_speedup([2.0] * 5, [1.0] * 5)
    assert five.low == five.high == 2.0 and five.noisy


@pytest.mark.parametrize(
    "a, b, message",
    [([1.0], [1.0, 2.0], "equal lengths"), ([], [], "at least one pair"), ([1.0], [0.0], "positive")],
)
def test_paired_speedup_refuses_bad_input(a, b, message):
    with pytest.raises(ValueError, match=message):
        paired_speedup(a, b)


def test_turns_go_round_robin_and_skip_a_worker_that_left():
    turns = Turns(["flash", "linear", "mhla"])
    log = []
    work = {"flash": 3, "linear": 1, "mhla": 3}  # linear leaves after its first turn

    def worker(name):
        for i in range(work[name]):
            turns.wait(name)
            log.append(name)
            if i + 1 < work[name]:
                turns.done(name)
        turns.leave(name)

    threads = [threading.Thread(target=worker, args=(n,)) for n in reversed(list(work))]  # start order irrelevant
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert log == ["flash", "linear", "mhla", "flash", "mhla", "flash", "mhla"]
    assert turns.holder is None
    with pytest.raises(RuntimeError, match="does not hold"):
        Turns(["a", "b"]).done("b")


def test_countdown_counts_down_without_jitter_and_shows_a_real_slowdown():
    now = [0.0]
    c = Countdown(clock=lambda: now[0])
    assert c.update(None) is None  # nothing shown before the first estimate
    assert c.update(30.0) == 30.0
    now[0] = 5.0
    assert c.update(26.0) == 26.0  # a little above the count (within 10% and 1 s), below the last figure: no rise
    now[0] = 5.5
    assert c.update(26.2) == 26.0  # a little above the last figure: it holds, no jitter up
    now[0] = 6.0
    assert c.update(10.0) == 10.0  # a lower one is taken
    now[0] = 7.0
    assert c.update(20.0) == 20.0  # twice the count: the run slowed down, and saying 9 s would be wrong
    now[0] = 40.0
    assert c.update(None) == 0.0 and c.update(1.0) == 0.0  # never below zero; 1 s above 0 is jitter


# ---- degenerate videos ------------------------------------------------------------------------------------


def _square_video(frames=9, size=64, background=0.0, colour=(1.0, 0.0, 0.0)):
    """A small square moving right on a plain background (the world's smallest shape is about 0.4% of it)."""
    x = np.full((frames, size, size, 3), background, np.float32)
    side = 5
    for t in range(frames):
        left = 4 + 4 * t
        x[t, 30 : 30 + side, left : left + side] = colour
    return x


def test_degenerate_videos_are_found_and_a_normal_one_is_not():
    normal = _square_video()
    assert quality.degenerate(normal) is None
    assert quality.degenerate(_square_video(background=1.0)) is None  # white background, not saturated
    assert quality.degenerate((normal * 255).astype(np.uint8)) is None
    # a still shape whose pixels vary a little from frame to frame (as a diffusion model draws one) is a video
    rng = np.random.default_rng(0)
    still = np.repeat(_square_video(frames=1), 9, axis=0) + rng.normal(0, 0.01, (9, 64, 64, 3)).astype(np.float32)
    assert quality.degenerate(np.clip(still, 0, 1)) is None

    black = np.zeros((9, 64, 64, 3), np.float32)
    assert quality.degenerate(black) == "blank"
    # near-black with faint noise, as issue 31's hybrid video: still blank
    assert quality.degenerate(np.clip(black + rng.normal(0.05, 0.01, black.shape), 0, 1)) == "blank"
    assert quality.degenerate(np.repeat(normal[:1], 9, axis=0)) == "frozen"
    clipped = np.zeros((9, 64, 64, 3), np.float32)
    clipped[..., 0] = rng.random((9, 64, 64)) > 0.5  # red or black noise...
    clipped[..., 1] = 1 - clipped[..., 0]  # ...every pixel pure red or pure green
    assert quality.degenerate(clipped) == "saturated"
    assert quality.verdict_text({"colour": True, "shape": False}) == "misses: shape"
    assert quality.verdict_text(None) == ""


# ---- the permalink ----------------------------------------------------------------------------------------


def test_permalink_round_trip(monkeypatch):
    models = SimpleNamespace(
        example_prompt="a red square",
        components=SimpleNamespace(tokenizer=None),
        fits=lambda height, width: True,  # a text-to-video model whose tokens divide every preset
        needs_image=False,
        takes_image=False,
    )
    monkeypatch.setattr(compare.request, "preset_tokens", lambda m, p: 1600)
    req = compare.CompareRequest(
        "a small red triangle moves down & left?", "", 123, 17, 4.5, (17, 128, 160), ["flash", "mhla"]
    )
    query = compare.permalink_query(req)
    fields, problems = compare.parse_permalink(dict(parse_qsl(urlsplit(query).query)))
    assert problems == []
    assert fields == {
        "prompt": req.prompt,
        "seed": 123,
        "steps": 17,
        "guidance": 4.5,
        "variants": ["flash", "mhla"],
        "preset": "17x128x160",
    }
    back = compare.check_request(
        models,
        fields["prompt"],
        "",
        fields["seed"],
        fields["steps"],
        fields["guidance"],
        fields["preset"],
        fields["variants"],
    )
    assert (back.prompt, back.seed, back.num_inference_steps, back.guidance_scale, back.preset, back.variants) == (
        req.prompt,
        req.seed,
        req.num_inference_steps,
        req.guidance_scale,
        req.preset,
        req.variants,
    )


def test_a_bad_permalink_is_refused_field_by_field():
    bad = {
        "prompt": "x" * (compare.MAX_PROMPT_CHARS + 1),
        "seed": "-1",
        "steps": "2.5",
        "variants": "flash,../../etc",
        "guidance": "nan",
        "preset": "../x",
    }
    fields, problems = compare.parse_permalink(bad)
    assert fields == {} and set(problems) == set(bad)
    fields, problems = compare.parse_permalink({"steps": "20", "other": "ignored"})
    assert fields == {"steps": 20} and problems == []


# ---- the vocabulary warning -------------------------------------------------------------------------------


@pytest.mark.skipif(not builtin_available(), reason="needs the built-in model's tokenizer")
def test_words_outside_the_builtin_vocabulary_are_named():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(BUILTIN_DIR) / "tokenizer")
    models = SimpleNamespace(components=SimpleNamespace(tokenizer=tokenizer), builtin=True)
    assert compare.unknown_words(models, "a small red triangle moves down on a black background") == []
    assert compare.unknown_words(models, "A red FOX runs through the snow, fox!") == ["fox", "runs", "through", "snow"]
    note = compare.vocabulary_note(models, ["fox"])
    assert "**fox**" in note and "built-in model knows only" in note
    assert compare.vocabulary_note(models, []) == ""


def test_a_queued_request_sees_its_position_and_wait(monkeypatch):
    from app import compare_tab

    now = [100.0]
    monkeypatch.setattr(compare_tab.time, "monotonic", lambda: now[0])
    line = compare_tab._Queue()
    assert line.join() == "Starting…"
    line.start()  # the first run starts
    assert line.join() == "**Queued:** position 1 in line"  # no run has finished yet: no wait to promise
    now[0] = 130.0
    line.end()  # it took 30 s
    line.start()  # the second starts at 130 s
    now[0] = 140.0
    assert line.join() == "**Queued:** position 1 in line, expected wait about 20 s"
    assert line.join() == "**Queued:** position 2 in line, expected wait about 50 s"

"""The hand-written video analyser that scores the built-in model: right on real clips, wrong on wrong ones."""

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from factory.vae_ceiling import reconstruction_ceiling
from world.analyse import (
    OTHER,
    analyse,
    attribute_verdict,
    classify_shape,
    largest_component,
    parse_caption,
    score,
)
from world.synthetic import SyntheticVideoDataset, generate_sample, render_video


@pytest.fixture(scope="module", params=[(128, 160), (64, 80)], ids=["128x160", "64x80"])
def clips(request):
    # fresh draws of both splits (every motion, shape, colour, one or two objects, every background),
    # at the shipped size and at the half size a 4x4x4-stride VAE would use
    seed = int(np.random.default_rng().integers(1 << 30))
    height, width = request.param
    return seed, [
        generate_sample(i, seed=seed, split=split, num_frames=17, height=height, width=width)
        for split in ("train", "validation")
        for i in range(40)
    ]


@pytest.mark.slow  # reads real clips through the VAE
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
    attrs = {
        "background": "grey",
        "num_objects": 1,
        "held_out": False,
        "objects": [
            {
                "shape": "square",
                "colour": "red",
                "size": "large",
                "motion": "right",
                "start": [0.3, 0.5],
                "end": [0.7, 0.5],
            }
        ],
    }
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


def _flood_fill_sizes(mask):
    """Reference: 4-connected regions by breadth-first search, as (size, first pixel in row order, pixels)."""
    seen = np.zeros_like(mask)
    regions = []
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        seen[y, x] = True
        queue, pixels = deque([(y, x)]), []
        while queue:
            a, b = queue.popleft()
            pixels.append((a, b))
            for c, d in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
                if 0 <= c < mask.shape[0] and 0 <= d < mask.shape[1] and mask[c, d] and not seen[c, d]:
                    seen[c, d] = True
                    queue.append((c, d))
        regions.append((len(pixels), (int(y), int(x)), pixels))
    return regions


@pytest.mark.parametrize("density", [0.3, 0.5, 0.6, 0.75])
def test_largest_component_matches_a_flood_fill(density):
    rng = np.random.default_rng()
    for _ in range(20):
        h, w = rng.integers(1, 40, size=2)
        mask = rng.random((h, w)) < density
        got = largest_component(mask)
        regions = _flood_fill_sizes(mask)
        if not regions:
            assert not got.any() and got.shape == mask.shape
            continue
        size = max(r[0] for r in regions)
        first = min(r[1] for r in regions if r[0] == size)  # ties: the region met first in row order
        want = np.zeros_like(mask)
        for a, b in next(r[2] for r in regions if r[0] == size and r[1] == first):
            want[a, b] = True
        assert np.array_equal(got, want), (density, mask.astype(int))


def test_largest_component_checks_its_input():
    with pytest.raises(ValueError, match=r"mask must be \(H, W\), got shape \(2, 3, 4\)"):
        largest_component(np.zeros((2, 3, 4), bool))


def test_stray_pixels_do_not_change_the_shape():
    # a square plus specks of its colour in the frame's corners (a fringe, decoder noise): the box of
    # the whole mask would be the frame (fill ~0.1, read as a triangle or diamond); the object is a square
    yy, xx = np.mgrid[0:64, 0:80]
    square = (abs(xx - 40) <= 10) & (abs(yy - 32) <= 10)
    specks = square.copy()
    specks[0, 0] = specks[63, 79] = specks[2, 77] = specks[60, 3] = True
    assert classify_shape(square) == "square" and classify_shape(specks) == "square"
    circle = (xx - 40) ** 2 + (yy - 32) ** 2 <= 64
    assert classify_shape(circle | (specks & ~square)) == "circle"
    # a larger second region of the colour wins: the shape is read from it
    assert classify_shape(circle | ((abs(xx - 12) <= 10) & (abs(yy - 32) <= 10))) == "square"


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
def test_a_ragged_rim_does_not_make_a_square_a_circle():
    # seen on a fresh draw (seed 107346978, 64x80): a small blue square on a checkered background whose
    # anti-aliased edge pixels pass the colour test over the dark cells only; two of them below and two to
    # the left stretch its box from 11x11 to 12x12 (fill 0.87), which analyser v2 read as a circle
    sample = generate_sample(7, seed=107346978, split="validation", num_frames=17, height=64, width=80)
    assert sample.caption == "a small blue square stays still on a checkered background"
    verdict = analyse(sample.frames, sample.caption)
    assert verdict["shape"] is True, verdict["found"]
    # the same on masks drawn here: a square or a disc, its edge pixels on one side in x and one in y (where
    # a sub-pixel offset leaves partial coverage) kept at random, as over a checkered background
    rng = np.random.default_rng()
    yy, xx = np.mgrid[0:40, 0:40]
    discs_read_as_squares, squares_unread = [], []
    draws = 300
    for _ in range(draws):
        half, cx, cy = rng.uniform(4.5, 9), rng.uniform(15, 25), rng.uniform(15, 25)
        dx, dy = rng.choice([-1, 1], size=2)  # the rim: the shape moved by one pixel in x and in y, less itself
        square = (abs(xx - cx) <= half) & (abs(yy - cy) <= half)
        disc = (xx - cx) ** 2 + (yy - cy) ** 2 <= half**2
        moved_square = (abs(xx - dx - cx) <= half) & (abs(yy - dy - cy) <= half)
        moved_disc = (xx - dx - cx) ** 2 + (yy - dy - cy) ** 2 <= half**2
        keep = rng.random(square.shape) < rng.uniform(0.1, 0.5)
        ragged_square = square | (moved_square & keep)
        ragged_disc = disc | (moved_disc & keep)
        read = classify_shape(ragged_square)
        assert read in ("square", OTHER), (half, read, int(ragged_square.sum() - square.sum()))  # never a circle
        if read == OTHER:
            squares_unread.append(round(float(half), 2))
        if classify_shape(ragged_disc) == "square":
            discs_read_as_squares.append(round(float(half), 2))
    # analyser 4 reads outlines: a tiny square (half-side under ~6 px) with a random ragged rim may be unsure
    # ("other": 7 of 1,500 seeded draws), never a circle
    assert len(squares_unread) <= draws // 50, squares_unread
    # the corner test must not turn a disc into a square (a tiny disc with a rim may read as a diamond: rendered
    # discs, anti-aliased, do not; test_real_clips_score_perfectly checks those). A known limit: a small ragged
    # disc (radius 4.7-6.9 px) reads as a square in about 1 draw in 2,300 (13 of 30,000 seeded draws), so the
    # bound is a rate, not every draw (an unseeded every-draw assertion failed about 1 run in 25)
    assert len(discs_read_as_squares) <= draws // 100, discs_read_as_squares


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


class _BlurVAE:
    """Stands in for a VAE that loses detail: 8x8 average pooling of each frame, nearest upsampling back."""

    device, dtype = torch.device("cpu"), torch.float32

    def encode(self, x):
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=F.avg_pool3d(x, (1, 8, 8))))

    def decode(self, z):
        return SimpleNamespace(sample=F.interpolate(z, scale_factor=(1, 8, 8), mode="nearest"))


@pytest.mark.slow  # encodes and decodes every clip
def test_vae_ceiling_is_perfect_on_real_clips_and_drops_for_a_blurring_vae():
    seed = int(np.random.default_rng().integers(1 << 30))
    data = SyntheticVideoDataset(12, seed=seed, split="validation", num_frames=17, height=64, width=80)
    real = reconstruction_ceiling(None, data, range(12))
    assert real["overall"] == 1.0 and real["psnr_db"] == float("inf") and not real["failures"], seed
    blurred = reconstruction_ceiling(_BlurVAE(), data, range(12))
    assert blurred["psnr_db"] < 30 and blurred["psnr_object_db"] < blurred["psnr_db"], (seed, blurred)
    assert blurred["shape"] < 0.75 and blurred["overall"] < 0.75 and blurred["failures"], (seed, blurred)


class _DarkDriftVAE:
    """Stands in for a VAE that drifts on dark pixels over time: frame ``t`` of every pixel darker than
    -0.75 (black backgrounds only: the darkest colour channel is 40/255) comes back ``0.04 * t`` brighter."""

    device, dtype = torch.device("cpu"), torch.float32

    def encode(self, x):
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=x))

    def decode(self, z):
        t = torch.arange(z.shape[2], dtype=z.dtype).view(1, 1, -1, 1, 1)
        return SimpleNamespace(sample=z + 0.04 * t * (z < -0.75))


def test_vae_ceiling_breaks_psnr_down_by_background_and_frame():
    seed = int(np.random.default_rng().integers(1 << 30))
    pool = SyntheticVideoDataset(60, seed=seed, split="validation", num_frames=9, height=48, width=64)
    chosen: dict[str, list[int]] = {}
    for i in range(60):  # two clips of each background the pool has (black among them: 1 - 0.8^60)
        group = chosen.setdefault(pool.attributes(i)["background"], [])
        if len(group) < 2:
            group.append(i)
    indices = sorted(i for group in chosen.values() for i in group)
    res = reconstruction_ceiling(_DarkDriftVAE(), pool, indices)

    # reference: the drift applied and quantised here, errors pooled per background and per frame
    sums: dict[str, list[float]] = {}
    frame_sq, frame_n = np.zeros(9), np.zeros(9)
    for i in indices:
        real = pool[i]["video"].numpy().astype(np.float64)  # (3, T, H, W)
        drift = 0.04 * np.arange(9)[None, :, None, None] * (real < -0.75)
        seen = np.round((np.clip(real + drift, -1, 1) + 1) * 127.5)  # uint8 levels, what a user sees
        sq = ((seen - np.round((real + 1) * 127.5)) / 127.5) ** 2
        acc = sums.setdefault(pool.attributes(i)["background"], [0.0, 0])
        acc[0] += sq.sum()
        acc[1] += sq.size
        frame_sq += sq.sum(axis=(0, 2, 3))
        frame_n += sq[:, 0].size

    def psnr(mse):
        return 10 * np.log10(4.0 / mse) if mse > 0 else float("inf")

    got = res["psnr_by_background_db"]
    assert list(got) == sorted(chosen), (seed, got)
    for background, (total, count) in sums.items():
        assert got[background] == pytest.approx(psnr(total / count), abs=0.01), (seed, background, got)
    assert "black" in got and all(got["black"] < v for b, v in got.items() if b != "black"), (seed, got)
    frames = res["psnr_by_frame_db"]
    assert len(frames) == 9 and frames[0] == float("inf"), (seed, frames)
    assert all(a > b for a, b in zip(frames[1:], frames[2:])), (seed, frames)  # drifts further each frame
    assert frames == pytest.approx([psnr(s / n) for s, n in zip(frame_sq, frame_n)], abs=0.01), seed


def test_attribute_verdict_of_a_drawn_square():
    frames = np.full((5, 64, 64, 3), 128, np.uint8)  # grey background
    for t in range(5):
        frames[t, 24:40, 8 + 8 * t : 24 + 8 * t] = (230, 20, 20)  # a red square moving right
    assert attribute_verdict(frames, "a red square moves to the right") == (4, 4)
    assert attribute_verdict(frames, "a blue square moves to the right")[0] < 4
    assert attribute_verdict(frames, "a fox in the snow") is None


@pytest.mark.slow  # over a second on a quiet 2-core CPU: out of the fast tier (issue 51)
def test_second_world_clips_score_perfectly_and_a_cyan_fringe_is_not_an_object():
    from world.synthetic import WORLDS, generate_sample

    world = WORLDS["v2"]
    samples = [generate_sample(i, split="validation", height=128, width=160, world=world) for i in range(12)]
    verdicts = [analyse(s.frames, s.caption, colours=world.colours) for s in samples]
    assert score(verdicts)["overall"] == 1.0, [v["found"] for v in verdicts]
    # a cyan bar beside the object: an extra object among six colours, nothing in a world without cyan
    frames = samples[0].frames.copy()
    frames[:, 4:20, 4:40] = (40, 195, 210)
    assert analyse(frames, samples[0].caption)["count"] is False
    assert analyse(frames, samples[0].caption, colours=world.colours)["count"] is True

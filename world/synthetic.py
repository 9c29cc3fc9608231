"""A small synthetic text-to-video world: moving coloured shapes with matching captions.

Every sample is a pure function of ``(seed, split, index)``: its attributes are drawn from a
random generator seeded with those three numbers, and its frames are rendered from the
attributes alone. So sample 7 is the same whether 10 or 10,000 samples are generated, and
an evaluator can re-render or check any sample from its attribute dict.

World (see :class:`SyntheticWorld`): shapes (circle, square, triangle, diamond), six colours
well apart in hue, two sizes, eleven motions (left, right, up, down, four diagonals, bouncing,
static, growing), one or two objects of different colours whose paths never make them overlap, plain or textured (grey-toned)
backgrounds. A caption is built from one template::

    "a small red circle moves to the left on a grey background"
    "a large blue square moves up and a small yellow diamond grows on a checkered background"

Splits and held-out combinations: ``train`` never contains an object that matches any entry
of ``world.held_out`` (by default red triangles, blue circles, yellow squares and green
objects moving right), although every single attribute value still appears in train.
``validation`` alternates: even indices contain at least one held-out combination (tests
composition), odd indices are drawn like train (in-distribution loss). The attribute dict
says which: ``attributes["held_out"]``.

Frames are ``uint8`` arrays ``(frames, height, width, 3)``, rendered with 4x4 supersampling
(anti-aliased edges). Command line::

    python -m world.synthetic --out data/shapes --num 256 --frames 17 --height 64 --width 64 --seed 0

writes ``videos/*.mp4``, ``videos/*.txt`` captions and ``manifest.csv`` / ``manifest.jsonl``
(columns ``video``, ``caption``, ``split`` and the attributes), readable by
:class:`training.data.VideoFolderDataset`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

# Saturated colours at least ~40 degrees apart in hue, so a colour mask (or a small model)
# can tell them apart after lossy compression; no grey, because backgrounds are grey-toned.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "yellow": (235, 205, 40),
    "green": (40, 175, 70),
    "cyan": (40, 195, 210),
    "blue": (45, 85, 225),
    "purple": (150, 70, 205),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
# Base radius of an object as a fraction of min(height, width).
SIZES: dict[str, float] = {"small": 0.10, "large": 0.17, "big": 0.22, "huge": 0.25}
MOTIONS: tuple[str, ...] = (
    "left",
    "right",
    "up",
    "down",
    "up_left",
    "up_right",
    "down_left",
    "down_right",
    "bouncing",
    "static",
    "growing",
)
MOTION_PHRASES: dict[str, str] = {
    "left": "moves to the left",
    "right": "moves to the right",
    "up": "moves up",
    "down": "moves down",
    "up_left": "moves diagonally up and to the left",
    "up_right": "moves diagonally up and to the right",
    "down_left": "moves diagonally down and to the left",
    "down_right": "moves diagonally down and to the right",
    "bouncing": "bounces up and down",
    "static": "stays still",
    "growing": "grows",
}
# Plain backgrounds are one grey level; textured ones alternate two grey levels. All are
# unsaturated so that an object's colour is never confused with its background.
PLAIN_BACKGROUNDS: dict[str, int] = {"grey": 128, "black": 25, "white": 230}
TEXTURED_BACKGROUNDS: tuple[str, ...] = ("checkered", "striped")
BACKGROUNDS: tuple[str, ...] = (*PLAIN_BACKGROUNDS, *TEXTURED_BACKGROUNDS)

# Unit direction (x right, y down) of each straight-line motion.
_DIRECTIONS: dict[str, tuple[float, float]] = {
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
    "up_left": (-1, -1),
    "up_right": (1, -1),
    "down_left": (-1, 1),
    "down_right": (1, 1),
}
# Distance travelled over the clip, as a fraction of the frame along each axis.
STRAIGHT_TRAVEL = 0.40
DIAGONAL_TRAVEL = 0.30
BOUNCE_HEIGHT = 0.40
GROWTH_RANGE = (0.6, 1.4)  # radius multiplier at the first and the last frame
# Shapes reach at most this many radii from their centre (triangle vertices); placement keeps
# that much margin so an object never leaves the frame.
SHAPE_EXTENT = 1.25
SUPERSAMPLING = 4

SPLITS: tuple[str, ...] = ("train", "validation")

DEFAULT_HELD_OUT: tuple[dict[str, str], ...] = (
    {"colour": "red", "shape": "triangle"},
    {"colour": "blue", "shape": "circle"},
    {"colour": "yellow", "shape": "square"},
    {"colour": "green", "motion": "right"},
)


@dataclass(frozen=True)
class SyntheticWorld:
    """The vocabulary of the synthetic world and which attribute combinations train never sees.

    ``held_out`` entries are partial object descriptions (e.g. ``{"colour": "red", "shape":
    "triangle"}``); an object matches one when every listed attribute is equal. Narrow the
    world (e.g. ``max_objects=1``, ``backgrounds=("grey",)``) for quick smoke tests.
    """

    shapes: tuple[str, ...] = SHAPES
    colours: tuple[str, ...] = tuple(COLOURS)
    sizes: tuple[str, ...] = ("small", "large")  # the first world's; "big" is the second world's one size
    motions: tuple[str, ...] = MOTIONS
    backgrounds: tuple[str, ...] = BACKGROUNDS
    max_objects: int = 2
    two_object_probability: float = 0.4
    held_out: tuple[dict[str, str], ...] = field(default=DEFAULT_HELD_OUT)
    # probability that a caption leaves out the sizes, and (drawn apart) the background phrase, so a
    # model trained on them also follows short prompts ("a red square moves to the right")
    short_captions: float = 0.0
    # with short_captions > 0: the background a caption may leave unsaid. A clip on it names it half the
    # time and every other background is always named, so a prompt that names none means this one (a
    # model otherwise averages the five backgrounds into a texture). None: any background is left out
    # with probability short_captions.
    default_background: str | None = None
    # whether captions name the size ("a small red circle ..."); a world of one size leaves it unsaid
    size_words: bool = True

    def __post_init__(self):
        for name, values, known in (
            ("shapes", self.shapes, SHAPES),
            ("colours", self.colours, tuple(COLOURS)),
            ("sizes", self.sizes, tuple(SIZES)),
            ("motions", self.motions, MOTIONS),
            ("backgrounds", self.backgrounds, BACKGROUNDS),
        ):
            unknown = [v for v in values if v not in known]
            if not values or unknown:
                raise ValueError(f"world {name} must be a non-empty subset of {known}, got {values!r}")
        if self.default_background is not None and self.default_background not in self.backgrounds:
            raise ValueError(
                f"default_background must be one of the world's backgrounds {self.backgrounds} or None, "
                f"got {self.default_background!r}"
            )
        if self.max_objects not in (1, 2):
            raise ValueError(f"max_objects must be 1 or 2, got {self.max_objects!r}")
        if self.max_objects == 2 and len(self.colours) < 2:
            raise ValueError(f"two objects need two different colours, got colours={self.colours!r}")
        for combination in self.held_out:
            bad_keys = set(combination) - {"shape", "colour", "size", "motion"}
            if bad_keys:
                raise ValueError(f"held-out combination {combination!r} has unknown keys {sorted(bad_keys)}")

    def possible_held_out(self) -> tuple[dict[str, str], ...]:
        """Held-out combinations that objects of this (possibly narrowed) world can have."""
        vocab = {"shape": self.shapes, "colour": self.colours, "size": self.sizes, "motion": self.motions}
        return tuple(c for c in self.held_out if all(v in vocab[k] for k, v in c.items()))

    def is_held_out(self, obj: dict) -> bool:
        """Whether one object's attributes match any held-out combination."""
        return any(all(obj.get(k) == v for k, v in combination.items()) for combination in self.held_out)


@dataclass
class SyntheticSample:
    """One generated clip: ``frames`` uint8 ``(frames, height, width, 3)``, its caption and attributes."""

    frames: np.ndarray
    caption: str
    attributes: dict


# --------------------------------------------------------------------------- attributes


def _sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if index < 0:
        raise ValueError(f"sample index must be >= 0, got {index}")
    return np.random.default_rng([int(seed), SPLITS.index(split), int(index)])


def _sample_object(rng: np.random.Generator, world: SyntheticWorld, colours: tuple[str, ...]) -> dict:
    return {
        "shape": str(rng.choice(world.shapes)),
        "colour": str(rng.choice(colours)),
        "size": str(rng.choice(world.sizes)),
        "motion": str(rng.choice(world.motions)),
    }


def _sample_held_out_object(rng: np.random.Generator, world: SyntheticWorld) -> dict:
    possible = world.possible_held_out()
    combination = possible[rng.integers(len(possible))]
    obj = _sample_object(rng, world, world.colours)
    obj.update(combination)
    return obj


def _place(rng: np.random.Generator, obj: dict, aspect: float) -> None:
    """Chooses normalised start/end centres (x right, y down, in [0, 1]) that keep the object in frame.

    ``aspect`` is width / height; radii are relative to min(height, width).
    For ``bouncing``, ``end`` is the lowest point, reached mid-clip.
    """
    radius = SIZES[obj["size"]] * SHAPE_EXTENT * (GROWTH_RANGE[1] if obj["motion"] == "growing" else 1.0)
    # Radius as a fraction of each axis.
    margin_x = radius * min(1.0, 1.0 / aspect)
    margin_y = radius * min(1.0, aspect)
    motion = obj["motion"]
    if motion in _DIRECTIONS:
        dx, dy = _DIRECTIONS[motion]
        travel = DIAGONAL_TRAVEL if dx and dy else STRAIGHT_TRAVEL
        travel_x = min(travel, 1 - 2 * margin_x) * abs(dx)
        travel_y = min(travel, 1 - 2 * margin_y) * abs(dy)
    elif motion == "bouncing":
        travel_x, travel_y, dx, dy = 0.0, min(BOUNCE_HEIGHT, 1 - 2 * margin_y), 0, 1
    else:  # static, growing
        travel_x = travel_y = 0.0
        dx = dy = 0
    # Start anywhere the whole path fits.
    lo_x = margin_x + (travel_x if dx < 0 else 0.0)
    hi_x = 1 - margin_x - (travel_x if dx > 0 else 0.0)
    lo_y = margin_y + (travel_y if dy < 0 else 0.0)
    hi_y = 1 - margin_y - (travel_y if dy > 0 else 0.0)
    start = (float(rng.uniform(lo_x, max(lo_x, hi_x))), float(rng.uniform(lo_y, max(lo_y, hi_y))))
    obj["start"] = [round(start[0], 4), round(start[1], 4)]
    obj["end"] = [round(start[0] + dx * travel_x, 4), round(start[1] + dy * travel_y, 4)]


def _max_radius(obj: dict) -> float:
    return SIZES[obj["size"]] * (GROWTH_RANGE[1] if obj["motion"] == "growing" else 1.0)


def _placed_apart(rng: np.random.Generator, objects: list[dict], aspect: float, tries: int = 50) -> bool:
    """Places the objects; with two, retries until their paths never bring them closer than the
    sum of their radii (in units of min(height, width)), so neither hides the other. False if no try did."""
    for _ in range(tries):
        for obj in objects:
            _place(rng, obj, aspect)
        if len(objects) == 1:
            return True
        times = np.linspace(0, 1, 9)
        # Normalised coordinates -> units of min(height, width).
        to_units = np.array([max(1.0, aspect), max(1.0, 1.0 / aspect)])
        gap = (_centres(objects[0], times) - _centres(objects[1], times)) * to_units
        if np.min(np.hypot(*gap.T)) > _max_radius(objects[0]) + _max_radius(objects[1]):
            return True
    return False


def sample_attributes(
    seed: int, index: int, split: str = "train", world: SyntheticWorld | None = None, aspect: float = 1.0
) -> dict:
    """Draws the attribute dict of sample ``index`` of ``split``; deterministic in its arguments.

    Returns ``{"background", "num_objects", "held_out", "objects": [{"shape", "colour", "size",
    "motion", "start": [x, y], "end": [x, y]}, ...]}`` with normalised positions (x right, y down).
    ``aspect`` is width / height of the frames the sample will be rendered at.
    """
    world = world or SyntheticWorld()
    rng = _sample_rng(seed, split, index)
    num_objects = 2 if world.max_objects == 2 and rng.random() < world.two_object_probability else 1
    want_held_out = split == "validation" and index % 2 == 0 and bool(world.possible_held_out())
    # Rejection sampling keeps train free of held-out combinations and two objects apart; bounded
    # so that a world whose every combination is held out fails loudly instead of looping forever.
    for _ in range(1000):
        objects = []
        if want_held_out:
            objects.append(_sample_held_out_object(rng, world))
        while len(objects) < num_objects:
            used = {o["colour"] for o in objects}
            objects.append(_sample_object(rng, world, tuple(c for c in world.colours if c not in used)))
        if want_held_out:
            rng.shuffle(objects)  # the held-out object is not always the first one in the caption
        held_out = any(world.is_held_out(o) for o in objects)
        if held_out == want_held_out and _placed_apart(rng, objects, aspect):
            break
    else:
        raise ValueError(
            f"could not draw a {split} sample in 1000 tries: the held-out combinations {world.held_out!r} "
            "(or keeping two objects apart) rule out nearly every draw of this world"
        )
    return {
        "background": str(rng.choice(world.backgrounds)),
        "num_objects": num_objects,
        "held_out": held_out,
        "objects": objects,
    }


# the second design, sized to what a 6-layer, width-128 model learns on 2 cores: one object
# per clip, 48-64 px across at 128x160 (about 7 latent cells: radius 0.22 of the frame's short side),
# no cyan (it fringed into blue and green), straight motions and static, plain backgrounds; the
# size goes unsaid and a caption may leave out the default grey background
_V2 = SyntheticWorld(
    colours=("red", "yellow", "green", "blue", "purple"),
    sizes=("big",),
    motions=("left", "right", "up", "down", "static"),
    backgrounds=("grey", "black", "white"),
    max_objects=1,
    short_captions=0.5,
    default_background="grey",
    size_words=False,
)
WORLDS: dict[str, SyntheticWorld] = {
    # the world the shipped built-in model was trained on: six colours, two sizes, eleven
    # motions, five backgrounds, 40% of clips with two objects
    "v1": SyntheticWorld(),
    "v2": _V2,
    # the third design: the second world with a larger object (radius 0.25 of the short side: 32 px
    # across at 64x80, 8 latent cells of a 4x VAE), rendered at 64x80 and 9 frames
    "v3": dataclasses.replace(_V2, sizes=("huge",)),
}


def world_named(name: str, **overrides) -> SyntheticWorld:
    """The world preset ``name`` (see :data:`WORLDS`), with fields replaced by the ``overrides`` that are not None."""
    import dataclasses

    if name not in WORLDS:
        raise ValueError(f"unknown synthetic world {name!r}; expected one of {sorted(WORLDS)}")
    return dataclasses.replace(WORLDS[name], **{k: v for k, v in overrides.items() if v is not None})


def caption_for(attributes: dict, sizes: bool = True, background: bool = True) -> str:
    """``"a small red circle moves to the left and ... on a grey background"``; without ``sizes`` /
    ``background`` the size words / the background phrase are left out. An image's objects (motion ``None``,
    see :func:`image_attributes`) have no motion phrase: ``"a red circle on a grey background"``."""
    clauses = [
        f"a {o['size'] + ' ' if sizes else ''}{o['colour']} {o['shape']}"
        + (f" {MOTION_PHRASES[o['motion']]}" if o["motion"] is not None else "")
        for o in attributes["objects"]
    ]
    return " and ".join(clauses) + (f" on a {attributes['background']} background" if background else "")


# image i of a split draws its attributes as clip IMAGE_INDEX_OFFSET + i does, so images are other scenes than
# the clips of the same seed (a cache of clips and one of images hold no common scene)
IMAGE_INDEX_OFFSET = 1 << 40


def image_attributes(
    seed: int, index: int, split: str = "train", world: SyntheticWorld | None = None, aspect: float = 1.0
) -> dict:
    """The attribute dict of image ``index`` (a one-frame sample for joint image-video training): a clip's
    scene frozen at a time drawn along its path, each object with motion ``None`` (its caption names no motion)
    and ``start == end`` (at that time's centre and radius); deterministic in its arguments."""
    attributes = sample_attributes(seed, IMAGE_INDEX_OFFSET + index, split, world, aspect)
    time = np.random.default_rng([int(seed), SPLITS.index(split), int(index), 2]).random()
    for obj in attributes["objects"]:
        centre = _centres(obj, np.array([time]))[0]
        if obj["motion"] == "growing":  # its radius at that time, as a size of its own (kept in the frame)
            obj["scale"] = float(_radius_scale(obj, np.array([time]))[0])
        obj["start"] = obj["end"] = [round(float(centre[0]), 4), round(float(centre[1]), 4)]
        obj["motion"] = None
    return attributes


def sample_caption(seed: int, index: int, split: str, attributes: dict, world: SyntheticWorld) -> str:
    """The caption of sample ``index``: the full template, or a short form with ``world.short_captions``."""
    if world.short_captions <= 0:
        return caption_for(attributes, sizes=world.size_words)
    rng = np.random.default_rng([int(seed), SPLITS.index(split), int(index), 1])
    sizes, u = world.size_words and rng.random() >= world.short_captions, rng.random()
    if world.default_background is None:
        background = u >= world.short_captions
    else:
        background = attributes["background"] != world.default_background or u >= 0.5
    return caption_for(attributes, sizes=sizes, background=background)


# --------------------------------------------------------------------------- rendering


def _centres(obj: dict, times: np.ndarray) -> np.ndarray:
    """Normalised centres ``(len(times), 2)`` of an object at clip times in [0, 1]."""
    start, end = np.asarray(obj["start"], float), np.asarray(obj["end"], float)
    t = np.asarray(times, float)[:, None]
    if obj["motion"] == "bouncing":
        # Falls from start to end (the floor) and rebounds: |cos| gives the sharp turn of a bounce.
        return end - (end - start) * np.abs(np.cos(np.pi * t))
    return start + (end - start) * t


def _radius_scale(obj: dict, times: np.ndarray) -> np.ndarray:
    if obj["motion"] == "growing":
        return GROWTH_RANGE[0] + (GROWTH_RANGE[1] - GROWTH_RANGE[0]) * np.asarray(times, float)
    return np.full(len(times), obj.get("scale", 1.0))


def _inside(shape: str, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Whether points at offsets (dx, dy), in radii from the centre (y down), are inside ``shape``."""
    if shape == "circle":
        return dx * dx + dy * dy <= 1.0
    if shape == "square":
        return np.maximum(np.abs(dx), np.abs(dy)) <= 0.85
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= 1.15
    if shape == "triangle":
        # Equilateral, pointing up, centroid at the centre, circumradius SHAPE_EXTENT.
        r = SHAPE_EXTENT
        return (dy <= r / 2) & (dy >= -r + math.sqrt(3) * np.abs(dx))
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def _coverage(shape: str, centre_x: float, centre_y: float, radius: float, height: int, width: int):
    """Anti-aliased coverage in [0, 1] of a shape over its pixel bounding box.

    Returns ``(coverage (h, w), top, left)``; coordinates in pixels, pixel (i, j) spans
    ``[j, j + 1) x [i, i + 1)``.
    """
    reach = radius * SHAPE_EXTENT + 1
    top, bottom = max(0, int(centre_y - reach)), min(height, int(math.ceil(centre_y + reach)))
    left, right = max(0, int(centre_x - reach)), min(width, int(math.ceil(centre_x + reach)))
    if bottom <= top or right <= left:
        return np.zeros((0, 0)), top, left
    s = SUPERSAMPLING
    ys = top + (np.arange((bottom - top) * s) + 0.5) / s
    xs = left + (np.arange((right - left) * s) + 0.5) / s
    inside = _inside(shape, (xs[None, :] - centre_x) / radius, (ys[:, None] - centre_y) / radius)
    coverage = inside.reshape(bottom - top, s, right - left, s).mean(axis=(1, 3))
    return coverage, top, left


def render_background(name: str, height: int, width: int) -> np.ndarray:
    """Background ``(height, width, 3)`` float32 in [0, 255]."""
    if name in PLAIN_BACKGROUNDS:
        return np.full((height, width, 3), PLAIN_BACKGROUNDS[name], np.float32)
    rows, cols = np.arange(height)[:, None], np.arange(width)[None, :]
    cell = max(2, min(height, width) // 8)
    if name == "checkered":
        pattern = ((rows // cell + cols // cell) % 2).astype(bool)
    elif name == "striped":
        pattern = (((rows + cols) // cell) % 2).astype(bool)
    else:
        raise ValueError(f"unknown background {name!r}; expected one of {BACKGROUNDS}")
    grey = np.where(pattern, 150, 95).astype(np.float32)
    return np.repeat(grey[..., None], 3, axis=-1)


def render_video(attributes: dict, num_frames: int, height: int, width: int) -> np.ndarray:
    """Renders an attribute dict (see :func:`sample_attributes`) to uint8 ``(num_frames, height, width, 3)``."""
    if num_frames < 1 or height < 2 or width < 2:
        raise ValueError(f"need num_frames >= 1 and height, width >= 2, got {num_frames}, {height}, {width}")
    times = np.linspace(0.0, 1.0, num_frames) if num_frames > 1 else np.zeros(1)
    background = render_background(attributes["background"], height, width)
    frames = np.repeat(background[None], num_frames, axis=0)
    base = min(height, width)
    for obj in attributes["objects"]:  # later objects are drawn on top
        colour = np.asarray(COLOURS[obj["colour"]], np.float32)
        centres = _centres(obj, times) * np.array([width, height])
        radii = SIZES[obj["size"]] * base * _radius_scale(obj, times)
        for f in range(num_frames):
            coverage, top, left = _coverage(obj["shape"], *centres[f], radii[f], height, width)
            h, w = coverage.shape
            alpha = coverage[..., None].astype(np.float32)
            region = frames[f, top : top + h, left : left + w]
            region[:] = region * (1 - alpha) + colour * alpha
    return np.clip(np.rint(frames), 0, 255).astype(np.uint8)


def generate_sample(
    index: int,
    *,
    seed: int = 0,
    split: str = "train",
    num_frames: int = 17,
    height: int = 64,
    width: int = 64,
    world: SyntheticWorld | None = None,
    images: bool = False,
) -> SyntheticSample:
    """Generates sample ``index`` of ``split``: frames uint8 ``(num_frames, height, width, 3)``, caption, attributes.
    With ``images`` it is image ``index`` (:func:`image_attributes`: a still scene whose caption names no motion;
    ``num_frames`` must then be 1)."""
    world = world or SyntheticWorld()
    if images and num_frames != 1:
        raise ValueError(f"an image is one frame, got num_frames={num_frames}")
    draw = image_attributes if images else sample_attributes
    attributes = draw(seed, index, split, world, aspect=width / height)
    frames = render_video(attributes, num_frames, height, width)
    return SyntheticSample(
        frames=frames, caption=sample_caption(seed, index, split, attributes, world), attributes=attributes
    )


class SyntheticVideoDataset(Dataset):
    """Map-style torch dataset rendering samples on the fly (no files), items like
    :class:`training.data.VideoFolderDataset`'s: ``{"video": float32 (3, T, H, W) in [-1, 1],
    "caption": str, "index": int}``. Accepts an int or a ``ClipKey(index, epoch)`` (the epoch
    does not change a synthetic clip). ``attributes(i)`` gives sample ``i``'s attribute dict.
    ``images=True``: one-frame stills of the same world (:func:`image_attributes`), ``num_frames`` 1.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        split: str = "train",
        num_frames: int = 17,
        height: int = 64,
        width: int = 64,
        world: SyntheticWorld | None = None,
        images: bool = False,
    ):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if images and num_frames != 1:
            raise ValueError(f"an image dataset's samples are one frame, got num_frames={num_frames}")
        _sample_rng(seed, split, 0)  # validates the split name now rather than in a worker
        self.num_samples, self.seed, self.split = num_samples, seed, split
        self.num_frames, self.height, self.width = num_frames, height, width
        self.world = world or SyntheticWorld()
        self.images = images

    def __len__(self) -> int:
        return self.num_samples

    def attributes(self, index: int) -> dict:
        """Sample ``index``'s attribute dict (see :func:`sample_attributes`, :func:`image_attributes`)."""
        draw = image_attributes if self.images else sample_attributes
        return draw(self.seed, index, self.split, self.world, aspect=self.width / self.height)

    def __getitem__(self, key) -> dict:
        index = int(key[0] if isinstance(key, tuple) else key)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} synthetic samples")
        sample = generate_sample(
            index,
            seed=self.seed,
            split=self.split,
            num_frames=self.num_frames,
            height=self.height,
            width=self.width,
            world=self.world,
            images=self.images,
        )
        video = torch.from_numpy(sample.frames).permute(3, 0, 1, 2).float() / 127.5 - 1.0
        return {"video": video, "caption": sample.caption, "index": index}


# --------------------------------------------------------------------------- files


def sample_clips(count: int, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``count`` clips of the default world (samples ``0 ... count - 1`` of :func:`generate_sample`), uint8
    ``(count, frames, height, width, 3)``: what the app fits its live previews' colour map on for the built-in
    model."""
    return np.stack(
        [generate_sample(i, seed=seed, num_frames=frames, height=height, width=width).frames for i in range(count)]
    )


def write_mp4(path: str | Path, frames: np.ndarray, fps: float = 16) -> None:
    """Writes uint8 ``(T, H, W, 3)`` frames as H.264 mp4 at near-lossless quality so colours survive."""
    from common.video import write_mp4 as write_video

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"H.264 yuv420p needs even height and width, got {frames.shape[1]}x{frames.shape[2]}")
    write_video(path, frames, fps=fps, quality=9)


def _flat_row(video: str, caption: str, split: str, attributes: dict) -> dict:
    """Manifest row: object attributes flattened as shape, colour, ... and shape_2, colour_2, ..."""
    row = {"video": video, "caption": caption, "split": split}
    row.update({k: attributes[k] for k in ("background", "num_objects", "held_out")})
    for i in range(2):
        suffix = "" if i == 0 else f"_{i + 1}"
        obj = attributes["objects"][i] if i < len(attributes["objects"]) else {}
        for key in ("shape", "colour", "size", "motion"):
            row[key + suffix] = obj.get(key, "")
    return row


def write_dataset(
    out_dir: str | Path,
    num_samples: int,
    *,
    seed: int = 0,
    split: str = "train",
    num_frames: int = 17,
    height: int = 64,
    width: int = 64,
    fps: float = 16,
    world: SyntheticWorld | None = None,
    progress: bool = True,
) -> Path:
    """Writes ``num_samples`` clips of ``split`` as mp4 plus manifests; returns the JSONL manifest path.

    Layout: ``out_dir/videos/{split}_{index:06d}.mp4`` with a ``.txt`` caption beside each,
    ``out_dir/manifest.csv`` (flat attribute columns) and ``out_dir/manifest.jsonl`` (one
    object per line: ``video``, ``caption``, ``split``, ``attributes``). Video paths are
    relative to the manifest.
    """
    from tqdm import tqdm

    from common.outputs import write_text_atomic

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    out_dir = Path(out_dir)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    rows, records = [], []
    for index in tqdm(range(num_samples), desc=f"synthetic {split}", unit="video", disable=not progress):
        sample = generate_sample(
            index, seed=seed, split=split, num_frames=num_frames, height=height, width=width, world=world
        )
        video = f"videos/{split}_{index:06d}.mp4"
        write_mp4(out_dir / video, sample.frames, fps=fps)
        write_text_atomic((out_dir / video).with_suffix(".txt"), sample.caption + "\n")
        rows.append(_flat_row(video, sample.caption, split, sample.attributes))
        records.append({"video": video, "caption": sample.caption, "split": split, "attributes": sample.attributes})
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(out_dir / "manifest.csv", table.getvalue())
    jsonl_path = out_dir / "manifest.jsonl"
    write_text_atomic(jsonl_path, "".join(json.dumps(record) + "\n" for record in records))
    return jsonl_path


def main(argv: list[str] | None = None) -> int:
    """``python -m world.synthetic``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="world.synthetic")


def check_arguments(args: argparse.Namespace) -> None:
    """The command's values, before any work: ValueError naming the option and what was expected."""
    from common.errors import check_seed
    from common.outputs import resolve_output_folder
    from common.video import check_fps

    if args.num < 1:
        raise ValueError(f"--num {args.num}: expected at least 1 video")
    if args.frames < 1:
        raise ValueError(f"--frames {args.frames}: expected at least 1 frame (e.g. 17)")
    for name in ("height", "width"):
        value = getattr(args, name)
        if value < 8:
            raise ValueError(f"--{name} {value}: expected at least 8 pixels (e.g. 64)")
    try:
        check_fps(args.fps)
    except ValueError:
        raise ValueError(f"--fps {args.fps}: expected a frame rate > 0 (e.g. 16)") from None
    check_seed(args.seed)
    resolve_output_folder(args.out)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic moving-shapes text-to-video dataset.")
    parser.add_argument("--out", required=True, help="output folder (videos/ and manifest.csv/.jsonl go here)")
    parser.add_argument("--num", type=int, required=True, help="number of videos")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--fps", type=float, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("--max-objects", type=int, choices=(1, 2), default=2)
    parser.add_argument("--backgrounds", choices=("all", "plain"), default="all", help="plain: no textures")
    args = parser.parse_args(argv)
    check_arguments(args)  # everything before the first video is drawn
    world = SyntheticWorld(
        max_objects=args.max_objects,
        backgrounds=BACKGROUNDS if args.backgrounds == "all" else tuple(PLAIN_BACKGROUNDS),
    )
    manifest = write_dataset(
        args.out,
        args.num,
        seed=args.seed,
        split=args.split,
        num_frames=args.frames,
        height=args.height,
        width=args.width,
        fps=args.fps,
        world=world,
    )
    print(f"wrote {args.num} {args.split} videos and {manifest} (+ manifest.csv)")


if __name__ == "__main__":
    raise SystemExit(main())

"""The conditioning probe: swapping a word the model reads raises its loss; a word it ignores gives ratio 1."""

import pytest
import torch
import torch.nn.functional as F

from training.probe import SwapProbe, describe, swapped
from world.synthetic import COLOURS, WORLDS, caption_for, sample_attributes

WORLD = WORLDS["v2"]


class BagOfWords:
    """A stand-in encoder: latents are the clip pooled 8x8 in space and 4x in time; a caption's "embedding"
    is its word counts over the whole world vocabulary (one token)."""

    def __init__(self):
        self.words: list[str] = []

    def latents(self, video):
        return F.avg_pool3d(video, (1, 8, 8))[:, :, ::4]

    def text(self, captions):
        for c in captions:
            self.words += [w for w in c.split() if w not in self.words]
        return torch.stack([torch.tensor([[float(c.split().count(w)) for w in self.words]]) for c in captions])


class ReadsColour(torch.nn.Module):
    """Predicts from the noisy input plus a term from the colour words' counts only."""

    def __init__(self, words):
        super().__init__()
        self.colour = torch.tensor([1.0 if w in COLOURS else 0.0 for w in words])
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        width = encoder_hidden_states.shape[-1]
        colour = (encoder_hidden_states[:, 0, :] * self.colour[:width] * torch.arange(1.0, width + 1)).sum(-1)
        return (self.scale * hidden_states + colour.view(-1, 1, 1, 1, 1) * 0.1,)


def test_swapped_changes_one_word_only():
    attrs = sample_attributes(0, 3, "validation", WORLD, aspect=160 / 128)
    for attribute in ("colour", "shape", "motion", "background"):
        other = swapped(attrs, attribute, WORLD)
        before, after = caption_for(attrs, sizes=False), caption_for(other, sizes=False)
        assert before != after
        holder, changed = (attrs, other) if attribute == "background" else (attrs["objects"][0], other["objects"][0])
        assert changed[attribute] != holder[attribute]
        # every other attribute kept
        keys = {"shape", "colour", "motion"} - {attribute}
        assert all(other["objects"][0][k] == attrs["objects"][0][k] for k in keys)
    single = WORLDS["v2"].__class__(**{**WORLD.__dict__, "shapes": ("circle",), "held_out": ()})
    assert swapped(sample_attributes(0, 1, "train", single), "shape", single) is None


def test_a_model_that_reads_only_colour_has_ratio_one_elsewhere():
    encoder = BagOfWords()
    probe = SwapProbe(encoder, WORLD, num_frames=5, height=32, width=32, num_clips=4, sigmas=(0.4, 0.8))
    model = ReadsColour(encoder.words)
    result = probe(model)
    assert set(result["ratio"]) == {"colour", "shape", "motion", "background"}
    for attribute in ("shape", "motion", "background"):
        for r in result["ratio"][attribute].values():
            assert r == pytest.approx(1.0, abs=1e-6)
    assert all(abs(r - 1.0) > 1e-3 for r in result["ratio"]["colour"].values())
    assert "colour" in describe(result)


def test_a_model_that_ignores_text_is_flat():
    encoder = BagOfWords()
    probe = SwapProbe(encoder, WORLD, num_frames=5, height=32, width=32, num_clips=2, sigmas=(0.5,))
    model = ReadsColour(encoder.words)
    model.colour.zero_()
    assert all(r == pytest.approx(1.0, abs=1e-6) for r in probe(model)["mean_ratio"].values())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_clips"):
        SwapProbe(BagOfWords(), WORLD, 5, 32, 32, num_clips=0)
    with pytest.raises(ValueError, match="sigmas"):
        SwapProbe(BagOfWords(), WORLD, 5, 32, 32, sigmas=(1.5,))
    with pytest.raises(ValueError, match="split"):
        SwapProbe(BagOfWords(), WORLD, 5, 32, 32, split="test")


def test_the_train_split_probe_reads_the_clips_a_synthetic_dataset_starts_with():
    """``split="train"``: the probe's clips are the first training clips of the same seed, the ones a
    synthetic cache holds first (an overfitting check reads clips the model has seen); the default is unseen."""
    from world.synthetic import SyntheticVideoDataset

    seen = SyntheticVideoDataset(16, seed=3, num_frames=5, height=32, width=32, world=WORLD)
    unseen = SyntheticVideoDataset(3, seed=3, split="validation", num_frames=5, height=32, width=32, world=WORLD)
    for split, data in (("train", seen), ("validation", unseen)):
        encoder = BagOfWords()
        probe = SwapProbe(encoder, WORLD, num_frames=5, height=32, width=32, num_clips=3, seed=3, split=split)
        want = torch.stack([F.avg_pool3d(data[i]["video"][None], (1, 8, 8))[0, :, ::4] for i in range(3)])
        torch.testing.assert_close(probe.latents, want)
    from training.config import load_config

    with pytest.raises(ValueError, match="validation.probe_split"):
        load_config("configs/finetune/tiny.yaml", ["validation.probe_split=test"])

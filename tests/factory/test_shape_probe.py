"""factory.shape_probe: its sampler follows the flow exactly, and both diagnoses run on the built-in model."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from factory import shape_probe


class StraightFlow(torch.nn.Module):
    """A stand-in transformer that predicts the velocity of the straight path from ``x0`` to ``noise``
    (``noise - x0``), plus ``push`` times the text's mean, so guidance has something to scale."""

    def __init__(self, x0, noise, push=0.0):
        super().__init__()
        self.x0, self.noise, self.push = x0, noise, push
        self.config = SimpleNamespace(patch_size=(1, 2, 2))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        v = (self.noise - self.x0).expand_as(hidden_states) + self.push * encoder_hidden_states.mean()
        return (v,)


def test_the_sampler_lands_on_the_clean_latents_of_a_straight_flow():
    g = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    x0, noise = torch.randn(1, 4, 2, 4, 4, generator=g), torch.randn(1, 4, 2, 4, 4, generator=g)
    text, empty = torch.randn(1, 3, 8, generator=g), torch.zeros(1, 3, 8)
    for s in (1.0, 0.7, 0.3):
        sigmas = shape_probe.flow_sigmas(7, 3.0, s)
        assert sigmas[0] == s and sigmas[-1] == 0.0 and all(a > b for a, b in zip(sigmas, sigmas[1:]))
        start = (1 - s) * x0 + s * noise
        out = shape_probe.denoise(StraightFlow(x0, noise), start, sigmas, text, empty, 4.0)
        torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    # guidance scales the text's part of the velocity: v_empty + g (v_text - v_empty), integrated over s
    push = StraightFlow(x0, noise, push=1.0)
    out = shape_probe.denoise(push, noise, shape_probe.flow_sigmas(5, 3.0), text, empty, 3.0)
    torch.testing.assert_close(out, x0 - 3.0 * text.mean(), rtol=0, atol=1e-5)


def test_the_schedule_is_wans_shifted_one():
    # shift 3 maps s to 3s / (1 + 2s): the 4-step schedule's inner points 0.75, 0.5, 0.25 -> 0.9, 0.75, 0.5
    assert shape_probe.flow_sigmas(4, 3.0) == pytest.approx([1.0, 0.9, 0.75, 0.5, 0.0])
    assert shape_probe.flow_sigmas(4, 3.0, 0.8) == pytest.approx([0.8, 0.75, 0.5, 0.0])


@pytest.mark.slow
def test_both_diagnoses_run_on_the_built_in_model(tmp_path):
    from pipelines.model_dir import builtin_info

    if builtin_info().get("world") != "v3":
        pytest.skip("the shipped built-in model is not the third design")
    out = tmp_path / "u"
    assert shape_probe.main(["unconditional", "--seeds", "1", "--steps", "3", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["frames"] == 9 and 0 <= res["shape_rate"] <= 1 and sum(res["readings"].values()) == 9
    assert 0 <= res["object_rate"] <= 1 and sum(res["backgrounds"].values()) == 1
    out = tmp_path / "s"
    assert shape_probe.main(["swap", "--clips", "2", "--sigmas", "0.2", "0.9", "--steps", "3", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert set(res["sigmas"]) == {"0.2", "0.9"} and all(r["clips"] == 2 for r in res["sigmas"].values())
    assert res["sigmas"]["0.2"]["kept"] == 2  # at low noise the clip's own outline survives denoising
    assert np.all([c["swapped_to"] != c["shape"] for c in res["per_clip"]])

    out = tmp_path / "n"
    argv = ["uncaptioned", "--clips", "2", "--sigmas", "0.2", "0.95", "--steps", "3", "--out", str(out)]
    assert shape_probe.main(argv) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert set(res["sigmas"]) == {"0.2", "0.95"} and all(r["clips"] == 2 for r in res["sigmas"].values())
    low = res["sigmas"]["0.2"]
    assert low["background"] == 2 and low["colour"] == 2  # at low noise the clip survives without its caption


def test_the_background_is_read_from_rendered_clips():
    from world.analyse import parse_caption
    from world.synthetic import SyntheticVideoDataset, world_named

    world = world_named("v3")
    data = SyntheticVideoDataset(24, seed=3, split="train", num_frames=5, height=64, width=80, world=world)
    seen = set()
    for i in range(len(data)):
        item = data[i]
        video = item["video"]  # (T, C, H, W) in [-1, 1] or uint8 frames: make uint8 (T, H, W, 3)
        frames = video if video.dtype == torch.uint8 else ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        frames = frames.permute(0, 2, 3, 1).numpy() if frames.shape[1] == 3 else frames.numpy()
        named = parse_caption(item["caption"])["background"] or data.attributes(i)["background"]
        assert shape_probe.read_background(frames, world.backgrounds) == named, item["caption"]
        seen.add(named)
    assert seen == {"grey", "black", "white"}
    with pytest.raises(ValueError, match="no plain one"):
        shape_probe.read_background(frames, ("checkered",))

"""The object-weighted flow loss (``flow.object_weight``, issue 37): the objects' latent cells of flat-background
data weigh more. Checked against a reference written here from the formula, cell by cell, with the object placed
by hand (not found by the code under test), forward and backward, on fresh random inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training.config import FlowSection, load_config
from training.flow import FlowMatching

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "finetune" / "tiny.yaml")


def clip_with_objects(seed: int, shape=(2, 4, 3, 6, 7)):
    """Latents ``(B, C, F, H, W)``: each frame one background value per channel (plus noise far below the
    threshold) and a rectangle, placed per sample and frame, offset by 2-3 in every channel. Returns the latents and
    the rectangles' mask ``(B, F, H, W)``."""
    g = torch.Generator().manual_seed(seed)
    b, c, f, h, w = shape
    latents = torch.randn(b, c, f, 1, 1, generator=g).expand(shape).clone()
    latents += 0.05 * torch.randn(shape, generator=g)
    mask = torch.zeros(b, f, h, w, dtype=torch.bool)
    for i in range(b):
        for t in range(f):
            y, x = (int(v) for v in torch.randint(0, 3, (2,), generator=g))
            mask[i, t, y : y + 2, x : x + 3] = True  # 6 of 42 cells: a minority, as an object is
            sign = 1 if i % 2 == 0 else -1
            latents[i, :, t][:, mask[i, t]] += sign * (2 + torch.rand(c, 1, generator=g))
    return latents, mask


def reference_loss(pred, target, mask, object_weight):
    """Sum over cells and channels of weight x squared error, divided by the sum of the weights x channels."""
    b, c, f, h, w = pred.shape
    num = pred.new_zeros(())
    den = 0.0
    for i in range(b):
        for t in range(f):
            for y in range(h):
                for x in range(w):
                    weight = 1.0 + object_weight if mask[i, t, y, x] else 1.0
                    for ch in range(c):
                        num = num + weight * (pred[i, ch, t, y, x] - target[i, ch, t, y, x]) ** 2
                        den += weight
    return num / den


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_object_mask_finds_the_objects_placed_by_hand(seed):
    latents, mask = clip_with_objects(seed)
    found = FlowMatching(FlowSection(object_weight=3.0)).object_mask(latents)
    assert found.shape == (2, 1, 3, 6, 7)
    assert torch.equal(found[:, 0], mask)


@pytest.mark.parametrize("seed,object_weight", [(3, 4.0), (4, 0.5)])
def test_weighted_loss_and_its_gradient_match_the_reference(seed, object_weight):
    latents, mask = clip_with_objects(seed)
    g = torch.Generator().manual_seed(100 + seed)
    target = torch.randn(latents.shape, generator=g)
    pred = torch.randn(latents.shape, generator=g, requires_grad=True)
    pred_ref = pred.detach().clone().requires_grad_(True)
    got = FlowMatching(FlowSection(object_weight=object_weight)).loss(pred, target, latents)
    want = reference_loss(pred_ref, target, mask, object_weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(pred.grad, pred_ref.grad, rtol=1e-5, atol=1e-7)
    # and the weighting is not a no-op on these inputs (their errors differ between object and background cells)
    assert not torch.isclose(got.detach(), F.mse_loss(pred.detach(), target))


def test_zero_weight_is_the_plain_mse_and_a_uniform_error_keeps_its_scale():
    latents, _ = clip_with_objects(5)
    g = torch.Generator().manual_seed(6)
    pred, target = torch.randn(latents.shape, generator=g), torch.randn(latents.shape, generator=g)
    assert torch.equal(FlowMatching().loss(pred, target, latents), F.mse_loss(pred, target))
    same = target + 0.3  # the same squared error in every cell: any weighting returns it
    torch.testing.assert_close(
        FlowMatching(FlowSection(object_weight=9.0)).loss(same, target, latents), torch.tensor(0.09)
    )


def test_the_config_keys_reach_the_loss_and_bad_values_are_refused():
    cfg = load_config(TINY, ["flow.object_weight=4", "flow.object_threshold=0.5"])
    flow = FlowMatching(cfg.flow)  # as training.finetune builds it
    assert (flow.settings.object_weight, flow.settings.object_threshold) == (4.0, 0.5)
    with pytest.raises(ValueError, match=r"flow\.object_weight=-1: expected a value >= 0"):
        load_config(TINY, ["flow.object_weight=-1"])
    with pytest.raises(ValueError, match=r"flow\.object_threshold=0: expected a value > 0"):
        load_config(TINY, ["flow.object_threshold=0"])
    # a section built in code gets the same checks, from the same schema
    with pytest.raises(ValueError, match=r"flow\.object_weight=-2\.0: expected a value >= 0"):
        FlowMatching(FlowSection(object_weight=-2.0))
    with pytest.raises(ValueError, match=r"flow\.weighting='normal': expected one of \('logit_normal', 'uniform'\)"):
        FlowMatching(FlowSection(weighting="normal"))

"""The moving average of the trained weights against the formula written out by hand, per scalar."""

import pytest
import torch

from training.ema import EMA


def test_ema_follows_the_warmed_up_formula(gen):
    model = torch.nn.Linear(3, 2)
    decay = 0.95
    ema = EMA(model, ["weight"], decay)
    start = model.weight.detach().double().clone()
    expected = start.clone()
    for n in range(25):
        with torch.no_grad():
            model.weight.add_(torch.randn(model.weight.shape, generator=gen))
            model.bias.add_(1.0)
        ema.update(model)
        d = min(decay, (1.0 + n) / (10.0 + n))  # warm-up, then the configured decay (reached at n = 170 here)
        expected = d * expected + (1 - d) * model.weight.detach().double()
    assert ema.updates == 25 and set(ema.shadow) == {"weight"}  # bias is not tracked
    torch.testing.assert_close(ema.shadow["weight"].double(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(expected, model.weight.detach().double())


def test_the_decay_reaches_the_configured_value_after_warm_up():
    ema = EMA(torch.nn.Linear(1, 1), ["weight"], 0.5)
    assert ema.rate() == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    ema.updates = 8
    assert ema.rate() == 0.5  # 9 / 18 = 0.5: capped from here on
    ema.updates = 100
    assert ema.rate() == 0.5


def test_swapped_in_holds_the_average_and_gives_the_raw_weights_back(gen):
    model = torch.nn.Linear(4, 4)
    ema = EMA(model, ["weight", "bias"], 0.9)
    with torch.no_grad():
        model.weight.add_(torch.randn(4, 4, generator=gen))
    ema.update(model)
    raw = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with ema.swapped_in(model) as m:
        assert torch.equal(m.weight, ema.shadow["weight"]) and torch.equal(m.bias, ema.shadow["bias"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw[k])
    with pytest.raises(RuntimeError), ema.swapped_in(model):  # given back even when the block fails
        raise RuntimeError("boom")
    assert torch.equal(model.weight, raw["weight"])


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.1, 1.5])
def test_bad_decay_and_unknown_names_are_refused(decay):
    with pytest.raises(ValueError, match=f"EMA decay {decay!r}: expected a value in"):
        EMA(torch.nn.Linear(1, 1), ["weight"], decay)
    with pytest.raises(ValueError, match="has no parameters"):
        EMA(torch.nn.Linear(1, 1), ["nope"], 0.9)

"""The CPE of converted self-attention layers (``AttentionOptions.cpe``, the paper's Table 3a): a depthwise 3x3x3
convolution of ``v`` over the latent-token grid added to the attention output. Checked against a neighbour sum
written here (its own token-to-grid map), forward and backward; zero at the start, so turning it on in a trained
conversion changes nothing; saved and loaded with the model."""

from __future__ import annotations

import pytest
import torch

from pipelines.attention import AttentionOptions
from pipelines.model import convert_self_attention
from pipelines.tiny import build_tiny_transformer
from tests import independent
from tests.pipelines.test_pipeline_attention import _capture_layer, _forward

GRID = (3, 4, 6)  # the token grid of test_pipeline_attention's inputs


def neighbour_sum(v: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grid) -> torch.Tensor:
    """``v`` ``(B, N, C)``, token n at frame n // (H*W), row (n // W) % H, column n % W; each channel c:
    bias[c] + sum over the 27 offsets inside the grid of weight[c, 0, df+1, dh+1, dw+1] * v at the neighbour."""
    f, h, w = grid
    out = bias.view(1, 1, -1).expand(v.shape[0], v.shape[1], -1).clone()
    for n in range(v.shape[1]):
        t, y, x = n // (h * w), (n // w) % h, n % w
        for dt in (-1, 0, 1):
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    tt, yy, xx = t + dt, y + dy, x + dx
                    if 0 <= tt < f and 0 <= yy < h and 0 <= xx < w:
                        m = tt * h * w + yy * w + xx
                        out[:, n] = out[:, n] + weight[:, 0, dt + 1, dy + 1, dx + 1] * v[:, m]
    return out


def _randomise(conv, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.2)
        conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.1)


@pytest.mark.parametrize("variant", ["mhla", "linear"])
def test_the_layer_output_is_attention_plus_the_neighbour_sum(variant):
    model = build_tiny_transformer(seed=5, num_layers=2)
    convert_self_attention(model, variant, options=AttentionOptions(blocks=(3, 2, 2), cpe=True))
    attr = "mhla" if variant == "mhla" else "linear_attn"
    layer = getattr(model.blocks[0].attn1, attr)
    _randomise(layer.cpe, 1)
    seen, hooks = _capture_layer(model, 0)
    _forward(model)
    for h in hooks:
        h.remove()
    q, k, v = (seen[n].unflatten(2, (2, -1)).double() for n in ("q", "k", "v"))
    if variant == "mhla":
        mixing = independent.constrain(layer.mhla.mixing.weight.detach().double())
        attn = independent.mhla_dense(q, k, v, GRID, (3, 2, 2), mixing, rope=seen["rope"])
    else:
        import mhla

        attn = mhla.linear_attention_dense(q, k, v, normalize=False, rotary_emb=seen["rope"])
    w = layer.norm_out.weight.double()
    attn = attn / torch.sqrt(attn.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    cpe = neighbour_sum(seen["v"].double(), layer.cpe.weight.double(), layer.cpe.bias.double(), GRID)
    torch.testing.assert_close(seen["out"].double(), attn.flatten(2, 3) + cpe, rtol=2e-4, atol=2e-5)
    assert cpe.abs().mean() > 1e-2  # the check could tell a missing term


def test_its_gradient_matches_the_neighbour_sums():
    from pipelines.attention import LinearSelfAttention

    module = LinearSelfAttention("mhla", 32, 2, 16, AttentionOptions(blocks=(3, 2, 2), cpe=True, output_norm="none"))
    _randomise(module.cpe, 3)
    g = torch.Generator().manual_seed(4)
    n = GRID[0] * GRID[1] * GRID[2]
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for _ in range(3))
    v.requires_grad_(True)
    out = module(q, k, v, GRID)
    upstream = torch.randn(out.shape, generator=g)
    (out * upstream).sum().backward()
    # the attention part alone (no CPE) and the neighbour sum, each differentiated on its own
    module_plain = LinearSelfAttention("mhla", 32, 2, 16, AttentionOptions(blocks=(3, 2, 2), output_norm="none"))
    module_plain.load_state_dict({k2: v2 for k2, v2 in module.state_dict().items() if not k2.startswith("cpe.")})
    v2 = v.detach().double().requires_grad_(True)
    w2 = module.cpe.weight.detach().double().requires_grad_(True)
    b2 = module.cpe.bias.detach().double().requires_grad_(True)
    ref = module_plain(q, k, v2.float(), GRID).double() + neighbour_sum(v2.flatten(2), w2, b2, GRID).unflatten(
        2, (2, 16)
    )
    (ref * upstream.double()).sum().backward()
    torch.testing.assert_close(v.grad.double(), v2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(module.cpe.weight.grad.double(), w2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(module.cpe.bias.grad.double(), b2.grad, rtol=1e-4, atol=1e-5)


def test_turning_it_on_in_a_converted_model_changes_nothing_and_it_saves(tmp_path):
    from pipelines import load_transformer, save_transformer

    model = convert_self_attention(
        build_tiny_transformer(seed=9, num_layers=3), "mhla", options=AttentionOptions(blocks=(3, 2, 2))
    )
    with torch.no_grad():  # a trained conversion: mixing moved off its initialisation
        for block in model.blocks:
            block.attn1.mhla.mhla.mixing.weight.mul_(torch.rand_like(block.attn1.mhla.mhla.mixing.weight))
    before = _forward(model)
    model.convert("mhla", options=AttentionOptions(blocks=(3, 2, 2), cpe=True))
    assert all(block.attn1.mhla.cpe is not None for block in model.blocks)
    torch.testing.assert_close(_forward(model), before, rtol=0, atol=0)
    _randomise(model.blocks[1].attn1.mhla.cpe, 2)
    changed = _forward(model)
    assert not torch.allclose(changed, before, atol=1e-4)
    save_transformer(model, tmp_path / "t")
    loaded = load_transformer(tmp_path / "t", dtype=torch.float32, device="cpu")
    assert loaded.conversion.options.cpe
    torch.testing.assert_close(_forward(loaded), changed, rtol=0, atol=0)
    # a model with trained CPE weights cannot silently drop them
    with pytest.raises(ValueError, match="cpe=True"):
        loaded.convert("mhla", options=AttentionOptions(blocks=(3, 2, 2)))


def test_it_refuses_context_parallelism_by_name():
    from pipelines.attention import LinearSelfAttention

    module = LinearSelfAttention("linear", 32, 2, 16, AttentionOptions(cpe=True))
    x = torch.zeros(1, 72, 2, 16)
    with pytest.raises(ValueError, match="context parallelism"):
        module(x, x, x, GRID, parallel=object())

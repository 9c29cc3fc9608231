"""Conversion of the Wan transformer's self-attention: what changes, what does not, and the math."""

from __future__ import annotations

import math

import pytest
import torch

import mhla
from mhla import resample_mixing
from pipelines.attention import (
    AttentionOptions,
    LinearSelfAttnProcessor,
    SoftmaxSelfAttnProcessor,
    hybrid_layers,
    linear_layers_for,
    parse_layers,
)
from pipelines.model import convert_self_attention, model_blocks, resolve_model_blocks, set_variant
from pipelines.tiny import build_tiny_transformer
from tests import independent


def _inputs(grid=(3, 4, 6), seed=0, text_tokens=8):
    """Seeded transformer inputs for a latent-token grid (patch 1x2x2 -> latent H, W twice the grid)."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    return dict(
        hidden_states=torch.randn(1, 16, f, 2 * h, 2 * w, generator=g),
        timestep=torch.tensor([700]),
        encoder_hidden_states=torch.randn(1, text_tokens, 32, generator=g),
        return_dict=False,
    )


def _forward(model, grid=(3, 4, 6), seed=0):
    with torch.no_grad():
        return model(**_inputs(grid, seed))[0]


@pytest.fixture(scope="module")
def base_state():
    return {k: v.clone() for k, v in build_tiny_transformer(seed=3).state_dict().items()}


@pytest.mark.parametrize("variant", ["flash", "linear", "mhla", "mhla-hybrid"])
def test_conversion_changes_only_requested_self_attention(variant, base_state):
    model = build_tiny_transformer(seed=3)
    cross_before = {n: p for n, p in model.attn_processors.items() if ".attn2." in n}
    convert_self_attention(model, variant, options=AttentionOptions(blocks=(2, 2, 3)))

    expected = {"flash": [], "linear": list(range(30)), "mhla": list(range(30)), "mhla-hybrid": hybrid_layers(30)}
    targets = expected[variant]
    if variant == "mhla-hybrid":
        assert len(targets) == 20 and all(i % 3 != 0 for i in targets)

    state = model.state_dict()
    # every pretrained tensor (cross-attention, FFN, norms, q/k/v/out projections...) is byte-identical
    for key, before in base_state.items():
        assert torch.equal(state[key], before), key
    # the only new tensors are the variant's own parameters, in exactly the requested layers
    new_keys = set(state) - set(base_state)
    attr = "linear_attn" if variant == "linear" else "mhla"
    assert {int(k.split(".")[1]) for k in new_keys} == set(targets)
    assert all(f".attn1.{attr}." in k for k in new_keys)
    if variant in ("mhla", "mhla-hybrid"):
        mixing = [k for k in new_keys if k.endswith("mixing.weight")]
        assert len(mixing) == len(targets)
        assert state[mixing[0]].shape == (12, 12)

    procs = model.attn_processors
    for i in range(30):
        p = procs[f"blocks.{i}.attn1.processor"]
        assert isinstance(p, LinearSelfAttnProcessor if i in targets else SoftmaxSelfAttnProcessor)
    for name, proc in cross_before.items():
        assert procs[name] is proc  # cross-attention processors are the very same objects
    assert model.conversion.to_config()["linear_layers"] == targets
    assert model.config["self_attention"]["variant"] == variant


def test_one_processor_instance_per_layer():
    model = convert_self_attention(build_tiny_transformer(seed=3), "mhla-hybrid")
    procs = [p for n, p in model.attn_processors.items() if ".attn1." in n]
    assert len({id(p) for p in procs}) == 30


@pytest.mark.slow  # generates with the tiny model
def test_flash_matches_diffusers_processor():
    model = build_tiny_transformer(seed=4)
    reference = _forward(model)
    convert_self_attention(model, "flash")
    out = _forward(model)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert model.blocks[0].attn1.processor.context.softmax_backend is not None


def _capture_layer(model, layer: int):
    """Hooks that record q, k, v (after norm_q/norm_k), rotary_emb and the attention output before to_out."""
    attn = model.blocks[layer].attn1
    seen = {}
    hooks = [
        attn.norm_q.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out)),
        attn.norm_k.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out)),
        attn.to_v.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out)),
        attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("rope", a[3])),
        attn.to_out[0].register_forward_pre_hook(lambda m, a: seen.__setitem__("out", a[0])),
    ]
    return seen, hooks


@pytest.mark.parametrize(
    "grid,blocks,normalize,output_norm",
    [
        ((3, 4, 6), (3, 2, 2), False, "rms_head"),  # paper's Wan settings, even split
        ((3, 5, 13), (2, 2, 5), True, "none"),  # uneven split (tiny analogue of 21x30x52), normalizer on
        ((1, 4, 6), (3, 2, 2), False, "rms_head"),  # fewer frames than frame blocks: layout shrinks to 1x2x2
    ],
)
def test_mhla_layer_equals_dense_reference(grid, blocks, normalize, output_norm):
    model = build_tiny_transformer(seed=5, num_layers=3)
    options = AttentionOptions(blocks=blocks, normalize=normalize, output_norm=output_norm)
    convert_self_attention(model, "mhla", options=options)
    module = model.blocks[1].attn1.mhla
    with torch.no_grad():  # a trained-looking mixing matrix: signed noise, some entries past 1 and below 0
        module.mhla.mixing.weight.add_(
            torch.randn(module.mhla.mixing.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.8
        )
        if module.norm_out is not None:
            module.norm_out.weight.normal_()
    raw = module.mhla.mixing.weight.detach().double()
    assert (raw < 0).any() and (raw > 1).any()
    seen, hooks = _capture_layer(model, 1)
    _forward(model, grid)
    for h in hooks:
        h.remove()

    heads = model.blocks[1].attn1.heads
    q, k, v = (seen[n].unflatten(2, (heads, -1)).double() for n in ("q", "k", "v"))
    fitted = tuple(min(b, s) for b, s in zip(blocks, grid, strict=True))
    mixing = independent.constrain(raw)
    if fitted != tuple(blocks):
        mixing = independent.nearest_block_resample(mixing, blocks, fitted)
    ref = independent.mhla_dense(q, k, v, grid, fitted, mixing, normalize=normalize, rope=seen["rope"])
    if module.norm_out is not None:
        w = module.norm_out.weight.double()
        ref = ref / torch.sqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(seen["out"].double(), ref.flatten(2, 3), rtol=2e-4, atol=2e-5)
    assert math.prod(seen["q"].shape[:2]) == math.prod(grid)


def test_rope_switched_off_is_not_applied():
    model = build_tiny_transformer(seed=5, num_layers=2)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(1, 2, 2), rope=False, output_norm="none"))
    seen, hooks = _capture_layer(model, 0)
    _forward(model)
    for h in hooks:
        h.remove()
    q, k, v = (seen[n].unflatten(2, (2, -1)).double() for n in ("q", "k", "v"))
    mixing = independent.constrain(model.blocks[0].attn1.mhla.mhla.mixing.weight.detach().double())
    plain = independent.mhla_dense(q, k, v, (3, 4, 6), (1, 2, 2), mixing, rope=None)
    rotated = independent.mhla_dense(q, k, v, (3, 4, 6), (1, 2, 2), mixing, rope=seen["rope"])
    torch.testing.assert_close(seen["out"].double(), plain.flatten(2, 3), rtol=2e-4, atol=2e-5)
    assert not torch.allclose(plain, rotated, rtol=1e-3, atol=1e-4)  # the check could tell them apart


def test_output_gate_formula():
    model = build_tiny_transformer(seed=8, num_layers=2)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(1, 2, 2), output_gate=True))
    layer = model.blocks[0].attn1
    gate = layer.mhla.gate
    with torch.no_grad():
        gate.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(1))
        gate.bias.normal_(generator=torch.Generator().manual_seed(2))
    seen, hooks = _capture_layer(model, 0)
    hooks.append(layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0])))
    _forward(model)
    for h in hooks:
        h.remove()
    q, k, v = (seen[n].unflatten(2, (2, -1)).double() for n in ("q", "k", "v"))
    mixing = independent.constrain(layer.mhla.mhla.mixing.weight.detach().double())
    ref = independent.mhla_dense(q, k, v, (3, 4, 6), (1, 2, 2), mixing, rope=seen["rope"])
    w = layer.mhla.norm_out.weight.double()
    ref = ref / torch.sqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    x = seen["x"].double()
    scale = 2.0 / (1.0 + torch.exp(-(x @ gate.weight.double().T + gate.bias.double())))  # 2 * sigmoid
    torch.testing.assert_close(seen["out"].double(), ref.flatten(2, 3) * scale, rtol=2e-4, atol=2e-5)


def test_linear_layer_equals_dense_reference():
    model = build_tiny_transformer(seed=6, num_layers=2)
    convert_self_attention(model, "linear", options=AttentionOptions(normalize=True, output_norm="none"))
    seen, hooks = _capture_layer(model, 0)
    _forward(model)
    for h in hooks:
        h.remove()
    q, k, v = (seen[n].unflatten(2, (2, -1)).double() for n in ("q", "k", "v"))
    ref = mhla.linear_attention_dense(q, k, v, normalize=True, rotary_emb=seen["rope"])
    torch.testing.assert_close(seen["out"].double(), ref.flatten(2, 3), rtol=2e-4, atol=2e-5)


def test_resample_mixing_to_one_frame_block():
    layout = mhla.BlockLayout((21, 30, 50), (7, 3, 5))
    m = mhla.locality_init(layout).float()
    out = resample_mixing(m, (7, 3, 5), (1, 3, 5))
    assert out.shape == (15, 15)
    # one frame block sits at the centre: its rows are those of the middle frame block (3 of 7),
    # and the weights of all 7 frame blocks fold onto the one that is left
    expected = m.view(7, 15, 7, 15)[3].sum(dim=1)
    torch.testing.assert_close(out, expected / expected.sum(-1, keepdim=True))
    torch.testing.assert_close(out.sum(-1), torch.ones(15))
    assert resample_mixing(m, (7, 3, 5), (7, 3, 5)) is m


def test_resample_mixing_per_head_and_differentiable():
    m = torch.rand(4, 12, 12, requires_grad=True)
    out = resample_mixing(m, (3, 2, 2), (2, 1, 2))
    assert out.shape == (4, 4, 4)
    assert (out >= 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(4, 4))
    out[..., 0].sum().backward()
    assert m.grad is not None and m.grad.abs().sum() > 0


def test_variant_switch_keeps_weights():
    model = build_tiny_transformer(seed=7, num_layers=6)
    flash = _forward(model)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(3, 2, 2)))
    with torch.no_grad():
        for block in model.blocks:
            block.attn1.mhla.mhla.mixing.weight.uniform_(0.0, 1.0)
    mixed = _forward(model)
    assert not torch.allclose(mixed, flash)

    set_variant(model, "flash")
    torch.testing.assert_close(_forward(model), flash, rtol=1e-5, atol=1e-5)
    set_variant(model, "mhla")
    torch.testing.assert_close(_forward(model), mixed, rtol=0, atol=0)
    set_variant(model, "mhla-hybrid", layers=[1, 2])
    assert model.conversion.to_config()["linear_layers"] == [1, 2]
    with pytest.raises(ValueError, match="needs linear parameters in layers"):
        set_variant(model, "linear")
    with pytest.raises(ValueError, match="built with blocks"):
        convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(1, 2, 2)))


def test_layer_lists():
    assert linear_layers_for("mhla-hybrid", 30) == [i for i in range(30) if i % 3]
    assert linear_layers_for("mhla-hybrid", 30, [5, 1, 1]) == [1, 5]
    assert parse_layers("1,2,4-6") == [1, 2, 4, 5, 6]
    with pytest.raises(ValueError, match="out of range"):
        linear_layers_for("mhla-hybrid", 30, [30])
    with pytest.raises(ValueError, match="mhla-hybrid' only"):
        linear_layers_for("mhla", 30, [1])
    with pytest.raises(ValueError, match="unknown variant 'sparse'"):
        linear_layers_for("sparse", 30)


def test_output_gate_starts_as_identity():
    model = build_tiny_transformer(seed=8, num_layers=2)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(1, 2, 2)))
    ungated = _forward(model)
    gated = build_tiny_transformer(seed=8, num_layers=2)
    convert_self_attention(gated, "mhla", options=AttentionOptions(blocks=(1, 2, 2), output_gate=True))
    assert gated.blocks[0].attn1.mhla.gate is not None
    torch.testing.assert_close(_forward(gated), ungated, rtol=1e-6, atol=1e-6)


def test_clone_is_independent():
    from pipelines.model import clone_transformer

    model = convert_self_attention(
        build_tiny_transformer(seed=10, num_layers=4), "mhla", options=AttentionOptions(blocks=(1, 2, 2))
    )
    clone = clone_transformer(model)
    assert clone.conversion.to_config() == model.conversion.to_config()
    torch.testing.assert_close(_forward(clone), _forward(model), rtol=0, atol=0)
    set_variant(clone, "flash")
    _forward(clone, grid=(2, 3, 3))  # the clone records its own grid, not the original's
    assert clone.blocks[0].attn1.processor.context.grid == (2, 3, 3)
    assert model.blocks[0].attn1.processor.context.grid == (3, 4, 6)
    assert model.conversion.to_config()["variant"] == "mhla"
    assert (
        clone.blocks[0].attn1.mhla.mhla.mixing.weight.data_ptr()
        != model.blocks[0].attn1.mhla.mhla.mixing.weight.data_ptr()
    )


def test_unnormalised_output_survives_float16():
    # without the normalizer phi(q) S grows with the token count; it must reach the RMSNorm in float32
    from pipelines.attention import LinearSelfAttention

    module = LinearSelfAttention("mhla", 64, 4, 16, AttentionOptions(blocks=(1, 2, 2))).half()
    g = torch.Generator().manual_seed(0)
    q = (4 * torch.randn(1, 3600, 4, 16, generator=g)).half()
    v = (50 * torch.randn(1, 3600, 4, 16, generator=g)).half()
    out = module(q, q, v, (4, 30, 30))
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float().pow(2).mean(-1), torch.ones(1, 3600, 4), rtol=1e-2, atol=1e-2)


def test_each_mhla_call_applies_the_block_rule_once_and_reports_what_ran(monkeypatch):
    model = build_tiny_transformer(seed=3, num_layers=4)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(3, 2, 2)))
    calls = []
    original = mhla.module.resolve_blocks

    def counting(grid, *args, **kwargs):
        calls.append(tuple(grid))
        return original(grid, *args, **kwargs)

    monkeypatch.setattr(mhla.module, "resolve_blocks", counting)
    ctx = model.attention_context
    ctx.layouts.clear()
    _forward(model, grid=(1, 4, 6))  # one frame: the model's 3 frame blocks shrink to 1
    assert calls == [(1, 4, 6)] * 4  # once per layer call: the processor's note and the layer share the answer
    assert ctx.layouts == {"1x2x2 blocks (M=4) over a 1x4x6 grid (N=24) (shrunk from 3x2x2)"}
    # every processor knows the variant it runs by that name (not by its parameters' kind)
    procs = [p for n, p in model.attn_processors.items() if ".attn1." in n]
    assert {p.variant for p in procs} == {"mhla"}
    convert_self_attention(model, "mhla-hybrid", [1, 2])
    assert {p.variant for n, p in model.attn_processors.items() if ".attn1." in n} == {"mhla-hybrid", "flash"}


def test_a_layout_resolved_for_other_blocks_is_refused():
    layer = mhla.MHLA((2, 2, 2))
    q = torch.randn(1, 24, 2, 4)
    with pytest.raises(ValueError, match="resolved for 1x2x2 blocks was passed to an MHLA module with 2x2x2 blocks"):
        layer(q, q, q, mhla.resolve_blocks((3, 4, 2), own=(1, 2, 2)))
    torch.testing.assert_close(layer(q, q, q, layer.resolve((3, 4, 2))), layer(q, q, q, (3, 4, 2)))


def test_model_blocks_are_the_models_own_else_none():
    model = build_tiny_transformer(seed=3, num_layers=2)
    assert model_blocks(model) is None
    assert resolve_model_blocks(model, (3, 4, 6), block_shape=(3, 2, 2)).blocks == mhla.default_blocks(
        (3, 4, 6), (3, 2, 2)
    )
    convert_self_attention(model, "linear")
    assert model_blocks(model) is None  # linear layers have no blocks: a later MHLA conversion is free to choose
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(3, 2, 2)))
    convert_self_attention(model, "flash")
    assert model_blocks(model) == (3, 2, 2)  # kept while it runs as flash: its mixing matrices are 12x12
    r = resolve_model_blocks(model, (1, 4, 6))
    assert r.blocks == (3, 2, 2) and r.layout.blocks == (1, 2, 2)

"""Issue 50's levers on the part of the Wan step every variant pays, on a CPU: fused q, k, v projections give the
same numbers for every variant, and the torch.compile mode reaches torch.compile (what it makes of them is the
next GPU call's measurement, benchmarks/run_gpu.sh stage levers)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import wan_step
from mhla.compiled import TORCH_COMPILE_MODES, compile_transformer
from pipelines import AttentionOptions, convert_self_attention, set_variant
from pipelines.attention import LINEAR, MHLA


def tiny_model(layers: int = 2):
    config = dict(wan_step.CONFIGS["tiny"], num_layers=layers)
    model = wan_step.build_transformer(config, torch.device("cpu"), torch.float32, seed=0)
    options = AttentionOptions(blocks="1x2x2")
    convert_self_attention(model, LINEAR, options=options)
    convert_self_attention(model, MHLA, options=options)
    return model, config


def test_fused_projections_keep_every_variants_numbers(gen):
    model, config = tiny_model()
    inputs = wan_step.latent_inputs(config, (2, 4, 6), 2, 16, torch.device("cpu"), torch.float32, gen)
    run = wan_step.forward_fn(model, inputs)
    before = {}
    for variant in ("flash", "linear", "mhla"):
        set_variant(model, variant)
        before[variant] = run()
    assert wan_step.fuse_qkv(model) == 2 * 2  # each layer's self- and cross-attention
    attn = model.blocks[0].attn1
    assert attn.fused_projections and attn.to_qkv.weight.shape == (3 * attn.to_q.out_features, attn.to_q.in_features)
    for variant, expected in before.items():
        set_variant(model, variant)
        after = run()
        # one product instead of three: the same sums in another order
        torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5, msg=variant)
        assert not torch.equal(after, torch.zeros_like(after))


def test_compile_mode_reaches_torch_compile(monkeypatch):
    model, _ = tiny_model(layers=1)
    seen = []
    monkeypatch.setattr(type(model), "compile_repeated_blocks", lambda self, **kw: seen.append(("blocks", kw)))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(("full", kw)))
    compile_transformer(model, "blocks", backend="aot_eager", compile_mode="reduce-overhead")
    compile_transformer(model, "blocks", backend="aot_eager", compile_mode="reduce-overhead")  # the same: nothing
    compile_transformer(model, "full", backend="aot_eager")  # torch.compile's default: no mode passed
    assert seen == [
        ("blocks", {"fullgraph": False, "backend": "aot_eager", "mode": "reduce-overhead"}),
        ("full", {"fullgraph": False, "backend": "aot_eager"}),
    ]
    assert model._mhla_compiled == ("full", "aot_eager", False)  # what pipelines.caching unpacks
    with pytest.raises(ValueError, match="compile_mode must be one of .*got 'fast'"):
        compile_transformer(model, "blocks", backend="aot_eager", compile_mode="fast")
    assert set(wan_step.TORCH_COMPILE_MODES) == set(TORCH_COMPILE_MODES)


def test_wan_step_refuses_a_compile_mode_without_compile(tmp_path):
    argv = ["--device", "cpu", "--config", "tiny", "--layers", "1", "--grids", "2x4x6", "--text-len", "16"]
    with pytest.raises(SystemExit, match="--compile-mode reduce-overhead needs --compile"):
        wan_step.main([*argv, "--compile-mode", "reduce-overhead", "--no-save"])

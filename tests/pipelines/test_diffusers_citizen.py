"""A converted model behaves as a diffusers model: from_pretrained, torch.compile, memory hooks, backends.

Every check goes through diffusers' own entry points (``from_pretrained``, ``DiffusionPipeline``,
``enable_group_offload``, ``enable_layerwise_casting``, ``compile_repeated_blocks``,
``set_attention_backend``) on tiny converted models, and compares with the same model without the feature.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from diffusers import DiffusionPipeline, WanPipeline, WanTransformer3DModel

from pipelines.attention import PARAM_ATTRS, AttentionOptions, LinearSelfAttnProcessor, SoftmaxSelfAttnProcessor
from pipelines.model import convert_self_attention
from pipelines.tiny import build_tiny_components, build_tiny_transformer

VARIANTS = ("flash", "linear", "mhla", "mhla-hybrid")
LAYERS = 3
HYBRID = [1, 2]  # layer 0 stays softmax
OPTIONS = AttentionOptions(blocks=(1, 2, 2), output_gate=True)


def _converted(variant: str, seed: int = 0, layers: int = LAYERS):
    """A tiny converted transformer whose every weight is moved off its initial value (so a parameter that
    loads as freshly initialised, or not at all, changes the output)."""
    model = build_tiny_transformer(seed, num_layers=layers)
    convert_self_attention(model, variant, HYBRID if variant == "mhla-hybrid" else None, OPTIONS)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _inputs(seed: int = 0, timestep: int = 700):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g),  # token grid 2x4x4
        timestep=torch.tensor([timestep]),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
        return_dict=False,
    )


def _run(model, **kw):
    with torch.no_grad():
        return model(**_inputs(**kw))[0]


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def _expected_kinds(variant: str) -> list[str]:
    """What each layer's self-attention should run, written from the variant's definition."""
    if variant == "flash":
        return ["softmax"] * LAYERS
    if variant == "mhla-hybrid":
        return ["softmax" if i not in HYBRID else "mhla" for i in range(LAYERS)]
    return [variant] * LAYERS


def _kinds(model) -> list[str]:
    out = []
    for block in model.blocks:
        p = block.attn1.processor
        out.append("softmax" if isinstance(p, SoftmaxSelfAttnProcessor) else p.param_kind)
    return out


# ---- 1. from_pretrained


@pytest.mark.parametrize("variant", VARIANTS)
def test_plain_from_pretrained_restores_the_variant(variant, tmp_path):
    from pipelines.model import MHLAWanTransformer3DModel

    model = _converted(variant)
    before = _run(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["_class_name"] == "MHLAWanTransformer3DModel"
    assert config["self_attention"]["variant"] == variant

    loaded = MHLAWanTransformer3DModel.from_pretrained(tmp_path)
    assert type(loaded) is MHLAWanTransformer3DModel
    assert loaded.conversion.to_config() == model.conversion.to_config()
    assert _kinds(loaded) == _expected_kinds(variant)
    _assert_same_weights(loaded, model)
    torch.testing.assert_close(_run(loaded), before, rtol=0, atol=0)


def test_sharded_and_variant_files_round_trip(tmp_path):
    from pipelines.model import MHLAWanTransformer3DModel

    model = _converted("mhla-hybrid")
    model.save_pretrained(tmp_path, max_shard_size="40KB", variant="ema")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and all(".ema-" in s for s in shards)
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.ema.json").is_file()
    with pytest.raises(EnvironmentError):  # no files without the variant name
        MHLAWanTransformer3DModel.from_pretrained(tmp_path)
    loaded = MHLAWanTransformer3DModel.from_pretrained(tmp_path, variant="ema")
    _assert_same_weights(loaded, model)
    assert _kinds(loaded) == _expected_kinds("mhla-hybrid")


def test_bfloat16_keeps_the_mixing_matrix_float32(tmp_path):
    from pipelines.model import MHLAWanTransformer3DModel

    model = _converted("mhla")
    model.save_pretrained(tmp_path / "f32")
    loaded = MHLAWanTransformer3DModel.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16)
    ref = model.state_dict()
    for name, t in loaded.state_dict().items():
        if name.endswith("mixing.weight"):
            assert t.dtype == torch.float32 and torch.equal(t, ref[name]), name
    assert loaded.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.blocks[0].attn1.to_q.weight, ref["blocks.0.attn1.to_q.weight"].bfloat16())
    assert loaded.blocks[0].attn1.mhla.norm_out.weight.dtype == torch.bfloat16

    # and back through a bfloat16 save: the file keeps the float32 mixing
    loaded.save_pretrained(tmp_path / "bf16")
    again = MHLAWanTransformer3DModel.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    _assert_same_weights(again, loaded)
    out = _run(again.float())
    assert torch.isfinite(out).all()


def test_pipeline_folder_names_the_class_and_loads_through_diffusers(tmp_path):
    parts = build_tiny_components(0)
    convert_self_attention(parts["transformer"], "mhla-hybrid", [1, 2, 4], OPTIONS)
    WanPipeline(**parts).save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["pipelines.model", "MHLAWanTransformer3DModel"]
    for cls in (DiffusionPipeline, WanPipeline):
        pipe = cls.from_pretrained(tmp_path)
        assert type(pipe) is WanPipeline
        assert pipe.transformer.conversion.to_config() == parts["transformer"].conversion.to_config()
        _assert_same_weights(pipe.transformer, parts["transformer"])


def test_a_plain_wan_loader_drops_the_conversion_and_says_so(tmp_path):
    """What diffusers does with a converted folder loaded as a plain WanTransformer3DModel: softmax attention,
    a warning naming the ignored config key and one naming the unused weights (no hook lets us refuse)."""
    import diffusers

    model = _converted("mhla")
    model.save_pretrained(tmp_path)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger = diffusers.utils.logging.get_logger("diffusers")
    logger.addHandler(handler)
    try:
        plain = WanTransformer3DModel.from_pretrained(tmp_path)
    finally:
        logger.removeHandler(handler)
    assert type(plain) is WanTransformer3DModel
    text = "\n".join(records)
    assert "self_attention" in text and "not expected and will be ignored" in text
    assert "were not used" in text and "attn1.mhla.mhla.mixing.weight" in text
    assert not (_run(plain) - _run(model)).abs().max() < 1e-3  # really a different model


def test_load_transformer_is_from_pretrained(tmp_path):
    from pipelines.loading import load_transformer
    from pipelines.model import MHLAWanTransformer3DModel

    model = _converted("linear")
    model.save_pretrained(tmp_path)
    ours = load_transformer(tmp_path, dtype="float32", device="cpu")
    theirs = MHLAWanTransformer3DModel.from_pretrained(tmp_path)
    assert type(ours) is MHLAWanTransformer3DModel
    _assert_same_weights(ours, theirs)
    torch.testing.assert_close(_run(ours), _run(theirs), rtol=0, atol=0)


def test_a_folder_saved_with_the_plain_class_name_still_loads(tmp_path):
    """Folders written before the class existed name WanTransformer3DModel with a self_attention entry."""
    from pipelines.model import MHLAWanTransformer3DModel

    model = _converted("mhla-hybrid")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["_class_name"] = "WanTransformer3DModel"
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = MHLAWanTransformer3DModel.from_pretrained(tmp_path)
    assert _kinds(loaded) == _expected_kinds("mhla-hybrid")
    _assert_same_weights(loaded, model)


@pytest.mark.slow  # builds a base pipeline folder and imports: about 5 s
def test_an_imported_official_checkpoint_loads_through_diffusers(tmp_path):
    from pipelines import import_official as imp
    from pipelines.loading import load_transformer
    from pipelines.model import MHLAWanTransformer3DModel
    from tests.pipelines.test_import_official import _checkpoint_file, _small_base, synthetic_checkpoint

    base = _small_base(tmp_path, 3)
    ckpt = synthetic_checkpoint(build_tiny_transformer(num_layers=3), [1, 2], 6, seed=5)
    out = imp.import_official(_checkpoint_file(tmp_path, ckpt), base, tmp_path / "out", grid=(3, 4, 6))
    index = json.loads((out / "model_index.json").read_text())
    assert index["transformer"] == ["pipelines.model", "MHLAWanTransformer3DModel"]
    assert index["vae"] == json.loads((base / "model_index.json").read_text())["vae"]
    pipe = WanPipeline.from_pretrained(out)
    assert type(pipe.transformer) is MHLAWanTransformer3DModel
    ours = load_transformer(out / "transformer", dtype="float32", device="cpu")
    assert pipe.transformer.conversion.to_config() == ours.conversion.to_config()
    assert ours.conversion.to_config()["linear_layers"] == [1, 2]
    _assert_same_weights(pipe.transformer, ours)


def test_shipped_variant_folders_name_the_class():
    from pipelines.model_dir import BUILTIN_DIR, builtin_available

    if not builtin_available():
        pytest.skip("the built-in model is not in this checkout")
    folders = sorted((BUILTIN_DIR / "variants").iterdir())
    assert [f.name for f in folders] == ["linear", "mhla", "mhla-hybrid"]
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        assert config["_class_name"] == "MHLAWanTransformer3DModel"
        assert config["self_attention"]["variant"] == folder.name


def test_every_model_the_project_builds_is_the_project_class_and_converts_in_place():
    from pipelines.model import MHLAWanTransformer3DModel

    model = build_tiny_transformer(0, num_layers=2)
    assert type(model) is MHLAWanTransformer3DModel and model.conversion.variant == "flash"
    same = convert_self_attention(model, "mhla", options=OPTIONS)
    assert same is model and type(model) is MHLAWanTransformer3DModel
    assert isinstance(model.blocks[1].attn1.processor, LinearSelfAttnProcessor)


def test_a_plain_diffusers_model_is_left_alone_and_the_converted_one_shares_its_weights():
    """No class swap: diffusers' own model keeps its class and processors; the result is a new object whose
    tensors are the plain model's (no copy), running as asked."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from pipelines.model import MHLAWanTransformer3DModel

    ours = build_tiny_transformer(3, num_layers=LAYERS)
    plain = WanTransformer3DModel.from_config({k: v for k, v in ours.config.items() if k != "self_attention"})
    plain.load_state_dict(ours.state_dict())
    plain.eval()
    before = _run(plain)
    converted = convert_self_attention(plain, "flash")
    assert type(plain) is WanTransformer3DModel and type(converted) is MHLAWanTransformer3DModel
    assert all(type(b.attn1.processor) is WanAttnProcessor for b in plain.blocks)
    tensors = dict(plain.named_parameters()) | dict(plain.named_buffers())
    for name, t in [*converted.named_parameters(), *converted.named_buffers()]:
        assert t is tensors[name], name
    assert not converted.training
    # diffusers' softmax and ours (same weights) agree; the plain model still gives what it gave
    torch.testing.assert_close(_run(converted), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_run(plain), before, rtol=0, atol=0)
    mhla = convert_self_attention(plain, "mhla", options=OPTIONS)
    assert mhla is not converted and mhla.conversion.variant == "mhla" and converted.conversion.variant == "flash"


def test_the_conversion_is_typed_frozen_and_what_the_config_says():
    import dataclasses

    from pipelines.conversion import CONFIG_KEY, Conversion

    model = _converted("mhla-hybrid")
    conversion = model.conversion
    assert isinstance(conversion, Conversion)
    assert conversion.variant == "mhla-hybrid" and conversion.linear_layers == tuple(HYBRID)
    assert dict(conversion.parameters) == {"mhla": tuple(HYBRID), "linear": ()}
    assert conversion.options == OPTIONS and conversion.blocks == (1, 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        conversion.variant = "flash"
    with pytest.raises(TypeError):
        conversion.parameters["mhla"] = (0,)
    assert model.config[CONFIG_KEY] == conversion.to_config()
    assert Conversion.from_config(json.loads(json.dumps(conversion.to_config())), LAYERS) == conversion
    # a switch back to flash keeps the parameters (and their blocks), runs no linear layer
    model.set_variant("flash")
    assert model.conversion.linear_layers == () and model.conversion.parameters["mhla"] == tuple(HYBRID)
    assert model.conversion.blocks == (1, 2, 2) and model.config[CONFIG_KEY] == model.conversion.to_config()


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ([1, 2], "must be a JSON object"),
        ({"variant": "mhla"}, "lacks ['linear_layers', 'parameters', 'options']"),
        ({"variant": "mhla", "linear_layers": [], "parameters": {"rwkv": []}, "options": {}}, "'mhla'/'linear'"),
        (
            {"variant": "mhla", "linear_layers": [0, 3], "parameters": {}, "options": {}},
            "linear_layers names layers [3]",
        ),
        ({"variant": "mhla", "linear_layers": [], "parameters": {"mhla": [-1]}, "options": {}}, "layers [-1]"),
        ({"variant": "mhla", "linear_layers": [], "parameters": {"mhla": "12"}, "options": {}}, "list of layer"),
        ({"variant": "softmax", "linear_layers": [], "parameters": {}, "options": {}}, "unknown variant 'softmax'"),
        (
            {"variant": "mhla", "linear_layers": [], "parameters": {}, "options": {"tau": 1}},
            "unknown attention options",
        ),
    ],
)
def test_a_malformed_conversion_record_is_refused_naming_what_is_wrong(entry, named):
    from pipelines.conversion import Conversion

    with pytest.raises(ValueError) as e:
        Conversion.from_config(entry, 3)
    assert named in str(e.value)


def test_a_clone_has_its_own_context_and_processors_and_the_same_weights():
    model = _converted("mhla")
    clone = model.clone()
    assert clone.attention_context is not model.attention_context and clone.conversion == model.conversion
    for a, b in zip(model.blocks, clone.blocks, strict=True):
        assert a.attn1.processor is not b.attn1.processor
        assert a.attn1.processor.context is model.attention_context
        assert b.attn1.processor.context is clone.attention_context
    _assert_same_weights(model, clone)
    torch.testing.assert_close(_run(clone), _run(model), rtol=0, atol=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        clone(torch.randn(1, 16, 4, 8, 8, generator=g), torch.tensor([3]), torch.randn(1, 6, 32, generator=g))
    assert clone.attention_context.grid == (4, 4, 4) and model.attention_context.grid == (2, 4, 4)


def test_the_forward_records_the_grid_and_refuses_a_flat_input():
    model = _converted("mhla")
    _run(model)
    assert model.attention_context.grid == (2, 4, 4)
    with pytest.raises(ValueError, match=r"\(batch, channels, frames, height, width\), got \(1, 16, 8\)"):
        model(torch.zeros(1, 16, 8), torch.tensor([1]), torch.zeros(1, 6, 32))


def test_no_class_swap_and_no_attribute_smuggling_in_the_product():
    """What the conversion used to do (switch an instance's class, attach state with object.__setattr__ and a
    forward pre-hook): nowhere in the product's source now."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for package in ("pipelines", "app", "training", "factory", "benchmarks"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else []
                if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                    found.append(f"{path.name}:{node.lineno} assigns __class__")
    assert found == []


# ---- 2. torch.compile


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _fresh_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


# compiling is slow on a busy 2-core machine (3-8 s per test): all marked slow
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mhla-hybrid", "linear"])
def test_compile_fullgraph_has_no_graph_break_and_no_recompile(variant):
    import torch._dynamo

    model = _converted(variant)
    expected = [_run(model, timestep=700), _run(model, timestep=300)]
    _fresh_dynamo()
    explain = torch._dynamo.explain(model)(**_inputs())
    assert explain.graph_break_count == 0, explain.break_reasons
    _fresh_dynamo()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: any graph break raises
    first = _run(compiled, timestep=700)
    graphs = _graph_count()
    assert graphs == 1
    second = _run(compiled, timestep=300)  # the next denoising step: same graph, no recompilation
    assert _graph_count() == graphs
    torch.testing.assert_close(first, expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(second, expected[1], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compile_repeated_blocks_fullgraph():
    model = _converted("mhla-hybrid")
    expected = [_run(model, timestep=700), _run(model, timestep=300)]
    _fresh_dynamo()
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    first = _run(model, timestep=700)
    graphs = _graph_count()
    assert graphs == 2  # one block graph per kind of layer (softmax, MHLA); fullgraph means no break
    second = _run(model, timestep=300)
    assert _graph_count() == graphs
    torch.testing.assert_close(first, expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(second, expected[1], rtol=0, atol=1e-6)


# ---- 3. memory hooks


@pytest.mark.parametrize(
    "offload",
    [
        # on a CPU-only machine onload and offload devices are both "cpu": only the disk modes take the weights
        # away between calls (the leaf level then gave NaN when a weight was read outside its module's call)
        dict(offload_type="leaf_level", disk=True),
        dict(offload_type="block_level", num_blocks_per_group=1),
        pytest.param(dict(offload_type="leaf_level"), marks=pytest.mark.slow),
        pytest.param(dict(offload_type="block_level", num_blocks_per_group=1, disk=True), marks=pytest.mark.slow),
    ],
    ids=["leaf-disk", "block", "leaf", "block-disk"],
)
@pytest.mark.parametrize("variant", ["linear", "mhla", "mhla-hybrid"])
def test_group_offloading_gives_the_unhooked_output(variant, offload, tmp_path):
    model = _converted(variant)
    expected = _run(model)
    offload = dict(offload)
    if offload.pop("disk", False):
        offload["offload_to_disk_path"] = str(tmp_path)
    model.enable_group_offload(torch.device("cpu"), torch.device("cpu"), **offload)
    # diffusers' leaf-level disk offloading changes the plain Wan transformer's output by ~5e-7 on its own
    # (measured on the unconverted tiny model): that much is allowed with a disk, nothing without
    torch.testing.assert_close(_run(model), expected, rtol=0, atol=0 if "offload_to_disk_path" not in offload else 2e-6)


@pytest.mark.parametrize("variant", ["linear", "mhla", "mhla-hybrid"])
def test_sequential_offload_gives_the_unhooked_output(variant):
    """enable_sequential_cpu_offload is accelerate's cpu_offload on each model: weights live on the meta
    device and each module's hook brings them in for its own forward, so a weight read outside a module
    call fails. ("cpu" as the execution device: the same hooks run on a machine without a GPU.)"""
    from accelerate import cpu_offload

    model = _converted(variant)
    expected = _run(model)
    cpu_offload(model, execution_device=torch.device("cpu"), offload_buffers=True)
    assert all(p.device.type == "meta" for p in model.parameters())
    torch.testing.assert_close(_run(model), expected, rtol=0, atol=0)
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.slow  # two tiny pipeline runs: about 15 s on a busy 2-core machine
def test_model_cpu_offload_gives_the_unhooked_output():
    parts = build_tiny_components(0)
    convert_self_attention(parts["transformer"], "mhla-hybrid", [1, 2, 4], OPTIONS)
    kw = dict(prompt="a red square", num_frames=5, height=32, width=32, num_inference_steps=2, output_type="latent")
    expected = WanPipeline(**copy.deepcopy(parts))(generator=torch.Generator().manual_seed(0), **kw).frames
    pipe = WanPipeline(**parts)
    pipe.enable_model_cpu_offload(device="cpu")
    assert hasattr(pipe.transformer, "_hf_hook")
    out = pipe(generator=torch.Generator().manual_seed(0), **kw).frames
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["linear", "mhla-hybrid"])
def test_layerwise_casting_runs_on_the_stored_weights(variant):
    """fp8 storage, float32 compute: the output equals the un-hooked model holding the fp8-rounded weights."""
    model = _converted(variant)
    reference = copy.deepcopy(model)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    stored = dict(model.named_parameters())
    assert stored["blocks.1.attn1.to_q.weight"].dtype == torch.float8_e4m3fn
    gate = f"blocks.1.attn1.{PARAM_ATTRS['linear' if variant == 'linear' else 'mhla']}.gate.weight"
    assert stored[gate].dtype == torch.float8_e4m3fn  # our new Linear too
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if stored[name].dtype == torch.float8_e4m3fn:
                p.copy_(stored[name].float())
    torch.testing.assert_close(_run(model), _run(reference), rtol=0, atol=0)


@pytest.mark.slow  # two backward passes: 5-9 s on a busy 2-core machine
@pytest.mark.parametrize("variant", ["linear", "mhla-hybrid"])
def test_gradient_checkpointing_gives_the_same_gradients(variant):
    def grads(model):
        model.train()
        out = model(**_inputs())[0]
        out.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model = _converted(variant)
    checkpointed = copy.deepcopy(model)
    checkpointed.enable_gradient_checkpointing()
    assert checkpointed.gradient_checkpointing
    plain, ckpt = grads(model), grads(checkpointed)
    assert sorted(plain) == sorted(ckpt) and any(".attn1.mhla." in n or "linear_attn" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


# ---- 4. attention backends


class _Counting:
    """Stands in for one diffusers attention backend and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def counted_math_backend(monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = AttentionBackendName._NATIVE_MATH
    counter = _Counting(_AttentionBackendRegistry._backends[name])
    monkeypatch.setitem(_AttentionBackendRegistry._backends, name, counter)
    return counter


def test_set_attention_backend_reaches_the_softmax_layers(counted_math_backend):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    model = _converted("mhla-hybrid")
    expected = _run(model)
    active = _AttentionBackendRegistry._active_backend
    try:
        model.set_attention_backend("_native_math")
        out = _run(model)
    finally:
        model.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(active)
    # one softmax self-attention layer (0) and the cross-attention of all three
    assert counted_math_backend.calls == 1 + LAYERS
    assert model.attention_context.softmax_backend == "sdpa_math"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_attention_backend_context_reaches_the_flash_variant(counted_math_backend):
    from diffusers.models.attention_dispatch import attention_backend

    model = _converted("flash")
    with attention_backend("_native_math"):
        _run(model)
    assert counted_math_backend.calls == 2 * LAYERS  # self- and cross-attention of every layer
    _run(model)  # the context is over: back to the default backend
    assert counted_math_backend.calls == 2 * LAYERS


def test_the_options_backend_is_a_diffusers_backend(counted_math_backend):
    model = build_tiny_transformer(0, num_layers=LAYERS)
    convert_self_attention(model, "flash", options=AttentionOptions(softmax_backend="sdpa_math"))
    _run(model)
    assert counted_math_backend.calls == LAYERS  # the self-attention layers; cross-attention keeps the default
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:  # a missing package is named at conversion
        with pytest.raises(ValueError, match="'flash_attn' .*cannot run here"):
            convert_self_attention(model, "flash", options=AttentionOptions(softmax_backend="flash_attn"))

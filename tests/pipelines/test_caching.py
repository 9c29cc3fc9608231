"""diffusers' FirstBlockCache and MagCache on converted transformers (every variant): equal to the uncached
run when nothing is skipped; skipping the blocks as configured; the CLI's --cache."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch

from pipelines import VARIANTS, convert_self_attention
from pipelines.caching import CacheSpec, cached, parse_cache
from pipelines.tiny import build_tiny_transformer

LAYERS = 3
STEPS = 4


def converted(variant: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fresh MHLA parameters: untrained, as intended here
        model = convert_self_attention(build_tiny_transformer(seed=0, num_layers=LAYERS), variant)
    return model.eval()


def steps_inputs(seed: int = 1):
    """A different latent per step (as denoising makes), so block 0's output always moves."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 7, 32, generator=gen)
    return [
        dict(
            hidden_states=torch.randn(1, 16, 3, 8, 8, generator=gen),
            timestep=torch.tensor([1000.0 - 250 * i]),
            encoder_hidden_states=text,
            return_dict=False,
        )
        for i in range(STEPS)
    ]


def run(model, spec: CacheSpec | None, inputs) -> tuple[list[torch.Tensor], int]:
    """The outputs of the steps in one cache context, and how many blocks ran their feed-forward."""
    ran = [0]
    hooks = [b.ffn.register_forward_hook(lambda *a: ran.__setitem__(0, ran[0] + 1)) for b in model.blocks]
    try:
        with torch.no_grad(), cached(model, spec, STEPS):
            if spec is None:
                outs = [model(**x)[0] for x in inputs]
            else:
                with model.cache_context("cond"):
                    outs = [model(**x)[0] for x in inputs]
    finally:
        for h in hooks:
            h.remove()
    return outs, ran[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_first_block_cache(variant):
    model, inputs = converted(variant), steps_inputs()
    plain, ran = run(model, None, inputs)
    assert ran == LAYERS * STEPS
    # threshold 0: block 0's change is never below it, so every block runs: the same numbers
    never, ran = run(model, CacheSpec("first-block", 0.0), inputs)
    assert ran == LAYERS * STEPS
    for a, b in zip(never, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a huge threshold: after the first step only block 0 runs, the others' residual is reused
    always, ran = run(model, CacheSpec("first-block", 1e9), inputs)
    assert ran == LAYERS + (STEPS - 1)
    torch.testing.assert_close(always[0], plain[0], rtol=0, atol=0)
    assert not torch.equal(always[-1], plain[-1])
    # the cache is off again afterwards
    again, ran = run(model, None, inputs)
    assert ran == LAYERS * STEPS and torch.equal(again[-1], plain[-1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_mag_cache(variant):
    model, inputs = converted(variant), steps_inputs(2)
    plain, _ = run(model, None, inputs)
    calibrating, ran = run(model, CacheSpec("mag-calibrate", 0.0), inputs)  # measures, never skips
    assert ran == LAYERS * STEPS
    for a, b in zip(calibrating, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # skipped when the error accumulated from the ratios is <= the threshold (diffusers 0.42): ratios of 0.5
    # accumulate 0.5 per step, over a threshold of 0, so nothing is skipped: the same numbers
    never, ran = run(model, CacheSpec("mag", 0.0, (1.0,) + (0.5,) * (STEPS - 1)), inputs)
    assert ran == LAYERS * STEPS
    for a, b in zip(never, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # ratios of 1 accumulate no error: every step after the retained first (retention 0.2 of 4 steps rounds
    # to 1) is skipped, up to max_skip_steps (3) in a row: the blocks run for step 0 only
    skipping, ran = run(model, CacheSpec("mag", 0.0, (1.0,) * STEPS), inputs)
    assert ran == LAYERS
    torch.testing.assert_close(skipping[0], plain[0], rtol=0, atol=0)
    assert not torch.equal(skipping[-1], plain[-1])


def test_parse_cache(tmp_path):
    assert parse_cache("none") is None
    assert parse_cache("first-block") == CacheSpec("first-block", 0.05)
    assert parse_cache("first-block:0.1") == CacheSpec("first-block", 0.1)
    ratios = tmp_path / "r.json"
    ratios.write_text(json.dumps([1.0, 0.9, 0.95]))
    assert parse_cache(f"mag:0.06:{ratios}") == CacheSpec("mag", 0.06, (1.0, 0.9, 0.95))
    for bad in ("first-block:-1", "first-block:nan", "mag:0.1", "teacache", f"mag:x:{ratios}", "mag:0.1:/nope.json"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_cache(bad)


def test_cli_cache_option(tmp_path, capsys):
    from pipelines.cli import main

    out = tmp_path / "v.mp4"
    args = ["--model", "tiny-random", "--variant", "mhla", "--prompt", "a fox", "--steps", "3", "--no-progress"]
    assert main([*args, "--out", str(out), "--cache", "first-block:0.05"]) == 0
    assert "cache: FirstBlockCache, threshold 0.05" in capsys.readouterr().out
    assert out.is_file()
    assert main([*args, "--out", str(out), "--cache", "bogus"]) != 0


@pytest.mark.parametrize("kind", ["mag", "first-block"])
def test_compiled_blocks_stay_compiled_under_the_cache(kind):
    """``--compile blocks`` with a step cache: the blocks the cache computes run compiled, the same numbers as the
    uncompiled cached run, and enabling the cache again (the next generation) compiles nothing. MagCache's hooks
    are ``torch.compiler.disable``: the blocks ran EAGER under them before pipelines.caching rewired them."""
    from mhla.compiled import compile_transformer

    torch._dynamo.reset()
    ran = [0]
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            ran[0] += 1
            return gm.forward(*args)

        return run

    spec = CacheSpec("mag", 0.0, (1.0,) * STEPS) if kind == "mag" else CacheSpec("first-block", 1e9)
    inputs = steps_inputs(5)
    model = converted("mhla")
    eager, eager_ran = run(model, spec, inputs)  # block 0 for every step, the others for the first only
    compile_transformer(model, "blocks", backend=counting)
    with torch.no_grad():
        model(**inputs[0])  # compiled, uncached: every block
    first = len(graphs)
    for _ in range(2):
        ran[0] = 0
        got, _ = run(model, spec, inputs)
        assert ran[0] == eager_ran, (ran[0], eager_ran)  # every block the cache computed ran compiled
        for a, b in zip(got, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(graphs) == first, f"{len(graphs) - first} graphs compiled while the cache was on"


@pytest.mark.parametrize("compile_mode", [None, "reduce-overhead"])
def test_the_cache_compiles_the_blocks_it_runs_in_the_transformer_s_compile_mode(monkeypatch, compile_mode):
    """A transformer compiled with a torch.compile mode (reduce-overhead's CUDA graphs) keeps it under the step
    cache: the block forward the cache's hooks call is compiled with the same mode, not torch's default."""
    from mhla.compiled import compile_transformer
    from pipelines import caching

    calls: list[dict] = []

    def recording(fn=None, **kwargs):  # records what is asked, compiles nothing
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(caching, "_COMPILED_FORWARDS", {})
    model = converted("mhla")
    compile_transformer(model, "blocks", backend="inductor", compile_mode=compile_mode)
    asked = len(calls)
    run(model, CacheSpec("first-block", 1e9), steps_inputs(2))
    under_cache = calls[asked:]
    assert under_cache, "the cache's hooks compiled no block forward"
    for kwargs in under_cache:
        assert kwargs.get("mode") == compile_mode and kwargs["backend"] == "inductor", kwargs

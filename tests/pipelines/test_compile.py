"""--compile: every variant's transformer under torch.compile (repeated blocks or whole) gives the eager
numbers; the CLI option. On a CPU with the aot_eager backend (the same graphs, no C++ compiler)."""

from __future__ import annotations

import warnings

import pytest
import torch

from mhla.checks import COMPILE_MODES
from mhla.compiled import compile_transformer
from pipelines import VARIANTS, convert_self_attention
from pipelines.tiny import build_tiny_transformer


def inputs(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(2, 16, 3, 8, 8, generator=gen),
        timestep=torch.tensor([700.0, 700.0]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
        return_dict=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["blocks", "full"])
def test_compiled_transformer_matches_eager(variant, mode):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = convert_self_attention(build_tiny_transformer(seed=0, num_layers=2), variant).eval()
    x = inputs()
    with torch.no_grad():
        want = model(**x)[0]
        compile_transformer(model, mode, backend="aot_eager")
        got = model(**x)[0]
        again = model(**inputs(4))[0]  # same shapes: no recompile needed, and still right
        want_again = model._orig_mod(**inputs(4))[0] if hasattr(model, "_orig_mod") else None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(again).all()
    if want_again is not None:
        torch.testing.assert_close(again, want_again, rtol=1e-5, atol=1e-5)
    assert model._mhla_compiled == (mode, "aot_eager", False)


def test_compile_mode_checked():
    with pytest.raises(ValueError, match="compile mode"):
        compile_transformer(torch.nn.Linear(2, 2), "everything")


@pytest.mark.parametrize("mode", ["none", *COMPILE_MODES])
def test_the_cli_and_the_step_benchmark_offer_the_compile_modes_of_the_operator(mode, capsys):
    """One list of modes: each is taken by both command lines, and anything else is refused by both."""
    from benchmarks.wan_step import build_parser
    from pipelines.cli import _parse_args

    prompt = ["--prompt", "a red square"]
    assert _parse_args([*prompt, "--compile", mode]).compile == mode
    assert build_parser().parse_args(["--compile", mode]).compile == mode
    for parse, argv in ((_parse_args, prompt), (build_parser().parse_args, [])):
        with pytest.raises(SystemExit):
            parse([*argv, "--compile", "everything"])
        assert "invalid choice: 'everything'" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_compile_option(tmp_path, capsys, monkeypatch):
    from pipelines.cli import main

    monkeypatch.setenv("MHLA_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    out = tmp_path / "v.mp4"
    args = ["--model", "tiny-random", "--variant", "mhla", "--prompt", "a fox", "--steps", "2", "--no-progress"]
    assert main([*args, "--out", str(out), "--compile", "blocks"]) == 0
    assert "torch.compile: blocks" in capsys.readouterr().out and out.is_file()


@pytest.mark.parametrize("variant", ["mhla", "mhla-hybrid"])
def test_compiled_layers_compile_once_across_generations(variant):
    """Each generation opens a new ``reuse_constrained_mixing`` scope (as pipelines.pipeline.generate does); a
    compiled layer must not depend on that scope's counter. It did: TorchDynamo guarded on the counter's value
    and recompiled every layer on every forward, which on an H100 made compiled MHLA as slow as softmax
    (956 ms against 340 ms once fixed, Wan2.1-1.3B at 31,500 tokens)."""
    from mhla.mixing import reuse_constrained_mixing

    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = convert_self_attention(build_tiny_transformer(seed=0, num_layers=2), variant).eval()
        compile_transformer(model, "blocks", backend=counting)
        with torch.no_grad():
            for seed in range(4):
                with reuse_constrained_mixing():
                    model(**inputs(seed))
    first = len(graphs)
    assert first >= 1
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for seed in range(3):
            with reuse_constrained_mixing():
                model(**inputs(seed))
    assert len(graphs) == first, f"{len(graphs) - first} recompiles after the first generations"

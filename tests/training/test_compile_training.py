"""``train.compile``: the recipe's transformer compiled in place (``mhla.compiled.compile_transformer``). On a CPU the
tests compile with ``aot_eager`` (the same graphs, no C++ compiler): a compiled run must train as the eager one does,
write checkpoints with the same names a later eager run (or the app) reads, and resume."""

import pytest
import torch
from safetensors.torch import load_file

from tests.training.test_training import finetune, metrics
from training import checkpoint as ckpt
from training.config import load_config

pytestmark = pytest.mark.slow


def _losses(run):
    return [r["loss"] for r in metrics(run) if r.get("stage") == "train"]


def _weights(run, step):
    folder = ckpt.list_checkpoints(run)[[p.name for p in ckpt.list_checkpoints(run)].index(f"step-{step:07d}")]
    return load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))


def test_a_compiled_run_trains_as_the_eager_one_and_its_checkpoints_read_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("MHLA_COMPILE_BACKEND", "aot_eager")
    from torch._dynamo.utils import counters

    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    common = ("train.steps=4", "checkpoint.every=2", "data.image_ratio=1.0")  # clips and stills: two shapes
    finetune(eager, *common)
    torch._dynamo.reset()
    counters.clear()
    finetune(compiled, *common, "train.compile=blocks")
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks went through TorchDynamo
    assert _losses(compiled) == pytest.approx(_losses(eager), rel=1e-4, abs=1e-6)
    a, b = _weights(eager, 4), _weights(compiled, 4)
    assert sorted(a) == sorted(b)  # no "_orig_mod." prefixes: the module compiled in place
    # Adam divides each gradient by its own running scale, so round-off in a near-zero gradient moves a weight by a
    # fraction of the learning rate: compared per tensor as a share of its norm, not element by element
    worst = max(((a[k] - b[k]).norm().item() / max(a[k].norm().item(), 1e-12), k) for k in a)
    assert worst[0] < 1e-3, worst

    # a compiled run resumed from its step-2 checkpoint continues as the uninterrupted one did
    resumed = tmp_path / "resumed"
    finetune(resumed, *common, "train.compile=blocks", "train.steps=2")
    torch._dynamo.reset()
    finetune(resumed, *common, "train.compile=blocks", "resume=latest")
    assert _losses(resumed)[-2:] == pytest.approx(_losses(compiled)[-2:], rel=1e-4, abs=1e-6)


def test_a_bad_compile_mode_is_named(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run_dir: x\ntrain:\n  compile: fast\n")
    with pytest.raises(ValueError, match=r"train\.compile.*'fast'"):
        load_config(str(cfg))

"""Issue 52: a softmax backend this device cannot run is refused before the model loads, naming the value and what
runs here (it ended "unexpected failure (RuntimeError: No viable backend...)" at the first softmax layer)."""

from __future__ import annotations

import pytest
import torch

import pipelines.cli as gen
from mhla.softmax import SOFTMAX_BACKENDS, backends_for, check_backend, softmax_attention
from tests.boundary import assert_refused


def _runs_here(backend: str) -> bool:
    """Whether ``backend`` computes softmax attention on this CPU, tried on small inputs of each dtype."""
    q = torch.randn(1, 8, 2, 16)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            softmax_attention(q.to(dtype), q.to(dtype), q.to(dtype), backend=backend)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def test_the_cpu_list_is_what_runs_on_the_cpu():
    # the reference: each backend tried for real on this machine's CPU
    assert set(backends_for("cpu")) == {b for b in SOFTMAX_BACKENDS if _runs_here(b)}
    for b in SOFTMAX_BACKENDS:
        if b in backends_for("cpu"):
            check_backend(b, "cpu")
        else:
            with pytest.raises(ValueError, match=rf"'{b}' cannot run on cpu; on cpu use one of: auto, sdpa"):
                check_backend(b, "cpu")
    with pytest.raises(ValueError, match="'nope': unknown"):
        check_backend("nope", "cpu")


def test_the_cli_refuses_it_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def no_load(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(gen, "_load", no_load)
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))
    argv = ["--model", "tiny-random", "--prompt", "a fox", "--device", "cpu", "--out", f"{tmp_path}/v.mp4"]
    err = assert_refused(gen.main, [*argv, "--softmax-backend", "sdpa_efficient"], capsys, tmp_path)
    assert "--softmax-backend 'sdpa_efficient' cannot run on cpu" in err and "sdpa_flash, sdpa_math" in err, err
    assert "unexpected failure" not in err

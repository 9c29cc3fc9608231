"""Issue 30 at the app's edge: values from the page or the API are checked for type, never coerced (a list
is not a prompt, repeats=2.7 is not 2), control characters are refused, a refused input is one log line,
and the launcher sits behind the error boundary."""

from __future__ import annotations

import logging
import re

import pytest

from app import bench, compare
from app.models import load_app_models
from tests.boundary import assert_refused

SMALLEST = compare.preset_key(compare.PRESETS[0])


@pytest.fixture(scope="module")
def models():
    return load_app_models("tiny-random")


@pytest.mark.parametrize(
    "prompt,message",
    [
        (["a red fox", "a cat"], "the prompt must be text, got list"),
        ({"text": "a fox"}, "the prompt must be text, got dict"),
        (42, "the prompt must be text, got int"),
        ("a NUL \x00 byte", "control character U+0000"),
        ("colours \x1b[31m", "control character U+001B"),
    ],
)
def test_prompts_must_be_clean_text(models, prompt, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compare.check_request(models, prompt, "", 0, 1, 5.0, SMALLEST, ["flash"])
    with pytest.raises(ValueError, match=re.escape(message.replace("the prompt", "the negative prompt"))):
        compare.check_request(models, "a fox", prompt, 0, 1, 5.0, SMALLEST, ["flash"])


@pytest.mark.parametrize("variants", ["flash", [["flash"]], [1]])
def test_variants_must_be_a_list_of_names(models, variants):
    with pytest.raises(ValueError, match="variants must be a list of names"):
        compare.check_request(models, "a fox", "", 0, 1, 5.0, SMALLEST, variants)


@pytest.mark.parametrize("repeats", [2.7, "3", True, 0, 21])
def test_benchmark_repeats_are_refused_never_truncated(models, repeats):
    with pytest.raises(ValueError, match="repeats must be"):
        bench.run_benchmark(models, "1x4x4", levels=["operator"], repeats=repeats)


def test_benchmark_grids_must_be_text(models):
    with pytest.raises(ValueError, match="token grids must be text"):
        bench.run_benchmark(models, ["1x4x4"], levels=["operator"])


def test_a_refused_input_is_one_log_line_and_no_traceback(caplog):
    from app import inputs

    with caplog.at_level(logging.INFO):
        error = inputs.refused("steps must be a whole number, got 2.5")
    assert error.print_exception is False  # gradio prints no traceback for it
    records = [r for r in caplog.records if r.name == "app"]
    assert len(records) == 1 and records[0].getMessage() == "refused input: steps must be a whole number, got 2.5"
    assert records[0].exc_info is None


def test_the_api_events_hand_raw_values_to_the_checks(models, tmp_path):
    """gradio's preprocessing would turn a list prompt into its text (and round numbers) before any check:
    the API events take raw values."""
    from app.ui import build_demo

    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    named = {fn.api_name: fn for fn in demo.fns.values() if fn.api_name in ("compare", "benchmark")}
    assert set(named) == {"compare", "benchmark"}
    assert all(fn.preprocess is False for fn in named.values())


LAUNCHER_TABLE = [
    ["--port", "99999"],
    ["--max-tokens", "0"],
    ["--model", "/no/such/model"],
    ["--model", "{root}/a_file"],
    ["--variant", "mhla"],
    ["--variant", "fast=ckpt"],
    ["--random-weights", "7b"],
    ["--model", "tiny-random", "--random-weights", "1.3b"],
    ["--device", "bogus"],
]


@pytest.mark.parametrize("extra", LAUNCHER_TABLE, ids=[" ".join(a)[:40] for a in LAUNCHER_TABLE])
def test_launcher_refuses_malformed_values(extra, tmp_path, capsys, monkeypatch):
    import run_app

    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(run_app, "compose", lambda *a, **k: pytest.fail("the models loaded"))
    (tmp_path / "a_file").write_text("keep")
    argv = [a.replace("{root}", str(tmp_path)) for a in extra]
    assert_refused(run_app.main, argv, capsys, tmp_path)


@pytest.mark.slow
def test_through_the_api_a_list_prompt_and_fractional_repeats_are_refused_in_one_log_line(models, tmp_path, capfd):
    """The served app, through gradio_client: a list as the prompt was generated as the list's text, repeats=2.7
    was truncated to 2; each refused input wrote a 30-line traceback to the server's log."""
    import socket

    from gradio_client import Client
    from gradio_client.exceptions import AppError

    from app.ui import build_demo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    demo.queue(default_concurrency_limit=1).launch(
        server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, show_error=False, ssr_mode=False
    )
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        capfd.readouterr()
        with pytest.raises(AppError, match="the prompt must be text, got list"):
            client.predict(
                prompt=["a red fox", "a cat"],
                seed=0,
                num_inference_steps=1,
                guidance_scale=5.0,
                preset=SMALLEST,
                variants=["flash"],
                api_name="/compare",
            )
        with pytest.raises(AppError, match="repeats must be a whole number, got 2.7"):
            client.predict("1x4x4", ["operator"], ["flash"], 2.7, api_name="/benchmark")
        err = capfd.readouterr().err
        assert "Traceback" not in err, err[-3000:]
    finally:
        demo.close()

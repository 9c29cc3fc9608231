"""Issue 30: the factory's commands behind the error boundary (a table of malformed values: non-zero exit, a
message, no traceback, pre-existing files byte-identical)."""

from __future__ import annotations

import pytest

from factory import arms, build, examples, reship, shape_probe
from tests.boundary import assert_refused

TABLE = [
    (build, ["build", "--until", "nowhere"]),
    (build, ["init-vae", "--out", "{root}/vae", "--set", "base_dim"]),
    (build, ["init-vae", "--out", "{root}/vae", "--set", "base_dim=[1,"]),
    (examples, ["--from", "/no/such.json"]),
    (examples, ["--from", "{root}/not_json.json"]),
    (examples, ["--from", "{root}/not_json.json", "--count", "0"]),
    (examples, ["--from", "{root}/not_json.json", "--model", "{root}"]),
    (shape_probe, ["unconditional", "--weights", "raw"]),  # raw weights need a checkpoint
    (shape_probe, ["unconditional", "--transformer", "{root}", "--weights", "raw"]),  # not a checkpoint
    (reship, ["{root}/step-0000100", "--name", "joint-step100", "--start", "mhla"]),  # not VARIANT=DIR
    (reship, ["{root}/step-0000100", "--name", "joint-step100", "--start", "flash={root}"]),  # not a conversion
    (arms, ["a={root}/not_json.json", "b={root}/not_json.json", "--from", "0", "--to", "10", "--out", "{root}/o"]),
]


@pytest.mark.parametrize("module,argv", TABLE, ids=[" ".join(a)[:40] for _, a in TABLE])
def test_factory_commands_refuse_malformed_values(module, argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))
    (tmp_path / "not_json.json").write_text("{ not json")
    argv = [a.replace("{root}", str(tmp_path)) for a in argv]
    assert_refused(module.main, argv, capsys, tmp_path)

"""benchmarks.wan_14b on a CPU with the tiny config: a block of layers timed and scaled to the model's count
(step = fixed + layers x per layer, said plainly in the table), mhla-hybrid composed from the flash and MHLA layers
of its split, the counted prediction shown beside each row; the whole model timed when --layers is its count.
Nothing about time is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import wan_14b
from pipelines.attention import HYBRID, linear_layers_for

pytestmark = pytest.mark.slow


def fake_predictions(path, tokens):
    table = {
        v: {"eager_ms": 100.0 * k, "compiled_ms": 90.0 * k, "vs_flash_eager": 3.0 / k, "vs_flash_compiled": 3.0 / k}
        for k, v in ((3, "flash"), (1, "mhla"), (1, "linear"), (2, "mhla-hybrid"))
    }
    data = {"meta": {"config": "tiny", "tokens": tokens}, "attention": {}, "predictions": {"H100": table}}
    path.write_text(json.dumps(data))
    return path


def test_a_block_of_layers_scaled_to_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MHLA_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    full = 3
    preds = fake_predictions(tmp_path / "p.json", 3 * 8 * 8)
    args = ["--config", "tiny", "--grid", "3x8x8", "--layers", "1", "--full-layers", str(full), "--repeats", "1"]
    record = wan_14b.main([*args, "--predictions", str(preds), "--out-dir", str(tmp_path), "--tag", "t"])
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["meta"]["complete"] and saved["meta"]["scaled"] and saved["meta"]["layers_timed"] == 1
    rows = {(r["mode"], r["variant"]): r for r in record["rows"]}
    assert set(rows) == {(m, v) for m in ("eager", "compiled") for v in ("flash", "mhla", "linear", HYBRID)}
    hybrid_mhla = len(linear_layers_for(HYBRID, full))
    for mode in ("eager", "compiled"):
        flash, mhla = rows[(mode, "flash")], rows[(mode, "mhla")]
        for v in ("flash", "mhla", "linear"):
            r = rows[(mode, v)]
            assert r["per_layer_ms"] == pytest.approx(r["depth_ms"] - r["fixed_ms"])  # 1 layer timed
            assert r["step_ms"] == pytest.approx(r["fixed_ms"] + full * r["per_layer_ms"])
            assert r["vs_flash"] == pytest.approx(flash["step_ms"] / r["step_ms"])
            assert r["graphs_compiled_while_timed"] == 0
        h = rows[(mode, HYBRID)]
        assert h["composed"] and h["step_ms"] == pytest.approx(
            flash["fixed_ms"] + (full - hybrid_mhla) * flash["per_layer_ms"] + hybrid_mhla * mhla["per_layer_ms"]
        )
        assert rows[(mode, "mhla")]["predicted_ms"] == (100.0 if mode == "eager" else 90.0)
    assert rows[("eager", "flash")]["attn_ms_full"] > 0
    table = (tmp_path / "t.md").read_text()
    assert "**SCALED, not the whole model: 1 of its 3 layers were built and timed**" in table
    assert "| mhla-hybrid (composed) | eager |" in table and "| predicted ms (count) |" in table


def test_the_whole_model_when_layers_is_its_count(tmp_path):
    args = ["--config", "tiny", "--grid", "3x8x8", "--layers", "2", "--full-layers", "2", "--modes", "eager"]
    record = wan_14b.main([*args, "--variants", "flash,mhla", "--repeats", "1", "--out-dir", str(tmp_path)])
    assert not record["meta"]["scaled"]
    for r in record["rows"]:
        assert r["step_ms"] == r["depth_ms"] and "fixed_ms" not in r
    assert all(r["variant"] != HYBRID for r in record["rows"])  # composed only from a scaled block
    with pytest.raises(SystemExit):
        wan_14b.main(["--variants", "mhla-hybrid"])

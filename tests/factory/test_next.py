"""The next design's stages resume from the repository: init lays committed stage weights over the shipped
model directory; save keeps only weights and configs, atomically, within the size budget."""

import json

import pytest

from factory import next as nxt


def _model_dir(root, vae_tag="shipped"):
    (root / "vae").mkdir(parents=True)
    (root / "vae" / "config.json").write_text(json.dumps({"tag": vae_tag}))
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps({"tag": "shipped"}))
    (root / "variants" / "mhla").mkdir(parents=True)
    (root / "model_index.json").write_text("{}")
    return root


def test_init_lays_stage_weights_over_the_shipped_model(tmp_path):
    base = _model_dir(tmp_path / "builtin")
    nxt_dir = tmp_path / "builtin-next"
    (nxt_dir / "vae").mkdir(parents=True)
    (nxt_dir / "vae" / "config.json").write_text(json.dumps({"tag": "stage"}))
    out = nxt.init(tmp_path / "runs" / "model", next_dir=nxt_dir, base=base)
    assert json.loads((out / "vae" / "config.json").read_text())["tag"] == "stage"
    assert json.loads((out / "transformer" / "config.json").read_text())["tag"] == "shipped"
    assert not (out / "variants").exists()
    assert not (out.with_name("model.tmp")).exists()


def test_save_keeps_weights_only_and_replaces_in_place(tmp_path):
    src = tmp_path / "vae"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"x" * 1000)
    (src / "optimizer.pt").write_bytes(b"y" * 10)
    dst = nxt.save("vae", src, next_dir=tmp_path / "next")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"z" * 10)
    nxt.save("vae", src, next_dir=tmp_path / "next")
    assert (dst / "diffusion_pytorch_model.safetensors").read_bytes() == b"z" * 10
    assert sorted(p.name for p in (tmp_path / "next").iterdir()) == ["vae"]  # no staging folders left


def test_save_refuses_bad_input(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="part"):
        nxt.save("optimizer", tmp_path, next_dir=tmp_path / "next")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        nxt.save("vae", tmp_path / "missing", next_dir=tmp_path / "next")
    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"x" * 3000)
    monkeypatch.setattr(nxt, "MAX_MB", 1000 / 2**20)
    with pytest.raises(ValueError, match="budget"):
        nxt.save("vae", src, next_dir=tmp_path / "next")
    assert not (tmp_path / "next" / "vae").exists()
    with pytest.raises(FileNotFoundError, match="model_index"):
        nxt.init(tmp_path / "out", next_dir=tmp_path / "next", base=tmp_path / "nothing")

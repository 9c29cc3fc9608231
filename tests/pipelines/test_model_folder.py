"""ModelDir: what a model folder says, read from its files without loading a weight, each file once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mhla import PAPER_BLOCK_SHAPE
from pipelines import model_dir as model_dir_module
from pipelines.model_dir import ModelDir, ModelIndex, TransformerShape
from pipelines.tiny import TINY_BLOCK_SHAPE, TINY_DEFAULTS, TINY_TRANSFORMER, WAN_DEFAULTS


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """How often each file is read as JSON, by path."""
    counts: Counter = Counter()
    real = model_dir_module.read_json

    def counting(path, what="file"):
        counts[Path(path)] += 1
        return real(path, what)

    monkeypatch.setattr(model_dir_module, "read_json", counting)
    return counts


def test_the_tiny_random_model_is_described_without_a_folder():
    model = ModelDir("tiny-random")
    assert model.path is None and model.random_weights
    assert model.index == ModelIndex()
    assert (model.defaults, model.block_shape, model.variant_dirs) == (TINY_DEFAULTS, TINY_BLOCK_SHAPE, {})
    shape = model.shape()
    assert shape.patch == tuple(TINY_TRANSFORMER["patch_size"])
    assert (shape.num_layers, shape.num_heads) == (
        TINY_TRANSFORMER["num_layers"],
        TINY_TRANSFORMER["num_attention_heads"],
    )
    assert model.vae_stride == (4, 8, 8)


def test_a_folder_that_says_nothing_is_wan21(tmp_path):
    _write(tmp_path / "model_index.json", {"_class_name": "WanPipeline"})
    model = ModelDir(tmp_path)
    assert not model.random_weights
    assert (model.defaults, model.block_shape, model.variant_dirs) == (WAN_DEFAULTS, PAPER_BLOCK_SHAPE, {})
    assert (model.shape(), model.vae_stride) == (TransformerShape((1, 2, 2), 30, 12), (4, 8, 8))


def test_a_folder_is_read_once_and_a_transformer_folder_wins(tmp_path, reads):
    _write(tmp_path / "model_index.json", {"_class_name": "WanPipeline"})
    _write(tmp_path / "vae" / "config.json", {"scale_factor_temporal": 4, "scale_factor_spatial": 16})
    _write(
        tmp_path / "transformer" / "config.json", {"patch_size": [1, 2, 2], "num_layers": 7, "num_attention_heads": 3}
    )
    tuned = tmp_path / "tuned"
    _write(tuned / "config.json", {"patch_size": [1, 1, 1], "num_layers": 5, "num_attention_heads": 2})
    model = ModelDir(tmp_path)
    for _ in range(2):
        assert model.index.pipeline_class == "WanPipeline"
        assert model.vae_stride == (4, 16, 16)
        assert model.shape() == TransformerShape((1, 2, 2), 7, 3)
        assert model.shape(tuned) == TransformerShape((1, 1, 1), 5, 2)
    assert model.shape(tmp_path / "untuned") == TransformerShape((1, 2, 2), 7, 3)  # no config there: the model's
    assert reads[tmp_path / "model_index.json"] == 1
    assert reads[tmp_path / "vae" / "config.json"] == 1
    assert reads[tmp_path / "transformer" / "config.json"] == 1
    assert reads[tuned / "config.json"] == 1


def test_a_missing_key_is_named_with_its_file(tmp_path):
    _write(tmp_path / "transformer" / "config.json", {"num_layers": 7})
    with pytest.raises(ValueError, match=r"patch_size.*transformer/config\.json|transformer/config\.json.*patch_size"):
        ModelDir(tmp_path).shape()


def test_the_second_expert_has_its_own_layers(tmp_path):
    shape = {"patch_size": [1, 2, 2], "num_attention_heads": 3}
    _write(tmp_path / "transformer" / "config.json", {**shape, "num_layers": 7})
    _write(tmp_path / "transformer_2" / "config.json", {**shape, "num_layers": 9})
    model = ModelDir(tmp_path)
    assert (model.shape().num_layers, model.shape(part="transformer_2").num_layers) == (7, 9)

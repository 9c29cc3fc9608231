"""``factory.hybrid_split``: an arm's start and how its evaluation is counted, checked against the weights and
captions directly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from factory import hybrid_split
from pipelines.attention import AttentionOptions
from pipelines.loading import load_transformer, save_transformer
from pipelines.tiny import build_tiny_transformer

WEIGHTS = "diffusion_pytorch_model.safetensors"


def test_the_start_runs_the_split_with_the_bases_self_attention_in_its_softmax_layers(tmp_path):
    base = build_tiny_transformer(seed=1, num_layers=3)
    save_transformer(base, tmp_path / "base")
    mhla = build_tiny_transformer(seed=2, num_layers=3).convert("mhla", options=AttentionOptions(blocks=(1, 1, 1)))
    save_transformer(mhla, tmp_path / "mhla")

    got = hybrid_split.build_start([1], tmp_path / "mhla", tmp_path / "base", tmp_path / "start")
    assert got["softmax"] == [1] and got["mhla"] == [0, 2] and got["moved"] > 0
    start = load_transformer(tmp_path / "start", dtype=torch.float32, device="cpu")
    assert start.conversion.variant == "mhla-hybrid" and list(start.conversion.linear_layers) == [0, 2]
    b, m = load_file(str(tmp_path / "base" / WEIGHTS)), load_file(str(tmp_path / "mhla" / WEIGHTS))
    s = load_file(str(tmp_path / "start" / WEIGHTS))
    moved = [k for k in s if k.startswith("blocks.1.attn1.") and k in b]
    assert moved and len(moved) == got["moved"]
    for k in s:
        expected = b[k] if k in moved else m[k]
        assert torch.equal(s[k], expected), k
    assert not torch.equal(b["blocks.1.attn1.to_q.weight"], m["blocks.1.attn1.to_q.weight"])  # the test can tell

    own = hybrid_split.build_start([1], tmp_path / "mhla", None, tmp_path / "own")
    assert own["moved"] == 0
    o = load_file(str(tmp_path / "own" / WEIGHTS))
    assert all(torch.equal(o[k], m[k]) for k in o)


def test_a_split_must_leave_both_kinds_of_layer():
    assert hybrid_split.parse_split("4,5", 6) == [4, 5]
    with pytest.raises(ValueError, match="at least one MHLA layer"):
        hybrid_split.parse_split("0-5", 6)
    with pytest.raises(ValueError, match="out of range|past"):
        hybrid_split.parse_split("6", 6)


def test_shapes_are_counted_by_the_word_the_caption_asks_for():
    videos = [
        {"caption": "a red triangle moves up", "seed": 0, "shape": True},
        {"caption": "two blue triangles stay still", "seed": 1, "shape": False},
        {"caption": "a green circle and a red square", "seed": 0, "shape": True},
        {"caption": "a yellow diamond moves left", "seed": 2, "shape": False},
    ]
    got = hybrid_split.shape_counts(videos)
    assert got == {"square": [1, 1], "circle": [1, 1], "triangle": [1, 2], "diamond": [0, 1]}
    assert hybrid_split.shape_counts(videos, seeds=[0])["triangle"] == [1, 1]

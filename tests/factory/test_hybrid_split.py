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


def test_an_arm_is_scored_as_the_evaluation_scores_it():
    """Overall: every named attribute right (an attribute the analyser could not judge, None, does not count
    against it); per shape asked: the objects read as it, from ``read``, by colour."""

    def video(caption, seed, read, shape, count=True):
        return {
            "caption": caption,
            "seed": seed,
            "read": read,
            "shape": shape,
            "count": count,
            "colour": True,
            "motion": True,
        }

    evaluation = {
        "variants": {
            "mhla-hybrid": {
                "flow_loss": 0.07,
                "per_video": [
                    video("a red triangle moves up", 0, {"red": "triangle"}, True),
                    video("a blue triangle stays still", 1, {"blue": "other"}, False),
                    video("a green circle moves left", 0, {"green": "circle"}, True, count=None),
                    video("a yellow diamond moves down", 2, {"yellow": "diamond"}, True, count=False),
                ],
            }
        }
    }
    got = hybrid_split.row(evaluation)
    assert got["overall"] == 0.5 and got["shape"] == 0.75 and got["videos"] == 4 and got["flow_loss"] == 0.07
    assert got["shapes"] == {"circle": [1, 1], "triangle": [1, 2], "diamond": [1, 1]}
    seed0 = hybrid_split.row(evaluation, seeds=[0])
    assert seed0["overall"] == 1.0 and seed0["shapes"] == {"circle": [1, 1], "triangle": [1, 1]}

"""factory.memorization: the flow loss on a stage's training draws against fresh draws of the same world."""

import json

import pytest
import torch

from factory import memorization
from world.synthetic import SyntheticVideoDataset, world_named


def test_the_fresh_draws_are_none_of_the_trained_ones():
    """The fresh seed's samples are other clips and stills than the cache's (seed 0): same world, other draws."""
    for frames in (9, 1):
        trained = SyntheticVideoDataset(32, seed=0, num_frames=frames, height=64, width=80, world=world_named("v3"))
        fresh = SyntheticVideoDataset(
            32, seed=memorization.FRESH_SEED, num_frames=frames, height=64, width=80, world=world_named("v3")
        )
        seen = [trained[i]["video"] for i in range(32)]
        for i in range(32):
            assert not any(torch.equal(fresh[i]["video"], v) for v in seen)


def test_the_trained_draws_are_the_joint_stage_s_cache_samples():
    """What the stage's cache was encoded from (its config, data.source=synthetic, build_dataset with train.seed):
    the same clips and stills, item for item, as the command's trained draws."""
    from training.config import load_config
    from training.data import build_dataset

    # the data and seed from the stage's config; its folders (runs/, absent on a clean clone) replaced
    cfg = load_config(
        "factory/configs/v3/joint.yaml",
        [
            "data.source=synthetic",
            "data.image_ratio=0",
            "data.image_path=null",
            "model.path=assets/builtin",
            "model.transformer=null",
        ],
    )
    d = cfg.data
    for images, frames in ((False, d.num_frames), (True, 1)):
        cached = build_dataset(d, cfg.train.seed, cfg.model, images=images)
        ours = memorization.draws(d.num_samples, cfg.train.seed, frames, d.height, d.width, world_named(d.world))
        for i in (0, 1, 4095):
            assert torch.equal(cached[i]["video"], ours[i]["video"]) and cached[i]["caption"] == ours[i]["caption"]


def test_it_runs_on_the_built_in_model_and_reports_both_kinds(tmp_path):
    from pipelines.model_dir import builtin_info

    if builtin_info().get("world") != "v3":
        pytest.skip("the shipped built-in model is not the third design")
    out = tmp_path / "m"
    transformer = memorization.BUILTIN_DIR / "transformer"
    args = ["--transformer", str(transformer), "--samples", "16", "--batches", "1", "--batch-size", "2"]
    assert memorization.main([*args, "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert set(res["losses"]) == {"clips trained", "clips fresh", "stills trained", "stills fresh"}
    assert all(r["mean"] > 0 and len(r["draws"]) == 2 for r in res["losses"].values())
    for kind in ("clips", "stills"):
        want = res["losses"][f"{kind} fresh"]["mean"] / res["losses"][f"{kind} trained"]["mean"] - 1
        assert res["fresh_over_trained"][kind] == pytest.approx(want)
    with pytest.raises(SystemExit):
        memorization.main(["--transformer", str(transformer), "--batches", "0"])

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

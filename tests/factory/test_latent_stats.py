"""The latent-statistics diagnosis: per-frame statistics, and which real frame a generated frame resembles."""

import json

import numpy as np
import pytest
import torch

from factory.latent_stats import frame_statistics, main
from pipelines.model_dir import builtin_available


def test_a_first_frame_drawn_like_the_second_is_found():
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    n, c, f = 6, 16, 4
    offsets = torch.randn(c, f, generator=g) * 2  # each frame's own channel means
    real = torch.randn(n, c, f, 3, 5, generator=g) * 0.1 + offsets[None, :, :, None, None]
    drawn = offsets.clone()
    drawn[:, 0] = offsets[:, 1]  # the generator gives frame 0 the second frame's channel means
    generated = torch.randn(n, c, f, 3, 5, generator=g) * 0.1 + drawn[None, :, :, None, None]
    stats = frame_statistics(real, generated)
    assert stats["closest_real_frame"] == [1, 1, 2, 3]
    x = real.numpy().astype(np.float64)
    for t in range(f):
        assert stats["real_std"][t] == pytest.approx(x[:, :, t].std(ddof=1), abs=1e-3)
        gap = np.abs(generated.numpy()[:, :, t].mean(axis=(0, 2, 3)) - x[:, :, t].mean(axis=(0, 2, 3))).mean()
        assert stats["channel_mean_gap"][t] == pytest.approx(gap, abs=1e-3)
    assert stats["channel_mean_gap"][0] > 5 * max(stats["channel_mean_gap"][1:])
    with pytest.raises(ValueError, match="differ"):
        frame_statistics(real, generated[:, :, :3])


@pytest.mark.skipif(not builtin_available(), reason="assets/builtin is missing")
@pytest.mark.slow  # loads the built-in model
def test_latent_stats_runs_on_the_builtin_model(tmp_path, capsys):
    out = tmp_path / "stats"
    assert main(["--num-prompts", "2", "--steps", "2", "--guidance-max-sigma", "0.5", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["guidance_max_sigma"] == 0.5
    assert len(res["real_std"]) == len(res["generated_std"]) == len(res["corr_real"]) == 5  # 17 frames: 5 latent
    assert all(len(row) == 5 and all(-1 <= v <= 1 for v in row) for row in res["corr_real"])
    assert "closest real frame" in capsys.readouterr().out
    assert main(["--num-prompts", "1"]) == 2  # the error boundary: an exit code, not SystemExit
    assert main(["--guidance-max-sigma", "1.5"]) == 2  # the error boundary: an exit code, not SystemExit
    assert "--guidance-max-sigma must be a noise level in [0, 1], got 1.5" in capsys.readouterr().err

import pytest
import torch

from mhla import BlockLayout, attention_weights, expressivity, locality_init, rank_and_entropy


def test_linear_rank_bounded_by_d_and_mhla_exceeds_it(gen):
    d, layout = 8, BlockLayout((4, 8, 8), (2, 2, 4))  # N = 256 >> d, M = 16
    q = torch.randn(layout.num_tokens, d, generator=gen, dtype=torch.float64)
    k = torch.randn(layout.num_tokens, d, generator=gen, dtype=torch.float64)
    stats = expressivity(q, k, layout, locality_init(layout))
    assert stats["linear"]["rank"] <= d
    assert stats["mhla"]["rank"] > d
    assert stats["softmax"]["rank"] > d
    # rank of MHLA is bounded by sum_b min(n_b, d)
    assert stats["mhla"]["rank"] <= int(layout.block_sizes.clamp(max=d).sum())
    # linear attention spreads its weight more evenly than MHLA (closer to uniform rows)
    assert stats["linear"]["entropy"] > stats["mhla"]["entropy"]
    for kind in stats.values():
        assert 0 < kind["entropy"] <= kind["max_entropy"] + 1e-9


def test_weights_are_row_stochastic(gen):
    layout = BlockLayout((1, 4, 4), (1, 2, 2))
    q, k = (torch.randn(16, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    for kind in ("softmax", "linear", "mhla"):
        w = attention_weights(q, k, kind, layout, locality_init(layout))
        assert (w >= 0).all()
        torch.testing.assert_close(w.sum(1), torch.ones(16, dtype=torch.float64))


def test_rank_and_entropy_by_hand():
    rank, ent = rank_and_entropy(torch.full((4, 4), 0.25, dtype=torch.float64))
    assert rank == 1 and ent == pytest.approx(torch.log(torch.tensor(4.0)).item())
    rank, ent = rank_and_entropy(torch.eye(5, dtype=torch.float64))
    assert rank == 5 and ent == pytest.approx(0.0, abs=1e-12)


def test_diagnostics_bad_input():
    q = torch.randn(8, 4)
    with pytest.raises(ValueError, match="unknown attention kind"):
        attention_weights(q, q, "sparse")
    with pytest.raises(ValueError, match="needs a layout"):
        attention_weights(q, q, "mhla")
    with pytest.raises(ValueError, match=r"\(tokens, head_dim\)"):
        attention_weights(q, q[:4], "linear")

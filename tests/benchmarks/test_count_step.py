"""benchmarks.count_step: its matrix-product count against the Wan2.1-1.3B block written out by hand, and
fusion never adding traffic. Counting only (meta device); nothing timed."""

from benchmarks.count_step import main


def test_counts_against_the_hand_formula(tmp_path):
    r = main(["--out", str(tmp_path / "count")])
    b, n, t, d, f = 2, 21 * 30 * 50, 512, 1536, 8960
    per_layer = (
        2 * b * n * d * d * 4  # self-attention q, k, v, out
        + 2 * b * n * d * d * 2  # cross-attention q, out
        + 2 * b * t * d * d * 2  # cross-attention k, v on the text
        + 4 * b * n * t * d  # cross-attention's QK^T and PV
        + 2 * b * n * d * f * 2  # feed-forward up and down
    )
    counted = r["counts"]["eager_per_layer"]["product_flops"]
    assert abs(counted - per_layer) / per_layer < 1e-9, (counted, per_layer)
    eager, compiled = r["counts"]["eager"], r["counts"]["compiled"]
    assert compiled["product_flops"] == eager["product_flops"]
    assert compiled["elementwise_bytes"] < eager["elementwise_bytes"]
    assert compiled["elementwise_kernels"] < eager["elementwise_kernels"]
    assert (tmp_path / "count.md").read_text().startswith("# The Wan2.1-1.3b step outside self-attention")


def test_14b_at_720p_is_predicted_from_the_measured_fit(tmp_path):
    """Wan2.1-14B at 81x720x1280 (21x45x80 = 75,600 tokens): the rest counted as the 1.3B's (its products against
    the hand formula), softmax attention at the measured run's FLOP rate, the fit's efficiencies unchanged."""
    r = main(["--config", "14b", "--grid", "21x45x80", "--out", str(tmp_path / "c14")])
    b, n, t, d, f, h, layers = 2, 21 * 45 * 80, 512, 5120, 13824, 40, 40
    per_layer = 2 * b * n * d * d * 6 + 2 * b * t * d * d * 2 + 4 * b * n * t * d + 2 * b * n * d * f * 2
    counted = r["counts"]["eager_per_layer"]["product_flops"]
    assert abs(counted - per_layer) / per_layer < 1e-9, (counted, per_layer)
    a = r["attention"]
    assert a["softmax_flops"] == 4 * b * h * n * n * 128 * layers
    # the rate is the measured run's: 1.3B, 30 layers, 12 heads, 31,500 tokens, 771.5 ms of self-attention
    assert abs(a["softmax_flop_rate"] - 4 * 2 * 12 * 31500**2 * 128 * 30 / 0.7715) < 1e3
    assert a["work_scale_vs_measured"] == (40 * 75600) / (12 * 31500)
    h100 = r["predictions"]["H100"]
    assert 0.6 < h100["softmax_attention_share_eager"] < 0.8
    assert h100["flash"]["eager_ms"] > h100["mhla-hybrid"]["eager_ms"] > h100["mhla"]["eager_ms"]
    assert h100["mhla"]["vs_flash_eager"] == h100["flash"]["eager_ms"] / h100["mhla"]["eager_ms"]
    assert r["predictions"]["H200"]["mhla"]["eager_ms"] < h100["mhla"]["eager_ms"]  # its bandwidth, same FLOPs
    assert 13e9 < r["memory"]["weights_bytes"] / 2 < 15e9  # ~14B parameters in bf16
    assert (
        r["meta"]["elementwise_efficiency_fitted"]
        == main(["--out", str(tmp_path / "c13")])["meta"]["elementwise_efficiency_fitted"]
    )
    assert "hangs on cuDNN's rate" in (tmp_path / "c14.md").read_text()

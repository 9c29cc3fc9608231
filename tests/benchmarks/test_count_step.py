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

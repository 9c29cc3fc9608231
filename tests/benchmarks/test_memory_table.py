"""The memory estimate: exact parameter counts from meta-device builds, the token grids of each model, and
offload modes that never need more than keeping everything on the card."""

import math

from benchmarks import memory_table as mt


def test_meta_counts_equal_a_real_build():
    from diffusers import WanTransformer3DModel

    cfg = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=3,
    )
    counts = mt.transformer_counts(cfg)
    real = WanTransformer3DModel(**cfg)
    assert counts["total"] == sum(p.numel() for p in real.parameters())
    assert counts["block"] * 3 + counts["rest"] == counts["total"]
    # sequential offloading holds a module's own weights while its children run: the largest sum of own
    # parameters along a path from the root to a module (its name's prefixes)
    own = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in real.named_modules()}
    paths = {
        name: own[""] + sum(own[".".join(name.split(".")[: i + 1])] for i in range(len(name.split("."))))
        for name in own
        if name
    }
    assert counts["leaf"] == max(paths.values())
    assert counts["leaf"] > max(own.values())  # the root's and the blocks' scale_shift_table ride along


def test_token_grids_follow_each_vae():
    wan21, wan22 = mt.MODELS[0], mt.MODELS[2]
    assert mt.token_grid(wan21, 480, 832) == (21, 30, 52)  # 32,760 tokens
    assert mt.token_grid(wan21, 480, 800) == (21, 30, 50)  # the paper's 31,500
    assert mt.token_grid(wan22, 704, 1280) == (31, 22, 40)  # 121 frames, 16x VAE and a 2x2 patch


def test_offloading_never_needs_more_than_none():
    tiny = dict(mt.WAN_CONFIGS["1.3b"], num_layers=2)
    model = mt.Model("tiny", (tiny, tiny), mt.VAE_21, (4, 8, 8), 17, {"low": (128, 160)})
    counts = {
        "text_encoder": {"total": 1000, "layer": 100, "leaf": 50},
        "transformer": {"tiny": [mt.transformer_counts(tiny)] * 2},
        "vae": {"tiny": {"total": 10, "config": {"base_dim": 96, "patch_size": None}}},
    }
    for variant in mt.VARIANTS:
        peak = {m: mt.estimate(model, "low", variant, m, True, counts)["peak_gb"] for m in mt.MODES}
        assert peak["group"] <= peak["model"] <= peak["none"]
        assert peak["sequential"] <= peak["model"]
    none = mt.estimate(model, "low", "mhla", "none", True, counts)
    # both experts' weights resident without offloading
    weights = (1000 + 2 * counts["transformer"]["tiny"][0]["total"] + 10) * 2 / 1e9
    assert none["peak_gb"] >= round(weights, 1)
    assert none["fits_gb"]["80"] and none["host_ram_gb"] == 0


def test_activation_grows_with_tokens_and_linear_holds_float32_features():
    cfg = mt.WAN_CONFIGS["1.3b"]
    small, large = (mt.activation_bytes(cfg, n, "flash", 105) for n in (1000, 4000))
    assert large == 4 * small
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    n = 50_000
    ffn = n * cfg["ffn_dim"] * 4
    attention = n * d * 24 + 105 * 12 * 128 * 128 * 4
    assert mt.activation_bytes(cfg, n, "mhla", 105) == n * d * 6 + max(ffn, attention)
    assert math.isclose(mt.blocks_for((21, 30, 50)), 105)

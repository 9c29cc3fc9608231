"""Importing the MHLA authors' published Wan2.1 checkpoints, and the compatibility mode their forward needs.

Nobody can download the real files here, so every test uses a tiny synthetic checkpoint in the published
key format (original Wan names + ``self_attn.block_attn.conv.weight`` / ``self_attn.g_norm.weight``), with
random values, and checks the imported model against a dense O(N^2) implementation of the authors' forward
written in this file from its description (PAPER_NOTES, issue 8).
"""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch

import mhla
from mhla import BlockLayout, MixingCoefficients, locality_columns_init, resample_mixing
from pipelines import import_official as imp
from pipelines.attention import AttentionOptions, hybrid_layers
from pipelines.loading import load_components, load_transformer, save_transformer
from pipelines.model import convert_self_attention, current_variant
from pipelines.tiny import TINY_TRANSFORMER, build_tiny_components, build_tiny_transformer

# ---------------------------------------------------------------------------------------------------------
# compatibility-mode pieces of the operator and the options


def test_locality_columns_init_by_hand():
    # centres 0, 1, 2; global max distance 2: 1 - D/2 = [[1, .5, 0], [.5, 1, .5], [0, .5, 1]], columns / sums
    m = locality_columns_init(BlockLayout((1, 1, 6), (1, 1, 3)))
    raw = torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.5], [0.0, 0.5, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(m, raw / raw.sum(0, keepdim=True), rtol=0, atol=1e-15)
    torch.testing.assert_close(m.sum(0), torch.ones(3, dtype=torch.float64))
    assert not torch.allclose(m.sum(1), torch.ones(3, dtype=torch.float64))  # rows are not normalised
    assert locality_columns_init(BlockLayout((1, 1, 2), (1, 1, 1))).tolist() == [[1.0]]
    coeffs = MixingCoefficients(BlockLayout((1, 1, 6), (1, 1, 3)), init="locality_columns", constrain=False)
    torch.testing.assert_close(coeffs(), m.float())


def test_unconstrained_mixing_is_used_as_stored():
    layout = BlockLayout((1, 2, 2), (1, 2, 2))
    coeffs = MixingCoefficients(layout, constrain=False)
    with torch.no_grad():
        coeffs.weight.copy_(torch.tensor([[2.0, -1.0, 0.0, 0.5]] * 4))
    assert torch.equal(coeffs(), coeffs.weight)
    coeffs.project_()  # a no-op without the constraint
    assert coeffs.weight[0, 1] == -1.0


def test_constrain_mixing_option_defaults_on_and_travels_in_the_config(tmp_path):
    assert AttentionOptions().constrain_mixing is True
    assert AttentionOptions.from_dict({"blocks": [1, 2, 2]}).constrain_mixing is True  # configs saved before it
    with pytest.raises(ValueError, match="constrain_mixing must be True or False"):
        AttentionOptions(constrain_mixing="no")

    model = build_tiny_transformer(seed=4, num_layers=2)
    convert_self_attention(model, "mhla", options=AttentionOptions(blocks=(1, 2, 2), constrain_mixing=False))
    mod = model.blocks[1].attn1.mhla
    assert mod.mhla.mixing.constrain is False
    with torch.no_grad():
        mod.mhla.mixing.weight.mul_(-3.0)  # negative, rows far from 1: kept as they are
    assert torch.equal(mod.mhla.mixing(), mod.mhla.mixing.weight)
    save_transformer(model, tmp_path / "t")
    saved = json.loads((tmp_path / "t" / "config.json").read_text())["self_attention"]["options"]
    assert saved["constrain_mixing"] is False
    loaded = load_transformer(tmp_path / "t", dtype="float32", device="cpu")
    assert loaded.blocks[1].attn1.mhla.mhla.mixing.constrain is False
    assert torch.equal(loaded.blocks[1].attn1.mhla.mhla.mixing(), mod.mhla.mixing.weight)
    # our own conversions keep the paper's constraint
    ours = convert_self_attention(build_tiny_transformer(seed=4, num_layers=2), "mhla")
    assert ours.blocks[0].attn1.mhla.mhla.mixing.constrain is True
    assert ours.conversion.to_config()["options"]["constrain_mixing"] is True


def test_resample_without_renormalising_keeps_row_totals(gen):
    m = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    out = resample_mixing(m, (3, 2, 2), (1, 2, 2), renormalize=False)
    rows = torch.tensor([4, 5, 6, 7])  # the middle frame block's rows (nearest centre to the single new one)
    torch.testing.assert_close(out.sum(1), m[rows].sum(1))
    torch.testing.assert_close(out, m[rows].reshape(4, 3, 4).sum(1))
    normalised = resample_mixing(m.abs(), (3, 2, 2), (1, 2, 2))
    torch.testing.assert_close(normalised.sum(1), torch.ones(4, dtype=torch.float64))


def test_mhla_module_starts_from_the_authors_init():
    # 3 blocks in a row: 1 - dist / (global max 2), columns normalised (rows are not), used unconstrained
    raw = torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.5], [0.0, 0.5, 1.0]], dtype=torch.float64)
    m = raw / raw.sum(0, keepdim=True)
    module = mhla.MHLA("1x1x3", mixing_init="locality_columns", constrain_mixing=False)
    torch.testing.assert_close(module.mixing().double(), m.float().double())


# ---------------------------------------------------------------------------------------------------------
# synthetic checkpoints in the published format

# diffusers name -> original Wan name, written out here (not taken from the importer) so the test checks
# diffusers' mapping rather than repeating it
_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("proj_out", "head.head"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
]


def original_name(name: str) -> str:
    for a, b in _TO_ORIGINAL:
        name = name.replace(a, b)
    name = re.sub(r"^blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3.", name)  # the cross-attention norm
    name = re.sub(r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation", name)
    return "head.modulation" if name == "scale_shift_table" else name


def synthetic_checkpoint(model, mhla_layers, num_blocks, seed=0) -> dict[str, torch.Tensor]:
    """``model``'s weights (re-drawn at random) under original Wan names, plus the published MHLA keys:
    an ``M x M x 1 x 1`` conv of random signed values and a random ``g_norm`` weight per MHLA layer."""
    g = torch.Generator().manual_seed(seed)
    head_dim = model.config.attention_head_dim
    ckpt = {original_name(k): torch.randn(v.shape, generator=g) * 0.2 for k, v in model.state_dict().items()}
    for name in list(ckpt):
        if "norm" in name and name.endswith(".weight"):
            ckpt[name] = 1.0 + ckpt[name]  # norm weights near 1, as trained ones are
    for i in mhla_layers:
        ckpt[f"blocks.{i}.self_attn.block_attn.conv.weight"] = torch.randn(num_blocks, num_blocks, 1, 1, generator=g)
        ckpt[f"blocks.{i}.self_attn.g_norm.weight"] = 0.5 + torch.rand(head_dim, generator=g)
    return ckpt


def test_original_names_map_back_through_diffusers():
    model = build_tiny_transformer(num_layers=3)
    names = {original_name(k): k for k in model.state_dict()}
    assert "blocks.1.self_attn.q.weight" in names and "blocks.0.norm3.weight" in names and "head.head.bias" in names
    assert imp.diffusers_names(names) == names


def test_infer_blocks_published_and_bad_sizes():
    assert imp.infer_blocks(150, (21, 30, 50)) == (3, 5, 10)  # the published layout: 7x6x5-token blocks
    for (m, grid), blocks in imp.KNOWN_LAYOUTS.items():
        assert imp.infer_blocks(m, grid) == blocks
    assert imp.infer_blocks(105, (21, 30, 50)) == (7, 3, 5)  # the paper's M (3x10x10-token blocks)
    assert imp.infer_blocks(6, (3, 4, 6)) == (1, 2, 3)
    with pytest.raises(ValueError, match=r"8x8 mixing matrix \(M=8\) fits no block layout of the 21x30x50 token grid"):
        imp.infer_blocks(8)
    with pytest.raises(ValueError, match="bf dividing 21, bh dividing 30 and bw dividing 50"):
        imp.infer_blocks(11)


# ---------------------------------------------------------------------------------------------------------
# the dense O(N^2) forward of the authors' MHLA layer, written from its description


def _rms(x, weight, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _wan_rope(grid, head_dim, theta=10000.0):
    """Original Wan RoPE as complex numbers ``(N, head_dim/2)``: frequencies split over (frames, height, width)."""

    def params(dim):
        angles = torch.outer(
            torch.arange(1024, dtype=torch.float64), 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        )
        return torch.polar(torch.ones_like(angles), angles)

    d = head_dim
    freqs = torch.cat([params(d - 4 * (d // 6)), params(2 * (d // 6)), params(2 * (d // 6))], dim=1)
    c = d // 2
    ff, fh, fw = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    return torch.cat(
        [
            ff[:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            fh[:h].view(1, h, 1, -1).expand(f, h, w, -1),
            fw[:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, -1)


def their_mhla_layer(x, ckpt, layer, grid, blocks, heads):
    """One MHLA self-attention layer of the authors' model, dense, float64, from the published tensors.

    q, k: Wan's RMSNorm over all channels; phi = relu + 1e-6; RoPE on phi(q), phi(k); weight of key s for
    query t = W[block(t), block(s)] * phi(q_t).phi(k_s) with the conv weight W as stored (conv output
    channel = query block); no normalizer; per-head RMSNorm (one weight for all heads); then o.
    """
    p = lambda n: ckpt[f"blocks.{layer}.self_attn.{n}"].double()  # noqa: E731
    x = x.double()
    q = _rms(x @ p("q.weight").T + p("q.bias"), p("norm_q.weight"))
    k = _rms(x @ p("k.weight").T + p("k.bias"), p("norm_k.weight"))
    v = x @ p("v.weight").T + p("v.bias")
    n = x.shape[1]
    q, k, v = (t.view(1, n, heads, -1) for t in (q, k, v))
    fq, fk = torch.relu(q) + 1e-6, torch.relu(k) + 1e-6
    rope = _wan_rope(grid, q.shape[-1])[None, :, None, :]
    rq = torch.view_as_real(torch.view_as_complex(fq.reshape(1, n, heads, -1, 2).contiguous()) * rope).flatten(-2)
    rk = torch.view_as_real(torch.view_as_complex(fk.reshape(1, n, heads, -1, 2).contiguous()) * rope).flatten(-2)
    f, h, w = grid
    bf, bh, bw = blocks
    ti, hi, wi = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
    block = ((ti // (f // bf)) * bh + hi // (h // bh)) * bw + wi // (w // bw)
    block = block.reshape(-1)
    mix = p("block_attn.conv.weight")[:, :, 0, 0]
    weights = torch.einsum("bthd,bshd->bhts", rq, rk) * mix[block[:, None], block[None, :]]
    out = torch.einsum("bhts,bshd->bthd", weights, v)
    out = _rms(out, p("g_norm.weight"))
    return out.flatten(2) @ p("o.weight").T + p("o.bias")


def _checkpoint_file(tmp_path, ckpt, kind="safetensors"):
    path = tmp_path / f"ckpt.{kind}"
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in ckpt.items()}, str(path))
    else:
        torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A diffusers-format tiny Wan2.1 directory (30 layers), standing in for Wan2.1-T2V-1.3B-Diffusers."""
    from diffusers import WanPipeline

    root = tmp_path_factory.mktemp("base") / "wan"
    WanPipeline(**build_tiny_components(seed=0)).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def base6(tmp_path_factory):
    """A 6-layer base directory shared by the tests whose checkpoints are refused before anything is written
    (each asserts that its output folder was never made; the base is only read)."""
    return _small_base(tmp_path_factory.mktemp("base6"), 6)


def _small_base(tmp_path, num_layers):
    """A base dir whose transformer has ``num_layers`` layers (other parts as the tiny model's)."""
    from diffusers import WanPipeline

    parts = build_tiny_components(seed=0)
    parts["transformer"] = build_tiny_transformer(seed=2, num_layers=num_layers)
    root = tmp_path / f"base{num_layers}"
    WanPipeline(**parts).save_pretrained(root)
    return root


def test_imported_layers_equal_their_dense_forward(tmp_path):
    num_layers, grid, blocks = 3, (2, 4, 6), (2, 2, 3)
    base = _small_base(tmp_path, num_layers)
    ckpt = synthetic_checkpoint(build_tiny_transformer(num_layers=num_layers), range(num_layers), 12, seed=7)
    out = imp.import_official(_checkpoint_file(tmp_path, ckpt, "pt"), base, tmp_path / "out", grid=grid, blocks="2x2x3")
    model = load_transformer(out / "transformer", dtype=torch.float64, device="cpu")
    assert current_variant(model) == "mhla"
    options = model.conversion.to_config()["options"]
    assert options["constrain_mixing"] is False and options["normalize"] is False and options["blocks"] == [2, 2, 3]

    g = torch.Generator().manual_seed(3)
    x = torch.randn(
        1, 48, TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"], generator=g
    )
    latent = torch.zeros(1, 16, grid[0], 2 * grid[1], 2 * grid[2])
    # diffusers' Wan RoPE is Wan's original one, rounded to float32; feed the float64 original for a tight check
    freqs = _wan_rope(grid, TINY_TRANSFORMER["attention_head_dim"])
    rotary = tuple(t.repeat_interleave(2, dim=-1)[None, :, None, :] for t in (freqs.real, freqs.imag))
    for ours, wan in zip(model.rope(latent), rotary):
        torch.testing.assert_close(ours.double(), wan, rtol=0, atol=1e-6)
    model.attention_context.grid = grid
    for layer in range(num_layers):
        with torch.no_grad():
            ours = model.blocks[layer].attn1(x.double(), rotary_emb=rotary)
        theirs = their_mhla_layer(x, ckpt, layer, grid, blocks, TINY_TRANSFORMER["num_attention_heads"])
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)

    # the compatibility mode matters: the paper's clamped, row-normalised mixing computes something else
    mod = model.blocks[0].attn1.mhla.mhla.mixing
    assert (mod.weight < 0).any()
    mod.constrain = True
    with torch.no_grad():
        constrained = model.blocks[0].attn1(x.double(), rotary_emb=rotary)
    assert not torch.allclose(constrained, their_mhla_layer(x, ckpt, 0, grid, blocks, 2), atol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# import -> load -> generate, round trips


SMALL = dict(height=64, width=96, num_frames=9, num_inference_steps=2, guidance_scale=3.0)  # grid 3x4x6


@pytest.mark.slow  # writes, loads and generates with a model directory
def test_hybrid_import_loads_and_generates(base_dir, tmp_path, capsys):
    from pipelines.cli import GenerationRequest, generate
    from pipelines.cli import main as generate_main

    ckpt = synthetic_checkpoint(build_tiny_transformer(num_layers=30), hybrid_layers(30), 6, seed=1)
    path = _checkpoint_file(tmp_path, ckpt)
    out = tmp_path / "wan-mhla-hybrid"
    argv = ["--checkpoint", str(path), "--base", str(base_dir), "--out", str(out), "--hybrid", "--grid", "3x4x6"]
    assert imp.main(argv) == 0
    printed = capsys.readouterr().out
    assert "imported mhla-hybrid (20 MHLA layers, 1x2x3 blocks, inferred from M=6 over the 3x4x6 token grid)" in printed

    record = json.loads((out / "import_official.json").read_text())
    assert record["variant"] == "mhla-hybrid" and record["mhla_layers"] == hybrid_layers(30)
    assert record["blocks"] == [1, 2, 3] and record["components"] == "link"
    for part in ("scheduler", "tokenizer", "text_encoder", "vae"):
        assert (out / part).is_symlink() and (out / part).resolve() == (base_dir / part).resolve()

    components = load_components(out, dtype="float32", device="cpu")
    model = components.transformer
    state = model.conversion.to_config()
    assert state["variant"] == "mhla-hybrid" and state["linear_layers"] == hybrid_layers(30)
    assert state["options"]["constrain_mixing"] is False and state["options"]["blocks"] == [1, 2, 3]
    # every weight is the checkpoint's: mapped names, the conv as the (M, M) mixing matrix, g_norm as norm_out
    sd = model.state_dict()
    for name, theirs in ckpt.items():
        m = re.match(r"blocks\.(\d+)\.self_attn\.(block_attn\.conv|g_norm)\.weight", name)
        if m:
            mix, norm = imp.mhla_param_names(int(m.group(1)))
            ours = sd[mix] if "conv" in name else sd[norm]
            assert torch.equal(ours, theirs.reshape(ours.shape)), name
    mapped = imp.diffusers_names([k for k in ckpt if "block_attn" not in k and "g_norm" not in k])
    assert all(torch.equal(sd[new], ckpt[old]) for old, new in mapped.items())
    assert not hasattr(model.blocks[0].attn1, "mhla") and hasattr(model.blocks[1].attn1, "mhla")

    request = GenerationRequest(prompt="a fox", variant="mhla-hybrid", seed=0, **SMALL)
    result = generate(components, request, show_progress=False)
    assert result.frames.shape == (9, 64, 96, 3) and np.isfinite(result.frames).all()
    assert result.timing.num_blocks == 6 and "1x2x3 blocks (M=6)" in result.timing.layout
    assert model.conversion.to_config()["linear_layers"] == hybrid_layers(30)  # its own split, not re-chosen

    # the generation CLI runs it like any local model
    video = tmp_path / "fox.mp4"
    argv = ["--model", str(out), "--prompt", "a fox", "--variant", "mhla-hybrid", "--out", str(video), "--no-progress"]
    argv += ["--height", "64", "--width", "96", "--frames", "9", "--steps", "2"]
    assert generate_main(argv) == 0
    assert video.stat().st_size > 0 and "1x2x3 blocks (M=6)" in capsys.readouterr().out


def test_imported_model_round_trips_through_save_and_load(tmp_path):
    base = _small_base(tmp_path, 3)
    ckpt = synthetic_checkpoint(build_tiny_transformer(num_layers=3), [1, 2], 6, seed=5)
    training = {"state_dict": {f"module.{k}": v for k, v in ckpt.items()}, "step": 1500, "epoch": 2}
    path = tmp_path / "epoch_2_step_1500.pth"
    torch.save(training, path)
    out = imp.import_official(path, base, tmp_path / "out", grid=(3, 4, 6), components="copy")
    assert json.loads((out / "import_official.json").read_text())["state_dict_key"] == "state_dict"
    assert (out / "vae").is_dir() and not (out / "vae").is_symlink()

    model = load_transformer(out / "transformer", dtype="float32", device="cpu")
    assert current_variant(model) == "mhla-hybrid"
    inputs = dict(
        hidden_states=torch.randn(1, 16, 3, 8, 12, generator=torch.Generator().manual_seed(0)),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1)),
        return_dict=False,
    )
    with torch.no_grad():
        before = model(**inputs)[0]
    save_transformer(model, tmp_path / "again")
    again = load_transformer(tmp_path / "again", dtype="float32", device="cpu")
    assert again.conversion.to_config() == model.conversion.to_config()
    sa, sb = model.state_dict(), again.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():
        torch.testing.assert_close(again(**inputs)[0], before, rtol=0, atol=1e-6)
    # switching variants keeps the imported parameters and the compatibility mode
    from pipelines.model import set_variant

    set_variant(again, "flash")
    set_variant(again, "mhla-hybrid", layers=[1, 2])
    with torch.no_grad():
        torch.testing.assert_close(again(**inputs)[0], before, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# bad input: named, and found before heavy work


class NotAWeight:
    def __init__(self):
        self.payload = "anything"


def _no_heavy_work(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model was built before the input was checked")

    monkeypatch.setattr(imp, "build_transformer", boom)


def _drop_layer(ckpt, layer):
    return {k: v for k, v in ckpt.items() if not k.startswith(f"blocks.{layer}.")}


def _with(ckpt, **changes):
    out = dict(ckpt)
    for k, v in changes.items():
        if v is None:
            out.pop(k.replace("__", "."))
        else:
            out[k.replace("__", ".")] = v
    return out


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "neither",
            r"MHLA keys \(blocks.N.self_attn.block_attn.conv.weight\) in \[1, 3\], which matches neither "
            r"published layout: expected them in all 6 layers \(full MHLA\) or in layers \[1, 2, 4, 5\]",
        ),
        ("no_mhla", "in no layer, which matches neither published layout"),
        ("missing_layer", r"the checkpoint lacks layers \[5\]: expected blocks.0 ... blocks.5 .*num_layers=6"),
        ("extra_layer", r"has layers \[6\] beyond them"),
        ("bad_m", r"a 5x5 mixing matrix \(M=5\) fits no block layout of the 3x4x6 token grid: expected M = bf\*bh\*bw"),
        ("mixed_m", r"mixing matrices of different sizes \(M=6 in layers \[1, 2, 4\]; M=12 in layers \[5\]\)"),
        ("conv_shape", r"block_attn.conv.weight has shape \(6, 6, 3, 3\), expected \(M, M, 1, 1\)"),
        ("norm_shape", r"g_norm.weight has shape \(32,\), expected \(16,\): one RMSNorm weight per head channel"),
        ("no_norm", r"layer 2 has MHLA keys but lacks blocks.2.self_attn.g_norm.weight"),
        ("conv_bias", r"has 1 keys a Wan2.1 transformer does not, e.g. \['blocks.1.self_attn.block_attn.conv.bias'\]"),
        ("missing_weight", r"lacks 1 weights of the base transformer, e.g. \['blocks.3.ffn.net.2.bias'\]"),
        ("other_size", r"do not fit the base transformer config .* e.g. 'blocks.0.self_attn.q.weight' is \(64, 32\)"),
        ("full_not_hybrid", r"--hybrid was given, but the checkpoint is full MHLA"),
        ("blocks_product", r"--blocks 2x2x2 has 8 blocks, but the checkpoint's mixing matrices are 6x6"),
        ("nan_mixing", r"1 weight\(s\) hold NaN or inf, e.g. \['blocks.1.self_attn.block_attn.conv.weight'\]"),
        ("inf_weight", r"hold NaN or inf, e.g. \['blocks.0.self_attn.q.weight'\]"),
        ("int_weight", r"non-float tensor\(s\), e.g. 'blocks.0.self_attn.q.bias' as I64"),
    ],
)
def test_bad_checkpoints_are_named_before_heavy_work(case, message, tmp_path, monkeypatch, base6):
    num_layers = 6
    base = base6
    model = build_tiny_transformer(num_layers=num_layers)
    hybrid = hybrid_layers(num_layers)
    ckpt = synthetic_checkpoint(model, hybrid, 6)
    kwargs = dict(grid=(3, 4, 6))
    conv = "blocks.{}.self_attn.block_attn.conv.weight"
    if case == "neither":
        ckpt = synthetic_checkpoint(model, [1, 3], 6)
    elif case == "no_mhla":
        ckpt = synthetic_checkpoint(model, [], 6)
    elif case == "missing_layer":
        ckpt = _drop_layer(ckpt, 5)
    elif case == "extra_layer":
        ckpt = {**ckpt, "blocks.6.ffn.0.bias": torch.zeros(64)}
    elif case == "bad_m":
        ckpt = synthetic_checkpoint(model, hybrid, 5)
    elif case == "mixed_m":
        ckpt[conv.format(5)] = torch.zeros(12, 12, 1, 1)
    elif case == "conv_shape":
        ckpt[conv.format(1)] = torch.zeros(6, 6, 3, 3)
    elif case == "norm_shape":
        ckpt["blocks.4.self_attn.g_norm.weight"] = torch.ones(32)
    elif case == "no_norm":
        del ckpt["blocks.2.self_attn.g_norm.weight"]
    elif case == "conv_bias":
        ckpt["blocks.1.self_attn.block_attn.conv.bias"] = torch.zeros(6)
    elif case == "missing_weight":
        del ckpt["blocks.3.ffn.2.bias"]
    elif case == "other_size":
        ckpt["blocks.0.self_attn.q.weight"] = torch.zeros(64, 32)
    elif case == "full_not_hybrid":
        ckpt = synthetic_checkpoint(model, range(num_layers), 6)
        kwargs["hybrid"] = True
    elif case == "blocks_product":
        kwargs["blocks"] = "2x2x2"
    elif case == "nan_mixing":
        ckpt[conv.format(1)] = torch.full_like(ckpt[conv.format(1)], float("nan"))
    elif case == "inf_weight":
        ckpt["blocks.0.self_attn.q.weight"] = ckpt["blocks.0.self_attn.q.weight"].clone()
        ckpt["blocks.0.self_attn.q.weight"][0, 0] = float("inf")
    elif case == "int_weight":
        ckpt["blocks.0.self_attn.q.bias"] = ckpt["blocks.0.self_attn.q.bias"].long()
    _no_heavy_work(monkeypatch)
    with pytest.raises(ValueError, match=message):
        imp.import_official(_checkpoint_file(tmp_path, ckpt), base, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("damage", ["empty", "text", "truncated"])
def test_unreadable_checkpoint_files_are_named(suffix, damage, tmp_path, monkeypatch, base6):
    base = base6
    good = synthetic_checkpoint(build_tiny_transformer(num_layers=6), hybrid_layers(6), 6)
    path = tmp_path / f"ckpt{suffix}"
    if suffix == ".pt":
        torch.save(good, path)
    else:
        from safetensors.torch import save_file

        save_file(good, path)
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "text":
        path.write_text("not a checkpoint at all")
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _no_heavy_work(monkeypatch)
    with pytest.raises(
        ValueError, match=f"{str(path)!r}.*(not a readable safetensors file|cannot be read as a PyTorch)"
    ):
        imp.import_official(path, base, tmp_path / "out", grid=(3, 4, 6))
    assert not (tmp_path / "out").exists()
    assert imp.main(["--checkpoint", str(path), "--base", str(base), "--out", str(tmp_path / "out")]) == 2


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickles_needing_arbitrary_code_are_refused(tmp_path, monkeypatch):
    ckpt = {"blocks.0.self_attn.q.weight": torch.zeros(2, 2), "extra": NotAWeight()}
    path = tmp_path / "evil.pt"
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=r"refusing to load .*evil.pt.*needs arbitrary unpickling.*NotAWeight"):
        imp.load_checkpoint_tensors(path)
    # a plain pickle (not torch.save's format) of a custom object: refused the same way
    with open(tmp_path / "plain.pth", "wb") as f:
        pickle.dump({"w": NotAWeight()}, f)
    with pytest.raises(ValueError, match="refusing to load"):
        imp.load_checkpoint_tensors(tmp_path / "plain.pth")


def test_paths_and_formats_are_checked(base_dir, tmp_path, capsys):
    ckpt = tmp_path / "ok.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(ckpt))
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    cases = [
        (["--checkpoint", str(tmp_path / "nope.pt")], "checkpoint '.*nope.pt' does not exist"),
        (["--checkpoint", str(tmp_path / "weights.gguf")], r"expected one of .safetensors, .pt, .pth"),
        (["--checkpoint", str(ckpt), "--base", str(tmp_path / "nobase")], "model directory '.*nobase' does not exist"),
        (["--checkpoint", str(ckpt), "--out", str(tmp_path / "full")], "already exists and is not empty"),
        (["--checkpoint", str(ckpt), "--out", str(base_dir)], "is the --base directory"),
        (["--checkpoint", str(ckpt), "--grid", "3x4"], "--grid must look like '21x30x50'"),
    ]
    for argv, message in cases:
        full = {"--base": str(base_dir), "--out": str(tmp_path / "new")}
        for i in range(0, len(argv), 2):
            full[argv[i]] = argv[i + 1]
        assert imp.main([x for kv in full.items() for x in kv]) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err), (message, err)
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match=r"no state dict under 'ema'; its top-level keys are \['state_dict', 'step'\]"):
        torch.save({"state_dict": {"a": torch.zeros(1)}, "step": 3}, tmp_path / "t.pt")
        imp.load_checkpoint_tensors(tmp_path / "t.pt", state_dict_key="ema")


@pytest.mark.slow  # Triton's interpreter on a CPU
def test_fused_kernels_take_signed_unnormalised_mixing(gen):
    # the published mixing is partly negative with rows far from 1; the Triton path (on a GPU by default) must
    # use it as given too. Without a GPU this runs in Triton's interpreter (see conftest).
    triton_ops = pytest.importorskip("mhla.triton_ops")
    if not triton_ops.available():
        pytest.skip("Triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layout = BlockLayout((2, 4, 6), (2, 2, 3))
    q, k, v = (torch.randn(1, 48, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    mixing = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    angles = (torch.rand(1, 48, 1, 8, generator=gen, dtype=torch.float64) * 6.28).repeat_interleave(2, -1)
    rope = (angles.cos(), angles.sin())
    ref = mhla.mhla_attention_dense(q, k, v, layout, mixing, normalize=False, rotary_emb=rope)
    out = triton_ops.mhla_attention_fused(
        *(t.to(device, torch.float32) for t in (q, k, v)),
        layout,
        mixing.to(device, torch.float32),
        normalize=False,
        rotary_emb=tuple(t.to(device, torch.float32) for t in rope),
    )
    assert float((out.double().cpu() - ref).abs().max() / ref.abs().max()) < 1e-4


def test_failed_write_leaves_no_half_model(tmp_path, monkeypatch):
    base = _small_base(tmp_path, 3)
    ckpt = synthetic_checkpoint(build_tiny_transformer(num_layers=3), [1, 2], 6)
    path = _checkpoint_file(tmp_path, ckpt)

    def disk_full(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(imp, "write_json", disk_full)  # fails after the transformer and components are written
    with pytest.raises(OSError, match="No space left"):
        imp.import_official(path, base, tmp_path / "out", grid=(3, 4, 6))
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="No space left"):
        imp.import_official(path, base, tmp_path / "empty", grid=(3, 4, 6))
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
    assert (base / "vae").is_dir()  # the symlinked base parts are untouched


def test_a_dangling_symlink_as_out_is_followed_and_a_full_disk_is_exit_4(tmp_path, capsys, monkeypatch):
    """Issue 39: a symbolic link to a folder not made yet as ``--out`` ended in FileExistsError (an "unexpected
    failure"); it is followed (the folder is made where it points). A full disk while saving the transformer
    (safetensors reports it as its own error, not an OSError) is exit 4 with no half-written model left."""
    from tests.fulldisk import full_disk

    monkeypatch.setenv("MHLA_LOG_DIR", str(tmp_path / "logs"))
    base = _small_base(tmp_path, 3)
    path = _checkpoint_file(tmp_path, synthetic_checkpoint(build_tiny_transformer(num_layers=3), [1, 2], 6))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "made" / "here")
    argv = ["--checkpoint", str(path), "--base", str(base), "--grid", "3x4x6"]
    assert imp.main([*argv, "--out", str(link)]) == 0, capsys.readouterr().err
    assert (tmp_path / "made" / "here" / "model_index.json").is_file() and link.is_symlink()
    assert imp.main([*argv, "--out", str(link)]) == 2  # now a full folder: refused, left as it was
    assert "already exists and is not empty" in capsys.readouterr().err
    with full_disk(tmp_path / "disk", size="1m") as disk:
        disk.fill(free=20_000)
        rc = imp.main([*argv, "--out", str(disk.root / "model")])
        err = capsys.readouterr().err
        assert rc == 4 and "unexpected failure" not in err and "No space left on device" in err, err
        assert disk.files() == []

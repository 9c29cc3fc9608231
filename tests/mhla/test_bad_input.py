import pytest
import torch

from mhla import MHLA, BlockLayout, get_feature_map, linear_attention, locality_init, mhla_attention


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 60, 2, 4, generator=g) for _ in range(3)]


def test_grid_product_must_equal_tokens(qkv):
    layout = BlockLayout((3, 4, 6), (1, 2, 2))  # 72 tokens
    with pytest.raises(ValueError, match="3x4x6 has 72 tokens but q has 60"):
        mhla_attention(*qkv, layout, locality_init(layout))


def test_shapes_must_agree(qkv):
    q, k, v = qkv
    layout = BlockLayout((3, 4, 5), (1, 2, 2))
    m = locality_init(layout)
    with pytest.raises(ValueError, match="same shape"):
        mhla_attention(q, k[:, :30], v, layout, m)
    with pytest.raises(ValueError, match="same batch, tokens and heads"):
        linear_attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match=r"\(batch, tokens, heads, head_dim\)"):
        mhla_attention(q[0], k[0], v[0], layout, m)


def test_mixing_size_must_fit_layout(qkv):
    layout = BlockLayout((3, 4, 5), (1, 2, 2))
    with pytest.raises(ValueError, match=r"mixing matrix has shape \(5, 5\), expected \(4, 4\)"):
        mhla_attention(*qkv, layout, torch.eye(5))
    with pytest.raises(ValueError, match="per-head"):
        mhla_attention(*qkv, layout, torch.ones(3, 4, 4) / 4)


def test_unknown_feature_map(qkv):
    layout = BlockLayout((3, 4, 5), (1, 2, 2))
    with pytest.raises(ValueError, match="unknown feature map 'gelu'"):
        mhla_attention(*qkv, layout, locality_init(layout), feature_map="gelu")
    with pytest.raises(ValueError, match="unknown feature map"):
        get_feature_map(None)
    with pytest.raises(ValueError, match="unknown feature map"):
        MHLA("1x2x2", feature_map="softplus")


def test_rotary_shape(qkv):
    cos = torch.ones(1, 59, 1, 4)
    with pytest.raises(ValueError, match=r"rotary_emb cos has shape \(1, 59, 1, 4\), expected \(1, 60, 1, 4\)"):
        linear_attention(*qkv, rotary_emb=(cos, cos))
    with pytest.raises(ValueError, match="pair"):
        linear_attention(*qkv, rotary_emb=cos)


def test_layout_argument_type(qkv):
    with pytest.raises(ValueError, match="must be a BlockLayout"):
        mhla_attention(*qkv, (3, 4, 5), torch.eye(4))


# ---- issue 30, class 5: devices, head counts and grid types are checked in the shared input checks


def test_mixing_on_another_device_is_refused(qkv):
    """A mixing matrix on another device than q, k, v ("meta" stands in for a GPU here) used to return
    uninitialised output buffers without an error."""
    layout = BlockLayout((3, 4, 5), (1, 2, 2))
    with pytest.raises(ValueError, match="mixing matrix is on meta but q, k, v are on cpu"):
        mhla_attention(*qkv, layout, locality_init(layout).to("meta"))


def test_qkv_on_mixed_devices_are_refused(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="must be on one device"):
        linear_attention(q, k.to("meta"), v)


@pytest.mark.parametrize("shape", [(1, 60, 0, 4), (1, 60, 2, 0)])
def test_zero_heads_or_channels_are_refused(shape):
    q = torch.randn(shape)
    with pytest.raises(ValueError, match="at least one head"):
        linear_attention(q, q, q)
    with pytest.raises(ValueError, match="at least one head"):
        MHLA(blocks="1x2x2")(q, q, q, grid=(3, 4, 5))


@pytest.mark.parametrize("grid", [(3, 4.5, 5), (3.0, 4, 5), ("3", 4, 5), (True, 4, 15), (3, 4)])
def test_module_grid_must_be_integers(qkv, grid):
    with pytest.raises(ValueError, match="grid must be three"):
        MHLA(blocks="1x2x2")(*qkv, grid=grid)


def test_rotary_on_another_device_is_refused(qkv):
    q, k, v = qkv
    cos = torch.ones(1, 60, 1, 4, device="meta")
    with pytest.raises(ValueError, match="rotary_emb cos is on meta but q, k, v are on cpu"):
        linear_attention(q, k, v, rotary_emb=(cos, cos))

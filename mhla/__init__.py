"""MHLA: Multi-Head Linear Attention (arXiv 2601.07832) as a standalone PyTorch operator.

Depends on torch only. Tensors use the diffusers processor layout ``(batch, tokens, heads, head_dim)``
with tokens flattened in (frame, height, width) order of a latent-token grid ``(F, H, W)``.
"""

from .diagnostics import attention_weights, expressivity, rank_and_entropy
from .feature_maps import FEATURE_MAPS, get_feature_map
from .layout import (
    PAPER_BLOCK_SHAPE,
    BlockLayout,
    ResolvedBlocks,
    cached_layout,
    default_blocks,
    fit_blocks,
    parse_blocks,
    parse_grid,
    resolve_blocks,
    split_points,
)
from .mixing import (
    MixingCoefficients,
    constrain_mixing,
    locality_columns_init,
    locality_init,
    resample_mixing,
    uniform_init,
)
from .module import MHLA
from .naive import block_summaries, linear_attention_naive, mhla_attention_naive, mix_summaries
from .ops import linear_attention, mhla_attention
from .reference import linear_attention_dense, mhla_attention_dense, softmax_attention_dense
from .rope import apply_rotary
from .softmax import SOFTMAX_BACKENDS, last_softmax_backend, softmax_attention

__all__ = [
    "BlockLayout",
    "FEATURE_MAPS",
    "MHLA",
    "MixingCoefficients",
    "PAPER_BLOCK_SHAPE",
    "ResolvedBlocks",
    "SOFTMAX_BACKENDS",
    "apply_rotary",
    "attention_weights",
    "block_summaries",
    "cached_layout",
    "constrain_mixing",
    "default_blocks",
    "expressivity",
    "fit_blocks",
    "get_feature_map",
    "last_softmax_backend",
    "linear_attention",
    "linear_attention_dense",
    "linear_attention_naive",
    "locality_columns_init",
    "locality_init",
    "mhla_attention",
    "mhla_attention_dense",
    "mhla_attention_naive",
    "mix_summaries",
    "parse_blocks",
    "parse_grid",
    "rank_and_entropy",
    "resample_mixing",
    "resolve_blocks",
    "softmax_attention",
    "softmax_attention_dense",
    "split_points",
    "uniform_init",
]

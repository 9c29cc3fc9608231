"""The tiny random-weight model's sizes and defaults, and Wan's released defaults: plain values that the model
folder reader and the loader need without building a model (:mod:`pipelines.tiny` builds it and is also the
command ``python -m pipelines.tiny``; keeping these here keeps ``import pipelines`` from importing that module)."""

from __future__ import annotations

from typing import Any

# Tiny analogue of the paper's 3x10x10-token blocks: on the tiny default 3x4x6 grid the default rule
# (mhla.default_blocks with this shape) gives several blocks instead of one.
TINY_BLOCK_SHAPE = (1, 2, 2)
TINY_DEFAULTS = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 4, "guidance_scale": 5.0}
# The released Wan2.1 T2V defaults (diffusers' WanPipeline): 480x832, 81 frames, 50 steps, CFG 5.
WAN_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0}

# keyword arguments of the diffusers and transformers constructors (values of several types)
TINY_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=30,
    rope_max_seq_len=1024,
)

# a tiny model written as a folder holds this file: its architecture and seed, and so the note that its weights are
# random (pipelines.loading labels its videos as noise and gives it the tiny model's sizes and block shape)
TINY_INFO = "tiny_random.json"

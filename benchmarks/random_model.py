"""A random-weight Wan2.1 model folder (diffusers format) built with nothing downloaded, for end-to-end timing.

    python -m benchmarks.random_model --out /tmp/wan2.1-1.3b-RANDOM                 # on a GPU: ~12 GB in bf16
    python -m benchmarks.random_model --out DIR --size 1.3b --text-encoder-layers 2  # a smaller text encoder

The real Wan2.1 architecture (transformer of ``--size``, diffusers' default ``AutoencoderKLWan``, which is
Wan2.1's VAE, and a UMT5 encoder of UMT5-XXL's width: d_model 4096, 64 heads, d_ff 10240, 24 layers unless
``--text-encoder-layers`` says fewer) with RANDOM weights: every video it makes is noise; it exists so that
``python -m pipelines.cli --model DIR`` and the app time text encoding, denoising and VAE decoding at
the true size on a machine that cannot download. The tokenizer is byte-level (``ByT5Tokenizer``, no
vocabulary file), so its token ids are not UMT5's; the encoder's cost per token is. Parts are built on
the device directly (float32, then cast), then saved as safetensors; ``RANDOM_WEIGHTS.txt`` beside
``model_index.json`` says what the folder is.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

MARKER = "RANDOM_WEIGHTS.txt"
# UMT5-XXL (Wan2.1's text encoder) but for the layer count, which the caller picks
UMT5_XXL: dict[str, Any] = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from pipelines.loading import WAN_CONFIGS

    p = argparse.ArgumentParser(prog="python -m benchmarks.random_model", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="a new or empty folder")
    p.add_argument("--size", choices=sorted(WAN_CONFIGS), default="1.3b")
    p.add_argument("--text-encoder-layers", type=int, default=UMT5_XXL["num_layers"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on GPU, float32 on CPU")
    p.add_argument("--shrink", action="store_true", help="tests: every width divided by 16 (not the real sizes)")
    return p.parse_args(argv)


def configs(size: str, text_encoder_layers: int, shrink: bool = False) -> tuple[dict, dict, dict]:
    """``(transformer, text_encoder, vae)`` constructor arguments; ``shrink`` (tests on a CPU) keeps the
    structure and divides the widths, so the real sizes are only ever built where they fit."""
    from pipelines.loading import WAN_CONFIGS

    transformer = dict(WAN_CONFIGS[size])
    text = dict(UMT5_XXL, num_layers=text_encoder_layers)
    vae: dict[str, Any] = {}
    if shrink:
        transformer.update(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=64, freq_dim=32)
        transformer["num_layers"] = 2
        text.update(d_model=64, d_kv=16, d_ff=128, num_heads=4)
        vae = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=0)
    return transformer, text, vae


def build(
    out: str | Path,
    size: str = "1.3b",
    text_encoder_layers: int = UMT5_XXL["num_layers"],
    device: str = "auto",
    dtype: str = "auto",
    shrink: bool = False,
) -> Path:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    from pipelines.loading import resolve_device, resolve_dtype

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {str(out)!r} is not empty")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    t_cfg, te_cfg, vae_cfg = configs(size, text_encoder_layers, shrink)
    tokenizer = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]), torch.device(dev):
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(**t_cfg).to(dt)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **te_cfg)).to(dt)
        vae = AutoencoderKLWan(**vae_cfg)  # float32, as the pipelines load it
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "text_encoder_layers": text_encoder_layers, "shrink": shrink, "random_weights": True}
    (out / MARKER).write_text("RANDOM WEIGHTS: every video made with this folder is noise.\n" + json.dumps(info) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out = build(a.out, a.size, a.text_encoder_layers, a.device, a.dtype, a.shrink)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 2**30:.2f} GiB; RANDOM weights, Wan2.1-{a.size}, {a.text_encoder_layers}-layer UMT5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Estimated peak GPU memory of text-to-video inference per model, resolution, offload mode and variant.

    python -m benchmarks.memory_table                 # prints the table, writes benchmarks/results/memory_estimate.{md,json}

COMPUTED, NOT MEASURED (no GPU here): parameter counts are exact (each model is built on the ``meta`` device
from its architecture, so nothing is allocated); activation sizes come from the token grid and the formulas
below. Weights in bfloat16 (the text encoder too), batch 1 per transformer call (diffusers' WanPipeline runs the
conditional and unconditional passes one after another).

Per transformer call, the peak inside one block (bytes per token and channel ``D``, ``N`` tokens):
- the residual stream and its float32 norm: ``N x D x (2 + 4)``;
- self-attention: q, k, v and the output in bfloat16 plus RoPE'd q and k in float32, ``N x D x 16`` for softmax
  (FlashAttention keeps no N x N matrix); linear and MHLA also hold phi(q), phi(k) in float32: ``N x D x 24``;
  MHLA's summaries (``M x H x d x d`` float32) are added;
- the feed-forward layer: ``N x ffn x 4`` (its hidden state and the activation's output);
the larger of attention and feed-forward counts. VAE decoding: the decoder's widest full-resolution stage over a
causal chunk, ``C x 6 frames x H x W x 2 bytes x 4`` live tensors, plus the decoded video in float32; with tiling
(256 x 256 pixel tiles) the stage scales with the tile's area.

Offload modes (diffusers' hooks): ``none`` keeps every component on the GPU; ``model``
(``enable_model_cpu_offload``) one component at a time; ``group`` (block-level group offloading with prefetch:
two transformer blocks resident, the text encoder two layers); ``sequential`` (leaf-level: the largest single
layer with its ancestors' own parameters, :func:`largest_chain`). ``tests/pipelines/test_memory.py`` checks the
transformer's resident parameters per mode (:func:`transformer_resident`) against the hooks on a tiny model (CPU). A fit leaves 10% of the card and 1 GiB for the CUDA context and fragmentation.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mhla import PAPER_BLOCK_SHAPE
from pipelines.attention import HYBRID, LINEAR, MHLA, SOFTMAX, VARIANTS, variant_spec
from pipelines.loading import WAN_CONFIGS

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
BF16 = 2
CARDS_GB = (24, 32, 48, 80)
MODES = ("none", "model", "group", "sequential")

WAN22_5B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=24,
    attention_head_dim=128,
    in_channels=48,
    out_channels=48,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=14336,
    num_layers=30,
)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
VAE_21: dict = {}  # diffusers' defaults are Wan2.1's VAE
VAE_22 = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)


@dataclass(frozen=True)
class Model:
    name: str
    transformers: tuple[dict, ...]  # one per expert (Wan2.2-A14B has two, used in turn)
    vae: dict
    stride: tuple[int, int, int]  # pixels per latent cell (frames, height, width), before the 1x2x2 patch
    frames: int
    resolutions: dict[str, tuple[int, int]] = field(default_factory=dict)


MODELS = (
    Model("Wan2.1-T2V-1.3B", (WAN_CONFIGS["1.3b"],), VAE_21, (4, 8, 8), 81, {"480p": (480, 832), "720p": (720, 1280)}),
    Model("Wan2.1-T2V-14B", (WAN_CONFIGS["14b"],), VAE_21, (4, 8, 8), 81, {"480p": (480, 832), "720p": (720, 1280)}),
    Model("Wan2.2-TI2V-5B", (WAN22_5B,), VAE_22, (4, 16, 16), 121, {"480p": (480, 832), "720p": (704, 1280)}),
    Model(
        "Wan2.2-T2V-A14B",
        (WAN_CONFIGS["14b"], WAN_CONFIGS["14b"]),
        VAE_21,
        (4, 8, 8),
        81,
        {"480p": (480, 832), "720p": (720, 1280)},
    ),
)


def _on_meta(build):
    with torch.device("meta"):
        return build()


def largest_chain(module: torch.nn.Module) -> int:
    """The most parameters sequential offloading holds at once: accelerate's hook on each module brings in that
    module's own parameters for its whole forward, so a leaf layer runs with its ancestors' own parameters resident
    too (Wan's ``scale_shift_table`` of the model and of the block); the largest such chain, root to leaf."""
    own = sum(p.numel() for p in module.parameters(recurse=False))
    return own + max((largest_chain(child) for child in module.children()), default=0)


def model_counts(model: torch.nn.Module) -> dict:
    """Parameter counts of a Wan transformer (any device, converted or not): total, the largest block, the rest
    (outside the blocks), the largest chain of modules' own parameters (:func:`largest_chain`)."""
    total = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return {"total": total, "block": max(blocks), "rest": total - sum(blocks), "leaf": largest_chain(model)}


def transformer_counts(config: dict) -> dict:
    """Parameter counts of a WanTransformer3DModel built on ``meta``: total, per block, the rest, largest chain."""
    from diffusers import WanTransformer3DModel

    return model_counts(_on_meta(lambda: WanTransformer3DModel(**config)))


def transformer_resident(counts: dict, mode: str, prefetch: bool = True) -> int:
    """Transformer parameters on the GPU during its forward under offload ``mode``: all of them (none, model);
    the blocks outside any group plus one block, and the next one with ``prefetch`` (group: block level, with
    CUDA streams); the largest chain (sequential)."""
    if mode in ("none", "model"):
        return counts["total"]
    if mode == "group":
        return counts["rest"] + (2 if prefetch else 1) * counts["block"]
    return counts["leaf"]


def text_encoder_counts() -> dict:
    from transformers import UMT5Config, UMT5EncoderModel

    model = _on_meta(lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL)))
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.encoder.block[0].parameters())
    return {"total": total, "layer": layer, "leaf": largest_chain(model)}


def vae_counts(config: dict) -> dict:
    from diffusers import AutoencoderKLWan

    model = _on_meta(lambda: AutoencoderKLWan(**config))
    return {"total": sum(p.numel() for p in model.parameters()), "config": dict(model.config)}


def token_grid(model: Model, height: int, width: int) -> tuple[int, int, int]:
    """Tokens after the VAE and the 1x2x2 patch: ((T-1)/4+1, H/(2 sh), W/(2 sw))."""
    st, sh, sw = model.stride
    return ((model.frames - 1) // st + 1, height // (2 * sh), width // (2 * sw))


def blocks_for(grid: tuple[int, int, int]) -> int:
    """M for the estimate: blocks of about 3x10x10 tokens (the paper's 105 at 21x30x50)."""
    return math.prod(max(1, round(g / b)) for g, b in zip(grid, PAPER_BLOCK_SHAPE))


def activation_bytes(config: dict, tokens: int, variant: str, num_blocks: int) -> int:
    d = config["num_attention_heads"] * config["attention_head_dim"]
    residual = tokens * d * (2 + 4)
    softmax = tokens * d * 16
    linear = tokens * d * 24 + num_blocks * config["num_attention_heads"] * config["attention_head_dim"] ** 2 * 4
    spec = variant_spec(variant)  # softmax layers only, linear-attention layers only, or both kinds
    attention = softmax if spec.linear == "none" else max(softmax, linear) if spec.softmax_layers else linear
    ffn = tokens * config["ffn_dim"] * 4
    return residual + max(attention, ffn)


def vae_decode_bytes(vae: dict, frames: int, height: int, width: int, tiled: bool) -> int:
    cfg = vae["config"]
    channels = cfg.get("decoder_base_dim") or cfg["base_dim"]
    patch = cfg.get("patch_size") or 1
    h, w = height // patch, width // patch
    if tiled:
        h, w = min(h, 256 // patch), min(w, 256 // patch)
    stage = channels * 6 * h * w * BF16 * 4
    video = 3 * frames * height * width * 4
    return stage + video


def estimate(model: Model, resolution: str, variant: str, mode: str, tiled: bool, counts: dict) -> dict:
    height, width = model.resolutions[resolution]
    grid = token_grid(model, height, width)
    tokens = math.prod(grid)
    m = blocks_for(grid)
    te, vae = counts["text_encoder"], counts["vae"][model.name]
    experts = [counts["transformer"][model.name][i] for i in range(len(model.transformers))]
    act = max(activation_bytes(c, tokens, variant, m) for c in model.transformers)
    decode = vae_decode_bytes(vae, model.frames, height, width, tiled)
    te_act = 512 * UMT5_XXL["d_model"] * (2 + 4) + 512 * UMT5_XXL["d_ff"] * 4
    if mode == "none":
        weights = (te["total"] + sum(e["total"] for e in experts) + vae["total"]) * BF16
        peak = weights + max(act, decode, te_act)
    elif mode == "model":
        peak = max(
            te["total"] * BF16 + te_act,
            max(e["total"] for e in experts) * BF16 + act,
            vae["total"] * BF16 + decode,
        )
    elif mode == "group":
        peak = max(
            2 * te["layer"] * BF16 + te_act,
            max(transformer_resident(e, "group") for e in experts) * BF16 + act,
            vae["total"] * BF16 + decode,
        )
    else:  # sequential: one leaf module's weights at a time
        peak = max(
            te["leaf"] * BF16 + te_act,
            max(transformer_resident(e, "sequential") for e in experts) * BF16 + act,
            vae["total"] * BF16 + decode,
        )
    host = (te["total"] + sum(e["total"] for e in experts) + vae["total"]) * BF16 if mode != "none" else 0
    fits = {str(gb): bool(peak * 1.1 + GIB <= gb * 1e9) for gb in CARDS_GB}
    return {
        "model": model.name,
        "resolution": resolution,
        "pixels": [model.frames, height, width],
        "tokens": list(grid),
        "variant": variant,
        "offload": mode,
        "vae_tiling": tiled,
        "peak_gb": round(peak / 1e9, 1),
        "host_ram_gb": round(host / 1e9, 1),
        "fits_gb": fits,
    }


def count_all() -> dict:
    return {
        "text_encoder": text_encoder_counts(),
        "transformer": {m.name: [transformer_counts(c) for c in m.transformers] for m in MODELS},
        "vae": {m.name: vae_counts(m.vae) for m in MODELS},
    }


def _spread(rows: list[dict]) -> float:
    """The largest difference in peak between MHLA and linear attention or the hybrid, over every setting."""
    peak = {(r["model"], r["resolution"], r["offload"], r["variant"]): r["peak_gb"] for r in rows}
    return max(abs(v - peak[(*k[:3], MHLA)]) for k, v in peak.items() if k[3] in (LINEAR, HYBRID))


def _billions(count: dict) -> str:
    return f"{count['total'] / 1e9:.2f}B"


def markdown(rows: list[dict], counts: dict) -> str:
    lines = [
        "# Estimated peak GPU memory (computed, not measured)",
        "",
        "`python -m benchmarks.memory_table`: parameter counts exact (built on the meta device), activations from "
        "the formulas in the script's docstring; bfloat16 weights, batch 1 per transformer call, VAE tiling on. "
        "Fits: 10% + 1 GiB headroom. Host RAM: the weights the offload hooks keep on the CPU.",
        "",
        "Parameters: text encoder (UMT5-XXL) "
        f"{counts['text_encoder']['total'] / 1e9:.2f}B; "
        + "; ".join(
            f"{name} transformer {' + '.join(_billions(t) for t in ts)}, VAE {counts['vae'][name]['total'] / 1e6:.0f}M"
            for name, ts in counts["transformer"].items()
        ),
        "",
        "Each cell: peak GB, then the smallest of the 24/32/48/80 GB cards it fits (- : none). Linear attention and "
        f"the hybrid come within {_spread(rows):.1f} GB of MHLA (every row is in the JSON). The attention estimate is the "
        "PyTorch path's (features in float32); the fused GPU kernels hold less.",
        "",
        "| model | res | tokens | variant | "
        + " | ".join(f"offload {m}" for m in MODES)
        + " | host RAM GB (offloaded) |",
        "|---|---|---|---|" + "---:|" * len(MODES) + "---:|",
    ]
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["model"], r["resolution"], "x".join(map(str, r["tokens"])), r["variant"]), {})[
            r["offload"]
        ] = r
    for (model, res, tokens, variant), by_mode in cells.items():
        if variant not in (SOFTMAX, MHLA):
            continue
        shown = []
        for mode in MODES:
            r = by_mode[mode]
            card = next((gb for gb in CARDS_GB if r["fits_gb"][str(gb)]), None)
            shown.append(f"{r['peak_gb']} ({card or '-'})")
        lines.append(
            f"| {model} | {res} | {tokens} | {variant} | "
            + " | ".join(shown)
            + f" | {by_mode['model']['host_ram_gb']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS / "memory_estimate"), help="writes OUT.md and OUT.json")
    p.add_argument("--no-tiling", action="store_true", help="estimate VAE decoding without tiling")
    args = p.parse_args(argv)
    counts = count_all()
    rows = [
        estimate(m, res, variant, mode, not args.no_tiling, counts)
        for m in MODELS
        for res in m.resolutions
        for variant in VARIANTS
        for mode in MODES
    ]
    text = markdown(rows, counts)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, body in ((".md", text), (".json", json.dumps({"rows": rows, "counts": _plain(counts)}, indent=1))):
        tmp = out.with_name(out.name + suffix + ".tmp")
        tmp.write_text(body)
        tmp.replace(out.with_name(out.name + suffix))
    print(f"wrote {out}.md and {out}.json")
    return 0


def _plain(counts: dict) -> dict:
    vae = {k: {"total": v["total"]} for k, v in counts["vae"].items()}
    return {**counts, "vae": vae}


if __name__ == "__main__":
    raise SystemExit(main())

"""The built-in model's third design: a 4x VAE, a larger object, a context-free text encoder, patch 2x2.

    python -m factory.v3 init                        # runs/builtin-v3/model, from assets/builtin-next/v3 where it has parts
    nohup nice -n 5 env OMP_NUM_THREADS=1 python -m training.finetune --config factory/configs/v3/vae.yaml > runs/builtin-v3/vae.log 2>&1 &
    python -m factory.v3 gate runs/builtin-v3/vae/checkpoints/<latest>/vae   # the VAE gate: before any transformer
    python -m factory.v3 save-vae runs/builtin-v3/vae/checkpoints/<latest>   # -> assets/builtin-next/v3/vae
    python -m factory.v3 attention --transformer DIR   # the cross-attention's share on each caption word
    python -m factory.v3 retime-vae --temporal-downsample false,true --out runs/builtin-v3/model5   # 9 -> 5 frames
    python -m factory.v3 failures VAE_DIR --out sheet.png   # real | reconstruction | their masks, where it fails

What caps the second design and what this design changes:

- the VAE: 8x spatial compression rounded a triangle's corners and fringed its colours (ceiling 0.46-0.52). Here
  4x4 spatial and 2x temporal strides (a 9x64x80 clip -> 16x5x16x20 latents; the 4x temporal stride first tried
  smeared moving shapes and plateaued at a 0.78 ceiling), objects weighted 1 + 2 instead of 1 + 10, the decoder
  trained on noisy latents too (``vae.latent_noise``);
- the latent geometry: colour was about 30x louder than shape in the normalised latents. :func:`latent_geometry`
  measures it (mean squared change of the normalised latent, and of the pixels, when one attribute is swapped);
- padding: 22-24 zero tokens after a 12-token caption took 41-76% of the cross-attention. Here
  ``max_sequence_length`` 16, and a context-free text encoder (:func:`context_free_text_encoder`): each token's
  output is its own normalised embedding, the rows orthonormal, so no word is mixed into its neighbours;
- the object: radius 0.25 of the short side (world ``v3``) and one transformer token per 8x8 pixels (patch 1x2x2
  over the 16x20 latent grid: 5x8x10 = 400 tokens).

The gate (:func:`gate`) writes ``assets/builtin-next/v3/curves/vae-gate.json``: the analyser's ceiling on 64
validation clips (>= 0.95 overall) and the colour:shape latent-change ratio (within 3x of the pixel ratio).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common.outputs import atomic_dir, atomic_write
from factory import dump_json, world_clips, write_json
from factory.build import CONVERSIONS, TEXT_ENCODER, TRANSFORMER, build_tokenizer, vae_settings
from factory.next import NEXT_DIR
from pipelines.model_dir import BUILTIN_DIR, VARIANTS_SUBDIR

# this design's stage weights, beside the second design's (which stay until this one replaces them)
NEXT = NEXT_DIR / "v3"
WORK = Path("runs/builtin-v3")
MODEL = WORK / "model"
WORLD = "v3"
# 9 frames at 64x80 -> 5x16x20 latent cells (VAE 2x4x4) -> 5x8x10 = 400 tokens (patch 1x2x2)
DEFAULTS = {
    "height": 64,
    "width": 80,
    "num_frames": 9,
    "num_inference_steps": 20,
    "guidance_scale": 4.0,
    "max_sequence_length": 16,
}
# MHLA's target block in tokens: 5x8x10 -> 5x2x2 blocks, M = 20 (M * M <= N = 400)
BLOCK_SHAPE = (1, 4, 5)
VAE_V3 = dict(base_dim=16, dim_mult=[1, 2, 4], temperal_downsample=[False, True], num_res_blocks=1)
TRANSFORMER_V3 = {**TRANSFORMER, "patch_size": (1, 2, 2)}
GATE_CEILING = 0.95
GATE_RATIO = 3.0
GEOMETRY_ATTRIBUTES = ("colour", "shape", "motion", "background")


def context_free_text_encoder(vocab_size: int, seed: int = 0):
    """A ``UMT5EncoderModel`` whose output for each token is its own embedding, RMS-normalised: every layer's
    attention output projection and feed-forward output are zero (the residual stream is the embedding), and the
    embedding rows are orthonormal (every word as far from every other as the width allows). Nothing is mixed
    across positions, so swapping one word changes one output row."""
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, **TEXT_ENCODER)).eval()
        with torch.no_grad():
            torch.nn.init.orthogonal_(model.shared.weight)
            for block in model.encoder.block:
                block.layer[0].SelfAttention.o.weight.zero_()
                block.layer[-1].DenseReluDense.wo.weight.zero_()
    return model


def _copy_part(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def init(model: Path = MODEL, next_dir: Path = NEXT, seed: int = 0) -> Path:
    """Writes the working model directory ``model`` of this design: tokenizer and text encoder (from
    ``next_dir`` when committed there, else built and also written there: the transformer is trained against
    them, so they are kept, not rebuilt), the VAE (``next_dir/vae`` when its config is this design's, else the
    one ``model`` already holds (a VAE run in progress installs there), else a fresh one), the transformer
    (``next_dir/transformer``, else ``transformer-ema``, when their patch is this design's; else a fresh one),
    Wan's UniPC flow scheduler and ``builtin.json`` with this design's defaults and block shape."""
    laid: list[str] = []
    with atomic_dir(model) as tmp:  # the old folder stays whole until the new one is
        _lay_out(tmp, model, next_dir, seed, laid)
    print(f"wrote {model} with {', '.join(laid)}")
    return model


def ship(next_dir: Path = NEXT, out: Path = BUILTIN_DIR, evaluation: Path | None = None) -> Path:
    """Makes this design the shipped built-in model: ``out`` (``assets/builtin``) replaced whole, atomically, by
    the committed parts of ``next_dir``: tokenizer, text encoder, VAE, the base's EMA as the softmax transformer
    (``transformer-ema``: it draws better than the raw weights) and the three conversions as ``variants/`` (moved:
    the shipped folder keeps the one copy; :func:`init` lays them from there), with ``builtin.json`` naming where
    each came from and ``evaluation`` (the committed 4-variant evaluation that justified it). The old model's
    stored examples are not carried over (they show another model): ``python run_app.py --store-examples``
    writes this one's. Refused unless every part is there and is this design's."""
    missing = [
        str(next_dir / p)
        for p in (
            "tokenizer",
            "text_encoder",
            "vae",
            "transformer-ema",
            *(f"{VARIANTS_SUBDIR}/{v}" for v in CONVERSIONS),
        )
        if not (next_dir / p).is_dir() and not (p.startswith(VARIANTS_SUBDIR) and (out / p / "config.json").is_file())
    ]
    if missing:
        raise FileNotFoundError(f"cannot ship the third design: missing {', '.join(missing)}")
    laid: list[str] = []
    with atomic_dir(out) as tmp:
        _lay_out(tmp, out, next_dir, 0, laid, transformer_order=("transformer-ema",), variants_from=(next_dir, out))
        info = json.loads((tmp / "builtin.json").read_text())
        info.update(
            shipped=time.strftime("%Y-%m-%d"),
            parts=laid,
            evaluation=None if evaluation is None else str(evaluation),
            rebuild="python -m factory.v3 ship (from assets/builtin-next/v3; see factory/configs/v3/)",
        )
        (tmp / "builtin.json").write_text(dump_json(info))
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
    for variant in CONVERSIONS:  # moved into the shipped model: one copy in the tree
        shutil.rmtree(next_dir / VARIANTS_SUBDIR / variant, ignore_errors=True)
    if (next_dir / VARIANTS_SUBDIR).is_dir() and not any((next_dir / VARIANTS_SUBDIR).iterdir()):
        (next_dir / VARIANTS_SUBDIR).rmdir()
    print(f"shipped the third design into {out}: {', '.join(laid)}")
    return out


def _lay_out(
    tmp: Path,
    model: Path,
    next_dir: Path,
    seed: int,
    laid: list[str],
    transformer_order: tuple[str, ...] = ("transformer", "transformer-ema"),
    variants_from: tuple[Path, ...] | None = None,
) -> None:
    """:func:`init`'s parts, written into ``tmp``; ``laid`` gets where each came from. ``transformer_order``: the
    committed transformers to take, first found first; ``variants_from``: the folders whose ``variants/`` hold the
    conversions, first found first (default ``next_dir``, then the shipped model when it is this design)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    for part in ("tokenizer", "text_encoder"):
        if not (next_dir / part).is_dir():
            tokenizer = build_tokenizer()
            tokenizer.save_pretrained(str(next_dir / "tokenizer"))
            context_free_text_encoder(len(tokenizer), seed).save_pretrained(
                str(next_dir / "text_encoder"), safe_serialization=True
            )
            laid.append(f"a new tokenizer and context-free text encoder (written to {next_dir})")
            break
    for part in ("tokenizer", "text_encoder"):
        _copy_part(next_dir / part, tmp / part)
    want_vae = vae_settings(**VAE_V3)
    same = lambda folder: all(  # noqa: E731
        json.loads((folder / "config.json").read_text()).get(k) == want_vae[k] for k in VAE_V3
    )
    if (next_dir / "vae" / "config.json").is_file() and same(next_dir / "vae"):
        _copy_part(next_dir / "vae", tmp / "vae")
        laid.append(f"{next_dir / 'vae'}")
    elif (model / "vae" / "config.json").is_file() and same(model / "vae"):
        _copy_part(model / "vae", tmp / "vae")
        laid.append(f"the VAE {model / 'vae'} held")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            AutoencoderKLWan(**want_vae).save_pretrained(str(tmp / "vae"), safe_serialization=True)
        laid.append("a fresh VAE")
    for name in transformer_order:
        src = next_dir / name / "config.json"
        if src.is_file() and list(json.loads(src.read_text())["patch_size"]) == list(TRANSFORMER_V3["patch_size"]):
            _copy_part(next_dir / name, tmp / "transformer")
            laid.append(str(next_dir / name))
            break
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 2)
            WanTransformer3DModel(**TRANSFORMER_V3).save_pretrained(str(tmp / "transformer"), safe_serialization=True)
        laid.append("a fresh transformer")
    if variants_from is None:
        shipped = BUILTIN_DIR / "builtin.json"
        ours = shipped.is_file() and json.loads(shipped.read_text()).get("world") == WORLD
        # the design's own folder (not a test's or another copy's) falls back to the shipped conversions
        variants_from = (next_dir, BUILTIN_DIR) if ours and next_dir.resolve() == NEXT.resolve() else (next_dir,)
    for variant in CONVERSIONS:  # committed conversions (factory.next save-variant --into, or shipped) as variants
        for folder in variants_from:
            src = folder / VARIANTS_SUBDIR / variant
            if (src / "config.json").is_file():
                _copy_part(src, tmp / VARIANTS_SUBDIR / variant)
                laid.append(str(src))
                break
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    scheduler.save_pretrained(str(tmp / "scheduler"))
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": json.loads((tmp / "vae" / "config.json").read_text())["_diffusers_version"],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (tmp / "model_index.json").write_text(dump_json(index, indent=2))
    info = {
        "what": "Wan2.1-architecture text-to-video model trained from scratch on the synthetic moving-shapes world "
        "(third design)",
        "defaults": DEFAULTS,
        "block_shape": list(BLOCK_SHAPE),
        "world": WORLD,
        "transformer": {**TRANSFORMER_V3, "patch_size": list(TRANSFORMER_V3["patch_size"])},
        "vae": VAE_V3,
        "text_encoder": {**TEXT_ENCODER, "trained": False, "context_free": True, "tokenizer": "word-level"},
        "rebuild": "python -m factory.v3 init (see factory/configs/v3/)",
    }
    (tmp / "builtin.json").write_text(dump_json(info))


def clips(num_clips: int, split: str = "validation"):
    """``num_clips`` clips of the third world at this design's size (data seed 0): what the gate, the latent
    statistics and the attention measurement read."""
    from world.synthetic import world_named

    return world_clips(num_clips, DEFAULTS, world_named(WORLD), split=split)


@torch.no_grad()
def latent_geometry(vae, num_clips: int = 64) -> dict:
    """How loud each attribute is in the normalised latents and in the pixels: for each of ``num_clips``
    validation clips of the third world and each attribute, the clip with that attribute swapped for the
    world's next value (same start, same background otherwise; :func:`training.probe.swapped`), and for motion the
    same path run backwards (the opposite motion; static clips are left out of it); the mean squared
    change of the latent (posterior mean, normalised with the VAE's ``latents_mean``/``latents_std`` as the
    pipeline does) and of the pixels (in [-1, 1]). Returns both per attribute and the colour:shape ratios."""
    from training.probe import swapped
    from world.synthetic import render_video, world_named

    world = world_named(WORLD)
    data = clips(num_clips)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    def encode(frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        video = torch.from_numpy(frames).float().div(127.5).sub(1).permute(3, 0, 1, 2)[None]
        return (vae.encode(video).latent_dist.mean - mean) / std, video

    sums = {a: [0.0, 0.0, 0] for a in GEOMETRY_ATTRIBUTES}
    for i in range(num_clips):
        attributes = data.attributes(i)
        z, x = encode(render_video(attributes, DEFAULTS["num_frames"], DEFAULTS["height"], DEFAULTS["width"]))
        for attribute in GEOMETRY_ATTRIBUTES:
            if attribute == "motion":  # the renderer follows start -> end: the opposite motion is the reversed path
                obj = attributes["objects"][0]
                if obj["start"] == obj["end"]:
                    continue
                other = {**attributes, "objects": [{**obj, "start": obj["end"], "end": obj["start"]}]}
            else:
                other = swapped(attributes, attribute, world)
            z2, x2 = encode(render_video(other, DEFAULTS["num_frames"], DEFAULTS["height"], DEFAULTS["width"]))
            sums[attribute][0] += float((z2 - z).square().mean())
            sums[attribute][1] += float((x2 - x).square().mean())
            sums[attribute][2] += 1
    latent = {a: float(f"{s[0] / max(s[2], 1):.4g}") for a, s in sums.items()}
    pixel = {a: float(f"{s[1] / max(s[2], 1):.4g}") for a, s in sums.items()}
    ratio_latent = latent["colour"] / max(latent["shape"], 1e-12)
    ratio_pixel = pixel["colour"] / max(pixel["shape"], 1e-12)
    return {
        "latent_mse": latent,
        "pixel_mse": pixel,
        "colour_shape_ratio_latent": round(ratio_latent, 3),
        "colour_shape_ratio_pixel": round(ratio_pixel, 3),
        "ratio_of_ratios": round(ratio_latent / ratio_pixel, 3),
    }


def measure_statistics(vae, num_clips: int = 64) -> None:
    """The latents' per-channel mean and std over ``num_clips`` train clips of the third world, into the VAE's
    config (what the pipeline normalises with; a VAE run measures them only when it ends, so a checkpoint's are
    its initial ones)."""
    from training.vae import latent_statistics

    data = clips(num_clips, split="train")
    mean, std = latent_statistics(vae, data, num_clips)
    vae.register_to_config(latents_mean=mean, latents_std=std)


def gate(vae_dir: Path, num_clips: int = 64, out: Path | None = NEXT / "curves" / "vae-gate.json") -> dict:
    """The VAE gate: the analyser's ceiling on ``num_clips`` validation clips (overall >= :data:`GATE_CEILING`)
    and the colour:shape latent-change ratio within :data:`GATE_RATIO` x of the pixel ratio (either way), in
    latents normalised with statistics measured here (a checkpoint's config holds its initial ones)."""
    from diffusers import AutoencoderKLWan

    from factory.vae_ceiling import reconstruction_ceiling

    vae = AutoencoderKLWan.from_pretrained(str(vae_dir), dtype=torch.float32).eval()
    measure_statistics(vae)
    data = clips(num_clips)
    ceiling = reconstruction_ceiling(vae, data, range(num_clips))
    geometry = latent_geometry(vae, num_clips)
    ratio = geometry["ratio_of_ratios"]
    passed = {
        "ceiling": ceiling["overall"] >= GATE_CEILING,
        "geometry": 1 / GATE_RATIO <= ratio <= GATE_RATIO,
    }
    trained = vae_dir / "trained.json"
    record = {
        "vae": str(vae_dir),
        "trained": json.loads(trained.read_text()) if trained.is_file() else None,
        "num_clips": num_clips,
        "world": WORLD,
        "ceiling": ceiling,
        "geometry": geometry,
        "gate": {"ceiling >= 0.95": passed["ceiling"], "colour:shape within 3x of pixels": passed["geometry"]},
        "passed": all(passed.values()),
    }
    if out is not None:
        write_json(out, record)
    return record


@torch.no_grad()
def failure_sheet(vae_dir: Path, out: Path, num_clips: int = 32, rows: int = 6) -> list[dict]:
    """A picture of what fails the gate: for up to ``rows`` of the first ``num_clips`` validation clips whose
    reconstruction the analyser misreads, the real frame, the reconstruction and the analyser's colour mask of each
    (the frame where the reconstruction's mask is largest: the one the analyser classifies), 3x enlarged, written
    to ``out`` (PNG). Returns each row's clip index, caption, attributes missed and the two masks' box fills."""
    from diffusers import AutoencoderKLWan
    from PIL import Image

    from factory.vae_ceiling import to_frames
    from world.analyse import analyse, colour_masks
    from world.synthetic import caption_for

    vae = AutoencoderKLWan.from_pretrained(str(vae_dir), dtype=torch.float32).eval()
    data = clips(num_clips)

    def box_fill(mask: np.ndarray) -> float:
        ys, xs = np.nonzero(mask)
        return 0.0 if not len(ys) else len(ys) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))

    picture, found = [], []
    for i in range(num_clips):
        video = data[i]["video"]
        rec = to_frames(vae.decode(vae.encode(video[None]).latent_dist.mean).sample[0].clamp(-1, 1))
        real = to_frames(video)
        attributes = data.attributes(i)
        verdict = analyse(rec, attributes)
        missed = [a for a in ("count", "colour", "shape", "motion") if verdict[a] is False]
        if not missed:
            continue
        colour = attributes["objects"][0]["colour"]
        m_rec, m_real = colour_masks(rec)[colour], colour_masks(real)[colour]
        t = int(m_rec.reshape(len(m_rec), -1).sum(1).argmax())
        white = lambda m: np.repeat(m[..., None], 3, -1).astype(np.uint8) * 255  # noqa: E731
        picture.append(np.concatenate([real[t], rec[t], white(m_real[t]), white(m_rec[t])], 1))
        found.append(
            {
                "clip": i,
                "caption": caption_for(attributes, sizes=False),
                "missed": missed,
                "frame": t,
                "fill_real": round(box_fill(m_real[t]), 3),
                "fill_reconstruction": round(box_fill(m_rec[t]), 3),
            }
        )
        if len(found) == rows:
            break
    if picture:
        sheet = np.concatenate(picture, 0)
        image = Image.fromarray(sheet).resize((sheet.shape[1] * 3, sheet.shape[0] * 3), Image.NEAREST)
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(out) as tmp:
            image.save(tmp, format="PNG")
    return found


def save_vae(checkpoint: Path, next_dir: Path = NEXT) -> Path:
    """A VAE run's checkpoint (its ``vae/``) or a VAE folder into ``next_dir/vae``: float16 weights (a later stage
    loads them as float32 and trains on with a fresh optimizer), the latent statistics measured now, and a
    ``trained.json`` naming the run and its step. Counted against ``assets/builtin-next``'s budget as a whole."""
    import re

    from diffusers import AutoencoderKLWan

    from factory.next import save

    folder = checkpoint / "vae" if (checkpoint / "vae").is_dir() else checkpoint
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not an AutoencoderKLWan folder (no config.json)")
    vae = AutoencoderKLWan.from_pretrained(str(folder), dtype=torch.float32).eval()
    measure_statistics(vae)
    staged = WORK / ".vae-save"
    if staged.exists():
        shutil.rmtree(staged)
    try:
        vae.save_pretrained(str(staged), safe_serialization=True)
        step = re.search(r"step-(\d+)", str(checkpoint))
        record = {
            "steps": int(step.group(1)) if step else None,
            "run": str(checkpoint.parent.parent),
            "trainable": "all",
        }
        (staged / "trained.json").write_text(json.dumps(record) + "\n")
        return save("vae", staged, next_dir, half=True, budget_root=NEXT_DIR)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def retime_vae(vae_dir: Path, temperal_downsample: list[bool], out: Path, model: Path = MODEL) -> list[str]:
    """A copy of the model folder ``model`` at ``out`` whose VAE is ``vae_dir``'s with other temporal strides
    (``temperal_downsample``, one flag per downsampling), every layer's weights kept but the time convolutions a
    stride no longer has (returned: their names). The spatial layers, channels and latent statistics stay, so a
    VAE run continues from there (``factory/configs/v3/vae5.yaml``); builtin.json's ``vae`` says the new strides.
    Written through :func:`common.outputs.atomic_dir`: a failure leaves ``out`` as it was."""
    from diffusers import AutoencoderKLWan
    from safetensors.torch import load_file

    cfg = json.loads((vae_dir / "config.json").read_text())
    if len(temperal_downsample) != len(cfg["temperal_downsample"]):
        raise ValueError(
            f"temperal_downsample {temperal_downsample}: {vae_dir} has {len(cfg['temperal_downsample'])} "
            "downsamplings, one flag each expected"
        )
    settings = {k: v for k, v in cfg.items() if not k.startswith("_")}
    settings.update(temperal_downsample=list(temperal_downsample), scale_factor_temporal=2 ** sum(temperal_downsample))
    vae = AutoencoderKLWan(**settings)
    weights = {k: v.float() for k, v in load_file(str(vae_dir / "diffusion_pytorch_model.safetensors")).items()}
    missing, dropped = vae.load_state_dict(weights, strict=False)
    if missing:  # a stride added needs a time convolution nobody trained: not a transfer
        raise ValueError(f"{vae_dir} has no weights for {', '.join(missing[:4])}: strides can only be taken away")
    with atomic_dir(out) as tmp:
        for part in sorted(model.iterdir()):
            if part.name == "vae":
                continue
            (shutil.copytree if part.is_dir() else shutil.copy2)(part, tmp / part.name)
        vae.save_pretrained(str(tmp / "vae"), safe_serialization=True)
        info_path = tmp / "builtin.json"
        if info_path.is_file():
            info = json.loads(info_path.read_text())
            info["vae"] = {**info.get("vae", {}), "temperal_downsample": list(temperal_downsample)}
            info_path.write_text(dump_json(info))
    print(f"wrote {out}: {vae_dir}'s VAE with temporal strides {temperal_downsample}, dropped {', '.join(dropped)}")
    return list(dropped)


def _flags(text: str) -> list[bool]:
    words = {"true": True, "false": False}
    flags = [w.strip().lower() for w in text.split(",")]
    if not flags or any(f not in words for f in flags):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated true/false, e.g. false,true")
    return [words[f] for f in flags]


ROLES = ("colour", "shape", "motion", "background", "other words", "end", "padding")


@torch.no_grad()
def word_attention(
    model_dir: Path, transformer_dir: Path | None = None, num_clips: int = 8, sigma: float = 0.6
) -> dict:
    """Where the cross-attention looks: the share of every cross-attention layer's softmax weights (averaged over
    heads, video tokens and ``num_clips`` validation clips of the third world, noised to ``sigma``) that falls on
    each caption role: the colour, shape, motion and background words, the other words, the end token and the
    zero padding up to ``max_sequence_length``. A model that reads the shape word gives it more than the uniform
    share ``1 / max_sequence_length``. Queries and keys are recomputed from each layer's own projections and norms
    (``to_q``, ``norm_q``, ``to_k``, ``norm_k``), as diffusers' Wan processor computes them; a model that masks
    the caption's padding (``mask_text_padding``) gives it no weight, as its cross-attention does."""
    from pipelines import load_components, load_transformer
    from training.encoding import Encoder
    from world.synthetic import MOTION_PHRASES, caption_for, world_named

    world = world_named(WORLD)
    components = load_components(str(model_dir))
    transformer = (
        load_transformer(transformer_dir, dtype=torch.float32, device="cpu")
        if transformer_dir is not None
        else components.transformer
    ).eval()
    length = components.defaults.get("max_sequence_length", DEFAULTS["max_sequence_length"])
    encoder = Encoder(components, length)
    data = clips(num_clips)
    attrs = [data.attributes(i) for i in range(num_clips)]
    captions = [caption_for(a, sizes=world.size_words) for a in attrs]
    latents = encoder.latents(torch.stack([data[i]["video"] for i in range(num_clips)]))
    text = encoder.text(captions)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    x_t = (1 - sigma) * latents + sigma * noise
    words = {
        "colour": set(world.colours),
        "shape": set(world.shapes),
        "motion": {w for m in world.motions for w in MOTION_PHRASES[m].split()} - {"to", "the", "moves"},
        "background": set(world.backgrounds),
    }
    roles = []  # (clip, position) -> role
    for caption in captions:
        tokens = components.tokenizer.convert_ids_to_tokens(components.tokenizer(caption).input_ids)
        row = []
        for pos in range(length):
            if pos >= len(tokens):
                row.append("padding")
            elif tokens[pos] == components.tokenizer.eos_token:
                row.append("end")
            else:
                row.append(next((r for r, ws in words.items() if tokens[pos] in ws), "other words"))
        roles.append(row)
    captured: list[torch.Tensor] = []

    def hook(attn, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        context = args[1] if len(args) > 1 else kwargs["encoder_hidden_states"]
        q = attn.norm_q(attn.to_q(hidden)).unflatten(2, (attn.heads, -1))  # (B, S, H, D)
        k = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        logits = torch.einsum("bshd,blhd->bhsl", q, k).mul(q.shape[-1] ** -0.5)
        mask = transformer.attention_context.text_mask  # (B, 1, 1, L) where the model masks its padding
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        weights = logits.softmax(-1)
        captured.append(weights.mean((1, 2)))  # (B, L)

    handles = [b.attn2.register_forward_pre_hook(hook, with_kwargs=True) for b in transformer.blocks]
    try:
        transformer(
            hidden_states=x_t,
            timestep=torch.full((num_clips,), sigma * 1000.0),
            encoder_hidden_states=text,
            return_dict=False,
        )
    finally:
        for h in handles:
            h.remove()
    shares = torch.stack(captured)  # (layers, B, L)
    out: dict = {"sigma": sigma, "num_clips": num_clips, "max_sequence_length": length, "uniform": 1 / length}
    per_layer = []
    for layer in shares:
        totals = dict.fromkeys(ROLES, 0.0)
        for b, row in enumerate(roles):
            for pos, role in enumerate(row):
                totals[role] += float(layer[b, pos]) / num_clips
        per_layer.append({r: round(v, 4) for r, v in totals.items()})
    out["by_layer"] = per_layer
    out["mean"] = {r: round(sum(p[r] for p in per_layer) / len(per_layer), 4) for r in ROLES}
    out["words_per_caption"] = {r: round(sum(row.count(r) for row in roles) / num_clips, 2) for r in ROLES}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.v3", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="the working model directory runs/builtin-v3/model")
    i.add_argument("--out", default=str(MODEL))
    g = sub.add_parser("gate", help="the VAE gate (ceiling and latent geometry) of a VAE folder")
    g.add_argument("vae", help="an AutoencoderKLWan folder, e.g. runs/builtin-v3/model/vae")
    g.add_argument("--num-clips", type=int, default=64)
    g.add_argument("--out", default=str(NEXT / "curves" / "vae-gate.json"), help="'-' writes nothing")
    sv = sub.add_parser(
        "save-vae", help="a VAE run's checkpoint -> assets/builtin-next/v3/vae (float16, measured statistics)"
    )
    sv.add_argument("checkpoint", help="e.g. runs/builtin-v3/vae/checkpoints/step-0001700 (or a VAE folder)")
    f = sub.add_parser("failures", help="a picture of the clips whose reconstructions fail the analyser")
    f.add_argument("vae", help="an AutoencoderKLWan folder")
    f.add_argument("--out", required=True, help="a PNG: real | reconstruction | real mask | reconstruction mask")
    f.add_argument("--num-clips", type=int, default=32)
    f.add_argument("--rows", type=int, default=6)
    r = sub.add_parser("retime-vae", help="a copy of the model folder whose VAE has other temporal strides")
    r.add_argument("--vae", default=str(NEXT / "vae"), help="the VAE whose weights are kept")
    r.add_argument("--temporal-downsample", type=_flags, required=True, help="e.g. false,true (9 frames -> 5)")
    r.add_argument("--model", default=str(MODEL), help="the model folder copied (its VAE is replaced)")
    r.add_argument("--out", required=True)
    sh = sub.add_parser("ship", help="make this design the shipped built-in model (assets/builtin), atomically")
    sh.add_argument("--evaluation", default=None, help="the committed evaluation that justifies it (a JSON path)")
    a = sub.add_parser("attention", help="the cross-attention's share on each caption role (shape word, padding, ...)")
    a.add_argument("--model", default=str(MODEL))
    a.add_argument("--transformer", default=None, help="a transformer folder (default: the model's)")
    a.add_argument("--num-clips", type=int, default=8)
    a.add_argument("--sigma", type=float, default=0.6)
    a.add_argument("--out", default=None, help="writes OUT.json")
    args = p.parse_args(argv)
    if args.cmd == "init":
        init(Path(args.out))
        return 0
    if args.cmd == "ship":
        ship(evaluation=Path(args.evaluation) if args.evaluation else None)
        return 0
    if args.cmd == "failures":
        for row in failure_sheet(Path(args.vae), Path(args.out), args.num_clips, args.rows):
            print(
                f"clip {row['clip']} ({row['caption']}): misses {', '.join(row['missed'])}; box fill of the mask "
                f"{row['fill_real']:.2f} real, {row['fill_reconstruction']:.2f} reconstructed (frame {row['frame']})"
            )
        print(f"wrote {args.out}")
        return 0
    if args.cmd == "retime-vae":
        retime_vae(Path(args.vae), args.temporal_downsample, Path(args.out), Path(args.model))
        return 0
    if args.cmd == "save-vae":
        save_vae(Path(args.checkpoint))
        return 0
    if args.cmd == "attention":
        result = word_attention(
            Path(args.model), Path(args.transformer) if args.transformer else None, args.num_clips, args.sigma
        )
        if args.out:
            write_json(args.out, result)
        per = result["words_per_caption"]
        print(
            f"cross-attention share at sigma {result['sigma']} (uniform per position {result['uniform']:.3f}): "
            + ", ".join(f"{r} {v:.3f} ({per[r]:g} tokens)" for r, v in result["mean"].items())
        )
        return 0
    vae = Path(args.vae)
    if not (vae / "config.json").is_file():
        print(f"error: {vae} is not an AutoencoderKLWan folder (no config.json)", file=sys.stderr)
        return 2
    record = gate(vae, args.num_clips, None if args.out == "-" else Path(args.out))
    c, g = record["ceiling"], record["geometry"]
    print(
        f"ceiling overall {c['overall']:.2f} (count {c['count']:.2f}, colour {c['colour']:.2f}, shape {c['shape']:.2f}, "
        f"motion {c['motion']:.2f}; PSNR {c['psnr_db']:.1f} dB) on {record['num_clips']} clips; latent change "
        f"{g['latent_mse']}, pixels {g['pixel_mse']}; colour:shape {g['colour_shape_ratio_latent']} in the latents, "
        f"{g['colour_shape_ratio_pixel']} in pixels ({g['ratio_of_ratios']}x)"
    )
    print("gate: " + ("PASSED" if record["passed"] else f"FAILED {record['gate']}"))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Build the built-in model (``assets/builtin/``) from nothing, with this project's own recipe.

    python -m factory build                 # every stage below, resumable: a finished stage is skipped
    python -m factory build --until base    # stop after a stage
    python -m factory init --out runs/builtin/model

Stages (each a plain command; ``build`` prints them as it runs them):

1. ``init``: an untrained Wan2.1-architecture model directory ``runs/builtin/model``: a word-level
   tokenizer over the synthetic world's vocabulary, a small UMT5 text encoder (random and frozen: the
   transformer's cross-attention learns to read it), a small AutoencoderKLWan (z_dim 16), Wan's
   UniPC flow scheduler and a randomly initialised transformer (6 layers, 4 heads x 32, patch 1x1x1).
2. ``vae``, ``vae-17f``: ``training/finetune.py --config factory/configs/vae.yaml`` trains the VAE to
   reconstruct short synthetic clips, ``vae-17f.yaml`` continues it on whole 17-frame clips; each
   measures the latents' per-channel mean and std and installs the VAE in the model directory with
   those statistics (the pipeline normalises latents with them).
3. ``data``: ``training/precompute.py`` encodes the synthetic training split once (latents and text
   embeddings).
4. ``base``: ``finetune.py --config factory/configs/base.yaml`` trains the transformer from scratch
   with softmax attention (flow matching).
5. ``linear``, ``mhla``, ``mhla-hybrid``: each converts the base and fine-tunes it with the same budget
   (``factory/configs/<variant>.yaml``).
6. ``vae-decoder``: ``vae-decoder.yaml`` sharpens the VAE's decoder with its encoder frozen, so the
   latents, their statistics and every transformer trained on them stay valid.
7. ``assemble``: copies the model directory, the trained base transformer and the three fine-tuned
   variants into ``assets/builtin/`` with ``builtin.json`` (what was trained, how long, where).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.outputs import atomic_dir
from factory import dump_json
from pipelines.attention import SOFTMAX, VARIANTS
from pipelines.model_dir import BUILTIN_BLOCK_SHAPE, BUILTIN_DEFAULTS, BUILTIN_DIR, VARIANTS_SUBDIR
from training import checkpoint as ckpt
from world.synthetic import BACKGROUNDS, COLOURS, MOTION_PHRASES, SHAPES, SIZES

ROOT = Path(__file__).resolve().parents[2]
WORK = Path("runs/builtin")
MODEL = WORK / "model"
CACHE = WORK / "cache-train"
CONFIGS = Path("factory/configs")
CONVERSIONS = tuple(v for v in VARIANTS if v != SOFTMAX)  # the variants fine-tuned from the base
VAE_STAGES = ("vae", "vae-17f", "vae-decoder")
STAGES = ("init", "vae", "vae-17f", "data", "base", *CONVERSIONS, "vae-decoder", "assemble")

TRANSFORMER = dict(
    patch_size=(1, 1, 1),
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=64,
    ffn_dim=512,
    num_layers=6,
    rope_max_seq_len=1024,
)
VAE = dict(base_dim=12, z_dim=16, dim_mult=[1, 2, 2, 4], num_res_blocks=1, temperal_downsample=[False, True, True])
TEXT_ENCODER = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: UMT5's pad and eos ids


def world_vocabulary() -> list[str]:
    """Every word a synthetic caption can contain, sorted (see :func:`world.synthetic.caption_for`)."""
    words = {"a", "and", "on", "background", *SIZES, *COLOURS, *SHAPES, *BACKGROUNDS}
    for phrase in MOTION_PHRASES.values():
        words.update(phrase.split())
    return sorted(words)


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast``: lower-cased words, unknown words -> ``<unk>``, ``</s>`` appended."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *world_vocabulary()])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def init_model_dir(out: str | Path, seed: int = 0) -> Path:
    """Writes the untrained model directory (stage 1). Same ``seed`` -> identical weights."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    out = Path(out)
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TEXT_ENCODER)).eval()
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLWan(**VAE).eval()
        torch.manual_seed(seed + 2)
        transformer = WanTransformer3DModel(**TRANSFORMER).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipe.save_pretrained(str(tmp), safe_serialization=True)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# the settings that shape AutoencoderKLWan's encoder (and quant_conv): equal ones make encoders interchangeable
ENCODER_KEYS = ("in_channels", "base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample")


def vae_settings(**overrides) -> dict:
    """:data:`VAE`'s settings changed by ``overrides``, checked: every key an ``AutoencoderKLWan`` argument,
    one temporal flag per downsampling, scale factors that match the strides (filled in when not given)."""
    import inspect

    from diffusers import AutoencoderKLWan

    bad = sorted(set(overrides) - set(inspect.signature(AutoencoderKLWan.__init__).parameters))
    if bad:
        raise ValueError(f"AutoencoderKLWan has no argument {bad}")
    cfg = {**VAE, **overrides}
    downs = len(cfg["dim_mult"]) - 1
    if len(cfg["temperal_downsample"]) != downs:
        raise ValueError(
            f"temperal_downsample needs one entry per downsampling ({downs} for dim_mult {cfg['dim_mult']}), "
            f"got {cfg['temperal_downsample']}"
        )
    if cfg["z_dim"] != VAE["z_dim"]:  # diffusers' defaults hold 16 channels' statistics; training measures them
        cfg.setdefault("latents_mean", [0.0] * cfg["z_dim"])
        cfg.setdefault("latents_std", [1.0] * cfg["z_dim"])
    cfg.setdefault("scale_factor_spatial", 2**downs)
    cfg.setdefault("scale_factor_temporal", 2 ** sum(cfg["temperal_downsample"]))
    if cfg["scale_factor_spatial"] != 2**downs or cfg["scale_factor_temporal"] != 2 ** sum(cfg["temperal_downsample"]):
        raise ValueError(
            f"scale factors {cfg['scale_factor_temporal']}x{cfg['scale_factor_spatial']} do not match dim_mult "
            f"{cfg['dim_mult']} / temperal_downsample {cfg['temperal_downsample']}"
        )
    return cfg


def parse_overrides(items: list[str]) -> dict:
    """``["base_dim=24", "dim_mult=[1,2,4]"]`` -> ``{"base_dim": 24, "dim_mult": [1, 2, 4]}`` (values are JSON);
    raises ValueError naming a malformed item."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=JSON, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"--set {key}: {value!r} is not JSON") from None
    return overrides


def init_vae(out: str | Path, seed: int = 1, encoder_from: str | Path | None = None, **overrides) -> Path:
    """An untrained ``AutoencoderKLWan`` with :data:`VAE`'s settings changed by ``overrides`` (e.g. the
    pilots' ``dim_mult=[1, 2, 4], temperal_downsample=[True, True], scale_factor_spatial=4``: 4x4x4
    strides), saved as ``out/vae`` so that ``out`` can be a ``task: vae`` run's ``model.path``.

    ``encoder_from``: a trained VAE folder whose encoder, ``quant_conv`` and latent statistics are copied
    in (its encoder settings must match). With ``decoder_base_dim`` in ``overrides`` this makes a wider
    (or narrower) decoder for the same latents, which ``vae.trainable: decoder`` then trains: a transformer
    trained on that encoder's latents keeps working with it."""
    from diffusers import AutoencoderKLWan

    cfg = vae_settings(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(**cfg).eval()
    if encoder_from is not None:
        if not (Path(encoder_from) / "config.json").is_file():
            raise ValueError(
                f"encoder_from={str(encoder_from)!r} has no config.json (expected an AutoencoderKLWan folder)"
            )
        source = AutoencoderKLWan.from_pretrained(encoder_from, dtype=torch.float32)
        differ = {k: (source.config[k], vae.config[k]) for k in ENCODER_KEYS if source.config[k] != vae.config[k]}
        if differ:
            raise ValueError(f"the encoder of {encoder_from} has other settings (theirs, these): {differ}")
        vae.encoder.load_state_dict(source.encoder.state_dict())
        vae.quant_conv.load_state_dict(source.quant_conv.state_dict())
        vae.register_to_config(
            latents_mean=list(source.config.latents_mean), latents_std=list(source.config.latents_std)
        )
    dest = Path(out) / "vae"
    with atomic_dir(dest) as tmp:  # replaced whole (an earlier vae/ with its trained.json included), or not at all
        vae.save_pretrained(str(tmp), safe_serialization=True)
        if encoder_from is not None:  # the runs that trained the encoder (their decoder-only runs fitted another one)
            from training.vae import training_records

            encoder_runs = [
                r for r in training_records(Path(encoder_from) / "trained.json") if r.get("trainable", "all") == "all"
            ]
            if encoder_runs:
                last = {**encoder_runs[-1], "history": encoder_runs[:-1], "decoder": "new, untrained (init-vae)"}
                (tmp / "trained.json").write_text(json.dumps(last) + "\n")
    _match_transformer_channels(Path(out), cfg["z_dim"])
    return dest


def _match_transformer_channels(model_dir: Path, z_dim: int) -> None:
    """A model directory's untrained transformer reads and predicts ``z_dim`` latent channels: re-initialised
    with :data:`TRANSFORMER` (and the same seed as ``init``) when the VAE's ``z_dim`` differs from it."""
    config = model_dir / "transformer" / "config.json"
    if not config.is_file() or json.loads(config.read_text())["in_channels"] == z_dim:
        return
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        transformer = WanTransformer3DModel(**{**TRANSFORMER, "in_channels": z_dim, "out_channels": z_dim}).eval()
    with atomic_dir(model_dir / "transformer") as tmp:
        transformer.save_pretrained(str(tmp), safe_serialization=True)


def _latest_transformer(run: Path) -> Path:
    found = ckpt.list_checkpoints(run)
    if not found:
        raise FileNotFoundError(f"{run} has no checkpoint; run its stage first")
    return found[-1] / "transformer"


def _run_meta(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return {
        "run": str(run),
        "steps": steps[-1]["step"] if steps else 0,
        "train_minutes": round(sum(r["step_time"] for r in steps) / 60, 1),
        "eval_loss_start": evals[0]["eval_loss"] if evals else None,
        "eval_loss_end": evals[-1]["eval_loss"] if len(evals) > 1 else None,
    }


def assemble(out: Path = BUILTIN_DIR) -> Path:
    """Stage 6: the model directory with the trained base transformer, plus the fine-tuned variants."""
    tmp = out.with_name("." + out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(MODEL, tmp, ignore=shutil.ignore_patterns("transformer"))
    shutil.copytree(_latest_transformer(WORK / "base"), tmp / "transformer")
    for variant in CONVERSIONS:
        shutil.copytree(_latest_transformer(WORK / variant), tmp / VARIANTS_SUBDIR / variant)
    info = {
        "what": "Wan2.1-architecture text-to-video model trained from scratch on the synthetic moving-shapes world",
        "defaults": BUILTIN_DEFAULTS,
        "block_shape": list(BUILTIN_BLOCK_SHAPE),
        "transformer": TRANSFORMER,
        "vae": VAE,
        "text_encoder": {**TEXT_ENCODER, "trained": False, "tokenizer": "word-level over the world's vocabulary"},
        "runs": {
            name: _run_meta(WORK / name)
            for name in ("vae", "vae-decoder", "base", *CONVERSIONS)
            if (WORK / name / "metrics.jsonl").is_file()
        },
        "vae_reconstruction": json.loads((MODEL / "vae" / "trained.json").read_text()),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
        "device": "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "rebuild": "python -m factory build",
    }
    (tmp / "builtin.json").write_text(dump_json(info))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def stage_commands(stage: str) -> list[list[str]]:
    py, ft = sys.executable, str(ROOT / "training" / "finetune.py")
    if stage in VAE_STAGES:
        return [[py, ft, "--config", str(CONFIGS / f"{stage}.yaml")]]
    if stage == "data":
        return [
            [
                py,
                str(ROOT / "training" / "precompute.py"),
                "--config",
                str(CONFIGS / "base.yaml"),
                "--out",
                str(CACHE),
                "data.source=synthetic",
            ]
        ]
    if stage in ("base", *CONVERSIONS):
        return [[py, ft, "--config", str(CONFIGS / f"{stage}.yaml")]]
    return []


TRAINING_STAGES = (*VAE_STAGES, "base", *CONVERSIONS)


def stale_reason(stage: str) -> str | None:
    """Why a stage's existing output must not be continued, else None: a conversion fine-tuned from another
    transformer than its config now names, or a data cache written with other settings than ``base.yaml``'s.
    (Each stage is judged by its own config: a changed cache does not by itself retrain ``base``.)"""
    from omegaconf import OmegaConf

    from training.config import load_config

    if stage == "data":  # the cache is written with base.yaml's data settings
        from training.precompute import stale_cache

        stale = stale_cache(CACHE, load_config(CONFIGS / "base.yaml", ["data.source=synthetic"]))
        return f"{CACHE} was written with other settings ({stale})" if stale else None
    if stage not in CONVERSIONS:
        return None
    now = load_config(CONFIGS / f"{stage}.yaml")
    saved = Path(now.run_dir) / "config.yaml"
    if not saved.is_file():
        return None
    was = OmegaConf.load(saved).model.get("transformer")
    if was != now.model.transformer:
        return (
            f"its run was fine-tuned from {was}, factory/configs/{stage}.yaml now starts from {now.model.transformer}"
        )
    return None


def set_aside(stage: str, why: str) -> Path | None:
    """Move a stage's output (a training run directory, the data cache) to ``<dir>.old-<time>``; nothing
    is deleted, and a fresh run follows."""
    from training.config import load_config

    run = CACHE if stage == "data" else Path(load_config(CONFIGS / f"{stage}.yaml").run_dir)
    if not run.exists():
        return None
    dest = run.with_name(f"{run.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(run, dest)
    print(f"[builtin] {stage}: {why}; moved {run} to {dest}", flush=True)
    return dest


def stage_done(stage: str) -> bool:
    if stage == "init":
        return (MODEL / "model_index.json").is_file()
    if stage == "data":
        return (CACHE / "index.json").is_file() and not stale_reason(stage)
    if stage == "assemble" or stale_reason(stage):
        return False
    from training.config import load_config

    c = load_config(CONFIGS / f"{stage}.yaml")  # the config as it is now (its steps may have grown)
    if stage in VAE_STAGES:  # the installed VAE's record names every run that trained it
        from training.vae import vae_runs

        return vae_runs(MODEL / "vae" / "trained.json").get(str(Path(c.run_dir)), 0) >= c.train.steps
    found = ckpt.list_checkpoints(c.run_dir)
    return bool(found) and int(found[-1].name.split("-")[1]) >= c.train.steps + c.transfer.steps


def build(until: str, force: list[str]) -> int:
    for stage in STAGES:
        if stage_done(stage) and stage not in force:
            print(f"[builtin] {stage}: done, skipped")
        else:
            t0 = time.time()
            print(f"[builtin] {stage}: running", flush=True)
            if stage == "init":
                init_model_dir(MODEL)
            elif stage == "assemble":
                print(f"[builtin] wrote {assemble()}")
            else:
                if stage in (*TRAINING_STAGES, "data"):  # a grown step count resumes; forced or stale: afresh
                    why = "--force" if stage in force else stale_reason(stage)
                    if why:
                        set_aside(stage, why)
                for cmd in stage_commands(stage):
                    print("  $ " + " ".join(cmd), flush=True)
                    rc = subprocess.call(cmd)
                    if rc != 0:
                        print(f"[builtin] {stage} failed (exit {rc}); run the same command again to resume")
                        return rc
            print(f"[builtin] {stage}: {time.time() - t0:.0f} s", flush=True)
        if stage == until:
            break
    return 0


def main(argv=None) -> int:
    """``python -m factory``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run the stages in order (finished ones are skipped)")
    b.add_argument("--until", choices=STAGES, default="assemble")
    b.add_argument(
        "--force",
        nargs="*",
        default=[],
        choices=STAGES,
        help="re-run these stages; a training stage's run directory (or the data cache) is moved to <dir>.old-<time> "
        "first, so it starts afresh from its configured source (the vae stages from the VAE installed in "
        "runs/builtin/model)",
    )
    i = sub.add_parser("init", help="write the untrained model directory")
    i.add_argument("--out", default=str(MODEL))
    i.add_argument("--seed", type=int, default=0)
    v = sub.add_parser("init-vae", help="write an untrained VAE (OUT/vae) with the built-in settings changed by --set")
    v.add_argument("--out", required=True)
    v.add_argument("--seed", type=int, default=1)
    v.add_argument(
        "--encoder-from",
        default=None,
        metavar="VAE_DIR",
        help="copy this trained VAE's encoder and latent statistics (e.g. assets/builtin/vae with --set decoder_base_dim=24)",
    )
    v.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=JSON",
        help="e.g. base_dim=16 'dim_mult=[1,2,4]' 'temperal_downsample=[true,true]'",
    )
    sub.add_parser("assemble", help="copy the trained parts into assets/builtin")
    args = p.parse_args(argv)
    if args.cmd == "init":
        print(f"wrote {init_model_dir(args.out, args.seed)}")
        return 0
    if args.cmd == "init-vae":
        try:
            overrides = parse_overrides(args.set)
        except ValueError as e:
            p.error(str(e))
        print(f"wrote {init_vae(args.out, args.seed, encoder_from=args.encoder_from, **overrides)}")
        return 0
    if args.cmd == "assemble":
        print(f"wrote {assemble()}")
        return 0
    return build(args.until, args.force)


if __name__ == "__main__":
    sys.exit(main())

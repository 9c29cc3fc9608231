"""The built-in model's next design, staged so that a fresh machine resumes from the repository.

    python -m factory.next init                 # runs/builtin-v2/model from assets/builtin + assets/builtin-next
    nice -n 5 python -m training.finetune --config factory/configs/v2/vae.yaml     # a stage (see its header)
    python -m factory.next save vae             # its weights -> assets/builtin-next/vae (model weights only)
    python -m factory.next save-checkpoint runs/builtin-v2/base/checkpoints/step-XXXXXXX   # raw + EMA transformer
    python -m factory.next save-variant mhla runs/builtin-v2/mhla/checkpoints/step-XXXXXXX  # a conversion, float16

A stage's weights are committed under ``assets/builtin-next/`` (the VAE, the transformer and its EMA, the
conversions in float16, in the model directory's own format; no optimizer state, no latents), replaced in
place; ``init`` lays them over the shipped model directory, so a later stage on a fresh machine starts from
them (with a fresh AdamW and a short warm-up). ``assets/builtin/`` changes only when the whole new model beats
what ships on the committed evaluation, and then ``assets/builtin-next/`` goes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from factory import dump_json
from factory.build import CONVERSIONS, TRANSFORMER
from pipelines.attention import SOFTMAX
from pipelines.conversion import CONFIG_KEY
from pipelines.model_dir import BUILTIN_DIR, VARIANTS_SUBDIR

NEXT_DIR = BUILTIN_DIR.parent / "builtin-next"
WORK = Path("runs/builtin-v2")
MODEL = WORK / "model"
# what a stage may leave in assets/builtin-next/: model weights and their configs, nothing else
PARTS = ("vae", "transformer", "transformer-ema", *(f"{VARIANTS_SUBDIR}/{v}" for v in CONVERSIONS))
WEIGHT_FILES = ("config.json", "diffusion_pytorch_model.safetensors", "trained.json")
MAX_MB = 30


def init(
    model: Path = MODEL, next_dir: Path = NEXT_DIR, base: Path = BUILTIN_DIR, fresh_transformer: bool = False
) -> Path:
    """Writes ``model``: the shipped model directory (without its variants) with the committed stage weights of
    ``next_dir`` laid over it (``vae`` replaces the VAE, ``transformer`` the transformer, the keys of
    ``builtin.json`` there replace the model's: ``defaults`` key by key). An existing
    ``model`` is replaced whole (it is rebuilt from the repository alone). ``fresh_transformer``: a randomly
    initialised transformer of the built-in architecture where ``next_dir`` has none yet (the base stage
    trains from scratch; once a stage has saved one, later runs continue from it)."""
    if not (base / "model_index.json").is_file():
        raise FileNotFoundError(f"{base} is not a model directory (no model_index.json)")
    tmp = model.with_name(model.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns(VARIANTS_SUBDIR))
    laid = []
    # the base's raw weights (what a base stage resumes from) while it trains; its EMA once it is final
    transformer = next_dir / "transformer"
    if not (transformer / "config.json").is_file():
        transformer = next_dir / "transformer-ema"
    for part, src in (("vae", next_dir / "vae"), ("transformer", transformer)):
        if (src / "config.json").is_file():
            shutil.rmtree(tmp / part)
            shutil.copytree(src, tmp / part)
            laid.append(part)
    for variant in CONVERSIONS:  # committed conversions (save-variant) become the model's fine-tuned variants
        src = next_dir / VARIANTS_SUBDIR / variant
        if (src / "config.json").is_file():
            shutil.copytree(src, tmp / VARIANTS_SUBDIR / variant)
            laid.append(f"{VARIANTS_SUBDIR}/{variant}")
    overlay = next_dir / "builtin.json"
    if overlay.is_file():  # a stage that changes the clip (frames, block shape) records it here
        info, changes = json.loads((tmp / "builtin.json").read_text()), json.loads(overlay.read_text())
        for key, value in changes.items():
            info[key] = {**info[key], **value} if isinstance(value, dict) and isinstance(info.get(key), dict) else value
        (tmp / "builtin.json").write_text(dump_json(info))
        laid.append(f"builtin.json's {', '.join(changes)} from {overlay}")
    if fresh_transformer and "transformer" not in laid:
        import torch
        from diffusers import WanTransformer3DModel

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            WanTransformer3DModel(**TRANSFORMER).save_pretrained(str(tmp / "transformer"), safe_serialization=True)
        laid.append("a fresh transformer")
    if model.exists():
        shutil.rmtree(model)
    os.replace(tmp, model)
    print(f"wrote {model} from {base}" + (f" with {', '.join(laid)}" if laid else ""))
    return model


def save(part: str, src: Path, next_dir: Path = NEXT_DIR, half: bool = False, budget_root: Path | None = None) -> Path:
    """Copies a trained component folder ``src`` (config.json + safetensors) into ``next_dir/part``, atomically,
    refusing anything but weights and configs and a total over :data:`MAX_MB` (of ``budget_root``, default
    ``next_dir``: a design kept in a subfolder shares the folder's budget). ``half``: floating-point
    weights stored as float16 (loading casts them back to the model's dtype), refused if one does not fit."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if not (src / "config.json").is_file() or not (src / "diffusion_pytorch_model.safetensors").is_file():
        raise FileNotFoundError(f"{src} is not a model folder (config.json + diffusion_pytorch_model.safetensors)")
    dst = next_dir / part
    staged = dst.with_name("." + dst.name + ".new")
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    for name in WEIGHT_FILES:
        if half and name == "diffusion_pytorch_model.safetensors":
            _save_half(src / name, staged / name)
        elif (src / name).is_file():
            shutil.copy2(src / name, staged / name)
    root = budget_root or _budget_root(next_dir)
    others = sum(
        f.stat().st_size for f in root.rglob("*") if f.is_file() and dst not in f.parents and staged not in f.parents
    )
    total = (others + sum(f.stat().st_size for f in staged.iterdir())) / 2**20
    if total > MAX_MB:
        shutil.rmtree(staged)
        raise ValueError(f"assets/builtin-next would hold {total:.1f} MB, over its {MAX_MB} MB budget")
    old = dst.with_name("." + dst.name + ".old")
    if dst.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
    os.replace(staged, dst)
    if old.exists():
        shutil.rmtree(old)
    print(f"wrote {dst} ({total:.1f} MB in {next_dir})")
    return dst


def _inside_next(folder: Path) -> bool:
    """``folder`` is assets/builtin-next or a design's folder inside it."""
    root = NEXT_DIR.resolve()
    return folder.resolve() == root or root in folder.resolve().parents


def _budget_root(next_dir: Path) -> Path:
    """The folder whose total the budget counts: assets/builtin-next for it and every design's folder inside it."""
    return NEXT_DIR if _inside_next(next_dir) else next_dir


def _save_half(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(src))
    limit = torch.finfo(torch.float16).max
    for key, value in weights.items():
        if value.is_floating_point():
            if not bool(torch.isfinite(value).all()) or float(value.abs().max()) > limit:
                raise ValueError(f"{src}: {key} does not fit float16 (max |x| {float(value.abs().max()):g})")
            weights[key] = value.to(torch.float16)
    save_file(weights, str(dst), metadata={"format": "pt"})


def save_variant(variant: str, checkpoint: Path, next_dir: Path = NEXT_DIR) -> Path:
    """A conversion's fine-tuned transformer into ``next_dir/variants/VARIANT``: a checkpoint's ``transformer/``
    (its EMA's weights when the run kept one) or a transformer folder, stored in float16 so that the three
    conversions (3.5 MB each instead of 7) fit the budget beside the VAE and the base. ``init`` lays it into the
    working model's ``variants/``; an evaluation of that model is an evaluation of what is committed."""
    if variant not in CONVERSIONS:
        raise ValueError(f"variant must be one of {CONVERSIONS}, got {variant!r}")
    folder = checkpoint / "transformer" if (checkpoint / "transformer").is_dir() else checkpoint
    config = folder / "config.json"
    if config.is_file():
        got = (json.loads(config.read_text()).get(CONFIG_KEY) or {}).get("variant", SOFTMAX)
        if got != variant:
            raise ValueError(f"{folder} holds a {got!r} transformer, not {variant!r}")
    return save(f"{VARIANTS_SUBDIR}/{variant}", folder, next_dir, half=True)


def raw_weights(checkpoint: Path) -> dict:
    """A checkpoint's raw weights: its ``trainable.safetensors`` laid over its ``transformer/`` (the EMA's
    averages; the frozen weights are the same in both); a trainable weight the transformer lacks is refused."""
    from safetensors.torch import load_file

    raw = checkpoint / "trainable.safetensors"
    weights = load_file(str(checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
    trainable = load_file(str(raw))
    unknown = sorted(set(trainable) - set(weights))
    if unknown:
        raise ValueError(f"{raw} holds weights the transformer does not: {unknown[:4]}")
    weights.update(trainable)
    return weights


def save_checkpoint(checkpoint: Path, next_dir: Path = NEXT_DIR, half: bool = False) -> list[Path]:
    """A base-stage checkpoint into ``next_dir``: its ``transformer/`` (the EMA's weights when the run keeps an
    EMA) as ``transformer-ema``, and the raw weights (``trainable.safetensors`` laid over it) as ``transformer``,
    the one a later stage resumes from. Without an EMA the checkpoint's transformer is ``transformer`` alone.
    ``half``: both stored as float16 (a design in a subfolder of assets/builtin-next shares its budget).
    ``stage.json`` beside them names the checkpoint's step."""
    folder = checkpoint / "transformer"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint with a transformer/ folder")
    raw = checkpoint / "trainable.safetensors"
    if not raw.is_file():
        written = [save("transformer", folder, next_dir, half=half)]
    else:
        written = _save_raw_and_ema(checkpoint, folder, next_dir, half)
    write_stage_record(checkpoint, next_dir)
    return written


def write_stage_record(checkpoint: Path, next_dir: Path) -> Path:
    """``next_dir/stage.json``: the step the stage's weights were trained to (the checkpoint's), what a fresh
    machine's run goes on from with ``train.start_step=<step>`` (its schedule, data order and step count)."""
    from common.outputs import write_text_atomic
    from training.checkpoint import checkpoint_at

    path = next_dir / "stage.json"
    write_text_atomic(path, dump_json({"step": checkpoint_at(checkpoint), "checkpoint": checkpoint.name}))
    return path


def _save_raw_and_ema(checkpoint: Path, folder: Path, next_dir: Path, half: bool) -> list[Path]:
    """The EMA's weights as ``transformer-ema`` and the raw ones (laid over them) as ``transformer``."""
    from safetensors.torch import save_file

    written = [save("transformer-ema", folder, next_dir, half=half)]
    weights = raw_weights(checkpoint)
    staged = checkpoint / ".raw-transformer"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    try:
        shutil.copy2(folder / "config.json", staged / "config.json")
        save_file(weights, str(staged / "diffusion_pytorch_model.safetensors"))
        written.append(save("transformer", staged, next_dir, half=half))
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return written


def stage_transformer(path: str | Path, weights: str = "ema", dtype=None):
    """The transformer of ``path`` for a diagnosis: a transformer folder as it is, or a training checkpoint's
    (``transformer/`` and ``trainable.safetensors``): its ``transformer/`` for ``weights="ema"`` (the EMA's
    averages when the run keeps one), the raw weights laid over it for ``"raw"`` (what a short arm's few hundred
    steps changed, undiluted by the EMA's decay)."""
    import torch

    from pipelines import load_transformer

    if weights not in ("ema", "raw"):
        raise ValueError(f"weights={weights!r}: expected 'ema' or 'raw'")
    path = Path(path)
    dtype = dtype or torch.float32
    if (path / "config.json").is_file():
        if weights == "raw":
            raise ValueError(f"{str(path)!r} is a transformer folder (one set of weights); 'raw' needs a checkpoint")
        return load_transformer(str(path), dtype=dtype, device="cpu")
    if not (path / "transformer" / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is neither a transformer folder (config.json) nor a checkpoint (transformer/config.json)"
        )
    if weights == "raw" and not (path / "trainable.safetensors").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no trainable.safetensors: its transformer/ is the raw weights")
    transformer = load_transformer(str(path / "transformer"), dtype=dtype, device="cpu")
    if weights == "raw":
        transformer.load_state_dict({k: v.to(dtype) for k, v in raw_weights(path).items()})
    return transformer


def _design_folder(into: str) -> Path:
    """``--into``: assets/builtin-next or a design's folder inside it (never a path elsewhere: stage weights are
    committed there and counted against its budget)."""
    if not _inside_next(Path(into)):
        raise ValueError(f"--into {into!r}: expected {NEXT_DIR} or a folder inside it (e.g. {NEXT_DIR / 'v3'})")
    return Path(into).resolve()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.next", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="the working model directory from assets/builtin + assets/builtin-next")
    i.add_argument("--out", default=str(MODEL))
    i.add_argument(
        "--fresh-transformer",
        action="store_true",
        help="a random transformer where assets/builtin-next has none (the base stage trains from scratch)",
    )
    s = sub.add_parser("save", help="a stage's weights into assets/builtin-next/PART")
    s.add_argument("part", choices=PARTS)
    s.add_argument("--from", dest="src", default=None, help="the folder to save (default: the model directory's)")
    c = sub.add_parser(
        "save-checkpoint",
        help="a transformer stage's checkpoint: its raw weights -> transformer, its EMA's -> transformer-ema",
    )
    c.add_argument("checkpoint", help="e.g. runs/builtin-v2/base/checkpoints/step-0003000")
    c.add_argument("--into", default=str(NEXT_DIR), help="the design's folder (default %(default)s; v3: its v3/)")
    c.add_argument("--half", action="store_true", help="store the weights as float16")
    v = sub.add_parser("save-variant", help="a conversion's checkpoint -> variants/VARIANT, in float16")
    v.add_argument("variant", choices=CONVERSIONS)
    v.add_argument("checkpoint", help="e.g. runs/builtin-v2/mhla/checkpoints/step-0000300 (or its transformer/)")
    v.add_argument("--into", default=str(NEXT_DIR), help="the design's folder (default %(default)s; v3: its v3/)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "init":
            init(Path(args.out), fresh_transformer=args.fresh_transformer)
        elif args.cmd == "save-checkpoint":
            save_checkpoint(Path(args.checkpoint), _design_folder(args.into), half=args.half)
        elif args.cmd == "save-variant":
            save_variant(args.variant, Path(args.checkpoint), _design_folder(args.into))
        else:
            default = MODEL / ("transformer" if args.part.startswith("transformer") else args.part)
            save(args.part, Path(args.src) if args.src else default)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

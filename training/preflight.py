"""What a fine-tuning run can check before its model loads: every ``model.*`` key against the model's config
files (``model.expert`` against the model's transformers, layer indices, the clip size against the VAE's
compression and the patch, the block layout against the training grid, attention options, the transformer
folder), and a resume's architecture against the checkpoint's. Each check raises ValueError naming the key, the value
and what was expected (exit 2 through the error boundary)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

import mhla
from pipelines import AttentionOptions, latent_grid
from pipelines.attention import linear_layers_for
from pipelines.conversion import CONFIG_KEY, Conversion
from pipelines.model_dir import ModelDir, check_transformer_config, saved_transformer_config
from training.cache import latents_shape, read_index
from training.data import check_bucket_sizes_fit
from training.experts import TrainingTarget, expert_folder, read_target

# the keys that decide the converted transformer's parameters: a resume must keep them
ARCHITECTURE_KEYS = (
    "model.expert",
    "model.variant",
    "model.layers",
    "model.attention",
    "train.trainable",
    "train.lora",
)


def _own_blocks(cfg: DictConfig, target: TrainingTarget) -> tuple[int, int, int] | None:
    """The starting transformer's own MHLA blocks, from its config.json (its conversion record's
    :attr:`pipelines.conversion.Conversion.blocks`, as a loaded model's): ``model.transformer``'s, else the
    expert's in ``model.path``; None for a softmax one."""
    folder = expert_folder(cfg, target)
    config = (saved_transformer_config(folder) if folder is not None and Path(folder).is_dir() else None) or {}
    return Conversion.from_config(config.get(CONFIG_KEY), int(config.get("num_layers") or 0)).blocks


def planned_blocks(
    cfg: DictConfig, target: TrainingTarget | None = None
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(grid, blocks)`` the run will train with, from config files only, by the block rule
    ``finetune.build_model`` applies (:func:`mhla.resolve_blocks`: ``model.blocks``, which must fit the grid, else
    the starting transformer's own, else the default for the model's block shape). The grid comes from the clip
    size, the VAE's strides (16x for Wan2.2-TI2V's) and the expert's patch."""
    target = read_target(cfg) if target is None else target
    model = target.model_dir or ModelDir(cfg.model.path)
    patch = model.shape(expert_folder(cfg, target)).patch
    grid = latent_grid(cfg.data.height, cfg.data.width, cfg.data.num_frames, patch, target.vae_stride)
    resolved = mhla.resolve_blocks(grid, cfg.model.blocks or None, _own_blocks(cfg, target), model.block_shape)
    return grid, tuple(resolved.blocks)


def check_clip_size(cfg: DictConfig, target: TrainingTarget, patch: tuple[int, int, int]) -> None:
    """``data.height`` / ``data.width`` divisible by the VAE's spatial stride times the patch (32 for Wan2.2-TI2V's
    16x VAE, 16 for Wan2.1's 8x), ``data.num_frames - 1`` by the temporal stride."""
    st, sh, sw = target.vae_stride
    for key, stride, p in (("data.height", sh, patch[1]), ("data.width", sw, patch[2])):
        value, multiple = OmegaConf.select(cfg, key), stride * p
        if value % multiple:
            raise ValueError(
                f"{key}={value}: expected a multiple of {multiple} for {target.architecture} (the VAE's {stride}x "
                f"spatial compression x the transformer's patch {p}), e.g. {max(multiple, value // multiple * multiple)}"
            )
    frames = cfg.data.num_frames
    if (frames - 1) % st:
        raise ValueError(f"data.num_frames={frames}: expected {st}k+1 for the VAE's {st}x temporal compression")


def check_expert_run(cfg: DictConfig, target: TrainingTarget) -> None:
    """What one expert of a two-expert model cannot do alone: make validation videos (the pipeline runs both
    experts) or the conditioning probe (its noise levels span both experts' ranges)."""
    if not target.two_experts:
        return
    if cfg.validation.every:
        raise ValueError(
            f"validation.every={cfg.validation.every}: model.expert={target.expert!r} is one of two experts and "
            "cannot make a video alone; expected validation.every=0 (generate from a checkpoint with the other "
            "expert of the model directory instead)"
        )
    if cfg.validation.probe_every:
        raise ValueError(
            f"validation.probe_every={cfg.validation.probe_every}: the conditioning probe needs a model that covers "
            f"every noise level, and model.expert={target.expert!r} covers {target.sigma_range}; expected 0"
        )


def check_model_plan(cfg: DictConfig) -> TrainingTarget:
    """``model.*`` against the model's config files, before anything loads; returns the run's
    :class:`TrainingTarget` (its ``model_dir`` read once, for the rest of the run)."""
    if cfg.model.transformer:
        folder = Path(cfg.model.transformer)
        config = saved_transformer_config(folder) if folder.is_dir() else None
        if config is None:
            raise ValueError(
                f"model.transformer={cfg.model.transformer!r}: expected a transformer folder with a config.json "
                "(e.g. runs/<run>/checkpoints/step-XXXXXXX/transformer)"
            )
        check_transformer_config(config, folder / "config.json", "model.transformer")
    attention = OmegaConf.to_container(cfg.model.attention)
    if "blocks" in attention:  # type: ignore[operator]
        raise ValueError("model.attention.blocks: the MHLA layout is model.blocks (e.g. model.blocks=7x3x5)")
    try:
        AttentionOptions(**attention)  # type: ignore[arg-type]
    except TypeError:
        known = sorted(AttentionOptions.__dataclass_fields__)
        bad = sorted(set(attention) - set(known))  # type: ignore[arg-type]
        raise ValueError(f"model.attention: unknown option(s) {bad}; expected some of {known}") from None
    except ValueError as e:
        raise ValueError(f"model.attention: {e}") from None
    target = read_target(cfg)  # model.expert against the model's transformers
    check_expert_run(cfg, target)
    folder = expert_folder(cfg, target)
    shape = (target.model_dir or ModelDir(cfg.model.path)).shape(folder)
    num_layers = shape.num_layers
    check_clip_size(cfg, target, shape.patch)
    check_bucket_sizes_fit(cfg, target)
    layers = list(cfg.model.layers) if cfg.model.layers is not None else None
    try:
        linear_layers_for(cfg.model.variant, num_layers, layers)
    except ValueError as e:
        raise ValueError(f"model.layers={layers}: {e}") from None
    try:
        planned_blocks(cfg, target)  # a model.blocks that does not fit the training grid raises, naming the axis
    except ValueError as e:
        size = f"{cfg.data.num_frames} frames at {cfg.data.height}x{cfg.data.width}"
        raise ValueError(f"model.blocks={cfg.model.blocks!r} for the training grid of {size}: {e}") from None
    check_cache_fits(cfg, target)
    return target


def check_cache_fits(cfg: DictConfig, target: TrainingTarget) -> None:
    """A latent cache (``data.source=cache``) holds latents of the model's VAE at the clip size: a cache written
    with another VAE (Wan2.1's 16 channels at 8x for Wan2.2-TI2V's 48 at 16x) is refused naming both shapes.
    Reads the first sample's safetensors header only."""
    if cfg.data.source != "cache":
        return
    root = Path(cfg.data.path)
    index = root / "index.json"
    items = (read_index(root).get("items") or []) if index.is_file() else []  # its checksum, each entry's size
    if not items:
        return  # training.data.CachedLatents names what is missing
    shape = latents_shape(root / items[0]["file"])  # a damaged header: named (training/cache.py)
    folder = expert_folder(cfg, target)
    config = (saved_transformer_config(folder) if folder is not None else None) or {}
    channels = int(config.get("in_channels", 16))
    d = cfg.data
    # a cache of buckets records each clip's (frames, height, width): its first clip's latents are of that size
    frames, height, width = items[0].get("video") or (d.num_frames, d.height, d.width)
    expected = (channels, *latent_grid(height, width, frames, (1, 1, 1), target.vae_stride))
    if shape != expected:
        raise ValueError(
            f"data.path={str(root)!r}: its latents are {shape} (channels, frames, height, width), but "
            f"{target.architecture} at {frames} frames, {height}x{width} trains on {expected}; expected a "
            "cache written with this model's VAE (python -m training.precompute with the same model.path)"
        )


def check_resume_matches(cfg: DictConfig, checkpoint: Path) -> None:
    """The checkpoint being resumed was trained with the architecture this config builds: the same
    :data:`ARCHITECTURE_KEYS` and the same MHLA blocks (a changed ``model.blocks`` would otherwise fail in
    ``load_state_dict`` with a size mismatch after the model loaded)."""
    saved_file = checkpoint / "config.yaml"
    if not saved_file.is_file():
        return  # an older checkpoint: restore_run still compares the weights
    saved = OmegaConf.load(saved_file)
    changed = []
    for key in ARCHITECTURE_KEYS:
        was, now = OmegaConf.select(saved, key, default=None), OmegaConf.select(cfg, key, default=None)
        was = OmegaConf.to_container(was) if isinstance(was, DictConfig | ListConfig) else was
        now = OmegaConf.to_container(now) if isinstance(now, DictConfig | ListConfig) else now
        if was != now:
            changed.append(f"{key} was {was!r}, now {now!r}")
    folder = checkpoint / (OmegaConf.select(saved, "model.expert", default=None) or "transformer")
    config = saved_transformer_config(folder) or {}
    trained = Conversion.from_config(config.get(CONFIG_KEY), int(config.get("num_layers") or 0)).blocks
    if trained is not None:
        _, blocks = planned_blocks(cfg)
        if tuple(trained) != tuple(blocks):
            t, b = "x".join(map(str, trained)), "x".join(map(str, blocks))
            changed.append(f"MHLA blocks were {t}, now {b} (model.blocks={cfg.model.blocks!r})")
    if changed:
        raise ValueError(
            f"resume={cfg.resume!r}: checkpoint {str(checkpoint)!r} was trained with another architecture: "
            + "; ".join(changed)
            + ". Resume with the settings it was trained with, or start a new run_dir"
        )

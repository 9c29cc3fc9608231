"""What a fine-tuning run can check before its model loads: every ``model.*`` key against the model's config
files (``model.expert`` against the model's transformers, layer indices, the clip size against the VAE's
compression and the patch, the block layout against the training grid, attention options, the transformer
folder), and a resume's architecture against the checkpoint's. Each check raises ValueError naming the key, the value
and what was expected (exit 2 through the error boundary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import mhla
from pipelines import AttentionOptions, latent_grid
from pipelines.attention import linear_layers_for
from pipelines.conversion import CONFIG_KEY, Conversion
from pipelines.model_dir import ModelDir, check_transformer_config, saved_transformer_config
from training.cache import latents_shape, read_index
from training.config import DataSection, FinetuneConfig, ModelSection, ValidationSection, as_tree
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


def _own_blocks(model: ModelSection, target: TrainingTarget) -> tuple[int, int, int] | None:
    """The starting transformer's own MHLA blocks, from its config.json (its conversion record's
    :attr:`pipelines.conversion.Conversion.blocks`, as a loaded model's): ``model.transformer``'s, else the
    expert's in ``model.path``; None for a softmax one."""
    folder = expert_folder(model, target)
    config = (saved_transformer_config(folder) if folder is not None and Path(folder).is_dir() else None) or {}
    return Conversion.from_config(config.get(CONFIG_KEY), int(config.get("num_layers") or 0)).blocks


def planned_blocks(
    model: ModelSection, data: DataSection, target: TrainingTarget | None = None
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(grid, blocks)`` the run will train with, from config files only, by the block rule
    ``finetune.build_model`` applies (:func:`mhla.resolve_blocks`: ``model.blocks``, which must fit the grid, else
    the starting transformer's own, else the default for the model's block shape). The grid comes from the clip
    size, the VAE's strides (16x for Wan2.2-TI2V's) and the expert's patch."""
    target = read_target(model) if target is None else target
    folder = target.model_dir or ModelDir(model.path)
    patch = folder.shape(expert_folder(model, target)).patch
    grid = latent_grid(data.height, data.width, data.num_frames, patch, target.vae_stride)
    resolved = mhla.resolve_blocks(grid, model.blocks or None, _own_blocks(model, target), folder.block_shape)
    return grid, resolved.blocks


def check_clip_size(data: DataSection, target: TrainingTarget, patch: tuple[int, int, int]) -> None:
    """``data.height`` / ``data.width`` divisible by the VAE's spatial stride times the patch (32 for Wan2.2-TI2V's
    16x VAE, 16 for Wan2.1's 8x), ``data.num_frames - 1`` by the temporal stride."""
    st, sh, sw = target.vae_stride
    for side, stride, p in (("height", sh, patch[1]), ("width", sw, patch[2])):
        value, multiple = getattr(data, side), stride * p
        if value % multiple:
            raise ValueError(
                f"data.{side}={value}: expected a multiple of {multiple} for {target.architecture} (the VAE's {stride}x "
                f"spatial compression x the transformer's patch {p}), e.g. {max(multiple, value // multiple * multiple)}"
            )
    frames = data.num_frames
    if (frames - 1) % st:
        raise ValueError(f"data.num_frames={frames}: expected {st}k+1 for the VAE's {st}x temporal compression")


def check_expert_run(validation: ValidationSection, target: TrainingTarget) -> None:
    """What one expert of a two-expert model cannot do alone: make validation videos (the pipeline runs both
    experts) or the conditioning probe (its noise levels span both experts' ranges)."""
    if not target.two_experts:
        return
    if validation.every:
        raise ValueError(
            f"validation.every={validation.every}: model.expert={target.expert!r} is one of two experts and "
            "cannot make a video alone; expected validation.every=0 (generate from a checkpoint with the other "
            "expert of the model directory instead)"
        )
    if validation.probe_every:
        raise ValueError(
            f"validation.probe_every={validation.probe_every}: the conditioning probe needs a model that covers "
            f"every noise level, and model.expert={target.expert!r} covers {target.sigma_range}; expected 0"
        )


def check_model_plan(cfg: FinetuneConfig) -> TrainingTarget:
    """``model.*`` against the model's config files, before anything loads, with the data (clip size, buckets,
    cache) and validation settings that depend on the model; returns the run's :class:`TrainingTarget` (its
    ``model_dir`` read once, for the rest of the run)."""
    model, data = cfg.model, cfg.data
    if model.transformer:
        folder = Path(model.transformer)
        config = saved_transformer_config(folder) if folder.is_dir() else None
        if config is None:
            raise ValueError(
                f"model.transformer={model.transformer!r}: expected a transformer folder with a config.json "
                "(e.g. runs/<run>/checkpoints/step-XXXXXXX/transformer)"
            )
        check_transformer_config(config, folder / "config.json", "model.transformer")
    attention = model.attention
    if "blocks" in attention:
        raise ValueError("model.attention.blocks: the MHLA layout is model.blocks (e.g. model.blocks=7x3x5)")
    try:
        AttentionOptions(**attention)
    except TypeError:
        known = sorted(AttentionOptions.__dataclass_fields__)
        bad = sorted(set(attention) - set(known))
        raise ValueError(f"model.attention: unknown option(s) {bad}; expected some of {known}") from None
    except ValueError as e:
        raise ValueError(f"model.attention: {e}") from None
    target = read_target(model)  # model.expert against the model's transformers
    check_expert_run(cfg.validation, target)
    shape = (target.model_dir or ModelDir(model.path)).shape(expert_folder(model, target))
    num_layers = shape.num_layers
    check_clip_size(data, target, shape.patch)
    check_bucket_sizes_fit(data, model, target)
    try:
        linear_layers_for(model.variant, num_layers, model.layers)
    except ValueError as e:
        raise ValueError(f"model.layers={model.layers}: {e}") from None
    try:
        planned_blocks(
            model, data, target
        )  # a model.blocks that does not fit the training grid raises, naming the axis
    except ValueError as e:
        size = f"{data.num_frames} frames at {data.height}x{data.width}"
        raise ValueError(f"model.blocks={model.blocks!r} for the training grid of {size}: {e}") from None
    check_cache_fits(data, model, target)
    return target


def check_cache_fits(data: DataSection, model: ModelSection, target: TrainingTarget) -> None:
    """A latent cache (``data.source=cache``) holds latents of the model's VAE at the clip size: a cache written
    with another VAE (Wan2.1's 16 channels at 8x for Wan2.2-TI2V's 48 at 16x) is refused naming both shapes.
    Reads the first sample's safetensors header only."""
    if data.source != "cache" or data.path is None:
        return
    root = Path(data.path)
    index = root / "index.json"
    items = (read_index(root).get("items") or []) if index.is_file() else []  # its checksum, each entry's size
    if not items:
        return  # training.data.CachedLatents names what is missing
    shape = latents_shape(root / items[0]["file"])  # a damaged header: named (training/cache.py)
    folder = expert_folder(model, target)
    config = (saved_transformer_config(folder) if folder is not None else None) or {}
    channels = int(config.get("in_channels", 16))
    d = data
    # a cache of buckets records each clip's (frames, height, width): its first clip's latents are of that size
    frames, height, width = items[0].get("video") or (d.num_frames, d.height, d.width)
    expected = (channels, *latent_grid(height, width, frames, (1, 1, 1), target.vae_stride))
    if shape != expected:
        raise ValueError(
            f"data.path={str(root)!r}: its latents are {shape} (channels, frames, height, width), but "
            f"{target.architecture} at {frames} frames, {height}x{width} trains on {expected}; expected a "
            "cache written with this model's VAE (python -m training.precompute with the same model.path)"
        )


def check_resume_matches(cfg: FinetuneConfig, checkpoint: Path) -> None:
    """The checkpoint being resumed was trained with the architecture this config builds: the same
    :data:`ARCHITECTURE_KEYS` and the same MHLA blocks (a changed ``model.blocks`` would otherwise fail in
    ``load_state_dict`` with a size mismatch after the model loaded)."""
    # the snapshot as plain values (training.config.config_yaml wrote it; an older run's may lack a key: None)
    saved = saved_run_config(checkpoint)
    if saved is None:
        return  # an older checkpoint: restore_run still compares the weights
    now_tree = as_tree(cfg)
    changed = []
    for key in ARCHITECTURE_KEYS:
        was, now = _lookup(saved, key), _lookup(now_tree, key)
        if was != now:
            changed.append(f"{key} was {was!r}, now {now!r}")
    folder = checkpoint / (_lookup(saved, "model.expert") or "transformer")
    config = saved_transformer_config(folder) or {}
    trained = Conversion.from_config(config.get(CONFIG_KEY), int(config.get("num_layers") or 0)).blocks
    if trained is not None:
        _, blocks = planned_blocks(cfg.model, cfg.data)
        if tuple(trained) != tuple(blocks):
            t, b = "x".join(map(str, trained)), "x".join(map(str, blocks))
            changed.append(f"MHLA blocks were {t}, now {b} (model.blocks={cfg.model.blocks!r})")
    if changed:
        raise ValueError(
            f"resume={cfg.resume!r}: checkpoint {str(checkpoint)!r} was trained with another architecture: "
            + "; ".join(changed)
            + ". Resume with the settings it was trained with, or start a new run_dir"
        )


def saved_run_config(checkpoint: Path) -> dict[str, Any] | None:
    """The run configuration a checkpoint was written with (its ``config.yaml``, as plain values), or None for an
    older checkpoint without one."""
    saved_file = checkpoint / "config.yaml"
    if not saved_file.is_file():
        return None
    saved = OmegaConf.to_container(OmegaConf.load(saved_file))
    assert isinstance(saved, dict)  # config_yaml writes a mapping
    return {str(k): v for k, v in saved.items()}


def trained_text_mask(cfg: FinetuneConfig, checkpoint: Path) -> bool:
    """Whether the transformer in ``checkpoint`` was trained with the caption's padding masked in its
    cross-attention (its saved config's ``mask_text_padding``). A resumed run whose ``model.mask_text_padding``
    is null goes on that way: its weights load into a model built from ``model.transformer``, whose own setting
    may differ."""
    saved = saved_run_config(checkpoint) or {}
    folder = checkpoint / (_lookup(saved, "model.expert") or cfg.model.expert or "transformer")
    return bool((saved_transformer_config(folder) or {}).get("mask_text_padding", False))


def begun_at(checkpoint: Path) -> int:
    """The step the run that wrote ``checkpoint`` began at: its config's ``train.start_step`` (0 for a run that
    began at step 0, or a checkpoint written before the key existed)."""
    return int(_lookup(saved_run_config(checkpoint) or {}, "train.start_step") or 0)


def _lookup(tree: Any, key: str) -> Any:
    """The value at dotted ``key`` of a plain mapping, None where a part is missing (a snapshot written before the
    key existed)."""
    for part in key.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree

"""What a fine-tuning run can check before its model loads: every ``model.*`` key against the model's config
files (layer indices, the block layout against the training grid, attention options, the transformer folder),
and a resume's architecture against the checkpoint's. Each check raises ValueError naming the key, the value
and what was expected (exit 2 through the error boundary)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

import mhla
from pipelines import AttentionOptions, latent_grid
from pipelines.attention import linear_layers_for
from pipelines.builtin import BUILTIN_DIR, TINY_RANDOM, builtin_available
from pipelines.loading import model_num_layers, model_patch_size, model_settings, saved_transformer_config
from pipelines.model_dir import check_transformer_config

# the keys that decide the converted transformer's parameters: a resume must keep them
ARCHITECTURE_KEYS = ("model.variant", "model.layers", "model.attention", "train.trainable", "train.lora")


def _own_blocks(cfg: DictConfig) -> tuple[int, int, int] | None:
    """The starting transformer's own MHLA blocks, from its config.json (as ``pipelines.convert.model_blocks``
    reads them from a loaded one): ``model.transformer``'s, else ``model.path``'s; None for a softmax one."""
    folder = cfg.model.transformer
    if not folder:
        path = cfg.model.path if cfg.model.path is not None else (BUILTIN_DIR if builtin_available() else TINY_RANDOM)
        folder = None if str(path) == TINY_RANDOM else Path(path) / "transformer"
    config = saved_transformer_config(folder) if folder is not None and Path(folder).is_dir() else None
    state = (config or {}).get("self_attention") or {}
    if not (state.get("parameters") or {}).get("mhla"):
        return None
    return mhla.parse_blocks(state["options"]["blocks"])


def planned_blocks(cfg: DictConfig) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(grid, blocks)`` the run will train with, from config files only, by the block rule
    ``finetune.build_model`` applies (:func:`mhla.resolve_blocks`: ``model.blocks``, which must fit the grid, else
    the starting transformer's own, else the default for the model's block shape)."""
    patch = model_patch_size(cfg.model.path, cfg.model.transformer)
    grid = latent_grid(cfg.data.height, cfg.data.width, cfg.data.num_frames, tuple(patch))
    block_shape = model_settings(cfg.model.path)[1]
    resolved = mhla.resolve_blocks(grid, cfg.model.blocks or None, _own_blocks(cfg), block_shape)
    return grid, tuple(resolved.blocks)


def check_model_plan(cfg: DictConfig) -> None:
    """``model.*`` against the model's config files, before anything loads."""
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
    num_layers = model_num_layers(cfg.model.path, cfg.model.transformer)
    layers = list(cfg.model.layers) if cfg.model.layers is not None else None
    try:
        linear_layers_for(cfg.model.variant, num_layers, layers)
    except ValueError as e:
        raise ValueError(f"model.layers={layers}: {e}") from None
    try:
        planned_blocks(cfg)  # a model.blocks that does not fit the training grid raises, naming the axis
    except ValueError as e:
        size = f"{cfg.data.num_frames} frames at {cfg.data.height}x{cfg.data.width}"
        raise ValueError(f"model.blocks={cfg.model.blocks!r} for the training grid of {size}: {e}") from None


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
    state = (saved_transformer_config(checkpoint / "transformer") or {}).get("self_attention") or {}
    trained = (state.get("options") or {}).get("blocks")
    if trained is not None and state.get("parameters", {}).get("mhla"):
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

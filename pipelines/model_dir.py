"""What a model directory on disk must hold, and checks of its files before anything is loaded.

Used by every model source in :mod:`pipelines.loading` and by :mod:`pipelines.builtin`; reads only
config files and safetensors headers (and, in :func:`check_finite`, tensors already loaded).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

WEIGHTS = ("diffusion_pytorch_model.safetensors", "model.safetensors")
# What a diffusers-format Wan2.1 T2V directory must contain (weights: a single file or a sharded index).
EXPECTED = {
    "model_index.json": "model_index.json",
    "scheduler": "scheduler/scheduler_config.json",
    "tokenizer": "tokenizer/tokenizer_config.json",
    "text_encoder": "text_encoder/config.json + model.safetensors (or model.safetensors.index.json)",
    "transformer": "transformer/config.json + diffusion_pytorch_model.safetensors (or .safetensors.index.json)",
    "vae": "vae/config.json + diffusion_pytorch_model.safetensors",
}


def read_json(path: str | Path, what: str = "file") -> dict[str, Any]:
    """A JSON object from ``path``; a file that is not valid JSON raises ValueError naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON ({e}); expected a JSON object") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {str(path)!r} is not a text file; expected a JSON object") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} holds a {type(data).__name__}; expected a JSON object")
    return data


def require_key(config: dict[str, Any], key: str, path: str | Path) -> Any:
    if key not in config:
        raise ValueError(f"{str(path)!r} has no {key!r}; expected a Wan transformer config.json (save_pretrained's)")
    return config[key]


def _has_weights(folder: Path, name: str) -> bool:
    return (folder / name).is_file() or (folder / f"{name}.index.json").is_file()


def missing_model_files(model_dir: str | Path) -> list[str]:
    """The expected files of a diffusers-format Wan2.1 T2V directory that ``model_dir`` lacks."""
    root = Path(model_dir)
    missing = []
    if not (root / "model_index.json").is_file():
        missing.append(EXPECTED["model_index.json"])
    if not (root / "scheduler" / "scheduler_config.json").is_file():
        missing.append(EXPECTED["scheduler"])
    tok = root / "tokenizer"
    if not (tok / "tokenizer_config.json").is_file() and not (tok / "tokenizer.json").is_file():
        missing.append(EXPECTED["tokenizer"])
    for part, weights in (("text_encoder", "model.safetensors"), ("transformer", WEIGHTS[0]), ("vae", WEIGHTS[0])):
        folder = root / part
        if not (folder / "config.json").is_file() or not _has_weights(folder, weights):
            missing.append(EXPECTED[part])
    return missing


def check_model_dir(model_dir: str | Path) -> Path:
    """Raises ``FileNotFoundError`` naming what is missing unless ``model_dir`` is a complete Wan2.1 T2V dir."""
    root = Path(model_dir)
    if root.is_file():
        raise FileNotFoundError(
            f"model directory {str(root)!r} is a file; expected a local diffusers-format Wan2.1 T2V directory "
            "(the folder holding model_index.json, transformer/, vae/, ...)"
        )
    if not root.is_dir():
        raise FileNotFoundError(
            f"model directory {str(root)!r} does not exist; expected a local diffusers-format Wan2.1 T2V directory "
            f"({', '.join(EXPECTED.values())}), or no --model for the built-in model"
        )
    missing = missing_model_files(root)
    if missing:
        raise FileNotFoundError(
            f"model directory {str(root)!r} is incomplete (nothing is downloaded); missing: " + "; ".join(missing)
        )
    return root


def weight_files(folder: Path) -> list[Path]:
    single = folder / WEIGHTS[0]
    if single.is_file():
        return [single]
    index = folder / f"{WEIGHTS[0]}.index.json"
    if index.is_file():
        shards = sorted(set(require_key(read_json(index, "weights index"), "weight_map", index).values()))
        return [folder / s for s in shards]
    raise FileNotFoundError(f"{str(folder)!r} has no {WEIGHTS[0]} (or its .index.json)")


FLOAT_FILE_DTYPES = ("F16", "BF16", "F32", "F64")


def check_weight_files(files: list[Path]) -> None:
    """Opens each safetensors file's header: a file that is empty, truncated or not safetensors, or that holds
    a non-float tensor where the model has float weights, raises ValueError naming the file and tensor."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        except (SafetensorError, OSError) as e:
            size = file.stat().st_size if file.is_file() else 0
            raise ValueError(
                f"{str(file)!r} ({size} bytes) is not a readable safetensors file ({e}); it may be empty, truncated "
                "or another format"
            ) from None
        bad = {k: d for k, d in dtypes.items() if d not in FLOAT_FILE_DTYPES}
        if bad:
            k = sorted(bad)[0]
            raise ValueError(
                f"{str(file)!r} holds {len(bad)} non-float tensor(s), e.g. {k!r} as {bad[k]}; expected float weights "
                f"({', '.join(FLOAT_FILE_DTYPES)})"
            )


def check_finite(named_tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Raises ValueError naming the tensors of ``source`` that hold NaN or inf (a model that would write black
    videos), or that are not floating point."""
    not_float, not_finite = [], []
    for name, t in named_tensors:
        if not t.is_floating_point():
            not_float.append(f"{name} ({str(t.dtype).replace('torch.', '')})")
        elif not bool(torch.isfinite(t).all()):
            not_finite.append(name)
    if not_float:
        raise ValueError(f"{source}: {len(not_float)} weight(s) are not floating point, e.g. {not_float[:3]}")
    if not_finite:
        raise ValueError(
            f"{source}: {len(not_finite)} weight(s) hold NaN or inf, e.g. {not_finite[:3]}; refusing a model "
            "that can only produce non-finite (black) videos"
        )


TRANSFORMER_KEYS = ("patch_size", "num_layers", "num_attention_heads", "attention_head_dim", "in_channels")


def check_transformer_config(config: dict[str, Any], path: str | Path, what: str = "transformer") -> None:
    """Raises ValueError unless ``config`` (read from ``path``) looks like a Wan transformer's ``config.json``
    (a VAE's or a text encoder's does not): every key of :data:`TRANSFORMER_KEYS`, with positive integers."""
    missing = [k for k in TRANSFORMER_KEYS if k not in config]
    if missing:
        kind = config.get("_class_name") or "another model"
        raise ValueError(
            f"{what} {str(path)!r} is not a Wan transformer's config ({kind}: no {', '.join(map(repr, missing))}); "
            "expected the config.json of a transformer folder (e.g. <model>/transformer)"
        )
    for key in ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels"):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} {str(path)!r}: {key} is {value!r}; expected a positive integer")


def weight_keys(files: list[Path]) -> tuple[set[str], list[str]]:
    """The tensor names in safetensors ``files`` (headers only) and the names found in more than one file."""
    from safetensors import safe_open

    seen: set[str] = set()
    duplicated: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in seen:
                    duplicated.append(key)
                seen.add(key)
    return seen, sorted(duplicated)


def _first(keys: Iterable[str], n: int = 4) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def check_weights_match(
    expected: set[str], files: list[Path], source: str, optional: Callable[[str], bool] = lambda key: False
) -> None:
    """Raises :class:`pipelines.errors.ModelError` naming the first few keys when the weight files hold
    weights the model's config does not have (``optional(key)``: kept for later, e.g. attention parameters),
    lack weights it has, or hold a weight twice (in two shards). diffusers only warns of missing and unexpected
    keys (and this project mutes those warnings), so a config saying fewer layers than the weights would load
    with layers silently dropped."""
    from .errors import ModelError

    found, duplicated = weight_keys(files)
    missing = expected - found
    unexpected = {k for k in found - expected if not optional(k)}
    problems = []
    if missing:
        problems.append(f"{len(missing)} weight(s) its config.json promises are missing: {_first(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} weight(s) are not in its config.json's model: {_first(unexpected)}")
    if duplicated:
        problems.append(f"{len(duplicated)} weight(s) are stored twice: {_first(duplicated)}")
    if problems:
        raise ModelError(
            f"{source}: the weights do not match the config: " + "; ".join(problems) + ". Expected the files "
            "save_pretrained wrote with this config.json (was the config edited, or the files mixed?)"
        )


def check_transformer_weights(folder: str | Path, config: dict[str, Any], extra: Callable[[str], bool]) -> None:
    """:func:`check_weights_match` for a Wan transformer folder: the expected names come from its config, built
    on the meta device (no memory, no weights read); ``extra(key)``: names the loader reads itself."""
    import inspect

    from diffusers import WanTransformer3DModel

    folder = Path(folder)
    accepted = inspect.signature(WanTransformer3DModel.__init__).parameters
    with torch.device("meta"):
        model = WanTransformer3DModel(**{k: v for k, v in config.items() if k in accepted})
    expected = set(model.state_dict())
    check_weights_match(expected, weight_files(folder), f"transformer {str(folder)!r}", extra)

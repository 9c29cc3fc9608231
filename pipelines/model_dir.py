"""What a model directory on disk must hold, what it says (:class:`ModelDir`), and checks of its files before
anything is loaded.

Used by every model source in :mod:`pipelines.loading`, the app and the recipe; also where the built-in model
lives (:data:`BUILTIN_DIR`) and what its folder holds. Reads only
config files and safetensors headers (and, in :func:`check_finite`, tensors already loaded).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mhla import PAPER_BLOCK_SHAPE

from .tiny_sizes import TINY_BLOCK_SHAPE, TINY_DEFAULTS, TINY_INFO, TINY_TRANSFORMER, WAN_DEFAULTS

WEIGHTS = ("diffusion_pytorch_model.safetensors", "model.safetensors")
# What a diffusers-format Wan directory must contain (a Wan2.2-A14B's transformer_2 and a Wan2.1-I2V's image
# encoder too, when its model_index.json names them: OPTIONAL_EXPECTED) (weights: a single file or a sharded index).
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


def missing_model_files(model_dir: str | Path, named: set[str] | None = None) -> list[str]:
    """The expected files of a diffusers-format Wan directory that ``model_dir`` lacks; ``named``: the parts its
    ``model_index.json`` names (:func:`named_parts`; read here when not given)."""
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
    # the optional parts the model index names (Wan2.2-A14B's second expert, Wan2.1-I2V's image encoder)
    if named is None:
        named = named_parts(_read_index_or_none(root / "model_index.json"))
    if "transformer_2" in named:
        folder = root / "transformer_2"
        if not (folder / "config.json").is_file() or not _has_weights(folder, WEIGHTS[0]):
            missing.append(OPTIONAL_EXPECTED["transformer_2"])
    if "image_encoder" in named:
        folder = root / "image_encoder"
        if not (folder / "config.json").is_file() or not _has_weights(folder, WEIGHTS[1]):
            missing.append(OPTIONAL_EXPECTED["image_encoder"])
    if "image_processor" in named and not (root / "image_processor" / "preprocessor_config.json").is_file():
        missing.append(OPTIONAL_EXPECTED["image_processor"])
    return missing


# the parts a model index may name besides the required ones, and their files
OPTIONAL_EXPECTED = {
    "transformer_2": "transformer_2/config.json + diffusion_pytorch_model.safetensors (or .safetensors.index.json)",
    "image_encoder": "image_encoder/config.json + model.safetensors (or model.safetensors.index.json)",
    "image_processor": "image_processor/preprocessor_config.json",
}
# the diffusers pipeline classes this product runs (model_index.json's "_class_name")
SUPPORTED_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
IMAGE_TO_VIDEO = "WanImageToVideoPipeline"


def _read_index_or_none(index_file: Path) -> dict[str, Any] | None:
    """``model_index.json`` as a dict; None when it is missing or unreadable (:func:`model_index` reports that)."""
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


def named_parts(index: Mapping[str, Any] | None) -> set[str]:
    """The components a ``model_index.json`` names with a class (``[library, class]``, not ``[null, null]``)."""
    if not index:
        return set()
    return {k for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[0] is not None}


@dataclass(frozen=True)
class ModelIndex:
    """What a model directory's ``model_index.json`` says about its architecture (read without loading):

    ``pipeline_class``: one of :data:`SUPPORTED_PIPELINES`; ``transformer_2``: a second expert (Wan2.2-A14B)
    switched to below ``boundary_ratio * 1000``; ``expand_timesteps``: per-token timesteps (Wan2.2-TI2V);
    ``image_encoder``: a CLIP image encoder and its processor (Wan2.1-I2V; Wan2.2-I2V has none)."""

    pipeline_class: str = "WanPipeline"
    transformer_2: bool = False
    boundary_ratio: float | None = None
    expand_timesteps: bool = False
    image_encoder: bool = False

    @property
    def image_to_video(self) -> bool:
        """The model generates from an image (an image is required)."""
        return self.pipeline_class == IMAGE_TO_VIDEO

    @property
    def takes_image(self) -> bool:
        """The model can start from an image: an image-to-video model, or Wan2.2-TI2V (``expand_timesteps``),
        whose image mode is diffusers' ``WanImageToVideoPipeline`` on the same parts."""
        return self.image_to_video or self.expand_timesteps

    def describe(self) -> str:
        parts = [self.pipeline_class]
        if self.transformer_2:
            parts.append(f"two experts, boundary_ratio {self.boundary_ratio}")
        if self.expand_timesteps:
            parts.append("expand_timesteps")
        if self.image_encoder:
            parts.append("CLIP image encoder")
        return ", ".join(parts)


def model_index(index: Mapping[str, Any], index_file: Path) -> ModelIndex:
    """The architecture a ``model_index.json`` (read, at ``index_file``) names; ValueError naming the class when it
    is not a pipeline this product runs, or a bad ``boundary_ratio`` (before anything loads)."""
    name = index.get("_class_name", "WanPipeline")
    if name not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"model {str(index_file.parent)!r} is a {name!r} (its model_index.json's _class_name); supported: "
            f"{', '.join(SUPPORTED_PIPELINES)} (Wan2.1 / Wan2.2 text-to-video, text-image-to-video and "
            "image-to-video)"
        )
    named = named_parts(index)
    ratio = index.get("boundary_ratio")
    if "transformer_2" in named and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1
    ):
        raise ValueError(
            f"{str(index_file)!r} names a transformer_2 with boundary_ratio {ratio!r}; expected a number in (0, 1) "
            "(the noise level below which the second expert denoises, e.g. 0.875)"
        )
    return ModelIndex(
        pipeline_class=name,
        transformer_2="transformer_2" in named,
        boundary_ratio=float(ratio) if "transformer_2" in named and ratio is not None else None,
        expand_timesteps=bool(index.get("expand_timesteps", False)),
        image_encoder="image_encoder" in named,
    )


def read_model_index(model_dir: str | Path) -> ModelIndex:
    """The architecture of a model directory from its ``model_index.json`` (:meth:`ModelDir.index`)."""
    return ModelDir(model_dir).index


def check_model_dir(model_dir: str | Path | ModelDir) -> Path:
    """Raises ``FileNotFoundError`` naming what is missing unless ``model_dir`` is a complete Wan model dir
    (``ValueError`` naming the class when its ``model_index.json`` names a pipeline this product does not run).
    A :class:`ModelDir` is checked once (:meth:`ModelDir.check`), its files read once."""
    folder = model_dir if isinstance(model_dir, ModelDir) else ModelDir(model_dir)
    return folder.check()


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
    missing = [k for k in TRANSFORMER_KEYS if config.get(k) is None]  # a VAE's config may say patch_size: null
    patch = config.get("patch_size")
    if patch is not None and not _is_patch(patch):  # Wan2.2's VAE has a patch_size too: one int, not three
        missing.insert(0, "patch_size")
    if missing:
        kind = config.get("_class_name") or "another model"
        if "autoencoder" in str(kind).lower() or "z_dim" in config:
            kind = f"{kind}, a VAE's config"
        needs = []
        if "patch_size" in missing:
            got = f"; it has {patch!r}" if patch is not None else ""
            needs.append(f"patch_size (the transformer's patch, three whole numbers such as [1, 2, 2]{got})")
        if {"num_attention_heads", "attention_head_dim"} & set(missing):
            needs.append("the attention config (num_attention_heads, attention_head_dim)")
        if "num_layers" in missing:
            needs.append("num_layers")
        if "in_channels" in missing:
            needs.append("in_channels")
        raise ValueError(
            f"{what} {str(path)!r} is not a Wan transformer's config ({kind}): it lacks {'; '.join(needs)}; "
            "expected the config.json of a transformer folder (e.g. <model>/transformer, not <model>/vae)"
        )
    for key in ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels"):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} {str(path)!r}: {key} is {value!r}; expected a positive integer")


def _is_patch(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    )


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
    """Raises :class:`common.errors.ModelError` naming the first few keys when the weight files hold
    weights the model's config does not have (``optional(key)``: kept for later, e.g. attention parameters),
    lack weights it has, or hold a weight twice (in two shards). diffusers only warns of missing and unexpected
    keys (and this project mutes those warnings), so a config saying fewer layers than the weights would load
    with layers silently dropped."""
    from common.errors import ModelError

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
    files = weight_files(folder)
    found = _layer_count(weight_keys(files)[0])
    said = config.get("num_layers")
    if found is not None and said != found:  # named as what it is, before the keys it makes missing or extra
        from common.errors import ModelError

        raise ModelError(
            f"transformer {str(folder)!r}: the number of layers differs: {said} in config.json (num_layers), "
            f"{found} in the weights (blocks.0 to blocks.{found - 1}); expected the config.json saved with "
            "these weights (was it edited, or the files mixed?)"
        )
    accepted = inspect.signature(WanTransformer3DModel.__init__).parameters
    with torch.device("meta"):
        model = WanTransformer3DModel(**{k: v for k, v in config.items() if k in accepted})
    expected = set(model.state_dict())
    check_weights_match(expected, files, f"transformer {str(folder)!r}", extra)


def _layer_count(keys: Iterable[str]) -> int | None:
    """The number of transformer layers weights named ``blocks.<i>.`` hold (the highest index + 1); None when
    no key names a layer."""
    indices = [int(k.split(".")[1]) for k in keys if k.startswith("blocks.") and k.split(".")[1].isdigit()]
    return max(indices) + 1 if indices else None


def vae_strides(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """A Wan VAE's strides ``(time, height, width)`` from its config (a loaded VAE's ``config`` or its
    ``config.json``): 4 x 8 x 8 for Wan2.1's, 4 x 16 x 16 for Wan2.2-TI2V's; Wan2.1's where the config is silent."""
    spatial = int(config.get("scale_factor_spatial") or 8)
    return (int(config.get("scale_factor_temporal") or 4), spatial, spatial)


# ------------------------------------------------------------------------------------------ the built-in model
# A small Wan2.1-architecture text-to-video model trained by this project. It ships in ``assets/builtin/`` as a
# complete diffusers-format Wan2.1 T2V directory (tokenizer, text encoder, VAE, scheduler, the softmax-attention
# transformer) plus one fine-tuned transformer per converted variant in ``assets/builtin/variants/<variant>/``,
# trained on the synthetic moving-shapes world of :mod:`world.synthetic` (docs/builtin-model.md): coloured shapes
# moving on plain or textured backgrounds, nothing else. ``builtin.json`` beside it records how it was made and
# the model's defaults and block shape, which :class:`ModelDir` reads like any other folder's files.

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "assets" / "builtin"
VARIANTS_SUBDIR = "variants"
# 17 frames at 128x160 -> 5x16x20 latent cells; the transformer's patch is (1, 1, 1), so 1,600 tokens.
BUILTIN_DEFAULTS = {
    "height": 128,
    "width": 160,
    "num_frames": 17,
    "num_inference_steps": 20,
    "guidance_scale": 4.0,
    "max_sequence_length": 32,
}
# target block shape in tokens for the default MHLA layout: 5x16x20 -> 2x4x5 blocks (M = 40, M*M = N)
BUILTIN_BLOCK_SHAPE = (2, 4, 4)
# the name that asks for the random-weight tiny model (tests, smoke runs)
TINY_RANDOM = "tiny-random"


def builtin_available(root: str | Path = BUILTIN_DIR) -> bool:
    """Whether the trained built-in model is present (its base directory and ``builtin.json``)."""
    root = Path(root)
    return (root / "builtin.json").is_file() and not ModelDir(root).missing_files


def builtin_info(root: str | Path = BUILTIN_DIR) -> dict[str, Any]:
    """Contents of ``builtin.json``: how the built-in model was trained."""
    return json.loads((Path(root) / "builtin.json").read_text())


def builtin_examples(root: str | Path = BUILTIN_DIR) -> list[str]:
    """The example prompts ``builtin.json`` records (chosen from an evaluation by
    ``python -m factory.examples``); [] when it has none."""
    path = Path(root) / "builtin.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text()).get("example_prompts")
    prompts = record.get("prompts") if isinstance(record, dict) else None
    return [p for p in prompts if isinstance(p, str) and p.strip()] if isinstance(prompts, list) else []


def builtin_variant_dirs(root: str | Path = BUILTIN_DIR) -> dict[str, Path]:
    """Fine-tuned transformer folders of the converted variants, by variant name."""
    folder = Path(root) / VARIANTS_SUBDIR
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "config.json").is_file()}


class ModelDir:
    """A model as its files describe it, read without loading a weight: each file once, when first asked.

    ``model_dir``: a local diffusers Wan directory; ``"tiny-random"`` (the tiny random-weight model, no folder);
    ``None``: the built-in model (the tiny random one where ``assets/builtin`` is absent). What a directory
    does not say is Wan2.1's (480x832, 81 frames, 50 steps, the paper's 3x10x10 blocks, patch 1x2x2, VAE 4x8x8,
    30 layers, 12 heads); the tiny random model's own values for ``"tiny-random"`` and a folder written by
    ``python -m pipelines.tiny``. A transformer folder (``transformer_dir``: a fine-tuned one) wins over the
    model's own for the patch, the layers and the heads."""

    def __init__(self, model_dir: str | Path | None = None):
        if model_dir is None:
            model_dir = BUILTIN_DIR if builtin_available() else TINY_RANDOM
        self.tiny_random = str(model_dir) == TINY_RANDOM
        self.path: Path | None = None if self.tiny_random else Path(model_dir)
        self._configs: dict[Path, dict[str, Any] | None] = {}
        self._checked: Path | None = None

    def __repr__(self) -> str:
        return f"ModelDir({'tiny-random' if self.path is None else str(self.path)!r})"

    @cached_property
    def index_json(self) -> dict[str, Any]:
        """``model_index.json`` as read, once per ``ModelDir`` ({} for the tiny random model); ValueError naming
        a file that is not a JSON object."""
        return {} if self.path is None else read_json(self.path / "model_index.json", "model_index.json")

    @cached_property
    def index(self) -> ModelIndex:
        """The architecture ``model_index.json`` names (Wan2.1 text-to-video for the tiny random model);
        ValueError for a pipeline class this product does not run."""
        return ModelIndex() if self.path is None else model_index(self.index_json, self.path / "model_index.json")

    @cached_property
    def missing_files(self) -> list[str]:
        """The expected files the folder lacks (:func:`missing_model_files`; [] for the tiny random model)."""
        if self.path is None:
            return []
        try:
            named = named_parts(self.index_json) if (self.path / "model_index.json").is_file() else set()
        except (OSError, ValueError):  # unreadable: check() names that through index
            named = set()
        return missing_model_files(self.path, named)

    def check(self) -> Path:
        """The folder, once it is known to be a complete Wan model folder of a pipeline this product runs; raises
        ``FileNotFoundError`` naming what is missing (``ValueError`` naming an unsupported pipeline class first).
        Checked once: later calls return at once."""
        if self._checked is not None:
            return self._checked
        root = self.path
        if root is None:
            raise FileNotFoundError("the tiny random model has no folder to check")
        if root.is_file():
            raise FileNotFoundError(
                f"model directory {str(root)!r} is a file; expected a local diffusers-format Wan (2.1 or 2.2) "
                "directory (the folder holding model_index.json, transformer/, vae/, ...)"
            )
        if not root.is_dir():
            raise FileNotFoundError(
                f"model directory {str(root)!r} does not exist; expected a local diffusers-format Wan (2.1 or 2.2) "
                f"directory ({', '.join(EXPECTED.values())}), or no --model for the built-in model"
            )
        if (root / "model_index.json").is_file():
            _ = self.index  # a pipeline this product does not run is named first, not by its missing files
        if self.missing_files:
            raise FileNotFoundError(
                f"model directory {str(root)!r} is incomplete (nothing is downloaded); missing: "
                + "; ".join(self.missing_files)
            )
        self._checked = root
        return root

    @cached_property
    def random_weights(self) -> bool:
        """The tiny random-weight model, or a folder written by ``python -m pipelines.tiny``: videos are noise."""
        return self.path is None or (self.path / TINY_INFO).is_file()

    def source(self, seed: int = 0) -> str:
        """The name :func:`pipelines.loading.load_components` gives the model (``WanComponents.source``);
        ``seed``: the tiny random model's."""
        if self.path is None:
            return f"tiny random-weight Wan2.1 (seed {seed}, RANDOM weights)"
        if (self.path / "builtin.json").is_file():
            return f"built-in model ({self.path.name}: trained on synthetic moving shapes)"
        if self.random_weights:
            architecture = read_json(self.path / TINY_INFO, "tiny model description").get("architecture", "Wan")
            return f"tiny random-weight {architecture} {str(self.path)!r} (RANDOM weights)"
        return str(self.path)

    @cached_property
    def _settings(self) -> tuple[dict[str, Any], tuple[int, int, int], dict[str, Path]]:
        if self.random_weights:
            return dict(TINY_DEFAULTS), TINY_BLOCK_SHAPE, {}
        assert self.path is not None
        info = self.path / "builtin.json"
        if info.is_file():  # the built-in model's layout: its defaults, block shape and variants/
            meta = read_json(info, "model description")
            defaults, block_shape = require_key(meta, "defaults", info), require_key(meta, "block_shape", info)
            return dict(defaults), tuple(block_shape), builtin_variant_dirs(self.path)
        return dict(WAN_DEFAULTS), PAPER_BLOCK_SHAPE, {}

    @property
    def defaults(self) -> dict[str, Any]:
        """Generation defaults: height, width, num_frames, num_inference_steps, guidance_scale (a copy)."""
        return dict(self._settings[0])

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """The target block shape in tokens of the default MHLA layout."""
        return self._settings[1]

    @property
    def variant_dirs(self) -> dict[str, Path]:
        """The fine-tuned transformer folders the model ships, by variant (the built-in model's)."""
        return dict(self._settings[2])

    @cached_property
    def vae_stride(self) -> tuple[int, int, int]:
        """The VAE's strides ``(time, height, width)`` from ``vae/config.json``."""
        config_file = None if self.path is None else self.path / "vae" / "config.json"
        config = read_json(config_file, "VAE config") if config_file is not None and config_file.is_file() else {}
        return vae_strides(config)

    def transformer_config(self, folder: str | Path | None = None, part: str = "transformer") -> dict[str, Any] | None:
        """The ``config.json`` of a transformer folder (``folder``: a fine-tuned one), else of the model's ``part``
        (``transformer`` or ``transformer_2``); None where there is none. Each file is read once."""
        where = Path(folder) if folder is not None else None if self.path is None else self.path / part
        if where is None:
            return None
        if where not in self._configs:
            self._configs[where] = saved_transformer_config(where)
        return self._configs[where]

    def files(self, expert: str | None = None, seed: int = 0) -> ModelFiles:
        """Everything :func:`pipelines.loading.load_components` needs of the model, read and checked once
        (:meth:`check` first: a folder that is incomplete, or of a pipeline this product does not run, is named
        before anything loads): the transformer configs of the parts to load (``expert`` alone, else every one
        the index names), the image encoder's entries, the name (``seed``: the tiny random model's), defaults,
        block shape and fine-tuned variants."""
        if self.path is None:
            if expert == "transformer_2":
                raise ValueError("expert 'transformer_2': the tiny random model has one transformer")
            return ModelFiles(None, ModelIndex(), {}, {}, self.source(seed), True, *self._settings)
        root = self.check()  # once per ModelDir: a caller that checked it (the CLI) reads nothing again
        index = self.index
        if expert == "transformer_2" and not index.transformer_2:
            raise ValueError(
                f"expert 'transformer_2': {str(root)!r} has one transformer (its model_index.json names no "
                "transformer_2)"
            )
        parts = [expert] if expert else ["transformer", *(["transformer_2"] if index.transformer_2 else [])]
        configs = {part: self.transformer_config(part=part) for part in parts}
        image = {p: self.index_json.get(p) for p in ("image_encoder", "image_processor")} if index.image_encoder else {}
        return ModelFiles(root, index, configs, image, self.source(), self.random_weights, *self._settings)

    def shape(self, transformer_dir: str | Path | None = None, part: str = "transformer") -> TransformerShape:
        """The transformer's patch, layers and heads: ``transformer_dir``'s (a fine-tuned one) where it has a
        config, else the model's ``part``'s."""
        config = self.transformer_config(transformer_dir) if transformer_dir is not None else None
        where = Path(transformer_dir) if config is not None and transformer_dir is not None else None
        if config is None and self.path is not None:
            config, where = self.transformer_config(part=part), self.path / part
        if config is None or where is None:
            config, where = TINY_TRANSFORMER if self.path is None else WAN_TRANSFORMER, Path("-")
        file = where / "config.json"
        t, h, w = (int(p) for p in require_key(config, "patch_size", file))
        return TransformerShape(
            patch=(t, h, w),
            num_layers=int(require_key(config, "num_layers", file)),
            num_heads=int(require_key(config, "num_attention_heads", file)),
        )


@dataclass(frozen=True)
class ModelFiles:
    """A model as :func:`pipelines.loading.load_components` loads it, read and checked (:meth:`ModelDir.files`):
    ``root`` (None: the tiny random model, built rather than read), ``index``, the ``configs`` of the transformer
    parts to load by part (``transformer``, ``transformer_2``), ``image_parts`` (``model_index.json``'s
    ``image_encoder`` / ``image_processor`` entries; empty without an image encoder), ``source`` (its name),
    ``random_weights``, ``defaults``, ``block_shape`` and ``variant_dirs`` (:class:`ModelDir`'s)."""

    root: Path | None
    index: ModelIndex
    configs: dict[str, dict[str, Any] | None]
    image_parts: dict[str, Any]
    source: str
    random_weights: bool
    defaults: dict[str, Any]
    block_shape: tuple[int, int, int]
    variant_dirs: dict[str, Path]


@dataclass(frozen=True)
class TransformerShape:
    """What a transformer's config says of its shape: ``patch`` ``(t, h, w)``, ``num_layers``, ``num_heads``."""

    patch: tuple[int, int, int]
    num_layers: int
    num_heads: int


# what a model folder whose transformer has no config is taken as: Wan2.1-T2V-1.3B's
WAN_TRANSFORMER = {"patch_size": (1, 2, 2), "num_layers": 30, "num_attention_heads": 12}


def saved_transformer_config(folder: str | Path | None) -> dict[str, Any] | None:
    """A transformer folder's ``config.json`` as a dict (None if there is none), without loading weights."""
    config = Path(folder) / "config.json" if folder is not None else None
    return read_json(config, "transformer config") if config is not None and config.is_file() else None

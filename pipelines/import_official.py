"""Importing the MHLA authors' published Wan2.1 checkpoints (full MHLA and hybrid) as a model of this product.

    python -m pipelines.import_official --checkpoint wan_mhla_hybrid.safetensors \\
        --base /models/Wan2.1-T2V-1.3B-Diffusers --out /models/Wan2.1-T2V-1.3B-MHLA-hybrid [--hybrid]

``--out`` becomes a complete diffusers-format Wan2.1 directory: ``transformer/`` holds the imported weights
(a ``mhla`` or ``mhla-hybrid`` model, see :mod:`pipelines.convert`), and ``scheduler/``, ``tokenizer/``,
``text_encoder/``, ``vae/`` come from ``--base`` (symlinked by default, copied with ``--components copy``), and
``model_index.json`` is the base's with the transformer entry naming
:class:`pipelines.model.MHLAWanTransformer3DModel`. ``python -m pipelines.cli --model OUT``,
``pipelines.load_components(OUT)`` and diffusers' own ``WanPipeline.from_pretrained(OUT)`` load it like any other
model; ``OUT/transformer`` alone loads with ``MHLAWanTransformer3DModel.from_pretrained`` (or
``pipelines.load_transformer``). ``OUT/import_official.json`` records where it came from.

What the published checkpoints are (PAPER_NOTES "The authors' code"):

- Original Wan key names (``blocks.N.self_attn.q``, ``cross_attn``, ``ffn.0``, ``modulation``, ``head.head``,
  ...), mapped to diffusers' names with diffusers' own single-file mapping
  (:func:`diffusers.loaders.single_file_utils.convert_wan_transformer_to_diffusers`).
- Per MHLA layer two extra keys: ``blocks.N.self_attn.block_attn.conv.weight``, an ``M x M x 1 x 1`` 1x1
  convolution over blocks (the mixing matrix), and ``blocks.N.self_attn.g_norm.weight``, the per-head output
  RMSNorm weight (``head_dim`` values, shared across heads). A layer without them is softmax attention.
- Full MHLA converts every layer; the hybrid converts 1, 2, 4, 5, ..., 28, 29 and keeps 0, 3, ..., 27 softmax.
- ``M = 150``: a 3x5x10 block layout over their only token grid, 21x30x50 (81 frames at 480x800), i.e.
  blocks of 7x6x5 tokens. The layout is not stored; :func:`infer_blocks` recovers it from ``M`` and the grid.

Their forward, which the imported model reproduces (:data:`OFFICIAL_OPTIONS`): feature map ``relu(x) + 1e-6``
after Wan's q/k RMSNorm; RoPE on ``phi(q), phi(k)``; no normalizer; per-head RMSNorm of the output; no gate;
and the mixing matrix used exactly as stored (``constrain_mixing=False``): their matrix is never clamped
or renormalised, and the released values are partly negative. The conv maps block summaries as
``S~_i = sum_j W[i, j] S_j`` (a 1x1 ``Conv2d`` over the block axis: output channel ``i``, input channel
``j``), which is :func:`mhla.mix_summaries`' ``m_ij`` orientation, so ``W[:, :, 0, 0]`` is stored as our
mixing matrix unchanged, not transposed.

Not verifiable without the real files (their video model code is not at hand either): that blocks are
numbered in (frame, height, width) row-major order, as :class:`mhla.BlockLayout` numbers them (a different
order would permute the mixing matrix); the epsilon of their output RMSNorm (1e-6 here; negligible against
un-normalised linear-attention outputs); and that the files hold no keys beyond the ones above.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.errors import run_cli
from common.outputs import resolve_output_folder, write_text_atomic

from .attention import HYBRID, MHLA, AttentionOptions, hybrid_layers, variant_spec
from .loading import save_transformer
from .model_dir import check_finite, check_model_dir, check_weight_files, read_json

if TYPE_CHECKING:
    from .model import MHLAWanTransformer3DModel

# The only token grid the authors trained and run at: 81 frames at 480x800 -> 21x30x50 latent tokens.
OFFICIAL_GRID = (21, 30, 50)
# Layouts known from the published checkpoints, by (M, grid); infer_blocks() must agree with them.
KNOWN_LAYOUTS = {(150, OFFICIAL_GRID): (3, 5, 10)}
MIXING_KEY = "self_attn.block_attn.conv.weight"
NORM_KEY = "self_attn.g_norm.weight"
_MHLA_KEY = re.compile(r"^blocks\.(\d+)\.(self_attn\.block_attn\.conv\.weight|self_attn\.g_norm\.weight)$")
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
# Prefixes in front of every key: training wrappers (DDP, torch.compile) and ComfyUI-style single files.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.diffusion_model.")
# Where a .pt/.pth training checkpoint may keep the model's state dict, in order of preference.
STATE_DICT_KEYS = ("state_dict", "model", "module", "state_dict_ema", "ema")
CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
COMPONENTS = ("scheduler", "tokenizer", "text_encoder", "vae")
RECORD = "import_official.json"

# Their forward (module docstring). Layout ("blocks") is added per checkpoint.
OFFICIAL_OPTIONS: dict[str, Any] = dict(
    feature_map="relu",
    normalize=False,
    output_norm="rms_head",
    output_gate=False,
    rope=True,
    eps=1e-6,
    constrain_mixing=False,
    mixing_init="locality_columns",  # their init rule; only used if a layer were ever added afresh
)


def _grid_text(grid: Iterable[int]) -> str:
    return "x".join(str(int(x)) for x in grid)


# --------------------------------------------------------------------------------------------- reading files


def _flat_tensors(obj: Any, path: Path, state_dict_key: str | None) -> tuple[dict[str, torch.Tensor], str | None]:
    """The tensor dict inside a loaded .pt object, and the key it was found under (None: top level)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{str(path)!r} holds a {type(obj).__name__}, expected a dict of tensors (a state dict)")
    if state_dict_key is not None:
        if not isinstance(obj.get(state_dict_key), dict):
            raise ValueError(
                f"{str(path)!r} has no state dict under {state_dict_key!r}; its top-level keys are {sorted(obj)[:12]}"
            )
        obj, found = obj[state_dict_key], state_dict_key
    elif any(isinstance(v, torch.Tensor) for v in obj.values()):
        found = None
    else:
        found = next((k for k in STATE_DICT_KEYS if isinstance(obj.get(k), dict)), None)
        if found is None:
            raise ValueError(
                f"{str(path)!r} holds no tensors at its top level and none of {STATE_DICT_KEYS}; "
                f"its top-level keys are {sorted(map(str, obj))[:12]} (pass --state-dict-key)"
            )
        obj = obj[found]
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"{str(path)!r} has no tensors under {found or 'its top level'!r}")
    return tensors, found


def _is_pickle(path: Path) -> bool:
    """Whether ``path`` is torch.save's archive or parses as a pickle up to its STOP opcode (parsed with
    pickletools, never executed)."""
    import pickletools

    if zipfile.is_zipfile(path):  # torch.save's format: an intact archive around the pickle
        return True
    try:
        with path.open("rb") as f:
            for _ in pickletools.genops(f):
                pass
        return True
    except Exception:  # noqa: BLE001 - any parse failure means: not a pickle
        return False


def load_checkpoint_tensors(
    path: str | Path, state_dict_key: str | None = None
) -> tuple[dict[str, torch.Tensor], str | None]:
    """Reads a checkpoint: ``.safetensors``, or ``.pt/.pth/.bin/.ckpt`` through ``torch.load(weights_only=True)``.

    Returns ``(tensors, key)``: a flat ``{name: tensor}`` and where in a training checkpoint it was found.
    A pickle that needs anything beyond tensors and plain containers is refused, never unpickled.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix not in CHECKPOINT_SUFFIXES:
        raise ValueError(f"checkpoint {str(path)!r}: expected one of {', '.join(CHECKPOINT_SUFFIXES)}, got {suffix!r}")
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        if state_dict_key is not None:
            raise ValueError("--state-dict-key applies to .pt/.pth checkpoints only; a .safetensors file is flat")
        check_weight_files([path])  # empty, truncated, not safetensors, or integer tensors: named
        tensors = load_file(str(path))
        check_finite(tensors.items(), f"checkpoint {str(path)!r}")
        return tensors, None
    try:
        # mmap keeps a multi-GB zip-format checkpoint on disk until its tensors are used
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        if not _is_pickle(path):  # a damaged or foreign file, not a pickle that asks for code
            raise ValueError(
                f"checkpoint {str(path)!r} ({path.stat().st_size} bytes) cannot be read as a PyTorch checkpoint "
                "(not a valid pickle); it may be truncated or another format"
            ) from None
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"it contains {found.group(1)}" if found else str(e).strip().splitlines()[0]
        raise ValueError(
            f"refusing to load {str(path)!r}: it needs arbitrary unpickling ({what}, not only tensors and plain "
            "containers), which can run code. Only weights_only checkpoints are read; convert it to .safetensors "
            "where you trust its source (safetensors.torch.save_file(state_dict, 'x.safetensors'))"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(
            f"checkpoint {str(path)!r} ({path.stat().st_size} bytes) cannot be read as a PyTorch checkpoint "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}); "
            "it may be empty, truncated or another format"
        ) from None
    tensors, key = _flat_tensors(obj, path, state_dict_key)
    check_finite(tensors.items(), f"checkpoint {str(path)!r}")
    return tensors, key


# --------------------------------------------------------------------------------------------- key mapping


def _strip_wrappers(names: Iterable[str]) -> dict[str, str]:
    """``{clean name: stored name}`` with wrapper prefixes (:data:`_WRAPPER_PREFIXES`) removed. Two stored
    names for one weight (``module.x`` beside ``x``) raise :class:`common.errors.ModelError` naming the first
    few: which copy is the trained one cannot be known."""
    from common.errors import ModelError

    out: dict[str, str] = {}
    twice: list[str] = []
    for name in names:
        clean = name
        changed = True
        while changed:
            changed = False
            for p in _WRAPPER_PREFIXES:
                if clean.startswith(p):
                    clean, changed = clean[len(p) :], True
        if clean in out:
            twice.append(f"{out[clean]!r} and {name!r}")
        out[clean] = name
    if twice:
        raise ModelError(
            f"the checkpoint stores {len(twice)} weight(s) twice under different names, e.g. {'; '.join(twice[:3])}; "
            "expected one copy of each (save only the unwrapped model's state_dict)"
        )
    return out


def diffusers_names(original_names: Iterable[str]) -> dict[str, str]:
    """``{original Wan name: diffusers name}`` through diffusers' single-file Wan mapping.

    The mapping renames in place; it runs on a dict of names (not tensors), so nothing is loaded.
    """
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    names = list(original_names)
    converted = convert_wan_transformer_to_diffusers({n: n for n in names})
    mapped = {old: new for new, old in converted.items()}
    lost = [n for n in names if n not in mapped]
    if lost:  # the mapping split or dropped a key (face adapter, motion encoder: not Wan2.1 T2V)
        raise ValueError(f"keys {lost[:4]} are not Wan2.1 text-to-video transformer weights")
    return mapped


def mhla_param_names(layer: int) -> tuple[str, str]:
    """Our names of a layer's mixing matrix and output RMSNorm weight (see :class:`LinearSelfAttention`)."""
    return f"blocks.{layer}.attn1.mhla.mhla.mixing.weight", f"blocks.{layer}.attn1.mhla.norm_out.weight"


# --------------------------------------------------------------------------------------------- layouts


def infer_blocks(num_blocks: int, grid: Iterable[int] = OFFICIAL_GRID) -> tuple[int, int, int]:
    """The block layout ``(bf, bh, bw)`` of an ``M x M`` mixing matrix trained on ``grid``.

    Their code only splits grids evenly, so candidates are ``bf * bh * bw == M`` with each count dividing
    its axis. Among them the one with the most cube-like blocks in tokens wins (smallest ratio of longest
    to shortest block side; ties go to longer blocks along frames, then height). 150 over 21x30x50 gives
    3x5x10 (7x6x5-token blocks), the published layout. Raises ``ValueError`` naming what would fit.
    """
    grid = tuple(int(x) for x in grid)
    candidates = []
    for bf in range(1, grid[0] + 1):
        if grid[0] % bf or num_blocks % bf:
            continue
        for bh in range(1, grid[1] + 1):
            if grid[1] % bh or (num_blocks // bf) % bh:
                continue
            bw = num_blocks // (bf * bh)
            if bw <= grid[2] and grid[2] % bw == 0:
                shape = (grid[0] // bf, grid[1] // bh, grid[2] // bw)
                candidates.append((max(shape) / min(shape), tuple(-s for s in shape), (bf, bh, bw)))
    if not candidates:
        raise ValueError(
            f"a {num_blocks}x{num_blocks} mixing matrix (M={num_blocks}) fits no block layout of the "
            f"{_grid_text(grid)} token grid: expected M = bf*bh*bw with bf dividing {grid[0]}, bh dividing "
            f"{grid[1]} and bw dividing {grid[2]} (the published checkpoints have M=150 = 3x5x10 over 21x30x50); "
            "pass the grid it was trained on with --grid"
        )
    return min(candidates)[2]


# --------------------------------------------------------------------------------------------- planning


@dataclass
class ImportPlan:
    """What a checkpoint holds and how it maps onto a diffusers Wan transformer; built from names and shapes only.

    ``names``: ``{our parameter name: name in the checkpoint}``. ``reshape``: our names whose tensor is the
    ``(M, M, 1, 1)`` conv weight stored as ``(M, M)``.
    """

    variant: str
    mhla_layers: list[int]
    num_layers: int
    blocks: tuple[int, int, int]
    blocks_source: str
    grid: tuple[int, int, int]
    names: dict[str, str] = field(default_factory=dict)
    reshape: set[str] = field(default_factory=set)

    @property
    def options(self) -> AttentionOptions:
        return AttentionOptions(blocks=self.blocks, **OFFICIAL_OPTIONS)


def _expected_shapes(transformer_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Wan transformer of this config, built on the meta device (no memory, no init)."""
    from diffusers import WanTransformer3DModel

    config = {k: v for k, v in transformer_config.items() if not k.startswith("_") and k != "self_attention"}
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _layer_list(layers: Iterable[int]) -> str:
    layers = list(layers)
    return (
        str(layers) if len(layers) <= 12 else f"[{', '.join(map(str, layers[:8]))}, ..., {layers[-1]}] ({len(layers)})"
    )


def plan_import(
    shapes: dict[str, tuple[int, ...]],
    transformer_config: dict[str, Any],
    grid: str | Sequence[int] = OFFICIAL_GRID,
    hybrid: bool | None = None,
    blocks: str | Sequence[int] | None = None,
) -> ImportPlan:
    """Checks a checkpoint's names and shapes against a Wan transformer config; raises before any heavy work.

    Args:
        shapes: ``{name in the checkpoint: shape}``.
        transformer_config: the base model's ``transformer/config.json`` (layers, heads, widths).
        grid: the token grid the checkpoint was trained on (their only one: 21x30x50).
        hybrid: True: it must be the hybrid (MHLA in 1, 2, 4, 5, ...); False: full MHLA; None: either.
        blocks: the block layout, when it should not be inferred from ``M`` and ``grid``.
    """
    import mhla

    expected = _expected_shapes(transformer_config)
    num_layers = int(transformer_config["num_layers"])
    heads, head_dim = int(transformer_config["num_attention_heads"]), int(transformer_config["attention_head_dim"])
    clean = _strip_wrappers(shapes)

    # MHLA keys, by layer; everything else goes through diffusers' mapping
    mhla_keys: dict[int, dict[str, str]] = {}
    rest = []
    for name in clean:
        m = _MHLA_KEY.match(name)
        if m:
            mhla_keys.setdefault(int(m.group(1)), {})[m.group(2)] = name
        else:
            rest.append(name)
    mapped = diffusers_names(rest)

    # layers: every one the base config has, no others
    present = {int(m.group(1)) for n in mapped.values() if (m := _BLOCK_KEY.match(n))}
    missing_layers = sorted(set(range(num_layers)) - present)
    extra_layers = sorted(present - set(range(num_layers)))
    if missing_layers or extra_layers:
        what = []
        if missing_layers:
            what.append(f"lacks layers {_layer_list(missing_layers)}")
        if extra_layers:
            what.append(f"has layers {_layer_list(extra_layers)} beyond them")
        raise ValueError(
            f"the checkpoint {' and '.join(what)}: expected blocks.0 ... blocks.{num_layers - 1} "
            f"(the base transformer config has num_layers={num_layers})"
        )

    # which layers are MHLA, and does that match a published layout
    for layer, keys in sorted(mhla_keys.items()):
        if not 0 <= layer < num_layers:
            raise ValueError(f"MHLA keys for layer {layer}, but the model has layers 0 ... {num_layers - 1}")
        for key in (MIXING_KEY, NORM_KEY):
            if key not in keys:
                raise ValueError(
                    f"layer {layer} has MHLA keys but lacks blocks.{layer}.{key}; expected both "
                    f"blocks.N.{MIXING_KEY} and blocks.N.{NORM_KEY} in every MHLA layer"
                )
    layers = sorted(mhla_keys)
    full, half = list(range(num_layers)), hybrid_layers(num_layers)
    if layers == full:
        variant = MHLA
    elif layers == half:
        variant = HYBRID
    else:
        found = _layer_list(layers) if layers else "no layer"
        raise ValueError(
            f"the checkpoint has MHLA keys (blocks.N.{MIXING_KEY}) in {found}, which matches neither published "
            f"layout: expected them in all {num_layers} layers (full MHLA) or in layers {_layer_list(half)} "
            "(hybrid: every layer but 0, 3, 6, ...)"
        )
    if hybrid is True and variant != HYBRID:
        raise ValueError(f"--hybrid was given, but the checkpoint is full MHLA (MHLA keys in all {num_layers} layers)")
    if hybrid is False and variant != MHLA:
        raise ValueError(
            f"a full MHLA checkpoint was expected, but it is the hybrid (MHLA keys in layers {_layer_list(layers)})"
        )

    # mixing matrices and output norms
    sizes: dict[int, list[int]] = {}
    for layer in layers:
        conv = tuple(shapes[clean[mhla_keys[layer][MIXING_KEY]]])
        if not (len(conv) in (2, 4) and conv[0] == conv[1] and conv[2:] in ((), (1, 1))):
            raise ValueError(
                f"blocks.{layer}.{MIXING_KEY} has shape {conv}, expected (M, M, 1, 1): a 1x1 conv over M blocks"
            )
        sizes.setdefault(conv[0], []).append(layer)
        norm_shape = tuple(shapes[clean[mhla_keys[layer][NORM_KEY]]])
        if norm_shape != (head_dim,):
            raise ValueError(
                f"blocks.{layer}.{NORM_KEY} has shape {norm_shape}, expected ({head_dim},): one RMSNorm "
                f"weight per head channel (attention_head_dim={head_dim}), shared by the {heads} heads"
            )
    if len(sizes) > 1:
        detail = "; ".join(f"M={m} in layers {_layer_list(v)}" for m, v in sorted(sizes.items()))
        raise ValueError(f"the MHLA layers have mixing matrices of different sizes ({detail}); expected one M for all")
    num_blocks = next(iter(sizes))
    grid = mhla.parse_blocks(grid)
    if blocks is None:
        blocks = infer_blocks(num_blocks, grid)
        source = f"inferred from M={num_blocks} over the {_grid_text(grid)} token grid"
    else:
        blocks = mhla.parse_blocks(blocks)
        if math.prod(blocks) != num_blocks:
            raise ValueError(
                f"--blocks {_grid_text(blocks)} has {math.prod(blocks)} blocks, but the checkpoint's mixing "
                f"matrices are {num_blocks}x{num_blocks} (M={num_blocks})"
            )
        mhla.BlockLayout(grid, blocks)  # raises if it does not fit the grid
        source = "given with --blocks"

    # everything else must be exactly the base config's transformer
    names = {mapped[n]: clean[n] for n in rest}
    missing = sorted(set(expected) - set(names))
    unexpected = sorted(set(names) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} weights of the base transformer, e.g. {missing[:4]}")
        if unexpected:
            back = [names[k] for k in unexpected]
            parts.append(f"has {len(unexpected)} keys a Wan2.1 transformer does not, e.g. {back[:4]}")
        raise ValueError(
            "the checkpoint " + " and ".join(parts) + "; expected original Wan2.1 key names (blocks.N.self_attn.q, "
            f"cross_attn, ffn.0, modulation, head.head, ...) plus blocks.N.{MIXING_KEY} and blocks.N.{NORM_KEY}"
        )
    wrong = [(k, tuple(shapes[names[k]]), expected[k]) for k in sorted(names) if tuple(shapes[names[k]]) != expected[k]]
    if wrong:
        k, got, want = wrong[0]
        raise ValueError(
            f"{len(wrong)} weights do not fit the base transformer config (a checkpoint of another model size?), "
            f"e.g. {names[k]!r} is {got}, expected {want}"
        )

    reshape = set()
    for layer in layers:
        mix, norm = mhla_param_names(layer)
        names[mix], names[norm] = clean[mhla_keys[layer][MIXING_KEY]], clean[mhla_keys[layer][NORM_KEY]]
        reshape.add(mix)
    return ImportPlan(variant, layers, num_layers, blocks, source, grid, names, reshape)


# --------------------------------------------------------------------------------------------- import


def build_transformer(
    plan: ImportPlan, transformer_config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> MHLAWanTransformer3DModel:
    """A float32 Wan transformer of ``transformer_config`` converted to ``plan.variant`` in the compatibility mode,
    holding ``tensors`` (checkpoint names); every parameter is checked to be loaded."""
    from .model import MHLAWanTransformer3DModel

    config = {k: v for k, v in transformer_config.items() if not k.startswith("_") and k != "self_attention"}
    model = MHLAWanTransformer3DModel.from_config(config).eval()
    layers = plan.mhla_layers if variant_spec(plan.variant).layers else None
    model.convert(plan.variant, layers, plan.options)
    state = {}
    for ours, theirs in plan.names.items():
        t = tensors[theirs]
        state[ours] = t.reshape(t.shape[0], t.shape[1]) if ours in plan.reshape else t
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:  # plan_import checked this; keep the promise explicit
        raise ValueError(f"import left {result.missing_keys[:4]} unset and {result.unexpected_keys[:4]} unused")
    return model


def _remove_contents(folder: Path, remove_dir: bool) -> None:
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    if remove_dir:
        folder.rmdir()


def _check_out(out: Path, base: Path) -> None:
    if out.resolve() == base.resolve():
        raise ValueError(f"--out {str(out)!r} is the --base directory; expected a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} already exists and is not empty; expected a new or empty directory")


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def import_official(
    checkpoint: str | Path,
    base: str | Path,
    out: str | Path,
    hybrid: bool | None = None,
    grid: str | Sequence[int] = OFFICIAL_GRID,
    blocks: str | Sequence[int] | None = None,
    components: str = "link",
    state_dict_key: str | None = None,
) -> Path:
    """Imports a published MHLA Wan2.1 checkpoint into a new model directory ``out`` (see the module docstring).

    Args:
        checkpoint: ``.safetensors`` or ``.pt/.pth`` (read with ``weights_only=True``).
        base: a local diffusers-format Wan2.1 T2V directory of the same size (1.3B): its transformer config,
            scheduler, tokenizer, text encoder and VAE are used.
        out: a new (or empty) directory; becomes a full model directory.
        hybrid, grid, blocks: as :func:`plan_import`.
        components: ``"link"`` (symlink base's scheduler, tokenizer, text_encoder, vae) or ``"copy"``.
        state_dict_key: where a .pt training checkpoint keeps the weights (default: found automatically).
    Returns ``out``.
    """
    checkpoint, base, out = Path(checkpoint), Path(base), Path(out)
    if components not in ("link", "copy"):
        raise ValueError(f"components must be 'link' or 'copy', got {components!r}")
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} does not exist")
    base = check_model_dir(base)
    # written where a symbolic link leads (a link to a folder not made yet included: it is made), checked first
    target = resolve_output_folder(out)
    _check_out(target, base)
    transformer_config = json.loads((base / "transformer" / "config.json").read_text())

    if checkpoint.suffix.lower() == ".safetensors":  # names and shapes without reading the tensors
        from safetensors import safe_open

        check_weight_files([checkpoint])
        with safe_open(str(checkpoint), framework="pt", device="cpu") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        plan = plan_import(shapes, transformer_config, grid, hybrid, blocks)
        tensors, found = load_checkpoint_tensors(checkpoint, state_dict_key)
    else:
        tensors, found = load_checkpoint_tensors(checkpoint, state_dict_key)
        plan = plan_import({k: tuple(v.shape) for k, v in tensors.items()}, transformer_config, grid, hybrid, blocks)

    model = build_transformer(plan, transformer_config, tensors)
    del tensors
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    try:
        save_transformer(model, target / "transformer")
        for part in COMPONENTS:
            src = (base / part).resolve()
            if components == "copy":
                shutil.copytree(src, target / part)
            else:
                os.symlink(src, target / part, target_is_directory=True)
        # the base's index, naming the class that restores the conversion (diffusers' loaders then load it as saved)
        from .model import model_index_entry

        index = read_json(base / "model_index.json", "model_index.json")
        index["transformer"] = model_index_entry()
        write_json(target / "model_index.json", index)
        _write_record(target, checkpoint, found, base, components, plan)
    except BaseException:
        _remove_contents(target, remove_dir=created)  # no half-written directory that loads as something it is not
        raise
    return out


def _write_record(
    out: Path, checkpoint: Path, found: str | None, base: Path, components: str, plan: ImportPlan
) -> None:
    record = {
        "checkpoint": str(checkpoint.resolve()),
        "checkpoint_bytes": checkpoint.stat().st_size,
        "state_dict_key": found,
        "base": str(base.resolve()),
        "components": components,
        "variant": plan.variant,
        "mhla_layers": plan.mhla_layers,
        "blocks": list(plan.blocks),
        "blocks_source": plan.blocks_source,
        "trained_grid": list(plan.grid),
        "forward": "MHLA authors' (constrain_mixing=false: mixing used as stored; no normalizer; output RMSNorm)",
    }
    write_text_atomic(out / RECORD, json.dumps(record, indent=2) + "\n")


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.import_official",
        description="Import a published MHLA Wan2.1 checkpoint (full or hybrid) as a model directory.",
    )
    p.add_argument(
        "--checkpoint", required=True, help=".safetensors or .pt/.pth in the published (original Wan) format"
    )
    p.add_argument(
        "--base", required=True, help="local diffusers-format Wan2.1-T2V-1.3B directory (config, VAE, text encoder)"
    )
    p.add_argument("--out", required=True, help="new directory: a full model for `pipelines.cli --model OUT`")
    p.add_argument(
        "--hybrid", action="store_true", help="insist on the hybrid checkpoint (default: detected from the keys)"
    )
    p.add_argument("--grid", default=_grid_text(OFFICIAL_GRID), help="token grid it was trained on (default 21x30x50)")
    p.add_argument("--blocks", default=None, help="block layout FxHxW (default: inferred from M and --grid)")
    p.add_argument(
        "--components", choices=("link", "copy"), default="link", help="symlink (default) or copy base parts"
    )
    p.add_argument("--state-dict-key", default=None, help="key of the weights inside a .pt training checkpoint")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    return run_cli(_main, argv, prog="pipelines.import_official")


def _main(argv: Sequence[str]) -> int:
    import mhla

    args = _parse_args(argv)
    try:
        grid = mhla.parse_blocks(args.grid)
    except ValueError:
        raise ValueError(
            f"--grid must look like '21x30x50' (latent tokens: frames x height x width), got {args.grid!r}"
        ) from None
    out = import_official(
        args.checkpoint,
        args.base,
        args.out,
        hybrid=True if args.hybrid else None,
        grid=grid,
        blocks=args.blocks,
        components=args.components,
        state_dict_key=args.state_dict_key,
    )
    record = json.loads((out / RECORD).read_text())
    b = "x".join(map(str, record["blocks"]))
    print(
        f"imported {record['variant']} ({len(record['mhla_layers'])} MHLA layers, {b} blocks, {record['blocks_source']})"
    )
    print(
        f"wrote {out}; run it with:  python -m pipelines.cli --model {out} --variant {record['variant']} "
        '--height 480 --width 800 --frames 81 --prompt "..."'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA adapters in the format diffusers' ``WanPipeline.load_lora_weights`` reads, written by fine-tuning and
read back by it (``model.lora``) and by ``python -m pipelines.cli --lora``.

A LoRA run (``train.trainable=lora``) saves ``lora/`` beside the merged ``transformer/`` in each checkpoint and in
``<run_dir>/final/``:

- ``pytorch_lora_weights.safetensors``: the adapters as diffusers' ``save_lora_weights`` writes them (keys
  ``transformer.blocks.N.attn1.to_q.lora_A.weight``, ..., the adapter's ``LoraConfig`` (rank, alpha, target modules)
  in the file's ``lora_adapter_metadata``), plus :data:`INFO_KEY`: what this product knows about the run (variant,
  base model, step) and what a plain diffusers pipeline can load::

      pipe = WanPipeline.from_pretrained(BASE_MODEL)
      pipe.load_lora_weights("runs/my-lora/final/lora")

- ``attention_parameters.safetensors`` (linear, MHLA and hybrid variants only): the converted self-attention's
  own trained parameters (MHLA mixing coefficients, norms, gates), which are not LoRA weights; the conversion
  they belong to is in the file's metadata. A plain diffusers pipeline has neither these parameters nor the
  product's attention processors: it loads the adapters of such a run, but runs softmax attention on them.
- ``README.md``: the same in words.

:func:`read_lora` reads such a folder or file, and any diffusers Wan LoRA file (and the original-Wan and
musubi-tuner layouts diffusers converts); :func:`apply_lora` merges one into a transformer for generation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .attention import PARAM_ATTRS, SOFTMAX, VARIANTS
from .conversion import CONFIG_KEY, Conversion

LORA_FOLDER = "lora"  # <checkpoint>/lora, <run_dir>/final/lora
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
ATTENTION_NAME = "attention_parameters.safetensors"
README_NAME = "README.md"
INFO_KEY = "mhla_video"  # this product's entry in the safetensors metadata
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer"  # diffusers' key prefix of the transformer's adapters
FILE_PATTERNS = (WEIGHT_NAME, ATTENTION_NAME, README_NAME)


@dataclass(frozen=True)
class LoraAdapters:
    """A LoRA file read by :func:`read_lora`."""

    file: Path
    state: dict[str, torch.Tensor]  # diffusers' names: transformer.blocks.0.attn1.to_q.lora_A.weight, ...
    metadata: dict[str, Any] | None  # the LoraConfig arguments diffusers stores, unprefixed (None: from the shapes)
    info: dict[str, Any] = field(default_factory=dict)  # what this product wrote ({} for other files)
    attention: Path | None = None  # attention_parameters.safetensors beside it
    attention_state: dict[str, Any] | None = None  # the conversion those parameters belong to

    @property
    def rank(self) -> int:
        if self.metadata and "r" in self.metadata:
            return int(self.metadata["r"])
        ranks = [int(t.shape[0]) for k, t in self.state.items() if ".lora_A." in k]
        return max(set(ranks), key=ranks.count) if ranks else 0

    @property
    def alpha(self) -> float:
        if self.metadata and "lora_alpha" in self.metadata:
            return float(self.metadata["lora_alpha"])
        return float(self.rank)  # diffusers' rule for a file without alphas: scale 1

    @property
    def modules(self) -> list[str]:
        """The adapted modules, e.g. ``blocks.0.attn1.to_q``."""
        return sorted({k.split(".lora_")[0].removeprefix(f"{PREFIX}.") for k in self.state})

    @property
    def variant(self) -> str:
        """The self-attention variant the adapters were trained with (flash for a file from elsewhere)."""
        if self.attention_state:
            return str(self.attention_state["variant"])
        return str(self.info.get("variant") or SOFTMAX)

    def peft_state(self) -> dict[str, torch.Tensor]:
        """The adapters under peft's names without the adapter (``blocks.0.attn1.to_q.lora_A.weight``)."""
        return {k.removeprefix(f"{PREFIX}."): v for k, v in self.state.items()}

    def describe(self) -> str:
        extra = f", with {self.variant} attention parameters" if self.attention is not None else ""
        return f"{len(self.modules)} modules, rank {self.rank}, alpha {self.alpha:g}{extra}"


def find_lora_file(path: str | Path, what: str = "--lora") -> Path:
    """The weights file a LoRA ``path`` names: the file itself, or a folder's ``pytorch_lora_weights.safetensors``
    (else its only ``.safetensors`` file). Raises FileNotFoundError / ValueError naming ``path``."""
    p = Path(path).expanduser()
    expected = (
        f"expected a LoRA folder holding {WEIGHT_NAME} (e.g. <run_dir>/final/lora of a train.trainable=lora run) "
        "or a .safetensors LoRA file"
    )
    if not p.exists():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist; {expected}")
    if p.is_dir():
        if (p / WEIGHT_NAME).is_file():
            return p / WEIGHT_NAME
        found = sorted(f for f in p.glob("*.safetensors") if f.name != ATTENTION_NAME)
        if len(found) == 1:
            return found[0]
        listed = f" (it holds {', '.join(f.name for f in found[:4])})" if found else ""
        raise ValueError(f"{what} {str(path)!r} is a folder without {WEIGHT_NAME}{listed}; {expected}")
    if p.suffix != ".safetensors":
        raise ValueError(f"{what} {str(path)!r} is not a .safetensors file; {expected}")
    return p


def _file_metadata(file: Path, what: str) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{what} {str(file)!r} is not a readable safetensors file ({e})") from None


def _json_entry(metadata: dict[str, str], key: str, file: Path, what: str) -> dict[str, Any] | None:
    raw = metadata.get(key)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {str(file)!r}: its metadata entry {key!r} is not a JSON object")
    return value


def read_lora(path: str | Path, what: str = "--lora") -> LoraAdapters:
    """Reads a LoRA folder or file (see the module docstring) through diffusers' own ``WanPipeline.lora_state_dict``
    (so the original-Wan and musubi-tuner layouts are converted as ``load_lora_weights`` converts them). Raises
    ValueError naming ``path`` for a file that is not a transformer LoRA."""
    from diffusers import WanPipeline

    file = find_lora_file(path, what)
    metadata = _file_metadata(file, what)
    try:
        state, adapter_metadata = WanPipeline.lora_state_dict(str(file), return_lora_metadata=True)
    except Exception as e:  # diffusers' converters raise their own errors on foreign layouts
        first = " ".join(str(e).split())[:300]
        raise ValueError(f"{what} {str(path)!r}: diffusers could not read it as a Wan LoRA ({first})") from None
    if not state:
        raise ValueError(f"{what} {str(path)!r} holds no weights; expected LoRA adapters")
    bad = [k for k in state if "lora" not in k]
    if bad:
        raise ValueError(
            f"{what} {str(path)!r} holds weights that are not LoRA adapters (e.g. {bad[:3]}); expected a LoRA "
            "file (a full transformer folder goes to --transformer / model.transformer)"
        )
    others = [k for k in state if not k.startswith(f"{PREFIX}.")]
    if others:
        raise ValueError(
            f"{what} {str(path)!r} holds adapters of other parts than the transformer (e.g. {others[:3]}); "
            "expected transformer adapters only"
        )
    info = _json_entry(metadata, INFO_KEY, file, what) or {}
    beside = file.parent / ATTENTION_NAME
    attention = beside if beside.is_file() else None
    attention_state = None
    if attention is not None:
        attention_state = _json_entry(_file_metadata(attention, what), "self_attention", attention, what)
        if (
            attention_state is None
            or attention_state.get("variant") not in VARIANTS
            or attention_state["variant"] == SOFTMAX
        ):
            raise ValueError(
                f"{what} {str(attention)!r} does not say which conversion its parameters belong to; expected the "
                "file a train.trainable=lora run writes beside its adapters"
            )
    if adapter_metadata:  # diffusers keeps each part's LoraConfig under its prefix (transformer.r, ...)
        adapter_metadata = {
            k.removeprefix(f"{PREFIX}."): v for k, v in adapter_metadata.items() if k.startswith(f"{PREFIX}.")
        }
    return LoraAdapters(file, dict(state), adapter_metadata or None, info, attention, attention_state)


def check_lora_fits(adapters: LoraAdapters, config: dict[str, Any], what: str = "--lora") -> None:
    """The adapters against a transformer's ``config.json`` before it loads: layers it has and the attention
    projections' width (a LoRA of another model size is named here, not deep in peft)."""
    layers = int(config["num_layers"])
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    for key, t in adapters.state.items():
        name = key.removeprefix(f"{PREFIX}.")
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) >= layers:
            raise ValueError(
                f"{what} {str(adapters.file)!r} adapts {name.split('.lora_')[0]}, but the transformer has {layers} "
                "layers; expected a LoRA trained on this model"
            )
        if ".attn" in name and any(f".{p}.lora_" in name for p in ("to_q", "to_k", "to_v")):
            width = t.shape[1] if ".lora_A." in name else t.shape[0]
            if width != inner:
                raise ValueError(
                    f"{what} {str(adapters.file)!r}: {name} has width {width}, the transformer's attention "
                    f"{inner}; expected a LoRA trained on this model"
                )


# --------------------------------------------------------------------------- writing


def adapter_config(transformer: Any, adapter: str = "default") -> dict[str, Any]:
    """The adapter's ``LoraConfig`` arguments diffusers needs to rebuild it (rank, alpha, target modules): what
    ``load_lora_weights`` passes to ``LoraConfig(**metadata)``; only fields every peft version takes."""
    config = transformer.peft_config[adapter]
    return {
        "r": int(config.r),
        "lora_alpha": config.lora_alpha,
        "target_modules": sorted(config.target_modules),
        "lora_dropout": float(config.lora_dropout),
        "bias": config.bias,
        "use_rslora": bool(config.use_rslora),
        "use_dora": bool(config.use_dora),
        "init_lora_weights": True,
    }


def attention_parameter_names(transformer: Any) -> list[str]:
    """The converted self-attention's own parameters (``blocks.N.attn1.<mhla|linear>.*``)."""
    marks = tuple(f".attn1.{a}." for a in PARAM_ATTRS.values())
    return [n for n, _ in transformer.named_parameters() if any(m in n for m in marks)]


def save_lora(transformer: Any, folder: str | Path, info: dict[str, Any]) -> Path:
    """Writes ``transformer``'s LoRA adapter (peft's ``default``) to ``folder`` (atomically; an earlier save
    there is replaced whole): :data:`WEIGHT_NAME` in diffusers' format with ``info`` in its metadata, the
    converted attention's own parameters (:data:`ATTENTION_NAME`) when it has any, and :data:`README_NAME`.
    ``info``: at least ``variant``; ``base_model``, ``step``, ``expert`` are said in the README when given."""
    from diffusers import WanPipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from common.outputs import atomic_dir, check_replaceable

    lora = get_peft_model_state_dict(transformer, adapter_name="default")
    if not lora:
        raise ValueError("the transformer has no LoRA adapter to save")
    packed = WanPipeline.pack_weights(lora, PREFIX)
    config = adapter_config(transformer)
    params = dict(transformer.named_parameters())
    attention = {n: params[n] for n in attention_parameter_names(transformer)}
    info = {
        **info,
        "variant": info.get("variant", transformer.conversion.variant),
        "attention_parameters": bool(attention),
    }
    info["diffusers"] = _diffusers_note(info)
    metadata = {
        "format": "pt",
        # as diffusers' _save_lora_weights packs it: each key under the part's prefix (transformer.r, ...)
        ADAPTER_METADATA_KEY: json.dumps({f"{PREFIX}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True),
        INFO_KEY: json.dumps(info, sort_keys=True),
    }
    folder = Path(folder)
    check_replaceable(folder, FILE_PATTERNS)
    with atomic_dir(folder) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in packed.items()}, str(tmp / WEIGHT_NAME), metadata)
        if attention:
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in attention.items()},
                str(tmp / ATTENTION_NAME),
                {"format": "pt", CONFIG_KEY: json.dumps(transformer.conversion.to_config(), sort_keys=True)},
            )
        (tmp / README_NAME).write_text(readme(info, config), encoding="utf-8")
    return folder


def _diffusers_note(info: dict[str, Any]) -> str:
    if info.get("attention_parameters"):
        return (
            f"loads the adapters only: the run also trained {info['variant']} self-attention parameters "
            f"({ATTENTION_NAME}, not LoRA) and ran {info['variant']} attention, which a plain diffusers pipeline "
            "lacks (it runs softmax attention): use this product's processors (pipelines.cli --lora, or the merged "
            "transformer)"
        )
    if info.get("variant", SOFTMAX) != SOFTMAX:
        return (
            f"loads the adapters, but they were trained under {info['variant']} attention, which a plain diffusers "
            "pipeline lacks (it runs softmax attention): use this product's processors"
        )
    return "loads fully: the same model as the run's merged transformer"


def readme(info: dict[str, Any], config: dict[str, Any]) -> str:
    """The folder's README: what it holds and what loads it where."""
    variant = info.get("variant", SOFTMAX)
    base = info.get("base_model") or "the model the run trained on (model.path)"
    expert = info.get("expert")
    into = ", load_into_transformer_2=True" if expert == "transformer_2" else ""
    step = f" at step {info['step']}" if info.get("step") is not None else ""
    lines = [
        f"# LoRA adapters{step}",
        "",
        f"Trained by `python -m training.finetune` (train.trainable=lora) on {base}, self-attention variant "
        f"`{variant}`: rank {config['r']}, alpha {config['lora_alpha']}, on {', '.join(config['target_modules'])}.",
        "",
        f"- `{WEIGHT_NAME}`: the adapters in diffusers' format (diffusers' `save_lora_weights` layout, the",
        "  LoraConfig in the file's `lora_adapter_metadata`, this note in its `mhla_video` entry).",
    ]
    if info.get("attention_parameters"):
        lines += [
            f"- `{ATTENTION_NAME}`: the {variant} self-attention's own trained parameters (not LoRA weights).",
        ]
    lines += [
        "",
        "Plain diffusers:",
        "",
        "```python",
        "from diffusers import WanPipeline",
        f'pipe = WanPipeline.from_pretrained("{base}")',
        f'pipe.load_lora_weights("THIS_FOLDER"{into})',
        "```",
        "",
        f"A plain diffusers pipeline {_diffusers_note(info)}.",
        "",
        f"This product: `python -m pipelines.cli --model {base} --lora THIS_FOLDER --prompt ...` (as the",
        "variant it was trained as), or the merged model beside it (`--transformer ../transformer`); train on",
        "from it with `model.lora=THIS_FOLDER` (train.trainable=lora, the same rank and alpha).",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- loading


def load_attention_parameters(transformer: Any, adapters: LoraAdapters, what: str = "--lora") -> None:
    """A LoRA folder's attention parameters (:data:`ATTENTION_NAME`) into ``transformer``: converted to the
    variant, layers and options they were trained with first, so the parameters have somewhere to go."""
    from safetensors.torch import load_file

    if adapters.attention is None or adapters.attention_state is None:
        return
    trained = Conversion.from_config(adapters.attention_state, len(transformer.blocks))
    transformer.convert(trained.variant, trained.explicit_layers, trained.options)
    load_parameters(transformer, load_file(str(adapters.attention)), adapters.attention, what)


def load_parameters(transformer: Any, weights: dict[str, torch.Tensor], file: Path, what: str) -> None:
    """``weights`` (attention parameters) into ``transformer``, each one present there and of its shape."""
    params = dict(transformer.named_parameters())
    missing = [n for n in weights if n not in params]
    wrong = [
        f"{n} {tuple(t.shape)} vs {tuple(params[n].shape)}"
        for n, t in weights.items()
        if n in params and params[n].shape != t.shape
    ]
    if missing or wrong:
        raise ValueError(
            f"{what} {str(file)!r} does not fit this transformer: "
            + (f"no parameter {missing[:3]}" if missing else f"shapes {wrong[:3]}")
            + " (another model, variant or block layout than it was trained with)"
        )
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t.to(params[n].dtype))


def apply_lora(transformer: Any, adapters: LoraAdapters, what: str = "--lora") -> None:
    """Merges ``adapters`` into ``transformer`` for generation, in place: its attention parameters first (a linear
    or MHLA run's, converting the transformer to their variant), then the adapters through diffusers' own
    ``load_lora_adapter``, fused and unloaded (the transformer then runs as without a LoRA)."""
    load_attention_parameters(transformer, adapters, what)
    try:
        metadata = None if adapters.metadata is None else {f"{PREFIX}.{k}": v for k, v in adapters.metadata.items()}
        transformer.load_lora_adapter(dict(adapters.state), prefix=PREFIX, adapter_name="lora", metadata=metadata)
    except (RuntimeError, ValueError, KeyError) as e:
        first = " ".join(str(e).split())[:300]
        raise ValueError(f"{what} {str(adapters.file)!r} does not fit this transformer ({first})") from None
    loaded = {n for n, _ in transformer.named_parameters() if ".lora_A.lora." in n}
    if not loaded:
        raise ValueError(f"{what} {str(adapters.file)!r}: no adapter matched a module of this transformer")
    transformer.fuse_lora(adapter_names=["lora"])
    transformer.unload_lora()


def load_into_adapter(transformer: Any, adapters: LoraAdapters, what: str = "model.lora") -> list[str]:
    """``adapters`` into the transformer's existing peft adapter ``default`` (fine-tuning: the run's own adapter,
    made by ``add_adapter`` with the same rank), and their attention parameters (the transformer already converted
    as the run asks). Returns the adapted modules the file did not cover (they start at zero)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = adapters.peft_state()
    try:
        result = set_peft_model_state_dict(transformer, state, adapter_name="default")
    except RuntimeError as e:  # a size mismatch
        first = " ".join(str(e).split())[:300]
        raise ValueError(f"{what} {str(adapters.file)!r} does not fit this model's adapters ({first})") from None
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise ValueError(
            f"{what} {str(adapters.file)!r} adapts modules this run's adapter does not (e.g. {unexpected[:3]}); "
            "expected train.lora.target_modules to include them"
        )
    if adapters.attention is not None:
        load_parameters(transformer, load_file(str(adapters.attention)), adapters.attention, what)
    covered = {k.split(".lora_")[0] for k in state}
    modules = {n.split(".lora_A.")[0] for n, _ in transformer.named_parameters() if ".lora_A.default." in n}
    return sorted(modules - covered)


def module_kinds(names: Iterable[str]) -> list[str]:
    """``blocks.0.attn1.to_out.0`` -> ``attn1.to_out.0``: the kinds of adapted modules, as peft's
    ``target_modules`` may name them (a name matches a module it ends)."""
    kinds = set()
    for name in names:
        parts = name.split(".")
        kinds.add(".".join(parts[2:]) if parts[0] == "blocks" and len(parts) > 2 else name)
    return sorted(kinds)


def targeted(module: str, targets: Iterable[str]) -> bool:
    """Whether peft's ``target_modules`` (names) adapt ``module``: it is one of them or ends with ``.name``."""
    return any(module == t or module.endswith(f".{t}") for t in targets)

"""Loading Wan components from a local diffusers-format directory, the built-in model, or the tiny random-weight one.

A directory's ``model_index.json`` says which pipeline it is (:class:`pipelines.model_dir.ModelIndex`): Wan2.1 /
Wan2.2 text-to-video (``WanPipeline``, with a second expert for Wan2.2-A14B and per-token timesteps for
Wan2.2-TI2V) or image-to-video (``WanImageToVideoPipeline``); :func:`load_components` loads every part it names.

Nothing is ever fetched from a hub: a path that is missing or incomplete raises an error that lists the
files expected. Text encoder and VAE are loaded once and shared; transformers (one per variant, or one
switched between variants) are loaded with :func:`load_transformer`, which rebuilds the saved variant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from mhla import PAPER_BLOCK_SHAPE

from .attention import PARAM_ATTRS
from .compat import quiet_image_processors
from .devices import DTYPES as DTYPES  # the loaders' device and dtype names, for code that imports them here
from .devices import resolve_device as resolve_device
from .devices import resolve_dtype as resolve_dtype
from .model_dir import (
    ModelDir,
    ModelIndex,
    check_finite,
    check_transformer_config,
    check_transformer_weights,
    check_weight_files,
    read_json,
    require_key,
    vae_strides,
    weight_files,
)
from .tiny_sizes import WAN_DEFAULTS

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan, SchedulerMixin

    from .lora import LoraAdapters
    from .model import MHLAWanTransformer3DModel


@dataclass
class WanComponents:
    """The parts of a Wan2.1 T2V model, loaded once and shared by every variant.

    ``transformer`` is the default transformer (callers may keep others, one per variant).
    ``random_weights`` is True for the tiny random-weight model: its output is noise and must be labelled so.
    ``defaults``: height, width, num_frames, num_inference_steps, guidance_scale suited to the model.
    ``block_shape``: target block shape in tokens for the default MHLA layout (paper: 3x10x10).
    ``variant_dirs``: fine-tuned transformer folders by variant that ship with the model (the built-in one's).
    ``index``: the architecture (:class:`pipelines.model_dir.ModelIndex`: pipeline class, second expert and its
    ``boundary_ratio``, ``expand_timesteps``); ``transformer_2``: Wan2.2-A14B's low-noise expert (else None);
    ``image_encoder``/``image_processor``: Wan2.1-I2V's CLIP encoder (None for Wan2.2-I2V and text-to-video).
    """

    tokenizer: object
    text_encoder: torch.nn.Module
    vae: AutoencoderKLWan
    scheduler: SchedulerMixin
    transformer: MHLAWanTransformer3DModel
    source: str
    random_weights: bool
    device: torch.device
    dtype: torch.dtype
    defaults: dict[str, Any] = field(default_factory=dict)
    block_shape: tuple[int, int, int] = PAPER_BLOCK_SHAPE
    variant_dirs: dict[str, Path] = field(default_factory=dict)
    index: ModelIndex = field(default_factory=ModelIndex)
    transformer_2: MHLAWanTransformer3DModel | None = None
    image_encoder: torch.nn.Module | None = None
    image_processor: object | None = None

    @property
    def pipeline_class(self) -> str:
        """The diffusers pipeline class the model directory names (``WanPipeline``, ``WanImageToVideoPipeline``)."""
        return self.index.pipeline_class

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        """The VAE's strides ``(time, height, width)``: 4 x 8 x 8 for Wan2.1's, 4 x 16 x 16 for Wan2.2-TI2V's."""
        return vae_strides(self.vae.config)

    @property
    def latent_channels(self) -> int:
        """Channels of the denoised latents: the VAE's ``z_dim`` (an image-to-video transformer takes more, the
        first-frame condition and its mask concatenated to them)."""
        return int(self.vae.config.z_dim)


def random_wan_source(size: str) -> str:
    """The name of :func:`build_random_wan`'s model."""
    return f"Wan2.1-T2V-{size.upper()} architecture with RANDOM weights"


def load_transformer(
    path: str | Path,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = "auto",
    config: dict[str, Any] | None = None,
) -> MHLAWanTransformer3DModel:
    """Loads a transformer folder written by ``save_pretrained``, as the variant it was saved as.

    A thin caller of diffusers' own loader: the files are checked first (a missing key or a bad file is named
    before anything loads), then :class:`pipelines.model.MHLAWanTransformer3DModel` ``.from_pretrained`` builds
    the saved variant from ``config.json`` (its ``self_attention`` entry; a plain Wan folder loads as
    ``flash``) and loads every weight, refusing a checkpoint that lacks one the config promises.
    ``dtype``/``device``: as :func:`load_components` (default bfloat16 on GPU, float32 on CPU). ``config``: the
    folder's ``config.json`` when the caller has read it (:meth:`pipelines.model_dir.ModelDir.transformer_config`).
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    return load_transformer_on(path, dtype, device, config)


def load_transformer_on(
    path: str | Path, dtype: torch.dtype, device: torch.device, config: dict[str, Any] | None = None
) -> MHLAWanTransformer3DModel:
    """:func:`load_transformer` onto a ``device`` and ``dtype`` already resolved (:mod:`pipelines.devices`: a
    command line's plan resolves them once)."""
    from .model import MHLAWanTransformer3DModel

    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; expected a save_pretrained transformer folder")
    config = read_json(config_file, "transformer config") if config is None else config
    for key in ("patch_size", "num_layers", "num_attention_heads", "attention_head_dim"):
        require_key(config, key, config_file)
    # the folder's files, before diffusers reads them: a bad config or weight file, and missing, unexpected or
    # twice-stored weights, named (diffusers only warns about unexpected ones: a config saying fewer layers than
    # the weights would load with layers dropped); headers only. The variant's own parameters
    # (``.attn1.<mhla|linear_attn>.``) are the loader's; a malformed ``self_attention`` record is named by the model
    # class as it is built, before any weight is read
    check_transformer_config(config, config_file)
    check_weight_files(weight_files(folder))
    check_transformer_weights(folder, config, lambda key: any(f".attn1.{a}." in key for a in PARAM_ATTRS.values()))
    model, info = MHLAWanTransformer3DModel.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    # diffusers only warns about a missing weight (and leaves it on the meta device): refuse the checkpoint
    missing = sorted(info["missing_keys"])
    if missing:
        kind = "attention parameters" if all(".attn1." in k for k in missing) else "weights"
        raise ValueError(f"checkpoint {str(folder)!r} lacks {len(missing)} {kind}, e.g. {missing[:4]}")
    model = model.to(device).eval()
    check_finite(model.state_dict().items(), f"transformer {str(folder)!r}")
    return model


def save_transformer(transformer: MHLAWanTransformer3DModel, path: str | Path, **kwargs: Any) -> None:
    """``save_pretrained`` in safetensors (``kwargs``: its others, e.g. ``max_shard_size``, ``variant``); the
    variant travels in ``config.json`` under the class that restores it (see :mod:`pipelines.model`).
    Atomic: written to a temporary folder beside ``path`` and renamed into place when complete, so an earlier
    save there is replaced only by a whole one (a folder holding anything else is refused, never deleted)."""
    from common.outputs import atomic_dir, check_replaceable

    check_replaceable(path, MODEL_FILE_PATTERNS)
    with atomic_dir(path) as tmp:
        transformer.save_pretrained(str(tmp), safe_serialization=True, **kwargs)


def _load_scheduler(folder: Path) -> SchedulerMixin:
    """The scheduler class the directory names (Wan2.1 ships UniPCMultistepScheduler with flow_shift 3.0)."""
    import diffusers

    name = json.loads((folder / "scheduler_config.json").read_text()).get("_class_name", "UniPCMultistepScheduler")
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"{str(folder)!r} names scheduler class {name!r}, which diffusers does not have")
    return cls.from_pretrained(folder)


# what save_pretrained writes into a transformer folder: a folder holding only these may be replaced by a new save
MODEL_FILE_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json")

_Module = TypeVar("_Module", bound=torch.nn.Module)


def _cast(model: _Module, device: torch.device, dtype: torch.dtype) -> _Module:
    """``model.to(device, dtype)`` keeping the modules diffusers keeps in float32 (norms, time embedding,
    RoPE), as ``from_pretrained(dtype=...)`` does."""
    model = model.to(device)
    if dtype == torch.float32:
        return model
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if not any(k in name.split(".") for k in keep):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(dtype)
    return model


# diffusers' MHLAWanTransformer3DModel arguments of the released Wan2.1 T2V checkpoints: the architectures that
# --random-weights (the app) and benchmarks/wan_step.py build with random weights
WAN_CONFIGS = {
    "1.3b": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
    ),
    "14b": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=40,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=13824,
        num_layers=40,
    ),
}


def build_random_wan(
    size: str, device: str | torch.device | None = "auto", dtype: str | torch.dtype | None = "auto"
) -> WanComponents:
    """The real Wan2.1 transformer (``size``: a key of :data:`WAN_CONFIGS`) and VAE with RANDOM weights, for
    true-size latency; every video is noise.

    The text encoder is a 2-layer UMT5 stand-in with the real output width (4096): building the 5.7B-parameter
    UMT5-XXL would take minutes and ~11 GB for a stage that runs once per video and is not compared.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    from .model import MHLAWanTransformer3DModel

    if size not in WAN_CONFIGS:
        raise ValueError(f"random-weight Wan2.1 size must be one of {', '.join(WAN_CONFIGS)}, got {size!r}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    tokenizer = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        # built on the device directly: 14B parameters in float32 do not fit a 2-core CI box, let alone twice
        transformer = MHLAWanTransformer3DModel(**WAN_CONFIGS[size]).eval()
        text_encoder = UMT5EncoderModel(
            UMT5Config(vocab_size=len(tokenizer), d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64)
        ).eval()
        vae = AutoencoderKLWan().eval()  # diffusers' defaults are Wan2.1's VAE
    return WanComponents(
        tokenizer=tokenizer,
        text_encoder=text_encoder.to(dtype),
        vae=vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        transformer=_cast(transformer, device, dtype),
        source=random_wan_source(size),
        random_weights=True,
        device=device,
        dtype=dtype,
        defaults=dict(WAN_DEFAULTS),
    )


def load_components(
    model_dir: str | Path | ModelDir | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = "auto",
    seed: int = 0,
    expert: str | None = None,
    *,
    transformer: str | Path | None = None,
    transformer_config: dict[str, Any] | None = None,
    lora: LoraAdapters | None = None,
    lora_name: str | None = None,
) -> WanComponents:
    """Loads a local Wan directory (a path, or the run's :class:`pipelines.model_dir.ModelDir` of it: its files are
    then not read again); ``None`` loads the built-in model (``assets/builtin``: trained on synthetic moving
    shapes); ``"tiny-random"`` builds the tiny random-weight model (tests, smoke runs).

    A directory is read as its files say (:meth:`pipelines.model_dir.ModelDir.files`, once; the pipeline class is
    checked before anything loads): ``WanPipeline`` or ``WanImageToVideoPipeline``, each transformer
    (``transformer``, and ``transformer_2`` when named) as :func:`load_transformer` loads it (a converted one comes
    back as its variant), the image encoder and processor when named.

    The transformer and text encoder get ``dtype`` (default bfloat16 on GPU, float32 on CPU); the VAE
    stays float32, as in diffusers' Wan examples, because its decode is sensitive to precision. Both are
    resolved here, once. ``seed`` only affects the tiny model's random weights. ``expert`` (``"transformer"`` or
    ``"transformer_2"``) loads that expert alone, as ``components.transformer`` (fine-tuning one Wan2.2-A14B expert
    never loads the other); None loads every transformer the index names.

    The command line's ``--transformer`` and ``--lora``: ``transformer``, a saved transformer folder to run in
    place of the model's own (``transformer_config``: its ``config.json`` as read), refused when it does not fit
    the model; ``lora``, adapters (:func:`pipelines.lora.read_lora`, named ``lora_name``) merged into the
    transformer. Both are named in ``source``.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if expert not in (None, "transformer", "transformer_2"):
        raise ValueError(f"expert must be 'transformer', 'transformer_2' or None, got {expert!r}")
    # one description of the folder per run: a caller's (the CLI's, already checked), else made here
    folder = model_dir if isinstance(model_dir, ModelDir) else ModelDir(model_dir)
    files = folder.files(expert, seed)  # every fact loading needs, read and checked once
    if files.root is None:  # the tiny random-weight model: built, not read
        from .tiny import build_tiny_components  # here: `python -m pipelines.tiny` runs that module as __main__

        parts = build_tiny_components(seed)
        tokenizer, scheduler = parts["tokenizer"], parts["scheduler"]
        text_encoder = parts["text_encoder"].to(device, dtype)
        vae = parts["vae"].to(device)
        built = {"transformer": _cast(parts["transformer"], device, dtype)}
        image_encoder, image_processor = None, None
        folders: dict[str, tuple[Path, dict[str, Any] | None]] = {}
    else:
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel

        root = files.root
        tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
        # transformers wraps PreTrainedModel.to in functools.wraps(nn.Module.to): mypy takes it for the unbound
        # method
        text_encoder = UMT5EncoderModel.from_pretrained(root / "text_encoder", dtype=dtype).to(device).eval()  # type: ignore[arg-type]
        vae = AutoencoderKLWan.from_pretrained(root / "vae", dtype=torch.float32).to(device).eval()
        scheduler = _load_scheduler(root / "scheduler")
        image_encoder, image_processor = _load_image_encoder(root, files.image_parts, device)
        built, folders = {}, {part: (root / part, config) for part, config in files.configs.items()}
    own = expert or "transformer"
    keys = ("text_dim", "in_channels", "out_channels")  # what --transformer must share with the model it runs in
    own_config: dict[str, Any] | None = None
    if transformer is not None:  # --transformer runs in place of the model's own
        saved = folders.get(own, (None, None))[1]
        if saved is not None and all(k in saved for k in keys):  # its config.json says whether it fits: the
            own_config = saved  # model's own weights are not read (a 14B transformer is ~28 GB in bfloat16)
            del folders[own]
        folders["--transformer"] = (Path(transformer), transformer_config)
    # every transformer folder as load_transformer loads it (each comes back as its saved variant)
    experts = {**built, **{part: load_transformer_on(path, dtype, device, c) for part, (path, c) in folders.items()}}
    source = files.source
    first = experts.pop(own, None)
    loaded = experts.pop("--transformer", None)
    if loaded is not None:
        reference = own_config if first is None else dict(first.config)
        assert reference is not None  # the model's own transformer, loaded or its config read
        if any(loaded.config[k] != reference[k] for k in keys):
            raise ValueError(
                f"--transformer {str(transformer)!r} does not fit the model {source!r}: "
                + ", ".join(f"{k} {loaded.config[k]} vs {reference[k]}" for k in keys)
                + "; pass the --model it was trained with (e.g. --model tiny-random)"
            )
        first, source = loaded, f"{source} + transformer {transformer}"
    assert first is not None  # the model's own, or --transformer in its place
    if lora is not None:
        from .lora import apply_lora

        apply_lora(first, lora, "--lora")  # merged: it then runs as without a LoRA
        source += f" + LoRA {lora_name} ({lora.describe()})"
    return WanComponents(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=first,
        source=source,
        random_weights=files.random_weights,
        device=device,
        dtype=dtype,
        defaults=dict(files.defaults),
        block_shape=files.block_shape,
        variant_dirs=dict(files.variant_dirs),
        index=files.index,
        transformer_2=experts.get("transformer_2"),
        image_encoder=image_encoder,
        image_processor=image_processor,
    )


def _load_image_encoder(
    root: Path, parts: dict[str, Any], device: torch.device
) -> tuple[torch.nn.Module | None, object | None]:
    """Wan2.1-I2V's image encoder and processor, the ``transformers`` classes its ``model_index.json`` names
    (``parts``: those entries, e.g. CLIPVisionModel, CLIPImageProcessor); float32 like the VAE, as diffusers'
    Wan2.1-I2V example keeps it. (None, None) where it names none."""
    if not parts:
        return None, None
    import transformers

    quiet_image_processors()

    loaded: dict[str, Any] = {}
    for part in ("image_encoder", "image_processor"):
        library, name = parts.get(part) or (None, None)
        if library is None:
            loaded[part] = None
            continue
        cls = getattr(transformers, str(name), None) if library == "transformers" else None
        if cls is None or not hasattr(cls, "from_pretrained"):
            raise ValueError(
                f"{str(root / 'model_index.json')!r} names {part} {[library, name]!r}; expected a transformers "
                "class (CLIPVisionModel, CLIPImageProcessor)"
            )
        loaded[part] = cls.from_pretrained(root / part)
    encoder = loaded["image_encoder"]
    return (None if encoder is None else encoder.to(device).eval()), loaded["image_processor"]

"""Fine-tuning configuration: defaults, YAML files in ``configs/finetune/``, ``key=value`` overrides.

Every key a config may set is a field of :class:`FinetuneConfig` (its sections: :class:`DataSection`,
:class:`TrainSection`, ...), with its default, type and range; a misspelt key in a file or on the command line is
an error naming it, not a silently ignored setting. :func:`load_config` returns the checked config as a
``FinetuneConfig``, and each part of a run takes its own section of it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf

from mhla.checks import COMPILE_MODES
from pipelines.attention import MHLA, SOFTMAX, VARIANTS

# ---- the schema: one dataclass per section, one field per key: its default, its type (the annotation), its range or
# choices (the field's metadata); DEFAULTS and the checks' tables come from here. A key is added here, once.


def key(
    default: Any,
    *,
    low: float | None = None,
    above: bool = False,
    high: float | None = None,
    choices: tuple[Any, ...] | None = None,
) -> Any:
    """A config key's default and its bounds: numbers ``>= low`` (``> low`` with ``above``) and ``<= high``; values
    among ``choices``. Lists and mappings are copied for each config."""
    meta = {"low": low, "above": above, "high": high, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


TASKS = ("transformer", "vae")
VAE_TRAINABLE = ("all", "decoder")
SOURCES = ("synthetic", "folder", "cache")
LAYOUTS = ("auto", "jsonl", "csv", "txt")  # training.data.LAYOUTS (that module imports torch)
TRAINABLE = ("all", "attention", "new", "lora")
PRECISIONS = ("no", "bf16", "fp16")
LR_SCHEDULES = ("constant", "cosine")
EXPERTS = ("transformer", "transformer_2")  # training.experts.EXPERTS (that module imports pipelines)
PROBE_SPLITS = ("validation", "train")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHTINGS = ("logit_normal", "uniform")
SEED_MAX = 2**63 - 1  # a 64-bit generator's range
TRAIN_SEED_MAX = SEED_MAX // 1000 - 1000  # train.seed also seeds rank r's generator with seed * 1000 + r


@dataclass
class ModelSection:
    # local diffusers Wan directory (Wan2.1-T2V, Wan2.2-TI2V-5B, Wan2.2-T2V-A14B); null = the built-in model;
    # tiny-random = random tiny
    path: str | None = key(None)
    # Wan2.2-A14B (two experts): the one this run converts and trains, transformer (high noise, t >= boundary)
    # | transformer_2 (low noise, t < boundary); required there, null for a one-transformer model
    expert: str | None = key(None)
    transformer: str | None = key(None)  # optional: start from this transformer folder (e.g. a previous run's)
    # optional, train.trainable=lora: start the adapters (and a linear / MHLA run's attention parameters) from
    # this LoRA folder or file in diffusers' format (a run's final/lora, or any diffusers Wan LoRA)
    lora: str | None = key(None)
    seed: int = key(0, low=0, high=SEED_MAX)  # weights of the tiny model
    variant: str = key(MHLA, choices=VARIANTS)
    layers: list[int] | None = key(None)  # MHLA layers of mhla-hybrid, e.g. [1, 2, 4, 5]; null = all but 0, 3, 6, ...
    blocks: str | None = key(None)  # MHLA layout, e.g. "7x3x5"; null = the default rule for the training grid
    # pipelines.AttentionOptions overrides: normalize, feature_map, output_norm, ... (free-form: checked there)
    attention: dict[str, Any] = key({})
    dtype: str = key("auto", choices=MODEL_DTYPES)  # frozen text encoder / VAE: auto = bf16 on GPU, float32 on CPU
    # the cross-attention skips the caption's zero padding (MHLAWanTransformer3DModel.set_text_padding_mask; saved
    # in the transformer's config, so the pipeline runs it the same way); null = the starting transformer's own
    # (a resumed run: its checkpoint's)
    mask_text_padding: bool | None = key(None)


@dataclass
class DataSection:
    source: str = key("synthetic", choices=SOURCES)
    path: str | None = key(None)  # folder (manifest or .txt captions) or precomputed cache
    # data.source=folder: which layout data.path has (auto = a manifest when there is one, else .txt captions) and
    # the manifest's columns (null = 'video' / 'caption', or Hugging Face's metadata.csv / metadata.jsonl columns
    # 'file_name' / 'text')
    layout: str = key("auto", choices=LAYOUTS)
    video_column: str | None = key(None)
    caption_column: str | None = key(None)
    num_samples: int = key(64, low=1)  # synthetic only
    world: str = key("v1")  # synthetic only: the world preset (world.synthetic.WORLDS)
    # synthetic only: probability of leaving sizes / background out of a caption (null: the world's)
    short_captions: float | None = key(None, low=0, high=1)
    # synthetic only: the one background a caption may leave out (null: the world's)
    default_background: str | None = key(None)
    num_frames: int = key(81)
    height: int = key(480)
    width: int = key(800)
    frame_stride: int = key(1, low=1)
    # data.source=folder: take the frames at this rate from every video whatever its own (24 and 30 fps clips then
    # move at one speed), instead of every data.frame_stride-th frame; null = frame_stride
    fps: float | None = key(None, low=0, above=True)
    # data.source=folder, length buckets: a video too short for data.num_frames but long enough for this many
    # frames (4k+1) trains at the longest 4k+1 clip it holds instead of being skipped; null = skip it
    min_frames: int | None = key(None, low=1)
    # data.source=folder, resolution and aspect buckets: each clip trains at the (height, width) bucket nearest its
    # aspect ratio, of about data.height x data.width pixels in multiples of the model's VAE stride x patch
    # (resized to cover it, centre-cropped), a batch of one bucket (and one length); null (auto) = on when the
    # clips fall in more than one bucket, else every clip at data.height x data.width; true = on; false = off.
    # data.bucket_sizes: the buckets, e.g. [[480, 832], [832, 480], [624, 624]]; null = made from the size
    buckets: bool | None = key(None)
    bucket_sizes: list[Any] | None = key(None)
    # data.source=folder, for python -m training.precompute: windows (clips) the cache stores of each long video,
    # spread evenly over it; training reads another of them each epoch (live decoding draws a new clip each epoch)
    cache_windows: int = key(1, low=1)
    # data.source=folder: put this word in front of every caption ("WORD, caption"; not where it already is), the
    # clips' and data.image_path's images'
    trigger_word: str | None = key(None)
    # data.source=folder: how many times each video of data.path counts in an epoch, and more folders (or
    # manifests) with theirs, e.g. [{path: more_clips, repeats: 2}]: one dataset in all
    repeats: int = key(1, low=1)
    extra: list[Any] = key([])
    caption_dropout: float = key(0.1)
    num_workers: int = key(0, low=0)
    max_sequence_length: int = key(512, low=1)
    # joint image-video training, as Wan is trained: each step also trains on round(image_ratio * batch_size)
    # one-frame images (their own forward pass: another token count), the loss averaged over every sample;
    # 0 = videos only. Images: stills of the synthetic world (data.source=synthetic, rendered on the fly), a
    # folder of images (data.source=folder: data.image_path holds .png/.jpg/.webp with a .txt caption beside
    # each, or a manifest with columns image|file_name and caption|text) or a cache of either
    # (data.source=cache: data.image_path, written by training.precompute --images)
    image_ratio: float = key(0.0, low=0)
    image_path: str | None = key(None)
    # images to draw from (synthetic, and what precompute --images writes); null: num_samples
    image_num_samples: int | None = key(None, low=1)


@dataclass
class LoraSection:
    rank: int = key(32, low=1)
    alpha: int = key(32, low=0, above=True)
    target_modules: list[str] = key(["to_q", "to_k", "to_v", "to_out.0"])


@dataclass
class TrainSection:
    steps: int = key(1000, low=1)
    batch_size: int = key(1, low=1)  # per process
    grad_accum: int = key(1, low=1)
    trainable: str = key("all", choices=TRAINABLE)
    lr: float = key(2e-5, low=0, above=True)
    mixing_lr: float | None = key(None, low=0, above=True)  # lr of the MHLA mixing coefficients; null = lr
    betas: list[float] = key([0.9, 0.999])
    weight_decay: float = key(0.0, low=0)
    adam_eps: float = key(1e-10, low=0, above=True)
    warmup_steps: int = key(1000, low=0)
    # a new run that goes on with a schedule begun elsewhere: model.transformer holds weights trained this many steps
    # of it (a stage's committed weights on a fresh machine, e.g. factory.next's stage.json says which step). The
    # step count, checkpoints, logs, data order and lr schedule go on from it; the fresh optimiser warms up again
    # over its first warmup_steps. A resume keeps the step its run began at (its checkpoint's config)
    start_step: int = key(0, low=0)
    # after warm-up: constant | cosine (to min_lr_ratio * lr at train.steps)
    lr_schedule: str = key("constant", choices=LR_SCHEDULES)
    min_lr_ratio: float = key(0.1, low=0, high=1)
    grad_clip: float = key(0.1, low=0)
    precision: str = key("bf16", choices=PRECISIONS)  # autocast; master weights stay float32
    gradient_checkpointing: bool = key(True)
    # torch.compile of the transformer (mhla.compiled.compile_transformer): blocks = each repeated block compiled
    # once and reused by every layer (diffusers' compile_repeated_blocks; seconds), full = the whole forward; the
    # state dict, checkpoints and EMA are unchanged. Inductor fuses the work around the matmuls (norms, modulation,
    # GELU, residuals); a CPU needs a C++ compiler for it. none = eager
    compile: str = key("none", choices=("none", *COMPILE_MODES))
    seed: int = key(0, low=0, high=TRAIN_SEED_MAX)
    max_nonfinite: int = key(10, low=1)  # this many non-finite losses in a row stop the run
    ema_decay: float = key(0.0, low=0)  # moving average of the trained weights, e.g. 0.999; 0 = off (training/ema.py)
    # intra-op CPU threads for this run (torch.set_num_threads); null = torch's default (every core, or
    # OMP_NUM_THREADS); 0 = the cores other work leaves, measured again every minute (common/threads.py). A tiny
    # model's ops are each too small to share: with two threads every op waits for both, and on a busy machine for
    # the one that is descheduled (the smoke test: 1.6-20 s a step instead of 0.2 s)
    threads: int | None = key(None, low=0)
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass
class FlowSection:
    """object_weight > 0: the objects' latent cells weigh 1 + object_weight in the loss (flat-background data,
    training/flow.py); object_threshold marks them."""

    shift: float = key(3.0, low=0, above=True)
    weighting: str = key("logit_normal", choices=WEIGHTINGS)
    logit_mean: float = key(0.0)
    logit_std: float = key(1.0, low=0, above=True)
    object_weight: float = key(0.0, low=0)
    object_threshold: float = key(1.0, low=0, above=True)


@dataclass
class TransferSection:
    steps: int = key(0, low=0)  # attention transfer: this many steps before the train.steps ones (0 = off)
    lr: float = key(1e-4, low=0, above=True)


@dataclass
class DistillSection:
    """Output distillation (``train`` stage): the student's prediction also matches a frozen teacher's on the same
    noisy input, timestep and caption (a dropped caption included), clips and stills alike. The loss is
    ``(1 - weight) * flow + weight * mse(student, teacher)``, both with the flow section's object weighting.
    A converted model is far from its softmax base; the teacher's prediction is the base's estimate of the
    velocity's mean, so it carries what the base learned (shape at high noise) without the flow target's noise.
    teacher: a softmax (flash) transformer folder of the same architecture, e.g. the base's EMA."""

    teacher: str | None = key(None)
    weight: float = key(1.0, low=0, high=1)


@dataclass
class LogSection:
    every: int = key(10, low=1)
    tensorboard: bool = key(True)
    param_digest: bool = key(False)


@dataclass
class ValidationSection:
    every: int = key(0, low=0)  # steps between validation videos; 0 = none during training
    prompts: list[str] = key(["a red circle moves to the right on a grey background"])
    seeds: list[int] = key([0])
    num_inference_steps: int = key(50, low=1)
    guidance_scale: float = key(5.0, low=0)
    loss_batches: int = key(1, low=1)  # fixed batches (fixed noise) for the eval loss at start and end
    # steps between the conditioning probe (training/probe.py: the swap test on synthetic validation clips of
    # data.world) and the eval loss, both logged to metrics.jsonl; 0 = off. Synthetic worlds only.
    probe_every: int = key(0, low=0)
    probe_clips: int = key(8, low=1)
    # which clips the probe reads: validation (unseen: does the model generalise the words?) or train (the first
    # probe_clips clips of a synthetic cache or dataset: can it read the words of clips it has seen?)
    probe_split: str = key("validation", choices=PROBE_SPLITS)


@dataclass
class CheckpointSection:
    every: int = key(500, low=0)
    keep: int = key(3, low=0)  # the newest this many checkpoints; 0 = keep every one


@dataclass
class VaeSection:
    """task=vae only: crop size of training clips, KL weight, clips for the latent statistics, where to install it.
    trainable: all | decoder (the encoder, and so the latents and their statistics, stay as they are: a transformer
    trained on those latents stays valid while the decoder improves). latent_noise: Gaussian noise added to the
    posterior mean before decoding, in units of each latent channel's std over the batch (the decoder then also
    decodes the imperfect latents a transformer generates). edge_weight: L1 of the frames' horizontal and vertical
    pixel differences (object-weighted like the rest): corners and edges are a few pixels of a frame, so plain
    pixel losses let them go soft."""

    crop: int = key(64, low=8)
    kl_weight: float = key(1e-6, low=0)
    object_weight: float = key(10.0, low=0)
    latent_noise: float = key(0.0, low=0)
    edge_weight: float = key(0.0, low=0)
    stats_samples: int = key(64, low=1)
    export: str | None = key(None)
    trainable: str = key("all", choices=VAE_TRAINABLE)


@dataclass
class FinetuneConfig:
    """Every key a fine-tuning config may set, by section: ``configs/finetune/*.yaml`` and ``key=value`` overrides
    write over these defaults."""

    task: str = key("transformer", choices=TASKS)  # transformer (flow matching) | vae (training/vae.py)
    run_dir: str = key("runs/finetune")
    resume: str | None = key(None)  # null | latest | path to a checkpoint folder
    # true: a new run may replace an earlier run's files in run_dir (never mixed with them)
    overwrite: bool = key(False)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    flow: FlowSection = field(default_factory=FlowSection)
    transfer: TransferSection = field(default_factory=TransferSection)
    distill: DistillSection = field(default_factory=DistillSection)
    log: LogSection = field(default_factory=LogSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    vae: VaeSection = field(default_factory=VaeSection)


def _schema(cls: type, prefix: str = "") -> dict[str, tuple[Any, dict[str, Any]]]:
    """``{dotted key: (its type annotation, its field metadata)}`` of every leaf key of a section."""
    out: dict[str, tuple[Any, dict[str, Any]]] = {}
    hints = get_type_hints(cls)
    for f in fields(cls):
        name, hint = f"{prefix}{f.name}", hints[f.name]
        if isinstance(hint, type) and is_dataclass(hint):
            out.update(_schema(hint, name + "."))
        else:
            out[name] = (hint, dict(f.metadata))
    return out


def _plain(hint: Any) -> tuple[Any, bool]:
    """``(the type without None, whether None is allowed)`` of an annotation such as ``int | None``."""
    args = [a for a in get_args(hint) if a is not type(None)]
    nullable = type(None) in get_args(hint)
    return (args[0] if nullable and len(args) == 1 else hint), nullable


def _runtime_types(hint: Any) -> tuple[type, ...]:
    """What a value of an annotation may be: ``float`` takes integers too (``lr=1``), never a bool."""
    base = get_origin(hint) or hint
    table: dict[Any, tuple[type, ...]] = {
        float: (int, float),
        int: (int,),
        str: (str,),
        bool: (bool,),
        list: (list,),
        dict: (dict,),
    }
    return table[base]


SCHEMA = _schema(FinetuneConfig)
# every section's dotted name, outer ones first (train before train.lora), in the schema's order within a depth
SECTIONS: tuple[str, ...] = tuple(
    sorted(
        dict.fromkeys(".".join(k.split(".")[:i]) for k in SCHEMA for i in range(1, k.count(".") + 1)),
        key=lambda name: name.count("."),
    )
)
DEFAULTS: dict[str, Any] = asdict(FinetuneConfig())
_NUM = (int, float)
# the type of every key: its annotation (a float key takes an integer too; a null default takes null)
TYPES: dict[str, tuple[type, ...]] = {k: _runtime_types(_plain(hint)[0]) for k, (hint, _) in SCHEMA.items()}
NULLABLE = {k for k, (hint, _) in SCHEMA.items() if _plain(hint)[1]}
FREE_FORM = ("model.attention",)  # validated by pipelines.AttentionOptions
# key -> (lowest, lowest is allowed, highest or None): numbers outside are refused
RANGES: dict[str, tuple[Any, bool, Any]] = {
    k: (m["low"], not m["above"], m["high"]) for k, (_, m) in SCHEMA.items() if m.get("low") is not None
}
CHOICES: dict[str, tuple[Any, ...]] = {k: m["choices"] for k, (_, m) in SCHEMA.items() if m.get("choices")}
# list keys -> the type of their items
LIST_ITEMS: dict[str, tuple[type, ...]] = {
    k: _runtime_types(get_args(_plain(hint)[0])[0])
    for k, (hint, _) in SCHEMA.items()
    if get_origin(_plain(hint)[0]) is list and get_args(_plain(hint)[0])[0] is not Any
}


def lr_multiplier(schedule: str, warmup: int, total: int, min_ratio: float, start: int = 0) -> Callable[[int], float]:
    """``step -> factor of lr``: linear warm-up over ``warmup`` steps, then constant or a cosine down to
    ``min_ratio`` at step ``total`` (and ``min_ratio`` after it).

    ``start > 0`` (``train.start_step``): the steps are counted from ``start`` (the scheduler's step 0 is the
    schedule's step ``start``) and the schedule's factor there is reached by a linear warm-up over the run's first
    ``warmup`` steps (a fresh optimiser's moments), not by a jump.

    A plain function on purpose: ``LambdaLR`` does not save it in its state, so a run resumed with more
    ``train.steps`` follows the longer schedule from where it stopped.
    """
    warmup = max(1, warmup)
    if start:
        at = lr_multiplier(schedule, warmup, total, min_ratio)

        def resumed(step: int) -> float:
            return min(1.0, (step + 1) / warmup) * at(start + step)

        return resumed

    def factor(step: int) -> float:
        if step + 1 < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step + 1 - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> FinetuneConfig:
    """Defaults <- the YAML file <- ``key=value`` overrides (dotted keys, e.g. ``train.steps=10``), checked
    (:func:`check_types`, :func:`validate`) and returned as the typed :class:`FinetuneConfig`: each part of a run
    takes its own section (``cfg.data``, ``cfg.train``, ...)."""
    cfg = OmegaConf.create(DEFAULTS)
    OmegaConf.set_struct(cfg, True)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist (see configs/finetune/)")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml's ScannerError / ParserError and friends
            first = " ".join(str(e).split())[:300]
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {first}") from None
        if not isinstance(loaded, DictConfig):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of keys (e.g. 'train: {{steps: 10}}')")
        layers.append(loaded)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"overrides must look like key=value (e.g. train.steps=10), got {bad}")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        # model.attention is free-form (validated by AttentionOptions)
        with open_dict_at(cfg, "model.attention"):
            merged = OmegaConf.merge(cfg, *layers)
        tree = OmegaConf.to_container(merged, resolve=True)
    except Exception as e:  # omegaconf's ConfigKeyError and friends
        raise ValueError(f"bad configuration: {e}".splitlines()[0]) from None
    assert isinstance(tree, dict)  # a merge onto a mapping is a mapping
    plain: dict[str, Any] = {str(k): v for k, v in tree.items()}  # its keys are the schema's names
    check_types(plain)
    typed = build(FinetuneConfig, plain)
    validate(typed)
    return typed


S = TypeVar("S")


def build(cls: type[S], tree: Mapping[str, Any]) -> S:
    """The section ``cls`` (a dataclass of this schema) holding the values of ``tree`` (a plain mapping of every
    key, as :func:`check_types` checked it), the sections inside it built alike. Values are kept as they are (an
    integer ``lr`` stays an integer: a run's ``config.yaml`` is written as the config was given)."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]  # cls is one of the schema's dataclasses
        hint, value = hints[f.name], tree[f.name]
        values[f.name] = build(hint, value) if isinstance(hint, type) and is_dataclass(hint) else value
    return cls(**values)


def as_tree(cfg: FinetuneConfig) -> dict[str, Any]:
    """The config as plain nested dicts and lists, keys in the schema's order (what ``config.yaml`` holds)."""
    return asdict(cfg)


def config_yaml(cfg: FinetuneConfig) -> str:
    """The YAML a run writes as ``<run_dir>/config.yaml`` and into each checkpoint: every key, in the schema's order
    (:func:`load_config` of it gives the same config back; a resume compares against it)."""
    return OmegaConf.to_yaml(OmegaConf.create(as_tree(cfg)))


def select(cfg: Any, key: str) -> Any:
    """The value at dotted ``key`` (``"data.height"``) of a typed config, or of a plain mapping of one."""
    value = cfg
    for part in key.split("."):
        value = value[part] if isinstance(value, Mapping) else getattr(value, part)
    return value


class open_dict_at:
    """``with open_dict_at(cfg, "model.attention"):`` lets a merge add keys under that one node of a struct config."""

    def __init__(self, cfg: DictConfig, key: str) -> None:
        self.node = OmegaConf.select(cfg, key)

    def __enter__(self) -> None:
        OmegaConf.set_struct(self.node, False)

    def __exit__(self, *exc: object) -> None:
        return None


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in FREE_FORM:
            yield from _leaves(value, name + ".")
        else:
            yield name, value


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", bool: "true or false"}
    return names[float] if types == _NUM else " or ".join(names[t] for t in types)


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # bool is an int to Python, never a number here
        return bool in types
    if types == _NUM and isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, types)


def check_value(key: str, value: Any) -> None:
    """One key's value against the schema: its type (the field's annotation), null only where the annotation
    allows it, a list's items, a number's range and a value's choices. Raises ValueError naming key, value and
    expectation."""
    if key in FREE_FORM:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r}: expected a mapping of attention options")
        return
    types = TYPES[key]
    if value is None:
        if key in NULLABLE:
            return
        raise ValueError(f"{key}=null: expected {_type_name(types)}")
    if not _is(value, types):
        raise ValueError(f"{key}={value!r}: expected {_type_name(types)}")
    if key in LIST_ITEMS:
        bad = [x for x in value if not _is(x, LIST_ITEMS[key])]
        if bad:
            raise ValueError(f"{key}={value!r}: expected a list of {_type_name(LIST_ITEMS[key]).split(' ', 1)[1]}s")
    if key in RANGES:
        low, inclusive, high = RANGES[key]
        if value < low or (value == low and not inclusive) or (high is not None and value > high):
            span = f"{'>=' if inclusive else '>'} {low}" + ("" if high is None else f" and <= {high}")
            raise ValueError(f"{key}={value!r}: expected a value {span}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ValueError(f"{key}={value!r}: expected one of {CHOICES[key]}")


def check_types(tree: Mapping[str, Any]) -> None:
    """Every key of a plain mapping of a whole config against the schema (:class:`FinetuneConfig`), by
    :func:`check_value`."""
    for name in SECTIONS:  # a section given as null or as one value (train.lora=null) is named, not a crash
        node = select(tree, name)
        if not isinstance(node, Mapping):
            example = next(k for k in SCHEMA if k.startswith(name + "."))
            raise ValueError(f"{name}={node!r}: expected a section of keys (e.g. {example}=...), not a value")
    for key, _ in _leaves(DEFAULTS):
        check_value(key, select(tree, key))


def check_section(section: Any, prefix: str) -> None:
    """Every key of one section built in code (e.g. :class:`FlowSection` for ``training.flow.FlowMatching``)
    against the schema, named as ``prefix.key``: the checks a loaded config's keys get (:func:`check_value`)."""
    for key, value in _leaves(asdict(section), prefix + "."):
        check_value(key, value)


def validate(cfg: FinetuneConfig) -> None:
    """Checks across keys that need no model: raises ValueError naming the key, the value and what was expected."""

    def need(ok: bool, key: str, expected: str) -> None:
        if not ok:
            raise ValueError(f"{key}={select(cfg, key)!r}: expected {expected}")

    need(cfg.task != "vae" or bool(cfg.model.path), "model.path", "a model directory whose vae/ to train (task=vae)")
    for key in ("data.video_column", "data.caption_column"):
        value = select(cfg, key)
        need(value is None or bool(value.strip()), key, "null or a manifest column name")
    need(
        cfg.task != "vae" or cfg.train.precision in ("no", "bf16"),
        "train.precision",
        "'no' or 'bf16' for task=vae (its loop has no fp16 gradient scaler)",
    )
    need(cfg.data.num_frames >= 1 and (cfg.data.num_frames - 1) % 4 == 0, "data.num_frames", "4k+1 (e.g. 17, 81)")
    need(cfg.data.height % 16 == 0 and cfg.data.height > 0, "data.height", "a positive multiple of 16")
    need(cfg.data.width % 16 == 0 and cfg.data.width > 0, "data.width", "a positive multiple of 16")
    need(0 <= cfg.data.caption_dropout < 1, "data.caption_dropout", "a probability in [0, 1)")
    from world.synthetic import WORLDS

    need(cfg.data.world in WORLDS, "data.world", f"one of {sorted(WORLDS)}")
    backgrounds = WORLDS[cfg.data.world].backgrounds if cfg.data.world in WORLDS else ()
    need(
        cfg.data.default_background in (None, *backgrounds),
        "data.default_background",
        f"null or one of world {cfg.data.world}'s backgrounds {backgrounds}",
    )
    need(all(0 <= s <= SEED_MAX for s in cfg.validation.seeds), "validation.seeds", "seeds in [0, 2**63 - 1]")
    from common.errors import check_text

    for prompt in cfg.validation.prompts:
        check_text(prompt, "validation.prompts: a prompt")
    need(
        cfg.model.expert in (None, *EXPERTS),
        "model.expert",
        f"null or one of {EXPERTS} (the Wan2.2-A14B expert to train: transformer = high noise, transformer_2 = low)",
    )
    need(len(cfg.train.betas) == 2 and all(0 <= b < 1 for b in cfg.train.betas), "train.betas", "two numbers in [0, 1)")
    need(cfg.resume in (None, "latest") or Path(cfg.resume).is_dir(), "resume", "null, 'latest' or a checkpoint folder")
    need(cfg.train.ema_decay < 1, "train.ema_decay", "a decay in [0, 1) (0 = off, e.g. 0.999)")
    need(
        not (cfg.train.ema_decay and cfg.train.trainable == "lora"),
        "train.ema_decay",
        "0 with train.trainable=lora (the average is of full weights; LoRA adapters are merged at export)",
    )
    if cfg.model.lora is not None:
        need(
            cfg.train.trainable == "lora",
            "model.lora",
            f"null with train.trainable={cfg.train.trainable!r} (a LoRA to start from trains on as LoRA adapters: "
            "train.trainable=lora)",
        )
        need(Path(cfg.model.lora).exists(), "model.lora", "an existing LoRA folder (e.g. <run_dir>/final/lora) or file")
    need(
        cfg.data.source == "synthetic" or bool(cfg.data.path),
        "data.path",
        f"a folder for data.source={cfg.data.source}",
    )
    if cfg.data.path and cfg.data.source != "synthetic":
        need(Path(cfg.data.path).exists(), "data.path", "an existing folder or manifest")
    check_folder_keys(cfg.data, need)
    if cfg.data.image_ratio:
        need(
            cfg.data.source != "folder" or bool(cfg.data.image_path),
            "data.image_ratio",
            "0 with data.source=folder unless data.image_path names a folder of images (.png/.jpg/.webp with a .txt "
            "caption beside each, or a manifest with columns image|file_name and caption|text)",
        )
        need(
            cfg.data.source != "cache" or bool(cfg.data.image_path),
            "data.image_path",
            "a cache of images (python -m training.precompute --images) with data.source=cache and data.image_ratio > 0",
        )
        need(cfg.task == "transformer", "data.image_ratio", "0 with task=vae (its loop trains on clips)")
    if cfg.data.image_path:
        need(
            Path(cfg.data.image_path).is_dir() or (cfg.data.source == "folder" and Path(cfg.data.image_path).is_file()),
            "data.image_path",
            "an existing cache folder of images (python -m training.precompute --images), or with "
            "data.source=folder a folder of images with captions (or their manifest)",
        )
    if cfg.model.path and cfg.model.path != "tiny-random":
        need(
            Path(cfg.model.path).is_dir(),
            "model.path",
            "a local diffusers-format Wan directory (Wan2.1-T2V, Wan2.2-TI2V-5B or Wan2.2-T2V-A14B)",
        )
    if cfg.distill.teacher is not None:
        need(cfg.task == "transformer", "distill.teacher", "null with task=vae (its loop trains the VAE)")
        need(
            (Path(cfg.distill.teacher) / "config.json").is_file(),
            "distill.teacher",
            "a transformer folder with a config.json (a softmax one, e.g. assets/builtin-next/v3/transformer-ema)",
        )
    if cfg.train.start_step:
        need(
            cfg.train.start_step < cfg.train.steps,
            "train.start_step",
            f"a step before train.steps={cfg.train.steps} (the step model.transformer's weights were trained to)",
        )
        need(cfg.transfer.steps == 0, "train.start_step", "0 with transfer.steps > 0 (the schedule begins there)")
        need(cfg.task == "transformer", "train.start_step", "0 with task=vae (its loop starts at step 0)")
    if cfg.transfer.steps:
        need(
            cfg.model.variant != SOFTMAX,
            "model.variant",
            "a converted variant (attention transfer has no teacher to copy otherwise)",
        )


FOLDER_ONLY = {
    "data.fps": None,
    "data.trigger_word": None,
    "data.repeats": 1,
    "data.min_frames": None,
    "data.buckets": None,
    "data.bucket_sizes": None,
    "data.cache_windows": 1,
}  # keys of data.source=folder
EXTRA_KEYS = ("path", "repeats")


def check_folder_keys(data: DataSection, need: Callable[[bool, str, str], None]) -> None:
    """``data.fps``, ``data.min_frames``, ``data.buckets``, ``data.bucket_sizes``, ``data.cache_windows``,
    ``data.trigger_word``, ``data.repeats``, ``data.extra``: only with ``data.source=folder``
    (the synthetic world has no files; a cache's captions and clips were fixed when it was written, so there they
    go to ``training.precompute``), each of the right form."""
    source = data.source
    where = (
        "data.source=folder (a cache's clips and captions were fixed when it was written: give it to "
        "python -m training.precompute)"
        if source == "cache"
        else "data.source=folder (the synthetic world reads no files)"
    )
    for key, default in FOLDER_ONLY.items():
        value, shown = getattr(data, key.split(".")[1]), "null" if default is None else default
        need(value == default or source == "folder", key, f"{shown} with data.source={source!r}; it applies to {where}")
    need(not data.extra or source == "folder", "data.extra", f"[] with data.source={source!r}; it applies to {where}")
    need(
        data.fps is None or data.frame_stride == 1,
        "data.fps",
        f"null with data.frame_stride={data.frame_stride} (frames are taken either at a rate or every "
        "frame_stride-th): set one of them",
    )
    least = data.min_frames
    need(
        least is None or ((least - 1) % 4 == 0 and least <= data.num_frames),
        "data.min_frames",
        f"null or 4k+1 (e.g. 5, 9) at most data.num_frames={data.num_frames}",
    )
    pairs = data.bucket_sizes
    if pairs is not None:
        need(
            bool(pairs)
            and all(isinstance(p, list) and len(p) == 2 and all(_is(v, (int,)) and v > 0 for v in p) for p in pairs),
            "data.bucket_sizes",
            "null or a list of [height, width] pairs of positive integers, e.g. [[480, 832], [832, 480]]",
        )
        need(data.buckets is not False, "data.bucket_sizes", "null with data.buckets=false (no buckets)")
    trigger = data.trigger_word
    if trigger is not None:
        from common.errors import check_text

        need(
            bool(trigger.strip()) and trigger == trigger.strip(),
            "data.trigger_word",
            "null or a word (no spaces around)",
        )
        check_text(trigger, "data.trigger_word")
    for i, item in enumerate(data.extra):
        key = f"data.extra[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{key}={item!r}: expected a mapping like {{path: DIR, repeats: 2}}")
        unknown = sorted(set(item) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown}; expected {{path: DIR, repeats: N}} (repeats optional)")
        path, repeats = item.get("path"), item.get("repeats", 1)
        if not isinstance(path, str) or not path or not Path(path).exists():
            raise ValueError(f"{key}.path={path!r}: expected an existing folder of videos with captions, or a manifest")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"{key}.repeats={repeats!r}: expected an integer >= 1 (times each video counts an epoch)")


def check_data_source(data: DataSection) -> None:
    """A training run reads the data ``data.source`` names: a ``data.path`` beside ``data.source=synthetic`` (which
    renders the synthetic world and reads no path) would be ignored, so it is refused, naming the sources that
    read a path. Not part of :func:`validate`: ``training.precompute`` renders a config's synthetic clips into
    the cache its ``data.path`` names (``data.source=synthetic`` on the command line)."""
    if data.source == "synthetic" and data.image_path:
        raise ValueError(
            f"data.image_path={data.image_path!r} is set but data.source='synthetic' renders the world's stills "
            "and reads no path; expected data.source=folder (a folder of images with captions) or data.source=cache "
            "(a cache written by python -m training.precompute --images) with it, or data.image_path=null"
        )
    if data.source == "synthetic" and data.path:
        raise ValueError(
            f"data.path={data.path!r} is set but data.source='synthetic' renders the synthetic world and reads "
            "no path; expected data.source=folder (a folder of videos with captions, or a manifest) or "
            "data.source=cache (a cache written by python -m training.precompute) with it, or data.path=null"
        )

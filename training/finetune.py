"""Fine-tune a Wan transformer converted to MHLA, linear or hybrid MHLA self-attention: Wan2.1-T2V, Wan2.2-TI2V-5B,
or one expert of Wan2.2-T2V-A14B at a time (``model.expert``, :mod:`training.experts`).

    python -m training.finetune --config configs/finetune/tiny.yaml                  # CPU smoke test
    python -m training.finetune --config configs/finetune/wan2.1-1.3b-mhla.yaml model.path=... data.path=...
    python training/finetune.py --config ...                                         # the same, as a script
    accelerate launch --num_processes 8 training/finetune.py --config ...             # DDP (or FSDP via accelerate config)
    torchrun --nproc_per_node 8 training/finetune.py --config ...

The file reads top to bottom as the recipe: configuration, model and conversion, data, the optional
attention-transfer stage, the flow-matching loop, checkpoints. Distribution is accelerate's. Every run ends by
saving its model to ``<run_dir>/final/transformer`` (``python -m pipelines.cli --transformer`` loads it),
whatever ``checkpoint.every`` says (a LoRA run also its adapters in diffusers' format, ``final/lora``:
``WanPipeline.load_lora_weights``, ``pipelines.cli --lora``, ``model.lora``); ``resume=latest`` on a finished
run says so and exits.
A config with ``task: vae`` trains the model directory's VAE instead (:mod:`training.vae`; the
built-in model's first stage, ``factory/configs/vae.yaml``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from common import threads as threads_mod
from common.errors import ModelError, OutputError, Terminated, run_cli, write_failure
from common.outputs import write_text_atomic
from common.video import write_mp4
from pipelines import (
    AttentionOptions,
    GenerationRequest,
    WanComponents,
    latent_grid,
    load_transformer,
    save_transformer,
)
from pipelines.attention import PARAM_ATTRS, LinearSelfAttention, variant_spec
from pipelines.lora import LoraAdapters, load_into_adapter, read_lora, save_lora
from pipelines.pipeline import generate
from training import checkpoint as ckpt
from training.config import (
    CheckpointSection,
    DataSection,
    DistillSection,
    FinetuneConfig,
    LoraSection,
    ModelSection,
    TrainSection,
    TransferSection,
    ValidationSection,
    as_tree,
    check_data_source,
    config_yaml,
    load_config,
    lr_multiplier,
)
from training.data import (
    BatchEncoder,
    BucketBatchSampler,
    CachedLatents,
    ResumableSampler,
    VideoFolderDataset,
    batch_groups,
    build_dataset,
    build_validation_dataset,
    collate,
    data_loader,
    image_batch_size,
    make_sampler,
)
from training.ema import EMA
from training.encoding import Encoder
from training.experts import TrainingTarget, load_expert_components, model_timestep, read_target
from training.flow import FlowMatching
from training.lock import hold_run_dir, is_main_launch
from training.preflight import begun_at, check_model_plan, check_resume_matches, trained_text_mask

# --------------------------------------------------------------------------- model


def build_model(
    model: ModelSection, data: DataSection, device: torch.device, target: TrainingTarget | None = None
) -> tuple[WanComponents, Any, tuple[int, int, int]]:
    """Components (tokenizer, text encoder, VAE frozen) and the converted transformer in float32: the model's
    ``transformer/``, or the expert ``target`` names (``model.expert``; the other one is not loaded), converted as
    the model section says for the training grid of the data section's clip size."""
    target = read_target(model) if target is None else target
    components = load_expert_components(model, target, device)
    transformer = components.transformer
    if model.transformer:
        transformer = load_transformer(model.transformer, dtype=torch.float32, device=device)
    transformer = transformer.float()  # master weights in float32; autocast does the mixed precision
    if model.mask_text_padding is not None:
        transformer.set_text_padding_mask(model.mask_text_padding)
    for part in (components.text_encoder, components.vae):
        part.requires_grad_(False)

    patch = tuple(transformer.config.patch_size)
    grid = latent_grid(data.height, data.width, data.num_frames, patch, target.vae_stride)
    # the block rule: the config's blocks (they must fit the training grid: a ValueError names the axis), else
    # the transformer's own (a fine-tuned MHLA checkpoint's), else the default for the model's block shape
    blocks = transformer.resolve_blocks(grid, model.blocks or None, components.block_shape).blocks
    options = AttentionOptions(blocks=blocks, **model.attention)  # free-form: checked by preflight.check_model_plan
    transformer.convert(model.variant, layers_to_train(model, transformer), options)
    components.transformer = transformer
    return components, transformer, grid


def layers_to_train(model: ModelSection, transformer: Any) -> list[int] | None:
    """The MHLA layers of an ``mhla-hybrid`` run: ``model.layers`` when given, else the loaded transformer's own
    split when it already is that variant (a fine-tuned hybrid with softmax in layers 4 and 5 goes on as one, not
    silently re-split to the default), else None (:func:`pipelines.attention.hybrid_layers`)."""
    if model.layers is not None:
        return list(model.layers)
    conversion = transformer.conversion
    if variant_spec(model.variant).layers and conversion.variant == model.variant:
        return list(conversion.linear_layers)
    return None


def new_parameter_names(transformer: Any) -> set[str]:
    return {n for n, _ in transformer.named_parameters() if any(f".attn1.{a}." in n for a in PARAM_ATTRS.values())}


def select_trainable(transformer: Any, train: TrainSection, variant: str) -> list[str]:
    """Sets ``requires_grad`` by ``train.trainable``; returns the trainable parameter names.

    all: every transformer weight. attention: the self-attention layers (projections, q/k norms, new
    parameters). new: only MHLA's / linear attention's own parameters. lora: LoRA adapters (peft) on
    ``train.lora.target_modules`` plus the new parameters.
    """
    mode = train.trainable
    new = new_parameter_names(transformer)
    if mode == "lora":
        from peft import LoraConfig

        transformer.requires_grad_(False)
        lora = train.lora
        transformer.add_adapter(
            LoraConfig(
                r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), init_lora_weights=True
            )
        )
    for name, p in transformer.named_parameters():
        if mode == "all":
            p.requires_grad_(True)
        elif mode == "attention":
            p.requires_grad_(".attn1." in name)
        elif mode == "new":
            p.requires_grad_(name in new)
        else:  # lora: adapters were made trainable by peft; add the new attention parameters
            p.requires_grad_(p.requires_grad or name in new)
    names = [n for n, p in transformer.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError(f"train.trainable={mode!r} leaves nothing to train for model.variant={variant!r}")
    return names


def param_groups(transformer: Any, lr: float, mixing_lr: float | None) -> list[dict[str, Any]]:
    """AdamW groups: the MHLA mixing coefficients may learn at their own rate."""
    mixing: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for name, p in transformer.named_parameters():
        if p.requires_grad:
            (mixing if name.endswith("mixing.weight") else rest).append(p)
    groups = [{"params": rest, "lr": lr, "name": "weights"}]
    if mixing:
        groups.append({"params": mixing, "lr": mixing_lr or lr, "name": "mixing"})
    return [g for g in groups if g["params"]]


def project_mixing(transformer: Any) -> None:
    """Clip the stored mixing coefficients to [0, 1] and renormalise rows after each update (paper 4.2)."""
    for module in transformer.modules():
        if isinstance(module, LinearSelfAttention) and module.mhla is not None:
            module.mhla.mixing.project_()


def save_model_for_pipeline(transformer: Any, folder: Path, lora: bool) -> None:
    """The transformer in the pipeline's save format; LoRA adapters are merged into a copy first."""
    if lora:
        transformer = copy.deepcopy(transformer)
        transformer.fuse_lora()
        transformer.unload_lora()
    save_transformer(transformer, folder)


def check_start_lora(model: ModelSection, lora: LoraSection) -> LoraAdapters:
    """``model.lora`` read and checked against the run before any model loads: its rank and alpha against
    ``train.lora`` (the run's adapter is made with those), its modules against ``train.lora.target_modules``, and a
    linear / MHLA run's attention parameters against ``model.variant``. Returns the adapters; ValueError names
    the key, the value and the setting that would fit."""
    from pipelines.lora import module_kinds, targeted

    path = model.lora
    assert path is not None  # called for a run with model.lora
    adapters = read_lora(path, "model.lora")
    if adapters.rank != lora.rank or adapters.alpha != float(lora.alpha):
        raise ValueError(
            f"model.lora={path!r} holds adapters of rank {adapters.rank}, alpha {adapters.alpha:g}; this run makes "
            f"rank {lora.rank}, alpha {lora.alpha:g} (train.lora): expected train.lora.rank={adapters.rank} "
            f"train.lora.alpha={adapters.alpha:g} to train them on"
        )
    outside = [m for m in adapters.modules if not targeted(m, lora.target_modules)]
    if outside:
        kinds = module_kinds(outside)
        raise ValueError(
            f"model.lora={path!r} adapts modules train.lora.target_modules={list(lora.target_modules)} does not "
            f"({', '.join(kinds[:6])}); expected train.lora.target_modules to include them, e.g. "
            f"train.lora.target_modules=[{','.join(sorted(set(lora.target_modules) | set(kinds)))}]"
        )
    if adapters.attention is not None and adapters.attention_state is not None and adapters.variant != model.variant:
        raise ValueError(
            f"model.variant={model.variant!r}: model.lora={path!r} holds {adapters.variant} attention "
            f"parameters ({adapters.attention.name}) trained with its adapters; expected "
            f"model.variant={adapters.variant} to train on from them"
        )
    if adapters.variant != model.variant and is_main_launch():
        print(
            f"note: model.lora={path!r} was trained as variant {adapters.variant}; this run trains it on as "
            f"{model.variant}",
            file=sys.stderr,
        )
    return adapters


def lora_info(model: ModelSection, lora: LoraSection, step: int) -> dict[str, Any]:
    """What a LoRA run's adapter file says about it (:func:`pipelines.lora.save_lora`): variant, base model, step."""
    from pipelines import BUILTIN_DIR

    return {
        "variant": model.variant,
        "base_model": str(model.path or BUILTIN_DIR),
        "transformer": model.transformer,
        "expert": model.expert,
        "step": int(step),
        "rank": int(lora.rank),
        "alpha": lora.alpha,
    }


@dataclass(frozen=True)
class ModelCall:
    """The transformer called as diffusers' ``WanPipeline`` calls it: with ``expand_timesteps`` (Wan2.2-TI2V) the
    timestep per token (:func:`training.experts.model_timestep`), else per sample. Returns the prediction."""

    expand_timesteps: bool = False
    patch_size: tuple[int, ...] = (1, 2, 2)

    def __call__(self, model: Any, x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        timestep = model_timestep(t, x_t, self.patch_size, self.expand_timesteps)
        return model(hidden_states=x_t, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]


# --------------------------------------------------------------------------- output distillation

TEACHER_MATCH = ("patch_size", "in_channels", "out_channels", "text_dim", "num_attention_heads", "attention_head_dim")


def load_teacher(distill: DistillSection, student: Any, device: torch.device) -> Any | None:
    """The frozen teacher of output distillation (``distill.teacher``), float32, checked against the student: a
    softmax transformer whose inputs and outputs are the student's (patch, channels, text width, heads)."""
    if distill.teacher is None:
        return None
    teacher = load_transformer(distill.teacher, dtype=torch.float32, device=device)
    state = teacher.config.get("self_attention") or {}
    if state.get("linear_layers"):
        raise ValueError(
            f"distill.teacher={distill.teacher!r}: expected a softmax (flash) transformer; it has "
            f"{len(state['linear_layers'])} self-attention layers converted to {state.get('variant')!r}"
        )
    for name in TEACHER_MATCH:
        have, want = (_plain(m.config.get(name)) for m in (teacher, student))
        if have != want:
            raise ValueError(
                f"distill.teacher={distill.teacher!r}: its {name} is {have!r}, the trained transformer's {want!r}; "
                "expected a teacher of the same inputs and outputs"
            )
    return teacher.requires_grad_(False).eval()


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


@dataclass
class Distillation:
    """``distill``'s loss for one forward: ``(1 - weight) * flow + weight * match``, where ``match`` is the flow
    loss's weighted squared error against the teacher's prediction on the same input. Returns both."""

    teacher: Any
    weight: float
    call: ModelCall
    flow: FlowMatching

    def __call__(
        self,
        pred: torch.Tensor,
        x_t: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor,
        velocity: torch.Tensor,
        latents: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            target = self.call(self.teacher, x_t, t, text)
        match = self.flow.loss(pred, target, latents)
        if self.weight >= 1:
            return match, match
        return (1 - self.weight) * self.flow.loss(pred, velocity, latents) + self.weight * match, match


# --------------------------------------------------------------------------- attention transfer


class AttentionTransfer:
    """Per-layer MSE between each converted self-attention layer and a frozen copy of the original softmax layer,
    on the same input. Only while active; the copies are made before the model trains."""

    def __init__(self, transformer: Any, layers: list[int]) -> None:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.teachers = {}
        for i in layers:
            teacher = copy.deepcopy(transformer.blocks[i].attn1)
            for attr in PARAM_ATTRS.values():
                if hasattr(teacher, attr):
                    delattr(teacher, attr)
            teacher.set_processor(WanAttnProcessor())
            self.teachers[i] = teacher.requires_grad_(False).eval()
        self.losses: list[torch.Tensor] = []
        self.handles = [
            transformer.blocks[i].attn1.register_forward_hook(self._hook(i), with_kwargs=True) for i in layers
        ]

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> None:
            # WanTransformerBlock calls attn1(hidden_states, None, None, rotary_emb)
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            rotary = kwargs.get("rotary_emb", args[3] if len(args) > 3 else None)
            with torch.no_grad():
                target = self.teachers[i](hidden, None, None, rotary)
            self.losses.append(F.mse_loss(output.float(), target.float()))

        return hook

    def take_loss(self) -> torch.Tensor:
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.teachers.clear()


# --------------------------------------------------------------------------- the loop


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a YAML file in configs/finetune/")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=10 resume=latest")
    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    return p.parse_args(argv)


def make_optimizer(
    transformer: Any, train: TrainSection, transfer: TransferSection, stage: str
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule for a stage: ``train`` (the train section's rates, betas and schedule) or
    ``transfer`` (attention transfer: the transfer section's rate, constant; the train section's betas)."""
    lr = transfer.lr if stage == "transfer" else train.lr
    mixing_lr = transfer.lr if stage == "transfer" else train.mixing_lr
    groups = param_groups(transformer, lr, mixing_lr)
    beta1, beta2 = train.betas  # two: training.config.validate
    opt = torch.optim.AdamW(groups, betas=(beta1, beta2), eps=train.adam_eps, weight_decay=train.weight_decay)
    if stage == "train":
        factor = lr_multiplier(
            train.lr_schedule, train.warmup_steps, train.steps, train.min_lr_ratio, start=train.start_step
        )
    else:
        factor = lr_multiplier("constant", 1, transfer.steps, 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return opt, sched


def set_stage_trainable(transformer: Any, stage: str, trainable: list[str], converted: list[int]) -> None:
    """Transfer stage: only the converted layers' attention trains. End-to-end: ``train.trainable``."""
    names = set(trainable)
    prefixes = tuple(f"blocks.{i}.attn1." for i in converted)
    for name, p in transformer.named_parameters():
        p.requires_grad_(name in names and (stage == "train" or name.startswith(prefixes)))


def digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """``python -m training.finetune --config FILE [key=value ...]``, behind the error boundary of
    :func:`common.errors.run_cli` (exit codes there; 3: non-finite losses, 4: a checkpoint could not be written)."""
    return run_cli(_main, argv, prog="training.finetune")


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)  # every key's type and range
    check_data_source(cfg.data)  # a data.path the source would not read
    if cfg.task == "vae":  # the VAE stage's configs say task: vae; it has its own entry point
        from training import vae

        return vae.main(argv)
    target = check_model_plan(cfg)  # model.* against the model's config files, before the run folder is touched
    with hold_run_dir(cfg.run_dir), intra_op_threads(cfg.train.threads):  # one run per folder, for its life
        try:
            return train(cfg, target)
        except (KeyboardInterrupt, Terminated):
            if is_main_launch():
                print(interrupted_note(cfg.run_dir, cfg.checkpoint), file=sys.stderr)
            raise


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """``train.threads``: torch's intra-op CPU threads for the run, and the caller's count back afterwards (a run in
    a test's process leaves its thread count as it was). None: torch's default is left alone. A tiny model's ops
    are each too small to share between threads: with two, every op waits for both, and on a busy 2-core machine
    for the one the scheduler has just taken away (the smoke test's steps took 1.6-20 s instead of 0.2 s).
    0: the cores other work leaves (``common.threads.pick``), set here and again every :data:`THREADS_EVERY_S`
    by :class:`ThreadFollower` in the training loop."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads or threads_mod.pick() or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


THREADS_EVERY_S = 60.0  # train.threads = 0: how often the other work is measured again (0.2 s each time)


class ThreadFollower:
    """``train.threads = 0`` on a CPU: every :data:`THREADS_EVERY_S` of the loop, torch's threads set again to the
    cores other work leaves (``common.threads.pick``): a background run on a shared machine takes both cores when
    they are free and one when another job holds one (two threads then wait on the descheduled one after every op:
    the built-in model's joint step took 13-135 s instead of 3.7 s with one thread at a load of ~5)."""

    def __init__(self, threads: int | None, device: torch.device, every_s: float = THREADS_EVERY_S):
        self.on = threads == 0 and device.type == "cpu"
        self.every_s = every_s
        self.last = time.monotonic()

    def __call__(self) -> int | None:
        """Between steps: the thread count set now, None when it was not time (or the policy is off)."""
        if not self.on or time.monotonic() - self.last < self.every_s:
            return None
        self.last = time.monotonic()
        picked = threads_mod.pick()
        if picked is not None and picked != torch.get_num_threads():
            torch.set_num_threads(picked)
        return picked


def interrupted_note(run_dir: str, checkpoint: CheckpointSection) -> str:
    """What a stopped run (Ctrl-C, SIGTERM) of ``run_dir`` can do next: resume=latest from its newest checkpoint."""
    found = ckpt.list_checkpoints(run_dir)
    if found:
        return (
            f"stopped: continue this run from its newest checkpoint ({found[-1]}) with the same command and "
            "resume=latest"
        )
    return (
        f"stopped before its first checkpoint (checkpoint.every={checkpoint.every}): the same command with "
        "resume=latest starts it over (nothing to continue from)"
    )


@dataclass
class Progress:
    """Where the run is: what a checkpoint saves and a resume restores."""

    step: int = 0
    samples: int = 0
    nonfinite: int = 0
    images: int = 0  # one-frame samples of joint image-video training this rank consumed


def fresh_progress(train: TrainSection, images: ImageStream | None) -> Progress:
    """Where a new run starts: step 0, or ``train.start_step`` with the data orders where a run that had trained
    that many steps of this config would be (each rank's clips and images: its share of every step's batch)."""
    steps = train.start_step
    per_step = train.batch_size * train.grad_accum
    stills = 0 if images is None else images.size * train.grad_accum
    return Progress(steps, steps * per_step, 0, steps * stills)


class ImageStream:
    """The images of joint image-video training (``data.image_ratio``): their dataset, its resumable order
    (its own: a run's clips and images are drawn apart) and the batches of ``data.image_ratio * batch_size``."""

    def __init__(
        self, data: DataSection, train: TrainSection, dataset: Any, batches: BatchEncoder, rank: int, world: int
    ) -> None:
        self.dataset, self.batches, self.size = dataset, batches, image_batch_size(data, train.batch_size)
        self.sampler = ResumableSampler(len(dataset), seed=train.seed + 1, rank=rank, world_size=world)
        self.num_workers = data.num_workers
        self._iter: Iterator[dict[str, Any]] | None = None

    def next_batch(self, consumed: int) -> dict[str, Any]:
        """The next batch after ``consumed`` images (a new stage or a resume restarts the order there)."""
        if self._iter is None:
            self.sampler.samples_consumed = consumed
            loader = DataLoader(
                self.dataset,
                batch_size=self.size,
                sampler=self.sampler,
                num_workers=self.num_workers,
                drop_last=True,
                collate_fn=collate,
            )
            self._iter = iter(loader)
        return next(self._iter)


def train(cfg: FinetuneConfig, target: TrainingTarget | None = None) -> int:
    """The recipe: checks, model, data, resume, then the flow-matching loop with its checkpoints."""
    from accelerate import Accelerator, DistributedDataParallelKwargs  # type: ignore[import-untyped]

    # ---- everything that needs no model: a bad key, layer, layout, resume or dataset stops here
    replaced = ckpt.check_new_run(cfg.run_dir, cfg.resume, cfg.overwrite)  # never two runs in one folder
    resume_from = ckpt.resolve_resume(cfg.resume, cfg.run_dir)
    if resume_from is not None:
        check_resume_matches(cfg, resume_from)
        if cfg.model.mask_text_padding is None:  # null: as the checkpoint was trained, not model.transformer
            cfg.model.mask_text_padding = trained_text_mask(cfg, resume_from)
        begun = begun_at(resume_from)  # the schedule's offset is the run's own (train.start_step)
        if begun != cfg.train.start_step:
            if is_main_launch():
                print(
                    f"note: train.start_step={cfg.train.start_step} is for a new run; {resume_from.name} belongs to "
                    f"a run that began at step {begun}, and its schedule goes on from there",
                    file=sys.stderr,
                )
            cfg.train.start_step = begun
        if (Path(cfg.run_dir) / "metrics.jsonl").is_file():  # a damaged log is named before the model loads
            with warnings.catch_warnings():  # a half-written last row: said once, when it is dropped
                warnings.simplefilter("ignore")
                ckpt.read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    total_steps = cfg.transfer.steps + cfg.train.steps
    if finished_run(cfg, resume_from, total_steps):  # said, nothing written
        return 0
    dataset = build_dataset(cfg.data, cfg.train.seed, cfg.model)
    if isinstance(dataset, VideoFolderDataset):  # a folder of videos: read before the model loads
        short = dataset.check_clip_lengths()  # most videos too short for data.num_frames: refused here
        if short and is_main_launch():
            print(short, file=sys.stderr)
        if dataset.needs_probe:  # aspect and length buckets: every video's size and length
            shapes = dataset.probe_shapes(progress=is_main_launch())
            if shapes and is_main_launch():
                print(shapes, file=sys.stderr)
        dataset.require_usable()
    image_set = (  # a cache's shape checked now
        build_dataset(cfg.data, cfg.train.seed, cfg.model, images=True)
        if image_batch_size(cfg.data, cfg.train.batch_size)
        else None
    )
    if isinstance(image_set, VideoFolderDataset):  # a folder of images: one that opens, and the dropped ones named
        image_set.require_usable()
        if image_set.dropped and is_main_launch():
            print(image_set.skip_summary(), file=sys.stderr)
    start_lora = (  # read and checked now
        check_start_lora(cfg.model, cfg.train.lora) if cfg.model.lora and resume_from is None else None
    )
    if isinstance(dataset, VideoFolderDataset) and dataset.dropped and is_main_launch():  # named now, not at the end
        print(dataset.skip_summary(), file=sys.stderr)
    if resume_from is not None:  # the data order against the checkpoint's: a changed dataset is said, not refused
        for note in check_resume_data(cfg.resume, cfg.train.seed, resume_from, dataset, image_set):
            if is_main_launch():
                print(note, file=sys.stderr)
    run_dir = Path(cfg.run_dir)
    accelerator = Accelerator(
        mixed_precision=cfg.train.precision,
        gradient_accumulation_steps=cfg.train.grad_accum,
        log_with="tensorboard" if cfg.log.tensorboard else None,
        project_dir=str(run_dir),
        cpu=not torch.cuda.is_available(),  # several CPU processes (torchrun / accelerate launch) then use gloo
        # the transfer stage leaves non-attention weights without gradients
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=cfg.transfer.steps > 0)],
    )
    main_proc, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world:
        raise RuntimeError(f"launched as {launched} processes but accelerate set up {world}; check the launcher")
    device = accelerator.device
    print_main = accelerator.print  # prints on the main process only
    if cfg.train.threads is not None:  # set by _main for the run (intra_op_threads)
        how = "the cores other work leaves, measured every minute" if cfg.train.threads == 0 else "train.threads"
        print_main(f"CPU threads: {torch.get_num_threads()} ({how})")
    follow_threads = ThreadFollower(cfg.train.threads, device)
    if main_proc:  # what writers of a killed run left mid-write (this run holds the lock: none of them is alive)
        ckpt.sweep_temporaries(run_dir)
    if replaced and main_proc:
        print_main(f"overwrite=true: removing the earlier run's {len(replaced)} file(s) and folder(s) in {run_dir}")
        left = ckpt.clear_run(run_dir)  # only what its run manifest lists
        if left:
            shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            print_main(f"overwrite=true: left in place (not written by the earlier run): {shown}")
    accelerator.wait_for_everyone()
    torch.manual_seed(cfg.train.seed)

    # ---- model
    # which transformer trains, on which noise levels, called how (the model folder read once per run)
    target = read_target(cfg.model) if target is None else target
    components, transformer, grid = build_model(cfg.model, cfg.data, device, target)
    trainable = select_trainable(transformer, cfg.train, cfg.model.variant)
    if start_lora is not None:  # a resume loads the checkpoint's adapters instead
        uncovered = load_into_adapter(transformer, start_lora, "model.lora")
        print_main(f"adapters from model.lora={cfg.model.lora} ({start_lora.describe()})")
        if uncovered:
            print_main(
                f"note: model.lora has no adapter for {len(uncovered)} adapted modules (they start at zero), e.g. {uncovered[:3]}"
            )
    state = transformer.config["self_attention"]
    converted = state["linear_layers"]
    if cfg.train.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if cfg.train.compile != "none":  # in place: parameters, state dict and hooks stay the module's own
        from mhla.compiled import compile_transformer

        compile_transformer(transformer, cfg.train.compile)
        print_main(f"train.compile={cfg.train.compile}: the first steps of each input shape compile (about a minute)")
    transformer.train()
    n_train = sum(p.numel() for n, p in transformer.named_parameters() if n in set(trainable))
    print_main(
        f"model: {components.source} [{target.describe()}]; variant {state['variant']} ({len(converted)} of {len(transformer.blocks)} "
        f"self-attention layers converted), grid {'x'.join(map(str, grid))} = {math.prod(grid)} tokens, "
        f"{n_train / 1e6:.2f}M trainable parameters ({cfg.train.trainable})"
    )
    if components.random_weights:
        print_main(
            "NOTE: the tiny random-weight model (tiny-random) has RANDOM weights: this run checks the recipe, not video quality"
        )

    # ---- data (the dataset was built and checked before the model)
    # a batch of one clip shape: aspect / length buckets, or a cache of them (one shape: the order it always had)
    sampler = make_sampler(dataset, cfg.train.batch_size, seed=cfg.train.seed, rank=rank, world_size=world)
    flow = FlowMatching(
        cfg.flow,
        sigma_range=target.sigma_range,  # an A14B expert's share of the noise levels
        num_train_timesteps=target.num_train_timesteps,
    )
    call = ModelCall(target.expand_timesteps, tuple(transformer.config.patch_size))
    teacher = load_teacher(cfg.distill, transformer, device)
    distill = None if teacher is None else Distillation(teacher, cfg.distill.weight, call, flow)
    if distill is not None:
        print_main(f"output distillation from {cfg.distill.teacher} (weight {cfg.distill.weight} of the loss)")
    cached = isinstance(dataset, CachedLatents)  # data.source=cache: latents and text embeddings stored
    batches = BatchEncoder(
        None if cached else Encoder(components, cfg.data.max_sequence_length),
        dataset.empty_text if isinstance(dataset, CachedLatents) else None,
        cfg.data.caption_dropout,
        device,
    )
    images = None
    if image_set is not None:
        empty = image_set.empty_text if isinstance(image_set, CachedLatents) else None
        images = ImageStream(
            cfg.data,
            cfg.train,
            image_set,
            BatchEncoder(batches.encoder, empty, cfg.data.caption_dropout, device),
            rank,
            world,
        )
        print_main(
            f"joint image-video training: {images.size} images (1x{grid[1]}x{grid[2]} tokens) beside each step's "
            f"{cfg.train.batch_size} clips, from {len(image_set)} images"
        )

    # ---- resume
    at = fresh_progress(cfg.train, images)
    new_run = resume_from is None
    if cfg.train.start_step and new_run:
        print_main(
            f"train.start_step={at.step}: the weights of model.transformer go on at step {at.step} of "
            f"{total_steps}; a fresh optimiser warms up to the schedule's lr there over {cfg.train.warmup_steps} steps"
        )
    generator = torch.Generator(device=device).manual_seed(cfg.train.seed * 1000 + rank)
    resume_state, ema = None, None
    if resume_from is not None:
        print_main(f"resuming from {resume_from} (its files match its manifest)")
        resume_state, rank_state = ckpt.restore_run(
            resume_from, transformer, cfg.train.trainable == "lora", world, rank, folder=target.expert
        )
        if cfg.train.trainable != "lora" and resume_state.get("ema_updates") is not None and cfg.train.ema_decay:
            # transformer/ holds the averages: they are the shadows; the raw weights train on
            ema = EMA(transformer, trainable, cfg.train.ema_decay, updates=resume_state["ema_updates"])
        if cfg.train.trainable != "lora":
            ckpt.restore_raw_weights(resume_from, transformer)
        generator.set_state(rank_state["generator"])
        restore_order(sampler, rank_state["data"])
        at = Progress(
            resume_state["step"],
            rank_state["data"]["samples_consumed"],
            resume_state["nonfinite_in_a_row"],
            # a run that had no images (or a checkpoint from before them) starts their order at its beginning
            (rank_state.get("images") or {}).get("samples_consumed", 0),
        )
        if images is not None and rank_state.get("images"):
            restore_order(images.sampler, rank_state["images"])
        print_main(f"resumed from {resume_from} at step {at.step}")
    if cfg.train.ema_decay and ema is None:  # a new run, or EMA switched on for a resumed one
        ema = EMA(transformer, trainable, cfg.train.ema_decay)

    evaluate = EvalLoss(cfg.data, cfg.train, cfg.validation, dataset, batches, flow, accelerator, call)
    metrics = Metrics(run_dir / "metrics.jsonl", main_proc)
    if main_proc:
        run_dir.mkdir(parents=True, exist_ok=True)
        # every file the run writes is listed in its run manifest first: overwrite=true removes those, nothing else
        skipped = ["skipped.json"] if hasattr(dataset, "skipped_paths") else []
        tensorboard = ["finetune"] if cfg.log.tensorboard else []
        ckpt.record_run_files(run_dir, "config.yaml", "metrics.jsonl", *skipped, *tensorboard)
        write_text_atomic(run_dir / "config.yaml", config_yaml(cfg))
        write_skipped(run_dir, dataset)
        metrics.start(0 if new_run else at.step, end_of_run=at.step >= total_steps)
    if cfg.log.tensorboard:
        # a resumed run: what the stopped run logged after the checkpoint is redone, so it is cut from the earlier
        # event files (every reader then sees each step once) and TensorBoard is told to purge it too
        # (a resume at the run's end redoes its end-of-run evaluation: finish_run)
        if not new_run and at.step and main_proc:
            redone = ("eval_loss", "eval_loss_ema") if at.step >= total_steps else ()
            trim_event_files(run_dir / "finetune", at.step, redone)
        purge = {"tensorboard": {"purge_step": at.step + 1}} if at.step else {}
        config = {k: str(v) for k, v in as_tree(cfg).items()}
        accelerator.init_trackers("finetune", config=config, init_kwargs=purge)
    start_loss = evaluate(transformer)
    if new_run:
        metrics.write({"step": at.step, "eval_loss": start_loss})
        if cfg.log.tensorboard:
            accelerator.log({"eval_loss": start_loss}, step=at.step)
    print_main(f"eval flow loss at step {at.step}: {start_loss:.4f}")
    # the conditioning probe (training/probe.py): does the model read each caption word? beside the eval loss
    probe = None
    if cfg.validation.probe_every and main_proc:
        from training.probe import describe, log_probe, probe_from_config

        probe = probe_from_config(cfg.data, cfg.validation, cfg.train.seed, components)
        if new_run:
            row = log_probe(probe, evaluate, transformer, ema, at.step)
            metrics.write(row)
            print_main(f"probe at step {at.step}: {describe(row['probe'])}")

    matches: list[tuple[torch.Tensor, int]] = []  # distillation's teacher-matching part per forward of a step

    def sample_loss(
        pred: torch.Tensor,
        x_t: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor,
        velocity: torch.Tensor,
        latents: torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        """One forward's loss: the flow loss, or with ``distill`` its mix with the teacher's (the teacher's part
        noted in ``matches`` for the log)."""
        if distill is None:
            return flow.loss(pred, velocity, latents)
        with accelerator.autocast():
            part, match = distill(pred, x_t, t, text, velocity, latents)
        matches.append((match.detach(), n))
        return part

    # ---- stages: optional attention transfer, then end-to-end flow matching
    model = None
    progress = tqdm(total=total_steps, initial=at.step, disable=not main_proc, desc="fine-tune", dynamic_ncols=True)
    try:
        stage_start = 0
        for stage, n_steps in [("transfer", cfg.transfer.steps), ("train", cfg.train.steps)]:
            stage_end = stage_start + n_steps
            if at.step >= stage_end or n_steps == 0:
                stage_start = stage_end
                continue
            set_stage_trainable(transformer, stage, trainable, converted)
            transfer = AttentionTransfer(transformer, converted) if stage == "transfer" else None
            optimizer, scheduler = make_optimizer(transformer, cfg.train, cfg.transfer, stage)
            if resume_state is not None and resume_state["stage"] == stage:
                ckpt.restore_optimizer(optimizer, scheduler, resume_state)  # a changed train.lr takes effect
            model, optimizer = accelerator.prepare(transformer, optimizer)
            sampler.samples_consumed = at.samples  # the next stage continues the data order where this one stopped
            data_iter = iter(data_loader(dataset, sampler, cfg.train.batch_size, cfg.data.num_workers))
            stills = images if transfer is None else None  # attention transfer copies on clips only
            while at.step < stage_end:
                follow_threads()
                t0 = time.perf_counter()
                grad_norm, finite, image_loss = None, True, None
                matches.clear()
                for _ in range(cfg.train.grad_accum):
                    batch = next(data_iter)
                    at.samples += len(batch["caption"])
                    with accelerator.accumulate(model):
                        # (loss, samples) per forward: one per clip length (data.min_frames), images
                        parts: list[tuple[torch.Tensor, int]] = []
                        for group in batch_groups(batch):
                            latents, text = batches(group, generator)
                            x_t, t, velocity = flow.noisy_input(latents, generator)
                            if transfer is not None:
                                transfer.losses.clear()  # drop losses a checkpointed layer's recompute appended
                            with accelerator.autocast():
                                pred = call(model, x_t, t, text)
                            n = len(group["caption"])
                            if transfer is not None:
                                part = transfer.take_loss()
                            else:
                                part = sample_loss(pred, x_t, t, text, velocity, latents, n)
                            parts.append((part, n))
                        loss = parts[0][0]
                        if len(parts) > 1:  # the mean over the batch's clips, whatever their lengths
                            loss = weighted_mean(parts)
                        if (
                            stills is not None
                        ):  # their own forward (another token count); the loss is a mean over samples
                            image_batch = stills.next_batch(at.images)
                            at.images += len(image_batch["caption"])
                            image_latents, image_text = stills.batches(image_batch, generator)
                            x_i, t_i, velocity_i = flow.noisy_input(image_latents, generator)
                            with accelerator.autocast():
                                pred_i = call(model, x_i, t_i, image_text)
                            n = len(image_batch["caption"])
                            image_loss = sample_loss(pred_i, x_i, t_i, image_text, velocity_i, image_latents, n)
                            parts.append((image_loss, n))
                            loss = weighted_mean(parts)
                        finite = bool(accelerator.gather(torch.isfinite(loss.detach()).reshape(1)).all())
                        if finite:
                            total = sum(n for _, n in parts)
                            for k, (part, n) in enumerate(parts):  # one backward per forward (DDP marks each once)
                                last = k == len(parts) - 1
                                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                                    accelerator.backward(part * n / total)
                            if accelerator.sync_gradients and cfg.train.grad_clip:
                                grad_norm = accelerator.clip_grad_norm_(
                                    [p for p in model.parameters() if p.requires_grad], cfg.train.grad_clip
                                )
                            optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                if not finite:
                    skip_nonfinite_step(cfg.train, at, loss, run_dir)  # raises after train.max_nonfinite in a row
                    continue
                at.nonfinite = 0
                scheduler.step()
                project_mixing(accelerator.unwrap_model(model))
                if ema is not None:
                    ema.update(accelerator.unwrap_model(model))
                at.step += 1
                dt = time.perf_counter() - t0
                loss_value = accelerator.gather(loss.detach().reshape(1)).mean().item()
                lr = scheduler.get_last_lr()[0]
                tokens = cfg.train.batch_size * cfg.train.grad_accum * world * math.prod(grid)
                progress.update(1)
                progress.set_postfix(
                    stage=stage,
                    loss=f"{loss_value:.4f}",
                    lr=f"{lr:.2e}",
                    s_step=f"{dt:.2f}",
                    tok_s=f"{tokens / dt:.0f}",
                )
                row = {
                    "step": at.step,
                    "stage": stage,
                    "loss": loss_value,
                    "lr": lr,
                    "step_time": dt,
                    "tokens_per_s": tokens / dt,
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                }
                if image_loss is not None and stills is not None:  # "loss" is then the mean over clips and images
                    row["image_loss"] = accelerator.gather(image_loss.detach().reshape(1)).mean().item()
                    row["images_per_s"] = stills.size * cfg.train.grad_accum * world / dt
                if matches:  # the teacher-matching part alone (with weight < 1 "loss" also holds the flow loss)
                    row["distill_loss"] = accelerator.gather(weighted_mean(matches).reshape(1)).mean().item()
                metrics.write(row)
                if cfg.log.tensorboard and at.step % cfg.log.every == 0:
                    accelerator.log({k: v for k, v in row.items() if isinstance(v, float)}, step=at.step)
                if cfg.checkpoint.every and (at.step % cfg.checkpoint.every == 0 or at.step == total_steps):
                    save_or_explain(
                        accelerator,
                        cfg,
                        run_dir,
                        stage,
                        model,
                        optimizer,
                        scheduler,
                        generator,
                        sampler,
                        at,
                        ema,
                        images,
                    )
                if (
                    main_proc
                    and cfg.validation.every
                    and (at.step % cfg.validation.every == 0 or at.step == total_steps)
                ):
                    unwrapped = accelerator.unwrap_model(model)
                    with ema.swapped_in(unwrapped) if ema is not None else contextlib.nullcontext():
                        videos = validation_videos(cfg.validation, cfg.data, components, unwrapped, run_dir, at.step)
                    if cfg.log.tensorboard:
                        log_videos(accelerator, videos, at.step)
                probed = probe is not None and (at.step % cfg.validation.probe_every == 0 or at.step == total_steps)
                if (
                    main_proc
                    and cfg.validation.every
                    and at.step % cfg.validation.every == 0
                    and at.step < total_steps  # the end of the run evaluates (finish_run)
                    and not probed  # the probe logs the eval loss with its own
                ):
                    row = {"step": at.step, "eval_loss": evaluate(accelerator.unwrap_model(model))}
                    metrics.write(row)
                    if cfg.log.tensorboard:
                        accelerator.log({"eval_loss": row["eval_loss"]}, step=at.step)
                if probed and probe is not None:
                    row = log_probe(probe, evaluate, accelerator.unwrap_model(model), ema, at.step)
                    metrics.write(row)
                    if cfg.log.tensorboard:
                        accelerator.log({k: v for k, v in row.items() if k.startswith("eval_loss")}, step=at.step)
                    print_main(f"probe at step {at.step}: {describe(row['probe'])}, eval loss {row['eval_loss']:.4f}")
            if transfer is not None:
                transfer.remove()
            stage_start = stage_end
    except ModelError:
        accelerator.end_training()
        raise
    finally:
        progress.close()
    final = accelerator.unwrap_model(model) if model is not None else transformer
    finish_run(cfg, accelerator, evaluate, metrics, final, ema, at.step, start_loss, dataset, run_dir)
    return 0


# --------------------------------------------------------------------------- beside the loop


def weighted_mean(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """One step's loss from its forwards' ``(mean loss, samples)``: the mean over every sample."""
    mean = sum(part * n for part, n in parts) / sum(n for _, n in parts)
    assert isinstance(mean, torch.Tensor)  # a step has at least one forward
    return mean


class EvalLoss:
    """Evaluation loss on fixed batches with fixed noise, to compare start and end: the synthetic validation
    split (unseen captions and held-out attribute combinations), else the first training videos."""

    def __init__(
        self,
        data: DataSection,
        train: TrainSection,
        validation: ValidationSection,
        dataset: Any,
        batches: BatchEncoder,
        flow: FlowMatching,
        accelerator: Any,
        call: ModelCall | None = None,
    ) -> None:
        """``validation.loss_batches`` batches of ``train.batch_size`` clips: the data section's validation clips
        (drawn with ``train.seed``), else ``dataset``'s first ones."""
        size = train.batch_size
        held_out = build_validation_dataset(data, train.seed, max(1, validation.loss_batches * size))
        eval_set = dataset if held_out is None else held_out
        self.batches = [
            collate([eval_set[(i * size + j) % len(eval_set)] for j in range(size)])
            for i in range(validation.loss_batches)
        ]
        self.encode, self.flow, self.accelerator = batches, flow, accelerator
        self.call = call or ModelCall()

    def __call__(self, model: Any) -> float:
        g = torch.Generator(device=self.accelerator.device).manual_seed(12345)
        losses = []
        with torch.no_grad(), self.accelerator.autocast():
            for b in self.batches:
                parts = []  # a batch of clips of several lengths (data.min_frames): one pass per length
                for group in batch_groups(b):
                    latents, text = self.encode(group, None)
                    x_t, t, target = self.flow.noisy_input(latents, g)
                    pred = self.call(model, x_t, t, text)
                    parts.append((F.mse_loss(pred.float(), target.float()).item(), len(group["caption"])))
                losses.append(parts[0][0] if len(parts) == 1 else sum(v * n for v, n in parts) / len(b["caption"]))
        return sum(losses) / len(losses)


class Metrics:
    """``metrics.jsonl``: one JSON row per line, written by the main process; a resumed run drops the rows
    the interrupted run logged after its checkpoint (they are redone)."""

    def __init__(self, path: Path, main_proc: bool) -> None:
        self.path, self.main_proc = path, main_proc

    def start(self, step: int, end_of_run: bool = False) -> None:
        """``end_of_run``: a resume from the run's last checkpoint, which redoes the end of the run and its row."""
        if step == 0:
            write_text_atomic(self.path, "")
        else:
            ckpt.trim_metrics(self.path, step, end_of_run)

    def write(self, row: dict[str, Any]) -> None:
        if self.main_proc:
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(row) + "\n")  # one write per row: a crash leaves whole rows
            except OSError as e:  # a full disk: named (a cut-short last row is dropped on resume)
                raise OutputError(f"could not append to {str(self.path)!r}: {e.strerror or e}") from e


def skip_nonfinite_step(train: TrainSection, at: Progress, loss: torch.Tensor, run_dir: Path) -> None:
    """A non-finite loss skips the step with a warning; ``train.max_nonfinite`` of them in a row end the run
    (ModelError, exit 3), the last checkpoint intact."""
    at.nonfinite += 1
    warnings.warn(
        f"step {at.step + 1}: non-finite loss ({loss.item()}); step skipped ({at.nonfinite} in a row)", stacklevel=2
    )
    if at.nonfinite >= train.max_nonfinite:
        raise ModelError(
            f"{at.nonfinite} non-finite losses in a row (train.max_nonfinite={train.max_nonfinite}); "
            f"stopping. The last checkpoint in {run_dir / 'checkpoints'} is intact."
        )


def save_or_explain(
    accelerator: Any,
    cfg: FinetuneConfig,
    run_dir: Path,
    stage: str,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    generator: torch.Generator,
    sampler: ResumableSampler | BucketBatchSampler,
    at: Progress,
    ema: EMA | None,
    images: ImageStream | None = None,
) -> None:
    """:func:`save`, or when the disk refuses (full, quota, permissions) an OutputError (exit 4) that says what
    and where, after removing the half-written folder: earlier checkpoints stay intact."""
    try:
        save(
            accelerator,
            cfg,
            run_dir,
            at.step,
            stage,
            model,
            optimizer,
            scheduler,
            generator,
            sampler,
            at.samples,
            at.nonfinite,
            ema,
            images,
            at.images,
        )
    except Exception as e:
        # a full disk, however the writer reports it (OSError, torch's zip writer, safetensors): exit 4
        why = e.strerror if isinstance(e, OSError) and e.strerror else write_failure(e)
        if why is None and isinstance(e, OSError):
            why = str(e)
        shutil.rmtree(ckpt.pending_dir(run_dir, at.step), ignore_errors=True)
        if why is None:
            raise
        good = ckpt.list_checkpoints(run_dir)
        raise OutputError(
            f"could not write the checkpoint of step {at.step} to {ckpt.pending_dir(run_dir, at.step)}: "
            f"{why}. Earlier checkpoints are intact "
            f"({good[-1].name if good else 'none yet'} in {run_dir / 'checkpoints'}); free space and "
            "run the same command with resume=latest to continue."
        ) from e
    except BaseException:  # Ctrl-C or SIGTERM mid-save: no half-written folder either (earlier ones are intact)
        shutil.rmtree(ckpt.pending_dir(run_dir, at.step), ignore_errors=True)
        raise


def finish_run(
    cfg: FinetuneConfig,
    accelerator: Any,
    evaluate: EvalLoss,
    metrics: Metrics,
    final: Any,
    ema: EMA | None,
    step: int,
    start_loss: float,
    dataset: Any,
    run_dir: Path,
) -> None:
    """The final model (``final/transformer``, whatever the checkpoint schedule), the end-of-run evaluation (raw
    weights, then the EMA's), the skip summary and list, the parameter digest, and last ``final/finished.json``."""
    print_main = accelerator.print
    save_final_model(cfg.model, cfg.train, accelerator, final, ema, step, run_dir)
    end_loss = evaluate(final)
    print_main(f"eval flow loss at step {step}: {end_loss:.4f} (start {start_loss:.4f})")
    row = {"step": step, "eval_loss": end_loss}
    if ema is not None:
        with ema.swapped_in(final):
            row["eval_loss_ema"] = evaluate(final)
        print_main(
            f"eval flow loss of the EMA weights (decay {ema.decay:g}, {ema.updates} updates): {row['eval_loss_ema']:.4f}"
        )
    metrics.write(row)
    if cfg.log.tensorboard:
        accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
    if accelerator.is_main_process:
        skipped = getattr(dataset, "skip_summary", None)
        if skipped is not None:
            print_main(skipped())
            write_skipped(run_dir, dataset)  # with the videos found bad while training
    if cfg.log.param_digest:
        if accelerator.is_main_process:
            ranks = [f"param_digest/rank{r}.txt" for r in range(accelerator.num_processes)]
            ckpt.record_run_files(run_dir, *ranks, folders=("param_digest",))
        (run_dir / "param_digest").mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "param_digest" / f"rank{accelerator.process_index}.txt", digest(final))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:  # last: a run stopped before it is finished by resume=latest, not said done
        ckpt.prune_checkpoints(run_dir, cfg.checkpoint.keep)  # killed between a checkpoint's rename and its pruning
        ckpt.write_finished(run_dir, step, cfg.model.expert or "transformer")


def save_final_model(
    model: ModelSection, train: TrainSection, accelerator: Any, final: Any, ema: EMA | None, step: int, run_dir: Path
) -> Path:
    """The trained model in the pipeline's format at ``<run_dir>/final/<transformer folder>`` (with EMA the
    averaged weights, a LoRA merged in, as in a checkpoint) and a LoRA run's adapters in diffusers' format at
    ``final/lora`` (:func:`pipelines.lora.save_lora`), written atomically (``final/finished.json`` comes when
    the whole end of the run is done: :func:`finish_run`). Never pruned by ``checkpoint.keep``."""
    folder = model.expert or "transformer"
    path = ckpt.final_model_dir(run_dir, folder)
    lora = train.trainable == "lora"
    if accelerator.is_main_process:
        ckpt.record_final(run_dir, folder)
        with ema.swapped_in(final) if ema is not None else contextlib.nullcontext():
            save_model_for_pipeline(final, path, lora)
        if lora:
            adapters = save_lora(final, run_dir / ckpt.FINAL / ckpt.LORA, lora_info(model, train.lora, step))
        accelerator.print(f"final model (step {step}): {path}")
        if lora:
            accelerator.print(f"LoRA adapters (diffusers' load_lora_weights format): {adapters}")
    accelerator.wait_for_everyone()
    return path


def write_skipped(run_dir: Path, dataset: Any) -> None:
    """``<run_dir>/skipped.json``: the videos a folder dataset skips, by reason (found so far). Main process."""
    paths = getattr(dataset, "skipped_paths", None)
    if paths is None:
        return
    by_reason = paths()
    record = {
        "source": dataset.source,
        "entries": len(dataset.entries) + len(dataset.dropped),
        "skipped": sum(len(p) for p in by_reason.values()),
        "by_reason": by_reason,
    }
    write_text_atomic(run_dir / "skipped.json", json.dumps(record, indent=1) + "\n")


def finished_run(cfg: FinetuneConfig, resume_from: Path | None, total_steps: int) -> bool:
    """A resume of a run that already trained its ``total_steps``: says so, where its model is and how to train
    on, and returns True (the caller exits 0; nothing is evaluated or logged again). A run of this run_dir stopped
    after its last checkpoint but before ``final/finished.json`` (killed in the end of the run: the final model, the
    end-of-run evaluation row, the digest) has not finished: False, and the resume does the end of the run again
    from that checkpoint.
    ``resume=latest`` on a run that finished without a checkpoint (``checkpoint.every=0``) and asks for more
    steps is refused: there is no optimizer state to continue from."""
    run_dir = Path(cfg.run_dir)
    folder = cfg.model.expert or "transformer"
    final = ckpt.final_model_dir(run_dir, folder)
    if resume_from is not None:
        step = ckpt.checkpoint_at(resume_from)
        if step < total_steps:
            return False
        mine = resume_from.parent.resolve() == (run_dir / "checkpoints").resolve()
        done = ckpt.read_finished(run_dir)
        if mine and (done is None or done["step"] != step):
            return False  # stopped in the end of the run (after its last checkpoint): the resume does it whole
        where = f"its model is in {final}" if mine else f"its model is in {resume_from / folder}"
    elif cfg.resume == "latest":
        done = ckpt.read_finished(run_dir)
        if done is None:
            return False
        step = done["step"]
        if step < total_steps:
            raise ValueError(
                f"resume=latest: run_dir {str(run_dir)!r} holds a run that finished at step {step} without a "
                f"checkpoint to continue from (checkpoint.every=0), and this config asks for {total_steps} steps; "
                f"expected a checkpoint: train on from its model in a new run_dir with model.transformer={final}, "
                "or start over here with overwrite=true (without resume)"
            )
        where = f"its model is in {final}"
    else:
        return False
    if is_main_launch():
        print(
            f"run {str(run_dir)!r} already finished at step {step} (this config asks for {total_steps}); {where}. "
            "Nothing was trained or written: raise train.steps to train on"
        )
    return True


def check_resume_data(
    resume: str | None, seed: int, checkpoint: Path, dataset: Sized, image_set: Sized | None
) -> list[str]:
    """Before the model loads: the checkpoint's data order against this run's (its ``rank0.pt``; ``resume`` and
    ``seed``: the config's ``resume`` and ``train.seed``). Another number of processes or another ``train.seed``
    is refused (ValueError naming both); another dataset size (a caption
    fixed, videos added) is not: returns a note per changed dataset, and :func:`restore_order` continues an
    order drawn for the new size from the same position."""
    state = ckpt.load_state(checkpoint / "rank0.pt")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    notes = []
    streams = [("data", "clips", len(dataset), seed)]
    if image_set is not None:
        streams.append(("images", "images", len(image_set), seed + 1))
    step = ckpt.checkpoint_at(checkpoint)
    keys = dataset.shape_keys() if hasattr(dataset, "shape_keys") else []
    buckets = max(1, len(set(keys)))  # batches of one shape each (aspect or length buckets): BucketBatchSampler
    for key, what, size, stream_seed in streams:
        saved = state.get(key)
        if not saved:
            continue
        if saved["world_size"] != world:
            raise ValueError(
                f"resume={resume!r}: checkpoint {str(checkpoint)!r} was written by {saved['world_size']} "
                f"process(es), this run has {world}; expected the same number (launch it with "
                f"--nproc_per_node {saved['world_size']}), or start a new run_dir"
            )
        if saved["seed"] != stream_seed:
            was = saved["seed"] - (stream_seed - seed)
            raise ValueError(
                f"train.seed={seed}: checkpoint {str(checkpoint)!r} was trained with train.seed={was} "
                f"(it orders the data); expected train.seed={was} to resume, or start a new run_dir"
            )
        was, now = saved.get("buckets", 1), buckets if key == "data" else 1
        if saved["num_samples"] == size and was != now:
            notes.append(
                f"note: the clips' shapes changed since {checkpoint.name}: {was} bucket(s) then, {now} now "
                f"(data.buckets, data.min_frames). Resuming at step {step}: batches are drawn for the new buckets "
                f"and continue from sample {saved['samples_consumed']}"
            )
        if saved["num_samples"] != size:
            notes.append(
                f"note: the dataset changed since {checkpoint.name}: {saved['num_samples']} {what} then, {size} "
                f"now. Resuming at step {step} with the new dataset: its order is drawn for {size} {what} and "
                f"continues from sample {saved['samples_consumed']} (this epoch may repeat or miss a few)"
            )
    return notes


def restore_order(sampler: ResumableSampler | BucketBatchSampler, state: dict[str, Any]) -> None:
    """A checkpoint's data position; for a dataset whose size changed (said by :func:`check_resume_data`) the
    same position in an order drawn for the new size."""
    if state["num_samples"] != sampler.num_samples:
        sampler.samples_consumed = int(state["samples_consumed"])
    else:
        sampler.load_state_dict(state)


def save(
    accelerator: Any,
    cfg: FinetuneConfig,
    run_dir: Path,
    step: int,
    stage: str,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    generator: torch.Generator,
    sampler: ResumableSampler | BucketBatchSampler,
    samples: int,
    nonfinite: int,
    ema: EMA | None,
    images: ImageStream | None = None,
    images_consumed: int = 0,
) -> None:
    """One checkpoint, assembled in a temporary folder by all ranks, renamed into place by the main one.
    With EMA, ``transformer/`` holds the averaged weights and ``trainable.safetensors`` the raw ones."""
    if accelerator.is_main_process:
        tmp = ckpt.begin_checkpoint(run_dir, step)
    accelerator.wait_for_everyone()
    tmp = ckpt.pending_dir(run_dir, step)
    rank = accelerator.process_index
    rank_state = {"generator": generator.get_state(), "data": sampler.state_dict(samples)}
    if images is not None:
        rank_state["images"] = images.sampler.state_dict(images_consumed)
    ckpt.save_state(rank_state, tmp / f"rank{rank}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        lora = cfg.train.trainable == "lora"
        with ema.swapped_in(unwrapped) if ema is not None else contextlib.nullcontext():
            # the expert's own folder name (transformer_2 for A14B's low-noise expert): it drops into the model dir
            save_model_for_pipeline(unwrapped, tmp / (cfg.model.expert or "transformer"), lora)
        if ema is not None:
            from safetensors.torch import save_file

            params = dict(unwrapped.named_parameters())
            save_file({n: params[n].detach().contiguous() for n in ema.shadow}, tmp / "trainable.safetensors")
        if lora:
            from safetensors.torch import save_file

            trainable = {
                n: p.detach().contiguous() for n, p in unwrapped.named_parameters() if "lora_" in n or ".attn1." in n
            }
            save_file(trainable, tmp / "trainable.safetensors")  # what a resume loads (peft's names)
            save_lora(unwrapped, tmp / ckpt.LORA, lora_info(cfg.model, cfg.train.lora, step))  # what diffusers loads
        ckpt.save_state(
            {
                "step": step,
                "stage": stage,
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": scheduler.state_dict(),
                "nonfinite_in_a_row": nonfinite,
                "world_size": accelerator.num_processes,
                "ema_updates": None if ema is None else ema.updates,
            },
            tmp / ckpt.STATE_FILE,
        )
        (tmp / "config.yaml").write_text(config_yaml(cfg))
        ckpt.finish_checkpoint(run_dir, step, cfg.checkpoint.keep)
    accelerator.wait_for_everyone()


def validation_videos(
    validation: ValidationSection,
    data: DataSection,
    components: WanComponents,
    transformer: Any,
    run_dir: Path,
    step: int,
) -> dict[str, Any]:
    """The validation section's prompts and seeds at the data section's clip size, written as mp4 under
    ``<run>/validation/step-XXXXXXX/``; returns the videos, ``{"validation/prompt<i>_seed<seed>": float (T, H, W, 3)
    in [0, 1]}`` (:func:`log_videos`)."""
    out = run_dir / "validation" / f"step-{step:07d}"
    names = [f"prompt{i}_seed{seed}.mp4" for i in range(len(validation.prompts)) for seed in validation.seeds]
    here = f"validation/{out.name}"
    ckpt.record_run_files(run_dir, *(f"{here}/{n}" for n in names), folders=("validation", here))
    out.mkdir(parents=True, exist_ok=True)
    was_training = transformer.training
    transformer.eval()
    variant = transformer.config["self_attention"]["variant"]
    videos = {}
    with torch.no_grad():
        for i, prompt in enumerate(validation.prompts):
            for seed in validation.seeds:
                request = GenerationRequest(
                    prompt=prompt,
                    height=data.height,
                    width=data.width,
                    num_frames=data.num_frames,
                    num_inference_steps=validation.num_inference_steps,
                    guidance_scale=validation.guidance_scale,
                    seed=seed,
                    variant=variant,
                )
                result = generate(components, request, transformer=transformer, show_progress=False)
                write_mp4(out / f"prompt{i}_seed{seed}.mp4", result.frames, fps=16)
                videos[f"validation/prompt{i}_seed{seed}"] = result.frames
    transformer.train(was_training)
    return videos


def gif_summary(tag: str, frames: Any, fps: float = 16) -> Any:
    """A TensorBoard image summary holding ``frames`` (``(T, H, W, 3)``, float in [0, 1] or uint8) as an animated GIF:
    what ``SummaryWriter.add_video`` writes, without its moviepy dependency (TensorBoard's Images tab plays it)."""
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]

    video = np.asarray(frames)
    if video.dtype != np.uint8:
        video = (np.clip(video, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    images = [Image.fromarray(frame) for frame in video]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    height, width = video.shape[1:3]
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=buffer.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def log_videos(accelerator: Any, videos: dict[str, Any], step: int, fps: float = 16) -> None:
    """The validation videos in TensorBoard's event file at ``step`` (main process), one GIF each."""
    if not accelerator.is_main_process:
        return
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    for tag, frames in videos.items():
        writer._get_file_writer().add_summary(gif_summary(tag, frames, fps), step)
    writer.flush()


def trim_event_files(folder: Path, step: int, redone: tuple[str, ...] = ()) -> None:
    """Cuts the summaries of steps after ``step`` (and those of the ``redone`` tags at ``step``) from the TensorBoard
    event files in ``folder``, each rewritten atomically: a run resumed from its checkpoint at ``step`` logs them
    again. Records are copied as they were (framing and checksums); a record cut short by a crash ends its file."""
    import struct

    from tensorboard.compat.proto.event_pb2 import Event  # type: ignore[import-untyped]

    from common.outputs import atomic_write

    for path in sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []:
        data, kept, at, cut = path.read_bytes(), [], 0, False
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            end = at + 12 + length + 4
            if end > len(data):
                cut = True
                break
            event = Event.FromString(data[at + 12 : at + 12 + length])
            tags = {v.tag for v in event.summary.value}
            if event.HasField("summary") and (event.step > step or (event.step == step and tags & set(redone))):
                cut = True
            else:
                kept.append(data[at:end])
            at = end
        cut = cut or at != len(data)
        if cut:
            with atomic_write(path, allow_empty=True) as tmp:
                Path(tmp).write_bytes(b"".join(kept))


if __name__ == "__main__":
    sys.exit(main())

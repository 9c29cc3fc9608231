"""A command line's run, after its checks: the plan (:class:`RunPlan`) and its requests generated on the loaded
components (:func:`run`), each variant's files written as it finishes.

The command line (:mod:`pipelines.cli`) parses and checks (:class:`RunPlan`, before any model loads), loads the
components once (:func:`pipelines.loading.load_components`), attaches the scale's hooks once
(:meth:`pipelines.scale.Scale.attach`) and hands the plan and the components here. One variant runs ``repeats``
times; several take turns step by step by the app's rule (:mod:`common.interleave`), each on its own transformer.
Every generation goes through :func:`_variant`: the scale's hooks around it (:meth:`pipelines.scale.Scale.running`),
``--compile``, ``--cache``, :func:`pipelines.pipeline.generate`, then the variant's files.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import ModelError
from common.interleave import format_paired_comparison, take_turns
from common.timing import Timing, format_timing

from .pipeline import RANDOM_WEIGHTS_NOTE, GenerationResult, NonFiniteLatentsError, generate
from .request import GenerationRequest
from .scale import Scale

if TYPE_CHECKING:
    import torch

    from common.interleave import StepClock

    from .caching import CacheSpec
    from .loading import WanComponents
    from .lora import LoraAdapters
    from .model_dir import ModelDir

# at most this share of the free memory goes to a transformer per variant (the rest: activations, the VAE)
COPY_SHARE = 0.5


@dataclass
class RunPlan:
    """What a command line asks for, checked before any model loads (:func:`pipelines.cli._preflight`): the one
    value each later stage is handed."""

    requests: list[GenerationRequest]
    outputs: list[tuple[Path, Path | None, Path | None]]  # (mp4, gif, grid png) per request
    overrides: dict[str, Any]
    device: torch.device  # where it computes (this process's GPU under context parallelism)
    dtype: torch.dtype
    load_device: torch.device  # where the components load: the CPU when offloaded (the hooks bring them in)
    scale: Scale = field(default_factory=Scale)  # offload, VAE tiling, context parallelism (pipelines/scale.py)
    frames_npy: list[Path] | None = None  # per request, with --frames-npy
    folder: ModelDir | None = None  # the model's files as read (once) and checked: loading reads none again
    transformer: str | None = None  # --transformer: a saved transformer folder in place of the model's own
    transformer_config: dict[str, Any] | None = None  # its config.json, as read
    lora: LoraAdapters | None = None  # --lora, read and checked
    lora_name: str | None = None  # --lora as given
    fine_tuned: dict[str, Path] = field(default_factory=dict)  # the model's own fine-tuned transformer per variant
    repeats: int = 1
    fps: int = 16
    compile: str = "none"
    cache: CacheSpec | None = None
    show_progress: bool = True


def run(plan: RunPlan, components: WanComponents, say: Any) -> int:
    """Generates every request of ``plan`` on ``components`` and writes its files (process 0 only): one variant
    ``plan.repeats`` times, several in turns (:func:`_run_in_turns`). ``say``: print, or nothing on the processes
    other than 0. Returns the exit code."""
    if len(plan.requests) > 1:
        return _run_in_turns(plan, components, say)
    own = _own_transformers(plan, components, say)
    assert own is not None  # one variant always has its transformer
    transformer, _ = own[plan.requests[0].variant]
    main = plan.scale.main
    _result, timings = _variant(plan, components, 0, transformer, None, plan.show_progress and main)
    if main and len(timings) > 1:
        steps = [s for t in timings for s in t.warm_steps]
        print(
            f"step over {len(timings)} runs: {statistics.median(steps):.3f} s (median of {len(steps)} steps, each "
            "run's first left out)"
        )
    return 0


def _variant(
    plan: RunPlan,
    components: WanComponents,
    i: int,
    transformer: Any,
    transformer_2: Any,
    show_progress: bool,
    clock: StepClock | None = None,
    bar: Any = None,
) -> tuple[GenerationResult, list[Timing]]:
    """Request ``i``'s ``plan.repeats`` generations on ``transformer`` (None: the base one, converted in place) and
    ``transformer_2`` (None: the model's second expert, if any), with the plan's scale, compile and cache; a loaded
    ``transformer`` is unhooked after its last run. Then its files, written by process 0 (each atomically and
    checked: a failed writer raises, and nothing says "wrote"), and its timing table: the last run's, or with
    the variants in turns (``clock``, the turn's :class:`common.interleave.StepClock`) the clock's, which leaves
    out the waits for the turn. ``bar``: the turns' progress bar, cleared before the table. Returns the last
    result and each run's timing."""
    import time

    request = plan.requests[i]
    running = components.transformer if transformer is None else transformer
    timings = []
    for r in range(plan.repeats):
        if clock is not None:
            clock.check()
            clock.begin()
        start = time.perf_counter()
        drop = r == plan.repeats - 1 and transformer is not None
        try:
            with plan.scale.running(components, request, running, plan.overrides, drop=drop):
                if plan.compile != "none":
                    from mhla.compiled import compile_transformer

                    compile_transformer(running, plan.compile)
                from .caching import cached

                with cached(running, plan.cache, request.num_inference_steps or 1):  # validated: an int
                    result = generate(
                        components,
                        request,
                        attention_options=plan.overrides,
                        transformer=transformer,
                        transformer_2=transformer_2,
                        show_progress=show_progress,
                    )
        except NonFiniteLatentsError as e:
            raise ModelError(str(e)) from e
        timings.append(result.timing if clock is None else clock.timing(result.timing, start, time.perf_counter()))
    if plan.scale.main:  # in this variant's turn: writing never competes with another variant's step
        import numpy as np

        from common.outputs import atomic_write
        from common.video import write_frame_grid, write_gif, write_mp4

        if bar is not None:
            bar.clear()
        mp4, gif, png = plan.outputs[i]
        comment = f"{request.variant} | seed {request.seed} | {request.prompt}"
        if components.random_weights:
            comment = f"{RANDOM_WEIGHTS_NOTE} | {comment}"
        written = [str(write_mp4(mp4, result.frames, fps=plan.fps, comment=comment))]
        if gif:
            written.append(str(write_gif(gif, result.frames, fps=plan.fps, comment=comment)))
        if png:
            written.append(str(write_frame_grid(png, result.frames, comment=comment)))
        if plan.frames_npy:  # the decoded frames as a float32 .npy array
            with atomic_write(plan.frames_npy[i]) as tmp, open(tmp, "wb") as f:
                np.save(f, np.asarray(result.frames, dtype=np.float32))
            written.append(str(plan.frames_npy[i]))
        print(
            f"\nwrote {', '.join(written)}  ({len(result.frames)} frames, {request.height}x{request.width}, "
            f"{result.pipeline_class})"
        )
        print(format_timing(timings[-1]))
    return result, timings


def _fine_tuned(plan: RunPlan, variant: str, say: Any) -> Any:
    """The fine-tuned transformer the model ships for ``variant`` (the built-in model's ``variants/``), loaded;
    None where the variant runs on the base transformer, converted in place (a ``--transformer`` or a ``--lora``
    runs as given: the plan names no fine-tuned one then)."""
    if variant not in plan.fine_tuned:
        return None
    from .loading import load_transformer_on

    transformer = load_transformer_on(plan.fine_tuned[variant], plan.dtype, plan.load_device)
    say(f"{variant}: fine-tuned transformer {plan.fine_tuned[variant]}")
    return transformer


def _module_bytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device``: the GPU's free memory, the CPU's MemAvailable (None: unknown)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_transformers(plan: RunPlan, components: WanComponents, say: Any) -> dict[str, tuple[Any, Any]] | None:
    """Each variant's own transformers ``(transformer, transformer_2)``: one variant's is its fine-tuned one, or
    None (the base, converted in place). Several take turns step by step on their own (a transformer is converted
    in place to its variant: two variants cannot share one while both run): the model's fine-tuned ones loaded,
    the others deep copies of the base (which itself runs the last variant that uses it). None, said why, when
    they cannot: offloading or context parallelism (their hooks hold one transformer), or too little free memory
    for the copies (:data:`COPY_SHARE` of it)."""
    import copy

    names = [r.variant for r in plan.requests]
    if len(names) > 1 and (plan.scale.offload != "none" or plan.scale.context_parallel):
        say(
            "the variants run one after another (--offload and --context-parallel hold one transformer at a time): "
            "a change of machine load between them shows up as a speedup"
        )
        return None
    experts = [t for t in (components.transformer, components.transformer_2) if t is not None]
    need = (len(names) - 1) * sum(_module_bytes(t) for t in experts)
    free = _free_bytes(plan.device) if len(names) > 1 else None
    if len(names) > 1 and (free is None or need > COPY_SHARE * free):
        free_text = "an unknown amount" if free is None else f"{free / 2**30:.1f} GiB"
        say(
            f"the variants run one after another: a transformer per variant needs {need / 2**30:.1f} GiB more and "
            f"{free_text} is free (at most {COPY_SHARE:.0%} of it goes to them), so a change of machine load between "
            "them shows up as a speedup"
        )
        return None
    fine_tuned = {v: _fine_tuned(plan, v, say) for v in names}
    base_users = [v for v in names if fine_tuned[v] is None]
    second = components.transformer_2
    own: dict[str, tuple[Any, Any]] = {}
    for v in names:
        last = v == names[-1]  # the model's own second expert runs the last variant (the others: copies)
        t2 = None if second is None or last else copy.deepcopy(second)
        if fine_tuned[v] is not None:
            own[v] = (fine_tuned[v], t2)
        elif v == base_users[-1]:  # the base transformer itself, converted in place as a single run does
            own[v] = (None, t2)
        else:
            own[v] = (copy.deepcopy(components.transformer), t2)
    return own


def _run_in_turns(plan: RunPlan, components: WanComponents, say: Any) -> int:
    """Several variants, timed by the app's rule (:mod:`common.interleave`): they take turns one denoising step
    each, round-robin, each on its own transformer (:func:`_own_transformers`), so a change of machine load hits
    all of them alike; ``plan.repeats`` runs each that many times; the table pairs step ``k`` of each variant with
    flash's step ``k`` and reports the median ratio with its 95% interval, "noisy" past +-10%. Each variant's
    files are written in its turn as it finishes; a variant that fails does not stop the others (its error is
    raised once they are done)."""
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    names = [r.variant for r in plan.requests]
    own = _own_transformers(plan, components, say)
    interleaved = own is not None
    first = plan.requests[0]
    per_step = 2 if (first.guidance_scale or 0.0) > 1.0 else 1  # WanPipeline: conditional and unconditional calls
    steps = first.num_inference_steps or 1
    loaded: dict[str, tuple[Any, Any]] = {}

    def modules_of(name: str) -> list[Any]:
        # interleaved: the variant's own; else loaded now, in its turn (one fine-tuned transformer at a time)
        loaded[name] = own[name] if own is not None else (_fine_tuned(plan, name, say), None)
        t, t2 = loaded[name]
        second = components.transformer_2 if t2 is None else t2
        return [components.transformer if t is None else t] + ([] if second is None else [second])

    def work(name: str, clock: StepClock) -> tuple[GenerationResult, list[Timing]]:
        t, t2 = loaded[name]
        return _variant(plan, components, names.index(name), t, t2, False, clock, bar)

    bar = tqdm(
        total=len(names) * plan.repeats * steps,
        desc="denoising, the variants in turns" if interleaved else "denoising, one variant after another",
        unit="step",
        disable=not plan.show_progress or not plan.scale.main,
        leave=False,
    )
    timings: dict[str, list[Timing]] = {}
    errors: list[BaseException] = []
    try:
        for outcome in take_turns(
            names,
            modules_of,
            work,
            per_step,
            interleaved,
            on_step=lambda _n, _k, finished: bar.update(1) if finished else None,
            device=plan.device,
            thread_name="variant",
        ):
            if outcome.error is not None:
                errors.append(outcome.error)
            else:
                timings[outcome.name] = outcome.value[1]
    finally:
        bar.close()
    if len(timings) > 1:
        say("\n" + format_paired_comparison({n: timings[n] for n in names if n in timings}, interleaved, plan.repeats))
    if errors:
        raise errors[0]
    return 0

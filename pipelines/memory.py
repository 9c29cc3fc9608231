"""Memory options of a generation: diffusers' offload hooks and VAE tiling, applied once to shared components.

    offload = apply_offload(components, "group", torch.device("cuda"), vae_tiling=True)
    offload.prepare(transformer, convert=...)   # before each run: hooks a new transformer, converts under the hooks
    result = generate(components, request, transformer=transformer)
    offload.release()                           # after each run: every component back on the offload device

The modes (``--offload`` of the CLI and the app; rows of ``benchmarks/memory_table.py``):

- ``none``: every component on the execution device.
- ``model``: diffusers' ``enable_model_cpu_offload`` (accelerate's ``cpu_offload_with_hook`` per component, in
  the pipeline's order text encoder -> transformer -> VAE): one whole component on the device at a time.
- ``group``: diffusers' group offloading at block level (``enable_group_offload`` on the diffusers models,
  ``apply_group_offloading`` on the text encoder), one block per group, with CUDA streams (prefetching the next
  block) on a CUDA device.
- ``sequential``: what ``enable_sequential_cpu_offload`` does per component (accelerate's ``cpu_offload``: the
  weights live on the ``meta`` device and each module's hook brings its own in for its forward).

On a CPU-only machine every mode runs with ``cpu`` as both the offload and the execution device: the hooks run
(and move nothing, except sequential offloading, which really keeps the weights on ``meta``). Two of diffusers'
pipeline methods cannot be called as they are there: with no device they raise "requires accelerator", and
``enable_sequential_cpu_offload(device="cpu")`` names the device ``cpu:0``, which accelerate fails on when the
text encoder runs; so this module passes the device, and calls the sequential method's per-model loop itself.

Conversions between variants add parameters (``attn1.mhla.*``, ``attn1.linear.*``) to a hooked transformer:
:meth:`Offload.prepare` runs the conversion where the hooks allow it and re-applies them when the parameters
changed (group offloading with streams keeps a pinned copy of each parameter it was given; sequential
offloading would create the new ones on ``meta``), so the new parameters move with the hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .loading import WanComponents

OFFLOAD_MODES = ("none", "model", "group", "sequential")
# diffusers' AutoencoderKLWan.enable_tiling defaults, in pixels: 256 x 256 tiles, 192 apart (64 overlapping)
VAE_TILE, VAE_TILE_STRIDE = 256, 192


def check_offload(mode: str, device: torch.device | str) -> str:
    """``mode`` if it is an offload mode that can run with ``device`` as the execution device; ValueError naming
    the value otherwise (checked before any model loads)."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"--offload {mode!r}: expected one of {', '.join(OFFLOAD_MODES)}")
    kind = torch.device(device).type
    if mode != "none" and kind not in ("cuda", "cpu"):
        raise ValueError(f"--offload {mode}: runs on a CUDA device or the CPU, not on {kind!r}")
    return mode


def parameter_names(module: torch.nn.Module) -> frozenset[str]:
    return frozenset(name for name, _ in module.named_parameters())


def _offload_all(hooks: list[Any]) -> Any:
    """A hook to stand where accelerate expects the previous component's (``prev_module_hook``) that offloads every
    transformer, so the VAE's turn offloads whichever one ran last. accelerate honours only a
    ``UserCpuOffloadHook`` there, and offloads it only when its ``model`` is off the CPU: ``model`` is the
    transformer that is on the device, if any."""
    from accelerate.hooks import UserCpuOffloadHook  # type: ignore[import-untyped]

    class OffloadAll(UserCpuOffloadHook):  # type: ignore[misc]
        def __init__(self) -> None:  # no single model: see the property
            self.hooks = hooks

        @property
        def model(self) -> torch.nn.Module:
            on_device = [h.model for h in self.hooks if next(h.model.parameters()).device.type != "cpu"]
            return on_device[0] if on_device else self.hooks[0].model

        def offload(self) -> None:
            for hook in self.hooks:
                hook.offload()

        def remove(self) -> None:
            for hook in self.hooks:
                hook.remove()

    return OffloadAll()


def _offload_each(hooks: list[Any]) -> None:
    """Offloads each hook's model (a transformer's pre-hook: the other transformers and the image encoder)."""
    for hook in hooks:
        hook.offload()


@dataclass
class Offload:
    """The offload hooks of one set of shared components and the transformers that run with them.

    Build it with :func:`apply_offload`. ``transformers`` are the hooked transformers with their parameter names
    at hooking (a conversion that adds parameters re-applies the hooks)."""

    mode: str
    device: torch.device
    vae_tiling: bool = False
    components: Any = None
    transformers: list[tuple[torch.nn.Module, frozenset[str]]] = field(default_factory=list)
    _model_hooks: dict[int, Any] = field(default_factory=dict)  # model offload: id(module) -> accelerate's hook
    _pre_hooks: dict[int, Any] = field(default_factory=dict)

    # ---- what the page and the CLI show

    def describe(self) -> str:
        """E.g. ``"offload group (block level, CUDA streams) · VAE tiling"``; ``""`` when nothing is on."""
        parts = []
        if self.mode == "group":
            parts.append("offload group (block level" + (", CUDA streams)" if self._streams else ")"))
        elif self.mode != "none":
            parts.append(f"offload {self.mode}")
        if self.vae_tiling:
            parts.append(f"VAE tiling ({VAE_TILE} px tiles)")
        return " · ".join(parts)

    @property
    def _streams(self) -> bool:
        return self.device.type == "cuda"

    # ---- hooking

    def _group_kwargs(self) -> dict[str, Any]:
        return dict(
            onload_device=self.device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=self._streams,
        )

    def _hook(self, module: torch.nn.Module, role: str) -> None:
        """Hooks one component (``role``: ``text_encoder``, ``image_encoder``, ``transformer`` or ``vae``) in group or sequential
        mode; model mode hooks the chain in :meth:`_hook_model_chain`."""
        if self.mode == "group":
            if hasattr(module, "enable_group_offload"):  # the diffusers models
                module.enable_group_offload(**self._group_kwargs())  # type: ignore[operator]
            else:  # the text encoder (transformers' UMT5): diffusers' function, as enable_group_offload calls it
                from diffusers.hooks import apply_group_offloading

                apply_group_offloading(module=module, **self._group_kwargs())
        elif self.mode == "sequential":
            from accelerate import cpu_offload  # type: ignore[import-untyped]

            # enable_sequential_cpu_offload's loop: buffers too when the model holds parameters of its own
            cpu_offload(module, self.device, offload_buffers=len(module._parameters) > 0)

    def _unhook(self, module: torch.nn.Module) -> None:
        if self.mode == "group":
            from diffusers.hooks import HookRegistry
            from diffusers.hooks.group_offloading import (
                _GROUP_OFFLOADING,
                _LAYER_EXECUTION_TRACKER,
                _LAZY_PREFETCH_GROUP_OFFLOADING,
            )

            registry = HookRegistry.check_if_exists_or_initialize(module)
            for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
                registry.remove_hook(name, recurse=True)
            module.to(torch.device("cpu"))
        elif self.mode in ("sequential", "model"):
            from accelerate.hooks import remove_hook_from_module

            remove_hook_from_module(module, recurse=True)  # sequential: the weights come back from the offload map

    def _hook_model_chain(self) -> None:
        """Model offload: diffusers' ``enable_model_cpu_offload`` on a pipeline of the shared components and the
        first transformer (text encoder -> transformer -> VAE, each turn offloading the one before); further
        transformers (the app's fine-tuned variants) join with the text encoder as their predecessor, each offloads
        the others when it runs, the VAE's turn offloads them all, and the text encoder's turn the VAE."""
        from accelerate import cpu_offload_with_hook
        from diffusers import WanPipeline

        c = self.components
        for hook in self._model_hooks.values():
            hook.remove()
        self._model_hooks.clear()
        for handle in self._pre_hooks.values():
            handle.remove()
        self._pre_hooks.clear()
        transformers = [t for t, _ in self.transformers]
        pipe = WanPipeline(
            tokenizer=c.tokenizer,
            text_encoder=c.text_encoder,
            vae=c.vae,
            scheduler=c.scheduler,
            transformer=transformers[0],
        )
        pipe.enable_model_cpu_offload(device=self.device)
        text_hook, first, vae_hook = pipe._all_hooks  # model_cpu_offload_seq: text_encoder->transformer->vae
        hooks = {id(c.text_encoder): text_hook, id(transformers[0]): first, id(c.vae): vae_hook}
        for t in transformers[1:]:
            _, hooks[id(t)] = cpu_offload_with_hook(t, self.device, prev_module_hook=text_hook)
        image_encoder = getattr(c, "image_encoder", None)  # Wan2.1-I2V's CLIP encoder: runs after the text encoder
        image_hooks = []
        if image_encoder is not None:
            _, hooks[id(image_encoder)] = cpu_offload_with_hook(image_encoder, self.device, prev_module_hook=text_hook)
            image_hooks.append(hooks[id(image_encoder)])
        self._model_hooks = hooks
        transformer_hooks = [hooks[id(t)] for t in transformers]
        vae_hook.hook.prev_module_hook = _offload_all(transformer_hooks + image_hooks)
        # and round again: the text encoder's turn (the next run) offloads the VAE, which nothing else would
        text_hook.hook.prev_module_hook = vae_hook
        if len(transformers) > 1 or image_hooks:
            for t in transformers:
                others = [hooks[id(o)] for o in transformers if o is not t] + image_hooks
                self._pre_hooks[id(t)] = t.register_forward_pre_hook(lambda *_, o=others: _offload_each(o))

    def attach(self, components: WanComponents, transformers: Iterable[torch.nn.Module] = ()) -> Offload:
        """Hooks the text encoder, the VAE, ``components.transformer`` (and ``transformer_2``, a second expert) and
        ``transformers`` (once)."""
        self.components = components
        if self.vae_tiling:
            components.vae.enable_tiling(
                tile_sample_min_height=VAE_TILE,
                tile_sample_min_width=VAE_TILE,
                tile_sample_stride_height=VAE_TILE_STRIDE,
                tile_sample_stride_width=VAE_TILE_STRIDE,
            )
        if self.mode == "none":
            return self
        all_transformers: list[torch.nn.Module] = []
        second = getattr(components, "transformer_2", None)  # Wan2.2-A14B's low-noise expert
        for t in (components.transformer, *([second] if second is not None else []), *transformers):
            if not any(t is o for o in all_transformers):
                all_transformers.append(t)
        self.transformers = [(t, parameter_names(t)) for t in all_transformers]
        if self.mode == "model":
            self._hook_model_chain()
        else:
            self._hook(components.text_encoder, "text_encoder")
            image_encoder = getattr(components, "image_encoder", None)
            if image_encoder is not None:  # Wan2.1-I2V's CLIP encoder, a transformers model like the text encoder
                self._hook(image_encoder, "image_encoder")
            self._hook(components.vae, "vae")
            for t in all_transformers:
                self._hook(t, "transformer")
        return self

    def hooked(self, transformer: torch.nn.Module) -> bool:
        return any(t is transformer for t, _ in self.transformers)

    def prepare(self, transformer: torch.nn.Module, convert: Callable[[], Any] | None = None) -> None:
        """Before a run with ``transformer``: hooks it if it is new, and runs ``convert`` (a conversion of it that
        may add attention parameters) so that every parameter it has afterwards moves with the hooks."""
        if self.mode == "none":
            if convert is not None:
                convert()
            return
        if not self.hooked(transformer):
            if convert is not None:
                convert()  # before hooking: nothing to redo
            self.transformers.append((transformer, parameter_names(transformer)))
            if self.mode == "model":
                self._hook_model_chain()
            else:
                self._hook(transformer, "transformer")
            return
        if convert is None:
            return
        if self.mode == "sequential":
            # the weights are on meta: a conversion would build the new parameters there. Unhook (the weights come
            # back), convert, hook again
            self._unhook(transformer)
            convert()
            self._hook(transformer, "transformer")
        else:
            # model offload moves the whole model (new parameters included); group offloading moves each block's
            # modules, but with streams it only knows the parameters it pinned when hooked
            convert()
            if self.mode == "group" and parameter_names(transformer) != self._names(transformer):
                from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading

                _maybe_remove_and_reapply_group_offloading(transformer)
        self.transformers = [(t, parameter_names(t) if t is transformer else n) for t, n in self.transformers]

    def _names(self, transformer: torch.nn.Module) -> frozenset[str]:
        return next(n for t, n in self.transformers if t is transformer)

    def release(self) -> None:
        """After a run: every component back on the offload device (model offload leaves the last component
        that ran on the device; diffusers' ``maybe_free_model_hooks`` does this at the end of a pipeline call,
        but ``generate()`` builds a fresh pipeline per call)."""
        for hook in self._model_hooks.values():
            hook.offload()

    def detach(self, transformer: torch.nn.Module) -> None:
        """Unhooks ``transformer`` and forgets it (the CLI drops one variant's fine-tuned transformer for the
        next's)."""
        if self.mode == "none" or not self.hooked(transformer):
            return
        self.transformers = [(t, n) for t, n in self.transformers if t is not transformer]
        self._unhook(transformer)
        if self.mode == "model":
            self._model_hooks.pop(id(transformer), None)
            handle = self._pre_hooks.pop(id(transformer), None)
            if handle is not None:
                handle.remove()
            if self.transformers:
                self._hook_model_chain()  # the VAE's predecessor and the transformers' mutual offloading


def apply_offload(
    components: WanComponents,
    mode: str,
    device: torch.device | str,
    vae_tiling: bool = False,
    transformers: Iterable[torch.nn.Module] = (),
) -> Offload:
    """Applies offload ``mode`` (one of :data:`OFFLOAD_MODES`) with ``device`` as the execution device, and VAE
    tiling, to ``components`` (loaded on the CPU for any mode but ``none``) and to further ``transformers``; sets
    ``components.device`` to ``device`` (where ``generate()`` puts the latents). Returns the :class:`Offload` to
    call :meth:`~Offload.prepare` and :meth:`~Offload.release` on around each run."""
    device = torch.device(device)
    check_offload(mode, device)
    components.device = device
    return Offload(mode, device, vae_tiling).attach(components, transformers)

"""The conditioning probe: does the transformer read each word of its caption? (an early gate)

The swap test: fixed validation clips of the synthetic world, fixed noise, a few fixed sigmas; the flow
loss with the true caption against the loss with one caption word swapped for another value of the same
attribute (colour, shape, motion, background). A model that follows a word predicts worse when it is
swapped (ratio > 1); a ratio near 1 means the word is ignored. Logged with the held-out loss every
``validation.probe_every`` steps into ``metrics.jsonl`` (``{"step", "probe": {...}}``).

A base whose shape and motion ratios stay near 1 after its first stage is not trained further as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from training.config import PROBE_SPLITS, DataSection, ValidationSection
from world.synthetic import SyntheticVideoDataset, SyntheticWorld, caption_for

if TYPE_CHECKING:
    from training.ema import EMA
    from training.encoding import Encoder

PROBE_SIGMAS: tuple[float, ...] = (0.3, 0.6, 0.9)
# the world field each attribute's values come from, and where it sits in an attribute dict
_VALUES = {"colour": "colours", "shape": "shapes", "motion": "motions", "background": "backgrounds"}


def swapped(attributes: dict[str, Any], attribute: str, world: SyntheticWorld) -> dict[str, Any] | None:
    """``attributes`` with its first object's ``attribute`` (or the background) replaced by the world's next
    value of it (cyclically), or None when the world has only one value."""
    values = getattr(world, _VALUES[attribute])
    if len(values) < 2:
        return None
    out = {**attributes, "objects": [dict(o) for o in attributes["objects"]]}
    holder = out if attribute == "background" else out["objects"][0]
    holder[attribute] = values[(values.index(holder[attribute]) + 1) % len(values)]
    return out


class SwapProbe:
    """Swap ratios of a transformer on ``num_clips`` validation clips of ``world`` (``split="train"``: the first
    ``num_clips`` training clips of the same seed, the ones a synthetic dataset or its cache starts with).

    ``encoder`` has ``latents(video (B, 3, T, H, W)) -> (B, C, F, h, w)`` and ``text(list[str]) -> (B, L, D)``
    (:class:`training.encoding.Encoder`); everything is encoded once, here.
    """

    def __init__(
        self,
        encoder: Encoder,
        world: SyntheticWorld,
        num_frames: int,
        height: int,
        width: int,
        num_clips: int = 8,
        sigmas: Sequence[float] = PROBE_SIGMAS,
        seed: int = 0,
        split: str = "validation",
    ) -> None:
        if num_clips < 1:
            raise ValueError(f"the probe needs at least one clip, got num_clips={num_clips}")
        if not sigmas or not all(0 < s < 1 for s in sigmas):
            raise ValueError(f"probe sigmas must lie in (0, 1), got {list(sigmas)}")
        if split not in PROBE_SPLITS:
            raise ValueError(f"probe split must be one of {PROBE_SPLITS}, got {split!r}")
        data = SyntheticVideoDataset(
            num_clips, seed=seed, split=split, num_frames=num_frames, height=height, width=width, world=world
        )
        attrs = [data.attributes(i) for i in range(num_clips)]
        video = torch.stack([data[i]["video"] for i in range(num_clips)])
        # kept on the CPU (the noise is drawn there; each call moves a batch to the transformer's device): an
        # encoder on a GPU gives GPU latents, which the CPU noise could not be mixed with
        self.latents = encoder.latents(video).float().cpu()
        # every caption in full (background named), so a swap changes exactly one word's meaning
        self.text = encoder.text([caption_for(a, sizes=world.size_words) for a in attrs]).float().cpu()
        self.swaps: dict[str, torch.Tensor] = {}
        for attribute in _VALUES:
            changed = [swapped(a, attribute, world) for a in attrs]
            if all(c is not None for c in changed):
                captions = [caption_for(c, sizes=world.size_words) for c in changed if c is not None]
                self.swaps[attribute] = encoder.text(captions).float().cpu()
        g = torch.Generator().manual_seed(seed + 12345)
        self.noise = torch.randn(self.latents.shape, generator=g)
        self.sigmas = tuple(float(s) for s in sigmas)

    @torch.no_grad()
    def __call__(self, transformer: Any) -> dict[str, Any]:
        """``{"loss": {sigma: true-caption loss}, "ratio": {attribute: {sigma: swapped / true}},
        "mean_ratio": {attribute: mean over sigmas}}`` (sigmas as strings, for JSON)."""
        p = next(transformer.parameters()) if hasattr(transformer, "parameters") else None
        device, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)

        def loss(x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, target: torch.Tensor) -> float:
            pred = transformer(
                hidden_states=x_t.to(device, dtype),
                timestep=t.to(device),
                encoder_hidden_states=text.to(device, dtype),
                return_dict=False,
            )[0]
            return float((pred.float().cpu() - target).square().mean())

        out: dict[str, Any] = {"loss": {}, "ratio": {a: {} for a in self.swaps}}
        for s in self.sigmas:
            x_t = (1 - s) * self.latents + s * self.noise
            target = self.noise - self.latents
            t = torch.full((len(x_t),), s * 1000.0)
            base = loss(x_t, t, self.text, target)
            out["loss"][str(s)] = base
            for attribute, text in self.swaps.items():
                out["ratio"][attribute][str(s)] = loss(x_t, t, text, target) / base if base > 0 else float("nan")
        out["mean_ratio"] = {a: sum(r.values()) / len(r) for a, r in out["ratio"].items()}
        return out


def describe(result: dict[str, Any]) -> str:
    """One line: ``swap ratios colour 1.52 shape 1.01 motion 1.00 background 1.10``."""
    return "swap ratios " + " ".join(f"{a} {r:.3f}" for a, r in result["mean_ratio"].items())


def probe_from_config(data: DataSection, validation: ValidationSection, seed: int, components: Any) -> SwapProbe:
    """The probe of a run: ``validation.probe_clips`` clips of ``data.world`` (``validation.probe_split``) at the
    run's clip size, drawn with ``seed`` (``train.seed``), encoded with the model's own VAE and text encoder."""
    from training.data import synthetic_world
    from training.encoding import Encoder

    return SwapProbe(
        Encoder(components, data.max_sequence_length),
        synthetic_world(data),
        data.num_frames,
        data.height,
        data.width,
        num_clips=validation.probe_clips,
        seed=seed,
        split=validation.probe_split,
    )


def log_probe(
    probe: SwapProbe, evaluate: Callable[[Any], float], model: Any, ema: EMA | None, step: int
) -> dict[str, Any]:
    """One ``metrics.jsonl`` row: the held-out loss and the probe on the raw weights, and on the EMA's when
    there is one (``*_ema``)."""
    import contextlib

    was = model.training
    model.eval()
    try:
        row: dict[str, Any] = {"step": step, "eval_loss": evaluate(model), "probe": probe(model)}
        if ema is not None:
            with ema.swapped_in(model) if ema is not None else contextlib.nullcontext():
                row["eval_loss_ema"] = evaluate(model)
                row["probe_ema"] = probe(model)
    finally:
        model.train(was)
    return row

"""The built-in model's factory: how ``assets/builtin/`` is made and judged, apart from the recipe.

- ``build``: the staged, resumable build (``python -m factory build``);
- ``evaluate``: the miniature Table 5 (``python -m factory.evaluate``);
- ``vae_ceiling``: what the VAE alone keeps of a clip (``python -m factory.vae_ceiling``);
- ``latent_stats``: generated against encoded latents, frame by frame;
- ``vae_speed``: a VAE training step's time per precision;
- ``examples``: the app's example prompts, chosen from an evaluation's videos;
- ``paired``: two evaluations compared on the videos both drew (same prompt and seed);
- ``transfer_study``: the conversion-recipe study on the built-in model;
- ``next``: the next design's stages, kept in ``assets/builtin-next/``; ``v3``: the third design (its model
  directory, the VAE gate, the cross-attention's share per caption word);
- ``arms``: short A/B arms of the base's recipe from one checkpoint, judged by the probe against a control;
- ``hybrid_split``: which layers the hybrid keeps softmax: a start-loss screen of every split and short arms
  judged by the evaluation;
- ``reship``: a later base stage's conversions, evaluation and diagnoses in one resumable command, shipped only
  when it beats the shipped model's committed evaluation (``python -m factory.reship CHECKPOINT --name NAME``).

The world it is trained on and the analyser that judges it are the package ``world`` below; this package
sits above the recipe (it runs ``training`` stages) and nothing imports it but its own commands and tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def output_path(out: str | Path, suffix: str) -> Path:
    """``<out><suffix>`` for a command's ``--out`` stem: the suffix is appended, so a stem with a dot
    (``sweep_sigma0.75``) keeps it (``Path.with_suffix`` would replace ``.75``); a stem that already ends
    with the suffix is kept as it is."""
    out = str(out)
    return Path(out if out.endswith(suffix) else out + suffix)


ROOT = Path(__file__).resolve().parents[1]  # the checkout this package runs from


def world_clips(count: int, defaults: dict, world, seed: int = 0, split: str = "validation"):
    """``count`` clips of ``world`` (a ``world.synthetic`` world) at a model's default size (``defaults``: its
    ``num_frames``, ``height`` and ``width``, e.g. ``components.defaults``): what the factory's judges read
    (the evaluation, the probes, the gate, the latent statistics)."""
    from world.synthetic import SyntheticVideoDataset

    return SyntheticVideoDataset(
        count,
        seed=seed,
        split=split,
        num_frames=defaults["num_frames"],
        height=defaults["height"],
        width=defaults["width"],
        world=world,
    )


def run_command(cmd: Sequence[str], quiet: bool = False) -> None:
    """Runs a repository command from the checkout's root (the configs' and commands' paths are the repository's),
    echoing it (without the interpreter's path) first; a failure raises ``CalledProcessError``. ``quiet``: its
    standard output is dropped (its errors still show)."""
    cmd = list(cmd)
    print("$", " ".join(cmd[1:] if cmd[0] == sys.executable else cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL if quiet else None)


def portable(value):
    """``value`` (a record: dicts, lists, strings, numbers) with this checkout's absolute path taken out of every
    string: a path inside the checkout is written relative to its root (``assets/builtin``, not
    ``/home/me/clone/assets/builtin``), so a committed record reads the same in every clone and names no one's
    machine. Paths outside the checkout are kept as they are."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        root = str(ROOT)
        return "." if value == root else value.replace(root + "/", "")
    return value


def dump_json(result: dict, indent: int = 1) -> str:
    """``result`` as the factory's records are written (:func:`portable`, indented, a final newline)."""
    return json.dumps(portable(result), indent=indent) + "\n"


def write_json(out: str | Path, result: dict) -> Path:
    """Writes ``result`` to ``<out>.json`` (folders made as needed, paths :func:`portable`) and returns that
    path: the commands' ``--out``."""
    from common.outputs import write_text_atomic

    path = output_path(out, ".json")
    return write_text_atomic(path, dump_json(result))

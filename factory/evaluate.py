"""Evaluate the built-in model's variants the way the paper's Table 5 compares them, in miniature.

    python -m factory.evaluate                                  # assets/builtin, every variant
    python -m factory.evaluate --num-prompts 8 --steps 10       # quicker
    python -m factory.evaluate --model DIR --out benchmarks/results/my_eval
    python -m factory.evaluate --variants flash --data-seed 1 --loss-batches 0 --guidance 1.5 2 3 4 \
        --out benchmarks/results/builtin_cfg_sweep_cpu    # pick the CFG scale on a separate draw

For each variant (flash = the softmax base; linear, mhla, mhla-hybrid = its fine-tuned conversions):

- **held-out flow loss**: the flow-matching loss on the synthetic validation split (captions and
  held-out attribute combinations training never saw), with the same noise and timesteps for every
  variant;
- **semantic score**: a video for each of the first ``--num-prompts`` validation captions and each
  seed, judged by :mod:`world.analyse` (colour, shape, count, motion; overall = all right), split
  into in-distribution prompts and prompts with a held-out combination; the analyser's score on
  the VAE's own reconstructions of the real clips is printed as the ceiling;
- **latency**: the mean denoising and total time of those generations on this machine.

With several ``--guidance`` values it sweeps them instead: the semantic score per variant and scale,
each variant's best scale (overall accuracy, ties broken by the mean attribute accuracy) marked, and a
plot of accuracy against the scale. Sweep on another ``--data-seed`` than the one the table reports, so
the scale is not tuned on the prompts it is judged by.

Writes ``<out>.json``, ``<out>.md`` (the table README quotes) and ``<out>.png`` (accuracy bars and the
first, middle and last frame of a few videos per variant); ``<out>`` defaults to
``benchmarks/results/builtin_eval_<device>``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from common.outputs import atomic_write, write_text_atomic
from factory import output_path, world_clips, write_json
from factory.vae_ceiling import reconstruction_ceiling, to_frames
from pipelines import BUILTIN_DIR, VARIANTS, GenerationRequest, load_components, load_transformer
from pipelines.attention import SOFTMAX, VARIANT_SPECS
from pipelines.model_dir import builtin_info
from pipelines.pipeline import generate
from training.encoding import Encoder
from training.flow import FlowMatching
from world.analyse import ANALYSER_VERSION, ATTRIBUTES, analyse, parse_caption, score
from world.synthetic import SHAPES, WORLDS

NAMES = {name: spec.label for name, spec in VARIANT_SPECS.items()}


def variant_transformers(components, variants: list[str]) -> dict:
    """The transformer each variant runs on: its fine-tuned checkpoint where the model ships one."""
    out = {}
    for v in variants:
        if v in components.variant_dirs:
            out[v] = load_transformer(components.variant_dirs[v], dtype=components.dtype, device=components.device)
        elif v == SOFTMAX:
            out[v] = components.transformer
        else:
            raise ValueError(
                f"the model has no fine-tuned {v!r} transformer (variants/{v}); it has {sorted(components.variant_dirs)}"
            )
    return out


@torch.no_grad()
def heldout_loss(
    components, transformers: dict, dataset, batches: int, batch_size: int, seed: int = 0, draws: int = 3
) -> dict:
    """Flow-matching loss per variant over the same latents, noise and timesteps, for ``draws`` independent
    draws of noise and timesteps (each clip encoded once): ``{variant: {"mean", "std", "draws"}}``, where
    ``draws`` are the per-draw means and ``std`` their sample standard deviation (0 for one draw)."""
    encoder = Encoder(components, components.defaults.get("max_sequence_length", 512))
    flow = FlowMatching()
    generators = [torch.Generator().manual_seed(seed * 1000 + k) for k in range(draws)]
    losses = {v: [[] for _ in range(draws)] for v in transformers}
    for b in tqdm(range(batches), desc="held-out loss", leave=False):
        items = [dataset[(b * batch_size + j) % len(dataset)] for j in range(batch_size)]
        latents = encoder.latents(torch.stack([it["video"] for it in items]))
        text = encoder.text([it["caption"] for it in items])
        for k, g in enumerate(generators):
            x_t, t, target = flow.noisy_input(latents, g)
            for v, tr in transformers.items():
                pred = tr(
                    hidden_states=x_t.to(tr.dtype),
                    timestep=t,
                    encoder_hidden_states=text.to(tr.dtype),
                    return_dict=False,
                )[0]
                losses[v][k].append(F.mse_loss(pred.float(), target.float()).item())
    out = {}
    for v, per_draw in losses.items():
        means = [float(np.mean(x)) for x in per_draw]
        out[v] = {
            "mean": float(np.mean(means)),
            "std": float(np.std(means, ddof=1)) if draws > 1 else 0.0,
            "draws": means,
        }
    return out


GRID_PROMPTS = 4  # columns of the PNG's video grid: the first validation prompts


@torch.no_grad()
def vae_ceiling(components, dataset, prompts: list[int]) -> tuple[dict, list[np.ndarray]]:
    """Analyser score and PSNR of the VAE's reconstructions of the real validation clips (what a perfect
    transformer reaches; :func:`factory.vae_ceiling.reconstruction_ceiling`), and the
    reconstructions of the first :data:`GRID_PROMPTS` clips."""
    shown: list[np.ndarray] = []
    result = reconstruction_ceiling(components.vae, dataset, prompts, keep=shown, keep_first=GRID_PROMPTS)
    return result, shown


def attribute_mean(row: dict) -> float:
    """Mean accuracy over the attributes the prompts named (the sweep's tie-break when ``overall`` ties)."""
    vals = [row[a] for a in ATTRIBUTES if row[a] is not None]
    return float(np.mean(vals)) if vals else 0.0


def semantic(
    components, transformer, variant: str, validation, prompts, seeds, steps, guidance, max_sigma=None, kept=None
) -> tuple[dict, list]:
    """Analyser scores and latency of one variant at one CFG scale; also the first seed's frames of the grid's prompts.
    ``kept``: a list that gets every video's uint8 frames ``(T, H, W, 3)``, in the order of ``per_video``."""
    verdicts, timings, frames = [], [], []
    for i in tqdm(prompts, desc=f"generate [{variant}, CFG {guidance:g}]"):
        caption = validation[i]["caption"]
        for seed in seeds:
            request = GenerationRequest(
                prompt=caption,
                variant=variant,
                seed=seed,
                num_inference_steps=steps,
                guidance_scale=guidance,
                guidance_max_sigma=max_sigma,
            )
            result = generate(components, request, transformer=transformer, show_progress=False)
            verdict = analyse(result.frames, caption, colours=validation.world.colours)
            verdict["held_out"] = validation.attributes(i)["held_out"]
            verdict["prompt"], verdict["caption"], verdict["seed"] = i, caption, seed
            verdicts.append(verdict)
            timings.append(result.timing)
            if kept is not None:  # uint8 as the analyser reads float frames (scaled, truncated): the same verdicts
                kept.append(to_uint8(result.frames))
            if i < GRID_PROMPTS and seed == seeds[0]:
                frames.append(result.frames)
    held = [x for x in verdicts if x["held_out"]]
    seen = [x for x in verdicts if not x["held_out"]]
    by_seed = [score(verdicts[j :: len(seeds)])["overall"] for j in range(len(seeds))]  # prompt-major order
    row = {
        **score(verdicts),
        "overall_by_seed": by_seed,
        "overall_std": float(np.std(by_seed, ddof=1)) if len(by_seed) > 1 else 0.0,
        "overall_in_distribution": score(seen)["overall"] if seen else None,
        "overall_held_out": score(held)["overall"] if held else None,
        "denoise_s": float(np.mean([t.denoising for t in timings])),
        "total_s": float(np.mean([t.total for t in timings])),
        # every video's verdict (which prompts work, for the app's examples: factory.examples)
        "per_video": [video_record(x) for x in verdicts],
    }
    return row, frames


def video_record(verdict: dict) -> dict:
    """A video's entry of ``per_video``: its prompt, caption, seed and split, each attribute's verdict, and
    ``read``: the shape the analyser read for each colour the caption names (None: no object of it)."""
    record = {k: verdict[k] for k in ("prompt", "caption", "seed", "held_out", *ATTRIBUTES)}
    record["read"] = {c: o["shape"] for c, o in verdict["found"]["objects"].items()}
    return record


def shape_readings(per_video: list[dict]) -> dict[str, dict]:
    """Per shape the captions ask for: ``{"asked": n, "right": k, "read_as": {shape or "none": count}}`` over the
    objects of ``per_video`` (what each was read as, from ``read``; an evaluation written before ``read`` was
    kept counts its single-shape videos by their shape verdict, with no ``read_as``)."""
    table: dict[str, dict] = {}
    for video in per_video:
        if "caption" not in video:
            continue
        objects = [o for o in parse_caption(video["caption"])["objects"] if "shape" in o]
        read = video.get("read")
        for obj in objects:
            row = table.setdefault(obj["shape"], {"asked": 0, "right": 0, "read_as": {}})
            if read is None:
                if len(objects) != 1 or video["shape"] is None:
                    continue
                row["asked"] += 1
                row["right"] += bool(video["shape"])
                continue
            got = read.get(obj.get("colour"))
            row["asked"] += 1
            row["right"] += got == obj["shape"]
            if got != obj["shape"]:
                key = got or "none"
                row["read_as"][key] = row["read_as"].get(key, 0) + 1
    return {k: table[k] for k in SHAPES if k in table}


def shape_markdown(res: dict) -> list[str]:
    """The table of which shapes each variant draws: objects read as the shape asked / objects asked, and what the
    others were read as (``other``: no outline fits; ``none``: no object of the colour)."""
    tables = {v: shape_readings(r.get("per_video") or []) for v, r in res["variants"].items()}
    shapes = [s for s in SHAPES if any(s in t for t in tables.values())]
    if not shapes:
        return []
    lines = [
        "",
        "Shape by the shape asked for: objects read as it / objects asked (what the others were read as).",
        "",
        "| variant | " + " | ".join(shapes) + " |",
        "|---|" + "---:|" * len(shapes),
    ]
    for v, table in tables.items():
        cells = []
        for s in shapes:
            row = table.get(s)
            if row is None:
                cells.append("")
                continue
            wrong = sorted(row["read_as"].items(), key=lambda kv: (-kv[1], kv[0]))
            note = f" ({', '.join(f'{k} {n}' for k, n in wrong)})" if wrong else ""
            cells.append(f"{row['right']}/{row['asked']}{note}")
        lines.append(f"| {NAMES.get(v, v)} | " + " | ".join(cells) + " |")
    return lines


def run(args) -> dict:
    components = load_components(args.model, dtype=args.dtype, device=args.device)
    if components.random_weights:
        raise SystemExit("error: the model has random weights; evaluate the built-in model or a trained one (--model)")
    if args.transformer:  # a stage's checkpoint, judged with the model directory's other parts
        components.transformer = load_transformer(args.transformer, dtype=components.dtype, device=components.device)
        components.variant_dirs = {}  # fine-tuned variants of another base would not match it
        components.source += f", transformer {args.transformer}"
    d = components.defaults
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"error: unknown variants {bad}; expected some of {VARIANTS}")
    transformers = variant_transformers(components, variants)
    validation = world_clips(
        max(args.num_prompts, args.loss_batches * args.batch_size), d, WORLDS[args.world], seed=args.data_seed
    )
    print(f"model: {components.source}; world {args.world}; variants {variants}; device {components.device}")
    t0 = time.time()
    if args.loss_batches:
        losses = heldout_loss(
            components, transformers, validation, args.loss_batches, args.batch_size, draws=args.noise_draws
        )
        print("held-out flow loss: " + ", ".join(f"{v} {x['mean']:.4f} ± {x['std']:.4f}" for v, x in losses.items()))
    else:
        losses = dict.fromkeys(variants, {"mean": None, "std": None, "draws": []})
    prompts = list(range(args.num_prompts))
    shown = [validation[i] for i in prompts[:GRID_PROMPTS]]  # each clip rendered once
    # the grid's reference rows: what each caption describes, and what the VAE makes of it
    grid = {"real clip": [to_frames(item["video"]) for item in shown]}
    ceiling = None  # the sweep's table does not show the ceiling (it does not depend on the CFG scale)
    if not args.guidance or len(args.guidance) == 1:
        ceiling, grid["VAE reconstruction"] = vae_ceiling(components, validation, prompts)
        print(
            f"analyser on VAE reconstructions of the real clips: overall {ceiling['overall']:.2f}, "
            f"PSNR {ceiling['psnr_db']} dB (objects {ceiling['psnr_object_db']} dB)"
        )

    info_dir = Path(args.model) if args.model else BUILTIN_DIR
    guidances = args.guidance or [d["guidance_scale"]]
    max_sigma = args.guidance_max_sigma if args.guidance_max_sigma is not None else d.get("guidance_max_sigma")
    rows, samples, videos = {}, {}, {}
    for v in variants:
        by_guidance = {}
        for g in guidances:
            kept: list[np.ndarray] = []
            row, frames = semantic(
                components, transformers[v], v, validation, prompts, args.seeds, args.steps, g, max_sigma, kept
            )
            videos[f"{v}@{g:g}"] = np.stack(kept)
            by_guidance[g] = row
            samples.setdefault(v, frames)
            print(
                f"{v} (CFG {g:g}): overall {row['overall']:.2f} (colour {row['colour']:.2f}, shape {row['shape']:.2f}, "
                f"count {row['count']:.2f}, motion {row['motion']:.2f}); {row['total_s']:.1f} s per video"
            )
        if len(guidances) == 1:
            rows[v] = {
                "flow_loss": losses[v]["mean"],
                "flow_loss_std": losses[v]["std"],
                "flow_loss_draws": losses[v]["draws"],
                **by_guidance[guidances[0]],
            }
        else:
            best = max(guidances, key=lambda g: (by_guidance[g]["overall"], attribute_mean(by_guidance[g])))
            rows[v] = {
                "flow_loss": losses[v]["mean"],
                "flow_loss_std": losses[v]["std"],
                "best_guidance": best,
                "by_guidance": {f"{g:g}": r for g, r in by_guidance.items()},
            }
    return {
        "model": components.source,
        "builtin": builtin_info(info_dir) if (info_dir / "builtin.json").is_file() else None,
        "device": str(components.device),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "analyser_version": ANALYSER_VERSION,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "num_prompts": len(prompts),
        "seeds": list(args.seeds),
        "num_inference_steps": args.steps or d["num_inference_steps"],
        "guidance_scale": guidances[0] if len(guidances) == 1 else guidances,
        "guidance_max_sigma": max_sigma,
        "loss_clips": args.loss_batches * args.batch_size,
        "noise_draws": args.noise_draws,
        "data_seed": args.data_seed,
        "world": args.world,
        "vae_ceiling": ceiling,
        "variants": rows,
        "grid_prompts": [item["caption"] for item in shown],
        "minutes": round((time.time() - t0) / 60, 1),
        "_samples": samples,
        "_grid": grid,
        "_videos": videos,
    }


def to_uint8(frames) -> np.ndarray:
    """Frames as :func:`world.analyse.analyse` reads them: uint8 as they are, floats in [0, 1] (or [0, 255]) scaled
    and truncated."""
    frames = np.asarray(frames)
    if frames.dtype == np.uint8:
        return frames
    return np.clip(frames.astype(np.float32) * (255.0 if frames.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)


# every generated video of an evaluation, beside the run's other outputs (not committed: a few MB): a later analyser
# re-judges them without generating again (world.analyse's version changes, the videos do not)
VIDEOS_DIR = Path("runs/eval-videos")


def save_videos(videos: dict[str, np.ndarray], res: dict, out: Path) -> Path:
    """``runs/eval-videos/<out's name>.npz``: per ``variant@guidance`` the uint8 frames ``(videos, T, H, W, 3)`` in
    ``per_video``'s order, and that order's captions and seeds (as JSON)."""
    import json

    path = VIDEOS_DIR / f"{Path(out).name}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    order = {}
    for key in videos:
        variant, guidance = key.split("@")
        row = res["variants"][variant]
        listed = row.get("per_video") or row.get("by_guidance", {}).get(guidance, {}).get("per_video") or []
        order[key] = [{"caption": x["caption"], "seed": x["seed"], "prompt": x["prompt"]} for x in listed]
    with atomic_write(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, order=np.array(json.dumps(order)), **videos)
    print(f"wrote the {sum(len(v) for v in videos.values())} videos to {path} (for re-judging)")
    return path


def rejudge(out: Path) -> dict:
    """An evaluation judged again by this version of the analyser, from the videos it kept (:func:`save_videos`):
    ``OUT.json``'s per-video verdicts and scores replaced (losses, timings and settings kept), ``OUT.md`` and
    ``OUT.png`` rewritten (the PNG's grid: the real clips and each variant's videos). The VAE ceiling is judged
    again only when the run recorded it per clip; otherwise it is marked as the earlier analyser's."""
    import json

    out = Path(out)
    res = json.loads(output_path(out, ".json").read_text())
    if isinstance(res["guidance_scale"], list):
        raise ValueError(f"{out}: a guidance sweep; re-judge one scale at a time (not supported)")
    path = VIDEOS_DIR / f"{out.name}.npz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} holds no videos of {out}: re-run the evaluation (it keeps them now)")
    kept = np.load(path)
    order = json.loads(str(kept["order"]))
    world = WORLDS[res.get("world", "v1")]
    g = f"{res['guidance_scale']:g}"
    samples = {}
    for v, row in res["variants"].items():
        frames, listed = kept[f"{v}@{g}"], order[f"{v}@{g}"]
        held = {(x["prompt"], x["seed"]): x["held_out"] for x in row["per_video"]}
        verdicts = []
        for video, item in zip(frames, listed):
            verdict = analyse(video, item["caption"], colours=world.colours)
            verdict.update(prompt=item["prompt"], caption=item["caption"], seed=item["seed"])
            verdict["held_out"] = held[(item["prompt"], item["seed"])]
            verdicts.append(verdict)
        seeds = res["seeds"]
        held_out = [x for x in verdicts if x["held_out"]]
        seen = [x for x in verdicts if not x["held_out"]]
        by_seed = [score(verdicts[j :: len(seeds)])["overall"] for j in range(len(seeds))]
        row.update(score(verdicts))
        row.update(
            overall_by_seed=by_seed,
            overall_std=float(np.std(by_seed, ddof=1)) if len(by_seed) > 1 else 0.0,
            overall_in_distribution=score(seen)["overall"] if seen else None,
            overall_held_out=score(held_out)["overall"] if held_out else None,
            per_video=[video_record(x) for x in verdicts],
        )
        samples[v] = [frames[i] for i, x in enumerate(listed) if x["prompt"] < GRID_PROMPTS and x["seed"] == seeds[0]]
    if res.get("analyser_version") != ANALYSER_VERSION and res.get("vae_ceiling"):
        res["vae_ceiling"]["analyser_version"] = res.get("analyser_version")
    res["analyser_version"] = ANALYSER_VERSION
    res["rejudged"] = time.strftime("%Y-%m-%d %H:%M")
    d = res.get("builtin") or {}
    size = (d.get("defaults") or {}) if isinstance(d, dict) else {}
    size = {"num_frames": 17, "height": 128, "width": 160, **size}  # records before the defaults were kept
    validation = world_clips(GRID_PROMPTS, size, world, seed=res.get("data_seed", 0))
    grid = {"real clip": [to_frames(validation[i]["video"]) for i in range(min(GRID_PROMPTS, res["num_prompts"]))]}
    plot({**res, "_samples": samples, "_grid": grid}, output_path(out, ".png"))
    write_json(out, res)
    write_text_atomic(output_path(out, ".md"), markdown(res))
    return res


def seed_spread(videos: list[dict], attribute: str) -> float | None:
    """Sample standard deviation over seeds of one attribute's accuracy, from an evaluation's ``per_video``
    verdicts (None with fewer than two seeds that judged it)."""
    per_seed = {}
    for x in videos:
        if x[attribute] is not None:
            per_seed.setdefault(x["seed"], []).append(bool(x[attribute]))
    return float(np.std([np.mean(v) for v in per_seed.values()], ddof=1)) if len(per_seed) > 1 else None


def interval(res: dict) -> str:
    """The header's note of a guidance interval ("" when every step is guided)."""
    m = res.get("guidance_max_sigma")
    return "" if m is None or m >= 1 else f" at sigma <= {m:g} only"


def markdown(res: dict) -> str:
    def f(x, p=2):
        return "n/a" if x is None else f"{x:.{p}f}"

    if isinstance(res["guidance_scale"], list):
        return sweep_markdown(res)

    def pm(x, spread, p=2):  # mean ± spread, the spread left out when there is none to show
        return f(x, p) if x is None or not spread else f"{x:.{p}f} ± {spread:.{p}f}"

    lines = [
        f"Built-in model, {res['num_prompts']} validation prompts x {len(res['seeds'])} seed(s), "
        f"{res['num_inference_steps']} steps, CFG {res['guidance_scale']}{interval(res)}, on {res['device']} ({res['machine']}), {res['date']}, analyser v{res.get('analyser_version', 1)}. "
        f"Held-out flow loss: mean ± standard deviation over {res.get('noise_draws', 1)} draws of noise and timesteps "
        f"on {res['loss_clips']} clips; attributes and overall: mean over prompts ± standard deviation over seeds.",
        "",
        "| variant | held-out flow loss | colour | shape | count | motion | overall | overall, held-out combos | latency per video (denoise) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in res["variants"].items():
        attrs = " | ".join(
            pm(r[a], seed_spread(r.get("per_video", []), a)) for a in ("colour", "shape", "count", "motion")
        )
        lines.append(
            f"| {NAMES.get(v, v)} | {pm(r['flow_loss'], r.get('flow_loss_std'), 4)} | {attrs} | "
            f"**{pm(r['overall'], r.get('overall_std'))}** | {f(r['overall_held_out'])} | "
            f"{r['total_s']:.1f} s ({r['denoise_s']:.1f} s) |"
        )
    c = res["vae_ceiling"]
    psnr = f", PSNR {c['psnr_db']} dB" if "psnr_db" in c else ""  # JSONs before the ceiling had PSNR
    lines.append(
        f"| *VAE reconstruction of the real clips (ceiling{psnr})* | | {f(c['colour'])} | {f(c['shape'])} | {f(c['count'])} | "
        f"{f(c['motion'])} | {f(c['overall'])} | | |"
    )
    lines += shape_markdown(res)
    return "\n".join(lines) + "\n"


def sweep_markdown(res: dict) -> str:
    """The CFG sweep: one row per variant and scale; each variant's best scale (overall, then attribute mean) in bold."""
    lines = [
        f"CFG sweep of the built-in model, {res['num_prompts']} validation prompts (data seed {res['data_seed']}) x "
        f"{len(res['seeds'])} seed(s), {res['num_inference_steps']} steps{interval(res)}, on {res['device']} ({res['machine']}), {res['date']}, analyser v{res.get('analyser_version', 1)}.",
        "",
        "| variant | CFG | " + " | ".join(ATTRIBUTES) + " | overall | attribute mean | latency per video |",
        "|---|---:|" + "---:|" * (len(ATTRIBUTES) + 3),
    ]
    for v, r in res["variants"].items():
        for g, row in r["by_guidance"].items():
            best = g == f"{r['best_guidance']:g}"
            cells = [row[a] for a in ATTRIBUTES] + [row["overall"], attribute_mean(row)]
            shown = " | ".join("n/a" if x is None else f"{x:.2f}" for x in cells)
            scale = f"**{g}** (best)" if best else g
            lines.append(f"| {NAMES.get(v, v)} | {scale} | {shown} | {row['total_s']:.1f} s |")
    return "\n".join(lines) + "\n"


def plot_sweep(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [*ATTRIBUTES, "overall"]
    fig, axes = plt.subplots(1, len(keys), figsize=(3 * len(keys), 3), sharey=True)
    for ax, k in zip(axes, keys):
        for v, r in res["variants"].items():
            gs = [float(g) for g in r["by_guidance"]]
            ax.plot(gs, [r["by_guidance"][g][k] or 0 for g in r["by_guidance"]], "o-", label=NAMES.get(v, v))
        ax.set_title(k)
        ax.set_xlabel("CFG scale")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)


def plot(res: dict, path: Path) -> None:
    """Accuracy bars per variant, and under them one grid of videos (first, middle and last frame): a column
    per prompt (its caption above), a row for the real clip, the VAE's reconstruction of it and each
    variant's video for the same seed."""
    if isinstance(res["guidance_scale"], list):
        return plot_sweep(res, path)
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(res["variants"])
    rows = {**res.get("_grid", {}), **{NAMES.get(v, v): res["_samples"].get(v, []) for v in variants}}
    cols = max((len(r) for r in rows.values()), default=0)
    _, h, w = next((r[0].shape[:3] for r in rows.values() if r), (1, 1, 3))
    # sizes in inches: thumbnails of three frames side by side keep the video's aspect
    left, thumb_w, gap, bars, title = 1.5, 2.6, 0.06, 2.0, 0.5
    thumb_h = thumb_w * h / (3 * w)
    width = left + max(cols, 1) * (thumb_w + gap) + 0.2
    height = 0.5 + bars + 0.5 + title + len(rows) * (thumb_h + gap) + 0.1
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes([left / width, 1 - (0.5 + bars) / height, (width - left - 0.2) / width, bars / height])
    keys = [*ATTRIBUTES, "overall"]
    bar = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar(np.arange(len(keys)) + i * bar, [res["variants"][v][k] or 0 for k in keys], bar, label=NAMES.get(v, v))
    ax.set_xticks(np.arange(len(keys)) + 0.4 - bar / 2, keys)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.legend(ncol=len(variants), fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0))
    top = 0.5 + bars + 0.5 + title
    captions = res.get("grid_prompts", [])
    for r, (name, videos) in enumerate(rows.items()):
        for c, frames in enumerate(videos):
            y = top + r * (thumb_h + gap) + thumb_h
            a = fig.add_axes([(left + c * (thumb_w + gap)) / width, 1 - y / height, thumb_w / width, thumb_h / height])
            n = len(frames)
            a.imshow(np.concatenate([frames[0], frames[n // 2], frames[-1]], axis=1))
            a.set_xticks([])
            a.set_yticks([])
            if c == 0:
                a.set_ylabel(name, fontsize=8, rotation=0, ha="right", va="center")
            if r == 0 and c < len(captions):
                a.set_title(textwrap.fill(captions[c], 44), fontsize=7, loc="left")
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    """``python -m factory.evaluate``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.evaluate")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the built-in model in assets/builtin)")
    p.add_argument(
        "--transformer",
        default=None,
        help="a transformer folder that replaces the model directory's (a stage's checkpoint, e.g. "
        "runs/builtin-v2/base2/checkpoints/step-0001000/transformer, its EMA); with --variants flash",
    )
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--num-prompts", type=int, default=24, help="validation captions to generate")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument(
        "--guidance",
        type=float,
        nargs="+",
        default=None,
        help="CFG scale (default: the model's); several values sweep them and mark each variant's best",
    )
    p.add_argument(
        "--guidance-max-sigma",
        type=float,
        default=None,
        help="guide only the steps whose noise level sigma is at most this (default: the model's; 1 = every step)",
    )
    p.add_argument("--loss-batches", type=int, default=16)
    p.add_argument(
        "--noise-draws", type=int, default=3, help="independent noise/timestep draws of the held-out loss (error bars)"
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic validation split")
    p.add_argument(
        "--world",
        choices=sorted(WORLDS),
        default="v1",
        help="the synthetic world the model was trained on (world.synthetic.WORLDS; the shipped model: v1)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--out",
        default=None,
        help="writes OUT.json, OUT.md, OUT.png (default benchmarks/results/builtin_eval_<device>)",
    )
    p.add_argument(
        "--rejudge",
        action="store_true",
        help="judge the evaluation at --out again with this analyser, from the videos it kept (no generation)",
    )
    args = p.parse_args(argv)
    if args.rejudge:
        if not args.out:
            p.error("--rejudge needs --out (the evaluation to judge again)")
        res = rejudge(Path(args.out))
        print(markdown(res))
        return 0
    if args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.loss_batches < 0:
        p.error(f"--loss-batches must be >= 0 (0 = skip the held-out loss), got {args.loss_batches}")
    if args.noise_draws < 1:
        p.error(f"--noise-draws must be >= 1, got {args.noise_draws}")
    bad = [g for g in args.guidance or [] if not np.isfinite(g) or g < 0]
    if bad or len(set(args.guidance or [])) != len(args.guidance or []):
        p.error(f"--guidance takes distinct finite scales >= 0, got {args.guidance}")
    if args.guidance_max_sigma is not None and not 0 <= args.guidance_max_sigma <= 1:
        p.error(f"--guidance-max-sigma must be in [0, 1], got {args.guidance_max_sigma}")
    if args.transformer and [v for v in args.variants.split(",") if v] != [SOFTMAX]:
        p.error(
            f"--transformer is evaluated as flash only (its conversions are not trained), got --variants {args.variants}"
        )
    res = run(args)
    out = Path(args.out or f"benchmarks/results/builtin_eval_{res['device'].split(':')[0]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(res, output_path(out, ".png"))
    res.pop("_samples")
    res.pop("_grid", None)
    save_videos(res.pop("_videos"), res, out)
    write_json(out, res)
    table = markdown(res)
    write_text_atomic(output_path(out, ".md"), table)
    print("\n" + table)
    print(f"wrote {', '.join(str(output_path(out, s)) for s in ('.json', '.md', '.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

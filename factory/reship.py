"""Re-ship the built-in model from a later base-stage checkpoint, in one resumable command, only when it is better.

    nohup nice -n 5 python -m factory.reship runs/builtin-v3/joint/checkpoints/step-0005000 --name joint-step5000 \\
        > runs/builtin-v3/reship-joint-step5000.log 2>&1 &

Issue 49's rule: "re-ship every time a later base and its conversions beat the shipped model on the committed
evaluation". By hand that was ten commands over an hour of CPU, each waiting on the last; here they are stages of
one run in ``runs/builtin-v3/reship-NAME/`` that a killed run resumes where it stopped (each stage is recorded in
``state.json`` when it is done; a conversion resumes from its own last checkpoint):

1. ``stage``: the checkpoint's EMA and raw weights into ``assets/builtin-next/v3`` (float16: the stage weights a
   later session, or a fresh machine, resumes from; committed whether or not the model ships);
2. ``starts``: where each conversion starts, measured (:class:`HeldOutLoss`, the synthetic validation split) and
   the lowest taken: the new EMA converted afresh (``base``: a freshly converted layer is far from the softmax
   one it replaces, about 1.67 against the base's 0.09 here), the shipped conversion (``shipped``), or the shipped
   conversion with the base's progress grafted on (``graft``: :func:`graft`, the new EMA minus the one the shipped
   conversions came from, added to every weight they share). A folder given with ``--start VARIANT=DIR``
   (``given``: a conversion trained on elsewhere, e.g. beside the base between re-ships, or a
   ``factory.hybrid_split`` arm) is measured beside them and taken: the held-out loss does not say which start
   draws better. A conversion then trains on across re-ships instead of relearning from 1.67 in each; one given 0
   steps (``--conversion-steps 0,mhla-hybrid=1000``) is the shipped one, kept as it is (``kept``);
3. ``convert-<variant>``: the three conversions (linear, mhla, mhla-hybrid) fine-tuned from their starts with their
   committed configs (``factory/configs/v3/<variant>.yaml``; ``--conversion-steps`` each: one budget, or one per
   variant such as ``600,mhla=900,linear=300``), each run in ``reship-NAME/<variant>``, its final EMA kept in
   ``reship-NAME/candidate/variants`` (float16);
4. ``layout``: the candidate model folder ``reship-NAME/model`` (the shipped design's parts, the new EMA as the
   softmax transformer, the new conversions as variants);
5. ``evaluate``: the committed evaluation (48 prompts x seeds 0 1 2, analyser, CFG: the model's defaults) of the
   candidate, written to ``assets/builtin-next/v3/curves/v3-eval-NAME``, and the base's diagnoses beside it
   (unconditional shape rate, the noised-real-clip swap test and its uncaptioned twin, memorisation; the base
   stage's curves when its run folder is here: ``factory.curves``; every stage's records drawn: ``factory.progress``);
6. ``decide``: the candidate against the evaluation the shipped model names in its ``builtin.json``
   (:func:`compare`), written to ``curves/reship-NAME.json`` (and each stage's record as it ends, its time and
   the starts' losses, to ``curves/reship-NAME-state.json``: ``runs/`` is not committed);
7. ``ship`` (only when it is better): ``factory.v3 ship`` with this evaluation, the app's example prompts chosen from
   it (``factory.examples``) and their results stored with the model (``run_app.py --store-examples``).

What stays for a person: README's table and the design history (``docs/builtin-model.md``) name the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from common.outputs import atomic_dir
from factory import run_command, write_json
from factory.build import CONVERSIONS
from factory.progress import stage_step
from factory.v3 import MODEL, NEXT, WORK, WORLD
from pipelines.attention import SOFTMAX
from pipelines.model_dir import BUILTIN_DIR, VARIANTS_SUBDIR
from training.checkpoint import checkpoint_step

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "factory" / "configs" / "v3"
CURVES = NEXT / "curves"
VARIANTS = (SOFTMAX, *CONVERSIONS)
# a variant's overall may fall by at most this much for the candidate to ship (about two seeds' standard deviation
# of overall at 48 prompts x 3 seeds: 0.02-0.04 in the committed evaluations)
MAX_DROP = 0.05
# overall means within this are a tie, which the mean held-out flow loss breaks
TIE = 0.005
# what two evaluations must share to be compared
SAME = ("world", "num_prompts", "seeds", "num_inference_steps", "guidance_scale", "analyser_version", "data_seed")

Runner = Callable[[Sequence[str]], None]
Measure = Callable[[str, Path], float]
WEIGHTS = "diffusion_pytorch_model.safetensors"


def compare(candidate: dict, shipped: dict | None) -> dict:
    """Whether the ``candidate`` evaluation (:mod:`factory.evaluate`'s JSON) beats the ``shipped`` one: the mean over
    the four variants of ``overall`` (every attribute right: what a person sees across the page's columns) rises by
    more than :data:`TIE`, or ties and the mean held-out flow loss falls; and no variant's ``overall`` falls by more
    than :data:`MAX_DROP`. Nothing shipped with an evaluation: it ships. Raises ``ValueError`` when the two were
    not measured the same way (:data:`SAME`) or lack a variant: such a comparison says nothing."""
    rows = {v: _row(candidate, v) for v in VARIANTS}
    if shipped is None:
        return {"ship": True, "why": "the shipped model names no evaluation", "candidate": rows}
    differ = [k for k in SAME if candidate.get(k) != shipped.get(k)]
    if differ:
        raise ValueError(
            "the candidate's and the shipped model's evaluations were not made the same way: "
            + ", ".join(f"{k} {candidate.get(k)!r} against {shipped.get(k)!r}" for k in differ)
            + " (to compare them, evaluate the shipped model as the candidate was, python -m factory.evaluate, and "
            "name that evaluation in its builtin.json)"
        )
    before = {v: _row(shipped, v) for v in VARIANTS}
    mean = lambda table, key: sum(r[key] for r in table.values()) / len(table)  # noqa: E731
    gain = mean(rows, "overall") - mean(before, "overall")
    loss_gain = mean(before, "flow_loss") - mean(rows, "flow_loss")
    drops = {v: before[v]["overall"] - rows[v]["overall"] for v in VARIANTS}
    worst = max(drops, key=drops.get)
    if drops[worst] > MAX_DROP:
        ship, why = False, f"{worst}'s overall falls {drops[worst]:.3f} (more than {MAX_DROP})"
    elif gain > TIE:
        ship, why = True, f"the mean overall rises {gain:+.3f}"
    elif gain >= -TIE and loss_gain > 0:
        ship, why = True, f"the mean overall ties ({gain:+.3f}) and the mean held-out loss falls {loss_gain:.4f}"
    else:
        ship, why = False, f"the mean overall changes {gain:+.3f} and the mean held-out loss {-loss_gain:+.4f}"
    return {
        "ship": ship,
        "why": why,
        "mean_overall": {"candidate": mean(rows, "overall"), "shipped": mean(before, "overall")},
        "mean_flow_loss": {"candidate": mean(rows, "flow_loss"), "shipped": mean(before, "flow_loss")},
        "candidate": rows,
        "shipped": before,
    }


def _row(evaluation: dict, variant: str) -> dict:
    got = (evaluation.get("variants") or {}).get(variant)
    if not got or "overall" not in got or "flow_loss" not in got:
        raise ValueError(f"the evaluation has no {variant!r} row with overall and flow_loss")
    return {k: got[k] for k in ("overall", "flow_loss", "colour", "shape", "count", "motion") if k in got}


def shipped_evaluation(model: Path = BUILTIN_DIR) -> tuple[dict | None, str | None]:
    """The evaluation the shipped model names (``builtin.json``'s ``evaluation``) and its path; (None, None) when it
    names none. A named file that is missing is an error: the rule cannot be applied."""
    info = json.loads((model / "builtin.json").read_text())
    path = info.get("evaluation")
    if not path:
        return None, None
    if not Path(path).is_file():
        raise FileNotFoundError(f"{model / 'builtin.json'} names the evaluation {path}, which is not there")
    return json.loads(Path(path).read_text()), path


def graft(variant: Path, old_base: Path, new_base: Path, out: Path) -> dict:
    """A conversion fine-tuned from ``old_base`` moved to ``new_base``: every weight the three share (same name and
    shape) becomes ``variant + (new_base - old_base)``, in float32; the conversion's own weights (MHLA's mixing, the
    output norm) are kept. Writes the folder ``out`` (``variant``'s config); returns how many weights moved and the
    RMS of the move. The bases must be the same design (their configs' architecture keys agree)."""
    from safetensors.torch import load_file, save_file

    keys = ("patch_size", "num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "ffn_dim")
    configs = [json.loads((f / "config.json").read_text()) for f in (variant, old_base, new_base)]
    differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
    if differ:
        raise ValueError(f"cannot graft {variant} from {old_base} onto {new_base}: their {', '.join(differ)} differ")
    weights = {k: v.float() for k, v in load_file(str(variant / WEIGHTS)).items()}
    old, new = load_file(str(old_base / WEIGHTS)), load_file(str(new_base / WEIGHTS))
    moved, square, count = 0, 0.0, 0
    for key, value in weights.items():
        if key in old and key in new and old[key].shape == value.shape == new[key].shape:
            delta = new[key].float() - old[key].float()
            weights[key] = value + delta
            moved += 1
            square, count = square + float(delta.pow(2).sum()), count + delta.numel()
    with atomic_dir(out) as tmp:
        shutil.copy2(variant / "config.json", tmp / "config.json")
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return {"moved": moved, "kept": len(weights) - moved, "delta_rms": (square / max(1, count)) ** 0.5}


class HeldOutLoss:
    """The flow loss of a transformer converted as a variant's committed config says, on the synthetic world's
    validation split (``batches`` x the config's batch size; fixed noise: :class:`training.finetune.EvalLoss`).
    ``model``: the model folder whose tokenizer, text encoder and VAE it runs with (default: the configs').

    The validation clips are rendered once per setting they depend on (the configs' data, batch, seed, flow and
    model folder), not once per measure: a re-ship measures nine starts, the split screen (``factory.hybrid_split``)
    thirty. Each measure still loads the model folder's parts with the transformer (:func:`build_model`; small)."""

    def __init__(self, batches: int = 2, model: Path | None = None, configs: Path = CONFIGS) -> None:
        self.batches, self.model, self.configs = batches, model, Path(configs)
        self._evaluators: dict[str, object] = {}

    def __call__(self, variant: str, transformer: Path) -> float:
        import torch
        from accelerate import Accelerator

        from training.config import load_config
        from training.data import BatchEncoder, build_dataset
        from training.encoding import Encoder
        from training.experts import read_target
        from training.finetune import EvalLoss, ModelCall, build_model
        from training.flow import FlowMatching

        overrides = [
            f"model.transformer={transformer}",
            "data.source=synthetic",
            f"validation.loss_batches={self.batches}",
        ]
        cfg = load_config(
            self.configs / f"{variant}.yaml",
            overrides + ([f"model.path={self.model}"] if self.model is not None else []),
        )
        accelerator = Accelerator(cpu=True)
        target = read_target(cfg.model)
        components, model, _ = build_model(cfg.model, cfg.data, accelerator.device, target)
        key = repr((cfg.data, cfg.train.batch_size, cfg.train.seed, cfg.validation, cfg.flow, cfg.model.path))
        evaluate = self._evaluators.get(key)
        if evaluate is None:
            dataset = build_dataset(cfg.data, cfg.train.seed, cfg.model)
            flow = FlowMatching(
                cfg.flow, sigma_range=target.sigma_range, num_train_timesteps=target.num_train_timesteps
            )
            call = ModelCall(target.expand_timesteps, tuple(model.config.patch_size))
            encode = BatchEncoder(Encoder(components, cfg.data.max_sequence_length), None, 0.0, accelerator.device)
            evaluate = EvalLoss(cfg.data, cfg.train, cfg.validation, dataset, encode, flow, accelerator, call)
            self._evaluators[key] = evaluate
        with torch.no_grad():
            return float(evaluate(model))


def held_out_loss(variant: str, transformer: Path, batches: int = 2, model: Path | None = None) -> float:
    """One :class:`HeldOutLoss` measure (its clips rendered for this call alone)."""
    return HeldOutLoss(batches, model)(variant, transformer)


def conversion_steps_for(spec: int | str | Mapping[str, int]) -> dict[str, int]:
    """Each conversion's fine-tuning steps from ``--conversion-steps``: a number for all (``600``), or a number
    then per-variant exceptions (``600,mhla=900,linear=300``: the budget where the gap is), or a mapping."""

    def bad(why: str) -> ValueError:
        return ValueError(
            f"--conversion-steps {spec!r}: {why}; expected N or N,VARIANT=N,... with VARIANT one of "
            f"{', '.join(CONVERSIONS)} and every N a number of steps (0: that conversion is kept as shipped), "
            "not all of them 0"
        )

    default: object = None
    named: list[tuple[str, object]] = []
    if isinstance(spec, Mapping):
        named = list(spec.items())
    else:
        for part in str(spec).split(","):
            variant, equals, n = part.strip().partition("=")
            if equals:
                named.append((variant, n))
            elif default is None:
                default = variant
            else:
                raise bad(f"two numbers for all ({default!r} and {variant!r})")
    steps = dict.fromkeys(CONVERSIONS, default)
    for variant, n in named:
        if variant not in CONVERSIONS:
            raise bad(f"{variant!r} is not a conversion")
        steps[variant] = n
    out = {}
    for variant, n in steps.items():
        try:
            out[variant] = int(str(n))
        except ValueError:
            raise bad(f"{variant} gets {n!r}") from None
        if out[variant] < 0:
            raise bad(f"{variant} gets {n!r}")
    if not any(out.values()):
        raise bad("every conversion gets 0 steps")
    return out


def _named_step(checkpoint: Path) -> int | None:
    """The step a checkpoint folder's name gives (``step-0006900``, or a copy set aside as ``keep-step-0006900``),
    read by :func:`training.checkpoint.checkpoint_step`; None for another name."""
    name = checkpoint.name
    try:
        return checkpoint_step(name[name.rfind("step-") :]) if "step-" in name else None
    except ValueError:
        return None


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _subprocess(cmd: Sequence[str]) -> None:
    run_command(cmd)


class Reship:
    """The stages of one re-ship (module docstring), recorded in ``<work>/state.json`` as each finishes."""

    def __init__(
        self,
        checkpoint: Path,
        name: str,
        conversion_steps: int | str | Mapping[str, int] = 600,
        num_prompts: int = 48,
        seeds: Sequence[int] = (0, 1, 2),
        work_root: Path = WORK,
        next_dir: Path = NEXT,
        builtin: Path = BUILTIN_DIR,
        run: Runner = _subprocess,
        measure: Measure | None = None,
        starts: Mapping[str, str | Path] | None = None,
    ) -> None:
        try:
            step = stage_step(name)  # the curves' records are read back by their label (factory.progress)
        except ValueError:
            raise ValueError(
                f"--name {name!r}: expected the stage's label, 'joint-stepN' or 'stepN' (N: the checkpoint's step) "
                "with an optional '-recipe' suffix, e.g. joint-step5400-cpe"
            ) from None
        named = _named_step(Path(checkpoint))
        if named is not None and named != step:
            raise ValueError(
                f"--name {name!r} says step {step}, but the checkpoint {Path(checkpoint).name!r} is step "
                f"{named}: the curves would place it wrongly"
            )
        self.steps = conversion_steps_for(conversion_steps)
        self.given = {}
        for variant, folder in (starts or {}).items():
            if variant not in CONVERSIONS:
                raise ValueError(
                    f"--start {variant}={folder}: {variant!r} is not a conversion; expected one of {CONVERSIONS}"
                )
            if not (Path(folder) / "config.json").is_file():
                raise FileNotFoundError(
                    f"--start {variant}={folder}: expected a transformer folder (config.json), e.g. a conversion "
                    "run's final/transformer"
                )
            self.given[variant] = Path(folder)
        for variant in (v for v, n in self.steps.items() if n == 0):
            if variant in self.given:
                raise ValueError(
                    f"--start {variant}={self.given[variant]} with 0 steps for {variant}: a kept conversion has no start"
                )
            if not (Path(builtin) / VARIANTS_SUBDIR / variant / "config.json").is_file():
                raise FileNotFoundError(
                    f"--conversion-steps gives {variant} 0 steps (kept as shipped), but {Path(builtin)} ships no "
                    f"{VARIANTS_SUBDIR}/{variant}"
                )
        self.checkpoint, self.name = Path(checkpoint), name
        self.num_prompts, self.seeds = num_prompts, list(seeds)
        self.work = Path(work_root) / f"reship-{name}"
        self.next_dir, self.builtin, self.run = Path(next_dir), Path(builtin), run
        self.measure = HeldOutLoss() if measure is None else measure  # clips rendered once for all nine starts
        self.curves = self.next_dir / "curves"
        self.state_path = self.work / "state.json"
        self.state = self._load_state()
        for f in ("config.json", "diffusion_pytorch_model.safetensors") if "stage" not in self.state["done"] else ():
            if not (self.checkpoint / "transformer" / f).is_file():  # once staged, the run may prune it
                raise FileNotFoundError(
                    f"{self.checkpoint} is not a base-stage checkpoint (expected transformer/{f} in it, as in "
                    f"runs/builtin-v3/joint/checkpoints/step-XXXXXXX)"
                )

    # ---- the record
    def _load_state(self) -> dict:
        # one number when the conversions share it (as every record before per-variant budgets says)
        steps = self.steps[CONVERSIONS[0]] if len(set(self.steps.values())) == 1 else self.steps
        want = {"checkpoint": str(self.checkpoint), "conversion_steps": steps, "num_prompts": self.num_prompts}
        want["seeds"] = self.seeds
        if self.given:  # records from before --start have no such key
            want["starts"] = {v: str(p) for v, p in self.given.items()}
        if self.state_path.is_file():
            state = json.loads(self.state_path.read_text())
            differ = [k for k in want if state.get(k) != want[k]]
            if state.get("starts", {}) != want.get("starts", {}) and "starts" not in differ:  # given, or no longer
                differ.append("starts")
            if differ:
                raise ValueError(
                    f"{self.work} is a re-ship of other settings ("
                    + ", ".join(f"{k} {state.get(k)!r}, not {want.get(k)!r}" for k in differ)
                    + "): give another --name, or remove the folder to start over"
                )
            return state
        return {**want, "done": [], "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def _done(self, stage: str, **info) -> None:
        self.state["done"].append(stage)
        self.state.setdefault("stages", {})[stage] = {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **info}
        self.work.mkdir(parents=True, exist_ok=True)
        write_json(self.state_path, self.state)
        # the record beside the curves (committed; runs/ is not): each stage's time, the starts' losses, the verdict
        write_json(str(self._out("reship")) + "-state.json", self.state)

    def stages(self) -> list[tuple[str, Callable[[], dict]]]:
        out = [("stage", self.stage), ("starts", self.starts)]
        out += [(f"convert-{v}", lambda v=v: self.convert(v)) for v in CONVERSIONS]
        out += [("layout", self.layout), ("evaluate", self.evaluate), ("decide", self.decide)]
        return out + [("ship", self.ship)]

    def __call__(self) -> dict:
        if not all(f"convert-{v}" in self.state["done"] for v in CONVERSIONS):
            self.preflight()
        for stage, step in self.stages():
            if stage in self.state["done"]:
                print(f"[reship] {stage}: done before ({self.state_path})", flush=True)
                continue
            if stage == "ship" and not self.state["stages"]["decide"]["ship"]:
                print(f"[reship] not shipped: {self.state['stages']['decide']['why']}", flush=True)
                break
            print(f"[reship] {stage} ...", flush=True)
            t0 = time.time()
            info = step() or {}
            self._done(stage, minutes=round((time.time() - t0) / 60, 2), **info)
        return self.state

    def preflight(self) -> None:
        """What the conversions read besides the checkpoint, checked before any weights are written: the working
        model folder (tokenizer, text encoder, VAE) and the clip cache their configs name."""
        from omegaconf import OmegaConf

        missing = []
        for variant in CONVERSIONS:
            # the file as written (loading it checks these very folders, and would name only the first missing)
            cfg = OmegaConf.load(CONFIGS / f"{variant}.yaml")
            named = [("model.path", cfg.model.path), ("data.path", cfg.data.path)]
            if cfg.data.get("image_path"):  # joint image-video conversion: its cache of stills
                named.append(("data.image_path", cfg.data.image_path))
            for what, path in named:
                if not (ROOT / path).exists() and (what, path) not in missing:
                    missing.append((what, path))
        if missing:
            raise FileNotFoundError(
                "the conversions' configs name folders this machine lacks: "
                + ", ".join(f"{w} {p}" for w, p in missing)
                + f"; make them first (python -m factory.v3 init lays {MODEL}; the cache command is in the header "
                "of factory/configs/v3/joint.yaml)"
            )

    # ---- the stages
    def stage(self) -> dict:
        from factory.next import save_checkpoint

        save_checkpoint(self.checkpoint, self.next_dir, half=True)
        return {}

    def starts(self) -> dict:
        """Each conversion's start (module docstring, step 2): the candidates measured, the lowest copied to
        ``starts/<variant>`` (the shipped model may be replaced before a resumed run needs it)."""
        new_base = self.next_dir / "transformer-ema"
        chosen: dict[str, dict] = {}
        for variant in CONVERSIONS:
            if self.steps[variant] == 0:  # kept as shipped: its start is what the candidate carries
                with atomic_dir(self.work / "starts" / variant) as tmp:
                    shutil.copytree(self.builtin / VARIANTS_SUBDIR / variant, tmp, dirs_exist_ok=True)
                chosen[variant] = {"from": "kept"}
                print(f"[reship] {variant}: 0 steps, the shipped conversion kept as it is", flush=True)
                continue
            candidates = {"base": new_base}
            shipped = self.builtin / VARIANTS_SUBDIR / variant
            if (shipped / "config.json").is_file() and (self.builtin / "transformer" / "config.json").is_file():
                candidates["shipped"] = shipped
                try:
                    moved = graft(shipped, self.builtin / "transformer", new_base, self.work / "grafts" / variant)
                    candidates["graft"] = self.work / "grafts" / variant
                    print(f"[reship] graft {variant}: {moved}", flush=True)
                except ValueError as e:  # another design's conversions: nothing to carry over
                    print(f"[reship] no graft for {variant}: {e}", flush=True)
            if variant in self.given:  # --start: a conversion trained on elsewhere (e.g. beside the base)
                candidates["given"] = self.given[variant]
            losses = {"base": float(self.measure(variant, new_base))}
            for name in ("shipped", "graft", "given"):
                if name in candidates:
                    try:
                        losses[name] = float(self.measure(variant, candidates[name]))
                    except (ValueError, RuntimeError) as e:  # another design's conversion: not a start here
                        print(f"[reship] {variant}: the {name} start does not load here ({e})", flush=True)
            # a start given by hand is taken (its loss recorded beside the others'): the held-out loss does not
            # say which start draws better (docs/builtin-model.md: a hybrid start at 0.080 drew more triangles
            # than one at 0.073); otherwise the lowest
            best = "given" if "given" in losses else min(losses, key=losses.get)
            print(f"[reship] {variant} starts from {best}: held-out losses {losses}", flush=True)
            with atomic_dir(self.work / "starts" / variant) as tmp:
                shutil.copytree(candidates[best], tmp, dirs_exist_ok=True)
            chosen[variant] = {"from": best, "losses": losses}
        shutil.rmtree(self.work / "grafts", ignore_errors=True)
        return {"chosen": chosen}

    def convert(self, variant: str) -> dict:
        from omegaconf import OmegaConf

        from factory.next import save_variant

        if self.steps[variant] == 0:
            save_variant(variant, self.work / "starts" / variant, self.work / "candidate")
            return {"step": 0, "kept": str(self.builtin / VARIANTS_SUBDIR / variant)}
        run_dir = self.work / variant
        overrides = [f"model.transformer={self.work / 'starts' / variant}", f"train.steps={self.steps[variant]}"]
        if OmegaConf.load(CONFIGS / f"{variant}.yaml").get("distill", {}).get("teacher"):
            # the config distills from the base: the one this re-ship staged (its EMA), whatever folder it names
            overrides.append(f"distill.teacher={self.next_dir / 'transformer-ema'}")
        config = str(CONFIGS / f"{variant}.yaml")
        self.run(_python("-m", "training.finetune", "--config", config, f"run_dir={run_dir}", *overrides))
        final = run_dir / "final"
        if not (final / "finished.json").is_file():
            raise RuntimeError(f"the {variant} conversion in {run_dir} did not finish (no final/finished.json)")
        save_variant(variant, final, self.work / "candidate")
        finished = json.loads((final / "finished.json").read_text())
        return {"step": finished.get("step"), "run_dir": str(run_dir)}

    def layout(self) -> dict:
        from factory.v3 import _lay_out

        laid: list[str] = []
        with atomic_dir(self.work / "model") as tmp:
            _lay_out(
                tmp,
                self.work / "model",
                self.next_dir,
                0,
                laid,
                transformer_order=("transformer-ema",),
                variants_from=(self.work / "candidate",),
            )
        missing = [v for v in CONVERSIONS if not (self.work / "model" / VARIANTS_SUBDIR / v / "config.json").is_file()]
        if missing:
            raise RuntimeError(f"the candidate model lacks the conversions {missing}")
        return {"parts": laid}

    def _out(self, what: str) -> Path:
        return self.curves / f"{what}-{self.name}"

    def stage_curves(self) -> Path | None:
        """The base stage's curves beside the evaluation, when its run folder has its ``metrics.jsonl``:
        ``curves/<run>.png`` and the probe rows ``curves/<run>-probe-step<N>.json``."""
        run_dir = self.run_folder()
        if run_dir is None:
            return None
        step = stage_step(self.name)  # the checkpoint's own step where its name gives one (checked at the start)
        summary = self.curves / f"{run_dir.name}-probe-step{step}.json"
        metrics = run_dir / "metrics.jsonl"
        cmd = ["-m", "factory.curves", str(metrics), "--out", str(self.curves / f"{run_dir.name}.png")]
        earlier = self.earlier_summary(run_dir.name, metrics, summary)
        self.run(_python(*cmd, "--summary", str(summary), *(["--earlier", str(earlier)] if earlier else [])))
        return summary

    def run_folder(self) -> Path | None:
        """The run the checkpoint came from, where its metrics are: the checkpoint's folder two up
        (``<run>/checkpoints/step-N``), or, for a checkpoint copied out of its run (``keep-step-N``: a run keeps
        only its latest), the ``run_dir`` its ``config.yaml`` names (relative to the repository)."""
        candidates = [self.checkpoint.parent.parent]
        config = self.checkpoint / "config.yaml"
        if config.is_file():
            from omegaconf import OmegaConf

            named = OmegaConf.load(config).get("run_dir")
            if named:
                candidates.append(Path(named) if Path(named).is_absolute() else ROOT / named)
        return next((c for c in candidates if (c / "metrics.jsonl").is_file()), None)

    def earlier_summary(self, run: str, metrics: Path, summary: Path) -> Path | None:
        """For a run whose metrics begin after step 0 (it went on from a stage's committed weights,
        ``train.start_step``): the committed probe summary of the latest step of that run, which holds its earlier
        part (None when there is none, or the metrics begin at 0)."""
        with metrics.open() as f:
            first = json.loads(f.readline() or "{}").get("step", 0)
        if not first:
            return None
        found = [p for p in self.curves.glob(f"{run}-probe-step*.json") if p != summary]
        steps = {p: int(p.stem.rsplit("-step", 1)[1]) for p in found if p.stem.rsplit("-step", 1)[1].isdigit()}
        return max(steps, key=steps.get) if steps else None

    def evaluate(self) -> dict:
        curves = self.stage_curves()
        model = str(self.work / "model")
        ema = str(self.next_dir / "transformer-ema")
        seeds = [str(s) for s in self.seeds]
        self.run(
            _python(
                "-m",
                "factory.evaluate",
                "--model",
                model,
                "--world",
                WORLD,
                "--num-prompts",
                str(self.num_prompts),
                "--seeds",
                *seeds,
                "--out",
                str(self._out("v3-eval")),
            )
        )
        for probe in ("unconditional", "swap", "uncaptioned"):
            out = str(self._out(f"shape-{probe}"))
            self.run(_python("-m", "factory.shape_probe", probe, "--model", model, "--transformer", ema, "--out", out))
        self.run(
            _python(
                "-m",
                "factory.memorization",
                "--model",
                model,
                "--transformer",
                ema,
                "--out",
                str(self._out("memorization")),
            )
        )
        self.run(_python("-m", "factory.progress", "--curves", str(self.curves)))  # the stages so far, drawn
        return {"evaluation": str(self._out("v3-eval")) + ".json", "curves": None if curves is None else str(curves)}

    def decide(self) -> dict:
        candidate = json.loads(Path(str(self._out("v3-eval")) + ".json").read_text())
        shipped, path = shipped_evaluation(self.builtin)
        verdict = {"checkpoint": str(self.checkpoint), "shipped_evaluation": path, **compare(candidate, shipped)}
        write_json(str(self._out("reship")) + ".json", verdict)
        print(f"[reship] {'ship' if verdict['ship'] else 'keep the shipped model'}: {verdict['why']}", flush=True)
        return {"ship": verdict["ship"], "why": verdict["why"]}

    def ship(self) -> dict:
        from factory.v3 import ship

        evaluation = str(self._out("v3-eval")) + ".json"
        for variant in CONVERSIONS:  # ship() takes the conversions from the design's folder
            dst = self.next_dir / VARIANTS_SUBDIR / variant
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(self.work / "candidate" / VARIANTS_SUBDIR / variant, dst)
        ship(self.next_dir, self.builtin, Path(evaluation))
        # the stored examples' latencies are what the page shows a person on this machine: measured with the cores a
        # user's run gets (common.threads' automatic count), not a thread cap the re-ship was started with to share
        # the CPU with the base's training
        if os.environ.pop("OMP_NUM_THREADS", None) is not None:
            print("[reship] the examples are stored without the OMP_NUM_THREADS the re-ship was given", flush=True)
        self.run(_python("-m", "factory.examples", "--from", evaluation, "--model", str(self.builtin)))
        self.run(_python("run_app.py", "--model", str(self.builtin), "--store-examples"))
        return {"evaluation": evaluation}


def main(argv=None) -> int:
    """``python -m factory.reship``, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="factory.reship")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m factory.reship", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a base-stage checkpoint, e.g. runs/builtin-v3/joint/checkpoints/step-0005000")
    p.add_argument(
        "--name",
        required=True,
        help="the stage's label, joint-stepN with an optional -recipe suffix (N: the checkpoint's step); names the "
        "work folder and the curves, e.g. joint-step5000",
    )
    p.add_argument(
        "--conversion-steps",
        default="600",
        help="each conversion's fine-tuning steps: N, or N then exceptions, e.g. 600,mhla=900,linear=300",
    )
    p.add_argument(
        "--start",
        action="append",
        default=[],
        metavar="VARIANT=DIR",
        help="where a conversion starts (a transformer folder, e.g. a conversion trained on beside the base or a "
        "factory.hybrid_split arm): taken, its held-out loss recorded beside the other starts'; repeatable",
    )
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    os.chdir(ROOT)  # the configs name the repository's folders (runs/, assets/) relative to it
    starts = {}
    for spec in args.start:
        variant, sep, folder = spec.partition("=")
        if not sep or not folder:
            p.error(f"--start {spec!r}: expected VARIANT=DIR, e.g. mhla=runs/conv-mhla/final/transformer")
        starts[variant] = folder
    state = Reship(
        Path(args.checkpoint), args.name, args.conversion_steps, args.num_prompts, args.seeds, starts=starts
    )()
    decided = state.get("stages", {}).get("decide", {})
    print(f"[reship] {args.name}: {'shipped' if 'ship' in state['done'] else 'not shipped'}; {decided.get('why', '')}")
    print(json.dumps({k: state[k] for k in ("checkpoint", "done")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

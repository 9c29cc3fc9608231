"""factory.reship: the rule that decides a re-ship, and the stages run on the committed third design's parts with
the heavy commands (fine-tuning, evaluation, the app) replaced by a runner that records them and writes what they
would (a conversion's final EMA, an evaluation's JSON)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from factory import reship
from factory.build import CONVERSIONS

ROOT = Path(__file__).resolve().parents[2]
NEXT = ROOT / "assets" / "builtin-next" / "v3"
SHIPPED = ROOT / "assets" / "builtin"
SETTINGS = {
    "world": "v3",
    "num_prompts": 48,
    "seeds": [0, 1, 2],
    "num_inference_steps": 20,
    "guidance_scale": 4.0,
    "analyser_version": 4,
    "data_seed": 0,
}


def evaluation(overall, loss=0.2, **settings):
    """An evaluation JSON with the given overall per variant (flash, linear, mhla, mhla-hybrid)."""
    names = ("flash", "linear", "mhla", "mhla-hybrid")
    overall = dict(zip(names, overall)) if not isinstance(overall, dict) else overall
    loss = loss if isinstance(loss, dict) else dict.fromkeys(names, loss)
    rows = {v: {"overall": overall[v], "flow_loss": loss[v], "shape": overall[v]} for v in names}
    return {**SETTINGS, **settings, "variants": rows}


# ---- the rule


def test_a_higher_mean_overall_ships():
    got = reship.compare(evaluation([0.5, 0.1, 0.1, 0.2]), evaluation([0.28, 0.0, 0.0, 0.06]))
    assert got["ship"] and "rises" in got["why"]
    assert got["mean_overall"]["candidate"] == pytest.approx(0.225)
    assert got["mean_overall"]["shipped"] == pytest.approx(0.085)


def test_a_variant_that_falls_more_than_the_margin_keeps_the_shipped_model():
    # the mean rises (0.25 against 0.16) but flash falls 0.10
    got = reship.compare(evaluation([0.30, 0.3, 0.2, 0.2]), evaluation([0.40, 0.1, 0.1, 0.04]))
    assert not got["ship"] and got["why"].startswith("flash's overall falls 0.100")


def test_a_fall_within_the_margin_is_allowed():
    assert reship.compare(evaluation([0.36, 0.3, 0.2, 0.2]), evaluation([0.40, 0.1, 0.1, 0.04]))["ship"]


def test_a_tie_is_broken_by_the_held_out_loss():
    shipped = evaluation([0.28, 0.0, 0.0, 0.06], loss=0.20)
    assert reship.compare(evaluation([0.28, 0.0, 0.0, 0.06], loss=0.19), shipped)["ship"]
    got = reship.compare(evaluation([0.28, 0.0, 0.0, 0.06], loss=0.21), shipped)
    assert not got["ship"] and "+0.000" in got["why"]


def test_a_lower_mean_keeps_the_shipped_model():
    assert not reship.compare(evaluation([0.26, 0.0, 0.0, 0.0], loss=0.1), evaluation([0.28, 0.0, 0.0, 0.06]))["ship"]


def test_evaluations_made_differently_are_not_compared():
    with pytest.raises(ValueError, match=r"num_prompts 16 against 48.*analyser_version 3 against 4"):
        reship.compare(evaluation([1, 1, 1, 1], num_prompts=16, analyser_version=3), evaluation([0, 0, 0, 0]))


def test_an_evaluation_without_every_variant_is_refused():
    partial = evaluation([0.5, 0.1, 0.1, 0.2])
    del partial["variants"]["mhla"]
    with pytest.raises(ValueError, match="no 'mhla' row"):
        reship.compare(partial, evaluation([0, 0, 0, 0]))


def test_nothing_shipped_with_an_evaluation_ships():
    assert reship.compare(evaluation([0, 0, 0, 0]), None)["ship"]


# ---- the stages, on the committed parts


class Runner:
    """Stands in for the heavy commands: records each, writes what it would write, fails on request."""

    def __init__(self, evaluation_json: dict, fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.evaluation_json, self.fail_on = evaluation_json, fail_on

    def __call__(self, cmd):
        cmd = list(cmd)
        self.calls.append(cmd)
        module = cmd[2] if cmd[1] == "-m" else cmd[1]
        if self.fail_on and any(self.fail_on in c for c in cmd):
            raise RuntimeError(f"stopped at {self.fail_on}")
        if module == "training.finetune":
            over = dict(c.split("=", 1) for c in cmd if "=" in c)
            variant = Path(cmd[cmd.index("--config") + 1]).stem
            final = Path(over["run_dir"]) / "final"
            shutil.copytree(SHIPPED / "variants" / variant, final / "transformer")
            (final / "finished.json").write_text(json.dumps({"step": int(over["train.steps"]), "model": "transformer"}))
        elif module == "factory.evaluate":
            out = Path(cmd[cmd.index("--out") + 1] + ".json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(self.evaluation_json))

    def modules(self):
        return [c[2] if c[1] == "-m" else c[1] for c in self.calls]


@pytest.fixture
def design(tmp_path):
    """A copy of the committed third design's folder, a shipped model naming an evaluation, and a base-stage
    checkpoint (the committed EMA as its transformer, raw weights in trainable.safetensors, moved off the EMA)."""
    next_dir = tmp_path / "next"
    next_dir.mkdir()
    for part in ("tokenizer", "text_encoder", "vae"):
        shutil.copytree(NEXT / part, next_dir / part)
    (next_dir / "curves").mkdir()
    builtin = tmp_path / "builtin"
    shutil.copytree(SHIPPED, builtin, ignore=shutil.ignore_patterns("examples"))
    shipped_eval = tmp_path / "shipped-eval.json"
    shipped_eval.write_text(json.dumps(evaluation([0.28, 0.0, 0.0, 0.06])))
    info = json.loads((builtin / "builtin.json").read_text())
    (builtin / "builtin.json").write_text(json.dumps({**info, "evaluation": str(shipped_eval)}))
    checkpoint = tmp_path / "joint" / "checkpoints" / "step-0004000"
    shutil.copytree(NEXT / "transformer-ema", checkpoint / "transformer")
    (tmp_path / "joint" / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 0.1}\n')
    weights = load_file(str(checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
    raw = {k: (v.float() + 0.25) for k, v in list(weights.items())[:3]}
    save_file(raw, str(checkpoint / "trainable.safetensors"))
    return {"next": next_dir, "builtin": builtin, "checkpoint": checkpoint, "work": tmp_path / "runs", "raw": raw}


class Measure:
    """Stands in for the held-out loss of a start: by the candidate's folder; records each call."""

    def __init__(self, losses: dict[str, float]) -> None:
        self.losses, self.calls = losses, []

    def __call__(self, variant, folder):
        self.calls.append((variant, Path(folder)))
        name = Path(folder).parent.name if Path(folder).parent.name in ("grafts", "variants") else Path(folder).name
        kind = {"grafts": "graft", "variants": "shipped", "transformer-ema": "base", "given": "given"}[name]
        return self.losses[kind]


def make(design, runner, **kw):
    kw.setdefault("measure", Measure({"base": 1.66, "shipped": 0.20, "graft": 0.19}))
    return reship.Reship(
        design["checkpoint"],
        "joint-step4000",
        conversion_steps=kw.pop("steps", 7),
        work_root=design["work"],
        next_dir=design["next"],
        builtin=design["builtin"],
        run=runner,
        **kw,
    )


def test_a_better_candidate_is_staged_converted_evaluated_and_shipped(design, monkeypatch):
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)  # the conversions are the runner's
    runner = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    state = make(design, runner)()
    assert state["done"] == [
        "stage",
        "starts",
        *(f"convert-{v}" for v in CONVERSIONS),
        "layout",
        "evaluate",
        "decide",
        "ship",
    ]
    # the stage's weights: the EMA and the raw weights (trainable laid over it), float16, in the design's folder
    staged = load_file(str(design["next"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    for key, value in design["raw"].items():
        assert staged[key].dtype == torch.float16
        assert torch.allclose(staged[key].float(), value, atol=2e-3)
    # each conversion from its measured start (the graft: lowest), its committed config, the steps, its own folder
    work = design["work"] / "reship-joint-step4000"
    assert state["stages"]["starts"]["chosen"]["mhla"] == {
        "from": "graft",
        "losses": {"base": 1.66, "shipped": 0.20, "graft": 0.19},
    }
    finetunes = [c for c in runner.calls if c[2] == "training.finetune"]
    assert [Path(c[c.index("--config") + 1]).name for c in finetunes] == [f"{v}.yaml" for v in CONVERSIONS]
    for c, v in zip(finetunes, CONVERSIONS):
        assert f"run_dir={work / v}" in c
        assert f"model.transformer={work / 'starts' / v}" in c and "train.steps=7" in c
        start = load_file(str(work / "starts" / v / "diffusion_pytorch_model.safetensors"))
        old = load_file(str(design["builtin"] / "variants" / v / "diffusion_pytorch_model.safetensors"))
        assert start.keys() == old.keys() and start[next(iter(start))].dtype == torch.float32
    assert not (work / "grafts").exists()
    assert runner.modules()[3:] == [
        "factory.curves",
        "factory.evaluate",
        "factory.shape_probe",
        "factory.shape_probe",
        "factory.shape_probe",
        "factory.memorization",
        "factory.progress",
        "factory.examples",
        "run_app.py",
    ]
    # shipped: the new EMA as the softmax transformer, the conversions as variants, the evaluation named
    info = json.loads((design["builtin"] / "builtin.json").read_text())
    assert info["evaluation"].endswith("curves/v3-eval-joint-step4000.json")
    shipped = load_file(str(design["builtin"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    ema = load_file(str(design["checkpoint"] / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(shipped[k].float(), ema[k].half().float()) for k in design["raw"])
    for v in CONVERSIONS:
        assert (design["builtin"] / "variants" / v / "config.json").is_file()
    curves = [c for c in runner.calls if c[2] == "factory.curves"][0]
    assert curves[3] == str(design["checkpoint"].parent.parent / "metrics.jsonl")
    assert curves[-1] == str(design["next"] / "curves" / "joint-probe-step4000.json")
    verdict = json.loads((design["next"] / "curves" / "reship-joint-step4000.json").read_text())
    assert verdict["ship"] and verdict["checkpoint"] == str(design["checkpoint"])
    record = json.loads((design["next"] / "curves" / "reship-joint-step4000-state.json").read_text())
    assert record["done"] == state["done"] and record["stages"]["starts"]["chosen"]["linear"]["from"] == "graft"


def test_a_start_that_measures_lowest_is_taken(design, monkeypatch):
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    measure = Measure({"base": 0.1, "shipped": 0.20, "graft": 0.19})
    state = make(design, Runner(evaluation([0.5, 0.1, 0.1, 0.2])), measure=measure)()
    assert {v["from"] for v in state["stages"]["starts"]["chosen"].values()} == {"base"}
    assert sorted({v for v, _ in measure.calls}) == sorted(CONVERSIONS) and len(measure.calls) == 9
    work = design["work"] / "reship-joint-step4000"
    ema = load_file(str(design["next"] / "transformer-ema" / "diffusion_pytorch_model.safetensors"))
    start = load_file(str(work / "starts" / "mhla" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(start[k], ema[k]) for k in ema)


def test_a_given_start_is_measured_with_the_others_and_taken(design, monkeypatch, tmp_path):
    """``--start mhla=DIR``: a conversion trained on elsewhere is measured beside mhla's candidates (the others'
    stay as they were) and copied as its start even where another measures lower (the held-out loss does not say
    which draws better), and the record names it (a resumed re-ship must be given the same)."""
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    given = tmp_path / "given"
    shutil.copytree(SHIPPED / "variants" / "mhla", given)
    weights = load_file(str(given / "diffusion_pytorch_model.safetensors"))
    moved = {k: v.float() + 0.5 for k, v in weights.items()}
    save_file(moved, str(given / "diffusion_pytorch_model.safetensors"))
    measure = Measure({"base": 1.66, "shipped": 0.20, "graft": 0.19, "given": 0.25})
    state = make(design, Runner(evaluation([0.5, 0.1, 0.1, 0.2])), measure=measure, starts={"mhla": given})()
    chosen = state["stages"]["starts"]["chosen"]
    assert chosen["mhla"] == {"from": "given", "losses": {"base": 1.66, "shipped": 0.20, "graft": 0.19, "given": 0.25}}
    assert chosen["linear"]["from"] == "graft" and "given" not in chosen["linear"]["losses"]
    start = load_file(
        str(design["work"] / "reship-joint-step4000" / "starts" / "mhla" / "diffusion_pytorch_model.safetensors")
    )
    assert all(torch.equal(start[k], moved[k]) for k in moved)
    assert state["starts"] == {"mhla": str(given)}
    with pytest.raises(ValueError, match="a re-ship of other settings"):  # resumed without it: refused
        make(design, Runner(evaluation([0.5, 0.1, 0.1, 0.2])), measure=measure)


def test_a_conversion_given_0_steps_is_kept_as_shipped_bit_for_bit(design, monkeypatch):
    """``--conversion-steps 0,mhla-hybrid=N``: mhla and linear are not measured, trained or changed; the candidate
    carries the shipped ones, and only the hybrid trains."""
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    runner, measure = Runner(evaluation([0.5, 0.1, 0.1, 0.2])), Measure({"base": 1.66, "shipped": 0.20, "graft": 0.19})
    state = make(design, runner, measure=measure, steps="0,mhla-hybrid=9")()
    chosen = state["stages"]["starts"]["chosen"]
    assert chosen["mhla"] == chosen["linear"] == {"from": "kept"}
    assert {v for v, _ in measure.calls} == {"mhla-hybrid"}
    trained = [Path(c[c.index("--config") + 1]).stem for c in runner.calls if "training.finetune" in c]
    assert trained == ["mhla-hybrid"]
    for variant in ("mhla", "linear"):
        assert state["stages"][f"convert-{variant}"]["step"] == 0
        shipped = load_file(str(design["builtin"] / "variants" / variant / "diffusion_pytorch_model.safetensors"))
        got = load_file(
            str(
                design["work"]
                / "reship-joint-step4000"
                / "candidate"
                / "variants"
                / variant
                / "diffusion_pytorch_model.safetensors"
            )
        )
        assert shipped.keys() == got.keys() and all(torch.equal(got[k], shipped[k]) for k in shipped)


def test_a_kept_conversion_needs_a_shipped_one_and_no_start(design, tmp_path):
    runner = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    with pytest.raises(ValueError, match="with 0 steps for mhla: a kept conversion has no start"):
        make(design, runner, steps="0,mhla-hybrid=9", starts={"mhla": design["builtin"] / "variants" / "mhla"})
    shutil.rmtree(design["builtin"] / "variants" / "linear")
    with pytest.raises(FileNotFoundError, match="gives linear 0 steps"):
        make(design, runner, steps="0,mhla-hybrid=9")
    assert runner.calls == []


def test_a_given_start_is_checked_before_anything_runs(design, tmp_path):
    runner = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    with pytest.raises(ValueError, match="'flash' is not a conversion"):
        make(design, runner, starts={"flash": tmp_path})
    with pytest.raises(FileNotFoundError, match="expected a transformer folder"):
        make(design, runner, starts={"mhla": tmp_path / "nowhere"})
    assert runner.calls == [] and not (design["work"] / "reship-joint-step4000").exists()


def test_a_start_that_does_not_load_is_left_out(design, monkeypatch):
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    losses = Measure({"base": 1.66, "shipped": 0.20, "graft": 0.19})

    def measure(variant, folder):
        if "grafts" in str(folder):
            raise ValueError("a grid that does not fit")
        return losses(variant, folder)

    state = make(design, Runner(evaluation([0.5, 0.1, 0.1, 0.2])), measure=measure)()
    chosen = state["stages"]["starts"]["chosen"]
    assert all(c == {"from": "shipped", "losses": {"base": 1.66, "shipped": 0.20}} for c in chosen.values())


def test_graft_moves_the_shared_weights_by_the_bases_difference(tmp_path):
    g = torch.Generator().manual_seed(3)
    config = {"patch_size": [1, 2, 2], "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 4}
    folders = {}
    for name, keys in (("old", ["a", "b"]), ("new", ["a", "b"]), ("variant", ["a", "b", "mix"])):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "config.json").write_text(json.dumps({**config, "tag": name}))
        tensors = {k: torch.randn(3, 4, generator=g).half() for k in keys}
        save_file(tensors, str(folders[name] / "diffusion_pytorch_model.safetensors"))
    # a weight whose shape differs in the new base is kept
    new = load_file(str(folders["new"] / "diffusion_pytorch_model.safetensors"))
    new["b"] = torch.zeros(5)
    save_file(new, str(folders["new"] / "diffusion_pytorch_model.safetensors"))
    got = reship.graft(folders["variant"], folders["old"], folders["new"], tmp_path / "out")
    assert got["moved"] == 1 and got["kept"] == 2
    load = lambda n: load_file(str(folders[n] / "diffusion_pytorch_model.safetensors"))  # noqa: E731
    out = load_file(str(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))
    v, o = load("variant"), load("old")
    expected = v["a"].double() + new["a"].double() - o["a"].double()
    assert torch.allclose(out["a"].double(), expected, atol=1e-6)
    assert torch.equal(out["b"], v["b"].float()) and torch.equal(out["mix"], v["mix"].float())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tag"] == "variant"
    bad = json.loads((folders["new"] / "config.json").read_text())
    (folders["new"] / "config.json").write_text(json.dumps({**bad, "num_layers": 2}))
    with pytest.raises(ValueError, match="num_layers differ"):
        reship.graft(folders["variant"], folders["old"], folders["new"], tmp_path / "out2")


@pytest.mark.slow
def test_the_held_out_loss_tells_a_trained_conversion_from_a_fresh_one():
    """The shipped MHLA conversion against the shipped softmax base freshly converted to MHLA: the measure that
    picks a conversion's start must see the gap (0.20 against 1.67 when measured)."""
    measure = reship.HeldOutLoss(batches=1, model=SHIPPED)
    fresh = measure("mhla", SHIPPED / "transformer")
    trained = measure("mhla", SHIPPED / "variants" / "mhla")
    assert 0 < trained < 0.5 < fresh
    # the clips were rendered once for both, and a measure of its own gives the same loss (fixed clips and noise)
    assert len(measure._evaluators) == 1
    assert reship.held_out_loss("mhla", SHIPPED / "variants" / "mhla", batches=1, model=SHIPPED) == pytest.approx(
        trained
    )


def test_a_worse_candidate_leaves_the_shipped_model_alone(design, monkeypatch):
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    before = {p: p.read_bytes() for p in design["builtin"].rglob("*") if p.is_file()}
    runner = Runner(evaluation([0.1, 0.0, 0.0, 0.0]))
    state = make(design, runner)()
    assert state["done"][-1] == "decide" and not state["stages"]["decide"]["ship"]
    assert {p: p.read_bytes() for p in design["builtin"].rglob("*") if p.is_file()} == before
    assert "factory.examples" not in runner.modules()
    # the stage's weights are kept for the next stage all the same
    assert (design["next"] / "transformer-ema" / "config.json").is_file()


def test_a_stopped_reship_resumes_where_it_stopped(design, monkeypatch):
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    first = Runner(evaluation([0.5, 0.1, 0.1, 0.2]), fail_on="mhla.yaml")
    with pytest.raises(RuntimeError, match="stopped at mhla.yaml"):
        make(design, first)()
    second = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    state = make(design, second)()
    assert state["done"][-1] == "ship"
    configs = [Path(c[c.index("--config") + 1]).stem for c in second.calls if c[2] == "training.finetune"]
    assert configs == ["mhla", "mhla-hybrid"]  # linear was done; mhla runs again (it resumes from its checkpoint)
    assert second.calls[0][2] == "training.finetune"  # the starts were measured once, before the stop


def test_other_settings_in_the_same_folder_are_refused(design, monkeypatch):
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    with pytest.raises(RuntimeError):
        make(design, Runner(evaluation([0.5, 0.1, 0.1, 0.2]), fail_on="linear.yaml"))()
    with pytest.raises(ValueError, match="conversion_steps 7, not 9"):
        make(design, Runner({}), steps=9)


def test_each_conversion_gets_its_own_budget(design, monkeypatch):
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    runner = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    state = make(design, runner, steps="5,mhla=8,linear=3")()
    finetunes = {Path(c[c.index("--config") + 1]).stem: c for c in runner.calls if c[2] == "training.finetune"}
    want = {"linear": 3, "mhla": 8, "mhla-hybrid": 5}
    assert {v: [a for a in c if a.startswith("train.steps=")] for v, c in finetunes.items()} == {
        v: [f"train.steps={n}"] for v, n in want.items()
    }
    assert state["conversion_steps"] == want  # recorded per variant; a resumed re-ship must ask the same
    with pytest.raises(ValueError, match="conversion_steps"):
        make(design, Runner({}), steps="5,mhla=9,linear=3")


@pytest.mark.parametrize(
    "spec, why",
    [
        ("0", "every conversion gets 0 steps"),
        ("600,mhla=-1", "mhla gets '-1'"),
        ("x", "linear gets 'x'"),
        ("600,lin=3", "'lin' is not a conversion"),
        ("600,700", "two numbers for all"),
        ("mhla=900", "linear gets None"),
    ],
)
def test_bad_conversion_budgets_are_named(spec, why):
    with pytest.raises(ValueError, match=f"--conversion-steps '{spec}': {why}"):
        reship.conversion_steps_for(spec)


def test_bad_arguments_are_named_before_any_work(design, tmp_path):
    for bad in ("a b", "joint5400", "../joint-step1", "step"):  # the curves read the base's step from the name
        with pytest.raises(ValueError, match=f"--name '{bad}'"):
            reship.Reship(design["checkpoint"], bad, work_root=tmp_path)
    with pytest.raises(ValueError, match="says step 5400, but the checkpoint 'step-0004000' is step 4000"):
        reship.Reship(design["checkpoint"], "joint-step5400-cpe", work_root=tmp_path)
    with pytest.raises(ValueError, match="--conversion-steps 0"):
        reship.Reship(design["checkpoint"], "joint-step4000", conversion_steps=0, work_root=tmp_path)
    with pytest.raises(FileNotFoundError, match="not a base-stage checkpoint"):
        reship.Reship(tmp_path, "joint-step1", work_root=tmp_path)


def test_preflight_names_the_folders_the_conversions_read(design, monkeypatch, tmp_path):
    monkeypatch.setattr(reship, "ROOT", tmp_path)  # a clone without runs/
    runner = Runner({})
    with pytest.raises(
        FileNotFoundError, match=r"model.path runs/builtin-v3/model, data.path runs/builtin-v3/cache-train"
    ):
        make(design, runner)()
    assert runner.calls == [] and not (design["next"] / "transformer-ema").exists()


def test_a_conversion_that_distills_is_taught_by_the_staged_base(design, monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    configs = tmp_path / "configs"
    shutil.copytree(reship.CONFIGS, configs)
    cfg = OmegaConf.load(configs / "mhla.yaml")
    cfg.distill = {"teacher": "assets/somewhere-else", "weight": 1.0}  # a folder the re-ship does not stage
    OmegaConf.save(cfg, configs / "mhla.yaml")
    for v in ("linear", "mhla-hybrid"):  # the others: no distill section at all
        plain = OmegaConf.load(configs / f"{v}.yaml")
        plain.pop("distill", None)
        OmegaConf.save(plain, configs / f"{v}.yaml")
    monkeypatch.setattr(reship, "CONFIGS", configs)
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    runner = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    make(design, runner)()
    finetunes = {Path(c[c.index("--config") + 1]).stem: c for c in runner.calls if c[2] == "training.finetune"}
    assert f"distill.teacher={design['next'] / 'transformer-ema'}" in finetunes["mhla"]
    assert not any(c.startswith("distill.") for v in ("linear", "mhla-hybrid") for c in finetunes[v])


def test_the_curves_of_a_run_that_went_on_elsewhere_keep_its_committed_earlier_part(design):
    """A joint run begun at train.start_step on a fresh machine has metrics from that step on: the stage's curves
    get the latest committed probe summary of the run as --earlier (never the one being written)."""
    runner = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    job = make(design, runner)
    metrics = design["checkpoint"].parent.parent / "metrics.jsonl"
    curves = design["next"] / "curves"
    for step in (3000, 6900, 4000):  # 4000: the summary this re-ship writes (a rerun of it)
        (curves / f"joint-probe-step{step}.json").write_text("[]")
    assert job.stage_curves() is not None
    call = runner.calls[-1]
    assert call[2] == "factory.curves" and "--earlier" not in call  # the metrics begin at step 0: all is there
    metrics.write_text('{"step": 3500, "eval_loss": 0.1}\n{"step": 3501, "loss": 0.1}\n')
    job.stage_curves()
    call = runner.calls[-1]
    assert call[call.index("--earlier") + 1] == str(curves / "joint-probe-step6900.json")


def test_a_checkpoint_copied_out_of_its_run_draws_that_runs_curves(design, monkeypatch, tmp_path):
    """A run keeps only its latest checkpoint, so a re-ship's base is often a copy (``keep-step-N``) beside the run:
    its curves come from the run its config.yaml names (relative to the repository), not from two folders up."""
    monkeypatch.setattr(reship, "ROOT", tmp_path)
    copied = tmp_path / "elsewhere" / "keep-step-0004000"
    shutil.copytree(design["checkpoint"], copied)
    runner = Runner(evaluation([0.5, 0.1, 0.1, 0.2]))
    job = make({**design, "checkpoint": copied}, runner)
    assert job.stage_curves() is None  # no config.yaml: nothing says where its run is
    (copied / "config.yaml").write_text("run_dir: joint\n")
    assert job.stage_curves() is not None
    call = runner.calls[-1]
    assert call[2] == "factory.curves" and call[3] == str(tmp_path / "joint" / "metrics.jsonl")
    assert call[call.index("--out") + 1] == str(design["next"] / "curves" / "joint.png")


def test_the_examples_are_stored_with_a_users_threads_not_the_reships_cap(design, monkeypatch):
    """A re-ship run beside the base with OMP_NUM_THREADS=1 trains and evaluates on one thread; the examples it
    stores (their latencies are shown on the page) are measured without that cap."""
    monkeypatch.setattr(reship.Reship, "preflight", lambda self: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = {}

    class Watching(Runner):
        def __call__(self, cmd):
            seen[Path(list(cmd)[2] if list(cmd)[1] == "-m" else list(cmd)[1]).name] = os.environ.get("OMP_NUM_THREADS")
            super().__call__(cmd)

    make(design, Watching(evaluation([0.5, 0.1, 0.1, 0.2])))()
    assert seen["training.finetune"] == "1" and seen["factory.evaluate"] == "1"  # the work shares the CPU
    assert seen["factory.examples"] is None and seen["run_app.py"] is None

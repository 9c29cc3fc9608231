"""The app's example prompts are chosen from an evaluation's per-video verdicts, and reach the app."""

import json
from types import SimpleNamespace

import pytest

from app.models import BUILTIN_PROMPTS, GENERAL_PROMPTS, AppModels
from factory import output_path
from factory.examples import choose, main
from pipelines.model_dir import builtin_examples


def video(caption, seed, count=True, colour=True, shape=True, motion=True):
    return {"prompt": 0, "caption": caption, "seed": seed, "held_out": False, "count": count, "colour": colour,
            "shape": shape, "motion": motion}  # fmt: skip


RED = "a red square moves to the right"
RED2 = "a small red circle moves up"
BLUE = "a blue circle moves to the left"
GREEN = "a green diamond bounces on a black background"
PLAIN = "a yellow triangle"  # names no motion: None is left out of the fraction


def evaluation():
    flash = [
        # RED: all right in 2 of 3 seeds; RED2: all right in 2 of 3 too, fewer attributes right in the third
        video(RED, 0), video(RED, 1), video(RED, 2, shape=False),
        video(RED2, 0), video(RED2, 1), video(RED2, 2, shape=False, motion=False),
        # BLUE: never all right, 3 of 4 attributes in each seed; GREEN: never, 2 of 4
        *[video(BLUE, s, shape=False) for s in range(3)],
        *[video(GREEN, s, shape=False, motion=False) for s in range(3)],
        # PLAIN: all right once; its motion is None
        video(PLAIN, 0, motion=None), video(PLAIN, 1, shape=False, motion=None), video(PLAIN, 2, shape=False, motion=None),
    ]  # fmt: skip
    mhla = [dict(v, shape=False) for v in flash]
    return {"seeds": [0, 1, 2], "analyser_version": 3, "variants": {"flash": {"per_video": flash}, "mhla": {"per_video": mhla}}}  # fmt: skip


def test_choose_ranks_by_all_right_then_attributes_then_one_per_colour():
    chosen = choose(evaluation(), count=4)
    # RED and RED2 tie on all-right (2); RED has more attributes right (11/12 vs 10/12). RED2 is red too, so
    # it waits while other colours are left: PLAIN (1 all right), then BLUE (0, 9/12) before GREEN (0, 6/12)
    assert [c["prompt"] for c in chosen] == [RED, PLAIN, BLUE, GREEN]
    red = chosen[0]
    assert red["all_right"] == 2 and red["videos"] == 3 and red["attributes_right"] == pytest.approx(11 / 12)
    assert chosen[1]["attributes_right"] == pytest.approx(7 / 9)  # three named attributes per PLAIN video
    # the fraction over every variant: flash 11/12 and mhla 9/12 (its shape wrong in every seed) for RED
    assert red["attributes_right_all_variants"] == pytest.approx((11 / 12 + 9 / 12) / 2)
    # with more asked for than there are colours, the best of the rest fill up
    assert [c["prompt"] for c in choose(evaluation(), count=5)] == [RED, PLAIN, BLUE, GREEN, RED2]


def test_choose_needs_per_video_verdicts():
    with pytest.raises(ValueError, match="no per-video verdicts for 'linear'"):
        choose(evaluation(), variant="linear")


def test_the_command_writes_builtin_json_and_the_app_offers_them(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "builtin.json").write_text(json.dumps({"defaults": {"height": 128}}))
    source = tmp_path / "eval.json"
    source.write_text(json.dumps(evaluation()))
    assert builtin_examples(model) == []
    assert main(["--from", str(source), "--model", str(model), "--count", "2"]) == 0
    info = json.loads((model / "builtin.json").read_text())
    assert info["defaults"] == {"height": 128}  # the rest of the record is kept
    assert info["example_prompts"]["prompts"] == [RED, PLAIN] and info["example_prompts"]["analyser_version"] == 3
    assert builtin_examples(model) == [RED, PLAIN] and "2/3 all right" in capsys.readouterr().out
    assert not list(model.glob("*.tmp"))
    for odd in ([RED], {"prompts": RED}, {"prompts": [RED, 3, " "]}):  # a hand-edited record: what is usable
        (model / "builtin.json").write_text(json.dumps({"example_prompts": odd}))
        assert builtin_examples(model) == ([RED] if isinstance(odd, dict) and isinstance(odd["prompts"], list) else [])
    (model / "builtin.json").write_text(json.dumps(info))
    # the app: a model's recorded examples win; without them, the built-in or general defaults
    assert AppModels(None, {}, examples=builtin_examples(model)).example_prompts == [RED, PLAIN]
    builtin, wan = SimpleNamespace(source="built-in model (assets/builtin)"), SimpleNamespace(source="/models/wan")
    assert AppModels(builtin, {}).example_prompts == BUILTIN_PROMPTS
    assert AppModels(wan, {}).example_prompts == GENERAL_PROMPTS


def test_a_source_inside_the_checkout_is_recorded_relative_to_it(tmp_path, monkeypatch):
    # the shipped builtin.json once named the checkout it was made in: a committed record reads the same in every clone
    import factory

    checkout = tmp_path / "clone"
    (checkout / "curves").mkdir(parents=True)
    monkeypatch.setattr(factory, "ROOT", checkout)
    model = tmp_path / "model"
    model.mkdir()
    (model / "builtin.json").write_text(json.dumps({"defaults": {}}))
    source = checkout / "curves" / "eval.json"
    source.write_text(json.dumps(evaluation()))
    assert main(["--from", str(source), "--model", str(model), "--count", "1"]) == 0
    assert json.loads((model / "builtin.json").read_text())["example_prompts"]["chosen_from"] == "curves/eval.json"


def test_the_command_refuses_bad_input(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    assert (
        main(["--from", str(tmp_path / "eval.json"), "--model", str(model)]) == 2
    )  # the error boundary: an exit code, not SystemExit
    assert "has no builtin.json" in capsys.readouterr().err
    (model / "builtin.json").write_text("{}")
    assert (
        main(["--from", str(tmp_path / "missing.json"), "--model", str(model)]) == 2
    )  # the error boundary: an exit code, not SystemExit
    assert "missing.json" in capsys.readouterr().err
    assert json.loads((model / "builtin.json").read_text()) == {}  # untouched


def test_output_path_appends_the_suffix():
    assert str(output_path("results/sweep_sigma0.75", ".json")) == "results/sweep_sigma0.75.json"
    assert str(output_path("results/eval", ".png")) == "results/eval.png"
    assert str(output_path("results/eval.json", ".json")) == "results/eval.json"

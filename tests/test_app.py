"""The app's logic, called directly (no server): presets, request checks, compare runs, benchmark."""

import pytest
import torch

from app import bench, compare
from app.models import CONVERTED_NOTE, build_random_components, load_app_models, parse_variant_dirs
from pipelines import VARIANTS, read_video

SMALLEST = compare.preset_key(compare.PRESETS[0])


@pytest.fixture(scope="module")
def models():
    return load_app_models("tiny-random")


def test_presets_name_their_token_count():
    labels = dict((v, k) for k, v in compare.preset_choices())
    assert labels["81x480x800"] == "81 frames, 480x800: 31,500 tokens (21x30x50), M=105"
    assert labels["81x480x832"].startswith("81 frames, 480x832: 32,760 tokens (21x30x52)")
    assert labels[SMALLEST] == "5 frames, 32x48: 12 tokens (2x2x3), M=1"
    for p in compare.PRESETS:
        assert compare.parse_preset(compare.preset_key(p)) == p


@pytest.mark.parametrize("bad", ["../../etc/passwd", "81x480x801", "", None, 5])
def test_unknown_presets_are_refused(bad):
    with pytest.raises(ValueError, match="unknown resolution preset"):
        compare.parse_preset(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(prompt="   "), "prompt is empty"),
        (dict(variants=[]), "no variant chosen"),
        (dict(variants=["flash", "softmax"]), "unknown variant"),
        (dict(preset="81x480x800"), r"too large for this device.*31,500 tokens.*at most 8,192"),
        (dict(steps=2.5), "steps must be a whole number, got 2.5"),
        (dict(steps=0), "steps must be between 1 and"),
        (dict(guidance=-1), "guidance must be a number between 0 and"),
        (dict(seed=float("nan")), "seed must be a whole number"),
    ],
)
def test_bad_requests_name_the_bad_value(models, change, message):
    args = dict(prompt="a fox", negative_prompt="", seed=0, steps=2, guidance=5.0, preset=SMALLEST, variants=["flash"])
    args.update(change)
    with pytest.raises(ValueError, match=message):
        compare.check_request(models, max_tokens=compare.CPU_MAX_TOKENS, **args)


def test_request_keeps_canonical_variant_order(models):
    req = compare.check_request(models, " a fox ", None, 3.0, 2, 5, SMALLEST, ["mhla", "flash", "mhla"])
    assert req.variants == ["flash", "mhla"] and req.prompt == "a fox" and req.seed == 3 and req.negative_prompt == ""


def test_variant_notes(models):
    assert models.random_note and "RANDOM weights" in models.random_note
    assert models.variants["flash"].note == "RANDOM weights: the video is noise"
    for name in ("linear", "mhla", "mhla-hybrid"):
        assert models.variants[name].note == CONVERTED_NOTE + "; RANDOM weights: the video is noise"
        assert models.variants[name].kind == "converted, random"
        assert models.variants[name].transformer is models.components.transformer  # shared, not copied


def test_compare_runs_every_variant_with_consistent_latency(models, tmp_path):
    req = compare.check_request(models, "a red fox", "", 0, 2, 5.0, SMALLEST, list(VARIANTS))
    calls = []
    result = compare.run_compare(models, req, tmp_path, progress=lambda i, n, d: calls.append((i, n)))
    assert calls == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert [r.variant for r in result.runs] == list(VARIANTS)
    for run in result.runs:
        assert run.error is None
        frames = read_video(run.video)
        assert frames.shape == (5, 32, 48, 3)
        t = run.timing
        assert t.variant == run.variant and t.num_tokens == 12 and len(t.steps) == 2
        assert 0 < t.per_step * 2 <= t.denoising * (1 + 1e-9) and t.denoising < t.total
        assert 0 < t.self_attention < t.denoising
        md = compare.variant_markdown(run)
        assert "per step" in md and run.note in md
    rows = compare.table_rows(result)
    assert rows[0][0] == "flash" and rows[0][10] == "1.00x"
    assert all(r[10].endswith("x") for r in rows)
    summary = compare.summary_markdown(result)
    assert "RANDOM weights" in summary and result.device in summary and "sdpa" in result.softmax_backend
    assert compare.speedup_figure(result) is not None


def test_compare_reports_a_failing_variant_and_goes_on(models, tmp_path, monkeypatch):
    real = compare.generate

    def failing(components, prompt, variant, **kw):
        if variant == "linear":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return real(components, prompt, variant=variant, **kw)

    monkeypatch.setattr(compare, "generate", failing)
    req = compare.check_request(models, "a fox", "", 1, 1, 5.0, SMALLEST, ["flash", "linear", "mhla"])
    result = compare.run_compare(models, req, tmp_path)
    by = {r.variant: r for r in result.runs}
    assert by["linear"].video is None and "out of memory" in by["linear"].error and "12 tokens" in by["linear"].error
    assert by["flash"].video.is_file() and by["mhla"].video.is_file()
    assert "Error" in compare.variant_markdown(by["linear"])
    assert "Failed:** linear" in compare.summary_markdown(result)
    assert compare.table_rows(result)[1][-1].startswith("error: out of memory")


def test_old_runs_are_cleaned_up(tmp_path):
    for _ in range(compare.KEEP_RUNS + 5):
        compare.new_run_dir(tmp_path)
    assert len(list(tmp_path.iterdir())) == compare.KEEP_RUNS


def test_variant_dirs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="expects NAME=DIR"):
        parse_variant_dirs(["mhla"])
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        parse_variant_dirs([f"fast={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        parse_variant_dirs([f"mhla={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    assert parse_variant_dirs([f"mhla={tmp_path}"]) == {"mhla": tmp_path}


def test_model_choices_exclude_each_other():
    with pytest.raises(ValueError, match="exclude each other"):
        load_app_models("/nowhere", random_weights="1.3b")
    with pytest.raises(ValueError, match="must be one of 1.3b, 14b, got '7b'"):
        build_random_components("7b")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no token grids"),
        ("1x16", "a grid looks like"),
        ("1x0x4", "a grid looks like"),
        ("4x64x64", "at most 4,096"),
    ],
)
def test_bench_grids_are_checked(text, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_grids(text, max_tokens=4096)


def test_bench_grids_sorted_by_tokens():
    assert bench.parse_grids("2x4x4, 1x4x4,2x4x4") == [(1, 4, 4), (2, 4, 4)]


def test_benchmark_measures_both_levels(models, tmp_path):
    result = bench.run_benchmark(models, "1x4x4,1x8x8", variants=["flash", "mhla"], repeats=1)
    rows = result["rows"]
    ops = [r for r in rows if r["level"] == "operator"]
    fwd = [r for r in rows if r["level"] == "transformer forward"]
    assert [(r["variant"], r["tokens"]) for r in ops] == [(v, n) for n in (16, 64) for v in bench.OPERATORS]
    assert [(r["variant"], r["tokens"]) for r in fwd] == [(v, n) for n in (16, 64) for v in ("flash", "mhla")]
    assert all(r["ms"] > 0 for r in rows)
    assert ops[0]["backend"].startswith("sdpa")
    assert result["meta"]["heads"] == models.components.transformer.config.num_attention_heads
    js, cs = bench.save(result, tmp_path)
    assert (
        cs.read_text().splitlines()[0] == ",".join(bench.FIELDS) and len(cs.read_text().splitlines()) == len(rows) + 1
    )
    assert js.is_file() and len(bench.table(result)) == len(rows)
    assert bench.figure(result) is not None


def test_benchmark_refuses_bad_choices(models):
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run_benchmark(models, "1x4x4", variants=["nope"])
    with pytest.raises(ValueError, match="levels must be some of"):
        bench.run_benchmark(models, "1x4x4", levels=["kernel"])


def test_page_builds(models, tmp_path):
    from app.ui import build_demo

    demo = build_demo(models, max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    config = demo.get_config_file()
    ids = {c.get("props", {}).get("elem_id") for c in config["components"]}
    assert {"prompt", "generate", "status", "table", *(f"video-{v}" for v in VARIANTS)} <= ids


@pytest.mark.gpu
def test_random_weights_at_true_size_on_gpu(tmp_path):
    m = load_app_models(random_weights="1.3b")
    assert m.components.transformer.config.num_attention_heads == 12 and "RANDOM" in m.random_note
    req = compare.check_request(m, "a fox", "", 0, 2, 5.0, compare.preset_key((17, 128, 192)), ["flash", "mhla"])
    result = compare.run_compare(m, req, tmp_path)
    assert all(r.error is None and r.timing.peak_memory_bytes > 0 for r in result.runs)
    assert result.runs[0].timing.num_tokens == 5 * 8 * 12 and read_video(result.runs[0].video).shape == (
        17,
        128,
        192,
        3,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "mhla"], "--variant expects NAME=DIR"),
        (["--variant", "fast=ckpt"], "unknown variant 'fast'"),
        (["--model", "/nowhere/wan"], "'/nowhere/wan' does not exist"),
        (["--model", "/nowhere/wan", "--random-weights", "1.3b"], "exclude each other"),
    ],
)
def test_launcher_refuses_bad_arguments_before_loading(argv, message, capsys):
    import run_app

    assert run_app.main(argv) == 2
    assert message in capsys.readouterr().err


def test_huge_prompts_are_refused_with_the_limit(models):
    with pytest.raises(ValueError, match=r"the prompt has 131,073 characters; at most 2,000 are accepted"):
        compare.check_request(models, "a" * 131_073, "", 1, 1, 5.0, SMALLEST, ["flash"])
    with pytest.raises(ValueError, match=r"the negative prompt has 5,000 characters"):
        compare.check_request(models, "a fox", "b" * 5000, 1, 1, 5.0, SMALLEST, ["flash"])


def test_a_variant_failing_unexpectedly_keeps_the_others_and_shows_no_server_path(models, tmp_path, monkeypatch):
    real = compare.generate
    secret = str(tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "x.py")

    def failing(components, prompt, variant, **kw):
        if variant == "flash":
            raise OSError(7, f"Argument list too long: {secret}")
        if variant == "linear":
            raise ValueError(f"weights in {secret} are bad")
        return real(components, prompt, variant=variant, **kw)

    monkeypatch.setattr(compare, "generate", failing)
    req = compare.check_request(models, "a fox " * 300, "", 1, 1, 5.0, SMALLEST, ["flash", "linear", "mhla"])
    result = compare.run_compare(models, req, tmp_path / "out")
    by = {r.variant: r for r in result.runs}
    assert by["mhla"].video.is_file()  # the long (1,800-character) prompt goes into its metadata safely
    assert by["flash"].error == "internal error (OSError); the details are in the server's log"
    assert by["linear"].error == "ValueError: weights in .../x.py are bad"
    page = compare.summary_markdown(result) + "".join(compare.variant_markdown(r) for r in result.runs)
    assert str(tmp_path) not in page

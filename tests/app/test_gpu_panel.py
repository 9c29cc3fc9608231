"""Issue 38 (4): the "measured on a GPU" panel reads the committed result files (device, date, software, how it
was run) and is its own section of the page, apart from the live CPU timings."""

import json

import pytest

from app import gpu_results
from app.gpu_results import RESULTS

H100 = RESULTS / "h100-2026-11-26" / "wan_step_1.3b_h100_20261126.json"


def test_the_committed_h100_results_are_read_as_they_are():
    tables = {t.file: t for t in gpu_results.load()}
    table = tables["h100-2026-11-26/wan_step_1.3b_h100_20261126.json"]
    rows = json.loads(H100.read_text())["rows"]
    assert table.device == "NVIDIA H100 80GB HBM3" and table.date.startswith("2026-11-26")
    assert "torch 2.11.0+cu130" in table.software and "--config 1.3b" in table.how
    text = gpu_results.table_markdown(table)
    for r in rows:  # every row of the file, with its own numbers
        assert f"| {r['pass']} | {r['size']} | {r['tokens']:,} | {r['variant']} | {r['ms']:.1f} | " in text
    mhla = next(r for r in rows if (r["variant"], r["pass"], r["tokens"]) == ("mhla", "fwd", 31500))
    assert f"{mhla['speedup_vs_flash']:.2f}x" == "2.43x" and "2.43x" in text


def test_a_compiled_run_says_so_and_an_eager_one_says_eager():
    tables = {t.file: t for t in gpu_results.load()}
    compiled = tables["h100-2026-11-26b/wan_step_1.3b_compiled-blocks_h100_20261126.json"]
    eager = tables["h100-2026-11-26/wan_step_1.3b_h100_20261126.json"]
    assert "torch.compile blocks" in compiled.model and "eager" not in compiled.model
    assert eager.model.endswith(", eager")
    rows = json.loads((RESULTS / compiled.file).read_text())["rows"]
    mhla = next(r for r in rows if r["variant"] == "mhla")
    assert f"{mhla['ms']:.1f}" in gpu_results.table_markdown(compiled)


def test_cpu_and_unfinished_results_are_not_gpu_results(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    good = json.loads(H100.read_text())
    cpu = {"meta": {**good["meta"], "device_type": "cpu", "device": "cpu"}, "rows": good["rows"]}
    unfinished = {"meta": {**good["meta"], "complete": False}, "rows": good["rows"]}
    (folder / "wan_step_cpu.json").write_text(json.dumps(cpu))
    (folder / "wan_step_unfinished.json").write_text(json.dumps(unfinished))
    (folder / "wan_step_broken.json").write_text("{not json")
    assert gpu_results.load(tmp_path) == [] and gpu_results.panel_markdown([]) == ""
    (folder / "wan_step_gpu.json").write_text(json.dumps(good))
    (folder / "README.md").write_text("- `wan_step_gpu.json`: `python -m benchmarks.wan_step --config 1.3b`\n")
    (table,) = gpu_results.load(tmp_path)
    assert table.how == "`wan_step_gpu.json`: `python -m benchmarks.wan_step --config 1.3b`"
    assert "not on this machine" in gpu_results.panel_markdown([table])


@pytest.mark.slow  # builds the page
def test_the_page_shows_the_gpu_panel_apart_from_the_live_timings(tmp_path):
    from app.models import load_app_models
    from app.ui import build_demo

    demo = build_demo(load_app_models("tiny-random"), out_root=tmp_path)
    props = {c.get("props", {}).get("elem_id"): c.get("props", {}) for c in demo.config["components"]}
    panel = props["gpu-results-text-compare"]["value"]
    assert "NVIDIA H100 80GB HBM3" in panel and "measured on a GPU" in panel and "2.43x" in panel
    assert "not this machine" in props["gpu-results-compare"]["label"] and "gpu-results-bench" in props


def test_the_live_table_names_the_machine_that_measured_it():
    from types import SimpleNamespace

    from app import compare
    from app.compare_tab import table_device

    result = compare.CompareResult(SimpleNamespace(), [compare.VariantRun("flash", "")], "cpu (2 cores)")
    result.load = "load 6.1 on 2 cores"
    assert table_device(result) == "\n\n_Timings in this table: measured live on cpu (2 cores), load 6.1 on 2 cores._"
    result.measured = "measured on cpu (4 cores), load 1.0, 2026-11-25"
    assert "2026-11-25" in table_device(result) and "live" not in table_device(result)
    assert table_device(compare.CompareResult(SimpleNamespace(), [], "cpu")) == ""


def test_a_command_wrapped_over_several_readme_lines_is_shown_whole(tmp_path):
    """Issue 52 (6): the panel cut the compiled-blocks command to its first line."""
    tables = {t.file: t for t in gpu_results.load()}
    compiled = tables["h100-2026-11-26b/wan_step_1.3b_compiled-blocks_h100_20261126.json"]
    tail = "--passes fwd --variants flash,mhla,linear,mhla-hybrid --softmax-backend sdpa_cudnn --compile blocks --warmup 1 --repeats 3"
    assert f"--sizes 81x480x800 {tail}`" in compiled.how
    assert tail in gpu_results.table_markdown(compiled)
    # an item ends at the next bullet or an unindented line: the next file's words are not taken along
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "wan_step_gpu.json").write_text(H100.read_text())
    (folder / "README.md").write_text(
        "Intro line.\n\n- `wan_step_gpu.json`: `python -m benchmarks.wan_step --config 1.3b\n  --repeats 3`: forward.\n"
        "- `other.json`: something else\nA paragraph.\n"
    )
    (table,) = gpu_results.load(tmp_path)
    assert table.how == "`wan_step_gpu.json`: `python -m benchmarks.wan_step --config 1.3b --repeats 3`: forward."

"""Issue 52 (2): one timing rule for the CLI and the app. ``python -m pipelines.cli --variant all`` takes turns step
by step as the page does (:mod:`common.interleave`), reports the paired per-step ratio vs flash with its 95%
interval and "noisy" past +-10%, and takes ``--repeats`` as the page's Repeats."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import numpy as np
import pytest

import pipelines.cli as cli
import pipelines.run as run
from common.interleave import MAX_REPEATS, NOISY, PairedSpeedup, format_paired_comparison, speedup_text, step_speedup
from common.timing import Timing
from pipelines import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = re.compile(r"(\d+\.\d\d)x \((\d+\.\d\d)-(\d+\.\d\d)\)")


def _timing(variant: str, steps: list[float]) -> Timing:
    return Timing(variant, "cpu", "float32", total=sum(steps) + 0.5, steps=steps, num_tokens=72)


def _row(table: str, variant: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == variant:
            return cells
    raise AssertionError(f"no row for {variant} in\n{table}")


def test_the_table_pairs_steps_and_says_noisy_past_ten_percent():
    load = [1.0, 3.0, 1.5, 2.5, 1.2, 2.8, 1.1, 2.0, 1.7, 2.2, 1.3]  # the machine's load changes 3x between rounds
    flash = [_timing("flash", [9.0] + [0.4 * x for x in load])]  # a cold first step: left out of the pairs
    mhla = [_timing("mhla", [5.0] + [0.2 * x for x in load])]  # 2x in every round
    jitter = [1.0, 1.6, 0.7, 1.3, 0.8, 1.5, 0.6, 1.2, 0.9, 1.4, 1.1]
    linear = [_timing("linear", [5.0] + [0.3 * x * j for x, j in zip(load, jitter)])]
    table = format_paired_comparison({"flash": flash, "mhla": mhla, "linear": linear}, interleaved=True, repeats=1)
    assert "vs flash per step (95% interval)" in table
    assert _row(table, "flash")[8] == "reference"
    steady = _row(table, "mhla")
    assert INTERVAL.fullmatch(steady[8]) and steady[8].startswith("2.00x (2.00-2.00)") and steady[9] == "11"
    wide = _row(table, "linear")
    estimate, low, high = map(float, INTERVAL.match(wide[8]).groups())
    assert low < estimate < high and "noisy ±" in wide[8]
    assert max(high / estimate - 1, 1 - low / estimate) > NOISY
    assert "noisy: linear" in table and "mhla" not in table.split("noisy:")[1]
    # the same steps run one after another: no speedup is trusted
    apart = format_paired_comparison({"flash": flash, "mhla": mhla}, interleaved=False)
    assert _row(apart, "mhla")[8].endswith("noisy") and "one after another" in apart
    # the app's rule is the same function: its table cell for these runs reads the same
    from app.compare.report import _speedup

    assert _speedup(step_speedup(flash, linear)) == wide[8]


def test_a_width_just_past_the_line_never_reads_as_on_it():
    assert speedup_text(PairedSpeedup(1.0, 0.9, 1.1004, 19, 0.05)) == "1.00x (0.90-1.10) noisy ±11%"
    assert speedup_text(PairedSpeedup(1.0, 0.95, 1.05, 19, 0.02)) == "1.00x (0.95-1.05)"
    few = "2.00x (2.00-2.00) noisy: 3 pairs, too few for a 95% interval"
    assert speedup_text(PairedSpeedup(2.0, 2.0, 2.0, 3, 0.0)) == few
    assert speedup_text(None) == "-"


def test_repeats_out_of_range_are_refused_naming_the_value(tmp_path, capsys):
    for bad in ("0", str(MAX_REPEATS + 1)):
        code = cli.main(
            ["--model", "tiny-random", "--prompt", "a fox", "--repeats", bad, "--out", str(tmp_path / "a.mp4")]
        )
        err = capsys.readouterr().err
        assert code not in (0, None) and f"--repeats {bad}" in err and f"1 to {MAX_REPEATS}" in err
    assert not list(tmp_path.iterdir())


def test_pipelines_and_common_never_import_app():
    """The arrows point one way: app/ imports pipelines/ and common/, never the reverse."""
    offenders = []
    for package in ("pipelines", "common", "mhla"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "app" or n.startswith("app.")]
    assert not offenders


def _spy_steps(monkeypatch) -> list[tuple[str, int, bool]]:
    """Records the CLI's step callbacks (variant, steps done, finished) in the order they happen."""
    seen: list[tuple[str, int, bool]] = []
    take_turns = run.take_turns

    def spy(*args, on_step=None, **kwargs):
        def record(name, k, finished):
            seen.append((name, k, finished))
            if on_step is not None:
                on_step(name, k, finished)

        return take_turns(*args, on_step=record, **kwargs)

    monkeypatch.setattr(run, "take_turns", spy)
    return seen


def _turns(seen) -> list[str]:
    """Who held each turn: the variants of the finished steps, runs of one variant collapsed."""
    return [name for name, _ in itertools.groupby(name for name, _, finished in seen if finished)]


@pytest.mark.slow  # four variants x 3 steps x 2 runs of the tiny model: ~10 s on a shared 2-core CPU
def test_variant_all_takes_turns_and_reports_intervals(tmp_path, monkeypatch, capsys):
    seen = _spy_steps(monkeypatch)
    out = tmp_path / "fox.mp4"
    argv = ["--model", "tiny-random", "--prompt", "a fox", "--variant", "all", "--steps", "3", "--repeats", "2"]
    assert cli.main([*argv, "--out", str(out), "--frames-npy", str(tmp_path / "fox.npy"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    # step by step, round-robin: 3 rounds, then the second runs' 3 (each variant's first step of its second run
    # follows its last step of the first in the same turn: 5 turns each)
    assert _turns(seen) == list(VARIANTS) * 5
    assert sum(finished for *_, finished in seen) == len(VARIANTS) * 3 * 2
    table = printed[printed.index("| variant") :]
    assert "took turns, one denoising step each (2 runs per variant)" in table
    for variant in VARIANTS[1:]:
        cells = _row(table, variant)
        estimate, low, high = map(float, INTERVAL.match(cells[8]).groups())
        assert low <= estimate <= high and cells[9] == "4"  # 2 runs x (3 steps - the warm-up)
        assert "noisy" in cells[8]  # 4 pairs make no 95% interval for a median: said, not hidden
    for variant in VARIANTS:
        assert (tmp_path / f"fox_{variant}.mp4").is_file()
    # a variant on its own copy of the transformer draws what it draws alone (interleaving changes no pixel)
    alone = tmp_path / "alone.mp4"
    argv1 = ["--model", "tiny-random", "--prompt", "a fox", "--variant", "mhla", "--steps", "3", "--no-progress"]
    assert cli.main([*argv1, "--out", str(alone), "--frames-npy", str(tmp_path / "alone.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "alone.npy"), np.load(tmp_path / "fox_mhla.npy"))


@pytest.mark.slow  # three variants x 3 steps of the tiny model
def test_without_room_for_copies_the_variants_run_one_after_another_and_say_so(tmp_path, monkeypatch, capsys):
    seen = _spy_steps(monkeypatch)
    monkeypatch.setattr(run, "_free_bytes", lambda device: 0)
    argv = ["--model", "tiny-random", "--prompt", "a fox", "--variant", "flash,linear,mhla", "--steps", "3"]
    assert cli.main([*argv, "--out", str(tmp_path / "fox.mp4"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert _turns(seen) == ["flash", "linear", "mhla"]  # each whole run in its turn
    assert "the variants run one after another: a transformer per variant needs" in printed
    table = printed[printed.index("| variant") :]
    assert all("noisy" in _row(table, v)[8] for v in ("linear", "mhla"))
    assert "one after another" in table

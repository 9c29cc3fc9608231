"""The CLI and the app time a step by one rule (the first step is a warm-up, left out; the median of the rest),
and a stored Timing reads back as it was written."""

from __future__ import annotations

import random
import statistics

import pytest

from common.timing import Timing, format_comparison, format_timing


def _timing(variant: str, steps: list[float]) -> Timing:
    return Timing(variant=variant, device="cpu", dtype="float32", steps=steps, denoising=sum(steps), grid=(1, 2, 3))


def test_a_step_is_the_median_of_the_steps_after_the_first():
    rng = random.Random()
    warm = [rng.uniform(0.5, 1.5) for _ in range(rng.randint(2, 9))]
    t = _timing("mhla", [10.0, *warm])
    assert t.warm_steps == warm and t.step == pytest.approx(statistics.median(warm))
    assert t.per_step == pytest.approx((10.0 + sum(warm)) / (1 + len(warm)))  # the mean keeps the cold step
    one = _timing("mhla", [3.0])
    assert one.warm_steps == [3.0] and one.step == 3.0 and _timing("mhla", []).step == 0.0
    assert "the first, a warm-up: 10.000 s" in format_timing(t)


def test_the_comparison_reports_warm_steps_and_speedups_over_the_first_variant():
    flash = _timing("flash", [9.0, 2.0, 2.2, 2.1])  # a cold first step 4x a warm one, as the CLI's first variant
    mhla = _timing("mhla", [1.5, 0.7, 0.69, 0.71])
    table = format_comparison([flash, mhla])
    header, _, first, second = table.splitlines()
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert "vs flash" in cols and "first s" in cols
    row = dict(zip(cols, (c.strip() for c in second.strip("|").split("|")), strict=True))
    assert row["step s"] == "0.700" and row["first s"] == "1.500"
    assert row["vs flash"] == f"{2.1 / 0.7:.2f}x"  # 3.00x; the means (3.83 s and 0.90 s) would say 4.24x


def test_a_timing_reads_back_from_its_dict():
    t = _timing("mhla-hybrid", [1.0, 0.5, 0.4])
    t.num_blocks, t.layout = 12, "(1, 4, 5)"
    d = t.as_dict()
    assert d["step"] == pytest.approx(0.45) and d["per_step"] == pytest.approx(1.9 / 3)
    back = Timing.from_dict(d)
    assert back == t and back.grid == (1, 2, 3)

"""Issue 53 (7): the fast fault-injection probes run as one suite (``python -m tests.reliability --tier fast`` in a
subprocess) in the slow tier, so that ``pytest -m slow`` (``.ci/run``) runs every probe: the slow ones as its own
tests, the fast ones here; the session ends with the table of all of them (tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.reliability import PROBES, ROOT, SUITE_PROPERTY, ok, table


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_fast_probes_pass_as_one_suite(tmp_path, record_property):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.reliability", "--tier", "fast", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    rows = json.loads(out.read_text()) if out.is_file() else []
    record_property(SUITE_PROPERTY, rows)  # into the session's table (tests/reliability: Recorder), xdist or not
    print(table(rows))
    assert rows, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r for r in rows if not ok(r)] == [], table(rows)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # every kind with a fast probe was run (each kind has at least one test, in one tier or the other)
    assert {r["probe"] for r in rows} <= set(PROBES)

"""The suite's guard (tests/conftest.py, pyproject.toml's timeout): a test that grows past the memory limit or runs
past its time fails by name, and the tests after it still run and the summary is printed."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RUNAWAY = """
import time
import pytest

def test_grows_without_end():
    held = []
    while True:
        held.append(bytearray(64 * 2**20))  # touched: resident, not only reserved
        held[-1][::4096] = b"x" * len(held[-1][::4096])

@pytest.mark.timeout(2)
def test_hangs():
    time.sleep(60)

def test_after_them():
    assert True
"""


@pytest.mark.slow
def test_a_runaway_test_fails_by_name_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_runaway.py").write_text(RUNAWAY)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_runaway.py"),
        ],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "MHLA_TEST_MAX_RSS_GB": "1.5", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "test_grows_without_end went past the suite's memory limit (1.5 GiB" in out, out
    assert "FAILED" in out and "test_hangs" in out and "Timeout" in out, out
    assert "2 failed, 1 passed" in out, out  # the summary: the run went on past both

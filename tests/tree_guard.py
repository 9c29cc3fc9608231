"""A test run never writes into the checkout's tracked files (CI's clean clone, a developer's work in progress).

The load test rewrote ``benchmarks/results/app_load_*`` in every pytest run, CI's included, and nobody saw it until
a ``git status``. This guard closes the class: the session's controller records every tracked file's size and
modification time when pytest starts and, when it ends, fails the run naming each one that changed. The reliability
suite (``python -m tests.reliability``, which sets :data:`tests.reliability.OUT_ENV`) is the one run that writes its
results into ``benchmarks/results/`` on purpose, and is let through; so is a checkout without git.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tracked_files(root: Path = ROOT) -> list[str] | None:
    """The checkout's tracked files (None: not a git checkout, or no git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, timeout=60
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return None
    return [p for p in out.split("\0") if p]


def snapshot(files: list[str], root: Path = ROOT) -> dict[str, tuple[int, int] | None]:
    """Each file's ``(size, mtime in ns)``, None where it does not exist."""
    out: dict[str, tuple[int, int] | None] = {}
    for name in files:
        try:
            st = os.stat(root / name)
            out[name] = (st.st_size, st.st_mtime_ns)
        except OSError:
            out[name] = None
    return out


def changed(before: dict[str, tuple[int, int] | None], root: Path = ROOT) -> list[str]:
    """The files of ``before`` whose size or modification time differ now (or that appeared or went)."""
    now = snapshot(list(before), root)
    return sorted(name for name, was in before.items() if now[name] != was)


class TreeGuard:
    """The plugin (registered by tests/conftest.py in the controller only, not in xdist's workers)."""

    def __init__(self, root: Path = ROOT):
        files = tracked_files(root)
        self.root = root
        self.before = None if files is None else snapshot(files, root)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        from tests.reliability import OUT_ENV

        if self.before is None or os.environ.get(OUT_ENV):
            return
        written = changed(self.before, self.root)
        if written:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            lines = [
                f"this test run wrote into {len(written)} tracked file(s) of the checkout (a test writes under "
                "tmp_path; results files are the reliability suite's, python -m tests.reliability):",
                *(f"  {name}" for name in written[:20]),
            ]
            if reporter is not None:
                reporter.write_sep("=", "tracked files written", red=True)
                for line in lines:
                    reporter.write_line(line)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

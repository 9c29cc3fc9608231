"""tests/tree_guard.py: a test run that writes into a tracked file of the checkout fails, naming it."""

import os
import subprocess
from types import SimpleNamespace

import pytest

from tests import tree_guard


def _repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "kept.txt").write_text("a\n")
    (tmp_path / "results.md").write_text("old figures\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    return tmp_path


def test_a_rewritten_tracked_file_is_named_and_fails_the_session(tmp_path, monkeypatch):
    root = _repo(tmp_path)
    guard = tree_guard.TreeGuard(root)
    assert sorted(guard.before) == ["kept.txt", "results.md"]
    (root / "untracked.log").write_text("a test's scratch file: not tracked, not checked\n")
    stat = os.stat(root / "results.md")
    (root / "results.md").write_text("new figures\n")  # the same size would still count: its time changed
    os.utime(root / "results.md", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert tree_guard.changed(guard.before, root) == ["results.md"]
    lines = []
    reporter = SimpleNamespace(write_sep=lambda *a, **k: lines.append(a[1]), write_line=lines.append)
    session = SimpleNamespace(
        config=SimpleNamespace(pluginmanager=SimpleNamespace(get_plugin=lambda name: reporter)), exitstatus=0
    )
    monkeypatch.delenv("MHLA_RELIABILITY_OUT", raising=False)
    guard.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED and any("results.md" in line for line in lines)


def test_the_reliability_suite_and_an_unchanged_tree_pass(tmp_path, monkeypatch):
    root = _repo(tmp_path)
    guard = tree_guard.TreeGuard(root)
    session = SimpleNamespace(config=SimpleNamespace(pluginmanager=SimpleNamespace(get_plugin=lambda n: None)))
    session.exitstatus = 0
    guard.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 0  # nothing written
    (root / "results.md").write_text("the reliability suite's figures\n")
    monkeypatch.setenv("MHLA_RELIABILITY_OUT", str(tmp_path / "rows.json"))
    guard.pytest_sessionfinish(session, 0)
    assert session.exitstatus == 0  # its results are written on purpose

"""Committed records name paths inside the checkout relative to its root, never one machine's absolute path."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from factory import ROOT, portable, write_json

# raw logs copied back from a device machine are kept as that machine printed them
RAW_LOGS = ("_log.txt",)


def test_portable_takes_the_checkout_out_of_every_string():
    inside = ROOT / "assets" / "builtin"
    record = {
        "model": str(inside),
        "parts": [str(ROOT / "a" / "b"), "a fresh VAE", f"written to {ROOT}/assets/x"],
        "root": str(ROOT),
        "path": inside,
        "nested": {"n": 3, "outside": "/elsewhere/model"},
        "sibling": f"{ROOT}-other/x",  # a folder beside the checkout whose name starts like it is not inside it
    }
    assert portable(record) == {
        "model": "assets/builtin",
        "parts": ["a/b", "a fresh VAE", "written to assets/x"],
        "root": ".",
        "path": "assets/builtin",
        "nested": {"n": 3, "outside": "/elsewhere/model"},
        "sibling": f"{ROOT}-other/x",
    }


def test_write_json_writes_portable_records(tmp_path):
    out = write_json(tmp_path / "r", {"model": str(ROOT / "assets" / "builtin"), "tmp": str(tmp_path)})
    data = json.loads(Path(out).read_text())
    assert data == {"model": "assets/builtin", "tmp": str(tmp_path)}


def _tracked_texts():
    """(name, text) of every tracked text file under 2 MB present here (raw device logs kept as printed)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = [n for n in listed.split("\n") if n]
    texts = []
    for name in names:
        if name.endswith(RAW_LOGS):
            continue
        path = ROOT / name
        try:
            if path.stat().st_size > 2_000_000:
                continue
            texts.append((name, path.read_text()))
        except (UnicodeDecodeError, OSError):
            continue  # binary files (weights, videos) and files absent from this checkout
    return names, texts


def test_no_tracked_file_names_this_checkouts_absolute_path():
    root = str(ROOT) + "/"
    offenders = [name for name, text in _tracked_texts()[1] if root in text]
    assert not offenders, f"files naming this checkout's absolute path {root!r}: {offenders[:10]}"


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_no_tracked_record_names_any_checkouts_absolute_path():
    # the test above sees only the checkout it runs in; a record written in another clone names that clone's folder
    # followed by one of the project's own top-level folders (/somewhere/clone/assets/...): caught in every clone
    names, texts = _tracked_texts()
    top = sorted({n.split("/")[0] for n in names if "/" in n} - {"tests"})
    inside = re.compile(r"^/(?:[^/\s]+/)+?(?:" + "|".join(map(re.escape, top)) + r")/")
    offenders = []
    for name, text in texts:
        if not name.endswith(".json"):
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            continue
        hits = [s for s in _strings(data) if inside.match(s)]
        if hits:
            offenders.append((name, hits[0]))
    assert not offenders, f"records naming a checkout's absolute path: {offenders[:10]}"

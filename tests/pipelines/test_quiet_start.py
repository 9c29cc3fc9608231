"""Issue 52 (9): nothing printed that is not the user's business. A text-to-video run says nothing about
torchvision and CLIPImageProcessor (diffusers' image-to-video module imports that name, and transformers 5 without
torchvision warned on every start), and ``python -m pipelines.tiny`` has no runpy RuntimeWarning (the module was
imported by ``import pipelines`` before it ran as __main__)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_import_pipelines_leaves_the_tiny_command_unimported():
    done = _run("-c", "import sys, pipelines; print('pipelines.tiny' in sys.modules)")
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


@pytest.mark.slow  # two interpreters that import torch and diffusers
def test_the_tiny_command_and_a_generation_print_no_warning(tmp_path):
    tiny = _run("-m", "pipelines.tiny", "--architecture", "wan2.1-i2v", "--out", str(tmp_path / "tiny"))
    assert tiny.returncode == 0, tiny.stderr
    assert "RuntimeWarning" not in tiny.stderr and "found in sys.modules" not in tiny.stderr, tiny.stderr
    assert "requires torchvision" not in tiny.stderr, tiny.stderr
    argv = ["--model", "tiny-random", "--prompt", "a fox", "--steps", "1", "--no-progress"]
    run = _run("-m", "pipelines.cli", *argv, "--out", str(tmp_path / "fox.mp4"))
    assert run.returncode == 0, run.stderr
    assert "requires torchvision" not in run.stderr + run.stdout and "CLIPImageProcessor" not in run.stderr

"""benchmarks/run_gpu.sh on a CPU: its dry run names commands whose arguments the scripts accept, the stages
come in the issue's order, and a stage that cannot run makes the exit status non-zero."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"


def dry_run(tmp_path: Path, *args: str, gpus: int = 2) -> tuple[int, str]:
    env = dict(os.environ, DRY_RUN="1", DRY_RUN_GPUS=str(gpus), OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


def commands(output: str) -> dict[str, list[str]]:
    found = {}
    for line in output.splitlines():
        if line.startswith("=== ") and " (dry run): " in line:
            name, cmd = line[4:].split(" (dry run): ", 1)
            found[name] = shlex.split(cmd)
    return found


def check_python_command(argv: list[str]) -> None:
    """``python3 -m MODULE ARGS``: MODULE's own parser accepts ARGS (a renamed flag fails here, not on a GPU)."""
    assert argv[:2] == ["python3", "-m"], argv
    module, args = argv[2], argv[3:]
    if module == "pytest":
        files = [a for a in args if a.endswith(".py") or a == "tests"]
        assert files and all((ROOT / f).exists() for f in files), files
        assert args[args.index("-m") + 1] == "gpu"
        return
    if module == "benchmarks.random_model":
        from benchmarks.random_model import parse_args

        parse_args(args)
    elif module == "benchmarks.cli_e2e":
        from pipelines.cli import _parse_args

        parsed = _parse_args(args)
        assert parsed.variant == "all" and (parsed.frames, parsed.height, parsed.width) == (81, 480, 832)
    elif module == "benchmarks.app_compare":
        from benchmarks.app_compare import parse_args as app_args

        app_args(args)
    elif module == "benchmarks.wan_step":
        import mhla
        from benchmarks.wan_step import build_parser

        parsed = build_parser().parse_args(args)
        assert parsed.softmax_backend in mhla.SOFTMAX_BACKENDS
    elif module == "benchmarks.context_parallel":
        from benchmarks.context_parallel import main as cp_main

        text = io.StringIO()
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            cp_main(["--help"])
        flags = [a for a in args if a.startswith("--")]
        assert all(f in text.getvalue() for f in flags), flags
    elif module == "benchmarks.attention":
        from benchmarks.attention import build_parser as attention_parser

        parsed = attention_parser().parse_args(args)
        assert parsed.passes and parsed.softmax_backends and parsed.impls
    elif module == "benchmarks.check_fused":
        assert args == []
    else:
        raise AssertionError(f"no check for {module}")


def test_dry_run_commands_parse_in_order(tmp_path):
    rc, out = dry_run(tmp_path)
    assert rc == 0, out
    found = commands(out)
    order = [n for n in found if n != "fused path check"]
    assert order == ["kernels", "model", "cli", "app", "compile", "op", "cp"], order
    for argv in found.values():
        check_python_command(argv)
    assert "| stage | result | s |" in out and "exit status 0" in out
    model_dir = found["model"][found["model"].index("--out") + 1]
    assert found["cli"][found["cli"].index("--model") + 1] == model_dir
    assert found["app"][found["app"].index("--model") + 1] == model_dir


def test_dry_run_extras_and_one_gpu(tmp_path):
    rc, out = dry_run(tmp_path, "tests,wan,profile,attention,cp", gpus=1)
    assert rc == 0, out
    found = commands(out)
    assert "cp" not in found and "skipped: 1 GPU" in out
    for name in ("gpu tests", "wan", "profile", "attention"):
        assert name in found, out
    check_python_command(found["wan"])


def test_unknown_stage_and_no_time_fail(tmp_path):
    rc, out = dry_run(tmp_path, "kernels,nonsense")
    assert rc == 2 and "unknown stage 'nonsense'" in out
    # not a dry run: with no budget left the stage is skipped, and that is a failure (exit 1)
    env = dict(os.environ, BUDGET_S="5", OUT=str(tmp_path / "real"))
    done = subprocess.run(["bash", str(SCRIPT), "kernels"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "| kernels | SKIPPED (no time left) | 0 |" in done.stdout


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_random_model_folder_runs_through_the_cli(tmp_path, capsys):
    # the builder's real configs are Wan2.1-1.3B's and UMT5-XXL's; built here shrunk (the real one is ~12 GB)
    from benchmarks import random_model
    from benchmarks.cli_e2e import main as cli_e2e

    transformer, text, _ = random_model.configs("1.3b", 24)
    assert (transformer["num_layers"], transformer["num_attention_heads"], transformer["ffn_dim"]) == (30, 12, 8960)
    assert (text["d_model"], text["num_layers"], text["d_ff"]) == (4096, 24, 10240)
    folder = random_model.build(tmp_path / "model", text_encoder_layers=1, device="cpu", dtype="float32", shrink=True)
    assert (folder / random_model.MARKER).is_file() and (folder / "model_index.json").is_file()
    out = tmp_path / "v.mp4"
    args = ["--model", str(folder), "--variant", "flash,mhla", "--prompt", "a fox", "--frames", "5", "--height", "32"]
    args += ["--width", "32", "--steps", "1", "--out", str(out), "--no-progress", "--blocks", "1x1x2"]
    assert cli_e2e(args) == 0
    printed = capsys.readouterr().out
    assert "mp4 writer:" in printed and "VAE decode" in printed and "text encoding" in printed
    assert (tmp_path / "v_flash.mp4").is_file() and (tmp_path / "v_mhla.mp4").is_file()


def test_slim_wheel_keeps_what_the_project_imports(tmp_path):
    import zipfile

    from benchmarks.slim_wheel import keep, slim

    assert keep("diffusers/pipelines/wan/pipeline_wan.py") and keep("diffusers/pipelines/pipeline_utils.py")
    assert keep("diffusers/hooks/first_block_cache.py") and keep("diffusers-0.42.1.dist-info/METADATA")
    assert not keep("diffusers/pipelines/flux/pipeline_flux.py")
    assert not keep("diffusers/modular_pipelines/wan/encoders.py")
    assert keep("diffusers/modular_pipelines/__init__.py")
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("diffusers/__init__.py", "diffusers/pipelines/wan/a.py", "diffusers/pipelines/flux/b.py"):
            z.writestr(name, "x = 1\n")
    assert slim(wheel, tmp_path / "out.zip") == (2, 1)

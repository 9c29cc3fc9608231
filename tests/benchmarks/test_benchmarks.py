"""CPU smoke tests of the benchmark scripts at tiny sizes: they run, write their files, and the JSON
holds the fields the README and the GPU script rely on. Nothing here compares times (no timed asserts)."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import attention, wan_step
from mhla import parse_grid

pytestmark = pytest.mark.slow  # starts processes and runs the benchmarks

ROOT = Path(__file__).resolve().parents[2]
META_KEYS = {"device", "device_type", "device_kind", "torch", "cuda", "triton", "triton_mode", "date", "dtype"}


def load(out_dir: Path, tag: str) -> dict:
    files = sorted(p.name for p in out_dir.iterdir())
    assert files == [f"{tag}.json", f"{tag}.md", f"{tag}.png"]
    assert (out_dir / f"{tag}.png").stat().st_size > 1000
    return json.loads((out_dir / f"{tag}.json").read_text())


def tokens_of(grid: str) -> int:
    return math.prod(parse_grid(grid))


def test_attention_benchmark_smoke(tmp_path):
    argv = ["--device", "cpu", "--grids", "1x4x8,2x6x5", "--heads", "2", "--dim", "16", "--softmax-backends", "all"]
    # the fused kernels run on CPU tensors only in Triton's interpreter (set up by conftest without a GPU)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
    impls = ["torch", "triton", "triton-v1", "layer"] if interpreted else ["torch", "layer"]
    argv += ["--impls", ",".join(impls), "--warmup", "0", "--repeats", "1", "--out-dir", str(tmp_path), "--tag", "t"]
    result = attention.main(argv)
    data = load(tmp_path, "t")
    assert data["meta"].keys() >= META_KEYS | {"copy_bandwidth_gbs", "matmul_tflops", "softmax_backends_available"}
    assert data["meta"]["copy_bandwidth_gbs"] > 0 and data["meta"]["matmul_tflops"] > 0
    assert data["meta"]["impls"] == impls
    if not torch.cuda.is_available():  # nothing is tuned in the interpreter (one launch setting)
        assert data["meta"]["triton_launches"] == {}
    rows = data["rows"]
    assert rows == json.loads(json.dumps(result["rows"]))
    softmax = [f"softmax[{b}]" for b in data["meta"]["softmax_backends_available"]]
    expected = set(softmax) | {f"{kind}[{impl}]" for kind in ("linear", "mhla") for impl in impls}
    for grid in ("1x4x8", "2x6x5"):
        for pass_ in ("fwd", "fwd+bwd"):
            got = {r["variant"] for r in rows if r["grid"] == grid and r["pass"] == pass_}
            assert got == expected, (grid, pass_)
    for r in rows:
        assert r["tokens"] == tokens_of(r["grid"])
        assert r["mem_floor_ms"] > 0 and r["flop_floor_ms"] > 0
        assert "skipped" not in r, r  # every path runs on a CPU at these sizes
        assert r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert r["x_mem_floor"] == pytest.approx(r["ms"] / r["mem_floor_ms"])
        assert r["speedup_vs_softmax"] > 0
        if r["impl"] in ("triton", "triton-v1"):
            assert r["speedup_vs_torch"] > 0
        if r["kind"] == "softmax":
            assert r["backend"] in data["meta"]["softmax_backends_available"]
        if r["kind"] == "mhla":
            assert r["blocks"] >= 1 and r["layout"]
    md = (tmp_path / "t.md").read_text()
    assert "| pass | grid | tokens | variant |" in md and f"mhla[{impls[-1]}]" in md


def test_attention_benchmark_skips_and_bad_arguments(tmp_path):
    result = attention.main(
        ["--device", "cpu", "--grids", "2x4x4", "--heads", "1", "--dim", "8", "--passes", "fwd"]
        + ["--max-softmax-tokens", "16", "--warmup", "0", "--repeats", "1", "--no-save"]
    )
    soft = [r for r in result["rows"] if r["kind"] == "softmax"]
    assert soft and all("skipped" in r and "ms" not in r for r in soft)
    assert all(r["speedup_vs_softmax"] is None for r in result["rows"] if "ms" in r)
    with pytest.raises(SystemExit):
        attention.main(["--device", "cpu", "--passes", "bwd", "--no-save"])
    with pytest.raises(ValueError, match="21x30x50"):
        attention.main(["--device", "cpu", "--grids", "21x30", "--no-save"])


def test_wan_sizes_give_the_paper_token_grids():
    assert wan_step.parse_size("81x480x800") == (21, 30, 50)
    assert wan_step.parse_size("81x480x832") == (21, 30, 52)
    with pytest.raises(ValueError, match="4k\\+1"):
        wan_step.parse_size("80x480x800")
    cfg = wan_step.CONFIGS["1.3b"]
    assert (cfg["num_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["ffn_dim"]) == (
        30,
        12,
        128,
        8960,
    )


def test_wan_step_smoke(tmp_path):
    # 2x4x6 has fewer cells than the 7x3x5 blocks on two axes: the MHLA layout shrinks
    argv = ["--device", "cpu", "--config", "tiny", "--layers", "2", "--grids", "2x4x6", "--text-len", "16"]
    argv += ["--warmup", "0", "--repeats", "1", "--steps", "50", "--out-dir", str(tmp_path), "--tag", "w"]
    wan_step.main(argv)
    data = load(tmp_path, "w")
    meta, rows = data["meta"], data["rows"]
    assert meta.keys() >= META_KEYS | {"config", "parameters", "batch_fwd", "batch_fwd_bwd", "grad_ckpt", "steps"}
    assert meta["transformer"]["num_layers"] == 2 and meta["hybrid_mhla_layers"] == [1]
    assert len(rows) == 2 * 4
    for r in rows:
        assert "skipped" not in r, r
        assert r["tokens"] == tokens_of(r["grid"])
        assert r["ms"] > 0 and r["speedup_vs_flash"] > 0
        assert r["batch"] == (2 if r["pass"] == "fwd" else 1)
        if r["variant"] == "flash":
            assert r["speedup_vs_flash"] == 1.0 and r["softmax_backend"]
        if r["variant"] == "mhla":
            assert r["mhla_layers"] == 2 and r["layouts"]
        if r["variant"] == "mhla-hybrid":
            assert r["mhla_layers"] == 1 and r["softmax_backend"]
        if r["pass"] == "fwd":
            assert r["projected_s"] == pytest.approx(r["ms"] * 50 / 1e3)
            assert r["attn_ms"] > 0 and r["attn_calls"] == 2
    assert any("shrunk" in layout for r in rows for layout in r.get("layouts", []))
    md = (tmp_path / "w.md").read_text()
    assert "| pass | size | tokens | variant |" in md and "mhla-hybrid" in md


FAKE_PYTHON = """#!/usr/bin/env bash
# records each call (arguments, and PYTHONWARNINGS once) and answers as told by FAKE_* variables
echo "$*" >>"$FAKE_CALLS"
echo "$PYTHONWARNINGS" >"$FAKE_CALLS.warnings"
case "$*" in
    *benchmarks.check_fused*) [ "${FAKE_FUSED_RC:-0}" -eq 0 ] && echo "fused path OK" || echo "FUSED PATH NOT TAKEN: fake" >&2
        exit "${FAKE_FUSED_RC:-0}" ;;
    *"-m pytest"*) exit "${FAKE_PYTEST_RC:-0}" ;;
esac
exit 0
"""


def run_gpu_script(tmp_path, stages, **env):
    """benchmarks/run_gpu.sh with fake ``python3`` and ``nvidia-smi`` first on PATH: what it would run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\necho fake GPU\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / f"calls_{stages}.txt"
    out = tmp_path / f"out_{stages}"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "FAKE_CALLS": str(calls)}
    full_env.pop("PYTHONWARNINGS", None)
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), stages],
        env={**full_env, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    called = calls.read_text().splitlines() if calls.exists() else []
    return run, [c for c in called if c.startswith("-m ")], (out / "log.txt")


def test_gpu_script_stages_limits_and_loud_fallback(tmp_path):
    script = ROOT / "benchmarks" / "run_gpu.sh"
    # a mistyped stage stops the script before anything runs
    run = subprocess.run(
        ["bash", str(script), "tests,attn"], env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True
    )
    assert run.returncode == 2 and "unknown stage 'attn'" in run.stderr

    # the kernel tests are a stage of their own: only tests/mhla/test_triton.py, within their own limit
    run, modules, log = run_gpu_script(tmp_path, "kernels")
    assert run.returncode == 0, run.stdout + run.stderr
    assert modules == ["-m pytest -q -m gpu -p no:cacheprovider tests/mhla/test_triton.py"]
    kernels_s = re.search(r'KERNELS_S="\$\{KERNELS_S:-(\d+)\}"', script.read_text()).group(1)
    assert f"=== kernels (limit {kernels_s}s" in log.read_text()  # the script's own default for the stage

    # the other GPU tests leave test_triton.py out; a failing stage makes the script fail
    run, modules, _ = run_gpu_script(tmp_path, "tests", FAKE_PYTEST_RC="1")
    assert run.returncode == 1 and len(modules) == 1
    assert "--ignore=tests/mhla/test_triton.py tests" in modules[0] and "-m gpu" in modules[0]

    # timing stages run after the fused-path check, within what is left of the budget
    run, modules, log = run_gpu_script(tmp_path, "wan,profile", BUDGET_S="200")
    assert run.returncode == 0, run.stdout + run.stderr
    assert [m.split()[1] for m in modules] == [
        "benchmarks.check_fused",
        "benchmarks.wan_step",
        "benchmarks.profile_mhla",
    ]
    text = log.read_text()
    # its 500 s cut to what is left of the 200 s budget, less the end's reserve (FINISH_S 30, KILL_S 5)
    limit = re.search(r"=== wan \(limit (\d+)s", text)
    assert limit and 100 < int(limit.group(1)) <= 200 - 30 - 5, text[-2000:]
    assert "=== profile (limit 150s" in text  # its own limit, less than what is left

    # impl="auto" on the PyTorch path: loud, nothing timed, exit 3
    run, modules, log = run_gpu_script(tmp_path, "wan,attention", FAKE_FUSED_RC="1")
    assert run.returncode == 3
    assert [m.split()[1] for m in modules] == ["benchmarks.check_fused"]  # checked once, nothing timed
    assert "FUSED PATH NOT TAKEN" in run.stdout and "FUSED PATH NOT TAKEN" in log.read_text()


def test_gpu_script_turns_the_fallback_warning_into_an_error(tmp_path):
    # the PYTHONWARNINGS the script exports makes ops._run_fused's fallback warning raise in a real Python
    run_gpu_script(tmp_path, "kernels")
    warnings_env = (tmp_path / "calls_kernels.txt.warnings").read_text().strip()
    assert warnings_env.startswith("error:")
    code = "import warnings; warnings.warn('MHLA Triton kernels failed (RuntimeError: x); using the PyTorch path')"
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONWARNINGS": warnings_env}, capture_output=True, text=True
    )
    assert run.returncode != 0 and "UserWarning: MHLA Triton kernels failed" in run.stderr
    other = subprocess.run(
        [sys.executable, "-c", "import warnings; warnings.warn('something else')"],
        env={**os.environ, "PYTHONWARNINGS": warnings_env},
        capture_output=True,
        text=True,
    )
    assert other.returncode == 0


def test_check_fused_sees_the_pytorch_path():
    # impl="auto" on CPU tensors runs the PyTorch path: the check must say so; forced to the kernels
    # (the interpreter on a CPU) it passes
    from benchmarks.check_fused import check

    problems = check("cpu", "auto")
    assert problems and all("PyTorch path" in p for p in problems), problems
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
        assert check("cpu", "triton") == []


def test_render_marks_a_partial_run(tmp_path):
    from benchmarks import render
    from benchmarks.common import write_partial

    result = attention.main(
        ["--device", "cpu", "--grids", "1x4x4", "--heads", "1", "--dim", "8", "--passes", "fwd", "--no-save"]
        + ["--warmup", "0", "--repeats", "1"]
    )
    rows = result["rows"][:2]
    write_partial(tmp_path, "cut", result["meta"], rows)
    render.render(tmp_path / "cut.json")
    assert (tmp_path / "cut.md").read_text().startswith("PARTIAL RUN: stopped after 2 rows.")
    assert json.loads((tmp_path / "cut.json").read_text())["meta"]["complete"] is False
    assert (tmp_path / "cut.png").exists()


@pytest.mark.gpu
def test_benchmarks_on_gpu(tmp_path, monkeypatch):
    """The GPU paths of both scripts (bf16, fused kernels, CUDA events, peak memory) at small sizes, with
    the fixed launch settings: tuning compiles every candidate, which the GPU test stage cannot afford
    (tests/mhla/test_triton.py tunes one case)."""
    from mhla import triton_ops

    monkeypatch.setattr(triton_ops, "AUTOTUNE", False)
    result = attention.main(
        ["--grids", "4x16x16", "--heads", "2", "--dim", "64", "--warmup", "1", "--repeats", "2"]
        + ["--out-dir", str(tmp_path), "--tag", "a"]
    )
    variants = {r["variant"] for r in result["rows"]}
    assert {"mhla[torch]", "mhla[triton]", "mhla[triton-v1]", "linear[torch]", "linear[triton]"} <= variants
    for r in result["rows"]:
        assert "skipped" not in r, r
        assert r["ms"] > 0 and r["peak_mib"] is not None
    assert isinstance(result["meta"]["triton_launches"], dict)  # nothing tuned here (AUTOTUNE off)
    wan = wan_step.main(
        ["--config", "tiny", "--layers", "2", "--grids", "3x8x8", "--warmup", "1", "--repeats", "2"]
        + ["--out-dir", str(tmp_path), "--tag", "w"]
    )
    assert wan["meta"]["dtype"] == "bf16"
    for r in wan["rows"]:
        assert "skipped" not in r, r
        assert r["ms"] > 0 and r["peak_total_mib"] > 0
    from benchmarks import profile_mhla

    prof = profile_mhla.main(
        ["--grid", "4x16x16", "--heads", "2", "--dim", "64", "--iters", "2", "--warmup", "1"]
        + ["--out-dir", str(tmp_path)]
    )
    for version in ("v2", "v1"):  # the compiled kernels are found in the profile by their names
        found = {r["entry"] for r in prof["rows"] if r["version"] == version and r["pass"] == "fwd+bwd"}
        assert set(profile_mhla.KERNELS) <= found, found


@pytest.mark.parametrize("dim", [128, 24])  # Wan's head_dim, and one that is no power of two
def test_kernel_resources_compiles_for_h100(tmp_path, dim):
    """The fused kernels compile for sm_90a here, with no GPU (Triton's ahead-of-time compile and its
    own ptxas): catches what the interpreter cannot, such as code the GPU compiler rejects or shared
    memory past an SM's. The register report is parsed for every kernel."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from benchmarks.kernel_resources import compile_support

    reason = compile_support()
    if reason:  # a Triton without the ahead-of-time API or a runnable ptxas: nothing to check here
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["--quick", "--grid", "3x8x10", "--heads", "2", "--dim", str(dim), "--out-dir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_resources", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "kernel_resources_sm90a_3x8x10_bf16.json").read_text())
    assert {r["kernel"] for r in data["rows"]} == {"summaries", "output", "backward_query", "backward_key"}
    for r in data["rows"]:
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] > 0, r
        assert r["programs_per_sm"] >= 1, r  # the v1 launch setting fits on an SM
    md = (tmp_path / "kernel_resources_sm90a_3x8x10_bf16.md").read_text()
    assert "| backward_key | v2 | bf16 | bf16 | 64 | 4 | 2 |" in md


def test_kernel_resources_occupancy_arithmetic():
    from benchmarks.kernel_resources import occupancy

    assert occupancy(255, 72 * 1024, 4) == 2  # 256 registers x 32 lanes x 4 warps = half the register file
    assert occupancy(62, 88 * 1024, 8) == 2  # shared memory binds: 228 KB / (88 + 1) KB
    assert occupancy(32, 1024, 4) == 16  # 64 warps per SM at most
    assert occupancy(255, 240 * 1024, 8) == 0  # more shared memory than an SM has


def test_profile_mhla_smoke(tmp_path):
    if not (os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None):
        pytest.skip("the fused kernels run on a CPU only in Triton's interpreter")
    from benchmarks import profile_mhla

    argv = ["--device", "cpu", "--grid", "2x4x6", "--heads", "2", "--dim", "16", "--versions", "v2"]
    result = profile_mhla.main(argv + ["--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path)])
    rows = result["rows"]
    for pass_, kernels in (("fwd", {"summaries", "output"}), ("fwd+bwd", set(profile_mhla.KERNELS))):
        sel = [r for r in rows if r["pass"] == pass_]
        assert kernels <= {r["entry"] for r in sel}, pass_
        for r in sel:
            if r["entry"] in kernels:
                assert r["us"] > 0 and r["calls"] == 1 and r["bytes"] > 0
        total = next(r for r in sel if r["entry"] == "TOTAL")
        assert total["us"] == pytest.approx(sum(r["us"] for r in sel if r["entry"] != "TOTAL"))
        assert total["floor_us"] > 0
    md = (tmp_path / "profile_mhla_cpu_2x4x6.md").read_text()
    assert "| v2 | fwd+bwd | backward_query | 1 |" in md and "**total**" in md


def test_profile_mhla_kernel_bytes():
    from benchmarks.profile_mhla import kernel_bytes

    # Wan's 21x30x50 case, batch 1, 12 heads x 128, bf16 in and out, bf16 summaries (v2), no normalizer
    wan = dict(b=1, n=31_500, h=12, d=128, e=128, m=105, size_in=2, size_sum=2, size_out=2, normalize=False)
    x = 31_500 * 12 * 128 * 2  # one of q, k, v, out: 96.8 MB
    summaries = 12 * 105 * 128 * 128 * 2  # 41.3 MB
    rope = 31_500 * 128 * 4  # the two half-width float32 tables
    # no normalizer: no z sums written (the summary kernel skips them)
    assert kernel_bytes("summaries", rope_half=True, **wan) == 2 * x + rope + summaries
    assert kernel_bytes("summaries", rope_half=True, **{**wan, "normalize": True}) == (
        2 * x + rope + summaries + 12 * 105 * 128 * 4
    )
    assert kernel_bytes("output", rope_half=True, **wan) == 2 * x + rope + summaries
    assert kernel_bytes("output", rope_half=True, size_rope=2, **wan) == 2 * x + rope // 2 + summaries  # bf16
    assert kernel_bytes("output", rope_half=False, **wan) == 2 * x + 2 * rope + summaries
    assert kernel_bytes("backward_key", rope_half=True, **wan) == 4 * x + rope + summaries


def test_attention_min_bytes_counts_the_tensors_once():
    from benchmarks.common import attention_min_bytes

    x = 31_500 * 12 * 128  # one of q, k, v at 21x30x50, 12 heads x 128 (benchmarks/NOTES.md)
    assert attention_min_bytes(x, 2, 2, backward=False) == 4 * x * 2  # 387 MB: q, k, v, out
    assert attention_min_bytes(x, 2, 2, backward=True) == 11 * x * 2  # 1,065 MB: + q, k, v, dO, dq, dk, dv
    assert attention_min_bytes(x, 2, 4, backward=True) == x * (9 * 2 + 2 * 4)  # float32 out and dO


def test_app_compare_smoke(tmp_path):
    """The app's Compare end to end through app.compare, on the tiny random model: a table and a JSON record."""
    from benchmarks import app_compare

    out = tmp_path / "app_compare"
    assert (
        app_compare.main(["--model", "tiny-random", "--requests", "2", "--steps", "2", "--levers", "--out", str(out)])
        == 0
    )
    record = json.loads(out.with_suffix(".json").read_text())
    assert [r["request"] for r in record["requests"]] == [1, 2]
    for row in record["requests"]:
        assert set(row["variants"]) == {"flash", "linear", "mhla", "mhla-hybrid"}
        assert row["first_video_s"] <= row["wall_s"] and row["cpu_s"] > 0
        assert not row["interleaved"]  # the tiny model's variants share one transformer
        mhla = row["variants"]["mhla"]
        assert mhla["speedup"] > 0 and mhla["ci"][0] <= mhla["speedup"] <= mhla["ci"][1]
        assert row["variants"]["flash"]["speedup"] is None
    levers = record["decode_levers"]
    assert set(levers["seconds_median"]) == {"float32", "float32 channels-last", "bfloat16"}
    md = out.with_suffix(".md").read_text()
    assert "| 2 | mhla |" in md and "VAE decode of one video" in md


def test_video_checks_benchmark_times_every_check_and_refuses_bad_sizes(tmp_path):
    from benchmarks import video_checks

    out = tmp_path / "vc"
    result = video_checks.main(["--sizes", "3x16x24,2x8x8", "--repeats", "1", "--out", str(out)])
    assert [(r["size"], r["check"]) for r in result["rows"]] == [
        (size, check) for size in ("3x16x24", "2x8x8") for check in ("degenerate", "psnr", "ssim")
    ]
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["meta"]["complete"] and len(saved["rows"]) == 6
    with pytest.raises(SystemExit, match="FRAMESxHEIGHTxWIDTH"):
        video_checks.main(["--sizes", "81x480", "--out", str(out)])


@pytest.mark.slow  # compiles every variant (aot_eager on a CPU)
def test_wan_step_compiled_timings_are_steady_state(tmp_path, monkeypatch):
    """A compiled step's timed runs compile nothing (else they time the compiler): counted per row, flagged in
    the table, and the script's exit status fails. Every variant, switching processors between timed runs."""
    import torch

    monkeypatch.setenv("MHLA_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    argv = ["--device", "cpu", "--config", "tiny", "--layers", "2", "--grids", "2x4x6", "--text-len", "16"]
    argv += ["--passes", "fwd", "--compile", "blocks", "--warmup", "1", "--repeats", "2"]
    result = wan_step.main([*argv, "--out-dir", str(tmp_path), "--tag", "c"])
    assert len(result["rows"]) == 4
    assert all(r["graphs_compiled_while_timed"] == 0 for r in result["rows"]), result["rows"]
    assert wan_step.recompiled(result["rows"]) == []
    flagged = [{**result["rows"][0], "graphs_compiled_while_timed": 3}]
    assert wan_step.recompiled(flagged) == [f"{flagged[0]['variant']} fwd 2x4x6 (3)"]
    assert "RECOMPILED x3 while timed" in wan_step.markdown(flagged, result["meta"])


def test_video_checks_keeps_the_callers_thread_count(tmp_path):
    import torch

    from benchmarks import video_checks

    before = torch.get_num_threads()
    video_checks.main(["--sizes", "2x8x8", "--repeats", "1", "--threads", "1", "--out", str(tmp_path / "v")])
    assert torch.get_num_threads() == before

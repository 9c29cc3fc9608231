import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (on the CPU); it must be chosen
# before the kernels are defined, i.e. before mhla.triton_ops is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that take more than a few seconds on a 2-core CPU (`pytest -m "not slow"` runs the rest): whole
# modules that start processes, compile or interpret kernels, or drive a browser, and single tests elsewhere.
SLOW_MODULES = ("test_training.py", "test_triton.py", "test_app_e2e.py", "test_builtin.py", "test_benchmarks.py")
SLOW_TESTS = (
    "test_analyse.py::test_real_clips_score_perfectly",
    "test_data.py::test_precompute_leaves_unreadable_videos_out",
    "test_pipeline.py::test_cli_writes_video_and_prints_timing",
    "test_pipeline.py::test_all_variants_generate_playable_mp4",
    "test_pipeline_attention.py::test_flash_matches_diffusers_processor",
    "test_import_official.py::test_hybrid_import_loads_and_generates",
    "test_reliability.py::test_latents_that_turn_non_finite",
    "test_app.py::test_a_variant_failing_unexpectedly",
    "test_app.py::test_compare_runs_every_variant",
    "test_app.py::test_compare_reports_a_failing_variant",
    "test_app_inputs.py::test_through_the_api",
    "test_errors.py::test_sigterm_during_a_video_write",
    "test_boundary.py::test_a_lock_is_released_on_any_exit",
    "test_boundary.py::test_a_resume_with_another_architecture",
    "test_boundary.py::test_sigterm_while_saving",
    "test_cli_boundary.py::test_a_failing_video_writer",
)


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        where = item.nodeid.split("/")[-1]
        if where.split("::")[0] in SLOW_MODULES or any(where.startswith(t) for t in SLOW_TESTS):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A fresh, randomly seeded generator per test: inputs are new draws every run.

    The seed is printed on failure (pytest shows captured stdout) so a failure can be replayed
    with MHLA_TEST_SEED.
    """
    seed = int(os.environ.get("MHLA_TEST_SEED", torch.seed() % (2**31)))
    print(f"MHLA_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)

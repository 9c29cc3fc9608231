import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (on the CPU); it must be chosen
# before the kernels are defined, i.e. before mhla.triton_ops is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that need more than a second or so on a 2-core CPU (`pytest -m "not slow"` runs the rest, in under a
# minute; `.ci/run` runs both): whole modules that start processes, compile or interpret kernels, drive a
# browser or load the built-in model, and single tests elsewhere (prefixes of node ids). What stays fast still
# checks every path of the operator against the straightforward one (tests/mhla/test_naive.py), the block rule,
# the request checks and the CLI's preflight; the slow ones generate videos, gradcheck and sweep chunk budgets.
SLOW_MODULES = ("test_training.py", "test_triton.py", "test_app_e2e.py", "test_builtin.py", "test_benchmarks.py")
SLOW_TESTS = (
    # start a process, write and read back a whole model directory, or run the precompute CLI
    "test_analyse.py::test_real_clips_score_perfectly",
    "test_data.py::test_precompute_leaves_unreadable_videos_out",
    "test_pipeline.py::test_cli_writes_video_and_prints_timing",
    "test_pipeline.py::test_local_model_dir_round_trip",
    "test_import_official.py::test_hybrid_import_loads_and_generates",
    "test_import_official.py::test_fused_kernels_take_signed_unnormalised_mixing",  # Triton's interpreter
    "test_latent_stats.py::test_latent_stats_runs_on_the_builtin_model",
    # generate videos with the tiny model (a few denoising steps through 30 layers and the VAE)
    "test_pipeline.py::test_all_variants_generate_playable_mp4",
    "test_pipeline.py::test_same_seed_same_video_and_other_seed_differs",
    "test_pipeline.py::test_uneven_grid_runs",
    "test_pipeline.py::test_few_frames_shrink_the_layout",
    "test_pipeline.py::test_tiny_model_is_deterministic",
    "test_guidance_interval.py::test_interval_matches_a_plain_loop",
    "test_guidance_interval.py::test_interval_ends",
    "test_guidance_interval.py::test_model_default_applies_and_an_argument_overrides_it",
    "test_pipeline_attention.py::test_flash_matches_diffusers_processor",
    "test_reliability.py::test_latents_that_turn_non_finite",
    "test_app.py::test_presets_name_the_tokens_and_the_m_that_runs",
    "test_app.py::test_compare_",
    "test_app.py::test_stop_ends_the_run_after_the_finished_variants",
    "test_app.py::test_after_stop_the_run_streams_nothing",
    "test_app.py::test_a_variant_failing_unexpectedly",
    "test_app.py::test_compare_runs_every_variant",
    "test_app.py::test_compare_reports_a_failing_variant",
    "test_app_inputs.py::test_through_the_api",
    "test_errors.py::test_sigterm_during_a_video_write",
    "test_boundary.py::test_a_lock_is_released_on_any_exit",
    "test_boundary.py::test_a_resume_with_another_architecture",
    "test_boundary.py::test_sigterm_while_saving",
    "test_cli_boundary.py::test_a_failing_video_writer",
    "test_cli_boundary.py::test_a_full_disk_fails_generate",
    "test_app.py::test_benchmark_measures_both_levels",
    "test_app.py::test_page_api_has_named_outputs",  # builds the Gradio page
    "test_app.py::test_the_launcher_gives_the_builtin_model_its_analyser",  # loads the built-in model's variants
    # numerical gradient checks (float64 finite differences over every input)
    "test_ops.py::test_gradcheck_",
    "test_ops_chunked.py::test_gradcheck_float64",
    "test_softmax.py::test_softmax_gradcheck",
    # the smallest chunk budgets: one token-head (or seven) per chunk, thousands of chunks
    "test_ops_chunked.py::test_forward_and_gradients_match_reference[1-",
    "test_ops_chunked.py::test_elu_per_head_mixing_and_fused_projection_views[1-",
    "test_ops_chunked.py::test_elu_per_head_mixing_and_fused_projection_views[7-",
    "test_ops_chunked.py::test_chunks_cover_every_token_and_head_once[3-1-grid4-blocks4]",  # 21x30x52 tokens
    # the VAE ceiling trains nothing but encodes and decodes every clip
    "test_analyse.py::test_vae_ceiling_is_perfect_on_real_clips",
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


@pytest.fixture(scope="session")
def tiny_components():
    """The tiny random-weight model (``tiny-random``), loaded once per session and shared by the tests that
    generate with it; use it through a fixture that puts it back to ``flash`` (conversions only add parameters)."""
    from pipelines.loading import load_components

    return load_components("tiny-random", dtype="float32", device="cpu")

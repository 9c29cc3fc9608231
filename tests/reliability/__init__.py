"""Issue 53 (7): the project's fault-injection tests as one suite, with a table of probe -> result.

:data:`PROBES` names them by kind: a full disk, a read-only folder, a signal or a kill during a write, a writer that
fails or writes short, a corrupt input, an input refused at the app's door, load, a soak, a runaway test. They stay
in their own modules; ``tests/conftest.py`` gives each the marker ``reliability`` (``pytest -m reliability`` selects
them) and prints the table at the end of any session that ran some of them. They run in both tiers as marked:

- ``python -m pytest -m slow`` runs the slow ones, and ``tests/reliability/test_suite.py`` (slow) runs the fast ones
  as one suite in a subprocess: the end of that session's output is the table of all of them (``.ci/run`` runs the
  slow tier as two sessions, ``-m "slow and not serial"`` in two processes, then the load and soak probes alone,
  ``-m "slow and serial"``: each ends with the table of its own);
- ``python -m tests.reliability [--tier fast|slow|all] [--markdown PATH]`` runs them alone and prints the table
  (exit 0 only when every probe passed or was skipped with its reason, and none is missing).

A test added for a new fault belongs in :data:`PROBES` (a node id without parameters covers every parametrization);
a name here that no longer exists is reported as missing, and the suite fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT_ENV = "MHLA_RELIABILITY_OUT"  # set by the runner: the session writes its rows (JSON) there, missing ones too
# the soak's length (tests/app/test_soak.py): the runner soaks FULL_SOAK requests; pytest -m slow (CI) a shorter soak
# that makes the same checks against scaled caps, unless this is set
SOAK_ENV = "MHLA_SOAK_REQUESTS"
FULL_SOAK = 100

PROBES: dict[str, list[str]] = {
    "full disk": [
        "tests/common/test_errors.py::test_a_full_disk_never_replaces_an_earlier_video_gif_or_png",
        "tests/common/test_errors.py::test_writers_that_report_a_full_disk_their_own_way_are_exit_4",
        "tests/common/test_errors.py::test_every_other_writer_on_a_full_disk_is_exit_4_and_keeps_what_was_there",
        "tests/pipelines/test_cli_boundary.py::test_a_full_disk_fails_generate_with_exit_4_and_keeps_the_earlier_video",
        "tests/pipelines/test_import_official.py::test_a_dangling_symlink_as_out_is_followed_and_a_full_disk_is_exit_4",
        "tests/training/test_boundary.py::test_a_full_disk_while_saving_a_checkpoint_is_exit_4_with_earlier_ones_intact",
        "tests/training/test_training.py::test_a_full_disk_while_saving_ends_with_a_message_and_keeps_earlier_checkpoints",
    ],
    "read-only folder": [
        "tests/reliability/test_read_only.py::test_generate_into_a_read_only_folder_is_refused_before_the_model_loads",
        "tests/reliability/test_read_only.py::test_a_run_dir_or_a_cache_in_a_read_only_folder_is_refused_by_name",
        "tests/reliability/test_read_only.py::test_a_video_written_into_a_read_only_folder_fails_naming_it_and_keeps_the_earlier_one",
    ],
    "signal or kill during a write": [
        "tests/common/test_errors.py::test_sigterm_during_a_video_write_keeps_the_earlier_video",
        "tests/training/test_boundary.py::test_sigterm_while_saving_a_checkpoint_exits_143_and_leaves_no_half_written_folder",
        "tests/training/test_boundary.py::test_a_lock_is_released_on_any_exit_and_a_dead_holders_lock_is_stale",
        "tests/training/test_training.py::test_kill_and_resume_gives_the_same_parameters",
        "tests/training/test_training.py::test_precompute_in_batches_writes_what_one_by_one_writes_and_an_interrupted_run_fills_only_the_gaps",
        "tests/training/test_killed_anywhere.py::test_a_run_killed_anywhere_twenty_times_ends_as_an_uninterrupted_one",
        "tests/training/test_killed_anywhere.py::test_the_next_run_removes_what_killed_writers_left_and_nothing_else",
        "tests/app/test_start.py::test_the_launcher_serves_before_the_warm_up_and_stops_cleanly",
        "tests/benchmarks/test_run_gpu.py::test_signal_runs_the_exit_trap",
    ],
    "failed or short write": [
        "tests/common/test_errors.py::test_a_failed_writer_leaves_the_earlier_file_and_no_temporary",
        "tests/common/test_errors.py::test_a_writer_that_writes_nothing_is_an_error_not_a_success",
        "tests/common/test_errors.py::test_a_writer_that_writes_short_without_raising_fails_with_exit_4",
        "tests/common/test_errors.py::test_atomic_dir_replaces_a_folder_whole_or_not_at_all",
        "tests/pipelines/test_cli_boundary.py::test_a_failing_video_writer_is_an_error_never_wrote",
        "tests/pipelines/test_import_official.py::test_failed_write_leaves_no_half_model",
    ],
    "corrupt input": [
        "tests/training/test_boundary.py::test_metrics_rows_half_written_or_broken_are_named",
        "tests/training/test_boundary.py::test_a_state_file_that_is_a_pickle_or_garbage_is_named",
        "tests/training/test_boundary.py::test_a_resume_names_a_pickled_state_and_a_damaged_metrics_log",
        "tests/training/test_training.py::test_damaged_checkpoints_are_skipped_and_the_run_ends_as_an_uninterrupted_one",
        "tests/training/test_data.py::test_bad_videos_are_skipped_counted_and_the_run_continues",
        "tests/training/test_data.py::test_precompute_leaves_unreadable_videos_out_instead_of_repeating_a_good_one",
        "tests/pipelines/test_reliability.py::test_model_and_config_files_that_are_not_what_they_should_be_are_named",
        "tests/pipelines/test_reliability.py::test_non_finite_or_integer_weights_are_refused_at_load",
        "tests/pipelines/test_reliability.py::test_unreadable_weight_files_are_named",
        "tests/pipelines/test_import_official.py::test_unreadable_checkpoint_files_are_named",
        "tests/common/test_errors.py::test_a_pickle_refused_by_weights_only_is_a_known_failure",
        "tests/training/test_cache_checksums.py::test_a_damaged_cache_file_is_refused_naming_it_never_read_as_garbage",
        "tests/training/test_cache_checksums.py::test_a_cache_written_before_checksums_still_loads_with_a_note",
        "tests/training/test_cache_checksums.py::test_a_damaged_settings_record_is_named_before_precompute_loads_a_model",
        "tests/training/test_cache_checksums.py::test_a_checkpoint_with_a_flipped_weight_file_or_a_damaged_manifest_is_skipped_naming_it",
        "tests/training/test_cache_checksums.py::test_precompute_writes_a_damaged_entry_again_and_training_refuses_one_by_name",
    ],
    "refused input at the app": [
        "tests/app/test_app_uploads.py::test_a_path_outside_the_upload_folder_is_refused_unread",
        "tests/app/test_app_uploads.py::test_the_api_refuses_a_server_path_and_copies_nothing",
        "tests/app/test_app_inputs.py::test_a_refused_input_is_one_log_line_and_no_traceback",
        "tests/app/test_app_inputs.py::test_through_the_api_a_list_prompt_and_fractional_repeats_are_refused_in_one_log_line",
    ],
    "load": [
        "tests/app/test_load.py::test_concurrent_clients_are_each_served_their_own_result_or_told_their_place",
        "tests/app/test_load.py::test_a_refused_or_stopped_request_leaves_no_phantom_place_in_line",
    ],
    "soak": [
        "tests/app/test_soak.py::test_a_hundred_requests_leave_no_memory_handles_or_files_behind",
    ],
    "runaway test": [
        "tests/common/test_suite_guard.py::test_a_runaway_test_fails_by_name_and_the_run_goes_on",
    ],
}  # fmt: skip

_KIND = {nodeid: kind for kind, ids in PROBES.items() for nodeid in ids}
SUITE_ROWS: list[dict] = []  # the fast probes' rows, run as one suite by tests/reliability/test_suite.py
# test_suite.py hands its rows to the session as this user property of its report: the report reaches the process that
# prints the table also when the test ran in one of pytest-xdist's workers (.ci/run's slow tier runs in two)
SUITE_PROPERTY = "reliability suite rows"


def probe_of(nodeid: str) -> str | None:
    """The probe kind of a test (``path::name[params]``), None when it is not one."""
    return _KIND.get(nodeid.split("[", 1)[0])


def files() -> list[str]:
    """The probes' modules, as paths from the repository's root."""
    return sorted({nodeid.split("::", 1)[0] for nodeid in _KIND})


class Recorder:
    """A pytest plugin: each probe's result (``passed``, ``failed``, ``error``, ``skipped`` with the reason), and the
    probes named in :data:`PROBES` that were never collected (``missing``: checked when the session collected every
    probe module, as the runner does)."""

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.collected: set[str] = set()

    def pytest_itemcollected(self, item):
        self.collected.add(item.nodeid.split("[", 1)[0])

    def pytest_runtest_logreport(self, report):
        for name, rows in getattr(report, "user_properties", ()):
            if name == SUITE_PROPERTY and report.when == "call":
                SUITE_ROWS.extend(rows)
        kind = probe_of(report.nodeid)
        if kind is None:
            return
        row = self.rows.setdefault(
            report.nodeid, {"probe": kind, "test": report.nodeid, "result": "passed", "seconds": 0.0, "why": ""}
        )
        row["seconds"] = round(row["seconds"] + report.duration, 2)
        if report.failed:
            row["result"] = "failed" if report.when == "call" else f"error ({report.when})"
            row["why"] = _first_line(report.longreprtext)
        elif report.skipped and row["result"] == "passed":
            row["result"] = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            row["why"] = reason.removeprefix("Skipped: ")

    def missing(self) -> list[dict]:
        return [
            {"probe": kind, "test": nodeid, "result": "missing", "seconds": 0.0, "why": "no such test"}
            for nodeid, kind in _KIND.items()
            if nodeid not in self.collected
        ]

    def pytest_sessionfinish(self, session):
        out = os.environ.get(OUT_ENV)
        if out:
            rows = [*self.rows.values(), *self.missing()]
            Path(out).write_text(json.dumps(rows, indent=1) + "\n")


def _first_line(text: str) -> str:
    """A failure's first ``E`` line (else its last line), cut to 160 characters."""
    lines = [x.strip() for x in text.splitlines()]
    errors = [x[1:].strip() for x in lines if x.startswith("E ")]
    return (errors[0] if errors else next((x for x in reversed(lines) if x), ""))[:160]


def ok(row: dict) -> bool:
    return row["result"] in ("passed", "skipped")


def table(rows: list[dict]) -> str:
    """The summary: one line per probe kind (passed of run, skipped, failed), then one per test that did not
    pass, then one per test."""
    if not rows:
        return "no reliability probe ran"
    kinds = [k for k in PROBES if any(r["probe"] == k for r in rows)]
    width = max(len("probe"), *(len(k) for k in kinds))
    lines = [f"{'probe':<{width}}  result", f"{'-' * width}  {'-' * 40}"]
    for kind in kinds:
        mine = [r for r in rows if r["probe"] == kind]
        passed = sum(r["result"] == "passed" for r in mine)
        skipped = sum(r["result"] == "skipped" for r in mine)
        bad = len(mine) - passed - skipped
        verdict = "PASS" if not bad else "FAIL"
        lines.append(
            f"{kind:<{width}}  {verdict}: {passed} passed"
            + (f", {skipped} skipped" if skipped else "")
            + (f", {bad} failed" if bad else "")
            + f" ({sum(r['seconds'] for r in mine):.0f} s)"
        )
    lines.append("")
    for r in sorted(rows, key=lambda r: (list(PROBES).index(r["probe"]), r["test"])):
        name = r["test"].split("::", 1)[1]
        mark = {"passed": "pass", "skipped": "skip"}.get(r["result"], r["result"].upper())
        lines.append(f"  {mark:<8} {r['probe']:<{width}}  {name}" + (f"  -- {r['why']}" if r["why"] else ""))
    return "\n".join(lines)

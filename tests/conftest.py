import os
import signal
import threading

# pytest-xdist's workers (.ci/run runs the slow tier in two on a 2-core CPU) share the cores: one thread each, set
# before torch is imported (their subprocesses inherit it), instead of two threads each spinning against the other's
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter (on the CPU); it must be chosen
# before the kernels are defined, i.e. before mhla.triton_ops is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    from tests.reliability import probe_of

    for item in items:  # the fault-injection probes (tests/reliability/__init__.py): selected by -m reliability
        kind = probe_of(item.nodeid)
        if kind is not None:
            item.add_marker(pytest.mark.reliability(kind))
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


# ---- a runaway test fails by name instead of taking the machine down -------------------------------------------
# Time: pytest-timeout (pyproject.toml's `timeout`) fails a test that runs past it and the run goes on. Memory: a
# watchdog thread reads this process's resident size; past MHLA_TEST_MAX_RSS_GB (default: 60% of the machine's
# memory) it interrupts the main thread with a MemoryError that names the test, so the test fails, its frames
# unwind and free what they held, and pytest prints its summary, where the kernel's OOM killer would end the run
# with no word of which test it was.
_current_test = {"name": None}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_limit_bytes() -> int:
    if "MHLA_TEST_MAX_RSS_GB" in os.environ:
        return int(float(os.environ["MHLA_TEST_MAX_RSS_GB"]) * 2**30)
    return int(0.6 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class TestMemoryLimit(MemoryError):
    """The watchdog's verdict on the running test."""


def _on_limit(signum, frame):
    raise TestMemoryLimit(
        f"{_current_test['name']} went past the suite's memory limit ({_memory_limit_bytes() / 2**30:.1f} GiB "
        f"resident; MHLA_TEST_MAX_RSS_GB): stopped here so the run goes on"
    )


def _watch(limit: int, main_id: int) -> None:
    while True:
        threading.Event().wait(0.25)
        if _current_test["name"] is not None and _rss_bytes() > limit:
            signal.pthread_kill(main_id, signal.SIGUSR2)
            threading.Event().wait(5.0)  # one interruption at a time: let the test unwind


def pytest_configure(config):
    from tests.reliability import Recorder

    config.pluginmanager.register(Recorder(), "reliability-recorder")  # the probes' table, at the end of the session
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): no tracked file may change
        from tests.tree_guard import TreeGuard

        config.pluginmanager.register(TreeGuard(), "tree-guard")
    if not os.path.exists("/proc/self/statm") or threading.current_thread() is not threading.main_thread():
        return  # the guard needs Linux's /proc and the main thread's signal handler
    signal.signal(signal.SIGUSR2, _on_limit)
    threading.Thread(target=_watch, args=(_memory_limit_bytes(), threading.main_thread().ident), daemon=True).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_test["name"] = item.nodeid
    try:
        yield
    finally:
        _current_test["name"] = None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The fault-injection probes' table (tests/reliability) when the session ran some of them, the fast ones run as
    one suite by tests/reliability/test_suite.py included."""
    from tests.reliability import OUT_ENV, SUITE_ROWS, table

    recorder = config.pluginmanager.get_plugin("reliability-recorder")
    rows = [*SUITE_ROWS, *(recorder.rows.values() if recorder else [])]
    if recorder is not None and os.environ.get(OUT_ENV):
        rows += recorder.missing()  # the runner collected every probe module: a name not found is missing
    if rows:
        terminalreporter.write_sep("=", "reliability probes (tests/reliability)")
        for line in table(rows).splitlines():
            terminalreporter.write_line(line)

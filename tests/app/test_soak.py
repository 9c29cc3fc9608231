"""Issue 53 (3): the app left up. 100 requests one after another on the built-in model over HTTP, as browser tabs
make them (the page served in this process on 127.0.0.1, :mod:`tests.app.served`), each with its own prompt and
seed: the process's resident memory after request 100 is within 10% of that after request 10 (both read after
``malloc_trim``: the plain figures, reported too, move several % either way with glibc's arenas), it holds no more file
handles (``/proc/self/fd``), no temporary file is left behind, and the folders of results stay within their
documented caps:

- the app's run folders (``<out_root>/compare``): the newest :data:`app.compare.KEEP_RUNS`, each holding the run's
  videos only; the stored examples' copies (``<out_root>/stored``) as they were at the start;
- gradio's cache (``GRADIO_TEMP_DIR``): one copy of each video a page returned, nothing else (``delete_cache``
  drops copies older than a day, hourly: none is that old here);
- the system's temporary folder (a private one for this test, holding the app's output folder and gradio's cache as
  ``run_app.py`` has them): nothing else in it;
- permalinks: the last 64 finished requests are remembered, and a link opens with a run's results only while its
  videos are kept; an older link restores the form (it never shows a video that is gone);
- gradio's page state per tab (``SESSIONS_KEPT``, app/ui.py): the last 64 tabs', and a tab left open holds the
  page's components once each, not one more per run.

Every 4th request comes from a tab left open, the others each from a new tab (gradio keeps a page state per tab).
One variant (mhla) at the model's size (9x64x80) and guidance, 4 denoising steps instead of 20: minutes, not an
hour, on a busy 2-core CPU. The figures go to ``benchmarks/results/app_soak_<device>.{json,md}`` (reported, not
asserted, except the 10% memory bound).

How many requests: ``MHLA_SOAK_REQUESTS`` (:data:`tests.reliability.SOAK_ENV`), 100 in the reliability suite
(``python -m tests.reliability`` sets it) and 40 otherwise (``pytest -m slow``, CI: about a minute less on a 2-core
CPU). The shorter soak makes every check the full one makes, with the caps scaled so that it runs past each of them as
the full soak does (the newest 8 run folders instead of 20, the last 16 tabs' page state instead of 64: the pruning
and the eviction are the same code whatever the cap; that ``run_app.py`` launches with 64 is tested below); its
figures are printed, not written (the file holds the full soak's)."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import pytest

from app import compare
from app.ui import SESSIONS_KEPT
from tests.app.served import (
    STATUS,
    Outcome,
    files_under,
    link_query,
    machine,
    open_fds,
    rss_bytes,
    serve,
    write_figures,
)
from tests.reliability import FULL_SOAK, SOAK_ENV

REQUESTS = int(os.environ.get(SOAK_ENV, 40))  # FULL_SOAK (100) in the reliability suite
VARIANT = "mhla"
STEPS = 4
MEASURED = (1, 10, REQUESTS // 2, REQUESTS)
PERMALINKS = 64  # app/ui.py: finished requests remembered for their links (docs/app.md: "the last 64")
COLOURS = ["red", "green", "blue", "yellow", "purple", "white", "grey", "black"]
SHAPES = ["square", "triangle", "circle"]
MOTIONS = ["moves left", "moves right", "moves up", "moves down", "stays still"]


def _prompt(i: int) -> str:
    return f"a {COLOURS[i % 8]} {SHAPES[(i // 8) % 3]} {MOTIONS[(i // 3) % 5]}"


def _trimmed_rss() -> int:
    """Resident bytes once glibc has returned its free pages (malloc_trim; each run's threads leave freed pages in
    their arenas): what the process holds, with less of the allocator's noise. Plain RSS where there is no glibc."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    return rss_bytes()


def _state_size(demo, session: str) -> int:
    """How many components gradio keeps in a session's page state (the page's own, once each)."""
    state = demo.state_holder.session_data.get(session)
    return -1 if state is None else len(state.blocks_config.blocks) + len(state.config_values)


def _strays(tmp: Path) -> list[Path]:
    """Files in the temporary folder outside the app's output folder and gradio's cache."""
    return [p for p in files_under(tmp) if p.relative_to(tmp).parts[0] not in ("out", "gradio")]


def _file_paths(outputs: list) -> list[str]:
    """Every file a page's outputs name (gradio's file data)."""
    return [o["path"] for o in outputs if isinstance(o, dict) and o.get("path")]


@pytest.mark.slow
@pytest.mark.serial  # reads the process's memory and the machine's load: alone, as a server left up would be
@pytest.mark.timeout(2400)
def test_a_hundred_requests_leave_no_memory_handles_or_files_behind(tmp_path, monkeypatch, capfd):
    from run_app import compose

    if REQUESTS < 20:
        raise ValueError(
            f"{SOAK_ENV}={REQUESTS}: the soak needs at least 20 requests (it compares request 10 with the last)"
        )
    # the caps it runs past: the app's own in the full soak; in a shorter one scaled to 2/5 of them, so that it runs
    # past them as the full soak does (the pruning and the page-state eviction are the same code whatever the cap)
    keep_runs, sessions_kept = compare.KEEP_RUNS, SESSIONS_KEPT
    if REQUESTS < FULL_SOAK:
        keep_runs, sessions_kept = compare.KEEP_RUNS * 2 // 5, SESSIONS_KEPT // 4
        monkeypatch.setattr(compare.engine, "KEEP_RUNS", keep_runs)
        monkeypatch.setattr("app.ui.SESSIONS_KEPT", sessions_kept)  # what tests.app.served launches with
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))  # the app's temporary files, and ffmpeg's
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    models = compose(None, {}, None, "cpu", "auto")  # the built-in model, with its analyser, as run_app serves it
    d = models.defaults
    preset = compare.preset_key((d["num_frames"], d["height"], d["width"]))
    # the app's folders in the temporary folder, where run_app.py has them (gradio serves files from there)
    out, cache = private_tmp / "out", private_tmp / "gradio"
    samples: dict[int, dict] = {}
    outcomes: list[Outcome] = []
    returned: set[str] = set()  # every file path a page returned
    links: dict[int, dict] = {}  # each request's permalink
    capfd.readouterr()
    with serve(models, private_tmp) as page:
        stored = files_under(out / "stored")
        before = machine()
        started = time.monotonic()
        regular = page.browser()  # a tab left open: every 4th request; the others each from a new tab
        for i in range(1, REQUESTS + 1):
            tab = regular if i % 4 == 0 else page.browser()
            o = tab.generate(Outcome(0, i, _prompt(i), i, [VARIANT]), STEPS, float(d["guidance_scale"]), preset)
            assert o.error is None, (i, o.error)
            assert f"seed used {i}." in o.output(STATUS)
            (video,) = o.videos().values()
            assert f"{VARIANT} | seed {i} | {_prompt(i)}".encode() in tab.download(video)  # its own video
            returned |= set(_file_paths(o.data))
            links[i] = link_query(o.output(STATUS))
            o.data = None  # the test keeps the figures only: a page (its chart inline) would count as the app's memory
            outcomes.append(o)
            if i in MEASURED:
                gc.collect()
                runs = [p for p in (out / "compare").iterdir() if p.is_dir()]
                samples[i] = {
                    "rss_mib": round(rss_bytes() / 2**20, 1),
                    "rss_trimmed_mib": round(_trimmed_rss() / 2**20, 1),
                    "open_fds": open_fds(),
                    "run_folders": len(runs),
                    "run_files": len(files_under(out / "compare")),
                    "gradio_cache_files": len(files_under(cache)),
                    "gradio_cache_mib": round(sum(f.stat().st_size for f in files_under(cache)) / 2**20, 2),
                    "temp_files": len(_strays(private_tmp)),
                    "gradio_sessions": len(page.demo.state_holder.session_data),  # each tab's page state
                    "open_tab_state": _state_size(page.demo, regular.session),
                    "load_1_5_15": machine().get("load_1_5_15"),
                }
                assert len(runs) == min(i, keep_runs), (i, len(runs))
                # a run folder holds its video, nothing else (no temporary file of the atomic writes)
                assert all(f.suffix == ".mp4" for f in files_under(out / "compare")), files_under(out / "compare")
        seconds = time.monotonic() - started
        after = machine()

        # permalinks: the newest run opens with its results; one whose videos were pruned restores the form only
        kept, pruned = (REQUESTS, REQUESTS - keep_runs + 1), (REQUESTS - keep_runs, REQUESTS // 2, 1)
        opened = {i: page.browser().open_link(links[i]) for i in (*kept, *pruned)}
        for i in kept:  # kept: shown as run here, its video served
            status, videos = opened[i][6], [o for o in opened[i] if isinstance(o, dict) and o.get("path")]
            assert "as run on this server" in status and len(videos) == 1, (i, status, videos)
            assert f"{VARIANT} | seed {i} | {_prompt(i)}".encode() in page.browser().download(videos[0])
        assert stored == files_under(out / "stored")
    logged = capfd.readouterr()

    for i in pruned:  # pruned (or beyond the 64 remembered): the form only
        status = opened[i][6]
        assert "Restored from the link" in status and _file_paths(opened[i]) == [], (i, status)
        assert opened[i][0] == _prompt(i) and opened[i][1] == i  # the link's fields are restored

    growth = samples[REQUESTS]["rss_mib"] / samples[10]["rss_mib"] - 1
    trimmed = samples[REQUESTS]["rss_trimmed_mib"] / samples[10]["rss_trimmed_mib"] - 1
    # memory: resident after the last request within 10% of after request 10, both read once glibc has returned the free
    # pages of its per-thread arenas (each run starts threads; their freed pages are the allocator's noise, several %
    # either way from run to run); the plain figure is reported beside it
    assert abs(trimmed) <= 0.10, samples
    # file handles: none left open per request (a few sockets may come and go)
    assert samples[REQUESTS]["open_fds"] <= samples[10]["open_fds"] + 4, samples
    # gradio's page state per tab: the last SESSIONS_KEPT tabs only (its default kept 10,000, ~0.3 MB each)
    assert samples[REQUESTS]["gradio_sessions"] <= sessions_kept, samples
    # the open tab's page state: the page's components, not one more per run
    assert samples[REQUESTS]["open_tab_state"] <= samples[10]["open_tab_state"], samples
    # temporary files: none
    assert samples[REQUESTS]["temp_files"] == 0, _strays(private_tmp)
    # gradio's cache: one copy of each video a page returned, nothing else
    assert {str(p) for p in files_under(cache)} <= returned | {str(p) for p in files_under(cache / "uploads")}
    assert samples[REQUESTS]["gradio_cache_files"] <= REQUESTS
    assert "Traceback" not in logged.out + logged.err, (logged.out + logged.err)[-3000:]

    services = [o.service for o in outcomes]
    figures = {
        "what": f"{REQUESTS} requests one after another over HTTP (every 4th from a tab left open, the others each from "
        f"a new tab), on the built-in model served in-process on 127.0.0.1",
        "model": "builtin",
        "device": models.device.type,
        "request": {"variant": VARIANT, "preset": preset, "steps": STEPS, "guidance": float(d["guidance_scale"])},
        "seconds": round(seconds, 1),
        "requests_per_minute": round(60 * REQUESTS / seconds, 2),
        "service_s": {"median": round(statistics.median(services), 2), "max": round(max(services), 2)},
        "after_request": samples,
        "requests": REQUESTS,
        "rss_growth_10_to_100": round(growth, 4),  # to the last request (the name kept: 100 in the full soak)
        "rss_trimmed_growth_10_to_100": round(trimmed, 4),
        "caps": {
            "run_folders": keep_runs,
            "permalinks": PERMALINKS,
            "gradio_sessions": sessions_kept,
            "gradio_cache": "copies older than a day deleted hourly (delete_cache=(3600, 86400))",
        },
        "machine_before": before,
        "machine_after": after,
    }
    if REQUESTS >= FULL_SOAK:
        write_figures(f"app_soak_{models.device.type}", figures, _markdown(figures))
    else:  # the shorter soak's figures: shown with -s or on a failure; the file keeps the full soak's
        print(_markdown(figures))


def _markdown(f: dict) -> str:
    s = f["after_request"]
    lines = [
        f"# App soak: {f['model']} model on {f['device']}",
        "",
        f"{f['what']}: {f['request']['variant']}, {f['request']['preset']}, {f['request']['steps']} steps. Written by "
        f"`tests/app/test_soak.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); asserted: memory at "
        f"{f['requests']} within 10% of memory at 10 (after malloc_trim), no file handle, temporary file or result beyond its cap.",
        "",
        f"- {f['seconds']} s in all ({f['requests_per_minute']} requests/min), a request {f['service_s']['median']} s "
        f"(median; max {f['service_s']['max']} s)",
        f"- resident memory from request 10 to {f['requests']}: {f['rss_growth_10_to_100']:+.1%} "
        f"({f['rss_trimmed_growth_10_to_100']:+.1%} once the allocator returned its free pages, malloc_trim)",
        f"- machine: {f['machine_before']} before, {f['machine_after']} after",
        f"- caps: {f['caps']['run_folders']} run folders, {f['caps']['permalinks']} permalinks, "
        f"{f['caps']['gradio_sessions']} tabs' page state, gradio's cache: "
        f"{f['caps']['gradio_cache']}",
        "",
        "| after request | resident MiB (trimmed) | open fds | run folders | files in them | gradio cache files | cache MiB | "
        "temp files | tabs' page states kept | entries in the open tab's |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {i} | {v['rss_mib']} ({v['rss_trimmed_mib']}) | {v['open_fds']} | {v['run_folders']} | {v['run_files']} | "
        f"{v['gradio_cache_files']} | {v['gradio_cache_mib']} | {v['temp_files']} | {v['gradio_sessions']} | "
        f"{v['open_tab_state']} |"
        for i, v in s.items()
    ]
    return "\n".join(lines)


@pytest.mark.slow  # three one-step runs of the tiny model
def test_a_link_to_a_run_whose_videos_were_pruned_restores_the_form_only(tmp_path, monkeypatch):
    """The page remembers the last 64 finished requests for their links, but keeps only the newest KEEP_RUNS run
    folders: a link to an older run named videos that were gone, and gradio's postprocessing of the page failed (the
    soak above found it: the page said "as run on this server" and its video player fetched a file that was gone).
    It now opens as a fresh link: the form restored, "press Generate"."""
    from types import SimpleNamespace

    from app.models import load_app_models
    from app.ui import build_demo

    monkeypatch.setattr(compare.engine, "KEEP_RUNS", 2)
    demo = build_demo(load_app_models("tiny-random"), max_tokens=compare.CPU_MAX_TOKENS, out_root=tmp_path)
    fns = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    smallest = compare.preset_key(compare.PRESETS[0])
    links = []
    for seed in range(3):
        *_, last = fns["on_compare"](
            "a red fox", "", seed, 1, 5.0, smallest, ["flash"], 1, request=SimpleNamespace(session_hash=f"s{seed}")
        )
        links.append(link_query(last[STATUS]))
    for seed, link in enumerate(links):
        opened = fns["on_load"](SimpleNamespace(session_hash="other", query_params=link))
        status, video = opened[6], opened[6 + 3]  # the 6 fields, then status, headline, (column, video, details)
        if seed == 0:  # its folder was pruned
            assert "Restored from the link" in status and not isinstance(video, str), (status, video)
        else:
            assert "as run on this server" in status and Path(video).is_file(), (status, video)


def test_the_launcher_keeps_the_page_state_of_the_last_sessions_only(monkeypatch):
    """run_app.py launches with gradio's page state kept for the last SESSIONS_KEPT browser sessions: gradio's default
    (10,000, about 0.3 MB each with this page, freed by nothing else) grew the soak's server with every new tab."""
    import gradio as gr

    import run_app

    launched = {}

    class Launched(Exception):
        pass

    def launch(self, **kwargs):
        launched.update(kwargs)
        raise Launched

    monkeypatch.setattr(gr.Blocks, "launch", launch)
    with pytest.raises(Launched):
        run_app._main(["--model", "tiny-random", "--port", "0"])
    assert launched["state_session_capacity"] == SESSIONS_KEPT and launched["server_name"] == "127.0.0.1"

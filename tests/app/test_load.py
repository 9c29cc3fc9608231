"""Issue 53 (2): the app under load. The page is served in this process on 127.0.0.1 (as ``run_app.py`` serves
it) and driven over HTTP by concurrent clients, each a browser tab of its own (:mod:`tests.app.served`): 8 clients x
3 requests on the tiny random-weight model, 2 x 2 on the built-in model at its defaults (9x64x80, 20 steps, every
variant). Every request is served or waits in line with its place shown, none errors, each gets its own result, and
the timings on each result say under what load they were taken. Throughput, queue wait and the per-step timings
(idle against under load) go to ``benchmarks/results/app_load_<model>_<device>.{json,md}``: reported, never asserted
(the machine may be busy).

Bounded: a fixed number of requests, every HTTP read with a timeout and every request a deadline, a time limit per
test, loopback only."""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app import compare
from tests.app.served import (
    HEADLINE,
    LOAD,
    STATUS,
    SUMMARY,
    TABLE,
    Outcome,
    link_query,
    machine,
    serve,
    write_figures,
)

COLOURS = ["red", "green", "blue", "yellow", "purple", "white", "grey", "black"]
SHAPES = ["square", "triangle", "circle"]
MOTIONS = ["moves left", "moves right", "moves up", "moves down", "stays still"]


def _prompt(client: int, index: int) -> str:
    """A prompt of the built-in model's words, different for every request of a test."""
    n = client * 3 + index
    return f"a {COLOURS[n % 8]} {SHAPES[(n // 8) % 3]} {MOTIONS[(n + client) % 5]}"


def _models(name: str):
    from run_app import compose

    return compose(None if name == "builtin" else name, {}, None, "cpu", "auto")


def _check_own_result(browser, o: Outcome, interleaved: bool) -> None:
    """``o``'s final page is its own request's: seed, prompt and variants in the status line's permalink and the
    summary, one video per requested variant whose file (fetched as the browser fetches it) was written for this
    prompt and seed; its timings name the machine's load, and a speedup too noisy to trust is flagged."""
    assert o.error is None and o.data is not None, (o.client, o.index, o.error)
    status = o.output(STATUS)
    assert status.startswith(f"Done: {len(o.variants)} variant(s)") and f"seed used {o.seed}." in status, status
    link = link_query(status)
    assert (link["prompt"], link["seed"], link["variants"]) == (o.prompt, str(o.seed), ",".join(o.variants)), link
    summary = o.output(SUMMARY)
    assert f"**seed used: {o.seed}**" in summary, summary
    videos = o.videos()
    assert sorted(videos) == sorted(o.variants), (o.variants, sorted(videos))
    for variant, video in videos.items():
        data = browser.download(video)
        assert f"{variant} | seed {o.seed} | {o.prompt}".encode() in data, (variant, o.seed, o.prompt)
    # the timings say under what load they were taken: the machine's load at the run's start, in the summary and
    # under the table
    m = LOAD.search(summary)
    assert m and int(m.group(2)) == os.cpu_count() and "at the start" in summary, summary
    assert "measured live on" in o.output(TABLE) and LOAD.search(o.output(TABLE)), o.output(TABLE)
    headline = o.output(HEADLINE)
    if "⚠ noisy" in headline:  # a noisy speedup is flagged and the warning names the load it was measured under
        assert "Noisy timings" in headline and LOAD.search(headline), headline
    if not interleaved and len(o.variants) > 1 and "flash" in o.variants:
        # variants that shared one transformer ran one after another: every speedup is flagged as noisy
        assert headline.count("⚠ noisy") == len(o.variants) - 1, headline


def _load(
    name: str, page, clients: int, per_client: int, steps: int, variants_of, note: str
) -> tuple[list[Outcome], Outcome, dict]:
    """``clients`` tabs at once, ``per_client`` requests each, one after another; a request alone first (the
    idle figures)."""
    models = page.models
    d = models.defaults
    preset = compare.preset_key((d["num_frames"], d["height"], d["width"]))
    guidance = float(d["guidance_scale"])
    alone = page.browser()
    idle = alone.generate(Outcome(-1, 0, _prompt(clients, 0), 10_000, list(variants_of(0))), steps, guidance, preset)
    assert idle.error is None, idle.error
    before = machine()
    barrier = threading.Barrier(clients)

    def client(c: int) -> list[tuple[object, Outcome]]:
        browser = page.browser()
        barrier.wait(timeout=60)  # every tab clicks at once
        done = []
        for i in range(per_client):
            o = Outcome(c, i, _prompt(c, i), 1000 * (c + 1) + i, list(variants_of(c)))
            done.append((browser, browser.generate(o, steps, guidance, preset, deadline_s=900)))
        return done

    with ThreadPoolExecutor(clients, thread_name_prefix="client") as pool:
        futures = [pool.submit(client, c) for c in range(clients)]
        results = [pair for f in futures for pair in f.result(timeout=1200)]
    after = machine()
    outcomes = [o for _, o in results]
    for browser, o in results:
        _check_own_result(browser, o, compare.interleaves(models, o.variants))
    served = [o for o in outcomes if o.data is not None]
    start = min(o.clicked for o in outcomes)
    end = max(o.ended for o in served)
    waits = sorted(o.wait for o in served)
    steps_idle = idle.step_ms()
    under = {v: [o.step_ms()[v] for o in served if v in o.variants] for v in steps_idle}
    figures = {
        "what": f"app under load: {clients} concurrent browser tabs x {per_client} requests each, one device slot "
        f"(concurrency 1, queue of {page.queue_size}), served in-process on 127.0.0.1",
        "model": name,
        "device": models.device.type,
        "preset": preset,
        "steps": steps,
        "guidance": guidance,
        "variants": sorted({",".join(o.variants) for o in outcomes}),
        "requests": len(outcomes),
        "served": len(served),
        "errors": len(outcomes) - len(served),
        "seconds": round(end - start, 1),
        "throughput_requests_per_minute": round(60 * len(served) / (end - start), 2),
        "queue_wait_s": {
            "median": round(statistics.median(waits), 1),
            "p90": round(waits[int(0.9 * (len(waits) - 1))], 1),
            "max": round(waits[-1], 1),
        },
        "service_s_median": round(statistics.median(o.service for o in served), 2),
        "idle_service_s": round(idle.service, 2),
        "positions_shown": sorted({o.position for o in outcomes}),
        "gradio_ranks_max": max(max(o.ranks, default=0) for o in outcomes),
        "step_ms_median": {
            v: {"idle": round(steps_idle[v], 1), "under_load": round(statistics.median(ms), 1)}
            for v, ms in under.items()
            if ms
        },
        "load_reported": sorted({LOAD.search(o.output(SUMMARY)).group(0) for o in served}),
        "noisy_flagged": sum("⚠ noisy" in o.output(HEADLINE) for o in served),
        "machine_before": before,
        "machine_after": after,
        "note": note,
    }
    return outcomes, idle, figures


def _markdown(f: dict) -> str:
    lines = [
        f"# App under load: {f['model']} model on {f['device']}",
        "",
        f"{f['what']}. Written by `tests/app/test_load.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
        "figures reported, not asserted.",
        "",
        f"- requests: {f['requests']} ({f['served']} served, {f['errors']} errors), preset {f['preset']}, "
        f"{f['steps']} steps, variants {'; '.join(f['variants'])}",
        f"- throughput: **{f['throughput_requests_per_minute']} requests/min** ({f['seconds']} s for all)",
        f"- queue wait: median **{f['queue_wait_s']['median']} s**, p90 {f['queue_wait_s']['p90']} s, "
        f"max {f['queue_wait_s']['max']} s; places shown in line: {f['positions_shown']} "
        f"(0: started at once); gradio's rank up to {f['gradio_ranks_max']}",
        f"- one request's own time: {f['service_s_median']} s under load (median), {f['idle_service_s']} s for the "
        "request run alone before the clients came (the first after the warm-up)",
        f"- machine: {f['machine_before']} before, {f['machine_after']} after; the results said "
        f"{', '.join(f['load_reported'])}; {f['noisy_flagged']} of {f['served']} flagged a noisy speedup",
        f"- {f['note']}",
        "",
        "| variant | step ms alone | step ms under load (median) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {v} | {s['idle']} | {s['under_load']} |" for v, s in f["step_ms_median"].items()]
    return "\n".join(lines)


LOADS = {
    # model: clients, requests each, steps (None: the model's own), variants of client c
    "tiny-random": (8, 3, None, lambda c: [["flash", "linear", "mhla", "mhla-hybrid"], ["flash", "mhla"], ["linear"],
                                           ["flash", "mhla-hybrid"]][c % 4]),
    "builtin": (2, 2, None, lambda c: ["flash", "linear", "mhla", "mhla-hybrid"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial  # its figures are the machine's throughput under this load alone
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(LOADS))
def test_concurrent_clients_are_each_served_their_own_result_or_told_their_place(name, tmp_path, capfd):
    clients, per_client, steps, variants_of = LOADS[name]
    models = _models(name)
    steps = steps or models.defaults["num_inference_steps"]
    capfd.readouterr()
    with serve(models, tmp_path) as page:
        outcomes, idle, figures = _load(
            name, page, clients, per_client, steps, variants_of, "the model's defaults (size, steps, guidance)"
        )
        run_dirs = [p for p in (tmp_path / "out" / "compare").iterdir() if p.is_dir()]
    logged = capfd.readouterr()
    # every request was served or queued with its place shown: the app's line ("Starting…", "Queued: position N") and
    # gradio's rank while it waited; none errored
    assert [o.error for o in outcomes] == [None] * len(outcomes)
    assert all(o.position is not None for o in outcomes), [o.line for o in outcomes]
    assert all(o.ranks for o in outcomes), [(o.client, o.index) for o in outcomes if not o.ranks]
    assert any(o.position and o.position >= 1 for o in outcomes)  # with one device slot, some waited in line
    assert len({tuple(sorted(v["path"] for v in o.videos().values())) for o in outcomes}) == len(outcomes)
    assert len(run_dirs) <= compare.KEEP_RUNS
    assert "Traceback" not in logged.out + logged.err, (logged.out + logged.err)[-3000:]
    write_figures(f"app_load_{name}_{models.device.type}", figures, _markdown(figures))


# ---- the line's count: a request that leaves before it runs leaves the line too ------------------------------


@pytest.mark.slow  # serves a page (the tiny model)
@pytest.mark.timeout(600)
def test_a_refused_or_stopped_request_leaves_no_phantom_place_in_line(tmp_path, capfd):
    """A request refused by the checks, or stopped while it waited, no longer counts in the line: the next visitor
    of an idle server is told "Starting…", not "Queued: position 1" (every refusal used to add a phantom place)."""
    models = _models("tiny-random")
    d = models.defaults
    preset = compare.preset_key((d["num_frames"], d["height"], d["width"]))
    with serve(models, tmp_path, warm=False) as page:
        refused = page.browser().generate(Outcome(0, 0, "a red fox", 1, ["flash"]), 0, 5.0, preset)
        assert refused.line == "Starting…" and "steps must be between 1 and" in (refused.error or ""), refused
        assert _place_in_line(page) == "Starting…"  # idle: nobody is in line

        # a long run; a second tab waits behind it and presses Stop before its turn; then the run is stopped too
        long_tab, waiting_tab = page.browser(), page.browser()
        running, waiting = Outcome(1, 0, "a blue fox", 2, ["flash"]), Outcome(2, 0, "a grey fox", 3, ["flash"])
        workers = [
            threading.Thread(target=tab.generate, args=(o, compare.MAX_STEPS, 5.0, preset), kwargs={"deadline_s": 300})
            for tab, o in ((long_tab, running), (waiting_tab, waiting))
        ]
        workers[0].start()
        _until(lambda: running.started is not None)
        workers[1].start()
        _until(lambda: bool(waiting.ranks))  # in gradio's queue, behind the run
        assert waiting.line.startswith("**Queued:** position 1 in line"), waiting.line
        waiting_tab.stop()
        long_tab.stop()
        for w in workers:
            w.join(timeout=300)
        assert not any(w.is_alive() for w in workers)
        assert waiting.started is None  # it never ran
        assert _place_in_line(page) == "Starting…"


def _place_in_line(page) -> str:
    """What a new tab's click is told; the tab then presses Stop (it leaves the line: it was only asking)."""
    tab = page.browser()
    place = tab.call(page.click_fn, [["flash"]])[1]
    tab.stop()
    return place


def _until(condition, seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)

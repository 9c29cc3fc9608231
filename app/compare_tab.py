"""The Compare tab: the request form, a column per variant streamed as each finishes (with a live preview before
it), the verdict, tables, chart and side-by-side video; stored examples and permalinks.

Handlers turn the page's values into a request, call :mod:`app.compare`, and turn its result into component values.
Bad input raises ``gr.Error`` (an error on the page, an error through the API). A compare run streams: it runs in a
worker thread and each variant's column fills as soon as that variant is done, while the status line names the
stage ("mhla: denoising step 7/20"). Stop cancels the run between two transformer calls. The tab's state (runs by
session, the queue, the finished runs a permalink opens, the clocks of the run's tails) is one
:class:`CompareState` per page.
"""

from __future__ import annotations

import math
import queue
import random
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from pipelines import VARIANTS

from . import compare, inputs, preview
from .interleave import Countdown, RunEstimate, SizeCost
from .models import AppModels, ModelFacts
from .page import PageSource, gpu_panel

SCROLL_TO_STATUS_JS = "() => { document.getElementById('status')?.scrollIntoView({behavior: 'smooth'}); }"
# the URL query of the request just run, written into the address bar without a reload (see compare.parse_permalink)
PERMALINK_JS = """
(prompt, seed, steps, guidance, preset, variants) => {
  const q = new URLSearchParams({prompt: prompt, seed: String(seed), steps: String(steps),
    variants: (variants || []).join(","), guidance: String(guidance), preset: String(preset)});
  window.history.replaceState(null, "", window.location.pathname + "?" + q.toString());
}
"""
POLL_SECONDS = 0.5  # how often the status line is refreshed while a run is going
# the shortest wait for the run's next event, whatever POLL_SECONDS says: a loop that never blocks would yield a page
# per turn and starve the worker thread of the GIL (a test with POLL_SECONDS = 0 grew to 24 GB that way)
MIN_WAIT_SECONDS = 0.02
# the outputs of each variant's column: the column, its video, its details, its live preview
PER_VARIANT = 4


def stored_label(result: compare.CompareResult) -> str:
    """The first line above a stored example: it is not the visitor's run, and where and when it was measured."""
    if not result.measured:
        return ""
    req = result.request
    return (
        f'> **Stored example, not a run of yours**: {result.measured}; prompt "{req.prompt}", seed {req.seed}, '
        f"{req.num_inference_steps} steps. It disappears when you press Generate.\n\n"
    )


def table_device(result: compare.CompareResult) -> str:
    """The line under the page's table naming the machine that measured it (never a GPU's committed numbers)."""
    if not result.runs:
        return ""
    where = result.measured or f"measured live on {result.device}" + (f", {result.load}" if result.load else "")
    speed = f" With {result.speed}." if result.speed else ""
    return f"\n\n_Timings in this table: {where}.{speed}_"


def _default_preset(models: AppModels | ModelFacts, max_tokens: int | None) -> str:
    """The model's own default size when it is a preset and allowed here, else the smallest preset."""
    d = models.defaults
    own = (d.get("num_frames"), d.get("height"), d.get("width"))
    if own in compare.PRESETS and (max_tokens is None or compare.preset_tokens(models, own) <= max_tokens):
        return compare.preset_key(own)
    return compare.preset_key(compare.PRESETS[0])


class _Runs:
    """The Stop flag of each browser session's running compare (a session stops only its own run)."""

    def __init__(self):
        self._flags: dict[str, threading.Event] = {}
        self._latest: dict[str, compare.CompareResult] = {}  # what the session's running compare has finished
        self._counts: dict[str, dict[str, tuple[int, int]]] = {}  # its variants' steps done and in all
        self._lock = threading.Lock()

    def start(self, session: str) -> threading.Event:
        with self._lock:
            flag = self._flags[session] = threading.Event()
            self._latest.pop(session, None)
            self._counts.pop(session, None)
        return flag

    def steps(self, session: str, flag: threading.Event, counts: dict[str, tuple[int, int]]) -> None:
        """Records the running compare's steps per variant (what Stop's message names)."""
        with self._lock:
            if self._flags.get(session) is flag:
                self._counts[session] = dict(counts)

    def counts(self, session: str) -> dict[str, tuple[int, int]]:
        with self._lock:
            return dict(self._counts.get(session, {}))

    def finished(self, session: str, flag: threading.Event, result: compare.CompareResult) -> None:
        """Records the running compare's latest snapshot (what Stop keeps)."""
        with self._lock:
            if self._flags.get(session) is flag:
                self._latest[session] = result

    def latest(self, session: str) -> compare.CompareResult | None:
        with self._lock:
            return self._latest.get(session)

    def stop(self, session: str) -> bool:
        """Sets the session's Stop flag; False when it has no run going."""
        with self._lock:
            flag = self._flags.get(session)
        if flag is not None:
            flag.set()
        return flag is not None

    def end(self, session: str, flag: threading.Event) -> None:
        with self._lock:
            if self._flags.get(session) is flag:
                del self._flags[session]
                self._latest.pop(session, None)
                self._counts.pop(session, None)


class _DecodeClock:
    """The seconds of a stage after a variant's steps on this server (a variant's tail: decode, video writing and
    checks; or the run's end) by size (pixels: frames x height x width): the warm-up's decodes first (at two sizes,
    :func:`app.compare.warm_up`), then each finished run's measure (what a run has still to do after its steps). A
    size not measured takes a fixed part and a part per pixel from the sizes that were
    (:class:`app.interleave.SizeCost`)."""

    def __init__(self):
        self._cost = SizeCost()
        self._steps: tuple[float, float, int] | None = None  # (the stage in denoising steps, in seconds, at pixels)
        self._lock = threading.Lock()

    def add(self, seconds: float, pixels: int, step_seconds: float | None = None, guess: bool = False) -> None:
        """A stage of ``seconds`` at ``pixels`` (``guess``: the warm-up's, which a run's measure replaces); with
        ``step_seconds`` (the same run's denoising step) also as a number of steps: a busier machine slows both
        alike, so that count carries to the next run where seconds do not (two requests 15.5 s and 11.1 s apart, the
        first's tails said +44% for the second's)."""
        if seconds > 0 and pixels > 0:
            with self._lock:
                self._cost.add(seconds, pixels, guess=guess)
                if guess:
                    return
                if not step_seconds or step_seconds <= 0:
                    self._steps = None
                    return
                steps = seconds / step_seconds
                if self._steps is not None and self._steps[2] == pixels:  # one run is one sample: averaged
                    steps, seconds = (steps + self._steps[0]) / 2, (seconds + self._steps[1]) / 2
                self._steps = (steps, seconds, pixels)

    @property
    def empty(self) -> bool:
        """Nothing measured yet (not even the warm-up's decodes)."""
        with self._lock:
            return not self._cost

    def in_steps(self, pixels: int) -> bool:
        """Whether the last stage at ``pixels`` is known as a number of steps (a run's, not the warm-up's)."""
        with self._lock:
            return self._steps is not None and self._steps[2] == pixels

    def seconds(self, pixels: int, step_seconds: float | None = None) -> float | None:
        """The stage's seconds at ``pixels``. With this run's step (``step_seconds``) and an earlier run's measure at
        the same size: the geometric mean of as many of this run's steps as it took there and of the seconds it took
        there. Steps alone follow a busier machine but also carry a step that is slower for other reasons (another
        process's burst, other variants chosen) into the decode, which it does not slow: on this CPU under a varying
        load one run's tails in steps said 0.73 s for the next run's 0.37 s, its seconds 0.40 s. The geometric mean
        errs by at most the square root of either's factor. Else the seconds measured at that size (runs' measures
        averaged), or from the sizes measured (:class:`app.interleave.SizeCost`)."""
        with self._lock:
            if self._steps is not None and step_seconds and self._steps[2] == pixels:
                return math.sqrt(self._steps[0] * step_seconds * self._steps[1])
            return self._cost.seconds(pixels)


def _times(seconds: float | None, share: float) -> float | None:
    return None if seconds is None else seconds * share


def progress_markdown(name: str, note: str, done: int, total: int, width: int = 20) -> str:
    """A running variant's column: its denoising steps done of its steps, as a bar, then that it decodes."""
    filled = round(width * done / total) if total else 0
    bar = "█" * filled + "░" * (width - filled)
    stage = "decoding its video" if total and done >= total else "denoising"
    return f"### {name}\n_{note}_\n\n`{bar}` {done}/{total} steps · {stage}"


def stopped_line(finished: list[str], counts: dict[str, tuple[int, int]], variants: list[str] | None = None) -> str:
    """Stop's status line: which variants finished (shown) and where each other one was stopped (``counts``: its
    denoising steps done and in all, over its repeats; ``variants``: the run's, in order; default the counts')."""
    names = list(variants or counts)
    done = [n for n in names if n in finished] or list(finished)
    parts = []
    if done:
        parts.append(f"{', '.join(done)} finished and {'is' if len(done) == 1 else 'are'} shown")
    stopped = []
    for name in (n for n in names if n not in done):
        steps, total = counts.get(name, (0, 0))
        if not steps:
            stopped.append(f"{name} before its first step")
        elif total and steps >= total:
            stopped.append(f"{name} after all {total} steps, while decoding its video")
        else:
            stopped.append(f"{name} at step {steps} of {total}" if total else f"{name} after {steps} steps")
    if stopped:
        parts.append("stopped: " + "; ".join(stopped) + " (not shown: a video needs every step)")
    if not parts:
        return "**Stopped** by you before any variant finished: this run has nothing to show."
    return "**Stopped** by you: " + "; ".join(parts) + "."


def _status(text: str, started: float, countdown: Countdown, estimate: RunEstimate | None = None) -> str:
    """The status line while a run goes: its stage, the seconds elapsed and, once ``estimate`` can say, the seconds
    left (:class:`app.interleave.RunEstimate`, shown through ``countdown`` so that it counts down)."""
    now = time.monotonic()
    line = f"**Running:** {text} · {now - started:.0f} s elapsed"
    left = countdown.update(None if estimate is None else estimate.seconds_left(now))
    if left is not None:
        if left >= 1:
            line += f", about {left:.0f} s left"
        else:
            # "finishing" only once no variant's video is still to come (the side-by-side video and the tables are
            # then all that is left): a tail that runs past its estimate is "about 1 s left", not minutes of
            # "finishing" (the 6.3 s)
            line += ", about 1 s left" if estimate is not None and estimate.videos_left() > 0 else ", finishing"
    return line


class _Queue:
    """Where a new request stands: requests waiting before it, and the wait they imply from the last run's time.
    One place per browser session, from its click until its run starts or it leaves (refused by the checks, stopped
    while it waited, its tab closed): a request that never runs leaves no place behind."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: dict[str, None] = {}  # the sessions in line, in the order they clicked
        self.running_since: float | None = None
        self.last_seconds: float | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def join(self, session: str | None = None) -> str:
        """Counts a new request in and says where it stands (a session's earlier place is given up)."""
        with self._lock:
            if session is not None:
                self._waiting.pop(session, None)
            ahead, running = len(self._waiting), self.running_since is not None
            self._waiting[session if session is not None else uuid.uuid4().hex] = None
            if not ahead and not running:
                return "Starting…"
            wait = ""
            if self.last_seconds is not None:
                left = max(0.0, self.last_seconds - (time.monotonic() - self.running_since)) if running else 0.0
                wait = f", expected wait about {left + ahead * self.last_seconds:.0f} s"
            return f"**Queued:** position {ahead + running} in line{wait}"

    def start(self, session: str | None = None) -> None:
        """A run starts: its session's place (without a session: the first in line) is given up."""
        with self._lock:
            if session is None and self._waiting:
                session = next(iter(self._waiting))
            self._waiting.pop(session, None)  # an API call never clicked: it has no place to give up
            self.running_since = time.monotonic()

    def leave(self, session: str | None) -> None:
        """A session's request that will not run (refused, stopped while waiting, its tab closed) leaves the line."""
        with self._lock:
            self._waiting.pop(session, None)

    def end(self) -> None:
        with self._lock:
            if self.running_since is not None:
                self.last_seconds = time.monotonic() - self.running_since
            self.running_since = None


def _files_kept(result: compare.CompareResult) -> bool:
    """Whether every file of a finished run is still on disk (only the newest compare.KEEP_RUNS run folders are kept;
    a page that names a pruned file fails in gradio's postprocessing)."""
    files = [r.video for r in result.runs if r.video is not None] + [result.side_by_side] * bool(result.side_by_side)
    return all(f.is_file() for f in files)


def _stored_copies(models: AppModels | ModelFacts, folder: Path) -> dict[str, compare.CompareResult]:
    """The stored example results, their videos copied into the app's own output folder (gradio serves files
    from there; the model's folder may lie anywhere)."""
    stored = compare.load_stored(models.stored_dir)
    for result in stored.values():
        target = folder / uuid.uuid4().hex[:8]
        target.mkdir(parents=True, exist_ok=True)
        for run in result.runs:
            if run.video is not None:
                run.video = Path(shutil.copy2(run.video, target / run.video.name))
    return stored


@dataclass
class CompareState:
    """The Compare tab's state, one per page (shared by its sessions): ``stored``, the example prompts' stored
    results by prompt; ``runs``, each session's run; ``queue``, the requests waiting; ``finished``, the runs a
    permalink opens again (by :func:`app.compare.request_key`, this server only, the newest 64); the clocks of a
    variant's tail (decode, video, checks) and of a run's end (side-by-side video, tables, chart), each tail's
    share of their mean by the number of variants of the last such run, and a run's end as a share of a tail as the
    warm-up measured them (the time-left estimate's priors)."""

    stored: dict[str, compare.CompareResult]
    runs: _Runs = field(default_factory=lambda: _Runs())
    queue: _Queue = field(default_factory=lambda: _Queue())
    finished: dict[str, tuple[compare.CompareResult, str]] = field(default_factory=dict)
    finished_lock: threading.Lock = field(default_factory=threading.Lock)
    decode_clock: _DecodeClock = field(default_factory=lambda: _DecodeClock())
    finish_clock: _DecodeClock = field(default_factory=lambda: _DecodeClock())
    tail_shapes: dict[int, list[float]] = field(default_factory=dict)
    end_share: float | None = None


def compare_tab(
    demo: gr.Blocks, source: PageSource, max_tokens: int | None, preview_every: int = preview.PREVIEW_EVERY
) -> None:
    """The Compare tab: the request form, a column per variant streamed as each finishes (a live preview every
    ``preview_every`` steps before it: :mod:`app.preview`; 0: none), the verdict, tables, chart and side-by-side
    video; stored examples and permalinks. ``max_tokens``: largest request accepted."""
    models, warmup, out_root, loaded = source.models, source.warmup, source.out_root, source.loaded
    # where gradio's upload route puts files: the only place an uploaded first frame may be read from
    upload_dirs = [Path(gr.utils.get_upload_folder())]
    page = models  # what the page is built from and shows before the models are loaded
    defaults = page.defaults
    gpu_tables = source.gpu_tables

    state = CompareState(_stored_copies(page, out_root / "stored"))

    def key_of(req: compare.CompareRequest) -> str:
        return compare.request_key(
            str(page.source),
            req.prompt,
            req.seed,
            req.num_inference_steps,
            req.guidance_scale,
            compare.preset_key(req.preset),
            req.variants,
        )

    # the outputs after the status line: headline, (column, video, details, preview) per variant, summary, table,
    # details table, chart, side-by-side file
    n_outputs = PER_VARIANT * len(VARIANTS) + 6

    def outputs_for(result: compare.CompareResult, status: str, running: bool = False) -> list:
        """The page for ``result``. ``running``: variants still run, so no chart yet (matplotlib in this thread
        would slow the VAE decode of the variant whose turn it is: it is drawn once, at the end) and a running
        variant's preview stays; a finished variant's video replaces its preview."""
        outs = [status, stored_label(result) + compare.headline_markdown(result) + _warning(result)]
        for name in VARIANTS:
            run = result.run(name)
            chosen = name in result.request.variants
            outs += [
                gr.Column(visible=chosen),
                str(run.video) if run and run.video else None,
                compare.variant_markdown(run, result) if run else f"### {name}\n_{page.variant_notes[name]}_\n\n…",
                gr.skip() if running and run is None else "",
            ]
        outs += [
            compare.summary_markdown(result),
            compare.table_markdown(result) + table_device(result),
            compare.detail_rows(result),
            gr.skip() if running else compare.speedup_figure(result),
            str(result.side_by_side) if result.side_by_side else None,
        ]
        return outs

    def cleared(variants: list[str] | None, status: str) -> list:
        """The page with nothing from any earlier request: what a new run starts from and what Stop leaves when
        no variant of this run had finished (a stored example or the last run never stays beside new results)."""
        outs: list = [status, ""]
        for name in VARIANTS:
            outs += [
                gr.skip() if variants is None else gr.Column(visible=name in variants),
                None,
                f"### {name}\n_{page.variant_notes[name]}_\n\n…",
                "",
            ]
        return outs + ["", "", {"headers": compare.ALL_HEADERS, "data": []}, None, None]

    def _warning(result: compare.CompareResult) -> str:
        note = compare.noise_warning(result)
        return f"\n\n{note}" if note else ""

    def on_compare(
        prompt,
        negative_prompt,
        seed,
        num_inference_steps,
        guidance_scale,
        preset,
        variants,
        repeats,
        image=None,
        request: gr.Request = None,
    ):
        """Generates the prompt with each chosen variant (same seed) and yields the page as each one is done.
        ``image``: the first frame, an input only for a model that takes one (gradio's upload, not trusted)."""
        while warmup is not None and not warmup.wait_loaded(POLL_SECONDS):  # the page was served before the model
            yield [warmup.note()] + [gr.skip()] * n_outputs
        models = loaded()
        if models is None:
            state.queue.leave(getattr(request, "session_hash", None))
            raise gr.Error(warmup.note() if warmup else "the model is not loaded", print_exception=False)
        try:
            req = compare.check_request(
                models,
                prompt,
                negative_prompt,
                seed,
                num_inference_steps,
                guidance_scale,
                preset,
                variants,
                max_tokens,
                repeats,
                image=image,
                upload_dirs=upload_dirs,
            )
        except ValueError as e:
            # the status line keeps the message after the alert is closed; the API gets an error, not a value
            state.queue.leave(getattr(request, "session_hash", None))  # a refused request leaves no place in line
            yield [f"✖ **Error:** {e}"] + [gr.skip()] * n_outputs
            raise inputs.refused(str(e)) from None  # one line in the server's log, no traceback
        session = getattr(request, "session_hash", None) or uuid.uuid4().hex
        stop = state.runs.start(session)
        state.queue.start(session)
        try:
            # nothing from an earlier request (a stored example, the last run, its chart) stays beside its results
            yield cleared(req.variants, (warmup.note() if warmup else "") or "**Running:** starting…")
            while warmup is not None and not warmup.wait(POLL_SECONDS) and not stop.is_set():
                yield [warmup.note()] + [gr.skip()] * n_outputs
        except BaseException:  # the page went away (or Stop cancelled this generator) while waiting
            state.runs.end(session, stop)
            state.queue.end()
            raise
        if stop.is_set():  # Stop before the run began: the page stays empty and says so
            state.runs.end(session, stop)
            state.queue.end()
            yield cleared(None, "**Stopped** by you before any variant finished: this run has nothing to show.")
            return
        if warmup is not None and warmup.decodes and state.decode_clock.empty:
            # the warm-up's decodes (two sizes: a fixed part and a part per pixel) are only the first estimate: once
            # they replaced the last run's measured tails at every request, so a run never learned from the one before
            for seconds, at in warmup.decodes:
                state.decode_clock.add(seconds, at, guess=True)
            # a run's end before any was measured: the warm-up's end over its tail at the same size, times a tail
            # (one more tail, as before, said 1.1 s for a 0.3-0.5 s end at 17x128x160: +22% near a run's end)
            tails_at = dict((at, seconds) for seconds, at in warmup.decodes)
            shares = [seconds / tails_at[at] for seconds, at in warmup.ends if tails_at.get(at, 0) > 0]
            state.end_share = shares[0] if shares else None
        pixels = req.num_frames * req.height * req.width
        events: queue.Queue = queue.Queue()

        def show(name: str, step: int, steps: int, frame, estimate: bool) -> None:
            """A variant's live preview (in its turn, between two timed steps): the column's HTML."""
            events.put(("preview", (name, preview.preview_html(frame, name, step, steps, estimate))))

        def counted(counts: dict[str, tuple[int, int]]) -> None:
            events.put(("steps", (time.monotonic(), counts)))  # the second it was counted: the estimate's clock
            state.runs.steps(session, stop, counts)

        def work():
            try:
                for snapshot in compare.iter_compare(
                    models,
                    req,
                    out_root / "compare",
                    progress=lambda t, f: events.put(("progress", (t, f))),
                    cancel=stop,
                    variant_steps=counted,
                    preview_every=preview_every,
                    show_preview=show if preview_every > 0 else None,
                ):
                    events.put(("result", (time.monotonic(), snapshot)))
            except BaseException as e:  # noqa: BLE001 - reported to the page below, without details
                events.put(("failed", e))
            finally:
                events.put(("end", None))

        def tail_prior(step: float | None) -> float | list[float] | None:
            """The tails of this run's variants as the last runs had them: their mean (:class:`_DecodeClock`), in
            the shape the last run of as many variants had (the first video's tail short, the later ones longer)."""
            mean = state.decode_clock.seconds(pixels, step)
            shape = state.tail_shapes.get(len(req.variants))
            return mean if mean is None or shape is None else [mean * x for x in shape]

        started = time.monotonic()
        countdown = Countdown()
        # what the run measures of itself (app.interleave.RunEstimate); what it has not yet measured (a tail, the
        # run's end) comes from earlier runs on this server, as many of this run's steps as they took there
        estimate = RunEstimate(
            req.variants,
            req.num_inference_steps,
            req.repeats,
            compare.interleaves(models, req.variants),
            tail_prior=tail_prior,
            # before any whole run: a tail times the warm-up's end over its tail, else one more tail (the
            # side-by-side video is one more video to write)
            finish_prior=lambda step: (
                state.finish_clock.seconds(pixels, step)
                or _times(state.decode_clock.seconds(pixels, step), state.end_share or 1.0)
            ),
            start=started,
            finish_like_tails=state.finish_clock.seconds(pixels) is None,
        )

        worker = threading.Thread(target=work, name="compare", daemon=True)
        worker.start()
        text, last, shown = "starting", None, 0.0
        counts: dict[str, tuple[int, int]] = {}  # each variant's steps done and in all
        previews: dict[str, str] = {}  # each running variant's latest preview not yet shown

        def columns_in_progress() -> list:
            """Each running variant's column: its steps done of its steps, as a bar, and its latest preview (finished
            ones: unchanged)."""
            finished = {r.variant for r in last.runs} if last else set()
            outs: list = []
            for name in VARIANTS:
                if name in counts and name not in finished:
                    bar = progress_markdown(name, page.variant_notes[name], *counts[name])
                    outs += [gr.skip(), gr.skip(), bar, previews.pop(name, gr.skip())]
                else:
                    outs += [gr.skip()] * PER_VARIANT
            return outs

        try:
            while True:
                try:
                    kind, payload = events.get(timeout=max(POLL_SECONDS, MIN_WAIT_SECONDS))
                except queue.Empty:
                    kind, payload = "tick", None
                if kind == "progress":
                    text = payload[0]
                elif kind == "steps":
                    at, counts = payload
                    estimate.steps(at, counts)
                    continue
                elif kind == "preview":
                    name, html_text = payload
                    previews[name] = html_text  # shown with the next refresh of the columns
                    continue
                elif kind == "result":
                    at, payload = payload
                    for r in payload.runs:
                        estimate.finished(at, r.variant)
                    last, shown = payload, time.monotonic()
                    state.runs.finished(session, stop, last)
                    if not stop.is_set():
                        yield outputs_for(last, _status(text, started, countdown, estimate), running=True)
                    continue
                elif kind == "failed":
                    compare.log.error("compare run failed", exc_info=payload)
                    raise gr.Error(  # the traceback was logged just above, once
                        f"internal error ({type(payload).__name__}); the details are in the server's log",
                        print_exception=False,
                    )
                elif kind == "end":
                    break
                # once Stop is pressed nothing more streams: on_stop's status line is the last word, not a tick
                # that was on its way while the run was being cancelled (a race seen under load)
                if stop.is_set():
                    continue
                if time.monotonic() - shown >= POLL_SECONDS:  # the stage line and the bars, at most twice a second
                    shown = time.monotonic()
                    status_line = _status(text, started, countdown, estimate)
                    yield [status_line, gr.skip(), *columns_in_progress()] + [gr.skip()] * 5
        finally:
            stop.set()  # the page went away or Stop cancelled this generator: end the worker's run too
            worker.join()
            state.runs.end(session, stop)
            state.queue.end()
        if last is None:
            raise gr.Error("the run was stopped before any variant finished", title="Stopped", print_exception=False)
        failed = [r.variant for r in last.runs if r.error]
        seconds = time.monotonic() - started
        if last.stopped:
            status = stopped_line([r.variant for r in last.runs], counts, req.variants)[:-1] + f" ({seconds:.0f} s)."
        elif failed:
            status = f"✖ **Error** in {', '.join(failed)}: see the column(s) below; the app is still serving."
        else:
            status = (
                f"Done: {len(last.runs)} variant(s) in {seconds:.0f} s, seed used {req.seed}. "
                f"[Link to this request]({compare.permalink_query(req)})"
            )
            if not req.negative_prompt and req.image is None and req.repeats == 1:
                with state.finished_lock:
                    state.finished[key_of(req)] = (last, time.strftime("%H:%M UTC", time.gmtime()))
                    while len(state.finished) > 64:  # the oldest go first
                        del state.finished[next(iter(state.finished))]
        if req.unknown_words:
            status += " " + compare.vocabulary_note(models, req.unknown_words)
        final = outputs_for(last, status)  # the table, the chart: part of what a run has still to do after its steps
        # the next run's estimates, this server's latest, as many of this run's steps as they took: a variant's tail
        # (its decode, video and checks) and the run's end after the last video (the side-by-side video, the tables,
        # the chart); only from a whole run. Both at the pace of this run's first steps (`step`, what the next run's
        # priors are taken at): a load that changed during the run is taken out
        complete = not last.stopped and all(r.timings for r in last.runs) and len(last.runs) == len(req.variants)
        step, tails = estimate.step_seconds, estimate.first_pace_tails()
        if complete and tails:
            mean = sum(tails) / len(tails)
            state.decode_clock.add(mean, pixels, step)
            if len(tails) == len(req.variants) and mean > 0:  # one run is one sample: averaged with the last
                shape, last_shape = [t / mean for t in tails], state.tail_shapes.get(len(req.variants))
                state.tail_shapes[len(req.variants)] = (
                    shape if last_shape is None else [(a + b) / 2 for a, b in zip(shape, last_shape, strict=True)]
                )
        elif complete:
            for r in last.runs:
                state.decode_clock.add(r.stage("vae_decode").median, pixels)
        if complete and estimate.finish_times:
            end = time.monotonic() - max(estimate.finish_times.values())
            state.finish_clock.add(end / estimate.tail_slowdown(), pixels, step)
        yield final

    def on_stop(request: gr.Request):
        """Stops this session's run: its worker ends before the next transformer call. The page keeps only what
        this run finished (nothing at all when no variant had finished)."""
        session = getattr(request, "session_hash", None) or ""
        state.queue.leave(session)  # stopped while it waited: its place in line goes too (gradio drops the queued run)
        last, counts = state.runs.latest(session), state.runs.counts(session)
        if not state.runs.stop(session):
            return [gr.Button(interactive=True)] + [gr.skip()] * (n_outputs + 1)  # nothing running (or queued)
        if last is None or not last.runs:
            return [gr.Button(interactive=True)] + cleared(
                None, "**Stopped** by you before any variant finished: this run has nothing to show."
            )
        status = stopped_line([r.variant for r in last.runs], counts, list(last.request.variants))
        return [gr.Button(interactive=True)] + outputs_for(last, status)

    stored_lock = threading.Lock()

    def show_stored(prompt):
        """The stored result of an example prompt (computed by ``python run_app.py --store-examples``), with its
        side-by-side video (made from the stored videos the first time it is shown: not at start)."""
        result = state.stored.get(prompt.strip() if isinstance(prompt, str) else "")
        if result is None:
            return ["Press **Generate** to run this prompt."] + [gr.skip()] * n_outputs
        with stored_lock:
            if result.side_by_side is None and result.runs and result.runs[0].video is not None:
                result.side_by_side = compare.stored_side_by_side(result, result.runs[0].video.parent)
        return outputs_for(result, f"Showing the stored result of this example ({result.measured}).")

    def prompt_note(prompt):
        """Under the prompt box while typing: characters used of the limit, and words the model does not know."""
        text = prompt if isinstance(prompt, str) else ""
        note = f"{len(text):,} / {compare.MAX_PROMPT_CHARS:,} characters"
        if len(text) > compare.MAX_PROMPT_CHARS:
            note = f"✖ {note}: too long"
        models = loaded()  # the tokenizer says which words it knows: nothing to say before it is loaded
        words = compare.unknown_words(models, text[: compare.MAX_PROMPT_CHARS]) if models and text else []
        vocab = compare.vocabulary_note(models, words) if models else ""
        return note + (f" · {vocab}" if vocab else "")

    def on_load(request: gr.Request):
        """Restores a permalink's fields (``?prompt=...&seed=...&steps=...&variants=...``), and shows the
        stored result of its prompt, or of the first example when the link names no prompt."""
        params = dict(getattr(request, "query_params", None) or {})
        fields, problems = compare.parse_permalink(params)
        prompt_value = fields.get("prompt") or (page.example_prompts[0] if state.stored else None)
        values = [
            prompt_value if prompt_value is not None else gr.skip(),
            fields.get("seed", gr.skip()),
            fields.get("steps", gr.skip()),
            fields.get("guidance", gr.skip()),
            fields.get("preset", gr.skip()),
            fields.get("variants", gr.skip()),
        ]
        result = state.stored.get(prompt_value or "")
        if result is not None:  # a stored result only for the very request the link names
            req = result.request
            same = {
                "seed": req.seed,
                "steps": req.num_inference_steps,
                "guidance": req.guidance_scale,
                "preset": compare.preset_key(req.preset),
                "variants": req.variants,
            }
            if any(fields[k] != v for k, v in same.items() if k in fields):
                result = None
        shown = show_stored(prompt_value) if result is not None else [gr.skip()] * (n_outputs + 1)
        run_here = None
        if not problems and {"prompt", "seed", "steps", "guidance", "preset", "variants"} <= set(fields):
            key = compare.request_key(
                str(page.source),
                fields["prompt"],
                fields["seed"],
                fields["steps"],
                fields["guidance"],
                fields["preset"],
                fields["variants"],
            )
            with state.finished_lock:
                run_here = state.finished.get(key)
        if run_here is not None and not _files_kept(run_here[0]):
            run_here = None  # its videos were pruned (compare.KEEP_RUNS run folders): the link restores the form only
        if run_here is not None:  # this very request ran on this server: its results, said to be those
            done, when = run_here
            result = done
            shown = outputs_for(
                done, f"Showing this link's request as run on this server at {when}; Generate runs it again."
            )
        if problems:
            shown[0] = f"⚠ The link's {', '.join(problems)} could not be used (left at the defaults)."
        elif fields and result is None:
            shown[0] = "Restored from the link: press **Generate** to run it."
        return values + shown + [prompt_note(prompt_value or "")]

    with gr.Tab("Compare"):
        with gr.Row():
            with gr.Column(scale=3) as prompt_column:
                prompt = gr.Textbox(
                    label="Prompt",
                    lines=2,
                    elem_id="prompt",
                    placeholder="Describe the video to generate (or pick an example below)",
                    info=f"at most {compare.MAX_PROMPT_CHARS:,} characters",
                )
                note = gr.Markdown(prompt_note(""), elem_id="prompt-note")
                negative = gr.Textbox(
                    "",
                    label="Negative prompt (optional)",
                    lines=1,
                    elem_id="negative",
                    placeholder="what the video should not show",
                )
                # only for a model that takes a first frame (image-to-video, Wan2.2-TI2V); gradio's own
                # upload (no URL or server path), checked again in compare.check_request
                image = gr.Image(
                    type="filepath",
                    sources=["upload"],
                    label="First frame" + (" (required)" if page.needs_image else " (optional)"),
                    elem_id="image",
                    height=200,
                    visible=page.takes_image,
                )
            with gr.Column(scale=2):
                preset = gr.Dropdown(
                    compare.preset_choices(page, max_tokens),
                    value=_default_preset(page, max_tokens),
                    label="Frames and resolution (latent tokens, MHLA blocks M)",
                    elem_id="preset",
                    info=compare.presets_left_out(page, max_tokens),
                )
                variants = gr.CheckboxGroup(list(VARIANTS), value=list(VARIANTS), label="Variants", elem_id="variants")
                with gr.Row():
                    # precision=None: 1.5 reaches the check and is refused, not rounded to 2
                    seed = gr.Number(0, label="Seed", precision=None, minimum=0, elem_id="seed")
                    dice = gr.Button("Random seed", size="sm", elem_id="random-seed", scale=0)
                with gr.Row():
                    # numbers, not sliders: a slider clamps 1000 steps to 100 in the browser; out-of-range
                    # values must reach the check and be refused with a message
                    steps = gr.Number(
                        defaults["num_inference_steps"],
                        precision=None,
                        elem_id="steps",
                        label="Steps",
                        info=f"1 to {compare.MAX_STEPS}",
                    )
                    guidance = gr.Number(
                        defaults["guidance_scale"],
                        precision=None,
                        step=0.5,
                        elem_id="guidance",
                        label="Guidance",
                        info=f"0 to {compare.MAX_GUIDANCE:g}",
                    )
                    repeats = gr.Number(
                        1,
                        precision=None,
                        elem_id="repeats",
                        label="Repeats",
                        info=f"timed runs per variant, 1 to {compare.MAX_REPEATS}",
                    )
        with gr.Row():
            run_button = gr.Button("Generate with each variant", variant="primary", elem_id="generate", scale=3)
            stop_button = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
        status = gr.Markdown(label="status", elem_id="status", min_height=50, container=True, padding=True)
        headline = gr.Markdown(label="headline", elem_id="headline")
        columns = []
        with gr.Row(equal_height=False):
            for name in VARIANTS:
                with gr.Column(min_width=200, elem_id=f"col-{name}") as col:
                    # the live preview (app.preview) above the video: an image inside HTML, none in gradio's cache
                    live = gr.HTML(
                        "", label=f"{name} preview", elem_id=f"preview-{name}", elem_classes="variant-preview"
                    )
                    video = gr.Video(
                        label=f"{name} video",
                        autoplay=True,
                        loop=True,
                        interactive=False,
                        height=260,
                        elem_id=f"video-{name}",
                    )
                    md = gr.Markdown(
                        f"### {name}\n_{page.variant_notes[name]}_",
                        label=f"{name} details",
                        elem_id=f"latency-{name}",
                        elem_classes="variant-info",
                    )
                columns += [col, video, md, live]
        table = gr.Markdown(label="By variant, best against the prompt first", elem_id="table")
        with gr.Row():
            chart = gr.Plot(label="denoising step latency", show_label=False, elem_id="chart")
            side_by_side = gr.File(
                label="Side-by-side video (every variant, labelled)", interactive=False, elem_id="side-by-side"
            )
        summary = gr.Markdown(label="summary", elem_id="summary")
        gpu_panel(gpu_tables, "compare")
        with gr.Accordion("All measurements", open=False, elem_id="details"):
            details = gr.Dataframe(
                headers=compare.ALL_HEADERS,
                label="All measurements by variant",
                show_label=False,
                elem_id="details-table",
                wrap=True,
            )
        with prompt_column:  # under the prompt box (made here: it fills the outputs defined above)
            gr.Examples(
                page.example_prompts,
                inputs=[prompt],
                outputs=[status, headline, *columns, summary, table, details, chart, side_by_side],
                fn=show_stored,
                run_on_click=True,
                cache_examples=False,
                label="Example prompts (open with their stored results; Generate runs them afresh)",
                api_visibility="private",
            )
        outputs = [status, headline, *columns, summary, table, details, chart, side_by_side]

        # typing, an example or a permalink: the count and the vocabulary note follow
        prompt.change(prompt_note, prompt, note, queue=False, api_visibility="private", trigger_mode="always_last")
        dice.click(lambda: random.randrange(2**31), None, seed, queue=False, api_visibility="private")

        def on_click(chosen, request: gr.Request):
            """The click's own update, before the run joins gradio's queue: the page cleared, the place in line."""
            place = state.queue.join(getattr(request, "session_hash", None))
            return [gr.Button(interactive=False), *cleared(chosen if isinstance(chosen, list) else [], place)]

        # a click clears the page at once: a stored example or an earlier run never waits in line beside it
        started = run_button.click(
            on_click,
            variants,
            [run_button, *outputs],
            queue=False,
            api_visibility="private",
        )
        run = started.then(
            on_compare,
            [prompt, negative, seed, steps, guidance, preset, variants, repeats]
            + ([image] if page.takes_image else []),  # the API's inputs stay as they were for other models
            outputs,
            concurrency_id="device",  # one run at a time: compare and benchmark share the device
            concurrency_limit=1,
            show_progress="hidden",  # the status line says the stage and the time left (gradio's ETA was wrong)
            api_name="compare",
            preprocess=False,  # raw values reach app.inputs' checks: a list prompt is refused, not str()-ed
        )
        for after in (run.then, run.failure):  # gradio 6 skips .then after an error: enable on both
            after(lambda: gr.Button(interactive=True), None, run_button, queue=False, api_visibility="private")
        # the address bar becomes the permalink of the request just run (restored by on_load)
        run.then(
            None,
            [prompt, seed, steps, guidance, preset, variants],
            None,
            js=PERMALINK_JS,
            queue=False,
            api_visibility="private",
        )
        stop_button.click(on_stop, None, [run_button, *outputs], cancels=[run], queue=False, api_visibility="private")
        demo.load(
            on_load,
            None,
            [prompt, seed, steps, guidance, preset, variants, *outputs, note],
            queue=False,
            api_visibility="private",
            show_progress="hidden",  # no spinner over the form while the link is read (the form is usable)
        )

        def on_unload(request: gr.Request):
            state.queue.leave(getattr(request, "session_hash", None))  # a tab closed while its request waited

        demo.unload(on_unload)
        # the results start below a 1400x900 window's fold: a click brings the status line and the columns into view
        run_button.click(None, None, None, js=SCROLL_TO_STATUS_JS, queue=False, api_visibility="private")

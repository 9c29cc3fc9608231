"""The app served in this process on the loopback interface, and a client that drives it over HTTP as a browser
does (issue 53: load and soak). Not a test module.

:func:`serve` serves loaded models as ``run_app.py`` does (warmed up before the first request,
``queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)``, the page state of the last ``SESSIONS_KEPT`` tabs) on
127.0.0.1 with a free port; the app's videos and gradio's cache and uploads go to a folder of the test's own
(``<root>/out``, ``GRADIO_TEMP_DIR=<root>/gradio``). ``run_app.compose`` gives the built-in model its analyser.

A :class:`Browser` is one browser tab (one gradio session): :meth:`Browser.generate` is a click on Generate as the
page's JavaScript makes it: the click's own handler first (it clears the page and says where the request stands in
line: "Starting…" or "Queued: position N in line"), then the compare event through gradio's queue
(``/gradio_api/queue/join``), whose event stream (``/gradio_api/queue/data``) it reads to the end: gradio's queue
ranks while it waits, the pages while it runs, the final page. Every read has a timeout and the whole call a
deadline: nothing here waits without end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.reliability import OUT_ENV

# the page's outputs after a compare, in order (app/compare_tab.py): status, headline, (column, video, details, live
# preview) per variant (PER_VARIANT of them), then summary, table, details table, chart, side-by-side file (counted
# from the end)
STATUS, HEADLINE = 0, 1
SUMMARY, TABLE, DETAILS, CHART, SIDE_BY_SIDE = -5, -4, -3, -2, -1
QUEUED = re.compile(r"^\*\*Queued:\*\* position (\d+) in line")
LOAD = re.compile(r"load (\d+(?:\.\d+)?) on (\d+) cores")


@dataclass
class Outcome:
    """One request as its client saw it."""

    client: int
    index: int
    prompt: str
    seed: int
    variants: list[str]
    line: str = ""  # the click's status line: where the request stood in the app's line
    ranks: list[int] = field(default_factory=list)  # gradio's queue ranks while it waited (0: next)
    queue_sizes: list[int] = field(default_factory=list)
    clicked: float = 0.0  # time.monotonic() of the click, the join, the run's start and end
    joined: float = 0.0
    started: float | None = None
    ended: float | None = None
    pages: int = 0  # pages streamed while it ran
    data: list | None = None  # the final page (process_completed's outputs)
    error: str | None = None  # what the client got instead of a page
    load_at_start: float | None = None  # the machine's 1-minute load when the run began (os.getloadavg)

    @property
    def position(self) -> int | None:
        """The place in line the app showed (0: "Starting…", it ran at once), None when it showed neither."""
        if self.line.startswith("Starting"):
            return 0
        m = QUEUED.match(self.line)
        return int(m.group(1)) if m else None

    @property
    def wait(self) -> float | None:
        """Seconds in gradio's queue: from the join to the run's start."""
        return None if self.started is None else self.started - self.joined

    @property
    def service(self) -> float | None:
        return None if self.started is None or self.ended is None else self.ended - self.started

    def output(self, index: int):
        """The final page's output ``index`` (:data:`STATUS`, :data:`SUMMARY`, ...)."""
        assert self.data is not None, self.error
        return self.data[index]

    def videos(self) -> dict[str, dict]:
        """The variant videos of the final page (gradio's file data) by variant, from the page's columns."""
        assert self.data is not None
        out = {}
        from app.compare_tab import PER_VARIANT

        for i in range(2, len(self.data) - 5, PER_VARIANT):
            video, details = self.data[i + 1], self.data[i + 2]
            if isinstance(video, dict) and video.get("path"):
                name = details.split("\n", 1)[0].removeprefix("### ").strip()
                out[name] = video
        return out

    def step_ms(self) -> dict[str, float]:
        """Each variant's median denoising step (ms) from the page's table of all measurements."""
        table = self.output(DETAILS)
        headers, rows = table["headers"], table["data"]
        col = headers.index("step ms (median)")
        return {row[0]: float(row[col]) for row in rows if row[col] not in ("", None)}


class Page:
    """The launched page: its URL and the events a browser triggers, by what they do."""

    def __init__(self, demo, models, root: Path, queue_size: int):
        self.demo = demo
        self.models = models
        self.root = root
        self.queue_size = queue_size
        self.url = demo.local_url
        fns = demo.fns

        def find(test) -> int:
            return next(i for i, f in fns.items() if test(f))

        def ids(blocks) -> list:
            return [getattr(b, "elem_id", None) for b in blocks]

        self.compare_fn = find(lambda f: getattr(f.fn, "__name__", "") == "on_compare")
        # the Generate button's own click: outputs the button first, takes the variants
        self.click_fn = find(
            lambda f: not f.queue and ids(f.outputs)[:1] == ["generate"] and ids(f.inputs) == ["variants"]
        )
        self.load_fn = find(lambda f: getattr(f.fn, "__name__", "") == "on_load")
        self.stop_fn = find(lambda f: getattr(f.fn, "__name__", "") == "on_stop")

    def browser(self) -> Browser:
        return Browser(self)


class Browser:
    """One tab: a gradio session of its own."""

    def __init__(self, page: Page):
        self.page = page
        self.session = uuid.uuid4().hex[:12]
        self.event_id: str | None = None  # the compare event last joined

    def _post(self, path: str, body: dict, timeout: float = 60.0) -> dict:
        request = urllib.request.Request(
            self.page.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())

    def call(self, fn_index: int, data: list, query: dict | None = None) -> list:
        """An event that runs outside the queue (a click's own handler, the page's load): its outputs."""
        path = "gradio_api/run/predict" + ("?" + urllib.parse.urlencode(query) if query else "")
        return self._post(path, {"fn_index": fn_index, "data": data, "session_hash": self.session})["data"]

    def open_link(self, query: dict) -> list:
        """The page opened at a permalink (``?prompt=...&seed=...``): the load handler's outputs."""
        return self.call(self.page.load_fn, [], query)

    def generate(
        self,
        outcome: Outcome,
        steps: int,
        guidance: float,
        preset: str,
        negative: str = "",
        repeats: int = 1,
        deadline_s: float = 600.0,
        read_timeout_s: float = 120.0,
    ) -> Outcome:
        """Generate pressed with ``outcome``'s prompt, seed and variants; fills ``outcome`` in and returns it."""
        deadline = time.monotonic() + deadline_s
        outcome.clicked = time.monotonic()
        clicked = self.call(self.page.click_fn, [outcome.variants])
        outcome.line = clicked[1]  # after the button's update: the status line
        data = [outcome.prompt, negative, outcome.seed, steps, guidance, preset, outcome.variants, repeats]
        joined = {"fn_index": self.page.compare_fn, "data": data, "session_hash": self.session}
        self.event_id = self._post("gradio_api/queue/join", joined)["event_id"]
        outcome.joined = time.monotonic()
        url = f"{self.page.url}gradio_api/queue/data?session_hash={self.session}"
        with urllib.request.urlopen(url, timeout=read_timeout_s) as stream:
            for raw in stream:
                if time.monotonic() > deadline:
                    outcome.error = f"no answer within {deadline_s:.0f} s"
                    break
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line.removeprefix("data:"))
                kind = msg.get("msg")
                if kind == "estimation":
                    if msg.get("rank") is not None:
                        outcome.ranks.append(int(msg["rank"]))
                    if msg.get("queue_size") is not None:
                        outcome.queue_sizes.append(int(msg["queue_size"]))
                elif kind == "process_starts":
                    outcome.started = time.monotonic()
                    with contextlib.suppress(OSError):
                        outcome.load_at_start = os.getloadavg()[0]
                elif kind == "process_generating":
                    outcome.pages += 1
                elif kind == "process_completed":
                    outcome.ended = time.monotonic()
                    output = msg.get("output") or {}
                    if msg.get("success") and "data" in output:
                        outcome.data = output["data"]
                    else:
                        outcome.error = str(output.get("error") or output.get("title") or output)
                    break
                elif kind in ("close_stream", "unexpected_error"):
                    outcome.error = outcome.error or f"the stream ended: {msg}"
                    break
        if outcome.data is None and outcome.error is None:
            outcome.error = "the stream ended without a result"
        return outcome

    def stop(self) -> list:
        """Stop pressed, as the page's JavaScript does it: the compare event cancelled (out of gradio's queue, or its
        run ended), then Stop's own handler; its outputs."""
        if self.event_id is not None:
            body = {"fn_index": self.page.compare_fn, "session_hash": self.session, "event_id": self.event_id}
            self._post("gradio_api/cancel", body)
        return self.call(self.page.stop_fn, [])

    def download(self, file_data: dict, timeout: float = 60.0) -> bytes:
        """A file of a page as the browser fetches it (gradio's file route)."""
        with urllib.request.urlopen(file_data["url"], timeout=timeout) as r:
            return r.read()


@contextlib.contextmanager
def serve(models, root: Path, warm: bool = True) -> Iterator[Page]:
    """``models`` served on 127.0.0.1 as ``run_app.py`` serves them, files under ``root`` (``out``: the app's
    videos, ``gradio``: gradio's cache and uploads)."""
    from app import compare
    from app.ui import CSS, QUEUE_SIZE, SESSIONS_KEPT, THEME, build_demo

    previous = os.environ.get("GRADIO_TEMP_DIR")
    os.environ["GRADIO_TEMP_DIR"] = str(root / "gradio")
    try:
        if warm:  # as the launcher does before the first request: no request pays the cold caches
            compare.warm_up(models)
        max_tokens = compare.CPU_MAX_TOKENS if models.device.type == "cpu" else None
        demo = build_demo(models, max_tokens=max_tokens, out_root=root / "out")
        demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE).launch(
            server_name="127.0.0.1",
            server_port=None,
            prevent_thread_lock=True,
            quiet=True,
            show_error=False,
            theme=THEME,
            css=CSS,
            ssr_mode=False,
            state_session_capacity=SESSIONS_KEPT,
        )
        try:
            yield Page(demo, models, root, QUEUE_SIZE)
        finally:
            demo.close()
    finally:
        if previous is None:
            os.environ.pop("GRADIO_TEMP_DIR", None)
        else:
            os.environ["GRADIO_TEMP_DIR"] = previous


def link_query(status: str) -> dict[str, str]:
    """The permalink's fields from a finished run's status line ("... [Link to this request](?prompt=...)")."""
    m = re.search(r"\]\((\?[^)]*)\)", status)
    assert m, status
    return dict(urllib.parse.parse_qsl(m.group(1)[1:]))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def machine() -> dict:
    """The machine the figures were taken on: cores, load, memory."""
    info = {"cores": os.cpu_count()}
    with contextlib.suppress(OSError):
        info["load_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(OSError, ValueError):
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        info["memory_gib"] = round(int(meminfo["MemTotal"].split()[0]) / 2**20, 1)
        info["available_gib"] = round(int(meminfo["MemAvailable"].split()[0]) / 2**20, 1)
    return info


def write_figures(name: str, figures: dict, markdown: str) -> Path | None:
    """``benchmarks/results/<name>.json`` and ``.md``: figures reported, never asserted; written only by the
    reliability suite (``python -m tests.reliability`` sets :data:`tests.reliability.OUT_ENV`). In a plain pytest
    run they are printed (shown with ``-s`` or on a failure): a test run never rewrites a tracked file (the load
    test rewrote its results in every run, CI's included)."""
    if not os.environ.get(OUT_ENV):
        print(markdown)
        return None
    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")
    (folder / f"{name}.md").write_text(markdown.rstrip() + "\n")
    return folder / f"{name}.json"

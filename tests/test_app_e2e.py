"""The launched app, end to end: `python run_app.py` on a free 127.0.0.1 port (the built-in model, CPU), driven
through gradio_client and through a real headless Chromium.

The browser test needs Debian's chromium (/usr/bin/chromium, or $CHROMIUM) and the playwright Python
package; it drives that browser (playwright downloads nothing). It saves a screenshot of the compare tab
to $APP_SCREENSHOT, or to the test's tmp folder.
"""

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipelines import read_video
from pipelines.builtin import builtin_available

ROOT = Path(__file__).resolve().parents[1]
SMALLEST = "5x32x48"
# tokens and M depend on the model's patch and block shape (the built-in model: 1x1x1, 48 tokens)
SMALLEST_LABEL = re.compile(r"^5 frames, 32x48: \d+ tokens \(\dx\dx\d\), M=\d+$")
TRAINED = builtin_available()  # the app serves the built-in model, else the tiny random one
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# no network on CI machines: without these Chromium keeps retrying its background connections
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "server.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "GRADIO_TEMP_DIR": str(log.parent / "gradio")}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "run_app.py", "--port", str(port)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"run_app.py exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"run_app.py did not serve {url} within 120 s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def compare(client, prompt="a red fox running through snow", preset=SMALLEST, variants=("flash", "linear", "mhla")):
    return client.predict(prompt, "", 0, 2, 5.0, preset, list(variants), api_name="/compare")


def test_client_compare_three_variants(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    out = compare(client)
    # layout components (the columns) are not API outputs: status, (video, latency) per variant, summary, table, chart
    status, cols, table = out[0], out[1:9], out[10]
    assert status.startswith("Done: 3 variant(s)")
    videos = {name: cols[2 * i] for i, name in enumerate(("flash", "linear", "mhla", "mhla-hybrid"))}
    assert videos["mhla-hybrid"] is None
    for name in ("flash", "linear", "mhla"):
        assert read_video(videos[name]).shape == (5, 32, 48, 3)
    headers, rows = table["headers"], table["data"]
    assert [r[0] for r in rows] == ["flash", "linear", "mhla"]
    col = {h: headers.index(h) for h in headers}
    for r in rows:
        total, denoise, step, attn = (float(r[col[h]]) for h in ("total s", "denoising s", "per step s", "self-attn s"))
        # rounded to 4 decimals in the table
        assert 0 < step * 2 <= denoise + 2e-4 and denoise <= total + 1e-4 and 0 < attn <= denoise + 1e-4


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(variants=()), "no variant chosen"),
        (dict(preset="81x480x800"), "too large for this device"),
        (dict(preset="/etc/passwd"), None),  # refused by gradio's own choice check or by ours
    ],
)
def test_client_bad_input_then_next_request_works(server, args, message):
    from gradio_client import Client

    client = Client(server, verbose=False)
    try:
        status = compare(client, **args)[0]
    except Exception as e:  # gradio rejects a value outside the dropdown's choices before our code runs
        assert message is None, e
    else:
        assert status.startswith("**Error:**") and (message is None or message in status)
    assert compare(client, variants=("flash",))[0].startswith("Done: 1 variant(s)")


def test_client_benchmark(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    status, _plot, table, files = client.predict(
        "1x4x4,1x8x8", ["operator", "transformer forward"], ["flash", "mhla"], 1, api_name="/benchmark"
    )
    assert status.startswith("Done"), status
    assert len(table["data"]) == 2 * 3 + 2 * 2
    assert sorted(Path(f).name for f in files) == ["benchmark.csv", "benchmark.json"]
    status = client.predict("1x4", ["operator"], ["flash"], 1, api_name="/benchmark")[0]
    assert "a grid looks like" in status


def _browser():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; or set $CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed (pip install playwright; no browser download)")
    return sync_playwright


def test_browser_compare_and_error(server, tmp_path):
    sync_playwright = _browser()
    shot = Path(os.environ.get("APP_SCREENSHOT", tmp_path / "compare.png"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            elsewhere = []  # the page must work with no network: every request goes to the app itself
            page.on(
                "request", lambda r: None if r.url.startswith((server, "data:", "blob:")) else elsewhere.append(r.url)
            )
            page.set_default_timeout(60_000)
            page.goto(server)
            page.locator("#prompt textarea").wait_for()
            assert page.locator("#random-note").count() == (0 if TRAINED else 1)
            page.locator("#prompt textarea").fill("a red fox running through snow")
            page.locator("#preset input").click()
            page.get_by_role("option", name=SMALLEST_LABEL).click()
            for name in ("mhla-hybrid", "linear"):  # keep flash and mhla
                page.locator("#variants").get_by_label(name, exact=True).uncheck()
            page.locator("#generate").click()
            status = page.locator("#status")
            status.filter(has_text="Done: 2 variant(s)").wait_for(timeout=120_000)
            for name in ("flash", "mhla"):
                page.locator(f"#video-{name} video").wait_for(state="attached")
                assert page.locator(f"#video-{name} video").get_attribute("src")
                assert "per step:" in page.locator(f"#latency-{name}").inner_text()
            assert page.locator("#col-linear").is_hidden() and page.locator("#col-mhla-hybrid").is_hidden()
            note = "fine-tuned" if TRAINED else "converted, not fine-tuned"
            assert note in page.locator("#latency-mhla").inner_text()
            table = page.locator("#table").inner_text()
            assert "flash" in table and "mhla" in table and "1.00x" in table
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)

            # bad input shows a readable error in the page; the next request still succeeds
            page.locator("#prompt textarea").fill("")
            page.locator("#generate").click()
            status.filter(has_text="prompt is empty").wait_for()
            page.locator("#prompt textarea").fill("a paper boat in the rain")
            page.locator("#generate").click()
            status.filter(has_text="Done: 2 variant(s)").wait_for(timeout=120_000)
            assert not elsewhere, f"the page requested other hosts: {elsewhere[:5]}"
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")

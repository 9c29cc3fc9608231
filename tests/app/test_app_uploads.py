"""Issue 38, point 8: a file parameter accepts only what gradio received as an upload. A path outside the upload
folder (a server file, one that climbs out with .., a symlink planted inside the folder that points out) is
refused, and the file it names is never read or copied into gradio's cache: checked directly on
``app.inputs.image`` and through the launched page's HTTP API with hand-made payloads (gradio_client would
upload a local file first, which is the legitimate route)."""

import json
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app import inputs

SECRET = (32, 200, 7)  # the planted server file's colour: it must never reach a video or the cache


def _picture(path: Path, colour=SECRET) -> Path:
    Image.new("RGB", (24, 16), colour).save(path)
    return path


@pytest.fixture
def folders(tmp_path):
    uploads, outside = tmp_path / "uploads", tmp_path / "server"
    uploads.mkdir()
    outside.mkdir()
    secret = _picture(outside / "secret.png")
    (uploads / "link.png").symlink_to(secret)  # inside the folder by name, outside once resolved
    (uploads / "sub").mkdir()
    return uploads, secret


def _forbidden(uploads: Path, secret: Path) -> list[str]:
    rel = os.path.relpath(secret, uploads / "sub")
    return [str(secret), str(uploads / "sub" / rel), str(uploads / "link.png"), "/etc/hostname", "../../etc/passwd"]


def test_a_path_outside_the_upload_folder_is_refused_unread(folders, monkeypatch):
    uploads, secret = folders
    opened: list[str] = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    for raw in _forbidden(uploads, secret):
        for value in ({"path": raw}, {"path": raw, "meta": {"_type": "gradio.FileData"}}):
            with pytest.raises(ValueError, match="not an upload of this page") as err:
                inputs.image("first frame", value, [uploads])
            assert str(uploads.parent) not in str(err.value) and "/etc" not in str(err.value)
    assert opened == []  # refused before anything was opened
    inside = _picture(uploads / "sub" / "ok.png", (1, 2, 3))
    assert inputs.image("first frame", {"path": str(inside)}, [uploads]).getpixel((0, 0)) == (1, 2, 3)


def test_a_relative_path_is_not_read_from_the_server_s_working_directory(folders, monkeypatch, tmp_path):
    uploads, _ = folders
    _picture(tmp_path / "here.png")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="not an upload of this page"):
        inputs.image("first frame", {"path": "here.png"}, [uploads])


# ---- through the launched page's API ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v_page(tmp_path_factory):
    pytest.importorskip("ftfy")
    import gradio as gr

    from app.models import load_app_models
    from app.ui import build_demo
    from pipelines.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("page")
    os.environ["GRADIO_TEMP_DIR"] = str(root / "gradio")  # this test's own upload folder and cache
    try:
        models = load_app_models(
            save_tiny_model("wan2.2-i2v", root / "i2v", num_layers=2), device="cpu", dtype="float32"
        )
        demo = build_demo(models, out_root=root / "out")
        demo.queue().launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True)
        try:
            yield demo, Path(gr.utils.get_upload_folder()), root
        finally:
            demo.close()
    finally:
        os.environ.pop("GRADIO_TEMP_DIR", None)


def _call(url: str, data: list) -> str:
    """The /compare endpoint through gradio's HTTP API; the event stream's text."""
    request = urllib.request.Request(
        url + "gradio_api/call/compare", json.dumps({"data": data}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        event = json.loads(r.read())["event_id"]
    with urllib.request.urlopen(f"{url}gradio_api/call/compare/{event}", timeout=300) as r:
        return r.read().decode()


def _colour_in_cache(folder: Path) -> list[Path]:
    """Files under gradio's cache that hold the planted picture (copied there)."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                with Image.open(path) as img:
                    if np.all(np.asarray(img.convert("RGB")) == SECRET):
                        found.append(path)
            except Exception:
                continue
    return found


def _error_message(stream: str) -> str | None:
    """The message of the event stream's error event (gradio sends ``data: null`` or ``{"error": null}`` for an
    exception it does not show)."""
    lines = stream.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line == "event: error":
            data = json.loads(lines[i + 1].removeprefix("data: "))
            return data.get("error") if isinstance(data, dict) else data
    return None


@pytest.mark.slow  # launches a page on a tiny image-to-video model
def test_the_api_refuses_a_server_path_and_copies_nothing(i2v_page, caplog, capfd):
    demo, uploads, root = i2v_page
    outside = root / "server"
    outside.mkdir(exist_ok=True)
    secret = _picture(outside / "secret.png")
    uploads.mkdir(parents=True, exist_ok=True)
    (uploads / "sub").mkdir(exist_ok=True)
    link = uploads / "link.png"
    if not link.exists():
        link.symlink_to(secret)
    args = ["a fox", "", 0, 1, 5.0, "9x64x96", ["mhla"], 1]
    capfd.readouterr()
    calls = 0
    with caplog.at_level("WARNING", logger="app"):
        for raw in _forbidden(uploads, secret):
            for value in ({"path": raw, "meta": {"_type": "gradio.FileData"}}, {"path": raw}):
                text = _call(demo.local_url, [*args, value])
                calls += 1
                assert "event: error" in text, (raw, text[-500:])
                assert "event: complete" not in text
                # one sentence naming the input and why, whichever layer (gradio's or the app's) refused it
                message = _error_message(text)
                assert message and "first frame" in message.lower() and "upload" in message, (raw, text[-500:])
                assert "/etc" not in message and str(outside) not in message
    assert _colour_in_cache(uploads) == []
    refusals = [r for r in caplog.records if r.getMessage().startswith("refused input:")]
    assert len(refusals) == calls, [r.getMessage() for r in caplog.records]
    logged = capfd.readouterr()
    assert "Traceback" not in logged.err + logged.out, (logged.err + logged.out)[-2000:]

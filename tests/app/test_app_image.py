"""The app's image input (issue 32): shown and required for an image-to-video model, absent for a text-to-video
one; an upload is read only from gradio's upload folder and only when it decodes as a picture."""

from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from app import compare, inputs
from app.models import load_app_models
from pipelines.tiny import save_tiny_model

PRESET = "9x64x96"


@pytest.fixture(scope="module", params=["wan2.2-i2v", "wan2.1-i2v"])  # without and with a CLIP image encoder
def i2v(tmp_path_factory, request):
    pytest.importorskip("ftfy")  # WanImageToVideoPipeline needs it at call time
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp("tiny") / "i2v", num_layers=3)
    return load_app_models(folder, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def t2v():
    return load_app_models("tiny-random", device="cpu", dtype="float32")


@pytest.fixture
def uploads(tmp_path):
    """A stand-in for gradio's upload folder, with a picture and a file that is not one."""
    folder = tmp_path / "uploads"
    folder.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(folder / "a.png")
    (folder / "notes.png").write_text("not a picture")
    return folder


def _check(models, image, upload_dirs=()):
    return compare.check_request(
        models, "a fox", "", 0, 1, 5.0, PRESET, ["flash", "mhla"], image=image, upload_dirs=list(upload_dirs)
    )


def test_the_model_says_whether_it_takes_an_image(i2v, t2v):
    assert i2v.needs_image and i2v.takes_image
    assert not t2v.needs_image and not t2v.takes_image


def test_an_image_to_video_model_needs_the_first_frame(i2v, uploads):
    with pytest.raises(ValueError, match="upload the first frame"):
        _check(i2v, None, [uploads])
    request = _check(i2v, {"path": str(uploads / "a.png"), "orig_name": "a.png"}, [uploads])
    assert isinstance(request.image, Image.Image) and request.image.size == (60, 40) and request.image.mode == "RGB"


def test_a_text_to_video_model_refuses_an_image(t2v, uploads):
    with pytest.raises(ValueError, match="text-to-video: it takes no image"):
        _check(t2v, {"path": str(uploads / "a.png")}, [uploads])


def test_an_upload_path_is_not_trusted(i2v, uploads, tmp_path):
    outside = tmp_path / "elsewhere.png"
    Image.new("RGB", (8, 8)).save(outside)
    for value in ({"path": str(outside)}, {"path": str(uploads / ".." / "elsewhere.png")}, {"path": "/etc/passwd"}):
        with pytest.raises(ValueError, match="not an upload of this page") as err:
            _check(i2v, value, [uploads])
        assert str(tmp_path) not in str(err.value)  # the server's paths never reach the browser
    with pytest.raises(ValueError, match="not a readable image"):
        _check(i2v, {"path": str(uploads / "notes.png")}, [uploads])
    for value in ("a.png", ["a.png"], {"url": "http://example.com/a.png"}):
        with pytest.raises(ValueError, match="must be an uploaded image file"):
            inputs.image("image", value, [uploads])


def test_a_compare_run_starts_from_the_image(i2v, uploads, tmp_path):
    request = _check(i2v, {"path": str(uploads / "a.png")}, [uploads])
    result = compare.run_compare(i2v, replace(request, variants=["mhla"]), tmp_path / "run")
    run = result.run("mhla")
    assert run.error is None and run.video is not None and run.video.is_file()
    record = compare.result_to_dict(result)  # a result is stored without the image
    assert "image" not in record["request"]


@pytest.mark.slow  # builds the Gradio page twice
def test_the_page_shows_the_image_input_only_for_a_model_that_takes_one(i2v, t2v, tmp_path):
    from app.ui import build_demo

    for models, shown in ((i2v, True), (t2v, False)):
        demo = build_demo(models, out_root=tmp_path / str(shown))
        images = [c for c in demo.config["components"] if c.get("props", {}).get("elem_id") == "image"]
        assert len(images) == 1 and images[0]["props"]["visible"] is shown
        params = [p["parameter_name"] for p in demo.get_api_info()["named_endpoints"]["/compare"]["parameters"]]
        assert ("image" in params) is shown and params[:8][-1] == "repeats"

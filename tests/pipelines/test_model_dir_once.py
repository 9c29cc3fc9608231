"""Issue 51 (2): one description of a model folder per run. The CLI builds one :class:`ModelDir`, checks it once and
hands it to loading: ``model_index.json`` is read once in a whole run's checks and loading, and the transformer's
``config.json`` once by the project's code (diffusers' ``from_pretrained`` reads it once more itself)."""

from __future__ import annotations

import builtins
import collections
import io
import pathlib
import traceback

import pytest

from pipelines.model_dir import ModelDir, check_model_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a tiny model folder written and loaded: several seconds on a 2-core CPU


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from pipelines.tiny import save_tiny_model

    out = tmp_path_factory.mktemp("model") / "tiny"
    save_tiny_model("wan2.1-t2v", out)
    return out


class Reads:
    """Counts the opens of each file under ``root``, and whether the project's code (not a library) opened it."""

    def __init__(self, root: pathlib.Path):
        self.root = str(root)
        self.all: collections.Counter[str] = collections.Counter()
        self.ours: collections.Counter[str] = collections.Counter()

    def note(self, path) -> None:
        name = str(path)
        if name.startswith(self.root):
            rel = name[len(self.root) + 1 :]
            self.all[rel] += 1
            # the nearest frame outside pathlib, json and io: the caller that asked for the file
            callers = [f.filename for f in traceback.extract_stack()[:-2] if "pathlib" not in f.filename]
            ours = callers and callers[-1].startswith(str(ROOT)) and "site-packages" not in callers[-1]
            if ours and "/tests/" not in callers[-1]:
                self.ours[rel] += 1


@pytest.fixture
def reads(monkeypatch, tiny_folder):
    seen = Reads(tiny_folder)
    real_open = builtins.open

    def spy_open(file, *args, **kwargs):  # Path.read_text / read_bytes / open go through io.open too
        if isinstance(file, (str, pathlib.PurePath)):
            seen.note(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(io, "open", spy_open)
    return seen


def test_a_cli_run_reads_the_model_index_once(reads, tiny_folder, tmp_path):
    from pipelines import cli

    args = cli._parse_args(
        ["--model", str(tiny_folder), "--prompt", "a red square", "--variant", "mhla", "--steps", "1"]
        + ["--out", str(tmp_path / "v.mp4"), "--no-progress"]
    )
    plan = cli._preflight(args)
    components = cli._load(plan)
    assert components.transformer is not None
    assert reads.all["model_index.json"] == 1, reads.all
    assert reads.ours["transformer/config.json"] == 1, reads.ours
    assert reads.ours["vae/config.json"] == 1, reads.ours


def test_the_counter_sees_reads(reads, tiny_folder):
    """The check above could pass by counting nothing: two fresh descriptions read the index twice."""
    check_model_dir(tiny_folder)
    check_model_dir(tiny_folder)
    assert reads.all["model_index.json"] == 2


def test_a_model_dir_is_checked_once(reads, tiny_folder):
    folder = ModelDir(tiny_folder)
    assert folder.check() == tiny_folder and check_model_dir(folder) == tiny_folder
    assert folder.index.pipeline_class == "WanPipeline" and not folder.missing_files
    assert reads.all["model_index.json"] == 1


def test_a_folder_missing_a_part_or_of_another_pipeline_is_named(tmp_path, tiny_folder):
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(FileNotFoundError, match="missing: vae/config.json"):
        ModelDir(broken).check()
    index = json.loads((broken / "model_index.json").read_text())
    (broken / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="is a 'FluxPipeline'"):  # the class first, before the missing part
        ModelDir(broken).check()

"""Issue 53 (5): corruption caught, not trusted. A latent cache (``python -m training.precompute``) carries checksums
(``training/cache.py``): a truncated or bit-flipped entry, ``empty_text`` or index is refused naming the file (exit 2
at the error boundary, no traceback), never trained on as garbage; a re-run of precompute writes a damaged entry
again; a cache written before checksums still loads, with a note. A checkpoint's weights and manifest likewise
(``training/checkpoint.py``'s SHA-256 manifest)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch

from tests.boundary import assert_refused

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "finetune" / "tiny.yaml")


def tensors_of(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"latents": torch.randn(16, 3, 8, 12, generator=g), "text": torch.randn(8, 32, generator=g)}


def make_cache(root: Path, n: int = 4, checksums: bool = True) -> Path:
    """A cache as precompute writes it (its writer and index sealing, no model), or as it was written before
    checksums (plain safetensors files, an index of files and captions)."""
    from safetensors.torch import save_file

    from training import cache
    from training.precompute import _atomic_save

    root.mkdir(parents=True, exist_ok=True)
    items = [{"file": f"sample_{i:07d}.safetensors", "caption": f"clip {i}"} for i in range(n)]
    for i, item in enumerate(items):
        if checksums:
            _atomic_save(tensors_of(i), root / item["file"], {"caption": item["caption"]})
        else:
            save_file(tensors_of(i), root / item["file"], metadata={"caption": item["caption"]})
    (save_file if not checksums else _atomic_save)({"text": torch.zeros(8, 32)}, root / "empty_text.safetensors")
    index = {"video": [9, 64, 96], "model": "test", "max_sequence_length": 8, "items": items}
    if checksums:
        index = cache.seal_index(root, index)
    (root / "index.json").write_text(json.dumps(index, indent=1))
    return root


def data_start(path: Path) -> int:
    """Where a safetensors file's tensor bytes begin (after its 8-byte length and JSON header)."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def flip(path: Path, at: int) -> None:
    """One byte of ``path`` changed in place: the size stays, as with a bit rot or a bad copy."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x55
    path.write_bytes(bytes(raw))


def cut(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def verify(root: Path, capsys) -> tuple[int, str, str]:
    from training.precompute import main

    code = main(["--out", str(root), "--verify"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_intact_cache_loads_what_was_written_and_verifies(tmp_path, capsys):
    from training.data import CachedLatents

    root = make_cache(tmp_path / "cache")
    data = CachedLatents(root)
    for i in range(4):
        assert all(torch.equal(data[i][k], v) for k, v in tensors_of(i).items())
    assert torch.equal(data.empty_text, torch.zeros(8, 32))
    assert verify(root, capsys)[:2] == (0, f"cache {str(root)!r}: all 4 entries and empty_text match their checksums\n")
    index = json.loads((root / "index.json").read_text())
    item = index["items"][1]
    assert item["bytes"] == (root / item["file"]).stat().st_size and len(item["sha256"]) == 64


DAMAGE = {
    # name: (how, when it is found: "open" / "load" (reading entry 2), what the refusal says)
    "entry cut short": (lambda r: cut(r / "sample_0000002.safetensors"), "open", r"sample_0000002.safetensors' has \d+ bytes, the index says \d+ \(truncated"),
    "entry bit-flipped": (lambda r: flip(r / "sample_0000002.safetensors", -7), "load", r"sample_0000002.safetensors' does not match its SHA-256 in"),
    "entry header damaged": (lambda r: flip(r / "sample_0000002.safetensors", 8), "load", r"sample_0000002.safetensors' has no readable safetensors header"),
    "entry missing": (lambda r: (r / "sample_0000002.safetensors").unlink(), "open", r"sample_0000002.safetensors' is missing"),
    "empty_text bit-flipped": (lambda r: flip(r / "empty_text.safetensors", -3), "open", r"empty_text.safetensors' does not match its SHA-256"),
    "index cut short": (lambda r: cut(r / "index.json"), "open", r"cache index '.*index.json' is not readable JSON"),
    "index changed": (lambda r: (r / "index.json").write_text((r / "index.json").read_text().replace("clip 2", "clip 7")), "open", r"index.json' does not match its own checksum"),
}  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_file_is_refused_naming_it_never_read_as_garbage(tmp_path, capsys, monkeypatch, damage):
    from training import finetune
    from training.cache import CacheDamaged
    from training.data import CachedLatents

    how, when, says = DAMAGE[damage]
    root = make_cache(tmp_path / "cache")
    how(root)
    if when == "open":
        with pytest.raises(CacheDamaged, match=says) as refused:
            CachedLatents(root)
    else:
        data = CachedLatents(root)  # the open-time check reads sizes only: a same-size change is found on reading
        assert torch.equal(data[1]["latents"], tensors_of(1)["latents"])
        with pytest.raises(CacheDamaged, match=says) as refused:
            data[2]
    assert f"run `python -m training.precompute` with the cache's config and --out {str(root)!r} again" in str(
        refused.value
    )
    # at the error boundary: --verify names it, exit 2, one paragraph and no traceback
    code, out, err = verify(root, capsys)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err and "unexpected" not in err, err
    assert len(err.strip().splitlines()) == 1 and re.search(says, err), err
    if when == "open":  # a training run on it stops before the model loads
        monkeypatch.setattr(finetune, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
        argv = ["--config", TINY, f"run_dir={tmp_path / 'run'}", "data.source=cache", f"data.path={root}"]
        err = assert_refused(finetune.main, [*argv, "train.steps=1", "log.tensorboard=false"], capsys, tmp_path)
        assert re.search(says, err) and len(err.strip().splitlines()) == 1, err


def test_a_damaged_settings_record_is_named_before_precompute_loads_a_model(tmp_path, capsys, monkeypatch):
    from training import precompute

    root = make_cache(tmp_path / "cache")
    (root / precompute.RECORD).write_text('{"data": {"source": "synthetic", "num_sam')  # cut short
    monkeypatch.setattr(precompute, "load_components", lambda *a, **k: pytest.fail("a model loaded"))
    err = assert_refused(precompute.main, ["--config", TINY, "--out", str(root)], capsys, tmp_path)
    assert f"error: {str(root / precompute.RECORD)!r} is not readable JSON" in err


def test_a_bit_flip_in_an_entry_would_have_been_read_as_other_numbers(tmp_path):
    """What the checksum guards against: safetensors reads a same-size change without complaint."""
    from safetensors.torch import load_file

    root = make_cache(tmp_path / "cache")
    flip(root / "sample_0000002.safetensors", -7)
    read = load_file(root / "sample_0000002.safetensors")
    assert any(not torch.equal(read[k], v) for k, v in tensors_of(2).items())


def test_a_cache_written_before_checksums_still_loads_with_a_note(tmp_path, capsys):
    from training.cache import CacheDamaged
    from training.data import CachedLatents

    root = make_cache(tmp_path / "old", checksums=False)
    data = CachedLatents(root)
    err = capsys.readouterr().err
    assert f"note: cache {str(root)!r} was written without checksums" in err
    assert all(torch.equal(data[i]["latents"], tensors_of(i)["latents"]) for i in range(4))
    CachedLatents(root)
    assert capsys.readouterr().err == ""  # said once
    code, out, _ = verify(root, capsys)
    assert code == 0 and "all 4 entries and empty_text read (written without checksums" in out
    cut(root / "sample_0000001.safetensors")  # without a checksum a cut-short entry is still named, never read
    with pytest.raises(CacheDamaged, match=r"sample_0000001.safetensors' is not a readable safetensors file"):
        data[1]


def test_a_checkpoint_with_a_flipped_weight_file_or_a_damaged_manifest_is_skipped_naming_it(tmp_path):
    from safetensors.torch import save_file

    from training import checkpoint as ckpt

    run = tmp_path / "run"
    for step in (1, 2, 3):
        tmp = ckpt.begin_checkpoint(run, step)
        (tmp / "transformer").mkdir()
        save_file(tensors_of(step), tmp / "transformer" / "diffusion_pytorch_model.safetensors")
        torch.save({"step": step}, tmp / ckpt.STATE_FILE)
        ckpt.finish_checkpoint(run, step)
    weights = ckpt.checkpoint_dir(run, 3) / "transformer" / "diffusion_pytorch_model.safetensors"
    flip(weights, -5)
    manifest = ckpt.checkpoint_dir(run, 2) / ckpt.MANIFEST
    manifest.write_text(manifest.read_text()[:40])
    with pytest.warns(UserWarning) as caught:
        assert ckpt.resolve_resume("latest", run) == ckpt.checkpoint_dir(run, 1)
    said = [str(w.message) for w in caught]
    assert any(str(weights) in x and "does not match its SHA-256" in x for x in said), said
    assert any(str(manifest) in x and "is not a readable manifest" in x for x in said), said
    with pytest.raises(ValueError, match=rf"not an intact checkpoint: {weights}"):
        ckpt.resolve_resume(str(ckpt.checkpoint_dir(run, 3)), run)


@pytest.mark.slow  # precompute and train the tiny model
def test_precompute_writes_a_damaged_entry_again_and_training_refuses_one_by_name(tmp_path, capsys):
    """The whole way: precompute a cache, damage entries, train on it (refused by name, also when the entry is read
    in a DataLoader worker), re-run precompute (the damaged entries written again, the others left), train."""
    from training.finetune import main as finetune
    from training.precompute import main as precompute

    root = tmp_path / "cache"
    base = ["--config", TINY, "data.num_samples=6"]
    assert precompute([*base, "--out", str(root)]) == 0
    capsys.readouterr()
    names = [f"sample_{i:07d}.safetensors" for i in range(6)]
    original = {n: (root / n).read_bytes() for n in names}
    flip(root / names[5], -9)  # read by the worker in the first epoch, not by the evaluation (entries 0-3)
    train = [*base, "data.source=cache", f"data.path={root}", "log.tensorboard=false", "train.steps=3"]
    train += ["data.num_workers=1", "checkpoint.every=0", "validation.loss_batches=2"]
    err = assert_refused(finetune, [*train, f"run_dir={tmp_path / 'run'}"], capsys, root)
    assert f"cache entry {str(root / names[5])!r} does not match its SHA-256" in err, err
    assert "Caught" not in err and "Traceback" not in err  # torch's worker traceback left out of the message
    assert [x for x in err.splitlines() if not x.startswith("\rfine-tune") and "it/s" not in x][-1].startswith(
        "error: "
    )
    cut(root / names[1])
    before = {n: os.stat(root / n).st_ino for n in names}
    assert precompute([*base, "--out", str(root)]) == 0
    err = capsys.readouterr().err
    assert f"cache entry {str(root / names[5])!r} does not match the SHA-256 in its header" in err
    assert f"{names[1]}" in err and "written again" in err
    again = {n: os.stat(root / n).st_ino for n in names}
    assert [n for n in names if again[n] != before[n]] == [names[1], names[5]]  # only those written again
    from safetensors.torch import load

    for n in names:  # as the first run wrote them (latents encoded in another batch: equal to float rounding)
        if n in (names[1], names[5]):
            was, now = load(original[n]), load((root / n).read_bytes())
            torch.testing.assert_close(now["latents"], was["latents"], rtol=0, atol=1e-5)
            assert torch.equal(now["text"], was["text"])
        else:
            assert (root / n).read_bytes() == original[n]
    code, out, _ = verify(root, capsys)
    assert code == 0 and "all 6 entries and empty_text match" in out
    assert finetune([*train, f"run_dir={tmp_path / 'run2'}"]) == 0
    # a cache written before checksums (the built-in model's): trained on as it is; a re-run of precompute adds them
    index = json.loads((root / "index.json").read_text())
    old = {k: v for k, v in index.items() if k not in ("index_sha256", "empty_text")}
    old["items"] = [{"file": it["file"], "caption": it["caption"]} for it in index["items"]]
    (root / "index.json").write_text(json.dumps(old))
    capsys.readouterr()
    assert finetune([*train, f"run_dir={tmp_path / 'run3'}"]) == 0
    assert "was written without checksums" in capsys.readouterr().err
    assert precompute([*base, "--out", str(root)]) == 0
    assert json.loads((root / "index.json").read_text()) == index

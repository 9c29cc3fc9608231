"""The one-call GPU build (issue 49, item 3) on its CPU dry path: what it brings back fits the device's limits
(8 files with the caller's log, 16 MiB each, 2 folders below $OUT, plain names), ``import`` lays it out as
``factory.next save-checkpoint --half`` / ``save-variant`` would and the product's loaders load it, the latents it
trains on are the training encoder's (and the VAE's posterior mean normalised by hand), and a deadline cuts a
build to what finished. Every import writes into a copy of the committed design, never into assets/."""

import json
import re
import shutil
from dataclasses import replace

import pytest
import torch

from factory import gpu_build
from factory.v3 import NEXT

ALLOWED = re.compile(r"^[A-Za-z0-9._-]+$")
PART_FILES = {f"{p}.safetensors" for p in gpu_build.PARTS}


def _design_copy(tmp_path):
    """A copy of the committed design folder (its curves left out): what an import may write into."""
    into = tmp_path / "design" / "v3"
    shutil.copytree(NEXT, into, ignore=shutil.ignore_patterns("curves"))
    return into


def _hashes(folder):
    return {str(f.relative_to(folder)): gpu_build.sha256(f) for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One dry build, as benchmarks/run_gpu.sh's build stage calls it: ``--out $OUT/builtin``."""
    device_out = tmp_path_factory.mktemp("device-out")
    out = device_out / "builtin"
    argv = ["--out", str(out), "--deadline-s", "900", "--dry-run", "--clips", "4", "--stills", "8", "--batch", "2"]
    return device_out, out, gpu_build.main(argv)


@pytest.mark.slow
def test_the_dry_build_brings_back_what_the_device_returns(built):
    device_out, out, rc = built
    assert rc == 0
    files = [f for f in device_out.rglob("*") if f.is_file()]
    assert len(files) + 1 <= 8  # the caller's log is the eighth
    for f in files:
        rel = f.relative_to(device_out)
        assert f.stat().st_size <= 16 * 2**20, rel
        assert len(rel.parts) - 1 <= 2, rel  # folders below $OUT
        assert all(ALLOWED.match(part) for part in rel.parts), rel
    assert {f.name for f in files} == {"build.json", *PART_FILES}
    assert gpu_build.limits_problems(out) == []
    data = gpu_build.read_build(out)  # every file's hash checked
    assert sorted(data["parts"]) == sorted(gpu_build.PARTS)
    phases = data["results"]["phases"]
    assert data["results"]["complete"] is True
    assert phases["data"]["clips"] == 4 and phases["data"]["stills"] == 8
    assert phases["data"]["latent_shape"] == [16, 5, 16, 20]
    assert phases["base"]["steps"] == 3 and phases["base"]["batch_stills"] == 2  # image ratio 1 in the dry run
    assert phases["base"]["samples"] == 3 * (2 + 2)
    for v in gpu_build.CONVERSIONS:
        assert phases["convert"][v]["steps"] == 3 and phases["convert"][v]["batch_stills"] == 0
        assert data["parts"][v]["base_ema_sha256"] == data["parts"]["transformer-ema"]["sha256"]
    ev = phases["eval"]
    assert set(ev["probe"]) == set(ev["heldout_loss"]) == set(ev["semantic"]) == {"flash", *gpu_build.CONVERSIONS}
    assert all(r["videos"] == 1 for r in ev["semantic"].values())
    from safetensors.torch import load_file

    for name in gpu_build.PARTS:
        weights = load_file(str(out / f"{name}.safetensors"))
        assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float16}, name
        config = json.loads(data["parts"][name]["config_json"])
        assert config["self_attention"]["variant"] == (name if name in gpu_build.CONVERSIONS else "flash")
        assert config["_name_or_path"] == "assets/builtin-next/v3/transformer"  # the repository's, not a machine's


@pytest.mark.slow
def test_import_lays_out_folders_the_product_loads(built, tmp_path):
    from factory import next as nxt
    from factory.v3 import init
    from pipelines import load_components, load_transformer

    _, out, rc = built
    assert rc == 0
    committed = _hashes(NEXT)
    into = _design_copy(tmp_path)
    assert gpu_build.main(["import", str(out), "--into", str(into)]) == 0
    data = gpu_build.read_build(out)
    for part in data["parts"].values():
        folder = into / part["folder"]
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
        assert (folder / "config.json").read_text() == part["config_json"]
        assert (folder / "diffusion_pytorch_model.safetensors").read_bytes() == (out / part["file"]).read_bytes()
    assert not [p.name for p in into.iterdir() if p.name.startswith(".")]  # no staging folders left
    # the working model folder laid from the design, as factory.v3 init lays it: its variants are the imported ones
    components = load_components(init(tmp_path / "model", next_dir=into), dtype=torch.float32, device="cpu")
    assert sorted(components.variant_dirs) == sorted(gpu_build.CONVERSIONS)
    raw = load_transformer(into / "transformer", dtype=torch.float32, device="cpu").state_dict()
    for key, value in components.transformer.state_dict().items():
        torch.testing.assert_close(value, raw[key], rtol=0, atol=0)
    for v, folder in components.variant_dirs.items():
        model = load_transformer(folder, dtype=torch.float32, device="cpu")
        assert model.config["self_attention"]["variant"] == v
        if v == "mhla-hybrid":  # the split the committed hybrid config names, else the default
            want = gpu_build.config_layers(v) or [i for i in range(len(model.blocks)) if i % 3]
            assert list(model.conversion.linear_layers) == want
    ema = load_transformer(into / "transformer-ema", dtype=torch.float32, device="cpu")  # pipelines.cli --transformer
    assert ema.config["self_attention"]["variant"] == "flash"
    # save-variant and save --half of the imported folders write the same bytes: they are already in that format
    other = tmp_path / "other"
    for v in gpu_build.CONVERSIONS:
        again = nxt.save_variant(v, into / "variants" / v, next_dir=other)
        for f in ("config.json", "diffusion_pytorch_model.safetensors"):
            assert (again / f).read_bytes() == (into / "variants" / v / f).read_bytes()
    again = nxt.save("transformer-ema", into / "transformer-ema", other, half=True)
    assert (again / "diffusion_pytorch_model.safetensors").read_bytes() == (
        out / "transformer-ema.safetensors"
    ).read_bytes()
    assert _hashes(NEXT) == committed  # the committed design is untouched


@pytest.mark.slow
def test_import_refuses_what_does_not_fit_and_leaves_the_folder_whole(built, tmp_path, capsys):
    _, out, rc = built
    assert rc == 0
    into = _design_copy(tmp_path)
    before = _hashes(into)
    # a file that is not the one build.json hashed
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    blob = bytearray((bad / "mhla.safetensors").read_bytes())
    blob[-1] ^= 1
    (bad / "mhla.safetensors").write_bytes(bytes(blob))
    assert gpu_build.main(["import", str(bad), "--into", str(into)]) == 2
    assert "mhla.safetensors" in capsys.readouterr().err
    # conversions without their base: the committed transformer-ema is not the EMA they were converted from
    orphans = tmp_path / "orphans"
    shutil.copytree(out, orphans)
    data = json.loads((orphans / "build.json").read_text())
    for name in ("transformer", "transformer-ema"):
        del data["parts"][name]
        (orphans / f"{name}.safetensors").unlink()
    (orphans / "build.json").write_text(json.dumps(data))
    assert gpu_build.main(["import", str(orphans), "--into", str(into)]) == 2
    assert "converted from a base EMA" in capsys.readouterr().err
    # a design whose VAE is another one: the latents the parts were trained on are not its latents
    other_vae = _design_copy(tmp_path / "x")
    blob = bytearray((other_vae / "vae" / "diffusion_pytorch_model.safetensors").read_bytes())
    blob[-1] ^= 1
    (other_vae / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(bytes(blob))
    assert gpu_build.main(["import", str(out), "--into", str(other_vae)]) == 2
    assert "not the vae the build encoded with" in capsys.readouterr().err
    assert _hashes(into) == before


@pytest.mark.slow
def test_rendered_then_encoded_latents_are_the_training_encoders(tmp_path):
    """The build's device tensors against the recipe read independently: the dataset's clip and still of the same
    index through :class:`training.encoding.Encoder`, and through the VAE's posterior mean normalised here with the
    VAE config's ``latents_mean`` / ``latents_std``; captions and their embeddings, the empty caption last."""
    from factory.v3 import init
    from pipelines import load_components
    from training.encoding import Encoder
    from world.synthetic import SyntheticVideoDataset, world_named

    renderer = gpu_build.Renderer(2, 2, seed=0, workers=1)  # forked before anything else runs
    components = load_components(init(tmp_path / "model", next_dir=NEXT), dtype=torch.float32, device="cpu")
    encoder = Encoder(components, 16)
    clock = gpu_build.Clock(600)
    cache = gpu_build.encode_rendered(renderer, encoder, clock.now() + 600, clock)
    assert cache.clips.shape == (2, 16, 5, 16, 20) and cache.stills.shape == (2, 16, 1, 16, 20)
    vae = components.vae
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    world = world_named("v3")
    clips = SyntheticVideoDataset(2, seed=0, num_frames=9, height=64, width=80, world=world)
    stills = SyntheticVideoDataset(2, seed=0, num_frames=1, height=64, width=80, world=world, images=True)
    for data, latents, ids in ((clips, cache.clips, cache.clip_text), (stills, cache.stills, cache.still_text)):
        for i in range(2):
            item = data[i]
            with torch.no_grad():
                by_hand = (vae.encode(item["video"][None]).latent_dist.mean[0] - mean) / std
            torch.testing.assert_close(latents[i], encoder.latents(item["video"][None])[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(latents[i], by_hand, rtol=1e-4, atol=1e-4)
            assert cache.captions[int(ids[i])] == item["caption"]
            torch.testing.assert_close(cache.text[ids[i]], encoder.text([item["caption"]])[0])
    assert not any("moves" in cache.captions[int(i)] for i in cache.still_text)  # stills name no motion
    torch.testing.assert_close(cache.text[cache.empty], encoder.text([""])[0])
    # caption dropout: every caption replaced by the empty one at probability 1, none at 0
    g = torch.Generator().manual_seed(0)
    torch.testing.assert_close(cache.text_batch(cache.clip_text, g, 1.0), cache.text[[cache.empty] * 2])
    torch.testing.assert_close(cache.text_batch(cache.clip_text, g, 0.0), cache.text[cache.clip_text])


def test_workers_render_what_the_parent_would():
    """The worker processes' chunks, in order, are the ones rendered in this process (the fall-back without them)."""
    import numpy as np

    pooled, inline = gpu_build.Renderer(3, 5, workers=2), gpu_build.Renderer(3, 5, workers=2, inline=True)
    try:
        for _ in pooled:
            a, b = pooled.next(60), inline.next(60)
            assert a[:2] == b[:2] and a[3] == b[3]
            np.testing.assert_array_equal(a[2], b[2])
    finally:
        pooled.close(True)
    assert [t[0] for t in pooled.tasks].count("clips") >= 2  # each worker gets chunks of both kinds to render


@pytest.mark.slow
def test_a_deadline_of_zero_leaves_a_valid_build_of_nothing(tmp_path, capsys):
    out = tmp_path / "builtin"
    assert gpu_build.main(["--out", str(out), "--deadline-s", "0", "--dry-run"]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["build.json"]
    data = gpu_build.read_build(out)
    assert data["parts"] == {} and data["results"]["complete"] is False
    assert all("skipped" in data["results"]["phases"][p] for p in ("data", "base", "convert", "eval"))
    into = _design_copy(tmp_path)
    before = _hashes(into)
    assert gpu_build.main(["import", str(out), "--into", str(into)]) == 2
    assert "no finished part" in capsys.readouterr().err
    assert _hashes(into) == before


@pytest.mark.slow
def test_a_phase_past_its_end_trains_nothing_and_one_in_time_adds_up():
    """:func:`factory.gpu_build.train` on a cache of random latents: past its end it takes no step (the phase then
    saves nothing, the last complete phase's weights stay); in time, its record counts what it trained."""
    from pipelines import load_transformer

    model = load_transformer(NEXT / "transformer", dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    cache = gpu_build.Cache(
        clips=torch.randn(4, 16, 5, 16, 20, generator=g),
        clip_text=torch.tensor([0, 1, 0, 1]),
        stills=torch.randn(4, 16, 1, 16, 20, generator=g),
        still_text=torch.tensor([1, 0, 1, 0]),
        text=torch.randn(3, 16, 64, generator=g),
        captions=["a red square", "a blue circle"],
    )
    s = replace(gpu_build.DRY, batch=2, log_every=10)
    stage = gpu_build.Stage("base", 2, 1e-3, 1, 0.9, 1.0)
    clock = gpu_build.Clock(600)
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    before = {k: v.clone() for k, v in model.state_dict().items()}
    record, ema = gpu_build.train(model, cache, stage, s, clock.now() - 1, clock, autocast)
    assert record["steps"] == 0 and record["cut_short"] and ema.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    record, ema = gpu_build.train(model, cache, stage, s, clock.now() + 600, clock, autocast)
    assert record["steps"] == 2 and not record["cut_short"] and ema.updates == 2
    assert record["samples"] == 2 * (2 + 2) and record["clips"] == 4 and record["stills"] == 4
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_phase_shares_follow_the_weights_of_the_phases_left():
    clock = gpu_build.Clock(100.0, reserve_s=10.0, start=0.0)
    clock.now = lambda: 10.0  # 80 s left before the reserve
    w = gpu_build.PHASE_WEIGHTS
    assert clock.share("base", ["base", "convert", "eval"]) == pytest.approx(
        10 + 80 * w["base"] / (w["base"] + w["convert"] + w["eval"])
    )
    assert clock.share("eval", ["eval"]) == pytest.approx(90.0)
    clock.now = lambda: 95.0
    assert clock.share("eval", ["eval"]) == 95.0  # past the deadline: no time, never negative


def test_bad_arguments_are_named_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cases = [
        (["--out", str(tmp_path / "a"), "--deadline-s", "-1"], "--deadline-s -1"),
        (["--out", str(tmp_path / "a"), "--deadline-s", "10", "--phases", "base,polish"], "--phases"),
        (["--out", str(tmp_path / "a"), "--deadline-s", "10", "--phases", "eval"], "--phases eval"),
        (["--out", str(tmp_path / "a"), "--deadline-s", "10", "--image-ratio", "nan"], "--image-ratio"),
        (["--out", str(out), "--deadline-s", "10", "--dry-run"], "notes.txt"),
        (["--out", str(tmp_path / "a"), "--deadline-s", "10", "--source", str(tmp_path)], "--source"),
        (["import", str(tmp_path / "nothing")], "build.json"),
    ]
    for argv, named in cases:
        assert gpu_build.main(argv) == 2, argv
        assert named in capsys.readouterr().err, argv
    assert (out / "notes.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_the_hybrids_layers_come_from_its_config(tmp_path):
    (tmp_path / "mhla-hybrid.yaml").write_text("model:\n  layers: [0, 1, 2, 3]\n")
    (tmp_path / "mhla.yaml").write_text("model:\n  variant: mhla\n")
    assert gpu_build.config_layers("mhla-hybrid", tmp_path) == [0, 1, 2, 3]
    assert gpu_build.config_layers("mhla", tmp_path) is None
    assert gpu_build.config_layers("linear", tmp_path) is None  # no config: the default

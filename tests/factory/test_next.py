"""The next design's stages resume from the repository: init lays committed stage weights over the shipped
model directory; save keeps only weights and configs, atomically, within the size budget."""

import json

import pytest

from factory import next as nxt


def _model_dir(root, vae_tag="shipped"):
    (root / "vae").mkdir(parents=True)
    (root / "vae" / "config.json").write_text(json.dumps({"tag": vae_tag}))
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps({"tag": "shipped"}))
    (root / "variants" / "mhla").mkdir(parents=True)
    (root / "model_index.json").write_text("{}")
    return root


def test_init_lays_stage_weights_over_the_shipped_model(tmp_path):
    base = _model_dir(tmp_path / "builtin")
    nxt_dir = tmp_path / "builtin-next"
    (nxt_dir / "vae").mkdir(parents=True)
    (nxt_dir / "vae" / "config.json").write_text(json.dumps({"tag": "stage"}))
    out = nxt.init(tmp_path / "runs" / "model", next_dir=nxt_dir, base=base)
    assert json.loads((out / "vae" / "config.json").read_text())["tag"] == "stage"
    assert json.loads((out / "transformer" / "config.json").read_text())["tag"] == "shipped"
    assert not (out / "variants").exists()
    assert not (out.with_name("model.tmp")).exists()


def test_init_lays_the_stages_builtin_json_keys_over_the_models(tmp_path):
    """A stage that changes the clip (base stage 2: 9 frames) records it in builtin-next/builtin.json:
    ``defaults`` merge key by key, other keys replace."""
    base = _model_dir(tmp_path / "builtin")
    info = {"defaults": {"num_frames": 17, "height": 128}, "block_shape": [2, 4, 4], "what": "shipped"}
    (base / "builtin.json").write_text(json.dumps(info))
    nxt_dir = tmp_path / "builtin-next"
    nxt_dir.mkdir()
    (nxt_dir / "builtin.json").write_text(json.dumps({"defaults": {"num_frames": 9}, "block_shape": [1, 4, 4]}))
    out = nxt.init(tmp_path / "model", next_dir=nxt_dir, base=base)
    got = json.loads((out / "builtin.json").read_text())
    assert got == {"defaults": {"num_frames": 9, "height": 128}, "block_shape": [1, 4, 4], "what": "shipped"}
    assert json.loads((base / "builtin.json").read_text()) == info  # the shipped model is untouched


def test_save_keeps_weights_only_and_replaces_in_place(tmp_path):
    src = tmp_path / "vae"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"x" * 1000)
    (src / "optimizer.pt").write_bytes(b"y" * 10)
    dst = nxt.save("vae", src, next_dir=tmp_path / "next")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"z" * 10)
    nxt.save("vae", src, next_dir=tmp_path / "next")
    assert (dst / "diffusion_pytorch_model.safetensors").read_bytes() == b"z" * 10
    assert sorted(p.name for p in (tmp_path / "next").iterdir()) == ["vae"]  # no staging folders left


def test_save_refuses_bad_input(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="part"):
        nxt.save("optimizer", tmp_path, next_dir=tmp_path / "next")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        nxt.save("vae", tmp_path / "missing", next_dir=tmp_path / "next")
    src = tmp_path / "big"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"x" * 3000)
    monkeypatch.setattr(nxt, "MAX_MB", 1000 / 2**20)
    with pytest.raises(ValueError, match="budget"):
        nxt.save("vae", src, next_dir=tmp_path / "next")
    assert not (tmp_path / "next" / "vae").exists()
    with pytest.raises(FileNotFoundError, match="model_index"):
        nxt.init(tmp_path / "out", next_dir=tmp_path / "next", base=tmp_path / "nothing")


def test_a_fresh_transformer_only_where_no_stage_has_saved_one(tmp_path):
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    base = _model_dir(tmp_path / "builtin")
    out = nxt.init(tmp_path / "model", next_dir=tmp_path / "none", base=base, fresh_transformer=True)
    fresh = WanTransformer3DModel.from_pretrained(str(out / "transformer"))
    assert fresh.config.num_layers == 6 and fresh.config.num_attention_heads * fresh.config.attention_head_dim == 128
    again = nxt.init(tmp_path / "model2", next_dir=tmp_path / "none", base=base, fresh_transformer=True)
    a = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(again / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # seeded: the same start on any machine
    staged = tmp_path / "next" / "transformer"
    staged.mkdir(parents=True)
    (staged / "config.json").write_text(json.dumps({"tag": "stage"}))
    kept = nxt.init(tmp_path / "model3", next_dir=tmp_path / "next", base=base, fresh_transformer=True)
    assert json.loads((kept / "transformer" / "config.json").read_text())["tag"] == "stage"


def test_the_second_designs_configs_are_valid(tmp_path):
    from training.config import load_config

    model = _model_dir(tmp_path / "model")
    cache = tmp_path / "cache"
    cache.mkdir()
    for name, extra in (("vae", []), ("base", [f"data.path={cache}"]), ("base2", [f"data.path={cache}"])):
        cfg = load_config(f"factory/configs/v2/{name}.yaml", [f"model.path={model}", *extra])
        assert cfg.data.world == "v2"
    assert load_config("factory/configs/v2/base.yaml", [f"model.path={model}", f"data.path={cache}"]).train.ema_decay
    with pytest.raises(ValueError, match="data.world"):
        load_config("factory/configs/v2/vae.yaml", [f"model.path={model}", "data.world=v7"])
    with pytest.raises(ValueError, match="default_background"):
        load_config("factory/configs/v2/vae.yaml", [f"model.path={model}", "data.default_background=striped"])


def test_save_checkpoint_keeps_the_raw_weights_and_the_emas(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "step-0000100"
    (ckpt / "transformer").mkdir(parents=True)
    (ckpt / "transformer" / "config.json").write_text("{}")
    ema = {"a": torch.randn(3), "b": torch.randn(2), "frozen": torch.randn(4)}
    raw = {"a": torch.randn(3), "b": torch.randn(2)}  # the trainable ones, un-averaged
    save_file(ema, str(ckpt / "transformer" / "diffusion_pytorch_model.safetensors"))
    save_file(raw, str(ckpt / "trainable.safetensors"))
    nxt.save_checkpoint(ckpt, next_dir=tmp_path / "next")
    got_ema = load_file(str(tmp_path / "next" / "transformer-ema" / "diffusion_pytorch_model.safetensors"))
    got_raw = load_file(str(tmp_path / "next" / "transformer" / "diffusion_pytorch_model.safetensors"))
    for k in ema:
        assert torch.equal(got_ema[k], ema[k])
    assert torch.equal(got_raw["a"], raw["a"]) and torch.equal(got_raw["b"], raw["b"])
    assert torch.equal(got_raw["frozen"], ema["frozen"])
    assert not (ckpt / ".raw-transformer").exists()
    # the step they were trained to, for a fresh machine's train.start_step
    assert json.loads((tmp_path / "next" / "stage.json").read_text()) == {"step": 100, "checkpoint": ckpt.name}
    save_file({"c": torch.randn(1)}, str(ckpt / "trainable.safetensors"))
    with pytest.raises(ValueError, match="does not"):
        nxt.save_checkpoint(ckpt, next_dir=tmp_path / "next")


def test_save_checkpoint_in_float16_into_a_design_folder_counts_the_whole_budget(tmp_path, monkeypatch):
    """``--half --into assets/builtin-next/v3``: both weights rounded to float16, and the 30 MB budget counts
    every design's files under assets/builtin-next, not only the subfolder's."""
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path / "builtin-next"
    monkeypatch.setattr(nxt, "NEXT_DIR", root)
    (root / "v2-stage").mkdir(parents=True)
    (root / "v2-stage" / "blob.safetensors").write_bytes(b"0" * (nxt.MAX_MB * 2**20 - 2048))
    ckpt = tmp_path / "step-0000100"
    (ckpt / "transformer").mkdir(parents=True)
    (ckpt / "transformer" / "config.json").write_text("{}")
    ema, raw = {"a": torch.randn(2048)}, {"a": torch.randn(2048)}
    save_file(ema, str(ckpt / "transformer" / "diffusion_pytorch_model.safetensors"))
    save_file(raw, str(ckpt / "trainable.safetensors"))
    with pytest.raises(ValueError, match="over its 30 MB budget"):  # 4 KB of float16 beside 30 MB less 2 KB elsewhere
        nxt.save_checkpoint(ckpt, next_dir=root / "v3", half=True)
    (root / "v2-stage" / "blob.safetensors").unlink()
    nxt.save_checkpoint(ckpt, next_dir=root / "v3", half=True)
    for part, want in (("transformer-ema", ema), ("transformer", raw)):
        got = load_file(str(root / "v3" / part / "diffusion_pytorch_model.safetensors"))
        assert got["a"].dtype == torch.float16
        torch.testing.assert_close(got["a"].float(), want["a"], rtol=2.0**-11, atol=2.0**-25)
    assert nxt.main(["save-checkpoint", "--into", str(tmp_path / "elsewhere"), str(ckpt)]) == 2


def _transformer_folder(root, variant, weights):
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    config = {"num_layers": 1} | ({"self_attention": {"variant": variant}} if variant != "flash" else {})
    (root / "config.json").write_text(json.dumps(config))
    save_file(weights, str(root / "diffusion_pytorch_model.safetensors"))
    return root


def test_save_variant_stores_a_conversion_in_float16_and_init_lays_it(tmp_path):
    """Three conversions fit the 30 MB beside the VAE and the base only in float16: the stored weights are the
    float32 ones rounded to the nearest float16 (integer tensors untouched), and init makes them the working
    model's variants/ so that an evaluation reads exactly what is committed."""
    import torch
    from safetensors.torch import load_file

    w = {"w": torch.randn(64, 64) * 0.02, "big": torch.tensor([3.0e4, -1.0e-3]), "ids": torch.arange(5)}
    ckpt = tmp_path / "step-0000300"
    _transformer_folder(ckpt / "transformer", "mhla", w)
    dst = nxt.save_variant("mhla", ckpt, next_dir=tmp_path / "next")
    assert dst == tmp_path / "next" / "variants" / "mhla"
    got = load_file(str(dst / "diffusion_pytorch_model.safetensors"))
    assert got["w"].dtype == torch.float16 and got["ids"].dtype == torch.int64
    assert torch.equal(got["ids"], w["ids"])
    for k in ("w", "big"):  # round to nearest: within half a float16 ulp of the float32 value
        err = (got[k].float() - w[k]).abs()
        assert bool((err <= w[k].abs() * 2.0**-11 + 2.0**-25).all()), k
    assert (dst / "diffusion_pytorch_model.safetensors").stat().st_size < 0.6 * (
        ckpt / "transformer" / "diffusion_pytorch_model.safetensors"
    ).stat().st_size
    assert sorted(p.name for p in (tmp_path / "next" / "variants").iterdir()) == ["mhla"]  # no staging left

    base = _model_dir(tmp_path / "builtin")
    out = nxt.init(tmp_path / "model", next_dir=tmp_path / "next", base=base)
    assert sorted(p.name for p in (out / "variants").iterdir()) == ["mhla"]
    assert json.loads((out / "variants" / "mhla" / "config.json").read_text())["self_attention"]["variant"] == "mhla"


def test_save_variant_refuses_the_wrong_transformer_and_weights_beyond_float16(tmp_path):
    import torch

    folder = _transformer_folder(tmp_path / "lin", "linear", {"w": torch.randn(4)})
    with pytest.raises(ValueError, match="'linear' transformer, not 'mhla'"):
        nxt.save_variant("mhla", folder, next_dir=tmp_path / "next")
    base = _transformer_folder(tmp_path / "base", "flash", {"w": torch.randn(4)})
    with pytest.raises(ValueError, match="'flash' transformer"):
        nxt.save_variant("linear", base, next_dir=tmp_path / "next")
    with pytest.raises(ValueError, match="variant must be one of"):
        nxt.save_variant("softmax", folder, next_dir=tmp_path / "next")
    huge = _transformer_folder(tmp_path / "huge", "linear", {"ok": torch.ones(2), "w": torch.tensor([1.0, 7.0e4])})
    with pytest.raises(ValueError, match="w does not fit float16"):
        nxt.save_variant("linear", huge, next_dir=tmp_path / "next")
    assert not (tmp_path / "next" / "variants" / "linear").exists()


def test_init_lays_the_bases_ema_once_its_raw_weights_are_gone(tmp_path):
    """While the base trains, init lays its raw weights (what the next base stage resumes from); once the base
    is final only its EMA is kept, and that becomes the working model's transformer."""
    base = _model_dir(tmp_path / "builtin")
    nxt_dir = tmp_path / "next"
    for part in ("transformer", "transformer-ema"):
        (nxt_dir / part).mkdir(parents=True)
        (nxt_dir / part / "config.json").write_text(json.dumps({"tag": part}))
    out = nxt.init(tmp_path / "model", next_dir=nxt_dir, base=base)
    assert json.loads((out / "transformer" / "config.json").read_text())["tag"] == "transformer"
    import shutil

    shutil.rmtree(nxt_dir / "transformer")
    out = nxt.init(tmp_path / "model", next_dir=nxt_dir, base=base)
    assert json.loads((out / "transformer" / "config.json").read_text())["tag"] == "transformer-ema"


def test_stage_transformer_reads_a_checkpoints_ema_or_raw_weights(tmp_path):
    """``factory.shape_probe --transformer CHECKPOINT --weights raw``: the checkpoint's trainable weights laid over
    its transformer/ (the EMA), every other weight the EMA folder's; a plain transformer folder as it is."""
    import torch
    from safetensors.torch import save_file

    from pipelines.tiny import build_tiny_transformer

    ema = build_tiny_transformer(seed=0, num_layers=2)
    ckpt = tmp_path / "step-0000100"
    ema.save_pretrained(ckpt / "transformer")
    names = [n for n, _ in ema.named_parameters()][:3]
    raw = {n: torch.randn_like(p) for n, p in ema.named_parameters() if n in names}
    save_file(raw, str(ckpt / "trainable.safetensors"))

    got = nxt.stage_transformer(ckpt, "raw").state_dict()
    want = ema.state_dict()
    for n in want:
        torch.testing.assert_close(got[n], raw[n] if n in raw else want[n], rtol=0, atol=0)
    got = nxt.stage_transformer(ckpt, "ema").state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert torch.equal(nxt.stage_transformer(ckpt / "transformer").state_dict()[names[0]], want[names[0]])

    with pytest.raises(ValueError, match="'raw' needs a checkpoint"):
        nxt.stage_transformer(ckpt / "transformer", "raw")
    with pytest.raises(ValueError, match="expected 'ema' or 'raw'"):
        nxt.stage_transformer(ckpt, "average")
    with pytest.raises(FileNotFoundError, match="neither a transformer folder"):
        nxt.stage_transformer(tmp_path / "nowhere")
    save_file({"blocks.99.nothing": torch.zeros(1)}, str(ckpt / "trainable.safetensors"))
    with pytest.raises(ValueError, match="holds weights the transformer does not"):
        nxt.stage_transformer(ckpt, "raw")
    (ckpt / "trainable.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no trainable.safetensors"):
        nxt.stage_transformer(ckpt, "raw")

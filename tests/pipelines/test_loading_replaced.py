"""``--transformer`` runs in place of a model folder's own transformer: the own one's config says whether it fits,
and its weights are never read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelines import loading

BUILTIN = Path(__file__).resolve().parents[2] / "assets" / "builtin"


@pytest.fixture
def read_folders(monkeypatch):
    """The transformer folders whose weights load_components reads, in order."""
    seen: list[Path] = []
    real = loading.load_transformer_on

    def spy(path, dtype, device, config=None):
        seen.append(Path(path).resolve())
        return real(path, dtype, device, config)

    monkeypatch.setattr(loading, "load_transformer_on", spy)
    return seen


@pytest.mark.slow  # loads the built-in model twice
def test_the_models_own_transformer_is_not_read_when_another_replaces_it(read_folders):
    variant = BUILTIN / "variants" / "mhla"
    c = loading.load_components(BUILTIN, dtype=torch.float32, device="cpu", transformer=variant)
    assert read_folders == [variant.resolve()]
    assert c.transformer.conversion.variant == "mhla" and "+ transformer" in c.source
    plain = loading.load_components(BUILTIN, dtype=torch.float32, device="cpu")
    assert read_folders[1:] == [(BUILTIN / "transformer").resolve()]  # without --transformer: its own
    assert plain.transformer.conversion.variant == "flash"


def test_a_transformer_that_does_not_fit_is_refused_by_the_models_config(tmp_path, read_folders):
    from diffusers import WanTransformer3DModel

    cfg = json.loads((BUILTIN / "transformer" / "config.json").read_text())
    keep = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "freq_dim")
    other = WanTransformer3DModel(
        **{k: cfg[k] for k in keep}, text_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=cfg["rope_max_seq_len"]
    )
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(
        ValueError, match=r"does not fit the model .*text_dim 32 vs 64.*pass the --model it was trained"
    ):
        loading.load_components(BUILTIN, dtype=torch.float32, device="cpu", transformer=tmp_path / "other")
    assert read_folders == [(tmp_path / "other").resolve()]

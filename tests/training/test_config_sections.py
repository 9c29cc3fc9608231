"""The typed config: ``load_config`` returns a ``FinetuneConfig`` of section dataclasses, and the ``config.yaml`` a run
writes (and a resume compares against) is what a plain OmegaConf merge of the same layers writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from training.config import (
    DEFAULTS,
    DataSection,
    FinetuneConfig,
    FlowSection,
    TrainSection,
    as_tree,
    check_section,
    config_yaml,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "finetune" / "tiny.yaml"


def plain_yaml(path: Path | None, overrides: list[str]) -> str:
    """The snapshot as written before the config was typed: defaults <- file <- overrides, merged by OmegaConf."""
    layers = [OmegaConf.create(DEFAULTS)]
    if path is not None:
        layers.append(OmegaConf.load(path))
    layers.append(OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_yaml(OmegaConf.merge(*layers))


def test_sections_are_typed_and_keep_the_values_as_given():
    cfg = load_config(TINY, ["train.lr=1", "data.bucket_sizes=null", "model.attention.normalize=true"])
    assert isinstance(cfg, FinetuneConfig)
    assert (
        isinstance(cfg.data, DataSection) and isinstance(cfg.train, TrainSection) and isinstance(cfg.flow, FlowSection)
    )
    # an integer lr stays an integer (the snapshot says what was given), lists and mappings are plain
    assert cfg.train.lr == 1 and type(cfg.train.lr) is int
    assert type(cfg.train.betas) is list and type(cfg.model.attention) is dict
    assert cfg.model.attention == {"normalize": True}


@pytest.mark.parametrize(
    "overrides",
    [[], ["train.lr=1", "model.attention.normalize=true", "validation.seeds=[3,4]", "model.layers=[1,2]"]],
    ids=["as shipped", "overridden"],
)
def test_the_snapshot_is_the_plain_merge_and_loads_back_the_same(tmp_path, overrides):
    cfg = load_config(TINY, overrides)
    text = config_yaml(cfg)
    assert text == plain_yaml(TINY, overrides)  # a run folder written before the config was typed resumes
    snapshot = tmp_path / "config.yaml"
    snapshot.write_text(text)
    assert as_tree(load_config(snapshot)) == as_tree(cfg)


def test_every_shipped_finetune_config_snapshots_as_the_plain_merge():
    paths = sorted((ROOT / "configs" / "finetune").glob("*.yaml"))
    assert paths
    for path in paths:
        overrides = ["data.path=null", "data.source=synthetic"]
        assert config_yaml(load_config(path, overrides)) == plain_yaml(path, overrides), path.name


def test_a_section_built_in_code_gets_the_schema_checks():
    check_section(FlowSection(shift=12.0, weighting="uniform"), "flow")
    with pytest.raises(ValueError, match=r"flow\.logit_std=0\.0: expected a value > 0"):
        check_section(FlowSection(logit_std=0.0), "flow")
    with pytest.raises(ValueError, match=r"train\.lora\.rank=0: expected a value >= 1"):
        check_section(
            dataclasses.replace(TrainSection(), lora=dataclasses.replace(TrainSection().lora, rank=0)), "train"
        )
    with pytest.raises(ValueError, match=r"data\.num_workers=True: expected an integer"):
        check_section(DataSection(num_workers=True), "data")


@pytest.mark.parametrize("override", ["train.lora=null", "model=null", "train=5"])
def test_a_section_given_as_one_value_is_named(override):
    name, value = override.split("=")
    with pytest.raises(
        ValueError, match=rf"^{name}={'None' if value == 'null' else value}: expected a section of keys"
    ):
        load_config(TINY, [override])

"""The variant table (pipelines.attention.VARIANT_SPECS) is the one place a variant's rules are written."""

import ast
from pathlib import Path

import pytest

from pipelines import MHLA_VARIANTS, VARIANT_SPECS, VARIANTS, variant_spec
from pipelines.attention import LAYERS_VARIANTS, SOFTMAX_VARIANTS, linear_layers_for, parameter_kind

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_the_lists_are_the_tables():
    assert VARIANTS == ("flash", "linear", "mhla", "mhla-hybrid")
    assert MHLA_VARIANTS == ("mhla", "mhla-hybrid")
    assert LAYERS_VARIANTS == ("mhla-hybrid",)
    assert SOFTMAX_VARIANTS == ("flash", "mhla-hybrid")
    assert [parameter_kind(v) for v in VARIANTS] == ["mhla", "linear", "mhla", "mhla"]
    assert [len(linear_layers_for(v, 6)) for v in VARIANTS] == [0, 6, 6, 4]
    assert all(spec.name == name for name, spec in VARIANT_SPECS.items())


@pytest.mark.parametrize("bad", ["mhla_hybrid", "", None, ["mhla"]])
def test_an_unknown_variant_is_named(bad):
    with pytest.raises(ValueError, match="unknown variant .*expected one of"):
        variant_spec(bad)


def test_no_variant_name_in_pipelines_outside_the_table():
    # "mhla" and "linear" also name the kinds of new parameters (PARAM_ATTRS); the softmax and hybrid names
    # belong to the variants alone, so they stand in attention.py's table and nowhere else in the package
    found = []
    for path in sorted(PIPELINES.glob("*.py")):
        if path.name == "attention.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        found += [
            f"{path.name}:{n.lineno}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in ("flash", "mhla-hybrid") and id(n) not in docs
        ]
    assert found == []

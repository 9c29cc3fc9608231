"""The import order of the packages: ``mhla`` at the bottom, ``common`` above it, then ``pipelines`` and ``world``,
then the recipe, the app and the rest. Read from the source (every import statement, at any depth), not by
importing: a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = {"mhla", "common", "pipelines", "world", "training", "factory", "app", "benchmarks", "run_app"}


def project_imports(package: str) -> dict[str, set[str]]:
    """{file: the project's top-level packages it imports} for every module of ``package``."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = (names & PROJECT) - {package}
    return found


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("mhla", set()),
        ("common", set()),
        ("world", {"common"}),
        ("pipelines", {"mhla", "common"}),
        ("app", {"mhla", "common", "pipelines"}),
        ("training", {"mhla", "common", "pipelines", "world"}),
        ("benchmarks", {"mhla", "common", "pipelines", "world", "app", "training"}),
    ],
)
def test_each_package_imports_only_the_floors_below_it(package, allowed):
    imports = project_imports(package)
    assert imports, f"no modules read in {package}/"
    above = {file: sorted(names - allowed) for file, names in imports.items() if names - allowed}
    assert above == {}


def test_the_reader_sees_lazy_imports():
    """The check above could pass by reading nothing: ``world`` does import ``common`` inside its functions."""
    assert "common" in project_imports("world")["world/synthetic.py"]


def test_replace_dir_puts_the_new_folder_in_place_and_leaves_no_old_one(tmp_path):
    from common.outputs import replace_dir

    dst, src = tmp_path / "store", tmp_path / "new"
    dst.mkdir(), src.mkdir()
    (dst / "a.txt").write_text("old")
    (src / "b.txt").write_text("new")
    replace_dir(src, dst)
    assert [p.name for p in dst.iterdir()] == ["b.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    fresh = tmp_path / "fresh"
    (tmp_path / "other").mkdir()
    replace_dir(tmp_path / "other", fresh)
    assert fresh.is_dir() and not (tmp_path / "other").exists()

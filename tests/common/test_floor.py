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


def module_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports} over every package, each import statement at any depth (a lazy
    import inside a function is an arrow too), relative imports resolved; ``from pkg import name`` points at
    ``pkg.name`` when that is a module, else at ``pkg``."""
    modules: dict[str, Path] = {}
    for package in sorted(PROJECT - {"run_app"}):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                prefix = ".".join([*base, node.module] if node.module else base)
                names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            graph[module].update(m for m in map(known, names) if m is not None and m != module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_others():
    """Arrows point one way inside each package too: no import circle between modules, lazy imports counted."""
    assert circles(module_graph()) == []


def test_the_circle_finder_finds_a_circle_and_the_graph_sees_lazy_relative_imports():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = module_graph()
    assert "pipelines.model" in graph["pipelines.loading"]  # imported inside load_transformer, relatively
    assert "pipelines.convert" in graph["pipelines.model"]


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

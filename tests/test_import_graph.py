"""The import graph of runner/, read from the source (every import statement, at module level or inside a
function, but not under `if TYPE_CHECKING:`): it has no cycle, the engine imports nothing of what comes
after or around training, and the library never imports the built-in models and datasets by name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# runner/models, runner/data and runner/conf are links to the top-level models/, data/ and conf/
LINKED = ("models", "data", "conf")


def modules() -> dict[str, Path]:
    """runner's modules by dotted name (a package by its own name), the links to models/ and data/ left out."""
    found = {}
    for path in sorted((REPO / "runner").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[1] in LINKED:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name `path`'s import statements import, relative imports made absolute."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    type_checking = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return names


def import_graph() -> dict[str, set[str]]:
    """runner module -> the runner modules it imports (a name inside a module counts as that module)."""
    known = modules()

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    return {name: {m for m in map(module_of, imported_names(path, name)) if m and m != name}
            for name, path in known.items()}


def all_imports() -> dict[str, set[str]]:
    """runner module -> every dotted name it imports (runner's or not)."""
    return {name: imported_names(path, name) for name, path in modules().items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_source() -> None:
    graph = import_graph()
    assert "runner.specs.run" in graph and "runner.engine.engine" in graph
    assert "runner.specs.run" in graph["runner.specs.components"]  # `from runner.specs.run import RunSpec`
    assert "runner.specs.components" in graph["runner.engine.engine"]  # `from runner.specs import components`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_spec_is_in_no_import_cycle() -> None:
    """The checks that need the task run after the spec is built (runner/specs/metric_names.py), so the spec,
    the task protocol and the component checks import each other one way only."""
    assert [c for c in cycles(import_graph()) if any(m.startswith(("runner.specs", "runner.tasks")) for m in c)] == []


def test_runner_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_engine_imports_nothing_of_search_results_or_benchmarks() -> None:
    wrong = {name: sorted(m for m in imported if m.startswith(("runner.search", "runner.results", "benchmarks")))
             for name, imported in all_imports().items() if name.startswith("runner.engine")}
    assert {name: found for name, found in wrong.items() if found} == {}


def test_runner_never_imports_the_built_in_models_or_datasets_or_the_benchmarks() -> None:
    wrong = {name: sorted(m for m in imported if m.split(".")[:2] in (["runner", "models"], ["runner", "data"])
                          or m.split(".")[0] in ("models", "data", "benchmarks"))
             for name, imported in all_imports().items()}
    assert {name: found for name, found in wrong.items() if found} == {}


def test_the_stop_lives_with_the_add_on_protocol_and_every_add_on_in_addons() -> None:
    """`Stop` is the protocol's type (runner/addons/base.py); the engine's own add-ons live in runner/addons/."""
    from runner.addons import base, early_stopping, non_finite_watch, stop_vote

    assert base.Stop.__module__ == "runner.addons.base"
    assert [c.__module__ for c in (early_stopping.Stopping, non_finite_watch.NonFiniteWatch, stop_vote.StopVote)] == [
        "runner.addons.early_stopping", "runner.addons.non_finite_watch", "runner.addons.stop_vote"]
    graph = import_graph()
    assert "runner.engine.stopping" not in graph
    addons = {name for name, path in modules().items() if "class " in path.read_text() and "(AddOn)" in path.read_text()}
    assert {name for name in addons if not name.startswith(("runner.addons", "runner.search"))} == set()


def test_the_spec_imports_nothing_from_the_engine_addons_cli_or_search() -> None:
    """The spec is data: the checks that need a built part run in preflight or the engine's build (the run's
    data and its k-fold cut: runner/engine/run_data.py, folds.py; reading what trainer.resume names:
    runner/engine/resume_source.py)."""
    wrong = {name: sorted(m for m in imported if m.startswith(("runner.engine", "runner.addons", "runner.cli",
                                                                "runner.search")))
             for name, imported in all_imports().items() if name.startswith("runner.specs")}
    assert {name: found for name, found in wrong.items() if found} == {}


def test_tracking_does_not_import_the_optuna_plugins_storage() -> None:
    wrong = {name: sorted(m for m in imported if m.startswith("hydra_plugins.runner_optuna_sweeper.storage"))
             for name, imported in all_imports().items() if name.startswith("runner.tracking")}
    assert {name: found for name, found in wrong.items() if found} == {}

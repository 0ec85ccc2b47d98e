"""runner/ is the engine: it never imports the built-in models/ or data/ by name (they are named by `_target_`
like a user's own), nor benchmarks/ (outside the library's import graph)."""
from __future__ import annotations

import ast
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[2] / "runner"


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_runner_imports_no_built_in_model_or_dataset_and_no_benchmark() -> None:
    offenders = {}
    for path in sorted(RUNNER.rglob("*.py")):
        relative = path.relative_to(RUNNER).as_posix()
        if relative.split("/")[0] in ("data", "models", "conf"):  # the symlinks to the built-ins themselves
            continue
        bad = sorted(m for m in imported_modules(path) if m.split(".")[:2] in (["runner", "data"], ["runner", "models"])
                     or m.split(".")[0] in ("data", "models", "benchmarks"))
        if bad:
            offenders[relative] = bad
    assert not offenders, offenders

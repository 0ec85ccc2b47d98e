"""The sweeper is its own distribution (sweeper/): it imports neither torch nor runner, installs alone in a
fresh virtual environment, and names itself `runner_optuna`, taking `optuna` only where
hydra-optuna-sweeper does not."""
from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import optuna
import pytest
from hydra.core.config_store import ConfigStore
from optuna.trial import TrialState
from packaging.requirements import Requirement

from hydra_plugins.runner_optuna_sweeper.config import hydra_optuna_sweeper_installed
from hydra_plugins.runner_optuna_sweeper.storage import open_storage

REPO = Path(__file__).resolve().parents[2]
SWEEPER = REPO / "sweeper"
PLUGIN = SWEEPER / "hydra_plugins" / "runner_optuna_sweeper"
KILN = Path(__file__).parent / "apps" / "kiln"
FORBIDDEN = {"torch", "runner", "mlflow"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_of_the_sweeper_imports_torch_runner_or_mlflow() -> None:
    """Every module, at any depth of the code (a function's own import too): the fresh-venv test below
    proves it by running, this scan keeps it in CI at no cost."""
    modules = sorted(PLUGIN.rglob("*.py"))
    assert len(modules) >= 10
    found = {p.name: imported_roots(p) & FORBIDDEN for p in modules}
    assert {name: roots for name, roots in found.items() if roots} == {}
    assert not (SWEEPER / "hydra_plugins" / "__init__.py").exists()  # a namespace shared with other plugins


def test_runner_optuna_and_its_optuna_alias_name_this_sweeper() -> None:
    assert not hydra_optuna_sweeper_installed()  # this environment: the alias is ours
    store = ConfigStore.instance()
    for name in ("runner_optuna", "optuna"):
        node = store.load(f"hydra/sweeper/{name}.yaml")
        assert node.provider == "runner_optuna_sweeper"
        assert node.node._target_ == "hydra_plugins.runner_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert {store.load(f"hydra/sweeper/sampler/{n}.yaml").provider for n in ("tpe", "grid", "gp")} == {"runner_optuna_sweeper"}


# What hydra-optuna-sweeper's own config module registers, by name (its provider is "optuna_sweeper")
OTHER_PLUGIN = """
from dataclasses import dataclass
from hydra.core.config_store import ConfigStore

@dataclass
class Other:
    _target_: str = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"

for group, names in (("hydra/sweeper", ["optuna"]), ("hydra/sweeper/sampler", ["tpe", "random", "cmaes", "nsgaii", "motpe", "grid"])):
    for name in names:
        ConfigStore.instance().store(group=group, name=name, node=Other, provider="optuna_sweeper")
"""
SHOW_PROVIDERS = """
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.core.config_store import ConfigStore
Plugins.instance().discover(Sweeper)  # Hydra's plugin scan imports every plugin's modules
store = ConfigStore.instance()
for path in ("hydra/sweeper/optuna", "hydra/sweeper/runner_optuna", "hydra/sweeper/sampler/tpe", "hydra/sweeper/sampler/gp",
             "hydra/sweeper/pruner/median"):
    print(path, store.load(path + ".yaml").provider)
"""


def test_with_hydra_optuna_sweeper_installed_beside_optuna_stays_its_own(tmp_path: Path) -> None:
    other = tmp_path / "hydra_plugins" / "hydra_optuna_sweeper"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "config.py").write_text(OTHER_PLUGIN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SHOW_PROVIDERS], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "hydra/sweeper/optuna optuna_sweeper",                    # theirs, whichever plugin Hydra scans last
        "hydra/sweeper/runner_optuna runner_optuna_sweeper",
        "hydra/sweeper/sampler/tpe optuna_sweeper",               # the names both define stay theirs ...
        "hydra/sweeper/sampler/gp runner_optuna_sweeper",         # ... the rest are ours
        "hydra/sweeper/pruner/median runner_optuna_sweeper"]


# --- a fresh virtual environment without torch -------------------------------------------------------

def requirement_closure(roots: list[str]) -> list[md.Distribution]:
    """The installed distributions that `roots` need, transitively (extras and other platforms' markers
    left out)."""
    seen: dict[str, md.Distribution] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen[key] = dist = md.distribution(req.name)
        todo += [Requirement(r) for r in dist.requires or []]
    return list(seen.values())


def repack(dist: md.Distribution, wheelhouse: Path) -> Path:
    """A wheel of an installed distribution, from its RECORD: this environment's packages, installed
    offline into the fresh one (the files as they are, for this interpreter and platform)."""
    site = Path(dist.locate_file(""))
    wheel_file = next((f for f in dist.files if f.name == "WHEEL" and f.parent.name.endswith(".dist-info")), None)
    tags = re.findall(r"^Tag: (\S+)$", wheel_file.read_text(), re.M) if wheel_file else []
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    path = wheelhouse / f"{name}-{dist.version}-{tags[0] if tags else 'py3-none-any'}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for f in dist.files:
            source = Path(dist.locate_file(f)).resolve()
            if ".." in f.parts or "__pycache__" in f.parts or not source.is_file():
                continue  # scripts in bin/ and bytecode: pip writes its own
            wheel.write(source, f.as_posix())
    return path


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


@pytest.mark.slow  # ~70 s (a venv, numpy and SQLAlchemy, two installs); in CI test_no_module_of_the_sweeper_imports_... keeps the property
def test_the_sweeper_installs_in_a_fresh_venv_without_torch_and_sweeps_a_plain_hydra_app(tmp_path: Path) -> None:
    import shutil
    import tomllib  # Python 3.11+, as this slow test

    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    needs = tomllib.loads((SWEEPER / "pyproject.toml").read_text())
    for dist in requirement_closure(needs["project"]["dependencies"] + needs["build-system"]["requires"]):
        repack(dist, wheelhouse)
    source = tmp_path / "sweeper"  # a copy: building writes into the source folder
    shutil.copytree(SWEEPER, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    run(*pip, "install", "--no-index", "--find-links", str(wheelhouse), str(source), cwd=tmp_path)  # `pip install ./sweeper`
    where = run(python, "-c", "import importlib.util as u, hydra_plugins.runner_optuna_sweeper as s; "
                              "print(s.__file__, [m for m in ('torch', 'runner', 'mlflow') if u.find_spec(m)])", cwd=tmp_path)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert where.stdout.split(maxsplit=1) == [str(site / "hydra_plugins" / "runner_optuna_sweeper" / "__init__.py"), "[]\n"]

    # a plain Hydra app, no runner: `optuna` is this sweeper's alias here; two slots run the trials
    sweep = run(python, str(KILN / "kiln.py"), "-m", f"hydra.sweep.dir={tmp_path}/sweep", "hydra/sweeper=optuna",
                "hydra.sweeper.n_jobs=2", cwd=tmp_path)
    study = optuna.load_study(study_name="kiln", storage=open_storage(str(tmp_path / "sweep" / "optuna.journal")))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 8
    sys.path.insert(0, str(KILN))
    try:
        from kiln import defects
    finally:
        sys.path.remove(str(KILN))
    for t in study.trials:
        assert t.value == pytest.approx(defects(**t.params))  # each job ran with its trial's parameters
    assert f"Best value: {min(t.value for t in study.trials)}" in sweep.stdout

    # an editable install (`make install`'s) is found by Hydra's plugin scan too
    run(*pip, "uninstall", "-y", "hydra-runner-optuna-sweeper", cwd=tmp_path)
    run(*pip, "install", "--no-index", "--find-links", str(wheelhouse), "-e", str(source), cwd=tmp_path)
    scan = run(python, "-c", "from hydra.core.plugins import Plugins; from hydra.plugins.sweeper import Sweeper; "
                             "print([s.__module__ for s in Plugins.instance().discover(Sweeper)])", cwd=tmp_path)
    assert "'hydra_plugins.runner_optuna_sweeper.optuna_sweeper'" in scan.stdout

"""A built wheel carries everything a run needs: installed alone (no checkout on the path) it trains."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# build outputs and local state that are not part of the source
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "datasets", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".whl", ".gpu")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True,
                   capture_output=True, text=True)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """runner's wheel and the sweeper's (sweeper/, its own distribution), each built from a pristine copy
    of the source, so no stale build/ of the checkout can leak into them."""
    tmp = tmp_path_factory.mktemp("packaging")
    shutil.copytree(REPO, tmp / "src", ignore=NOT_SOURCE)
    for source in (tmp / "src", tmp / "src" / "sweeper"):
        pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"), str(source))
    (runner,) = (tmp / "dist").glob("runner-*.whl")
    (sweeper,) = (tmp / "dist").glob("hydra_runner_optuna_sweeper-*.whl")
    return {"runner": runner, "sweeper": sweeper}


def test_the_wheel_holds_every_module_and_config_and_no_top_level_conf(wheels: dict[str, Path]) -> None:
    names = set(zipfile.ZipFile(wheels["runner"]).namelist())
    configs = {f"runner/conf/{p.relative_to(REPO / 'conf').as_posix()}" for p in (REPO / "conf").rglob("*.yaml")}
    groups = {p.name for p in (REPO / "conf").iterdir() if p.is_dir()}
    assert {"dataset", "model", "optimizer", "scheduler", "precision", "trainer"} <= groups
    assert configs - names == set()
    assert {n.split("/")[2] for n in configs if n.count("/") > 2} == groups
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "runner").rglob("*.py") if "__pycache__" not in p.parts}
    # the built-in components: top-level models/ and data/ installed as runner.models and runner.data
    modules |= {f"runner/{p.relative_to(REPO).as_posix()}" for d in ("models", "data") for p in (REPO / d).rglob("*.py")
                if "__pycache__" not in p.parts}
    assert {m for m in modules if m.startswith(("runner/models/", "runner/data/"))}
    assert modules - names == set()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"runner", "hydra_plugins"}
    # runner's own sweeper plugin (PBT needs runner), in the namespace shared with every Hydra plugin: no __init__
    plugins = {n for n in names if n.startswith("hydra_plugins/")}
    assert "hydra_plugins/runner_pbt_sweeper/pbt_sweeper.py" in plugins and "hydra_plugins/__init__.py" not in plugins
    assert not any(n.startswith("hydra_plugins/runner_optuna_sweeper/") for n in plugins)  # sweeper/'s own wheel
    assert not top_level & {"conf", "data", "models"}
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "Requires-Dist: hydra-runner-optuna-sweeper>=0.1" in zipfile.ZipFile(wheels["runner"]).read(metadata).decode()


def test_the_sweeper_wheel_holds_the_plugin_and_nothing_else(wheels: dict[str, Path]) -> None:
    names = {n for n in zipfile.ZipFile(wheels["sweeper"]).namelist() if ".dist-info/" not in n}
    plugin = REPO / "sweeper" / "hydra_plugins"
    modules = {p.relative_to(plugin.parent).as_posix() for p in plugin.rglob("*.py") if "__pycache__" not in p.parts}
    assert "hydra_plugins/runner_optuna_sweeper/optuna_sweeper.py" in modules
    assert names == modules  # no hydra_plugins/__init__.py: the namespace is shared with every other Hydra plugin


def test_an_installed_wheel_runs_from_anywhere(wheels: dict[str, Path], tmp_path: Path) -> None:
    site = tmp_path / "site"
    pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheels["runner"]), str(wheels["sweeper"]))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # only the target dir on the path; torch and friends come from the venv's own site-packages. The venv
    # also holds an editable install of a checkout: the imports below prove it is not the one used.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}

    where = subprocess.run(
        [sys.executable, "-c", "import runner, runner.specs.registry as r, hydra_plugins.runner_optuna_sweeper as s; "
                               "print(runner.__file__, r.CONF_DIR, s.__file__, sep='\\n')"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
    runner_file, conf_dir, sweeper_file = (Path(line) for line in where.stdout.split())
    for path in (runner_file, conf_dir, sweeper_file):
        assert path.resolve().is_relative_to(site.resolve()), where.stdout
    assert conf_dir == site / "runner" / "conf" and (conf_dir / "config.yaml").is_file()

    proc = subprocess.run([sys.executable, "-m", "runner", "trainer.max_steps=2", "tracking=none"], cwd=elsewhere,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((elsewhere / "outputs" / "runs").glob("*/*/spec.yaml")), proc.stdout[-2000:]


def test_make_installs_editable_packages_without_setuptools_note_on_each(tmp_path: Path) -> None:
    """Issue 35, item 13 (the install printed about 160 warning lines): besides the machine's own pip settings,
    setuptools printed an 11-line "Editable installation ... be careful with folders in your working directory"
    note for each editable package `make install` builds. The install's environment (PYTHONWARNINGS, read from
    the Makefile's recipe) drops that note: an editable build of the sweeper as pip runs it prints nothing."""
    import re

    recipe = (REPO / "Makefile").read_text()
    match = re.search(r'PYTHONWARNINGS="([^"]+)" \$\(PY\) -m pip install -q -c constraints.txt -e ./sweeper', recipe)
    settings = {"PYTHONWARNINGS": match.group(1)} if match else {}
    shutil.copytree(REPO / "sweeper", tmp_path / "sweeper", ignore=NOT_SOURCE)
    build = ("import sys; from setuptools import build_meta; "
             "build_meta.build_editable(sys.argv[1], config_settings={'editable_mode': 'lenient'})")
    proc = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=tmp_path / "sweeper",
                          capture_output=True, text=True, env={**os.environ, **settings})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Editable installation" not in proc.stderr, proc.stderr[-3000:]
    assert list((tmp_path / "dist").glob("*.whl"))

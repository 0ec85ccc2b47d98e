"""The command line as a user types it: real processes, exit codes, messages, MLflow left clean."""
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.engine.components import build_model
from runner.specs import components

from runner.specs import registry
from runner.cli.preflight import preflight
from runner.specs.resume import typed_keys
from runner.specs.run import SpecError
from tests.conftest import REPO, compose_spec, run_cli


def mlflow_runs(db: Path) -> list[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        return list(con.execute("select name, status from runs")) if "runs" in tables else []


# The bad-input matrix is tests/runner/test_bad_input.py.


def preflight_ok(args: list[str]) -> None:
    """Preflight as the CLI runs it, in this process: a refusal (exit 2) fails the test with its line."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        preflight(args)
    except SystemExit as e:
        pytest.fail(f"preflight refused {args} (exit {e.code})")
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("args", [["optimizer.lr=-1"], ["--cfg", "job", "+accum=4"], ["--help"], ["optimizer.lrr=1"],
                                  ["--info"]], ids=["bad value", "--cfg job", "--help", "unknown key", "--info"])
def test_checks_and_config_printing_import_neither_torch_nor_mlflow_nor_optuna(tmp_path: Path, args: list[str]) -> None:
    """The spec is checked before the heavy imports: -X importtime lists every module a process imports."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported  # the listing is real
    assert imported & {"torch", "mlflow", "optuna", "sklearn"} == set()
    assert proc.returncode == (2 if "=" in args[0] else 0), proc.stderr[-2000:]
    if "--help" in args:  # runner's own help: its groups, the shorthand, multiruns, completion, where to read more
        for text in ("\noptimizer: adafactor, ", "+accum=4", "-m optimizer=sgd,adamw", 'eval "$(runner -sc install=bash)"',
                     "README.md", "--hydra-help", "mode=eval trainer.resume=<run>", "mode=predict trainer.resume=<run>",
                     "mode=export trainer.resume=<run>", "runner reproduce <run id>", "runner compare <experiment"):
            assert text in proc.stdout, text
    if "--cfg" in args:  # the shorthand shows as the key it sets, once
        assert "\naccumulation:\n  steps: 4\n" in proc.stdout and "accum:" not in proc.stdout


def test_default_run_trains_to_95_percent_and_prints_a_summary(tmp_path: Path, migrated_mlflow_store: Path) -> None:
    db = tmp_path / "mlflow.db"
    # a copy of a migrated store (tests/conftest.py): seconds saved; a runner's first open of a new store is
    # tests/hydra_plugins/test_shared_store.py's (two processes at once)
    shutil.copy(migrated_mlflow_store, db)
    proc = run_cli([f"tracking.uri=sqlite:///{db}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    best = float(proc.stdout.split("best val/acc: ")[1].split()[0])
    assert best >= 0.95
    assert "run directory: " in proc.stdout  # how to see it: a store other than make ui's names its own UI command
    assert f"see it with: python -m runner.tracking.mlflow_ui --backend-store-uri sqlite:///{db}, then http://" in proc.stdout
    assert mlflow_runs(db) == [("default", "FINISHED")]
    run_dirs = list((tmp_path / "outputs" / "runs").glob("*/*"))
    assert len(run_dirs) == 1 and (run_dirs[0] / "spec.yaml").exists() and (run_dirs[0] / "curves.png").exists()
    # piped (no progress bar): the console shows each line once and the run log keeps every one, summary included
    assert_run_log(proc.stdout, run_dirs[0], epochs=None)


# what a run's start-up costs in Hydra: preflight's composition, none after it (each is 0.2-0.3 s)
COUNT_COMPOSITIONS = """
import atexit, runpy, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
load, calls = ConfigLoaderImpl.load_configuration, []
def counted(self, config_name, overrides, *args, **kwargs):
    calls.append(list(overrides))
    return load(self, config_name, overrides, *args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
atexit.register(lambda: print(f"compositions: {calls}"))
sys.argv = ["runner", *sys.argv[1:]]
runpy.run_module("runner", run_name="__main__")
"""


def test_a_single_run_is_composed_once_and_run_as_hydra_runs_a_job(tmp_path: Path) -> None:
    """preflight's composition is the one the run runs; what Hydra's run of a job does is all there: the run
    directory and its .hydra/ record, the job's log file, hydra.job.env_set around the job, Hydra initialized for a
    user's compose call inside the job, +accum as its key."""
    composes = "trainer.callbacks=[{_target_: tests.user_pkg.callbacks.ComposesAConfig, overrides: ['optimizer=adamw']}]"
    args = ["trainer.max_steps=2", "tracking=none", "+accum=2", "hydra.run.dir=run", "+hydra.job.env_set.RUNNER_PROBE=on",
            composes]
    # the callback's package importable as a user's is (a fresh clone does not install tests/)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", COUNT_COMPOSITIONS, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    # preflight's, then the user's inside the job (Hydra's run added two more of the run's before the job)
    assert f"compositions: {[args, ['optimizer=adamw']]}\n".replace("+accum=2", "accumulation.steps=2") in proc.stdout, \
        proc.stdout[-800:]
    run = tmp_path / "run"
    assert yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) == [
        "trainer.max_steps=2", "tracking=none", "accumulation.steps=2", composes]
    assert (run / "composed.txt").read_text() == "torch.optim.AdamW"
    job = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert job["accumulation"]["steps"] == 2 and job["trainer"]["max_steps"] == 2 and "hydra" not in job
    hydra = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra["mode"] == "RUN" and hydra["runtime"]["output_dir"] == str(run)
    assert hydra["job"]["env_set"] == {"RUNNER_PROBE": "on"}
    # the job ran inside env_set: the process state it recorded has the variable
    assert "RUNNER_PROBE" in yaml.safe_load((run / "process_state.yaml").read_text())["environ_sha256"]
    assert "runner: trained 2 optimizer steps" in (run / "runner.log").read_text()


def assert_run_log(console: str, run_dir: Path, epochs: int | None) -> None:
    """The epoch lines and the summary: once each on the console, all of them in <run dir>/runner.log."""
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["runner.log"]
    log = (run_dir / "runner.log").read_text()
    lines = [line for line in console.splitlines() if line.startswith("epoch ")]
    assert len(lines) == (epochs or len(lines)) > 0 and len(set(lines)) == len(lines), console
    summary = console[console.index("runner: trained"):].splitlines()[:3]
    assert console.count("runner: trained") == 1 and len(summary) == 3
    for line in lines + summary:
        assert log.count(line + "\n") == 1, (line, log)


def run_cli_on_a_terminal(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """run_cli with stderr on a pseudo-terminal (where the progress bar draws), stdout piped."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    drawn = bytearray()

    def drain() -> None:  # the bar redraws often: a full terminal buffer would block the run
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            drawn.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    try:
        proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=slave, text=True, timeout=300)
    finally:
        os.close(slave)
        reader.join(timeout=5)
        os.close(master)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, drawn.decode(errors="replace"))


def test_the_readme_command_works_as_typed_on_cpu(tmp_path: Path) -> None:
    # typed in a terminal: the progress bar draws, and the run log still gets every line
    proc = run_cli_on_a_terminal(["optimizer=adamw", "precision=bf16", "+accum=4", "trainer.max_epochs=2", "tracking=none"],
                                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    spec = next((tmp_path / "outputs" / "runs").glob("*/*/spec.yaml")).read_text()
    assert "steps: 4" in spec and "name: bf16" in spec and "_target_: torch.optim.AdamW" in spec
    assert "step/s" in proc.stderr or "s/step" in proc.stderr  # the bar drew on the terminal
    assert_run_log(proc.stdout + proc.stderr, next((tmp_path / "outputs" / "runs").glob("*/*")), epochs=2)


# --- composition: every option with the keys a user types most ---------------------------------------


@pytest.mark.parametrize("dataset", registry.options("dataset"))
def test_every_dataset_option_takes_the_loader_keys(tmp_path: Path, dataset: str) -> None:
    """batch_size and num_workers are runner's keys: an option's YAML need not list them."""
    overrides = [f"dataset={dataset}", "dataset.batch_size=5", "dataset.num_workers=3"]
    if dataset in ("imdb", "text_classification", "text_lm", "synthetic_tokens"):  # token ids: a model that reads them
        overrides.append("model=gpt")
    preflight_ok([*overrides, "--cfg", "job"])  # the override is accepted (nothing of the data is read)
    spec = components.resolved_spec(compose_spec(overrides, tmp_path / "run"), typed_keys(tuple(overrides)))
    assert (spec.dataset.batch_size, spec.dataset.num_workers) == (5, 3)
    assert not {"batch_size", "num_workers"} & set(spec.dataset.params)  # the builder never sees them


# the tasks each built-in model is made for, each with a dataset of that kind
MODEL_TASKS = [(model, task, dataset) for model in ("mlp", "cnn", "resnet18", "timm", "torchvision", "vit")
               for task, dataset in (("classification", "synthetic"), ("regression", "synthetic"))]
MODEL_TASKS += [("gpt", "language_modeling", "text_lm"), ("gpt2_medium", "language_modeling", "text_lm"), ("hf", "classification", "imdb"),
                ("hf", "language_modeling", "text_lm"), ("distilbert", "classification", "imdb")]


def test_every_model_option_composes_with_every_task_it_supports(tmp_path: Path) -> None:
    assert {m for m, _, _ in MODEL_TASKS} == set(registry.options("model"))  # a new model option joins the list
    for model, task, dataset in MODEL_TASKS:
        overrides = [f"model={model}", f"task={task}", f"dataset={dataset}", "dataset.batch_size=4"]
        if model == "hf" and task == "language_modeling":
            overrides.append("model.task=causal_lm")
        spec = components.resolved_spec(compose_spec(overrides, tmp_path / "run"), typed_keys(tuple(overrides)))
        names = {"classification": "Classification", "regression": "Regression", "language_modeling": "LanguageModeling"}
        assert spec.task.target.rpartition(".")[2] == names[task] and spec.dataset.batch_size == 4, overrides


USER_CONF = f"hydra.searchpath=[file://{REPO / 'tests' / 'user_pkg' / 'conf'}]"


def test_options_of_every_group_come_from_the_users_search_path(tmp_path: Path) -> None:
    """tests/user_pkg/conf: a preset naming the user's own optimizer and model options, and the user's
    scheduler and precision options; each is the built-in it extends, with the user's values on top."""
    user = [USER_CONF, "experiment=my_preset", "scheduler=my_cosine", "precision=my_bf16", "trainer.device=cpu"]
    preflight_ok([*user, "tracking=none", f"hydra.run.dir={tmp_path / 'run'}"])
    spec = compose_spec(user, tmp_path / "run")
    same = compose_spec([USER_CONF, "model=wide_net", "optimizer=sgd", "optimizer.lr=0.05", "scheduler=cosine",
                         "precision=bf16", "seed=3", "trainer.max_steps=7", "trainer.device=cpu"], tmp_path / "run")
    assert spec.optimizer.lr == 0.05 and spec.seed == 3 and spec.trainer.max_steps == 7
    for group in ("model", "optimizer", "scheduler", "precision", "trainer"):
        assert getattr(spec, group) == getattr(same, group), group


# --- a _target_ typed on the command line, and components nested in a component's arguments ------------

ACT_NET = ["model._target_=tests.user_pkg.blocks.ActNet", "+model.activation={_target_: torch.nn.LeakyReLU, negative_slope: 0.2}"]


def resolved(overrides: list[str], tmp_path: Path):
    return components.resolved_spec(compose_spec(overrides, tmp_path / "run"), typed_keys(tuple(overrides)))


def test_a_target_typed_on_the_command_line_starts_from_its_own_signature(tmp_path: Path) -> None:
    """mlp.yaml's dropout 0.0 must not replace ActNet's own 0.5, nor its list `hidden` reach Tower's int one."""
    spec = resolved(ACT_NET, tmp_path)
    assert spec.model.params["dropout"] == 0.5 and spec.model.params["width"] == 16
    assert set(spec.model.params) == {"activation", "width", "dropout"}
    assert resolved([*ACT_NET, "model.dropout=0.1"], tmp_path).model.params["dropout"] == 0.1  # typed: applied
    assert resolved(["model._target_=tests.user_pkg.blocks.Tower"], tmp_path).model.params == {"hidden": 32}
    assert resolved(["model._target_=tests.user_pkg.blocks.Tower", "model.hidden=8"], tmp_path).model.params == {"hidden": 8}
    preflight_ok(["model._target_=tests.user_pkg.blocks.Tower", "tracking=none", f"hydra.run.dir={tmp_path / 'cli'}"])


def test_a_typed_target_says_once_which_of_the_options_keys_it_does_not_use(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec is resolved three times (preflight, launch, engine); the note came twice, once per resolution after
    logging was set up. Said once, and still said."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = run_cli(["model._target_=tests.user_pkg.blocks.Tower", "trainer.max_steps=1",
                    "tracking=none", "trainer.memory_estimate=false", "trainer.progress_bar=off"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if "the option's own keys" in line]
    assert said == ["model._target_=tests.user_pkg.blocks.Tower: the option's own keys (dropout, hidden, norm) are "
                    "not used"], said


def test_a_nested_target_in_a_models_arguments_is_built_and_its_keys_checked(tmp_path: Path) -> None:
    from types import SimpleNamespace

    import torch

    spec = resolved(ACT_NET, tmp_path)
    assert spec.model.params["activation"] == {"_target_": "torch.nn.LeakyReLU", "negative_slope": 0.2, "inplace": False}
    model = build_model(spec, SimpleNamespace(input_shape=(4,), num_classes=3))
    assert isinstance(model.act, torch.nn.LeakyReLU) and model.act.negative_slope == 0.2
    assert model(torch.ones(2, 4)).shape == (2, 3)
    with pytest.raises(SpecError, match=r"^model.activation.negative_slop: unknown key for torch.nn.LeakyReLU; did you "
                                        r"mean negative_slope\? accepted keys: inplace, negative_slope$"):
        resolved([ACT_NET[0], "+model.activation={_target_: torch.nn.LeakyReLU, negative_slop: 0.2}"], tmp_path)
    with pytest.raises(SpecError, match=r"^model.activation.negative_slope: 'steep' is not a number"):
        resolved([ACT_NET[0], "+model.activation={_target_: torch.nn.LeakyReLU, negative_slope: steep}"], tmp_path)


# --- torchrun: every rank in the run directory the user named ------------------------------------------


def test_under_torchrun_every_rank_is_given_the_run_directory_preflight_resolved(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast case (one rank, in this process): what `cli` hands Hydra under torchrun."""
    import socket

    import torch.distributed as dist

    import runner.__main__ as entry

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"TORCHELASTIC_RUN_ID": "t", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    handed: list[list[str]] = []
    monkeypatch.setattr(entry, "main", lambda: handed.append(list(sys.argv)))
    ended: list[bool] = []  # a finished rank ends the process at once: not this test's
    monkeypatch.setattr("runner.cli.worker.exit_before_teardown", lambda: ended.append(True))
    monkeypatch.setattr(sys, "argv", ["runner", "parallelism=ddp", "trainer.device=cpu", "tracking=none",
                                      f"hydra.run.dir={tmp_path / 'mine'}"])
    try:
        entry.cli()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert handed[0][-1] == f"hydra.run.dir={tmp_path / 'mine'}"
    assert ended == [True]  # and the rank was ended before the interpreter's teardown (issue 26, section 5)


@pytest.mark.slow
def test_under_torchrun_the_run_goes_to_the_users_run_directory(tmp_path: Path) -> None:
    """`torchrun -m runner hydra.run.dir=X`: ranks used to share outputs/runs/<now> whatever X was."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "my run, ddp"  # a comma and a space: one path, not a sweep
    db = tmp_path / "mlflow.db"
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "runner", "parallelism=ddp", "parallelism.nproc_per_node=2", "trainer.device=cpu",
                           "trainer.max_steps=2", "trainer.progress_bar=off", f"tracking.uri=sqlite:///{db}",
                           f"tracking.artifact_root={tmp_path / 'artifacts'}", f"hydra.run.dir='{run_dir}'"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "spec.yaml").exists() and (run_dir / "checkpoints" / "last.pt").exists()
    assert yaml.safe_load((run_dir / "spec.yaml").read_text())["run_dir"] == str(run_dir)  # YAML may fold a long one
    assert not (tmp_path / "outputs").exists()  # no rank wrote anywhere else
    run = MlflowClient(f"sqlite:///{db}").search_runs([MlflowClient(f"sqlite:///{db}").get_experiment_by_name("runner").experiment_id])
    assert [(r.info.status, r.data.tags["run_dir"]) for r in run] == [("FINISHED", str(run_dir))]
    artifacts = {a.path for a in MlflowClient(f"sqlite:///{db}").list_artifacts(run[0].info.run_id)}
    assert "spec.yaml" in artifacts


@pytest.mark.slow  # in CI: test_extending_a_finished_k_fold_run_extends_every_fold_and_recomputes_the_mean
@pytest.mark.parametrize("command", [
    ["trainer.cross_validation.folds=2"],  # K fold runs, then the K-fold run's table
    ["-m", "optimizer.lr=0.01,0.02"],  # a grid: two jobs, then its summary
])
def test_a_command_of_several_runs_says_how_to_open_the_mlflow_ui_once(tmp_path: Path, migrated_mlflow_store: Path,
                                                                        command: list[str]) -> None:
    """Each run's summary names its MLflow run; how to see them (the UI command and its page) is printed once, by
    the command's parent run, not again by every fold or job."""
    db = tmp_path / "mlflow.db"
    shutil.copy(migrated_mlflow_store, db)
    proc = run_cli([*command, "trainer.max_steps=2", "trainer.progress_bar=off", "trainer.memory_estimate=false",
                    f"tracking.uri=sqlite:///{db}", f"hydra.run.dir={tmp_path / 'run'}",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("runner: trained 2 optimizer steps") == 2  # both runs printed their summary
    assert proc.stdout.count(f"mlflow_ui --backend-store-uri sqlite:///{db}") == 1, proc.stdout
    assert proc.stdout.count("MLflow run '") == 3 - (command[0] == "-m")  # a grid's parent has its own line

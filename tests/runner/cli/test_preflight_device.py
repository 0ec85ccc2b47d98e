"""The processes and devices a run asks for, against what this machine has (runner/cli/preflight_device.py),
refused by the CLI before anything exists: each command is run as a user types it, in an empty working
directory, and must end with one `error:` line naming the key, the value and what the machine has, exit code 2,
no traceback, no worker started, and nothing created there (no outputs/, no MLflow store, no run folder).
The launcher used to find these after the run directory and the MLflow store existed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli

NO_GPU = "error: trainer.device: 'cuda' was asked for but no CUDA GPU is visible; use trainer.device=cpu or auto"

# (the command, what its one line must say) on a machine without a GPU
WITHOUT_A_GPU = {
    "one process": (["trainer.device=cuda"], [NO_GPU]),
    "ddp workers": (["trainer.device=cuda", "parallelism=ddp", "parallelism.nproc_per_node=2"], [NO_GPU]),
    "tp workers": (["trainer.device=cuda", "parallelism.tp=2"], [NO_GPU]),
    "a sweep": (["-m", "trainer.device=cuda", "optimizer.lr=0.1,0.2"], [NO_GPU]),
}


@pytest.fixture(autouse=True)
def _repo_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The repository importable in `python -m runner` run from an empty temporary directory, as a user's own
    project is (PYTHONPATH or an install)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def assert_refused_before_anything(proc: subprocess.CompletedProcess, cwd: Path, said: list[str],
                                   lines_expected: int = 1) -> None:
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == 2, out[-3000:]
    assert len(lines) == lines_expected and len(set(lines)) == 1, out[-3000:]
    assert "Traceback" not in out
    for part in said:
        assert part in lines[0], lines[0]
    assert list(cwd.iterdir()) == [], f"the refused command made {sorted(str(p.relative_to(cwd)) for p in cwd.rglob('*'))}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: trainer.device=cuda is this machine's")
@pytest.mark.parametrize("case", list(WITHOUT_A_GPU))
def test_cuda_without_a_gpu_is_one_line_exit_2_before_any_run_directory_or_store(tmp_path: Path, case: str) -> None:
    args, said = WITHOUT_A_GPU[case]
    assert_refused_before_anything(run_cli([*args, "trainer.max_steps=1"], cwd=tmp_path, timeout=120), tmp_path, said)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: more workers than this machine's GPUs")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_workers_than_gpus_is_one_line_exit_2_before_any_run_directory_or_store(tmp_path: Path, device: str) -> None:
    gpus = torch.cuda.device_count()
    proc = run_cli([f"trainer.device={device}", "parallelism=ddp", f"parallelism.nproc_per_node={gpus + 1}",
                    "trainer.max_steps=1"], cwd=tmp_path, timeout=120)
    assert_refused_before_anything(proc, tmp_path, [
        f"error: parallelism.nproc_per_node: {gpus + 1} workers but only {gpus} GPU(s) visible on this node "
        f"(trainer.device={device}); use at most {gpus}, or trainer.device=cpu"])


def test_under_torchrun_more_processes_than_single_runs_is_refused_before_any_run_directory(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m runner` with parallelism=single: each rank that gets to it says it, nothing is created
    (the ranks used to refuse it after rank 0 had made the run directory)."""
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "runner", "trainer.device=cpu", "trainer.max_steps=1", "tracking=none"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0, out[-3000:]
    # one line per rank that says it: torchrun ends the other rank once one has exited, which may be before its line
    assert errors and errors == ["error: parallelism: torchrun started 2 processes but parallelism=single runs 1 "
                                 "(tp x pp x cp); add parallelism=ddp or parallelism=fsdp"] * len(errors), out[-3000:]
    assert f'File "{REPO / "runner"}' not in out  # torchrun's own report of its failed ranks is torchrun's
    assert list(work.iterdir()) == [], sorted(str(p.relative_to(work)) for p in work.rglob("*"))

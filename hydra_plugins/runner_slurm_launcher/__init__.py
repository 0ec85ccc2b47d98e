"""`hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml): Hydra's submitit SLURM launcher, with sbatch's
refusal said in one line.

When sbatch refuses a job (what the partition does not have: GPUs on a CPU partition, more memory or CPUs
than a node holds, an unknown partition), submitit raises its FailedJobError and Hydra prints some 30 lines
of traceback around sbatch's own one-line reason. Here that reason comes with what the job asked and the
launcher keys that decide it, and the sweep exits 2 (its configuration, not a run, was wrong), leaving no
parent run of a sweep that never ran.
"""
from __future__ import annotations

import sys
from typing import Sequence

from hydra.core.utils import JobReturn

try:  # the `cluster` extra; Hydra imports every hydra_plugins module at start, installed or not
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurmLauncher
except ImportError:
    _SubmititSlurmLauncher = None

# what the job asks of each node, by hydra.launcher key
RESOURCE_KEYS = ("partition", "nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "mem_gb", "timeout_min")


def refusal(sbatch_error: str, params: dict) -> str:
    """The one line for sbatch's refusal of a job the launcher built from `params`."""
    lines = [line.strip() for line in sbatch_error.splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("sbatch: error:")), lines[-1] if lines else "no reason given")
    asked = ", ".join(f"{k}={params[k]}" for k in RESOURCE_KEYS if params.get(k) is not None)
    return (f"error: hydra/launcher=slurm: sbatch refused the job ({reason.removeprefix('sbatch: error: ')}); it asked "
            f"{asked}: set hydra.launcher.partition, hydra.launcher.gpus_per_node, hydra.launcher.cpus_per_task and "
            "hydra.launcher.mem_gb to what the partition has (sinfo -o '%P %D %c %m %G' lists them)")


if _SubmititSlurmLauncher is not None:

    class SlurmLauncher(_SubmititSlurmLauncher):
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            from submitit.core.utils import FailedJobError

            try:
                return super().launch(job_overrides, initial_job_idx)
            except FailedJobError as e:
                from runner.search.sweep_hook import discard_childless_parents

                discard_childless_parents()  # nothing ran: no FAILED parent run left behind
                print(refusal(str(e), self.params), file=sys.stderr, flush=True)
                sys.exit(2)

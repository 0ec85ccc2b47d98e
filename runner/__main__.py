"""`python -m runner [overrides]`: Hydra composes conf/ once; the run spec takes it from there."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from runner import registry
from runner.spec import SpecError


@hydra.main(config_path=str(registry.CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from runner.launch import run, spec_from_hydra

    from runner.launch import WorkersFailed
    from runner.monitor import Diverged

    try:
        return run(spec_from_hydra(cfg)).objective
    except SpecError as e:
        fail(str(e))
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except WorkersFailed as e:
        print(f"runner: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_group_options(argv: list[str]) -> None:
    """Catch `precision=fp17` with a one-line error before Hydra's multi-line one."""
    groups = set(registry.groups())
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in groups or "(" in value or "$" in value:
            continue
        allowed = registry.options(key)
        for option in value.split(","):
            if option not in allowed:
                fail(f"{key}: unknown option {option!r}; choose one of {', '.join(allowed)}")


def shared_run_dir_overrides() -> list[str]:
    """Under torchrun every rank runs this command and Hydra would give each its own run directory;
    rank 0 names one and all ranks use it (only rank 0 writes Hydra's files and logs)."""
    import datetime

    import torch

    from runner.parallel import broadcast_object, init_process_group

    env = init_process_group("cuda" if torch.cuda.is_available() else "cpu")
    now = datetime.datetime.now()
    run_dir = broadcast_object(f"outputs/runs/{now:%Y-%m-%d}/{now:%H-%M-%S-%f}")
    extra = [f"hydra.run.dir={run_dir}"]
    if env.rank != 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    return extra


def cli() -> None:
    from runner.parallel import in_torchrun

    check_group_options(sys.argv[1:])
    if in_torchrun() and "-m" not in sys.argv and "--multirun" not in sys.argv:
        sys.argv += shared_run_dir_overrides()
    try:
        main()
    except KeyboardInterrupt:
        print("runner: interrupted; the run was marked KILLED", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()

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

    try:
        return run(spec_from_hydra(cfg)).objective
    except SpecError as e:
        fail(str(e))


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


def cli() -> None:
    check_group_options(sys.argv[1:])
    try:
        main()
    except KeyboardInterrupt:
        print("runner: interrupted; the run was marked KILLED", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()

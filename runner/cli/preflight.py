"""Preflight: everything a user can get wrong, checked before Hydra starts the run and before torch,
MLflow or Optuna are imported (they take seconds to import): the override grammar, group options and
keys, the values and metric names (RunSpec), what the spec names outside itself, and whether the run
directory can be written. A mistake is one `error: <key>: ...` line and exit code 2, within a second,
with nothing created; Hydra's multi-line composition errors are rewritten to that one line here.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.specs import registry
from runner.cli.run_dir import check_writable, under_torchrun
from runner.specs.fields import did_you_mean
from runner.specs.peer_names import peer_hint, peer_option_hint
from runner.specs.metric_names import with_task_declarations
from runner.specs.run import OPTION_GROUPS, RunSpec, SpecError, check_option

CONFIG_NAME = "config"


def fail(message: str) -> NoReturn:
    print(f"error: {message}".replace("\n", " "), file=sys.stderr, flush=True)
    sys.exit(2)


def resolved(cfg: DictConfig) -> dict:
    """The config without Hydra's own node, as plain data with `${...}` resolved (a bad one is a SpecError)."""
    out = {}
    for key in cfg:
        if key == "hydra":  # preflight's config has it: its job fields are only known once a job runs
            continue
        try:
            value = cfg[key]  # a node keeps its root: interpolations resolve as in the whole config
            out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except OmegaConfBaseException as e:
            raise SpecError(f"{e.full_key or key}: cannot resolve an interpolation ({_first_line(e)}); "
                            "check the ${...} expression") from None
    return out


@dataclass(frozen=True)
class Checked:
    """What preflight found good. A single run's: its run directory as Hydra names it (`${now:...}` resolved
    here) and its composed config, Hydra's node included, which the entry runs as composed
    (runner/__main__.py run_composed) rather than having Hydra compose it twice more."""

    run_dir: str | None = None
    config: DictConfig | None = None
    config_loader: Any = None  # Hydra's, of that composition: a job's HydraContext carries it


def preflight(argv: list[str]) -> Checked:
    """Check the command line as Hydra will read it; `fail` at the first mistake."""
    from hydra._internal.utils import get_args_parser  # hydra.main's own parser: flags as Hydra reads them

    args, unknown = get_args_parser().parse_known_args(argv)
    if unknown:
        fail(f"{unknown[0]}: unknown flag; see python -m runner --help")
    modes = [flag for flag, on in (("--multirun", args.multirun), ("--cfg", args.cfg), ("--info", args.info),
                                   ("--shell-completion", args.shell_completion), ("--run", args.run)) if on]
    if len(modes) > 1:  # Hydra raises a ValueError (a traceback) for this
        fail(f"{modes[0]}: cannot be combined with {modes[1]}; give one of --multirun (-m), --cfg, --info, "
             f"--shell-completion, --run")
    if args.help or args.hydra_help or args.shell_completion or args.config_path or args.config_dir \
            or args.experimental_rerun:
        return Checked()  # Hydra's own business: nothing of the run is composed
    try:
        return _check_command_line(args)
    except SpecError as e:
        fail(str(e))


def expand_accum(argv: list[str]) -> list[str]:
    """`+accum=N` as the key it stands for (`accumulation.steps=N`), so `--cfg job`, the run's recorded
    overrides and a sweep's job lines show one value. With accumulation.steps also given it is left as
    typed: the spec refuses the pair when they differ."""
    if any(a.lstrip("+~").startswith("accumulation.steps=") for a in argv):
        return argv
    return [f"accumulation.steps={a.split('=', 1)[1]}" if a.startswith("+accum=") else a for a in argv]


def _check_command_line(args: Any) -> Checked:
    overrides = _parse(args.overrides)
    searchpath = _searchpath(overrides)
    _check_groups(overrides, searchpath)
    if not args.multirun:
        _refuse_sweeps(overrides)
    variants = _variants(overrides) if args.multirun else [[o.input_line for o in overrides]]
    dir_key = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    first: tuple[RunSpec, str] | None = None
    for variant in variants:
        cfg, config_loader = _compose(args.config_name or CONFIG_NAME, variant,
                                      searchpath if not (args.multirun or args.cfg or args.info) else None)
        if args.cfg or args.info:
            return Checked()  # printing the config: the values are the user's to inspect, not to run
        run_dir = str(_select(cfg, dir_key))
        container = resolved(cfg)
        container["run_dir"] = run_dir
        spec = RunSpec.from_config(container, tuple(line for line in variant if not _key_of(line).startswith("hydra")))
        spec = with_task_declarations(spec)  # metric names, the objective's direction: the task's checks
        if args.multirun:
            _check_sweeper(cfg, spec)
        first = first or (spec, run_dir)
    if first is not None:  # every job's values are good: now what they name outside themselves
        _check_surroundings(first[0], dir_key, first[1])
    if args.multirun or first is None:
        return Checked()
    return Checked(first[1], cfg, config_loader)


def _check_surroundings(spec: RunSpec, dir_key: str, run_dir: str) -> None:
    """What the spec names outside itself: the checkpoint to resume from, the tracking store, the run directory."""
    from runner.cli.run_lock import check_at_start

    if spec.mode == "train":
        check_at_start(spec.trainer.resume, dir_key, run_dir, spec.parallelism)  # the checkpoint to resume, the directory's owner
    else:  # the run evaluated, predicted with or exported is only read; this invocation's directory is new
        from runner.results import source

        source.check_at_start(spec)
        check_at_start(None, dir_key, run_dir)
    if spec.tracking.name == "mlflow":
        from runner.tracking.mlflow_store import check_tracking  # neither torch nor MLflow: a few seconds at most

        check_tracking(spec.tracking, for_the_run=dir_key == "hydra.run.dir")
    # the processes and GPUs the run asks for (torch, only where there are GPUs to count): before the early
    # tracking process makes the store
    from runner.cli.preflight_device import check_devices, check_processes

    check_processes(spec)
    check_devices(spec)
    if spec.tracking.name == "mlflow":
        start_tracking_early(spec, multirun=dir_key == "hydra.sweep.dir")
    # last, as it imports the model's and dataset's modules (torch): their keys against their signatures
    from runner.specs import components
    from runner.specs.resume import typed_keys

    spec = components.resolved_spec(spec, typed_keys(spec.overrides))
    if spec.parallelism.cp != 1:  # the device and torch at hand, and the model's attention (torch is imported by now)
        from runner.engine.parallel import pick_device
        from runner.engine.parallel.context import check_context_parallel

        check_context_parallel(spec, pick_device(spec.trainer.device))
    # what the model makes of a sharded or cut run (runner/cli/preflight_model.py): under the user's torchrun on
    # every rank, at torchrun's degrees (every rank's engine runs the same checks as it builds)
    from runner.cli.preflight_model import check_model_composition

    check_model_composition(spec)
    # ranks under torchrun share one directory that rank 0 names; a probe there would race
    if not under_torchrun():
        check_writable(dir_key, run_dir)


# the sweepers whose jobs are a feature of the composition table (runner/specs/composition.py), by their class
SWEEPER_FEATURES = {"PbtSweeper": ("pbt", "hydra/sweeper=pbt"), "OptunaSweeper": ("optuna", "hydra/sweeper=runner_optuna")}


def _check_sweeper(cfg: DictConfig, spec: RunSpec) -> None:
    """A sweep's jobs in a parallel dimension the table refuses for them: one line before Hydra makes the sweep
    directory (the spec of a job does not know the sweeper that runs it)."""
    from runner.specs import composition

    target = str(OmegaConf.select(cfg, "hydra.sweeper._target_") or "")
    feature = SWEEPER_FEATURES.get(target.rpartition(".")[2])
    if feature is not None:
        composition.check_feature(feature[0], feature[1], spec)


def start_tracking_early(spec: RunSpec, multirun: bool) -> None:
    """A run this process trains starts its tracking process now, before torch is imported: it imports MLflow
    and opens the store on another core while this one imports torch and builds the run
    (runner/tracking/store_process.py). Not for a multirun's jobs (one process, one MLflow import for them
    all), torchrun's workers, parallel launchers or k-fold's runs."""
    from runner.specs.parallelism import nominal_world

    if (spec.mode != "train" or spec.tracking.name == "none" or under_torchrun() or multirun
            or spec.parallelism.name != "single" or nominal_world(spec.parallelism) != 1
            or spec.trainer.cross_validation.folds or "mlflow" in sys.modules):
        return
    from runner.tracking import store_process

    store_process.start_early(spec.tracking.uri, spec.tracking.experiment, spec.tracking.artifact_root)


def _refuse_sweeps(overrides: list[Any]) -> None:
    for o in overrides:
        if o.is_sweep_override():
            value = o.get_value_string()
            raise SpecError(f"{o.key_or_group}: {value!r} is a sweep; add -m to run one job per value, "
                            f"or quote it to mean one string: {o.key_or_group}='{value}'")


def _parse(lines: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for line in lines:
        try:
            override = parser.parse_override(line)
        except HydraException as e:
            reason = [ln for ln in str(e).splitlines() if ln.strip() and "hydra.cc" not in ln and "Error parsing" not in ln]
            key = line.split("=", 1)[0] or line
            raise SpecError(f"{key}: {line!r} is not a valid override ({reason[0] if reason else 'bad syntax'}); "
                            "write key=value, e.g. optimizer.lr=0.01") from None
        if not override.key_or_group:
            raise SpecError(f"{line}: not a valid override (no key before '='); write key=value, e.g. optimizer.lr=0.01")
        parsed.append(override)
    return parsed


def _check_groups(overrides: list[Any], searchpath: tuple[str, ...] | None) -> None:
    """`precision=fp17`: the option check RunSpec.validate uses, before Hydra's multi-line error. Options
    of every group may be the user's own, from YAML on hydra.searchpath."""
    if searchpath is None:
        return  # a search path known only once composed: Hydra looks, and its "could not find" is one line in _compose
    groups = set(registry.groups(searchpath))
    for o in overrides:
        if o.key_or_group not in groups or o.is_delete() or o.is_interval_sweep():
            continue
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator()) if o.is_discrete_sweep() and not _is_glob(o) else []
        else:
            values = [o.value()]
        for value in values:
            if value is not None:  # `experiment=null` deselects the group
                check_option(o.key_or_group, value, searchpath=searchpath)


def _searchpath(overrides: list[Any]) -> tuple[str, ...] | None:
    """The search path as Hydra will read it: the primary config's, then the command line's."""
    import yaml

    # libyaml's parser where PyYAML has it: the same values, 6 ms less of every start-up than PyYAML's own
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    primary = yaml.load((registry.CONF_DIR / f"{CONFIG_NAME}.yaml").read_text(), Loader=loader) or {}
    entries = list((primary.get("hydra") or {}).get("searchpath") or [])
    for o in overrides:
        if o.key_or_group == "hydra.searchpath" and not o.is_sweep_override() and not o.is_delete():
            value = o.value()
            entries += list(value) if isinstance(value, list) else [value]
    if any("${" in str(entry) for entry in entries):
        return None
    return tuple(str(entry) for entry in entries)


def _is_glob(o: Any) -> bool:
    from hydra.core.override_parser.types import Glob

    return isinstance(o.value(), Glob)


def _variants(overrides: list[Any], limit: int = 32) -> list[list[str]]:
    """For a multirun: the first job of the sweep, then each other value of each enumerable sweep
    on its own (up to `limit` jobs), so a bad value fails here rather than midway through the sweep.
    Interval sweeps (Optuna's) have no values to try; they leave the key at its configured value."""
    def line(o: Any, value: str) -> str:
        return f"{o.get_key_element()}={value}"

    first: list[str] = []
    others: list[tuple[int, str]] = []
    for o in overrides:
        if not o.is_sweep_override():
            first.append(o.input_line)
        elif o.is_discrete_sweep() and not _is_glob(o):
            values = list(o.sweep_string_iterator())
            if not values:  # range(5,1): nothing to run
                raise SpecError(f"{o.get_key_element()}: {o.input_line.partition('=')[2]} has no values; allowed: "
                                "range(start, stop) with start < stop, or a negative step to count down")
            first.append(line(o, values[0]))
            others += [(len(first) - 1, line(o, v)) for v in values[1:]]
    variants = [first]
    for index, replacement in others[:limit - 1]:
        variants.append(first[:index] + [replacement] + first[index + 1:])
    return variants


def _compose(config_name: str, overrides: list[str], cache_searchpath: tuple[str, ...] | None = None
             ) -> tuple[DictConfig, Any]:
    """The config a run of these overrides gets, as Hydra composes it for a job (RUN mode, Hydra's node
    included), and the config loader that composed it. With the search path given (a single run's), the
    composition is kept and reused while nothing it reads changes (runner/cli/compose_cache.py)."""
    import warnings

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException

    from runner.cli import compose_cache

    digest = compose_cache.key(config_name, overrides, cache_searchpath) if cache_searchpath is not None else None
    cached = compose_cache.load(digest)
    if cached is not None:
        cfg, config_loader = cached
    else:
        with initialize_config_dir(config_dir=str(registry.CONF_DIR), version_base=compose_cache.VERSION_BASE):
            try:
                with warnings.catch_warnings(record=True) as warned:
                    cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
            except (HydraException, OmegaConfBaseException) as e:
                raise SpecError(_composition_error(e, config_name, overrides)) from None
            finally:
                for w in warned:  # shown as they would have been; a config composed with a warning is not kept
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
            config_loader = GlobalHydra.instance().config_loader()
        if not warned:
            compose_cache.store(digest, cfg, config_loader)  # as composed: nothing has resolved ${now:...} yet
    HydraConfig.instance().set_config(cfg)  # as Hydra does for a job: ${hydra:...} resolves
    return cfg, config_loader


def _composition_error(error: Exception, config_name: str, overrides: list[str]) -> str:
    """One line for Hydra's multi-line composition errors, naming the override at fault; an unknown
    key gets the closest existing key."""
    from hydra import compose
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = error.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        # the keys the user could have meant: the config composed with the group choices alone
        # (and the search path, where a user's options live)
        groups = [line for line in overrides if _is_group(_key_of(line)) or _key_of(line) == "hydra.searchpath"]
        try:
            return unknown_key_message(cause.full_key, compose(config_name, overrides=groups, return_hydra_config=True))
        except (HydraException, OmegaConfBaseException):
            pass
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    if isinstance(error, MissingConfigException) and "Could not find '" in str(error):
        group, _, option = str(error).split("Could not find '")[1].split("'")[0].rpartition("/")
        available = [ln for ln in lines if ln.startswith("Available options")]
        choices = lines[lines.index(available[0]) + 1:] if available else []
        choices = choices[:next((i for i, ln in enumerate(choices) if ln.startswith("Config search path")), len(choices))]
        hint = peer_option_hint(group, option) or did_you_mean(option, choices)
        return f"{group}: unknown option {option!r}; {hint}choose one of {', '.join(choices)}"
    if isinstance(cause, OmegaConfBaseException) and cause.full_key == "trainer.callbacks":  # a mapping for the list
        from runner.specs.trainer import callbacks_refusal

        typed = [line.split("=", 1)[1] for line in overrides if _key_of(line) == "trainer.callbacks" and "=" in line]
        return callbacks_refusal(typed[-1] if typed else "a mapping")
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return f"{cause.full_key}: {_first_line(cause)}"
    keys = [_key_of(line) for line in overrides]
    culprit = next((k for k in keys if f"'{k}'" in str(error)), "config")
    return f"{culprit}: {' '.join(ln for ln in lines if not ln.startswith('Config search path'))}"


def _key_of(line: str) -> str:
    return line.split("=", 1)[0].lstrip("+~").split("@")[0]


def _is_group(key: str) -> bool:
    return "/" in key or key in registry.groups()


def unknown_key_message(key: str, cfg: DictConfig) -> str:
    if key == "accum":
        return "accum: the shorthand is added with a plus: +accum=N"
    plain = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(plain, dict)
    if not key.startswith("hydra."):
        plain.pop("hydra", None)
    parent, _, leaf = key.rpartition(".")
    if "." not in key and key not in plain and key in registry.groups():  # `tune.min_lr=...` with no tune= chosen
        return f"{key}: no {key} option is chosen, so it has no keys; choose one first: {key}=<{'|'.join(registry.options(key))}>"
    if parent in OPTION_GROUPS and isinstance(plain.get(parent), dict):
        meta = _spec_field(parent, leaf)
        if meta is not None:  # a spec key that the chosen option does not take
            return f"{key}: {parent}={plain[parent].get('name')} has no {leaf} ({meta['help']})"
    hint = peer_hint(key) or did_you_mean(key, list(_dotted(plain)))
    node = OmegaConf.select(cfg, parent) if parent else None
    if isinstance(node, DictConfig) and not node:  # a free mapping left empty (model.config: {}): it takes new keys
        return f"{key}: {parent} holds no keys yet, so a new one is added with a plus: +{key}=<value>"
    if isinstance(node, DictConfig):
        return f"{key}: unknown key; {hint}keys under {parent}: {', '.join(sorted(str(k) for k in node))}"
    return f"{key}: unknown key; {hint.strip().rstrip(';') or 'python -m runner --cfg job shows every key'}"


def _spec_field(group: str, name: str) -> Any:
    import dataclasses
    import typing

    cls = typing.get_type_hints(RunSpec)[group]
    return next((f.metadata for f in dataclasses.fields(cls) if f.name == name), None)


def _dotted(node: dict, prefix: str = "") -> Any:
    for k, v in node.items():
        yield f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _dotted(v, f"{prefix}{k}.")


def _select(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise SpecError(f"{key}: cannot resolve it ({_first_line(e)})") from None


def _first_line(error: BaseException) -> str:
    return next((ln.strip() for ln in str(error).splitlines() if ln.strip()), type(error).__name__)

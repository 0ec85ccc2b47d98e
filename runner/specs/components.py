"""Components named by `_target_`: the model, the dataset and the task, the optimizer and the schedule, a
user's or a built-in one alike.

A component's YAML names a callable (`_target_`, Hydra's instantiate convention) and gives its keyword
arguments. `resolve` checks them against the callable's signature before anything starts (an unknown
key names the key and lists the accepted ones; annotated types are checked), fills in the signature's
defaults, so spec.yaml is the fully resolved record, and keeps only the chosen component's own keys.

What the data decides reaches a model only through constructor parameters of the documented names
(DATA_DECIDED); a model that does not name them takes its sizes from its YAML. The spec is data: the
components are built by the engine (runner/engine/components.py).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import types
import typing
from typing import Any, Callable

from runner.specs import metric_names
from runner.specs.fields import SpecError, convert, did_you_mean
from runner.specs.run import RunSpec

log = logging.getLogger(__name__)

DATA_DECIDED = ("num_classes", "input_shape", "vocab_size", "max_length", "pad_token_id", "tokenizer")


def load_target(group: str, target: str) -> Callable:
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        found = getattr(module, attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise SpecError(f"{group}._target_: cannot import {target!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                        "give a dotted path to a class or function importable from here") from None
    if not callable(found):  # named the key typed, not the call's "'int' object is not callable"
        raise SpecError(f"{group}._target_: {target!r} is not a class or function (it is {type(found).__name__} "
                        f"{str(found)[:40]}); give a dotted path to a class or function importable from here")
    return found


_noted: set[tuple[str, str, str]] = set()


def _note_unused(group: str, target: str, keys: str) -> None:
    """Said once: a run's spec is resolved more than once (checked before logging is set up, then launched, then
    built), and only a note a handler took counts as said."""
    if (group, target, keys) in _noted:
        return
    if log.hasHandlers():
        _noted.add((group, target, keys))
    log.info("%s._target_=%s: the option's own keys (%s) are not used", group, target, keys)


def _same(default: Any, value: Any) -> bool:
    try:
        return bool(default == value)
    except Exception:  # a default whose == is not a plain truth value (a tensor)
        return False


def resolve(group: str, target: str, params: dict[str, Any], typed: set[str] = frozenset()) -> dict[str, Any]:
    """`params` checked against the target's signature and completed with its defaults.

    A `_target_` typed on the command line starts from its own signature's defaults: of the option's YAML
    (written for the option's callable) only the keys typed with it are applied. Otherwise keys that came
    from the YAML and that the target does not take are dropped with a note. A typed key the target does
    not take is an error. A mapping with its own `_target_` among the arguments is a component too
    (Hydra's instantiate convention): its keys are checked the same way, and it is built before the call."""
    fn = load_target(group, target)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    if f"{group}._target_" in typed:
        # a key at the target's own default is not the option's (a spec resolved once already holds the defaults)
        own = {} if signature is None else {n: p.default for n, p in signature.parameters.items()}
        dropped = sorted(k for k, v in params.items() if f"{group}.{k}" not in typed and not k.startswith("_")
                         and not (k in own and _same(own[k], v)))
        if dropped:
            _note_unused(group, target, ", ".join(dropped))
        params = {k: v for k, v in params.items() if k not in dropped}
    if signature is None:
        return dict(params)
    annotations = hints(fn)
    decided = decided_by_runner(group, fn)  # e.g. a model's sizes come from the data, a dataset's are its own
    accepted = {name: p for name, p in signature.parameters.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in decided}
    open_ended = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key.startswith("_") and key.endswith("_"):  # instantiate's own keys: _partial_, _args_, _convert_
            out[key] = value
            continue
        if key not in accepted and not open_ended:
            if key in decided and key in signature.parameters:
                raise SpecError(f"{group}.{key}: decided by {decided[key]} for {target}; remove it from the config")
            if f"{group}.{key}" not in typed:
                log.info("%s.%s dropped: %s does not take it", group, key, target)
                continue
            raise SpecError(f"{group}.{key}: unknown key for {target}; {did_you_mean(key, accepted)}"
                            f"accepted keys: {', '.join(sorted(accepted)) or '(none)'}")
        out[key] = _nested(value, f"{group}.{key}", typed)
        if out[key] is value:  # not a component: its annotation says what it may be
            out[key] = _convert_param(annotations.get(key), value, f"{group}.{key}")
    if params.get("_partial_") is True:
        return out  # the rest of the arguments come at call time
    for name, p in accepted.items():
        if name not in out:
            if p.default is p.empty:
                raise SpecError(f"{group}.{name}: {target} needs a value for it; add +{group}.{name}=...")
            out[name] = _plain(p.default)
    return out


def _nested(value: Any, key: str, typed: set[str]) -> Any:
    """A nested component (a mapping with a `_target_`, or a list of them) resolved; anything else as it is."""
    if isinstance(value, dict) and isinstance(value.get("_target_"), str):
        rest = {k: v for k, v in value.items() if k != "_target_"}
        if key in typed:  # the whole mapping was typed: so was each of its keys
            typed = {*typed, *(f"{key}.{k}" for k in value)}
        return {"_target_": value["_target_"], **resolve(key, value["_target_"], rest, typed)}
    if isinstance(value, list) and any(isinstance(v, dict) and "_target_" in v for v in value):
        return [_nested(v, f"{key}[{i}]", typed) for i, v in enumerate(value)]
    return value


def resolved_spec(spec: RunSpec, typed: set[str] = frozenset()) -> RunSpec:
    """The spec a run runs: its model and dataset arguments checked and completed, the task's declarations
    applied (metric names checked, the objective's direction and the metric modes filled in:
    metric_names.with_task_declarations), and its task, optimizer and schedule arguments checked and completed."""
    model = resolve("model", spec.model.target, spec.model.params, typed)
    data = resolve("dataset", spec.dataset.target, spec.dataset.params, typed)
    # here, in preflight, rather than once the data is built: reading and tokenizing can take minutes
    check_model_reads(spec, declared_inputs(load_target("dataset", spec.dataset.target)))
    spec = spec.replace(model=spec.model.with_params(model), dataset=spec.dataset.with_params(data))
    return resolved_callbacks(resolved_parts(metric_names.with_task_declarations(spec), typed))


# --- a user's own engine add-ons: trainer.callbacks ------------------------------------------------

def resolved_callbacks(spec: RunSpec) -> RunSpec:
    """trainer.callbacks checked against their classes (each an engine add-on) and completed with their
    defaults. Every key of a callback is the user's own, so one its class does not take is an error."""
    resolved = []
    for i, callback in enumerate(spec.trainer.callbacks):
        key = f"trainer.callbacks[{i}]"
        check_addon(key, callback.target)
        params = resolve(key, callback.target, callback.params, {f"{key}.{k}" for k in callback.params})
        resolved.append(callback.with_params(params))
    if not resolved:
        return spec
    return spec.replace(trainer=dataclasses.replace(spec.trainer, callbacks=tuple(resolved)))


ADDON_CLASS = "runner.addons.base.AddOn"


def check_addon(key: str, target: str) -> None:
    fn = load_target(key, target)
    # the protocol's class by its name: the spec imports nothing of the add-ons (it is data they read)
    if not (inspect.isclass(fn) and any(f"{c.__module__}.{c.__qualname__}" == ADDON_CLASS for c in fn.__mro__)):
        raise SpecError(f"{key}._target_: {target} is not an engine add-on; give a class that subclasses "
                        "runner.addons.base.AddOn (its hooks: runner/addons/base.py)")


# --- what a model reads against what the data gives, known before either is built ----------------

def declared_inputs(builder: Callable) -> str | None:
    """"token ids" when the builder's return annotation promises them (a DataSplits subclass with
    `gives_token_ids`, data/splits.py's TokenSplits), else None: known only once it has run."""
    returns = hints(builder).get("return") if not inspect.isclass(builder) else None
    return "token ids" if getattr(returns, "gives_token_ids", False) is True else None


def model_reads(target: str) -> str | None:
    """What a model reads, by the data-decided sizes its signature takes: a vocabulary means token ids,
    an input shape without one means tensors (images, features); None when it names neither."""
    try:
        names = inspect.signature(load_target("model", target)).parameters
    except (TypeError, ValueError):
        return None
    return "token ids" if "vocab_size" in names else "tensors" if "input_shape" in names else None


def check_model_reads(spec: RunSpec, data_gives: str | None) -> None:
    reads = model_reads(spec.model.target)
    if data_gives is not None and reads is not None and reads != data_gives:
        what = "vocab_size" if reads == "token ids" else "input_shape"
        dataset_key = _typed_dataset_key(spec.overrides)
        if dataset_key is not None:  # the dataset was what the user changed: their key, the dataset to change
            raise SpecError(f"{dataset_key}: dataset {spec.dataset.target} gives {data_gives}, but model "
                            f"{spec.model.target} reads {reads} (it takes {what}); choose a dataset of {reads} or "
                            f"another model")
        raise SpecError(f"model: {spec.model.target} reads {reads} (it takes {what}), but dataset "
                        f"{spec.dataset.target} gives {data_gives}; choose a model for {data_gives} or another dataset")


def _typed_dataset_key(overrides: tuple[str, ...]) -> str | None:
    """The dataset key typed (dataset=..., dataset.root=...) when no model key was: the one to name."""
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides if "=" in o]
    if any(k == "model" or k.startswith("model.") for k in keys):
        return None
    return next((k for k in keys if k == "dataset" or k.startswith("dataset.")), None)


# --- the training parts: task, optimizer, schedule ------------------------------------------------

# What runner decides for a part's callable, by parameter name, and who decides it (never from YAML).
RUN_DECIDED = {
    "task": {"num_classes": "the data"},
    "optimizer": {"foreach": "optimizer.impl", "fused": "optimizer.impl"},
    "scheduler": {"total_steps": "the run's length", "warmup_steps": "scheduler.warmup",
                  "last_epoch": "the run's step", "verbose": "runner"},
}


def decided_by_runner(group: str, fn: Callable) -> dict[str, str]:
    """Parameters of a component's callable that runner fills in, and who decides them: a model's sizes
    come from the data; an optimizer gets the parameter groups first, a schedule the optimizer (a class)
    or the step (a function)."""
    if group == "model":
        return {name: "the data" for name in DATA_DECIDED}
    decided = dict(RUN_DECIDED.get(group, {}))
    if group in ("optimizer", "scheduler"):
        try:
            first = next(iter(inspect.signature(fn).parameters), None)
        except (TypeError, ValueError):
            first = None
        if first is not None:
            decided[first] = "runner"
    return decided


def resolved_parts(spec: RunSpec, typed: set[str] = frozenset()) -> RunSpec:
    """The spec with its task, optimizer and schedule arguments checked against their callables and completed."""
    parts = {group: getattr(spec, group) for group in ("task", "optimizer", "scheduler")}
    return spec.replace(**{group: part.with_params(resolve(group, part.target, part.params, typed))
                           for group, part in parts.items()})


def typed_keys_under(overrides: tuple[str, ...], group: str) -> list[str]:
    """The keys of `group` the user typed (model.hidden from `model.hidden=[...]`), in their order."""
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides if "=" in o]
    return list(dict.fromkeys(k for k in keys if k.startswith(group + ".")))


def hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # unresolvable annotations: types are then not checked
        return {}


def _convert_param(tp: Any, value: Any, key: str) -> Any:
    """A value converted by its annotation; what runner.specs.fields does not type (Any, dicts, unions of
    several types, no annotation) is passed as given."""
    tp = yaml_type(tp)
    if tp is None or tp is Any:
        return _plain(value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args and len(args) == 2:
        return None if value is None else _convert_param(next(a for a in args if a is not type(None)), value, key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"{key}: {value!r} is not a list")
        return [_convert_param(args[0] if args else None, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple or tp in (bool, int, float, str) or origin is typing.Literal:
        return _plain(convert(tp, value, key))
    return _plain(value)


def yaml_type(tp: Any) -> Any:
    """An annotation without the members a YAML value cannot be (torch's `float | Tensor` is a float here)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        kept = [a for a in args if a in (bool, int, float, str, type(None)) or typing.get_origin(a) in (list, tuple, dict)]
        return typing.Union[tuple(kept)] if kept else tp
    if origin is tuple and args:
        return tuple[tuple(yaml_type(a) for a in args)]
    return tp


def _plain(value: Any) -> Any:
    """YAML-safe: tuples as lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value

"""Components named by `_target_`: the model and the dataset, a user's or a built-in one alike.

A component's YAML names a callable (`_target_`, Hydra's instantiate convention) and gives its keyword
arguments. `resolve` checks them against the callable's signature before anything starts (an unknown
key names the key and lists the accepted ones; annotated types are checked), fills in the signature's
defaults, so spec.yaml is the fully resolved record, and keeps only the chosen component's own keys.

What the data decides reaches a model only through constructor parameters of the documented names
(DATA_DECIDED); a model that does not name them takes its sizes from its YAML.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import typing
from typing import Any, Callable

from runner.fields import SpecError, _convert
from runner.spec import RunSpec, did_you_mean

log = logging.getLogger(__name__)

DATA_DECIDED = ("num_classes", "input_shape", "vocab_size", "max_length", "pad_token_id")


def load_target(group: str, target: str) -> Callable:
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise SpecError(f"{group}._target_: cannot import {target!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                        "give a dotted path to a class or function importable from here") from None


def resolve(group: str, target: str, params: dict[str, Any], typed: set[str] = frozenset()) -> dict[str, Any]:
    """`params` checked against the target's signature and completed with its defaults.

    Keys that came from an option's YAML (not typed on the command line) and that the target does not
    take are dropped with a note: `model._target_=pkg.Net` replaces the default option's callable, whose
    own keys mean nothing to pkg.Net. A typed key the target does not take is an error."""
    fn = load_target(group, target)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return dict(params)
    hints = _hints(fn)
    decided = DATA_DECIDED if group == "model" else ()  # a model's sizes come from the data, a dataset's are its own
    accepted = {name: p for name, p in signature.parameters.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in decided}
    open_ended = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in accepted and not open_ended:
            if key in decided and key in signature.parameters:
                raise SpecError(f"{group}.{key}: decided by the data for {target}; remove it from the config")
            if f"{group}.{key}" not in typed:
                log.info("%s.%s dropped: %s does not take it", group, key, target)
                continue
            raise SpecError(f"{group}.{key}: unknown key for {target}; {did_you_mean(key, accepted)}"
                            f"accepted keys: {', '.join(sorted(accepted)) or '(none)'}")
        out[key] = _convert_param(hints.get(key), value, f"{group}.{key}")
    for name, p in accepted.items():
        if name not in out:
            if p.default is p.empty:
                raise SpecError(f"{group}.{name}: {target} needs a value for it; add +{group}.{name}=...")
            out[name] = _plain(p.default)
    return out


def resolved_spec(spec: RunSpec, typed: set[str] = frozenset()) -> RunSpec:
    """The spec with its model and dataset arguments checked and completed."""
    model = resolve("model", spec.model.target, spec.model.params, typed)
    data = resolve("dataset", spec.dataset.target, spec.dataset.params, typed)
    return spec.replace(model=spec.model.with_params(model), dataset=spec.dataset.with_params(data))


def build_data(spec: RunSpec) -> Any:
    builder = load_target("dataset", spec.dataset.target)
    return _call("dataset", builder, spec.dataset.params)


def build_model(spec: RunSpec, data: Any) -> Any:
    """The model from its YAML's arguments plus what the data decides, for the parameters its signature names."""
    fn = load_target("model", spec.model.target)
    kwargs = dict(spec.model.params)
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        names = {}
    for name in DATA_DECIDED:
        value = getattr(data, name, None)
        if name in names and value is not None:
            kwargs[name] = tuple(value) if name == "input_shape" else value
    missing = [n for n, p in names.items() if p.default is p.empty and n not in kwargs
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise SpecError(f"model.{missing[0]}: {spec.model.target} needs it and the dataset ({spec.dataset.target}) "
                        f"does not provide it; choose a dataset that does, or set +model.{missing[0]}=...")
    return _call("model", fn, kwargs)


def _call(group: str, fn: Callable, kwargs: dict[str, Any]) -> Any:
    try:
        return fn(**{k: list(v) if isinstance(v, tuple) and k != "input_shape" else v for k, v in kwargs.items()})
    except (ValueError, TypeError) as e:  # a component's one-line complaint about its own arguments
        if isinstance(e, SpecError):
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecError(f"{group}.{first}") from None
    except (RuntimeError, MemoryError) as e:  # e.g. a layer too big to allocate: the config asked for it
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecError(f"{group}: building {getattr(fn, '__name__', fn)} failed ({first[:200]}); check its sizes") from None
    except Exception as e:  # a user's builder failing its own way (KeyError, OSError, ...): what it said, on one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise SpecError(f"{group}._target_: {getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)} raised "
                        f"{type(e).__name__}{f' ({first[:200]})' if first else ''}; fix it or name another") from None


def _hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # unresolvable annotations: types are then not checked
        return {}


def _convert_param(tp: Any, value: Any, key: str) -> Any:
    """A value converted by its annotation; what runner.fields does not type (Any, dicts, unions of
    several types, no annotation) is passed as given."""
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
        return _plain(_convert(tp, value, key, None))
    return _plain(value)


def _plain(value: Any) -> Any:
    """YAML-safe: tuples as lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value



def check_data(spec: RunSpec, data: Any) -> Any:
    """A builder must return DataSplits (or anything with its train, val and test splits)."""
    if not all(hasattr(data, split) for split in ("train", "val", "test")):
        raise SpecError(f"dataset._target_: {spec.dataset.target} returned a {type(data).__name__}, not DataSplits "
                        "(train, val and test splits); return runner.data.DataSplits(train, val, test, ...)")
    return data


def check_model(spec: RunSpec, module: Any, loaded: bool = False) -> Any:
    """What the engine can train: a torch.nn.Module with parameters; once its weights are loaded and its
    frozen parameters frozen (`loaded`), finite weights and some parameters left to train."""
    import torch  # here: preflight imports this module before torch is needed

    if not isinstance(module, torch.nn.Module):
        raise SpecError(f"model._target_: {spec.model.target} returned a {type(module).__name__}, not a "
                        "torch.nn.Module; name a class or function that builds the model")
    if next(module.parameters(), None) is None:
        raise SpecError(f"model._target_: {spec.model.target} has no parameters: there is nothing to train; "
                        "name a model with parameters")
    if not loaded:
        return module
    if spec.model.weights:
        bad = next((name for name, t in module.state_dict().items()
                    if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
        if bad is not None:  # it would train as a divergence at step 1, not naming the file
            raise SpecError(f"model.weights: {spec.model.weights} holds NaN or inf (in {bad}); give finite weights")
    if spec.model.freeze and spec.model.unfreeze_after_epochs is None and not any(
            p.requires_grad for p in module.parameters()):
        raise SpecError(f"model.freeze: {list(spec.model.freeze)} freezes every parameter of {spec.model.target}: "
                        "nothing is left to train; freeze fewer, or unfreeze later with model.unfreeze_after_epochs")
    return module

"""Components named by `_target_`, built: the model, the dataset, the task, a part's callable (optimizer,
schedule), a user's add-ons. Their arguments were checked and completed while the spec was made
(runner/specs/components.py: resolve, resolved_spec); here they are called, and a component's own complaint
about its arguments becomes one line naming the key.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Callable

from runner.specs.components import DATA_DECIDED, check_addon, load_target, typed_keys_under
from runner.specs.fields import SpecError
from runner.specs.run import RunSpec
from runner.specs.task import TaskSpec


def build_callbacks(spec: RunSpec) -> list[Any]:
    """The user's add-ons of trainer.callbacks, built; each is named by its class's `name`, else by its
    `_target_` (its checkpoint entry; a second of one target gets #2)."""
    built: list[Any] = []
    seen: dict[str, int] = {}
    for i, callback in enumerate(spec.trainer.callbacks):
        key = f"trainer.callbacks[{i}]"
        check_addon(key, callback.target)
        addon = build_component(key, callback.target, callback.params, {})
        name = addon.name or callback.target
        seen[name] = seen.get(name, 0) + 1
        addon.name = name if seen[name] == 1 else f"{name}#{seen[name]}"
        addon.origin = f"{key} ({callback.target})"
        built.append(addon)
    return built

def build_component(group: str, target: str, params: dict[str, Any], decided: dict[str, Any],
                    *args: Any) -> Any:
    """Call a part's callable with `args`, its own arguments and those of `decided` its signature names;
    a ValueError or TypeError it raises about its arguments becomes one line naming the key."""
    fn = load_target(group, target)
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        names = {}
    kwargs = {**{k: v for k, v in decided.items() if k in names}, **params}
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        raise SpecError(complaint(group, fn, e, list(kwargs))) from None


def complaint(group: str, fn: Callable, error: Exception, keys: list[str]) -> str:
    """One line for a component's error: `<group>.<key>: ...` when it names one of its arguments."""
    if isinstance(error, SpecError):
        return str(error)
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    head = first.split(":", 1)[0].strip()
    if head in keys:  # the convention of runner's built-ins: "milestones: 5 is not allowed; ..."
        return f"{group}.{first}"
    found = [(first.lower().find(k.lower()), -len(k), k) for k in keys if k.lower() in first.lower()]
    named = min(found)[2] if found else None  # the argument the message names first
    where = f"{group}.{named}" if named else group
    return f"{where}: {getattr(fn, '__qualname__', fn)} refuses it ({first})"


def build_dataset(spec: RunSpec) -> Any:
    """The dataset's splits as its builder returns them, its complaint one line naming the key. A run's data
    (a k-fold run's fold, checked against the model and the task) is runner/engine/run_data.py's build_data."""
    builder = load_target("dataset", spec.dataset.target)
    try:
        return _call("dataset", builder, spec.dataset.params)
    except SpecError as e:
        raise SpecError(_as_model_path(spec, str(e))) from None


def _as_model_path(spec: RunSpec, message: str) -> str:
    """A text dataset reads a pretrained model's own tokenizer from model.path (dataset.tokenizer's default):
    where the user typed model.path and not dataset.tokenizer, a complaint about the tokenizer is one about
    the model.path they typed."""
    path = spec.model.params.get("path")
    head = "dataset.tokenizer: "
    if (not message.startswith(head) or path is None or spec.dataset.params.get("tokenizer") != path
            or "dataset.tokenizer" in typed_keys_under(spec.overrides, "dataset")):
        return message
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is a file, not a directory"
        return (f"model.path: {path!r} {what}; allowed: a local directory written by save_pretrained (the model and "
                "its tokenizer; nothing is downloaded)")
    return f"model.path: {message.removeprefix(head)} (the data reads the model's tokenizer from model.path)"


def build_task(spec: TaskSpec, num_classes: int | None) -> Any:
    """The task `spec.target` (a runner.tasks.Task) with its own arguments, and the data's number of classes
    where its class takes one."""
    return build_component("task", spec.target, spec.params, {"num_classes": num_classes})


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
        decided = missing[0] in DATA_DECIDED  # the data's to give: a value in the config would be refused
        raise SpecError(f"model.{missing[0]}: {spec.model.target} needs it and the dataset ({spec.dataset.target}) "
                        f"does not provide it; choose a dataset that does" +
                        ("" if decided else f", or set +model.{missing[0]}=..."))
    return _call("model", fn, kwargs, dataset_keys=set(spec.dataset.params), typed=typed_keys_under(spec.overrides, "model"))


def _call(group: str, fn: Callable, kwargs: dict[str, Any], dataset_keys: set[str] = frozenset(),
          typed: list[str] = ()) -> Any:
    """The component built; its plain complaint (ValueError, TypeError, a file it cannot find), a
    built-in's or a user's alike, becomes the one line `<group>.<its key>: ...`."""
    kwargs = {k: _instantiated(v, f"{group}.{k}") for k, v in kwargs.items()}
    try:
        return fn(**{k: list(v) if isinstance(v, tuple) and k != "input_shape" else v for k, v in kwargs.items()})
    except SpecError:
        raise
    except (ValueError, TypeError) as e:  # a component's one-line complaint about its own arguments
        raise SpecError(_keyed(group, _first_line(e), dataset_keys)) from None
    except FileNotFoundError as e:
        raise SpecError(f"{group}: {_name(fn)} could not open {e.filename} ({e.strerror})") from None
    except (RuntimeError, MemoryError) as e:  # e.g. a layer too big to allocate: the config asked for it
        why = re.sub(r"^\[enforce fail at [^]]*\] err == 0\. ", "", _first_line(e))[:200]  # c10's allocator prefix
        sizes = [k for k in typed if _is_size(kwargs.get(k.partition(".")[2]))]
        if sizes:  # the sizes the user typed: the key to change is theirs
            named = ", ".join(f"{k}={kwargs[k.partition('.')[2]]}" for k in sizes)
            raise SpecError(f"{sizes[0]}: building {_name(fn)} with {named} failed ({why}); allowed: sizes that fit "
                            "in memory") from None
        raise SpecError(f"{group}: building {_name(fn)} failed ({why}); check its sizes") from None
    except Exception as e:  # a user's builder failing its own way (KeyError, OSError, ...): what it said, on one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise SpecError(f"{group}._target_: {getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)} raised "
                        f"{type(e).__name__}{f' ({first[:200]})' if first else ''}; fix it or name another") from None

def _is_size(value: Any) -> bool:
    numbers = value if isinstance(value, (list, tuple)) else [value]
    return bool(numbers) and all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)


def _keyed(group: str, message: str, dataset_keys: set[str]) -> str:
    """`key: why` under its group; a model's complaint about what the data decided names the dataset's
    key of that name where it has one (dataset.tokenizer, dataset.vocab_size): that is what to change."""
    key, sep, _ = message.partition(": ")
    if not sep or not _KEY.fullmatch(key):
        return f"{group}: {message}"
    if key in DATA_DECIDED and key in dataset_keys:
        group = "dataset"
    elif key == "max_length" and "block_size" in dataset_keys:  # a token corpus's sequence length is its block_size
        return f"dataset.block_size{message[len(key):]}"
    return f"{group}.{message}"


_KEY = re.compile(r"[A-Za-z_][\w.]*(\[\d+\])?")  # width, config.dim, channels[1]


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", str(fn))


def _instantiated(value: Any, key: str) -> Any:
    """Nested components built as hydra.utils.instantiate builds them (recursively, `_partial_` and `_args_`
    included), with plain containers rather than OmegaConf's."""
    if isinstance(value, dict) and "_target_" in value:
        from hydra.utils import instantiate

        try:
            return instantiate({"_convert_": "all", **value})
        except Exception as e:  # instantiate wraps the callable's own error: that one is the user's
            cause = e.__cause__ or e
            first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
            raise SpecError(f"{key}: building {value['_target_']} failed ({first[:200]})") from None
    if isinstance(value, dict):
        return {k: _instantiated(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_instantiated(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return value

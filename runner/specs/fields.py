"""Typed spec fields: `opt` declares a dataclass field with its help text and bounds; `build` makes
frozen dataclasses from plain data (Hydra's composed config, spec.yaml), checking every key, type
and range, and says what is wrong in one line (`SpecError`). `Component` is what the specs of the
groups named by `_target_` (dataset, model, task, optimizer, scheduler) share.

Written here rather than taken from pydantic or OmegaConf structured configs: those report several
lines per error and neither suggests the key a typo meant.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import field, fields
from typing import Any, Literal

from runner.specs.peer_names import peer_hint


class SpecError(ValueError):
    """Bad user input: one line naming the key, the bad value and what is allowed."""


def opt(default: Any, help: str, *, gt: float | None = None, ge: float | None = None,
        le: float | None = None, lt: float | None = None) -> Any:
    """A spec field with its help text and numeric bounds (on a list field: bounds of every element)."""
    meta = {"help": help, "gt": gt, "ge": ge, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


def build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"{prefix[:-1] or 'spec'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        close = difflib.get_close_matches(unknown[0], list(known), n=1, cutoff=0.6)
        hint = peer_hint(key) or (f"did you mean {prefix}{close[0]}? " if close else "")
        raise SpecError(f"{key}: unknown key; {hint}allowed keys under {prefix[:-1] or 'the root'}: {', '.join(sorted(known))}")
    values = {}
    for name, value in data.items():
        f = known[name]
        values[name] = convert(hints[name], value, f"{prefix}{name}", f.metadata)
    return cls(**values)


def convert(tp: Any, value: Any, key: str, meta: Any = None) -> Any:
    """`value` checked and converted to the annotation `tp`; errors name `key` (meta: an opt() field's range)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # parsed already (components: runner/specs/run.py)
            return value
        return build(tp, value if value is not None else {}, key + ".")
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return convert(inner, value, key, meta)
    if origin is Literal:  # a bool only for a bool: 1 == True, but trainer.compile=1 is no choice it offers
        for choice in args:
            if value == choice and isinstance(value, bool) == isinstance(choice, bool):
                return choice
        raise SpecError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(_choice, args))}")
    if origin is dict:  # dict[str, float]: e.g. lr multipliers by parameter-name pattern
        if not isinstance(value, dict):
            raise SpecError(f"{key}: {value!r} is not a mapping; expected one like {{'backbone.*': 0.1}}")
        return {str(k): convert(args[1], v, f"{key}.{k}", meta) for k, v in value.items()}
    if origin is tuple:
        fixed = args[-1] is not Ellipsis  # tuple[float, float]: exactly that many items
        if not isinstance(value, (list, tuple)):
            example = f"[{', '.join('1' for _ in range(len(args) if fixed else 2))}]"
            raise SpecError(f"{key}: {value!r} is not a list; expected a list like {example}")
        if fixed and len(value) != len(args):
            raise SpecError(f"{key}: {list(value)} is not allowed; give a list of {len(args)} numbers{_range_text(meta)}")
        return tuple(convert(args[0], v, f"{key}[{i}]", meta) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{key}: {value!r} is not a boolean; use true or false")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{key}: {value!r} is not an integer{_range_text(meta)}")
        _check_range(key, value, meta)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # nan != nan
            raise SpecError(f"{key}: {value!r} is not a number{_range_text(meta)}")
        if isinstance(value, int) and abs(value) >= 2**1024:  # does not fit a float
            raise SpecError(f"{key}: {str(value)[:12]}... ({len(str(value))} digits) is too large{_range_text(meta)}")
        number = float(value)
        if math.isinf(number):  # 1e400 reads as inf too; no setting of a run means infinity
            raise SpecError(f"{key}: {value!r} is not a finite number{_range_text(meta)}")
        _check_range(key, number, meta)
        if meta and meta.get("gt") == 0 and number < SMALLEST_POSITIVE:
            raise SpecError(f"{key}: {value!r} is too small to act; allowed: a value >= {SMALLEST_POSITIVE:.6g} "
                            "(float32's smallest normal number: below it the value, or its product with a gradient, "
                            "is denormal or zero in the weights' precision)")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(f"{key}: {value!r} is not a string")
        return value
    raise TypeError(f"spec field {key} has an unsupported type {tp}")


# a positive real (gt=0: a learning rate, an epsilon, a temperature) at least float32's smallest normal number:
# fp32 and bf16 weights (fp16's keep fp32 masters) hold nothing smaller, so 1e-320 would train as 0 does
SMALLEST_POSITIVE = 1.1754943508222875e-38


def _choice(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)  # as typed in YAML: true, false


def _range_text(meta: Any) -> str:
    if not meta:
        return ""
    parts = [f"{op} {_number(meta[k])}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if meta.get(k) is not None]
    return f"; allowed: a value {' and '.join(parts)}" if parts else ""


def _number(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _check_range(key: str, value: float, meta: Any) -> None:
    if not meta:
        return
    bad = ((meta.get("gt") is not None and not value > meta["gt"])
           or (meta.get("ge") is not None and not value >= meta["ge"])
           or (meta.get("lt") is not None and not value < meta["lt"])
           or (meta.get("le") is not None and not value <= meta["le"]))
    if bad:
        raise SpecError(f"{key}: {value!r} is out of range{_range_text(meta)}")


def to_plain(node: Any) -> Any:
    if hasattr(node, "__to_plain__"):  # a component spec: its target's own keys, flat
        return to_plain(node.__to_plain__())
    if isinstance(node, dict):
        return {k: to_plain(v) for k, v in node.items()}
    if dataclasses.is_dataclass(node):
        return {f.name: to_plain(getattr(node, f.name)) for f in fields(node)}
    if isinstance(node, tuple):
        return [to_plain(v) for v in node]
    return node


def did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    """'did you mean X? ' for the closest candidate, or '' when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"did you mean {close[0]}? " if close else ""


def flat_keys(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys -> values (a spec's keys as the command line names them)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_keys(value, f"{prefix}{key}."))
    return out


# mappings whose keys are parameter-name globs: a dot after the mapping's own key is part of the glob
GLOB_KEYED = ("optimizer.lr_multipliers",)


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """tree[a][b][c] = value for "a.b.c", making the mappings on the way (an empty one for a null);
    under a GLOB_KEYED mapping the rest is one key: "optimizer.lr_multipliers.backbone.*"."""
    mapping = next((m for m in GLOB_KEYED if dotted.startswith(m + ".")), None)
    if mapping is not None:
        parents, leaf = mapping.split("."), dotted[len(mapping) + 1:]
    else:
        *parents, leaf = dotted.split(".")
    for part in parents:
        if tree.get(part) is None:
            tree[part] = {}
        tree = tree[part]
    tree[leaf] = value


def component_dict(data: Any, key: str) -> dict:
    """A component's node as a plain dict with a dotted `_target_` (a parsed spec gives its own)."""
    if hasattr(data, "__to_plain__"):
        return data.__to_plain__()
    if not isinstance(data, dict):
        raise SpecError(f"{key}: expected a mapping with a _target_, got {data!r}")
    data = dict(data)
    target = data.get("_target_")
    if not isinstance(target, str) or "." not in target:
        raise SpecError(f"{key}._target_: {target!r} is not a dotted path to a callable; e.g. my_pkg.models.Net")
    return data


class Component:
    """What every spec named by `_target_` shares (its dataclass has `target` and `params` fields): a
    callable's dotted path and its own arguments, which runner/specs/components.py checks against the
    callable's signature once it can be imported."""

    target: str
    params: dict

    def __to_plain__(self) -> dict:  # a spec with fields of its own besides params adds them
        return {"_target_": self.target, **self.params}

    @classmethod
    def parse(cls, data: Any, key: str):
        data = component_dict(data, key)
        return cls(target=data.pop("_target_"), params=data)

    def with_params(self, params: dict):
        return dataclasses.replace(self, params=dict(params))

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

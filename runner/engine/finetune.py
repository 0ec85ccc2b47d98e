"""Fine-tuning: start from saved weights, freeze parameters by name, unfreeze later, per-pattern lr multipliers.

Name patterns are shell-style globs (fnmatch, case-sensitive) matched against whole parameter names as
`model.named_parameters()` gives them; `*` also crosses dots, so `backbone.*` is everything under
`backbone`. Globs rather than regexes: names are dotted paths, and `.` is a literal in a glob but "any
character" in a regex, an easy way to match more than meant.
"""
from __future__ import annotations

import fnmatch
import pickle
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn

from runner.engine import checkpoint
from runner.specs.run import SpecError

if TYPE_CHECKING:
    from runner.specs.run import RunSpec

# Wrappers that rename every key: DDP (module.), torch.compile (_orig_mod.), runner.models.hf (model.)
PREFIXES = ("module.", "_orig_mod.", "model.")
_SHOWN = 6  # names listed in a message before "and N more"
# Of the model's values (parameters and buffers), the share a weights file must fill: a file that fits
# less is another architecture's, and training from it would be training from scratch under its name.
MIN_SHARE = 0.5


@dataclass
class LoadReport:
    """What load_weights did: each list holds model-side parameter/buffer names."""

    path: str
    loaded: list[str] = field(default_factory=list)
    reinitialised: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # name, file, model shape
    missing: list[str] = field(default_factory=list)     # in the model, not in the file: fresh init kept
    unexpected: list[str] = field(default_factory=list)  # in the file (its own names), not in the model
    renamed: str = ""  # how the file's names were mapped, e.g. "stripped 'module.'"

    def describe(self) -> str:
        """One line, or two when names are missing or unexpected, for the run log."""
        line = f"loaded {len(self.loaded)} tensors from {self.path}"
        if self.renamed:
            line += f" ({self.renamed})"
        if self.reinitialised:
            line += "; re-initialised " + _names([f"{n} (shape {list(f)} in the file, {list(m)} here)"
                                                  for n, f, m in self.reinitialised])
        extra = [f"{what}: {_names(names)}" for what, names in (("missing", self.missing),
                                                                  ("unexpected", self.unexpected)) if names]
        return line if not extra else line + "\n" + "; ".join(extra)


def load_weights(model: nn.Module, path: str) -> LoadReport:
    """Copy the tensors of a weights file into `model`, keeping fresh init where names or shapes differ.

    `path`: a .safetensors file, a runner checkpoint (its "model" entry; a run directory: its newest
    good checkpoint), a torch.save file of a state dict (or of a dict holding one under "model" or
    "state_dict"), or a directory holding model.safetensors (save_pretrained's). Nothing is
    unpickled beyond tensors and plain containers. A name also matches one that differs from it only
    by wrapper prefixes (PREFIXES) in front. Call on the bare model, before wrapping for DDP/FSDP.
    """
    state = _read_weights(path)
    target = model.state_dict(keep_vars=True)
    mapping, renamed = _match_names(list(state), list(target))
    if not mapping:
        raise SpecError(f"model.weights: none of the {len(state)} tensors in {path} is named like a parameter of "
                        f"the model (file: {_names(list(state), 3)}; model: {_names(list(target), 3)})")
    report = LoadReport(path=str(path), renamed=renamed)
    chosen: dict[str, torch.Tensor] = {}
    by_model_key = {key: file_key for file_key, key in mapping.items()}
    for key in (k for k in target if k in by_model_key):  # the model's order: safetensors files sort their keys
        tensor, here = state[by_model_key[key]], target[key]
        if tuple(tensor.shape) != tuple(here.shape):
            report.reinitialised.append((key, tuple(tensor.shape), tuple(here.shape)))
        else:
            chosen[key] = tensor
    _check_share(target, chosen, report, path)
    model.load_state_dict(chosen, strict=False)
    report.loaded = list(chosen)
    report.unexpected = [k for k in state if k not in mapping]
    # tied weights (an LM head sharing the embedding) are saved once but listed under both names
    loaded_ids = {id(target[k]) for k in chosen}
    skipped = {k for k, _, _ in report.reinitialised}
    report.missing = [k for k in target if k not in chosen and k not in skipped and id(target[k]) not in loaded_ids]
    return report


def _check_share(target: dict[str, torch.Tensor], chosen: dict[str, torch.Tensor], report: LoadReport,
                 path: str) -> None:
    unique = {id(t): t for t in target.values()}  # tied weights count once
    total = sum(t.numel() for t in unique.values())
    filled = sum(t.numel() for t in {id(target[k]): target[k] for k in chosen}.values())
    if total and filled < MIN_SHARE * total:
        raise SpecError(f"model.weights: {path} fills {filled / total:.0%} of this model's values ({filled} of {total}; "
                        f"{len(chosen)} tensors fit, {len(report.reinitialised)} have another shape, "
                        f"{len(target) - len(chosen) - len(report.reinitialised)} are not in the file); at least "
                        f"{MIN_SHARE:.0%} must load: these look like the weights of another architecture")


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set requires_grad=False on every parameter matching one of `patterns`; return their names.

    Norm layers with running statistics (BatchNorm) among them stay in eval mode, whatever
    model.train() says, so their running mean and variance stay as they are: a frozen layer computes
    what it computed before. Keep frozen parameters in the optimizer (build it before freezing): torch
    optimizers skip a parameter whose .grad is None, so a frozen one is not updated or decayed, and
    unfreezing later needs no new optimizer.
    """
    names = _matching(list(model.named_parameters()), patterns, "freeze")
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
    for norm in frozen_norms(model, patterns):
        _hold_in_eval(norm)
    return names


def frozen_norms(model: nn.Module, patterns: list[str]) -> list[nn.Module]:
    """The layers with running statistics that `patterns` freeze: every parameter of theirs matches (a
    layer without affine parameters: its running_mean buffer's name matches)."""
    out = []
    for prefix, module in model.named_modules():
        if not (getattr(module, "track_running_stats", False) and isinstance(getattr(module, "running_mean", None),
                                                                             torch.Tensor)):
            continue
        own = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters()]
        if not own:
            own = [f"{prefix}.running_mean" if prefix else "running_mean"]
        if all(any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in own):
            out.append(module)
    return out


def _stay_in_eval(self: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(self, False)


def _hold_in_eval(norm: nn.Module) -> None:
    # an instance attribute shadows nn.Module.train, so the model's own train() (and DDP's, FSDP's)
    # leaves this layer in eval mode; deepcopy rebinds the method to the copy
    norm.train = types.MethodType(_stay_in_eval, norm)
    norm.train()


def _release(norm: nn.Module, mode: bool) -> None:
    if "train" in vars(norm):
        del norm.train
    norm.train(mode)


class Unfreezer:
    """Gradual unfreezing: freezes `patterns` now, unfreezes them at the start of epoch `unfreeze_after_epochs`
    (epochs count from 0, so 2 trains two epochs frozen). state_dict() goes into checkpoints so a resumed
    run has the same parameters frozen as the run it continues."""

    def __init__(self, model: nn.Module, patterns: list[str], unfreeze_after_epochs: int):
        if unfreeze_after_epochs < 0:
            raise ValueError(f"unfreeze_after_epochs: {unfreeze_after_epochs} is not allowed; allowed: 0 or more")
        self.model = model
        self.after = unfreeze_after_epochs
        self.names = freeze(model, patterns)
        self.norms = frozen_norms(model, patterns)
        self.unfrozen = False

    def on_epoch_start(self, epoch: int) -> list[str]:
        """The names unfrozen now: all of them at the first epoch >= unfreeze_after_epochs, else none."""
        if self.unfrozen or epoch < self.after:
            return []
        self._set(True)
        return list(self.names)

    def state_dict(self) -> dict[str, Any]:
        return {"unfrozen": self.unfrozen, "names": list(self.names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise ValueError("Unfreezer.load_state_dict: the checkpoint froze other parameters "
                             f"({_names(list(state['names']), 3)}) than this run ({_names(self.names, 3)})")
        self._set(bool(state["unfrozen"]))

    def _set(self, unfrozen: bool) -> None:
        params = dict(self.model.named_parameters())
        for name in self.names:
            params[name].requires_grad_(unfrozen)
        for norm in self.norms:
            if unfrozen:  # the layer follows the model's mode again, from now on
                _release(norm, self.model.training)
            else:
                _hold_in_eval(norm)
        self.unfrozen = unfrozen


def lr_multiplier_groups(named_params: list[tuple[str, nn.Parameter]], multipliers: dict[str, float]
                         ) -> list[tuple[float, list[tuple[str, nn.Parameter]]]]:
    """Parameters split by the first pattern of `multipliers` (in its order) that matches their name.

    Returns (multiplier, parameters) pairs: one per distinct multiplier, in the order the patterns give
    them, unmatched parameters under 1.0 (merged with a pattern's 1.0, else last). Empty pairs are left
    out. Each optimizer group's lr is then the base lr times its multiplier.
    """
    for pattern, value in multipliers.items():
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"lr multiplier for {pattern!r}: {value} is not allowed; allowed: a number >= 0")
    names = [n for n, _ in named_params]
    taken: dict[str, float] = {}
    for pattern, value in multipliers.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"lr multiplier pattern {pattern!r} matches no parameter; names look like {_names(names, 3)}")
        fresh = [n for n in hits if n not in taken]
        if not fresh:
            raise ValueError(f"lr multiplier pattern {pattern!r} matches only parameters an earlier pattern took; "
                             "put the more specific pattern first")
        taken.update((n, float(value)) for n in fresh)
    order = list(dict.fromkeys([*map(float, multipliers.values()), 1.0]))
    buckets: dict[float, list[tuple[str, nn.Parameter]]] = {m: [] for m in order}
    for name, p in named_params:
        buckets[taken.get(name, 1.0)].append((name, p))
    return [(m, ps) for m, ps in buckets.items() if ps]


# --- reading weights ---------------------------------------------------------------------------------

def _read_weights(path: str) -> dict[str, torch.Tensor]:
    p = Path(path).expanduser()
    if checkpoint.is_folder(p):  # a sharded checkpoint
        return _from_checkpoint(p, path)
    if p.is_dir():
        if (p / "model.safetensors").is_file():
            p = p / "model.safetensors"
        else:
            return _from_checkpoint(p, path)  # a run directory: its newest good checkpoint
    if not p.is_file():
        raise SpecError(f"model.weights: {path!r} does not exist; give a .safetensors file, a runner checkpoint "
                        "or a torch state-dict file")
    with open(p, "rb") as f:
        head = f.read(64)
    if checkpoint.is_checkpoint(head):
        return _from_checkpoint(p, path)
    if len(head) > 8 and head[8:9] == b"{":  # safetensors: an 8-byte header length, then the JSON header
        return _from_safetensors(p, path)
    if head[:2] == b"PK" or head[:1] == b"\x80":  # torch.save's zip format, or its legacy pickle format
        return _from_torch_file(p, path)
    raise SpecError(f"model.weights: {path} is not a weights file ({'empty' if not head else 'unknown format'}); "
                    "give a .safetensors file, a runner checkpoint or a torch state-dict file")


def _from_checkpoint(p: Path, path: str) -> dict[str, torch.Tensor]:
    try:  # a run directory: its newest good checkpoint; a sharded one's model read whole here, not its optimizer
        state = checkpoint.load_weights(checkpoint.verify(p) if p.is_dir() and not checkpoint.is_folder(p) else p)
    except SpecError as e:  # InvalidCheckpoint names trainer.resume; here the file came from model.weights
        raise SpecError(f"model.weights: {str(e).split(': ', 1)[-1]}") from None
    return _state_dict(state, path)


def _from_safetensors(p: Path, path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(p), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise SpecError(f"model.weights: {path} is not a readable safetensors file ({_first_line(e)})") from None


def _from_torch_file(p: Path, path: str) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise SpecError(f"model.weights: {path} holds objects other than tensors and plain containers; "
                        "only weights are loaded (save a state dict or safetensors)") from None
    except Exception as e:  # a damaged file fails in many ways inside torch.load; each is the file's fault
        raise SpecError(f"model.weights: {path} is not a weights file: not safetensors, a runner checkpoint "
                        f"or a torch.save file ({_first_line(e)})") from None
    return _state_dict(obj, path)


def _state_dict(obj: Any, path: str) -> dict[str, torch.Tensor]:
    """The tensors of a state dict, or of the "model" / "state_dict" entry of a checkpoint dict."""
    if isinstance(obj, dict) and not _all_tensors(obj.values()):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not _all_tensors(obj.values()):
        kind = type(obj).__name__ if not isinstance(obj, dict) else f"dict with keys {_names(list(map(str, obj)), 3)}"
        raise SpecError(f"model.weights: {path} holds no state dict (a {kind}); give a file of named tensors")
    return {str(k): v for k, v in obj.items()}


def _all_tensors(values: Iterable[Any]) -> bool:
    return all(isinstance(v, torch.Tensor) for v in values)


# --- names -------------------------------------------------------------------------------------------

def _match_names(file_keys: list[str], model_keys: list[str]) -> tuple[dict[str, str], str]:
    """{file key: model key} and how names were changed, e.g. "stripped 'module._orig_mod.'".

    Equal names match; the rest match when they are equal once the wrapper prefixes (PREFIXES, any
    number, in any order) are taken off the front of both, and only one name on each side reads so.
    """
    model_set = set(model_keys)
    mapping = {k: k for k in file_keys if k in model_set}
    taken = set(mapping.values())
    by_bare: dict[str, list[str]] = {}
    for key in model_keys:
        if key not in taken:
            by_bare.setdefault(_bare(key), []).append(key)
    file_bare: dict[str, list[str]] = {}
    for key in file_keys:
        if key not in mapping:
            file_bare.setdefault(_bare(key), []).append(key)
    changes: dict[str, None] = {}
    for bare, keys in file_bare.items():
        targets = by_bare.get(bare, [])
        if len(keys) == 1 and len(targets) == 1:
            mapping[keys[0]] = targets[0]
            changes[_change(keys[0][:len(keys[0]) - len(bare)], targets[0][:len(targets[0]) - len(bare)])] = None
    return mapping, ", ".join(changes)


def _bare(key: str) -> str:
    while prefix := next((p for p in PREFIXES if key.startswith(p)), None):
        key = key[len(prefix):]
    return key


def _change(file_prefix: str, model_prefix: str) -> str:
    if not model_prefix:
        return f"stripped {file_prefix!r}"
    if not file_prefix:
        return f"added {model_prefix!r}"
    return f"read {file_prefix!r} as {model_prefix!r}"


def _matching(named_params: list[tuple[str, nn.Parameter]], patterns: list[str], what: str) -> list[str]:
    names = [n for n, _ in named_params]
    chosen: dict[str, None] = {}
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"{what} pattern {pattern!r} matches no parameter; names look like {_names(names, 3)}")
        chosen.update(dict.fromkeys(hits))
    return [n for n in names if n in chosen]


def _names(names: list[str], shown: int = _SHOWN) -> str:
    if len(names) <= shown:
        return ", ".join(names)
    return ", ".join(names[:shown]) + f" and {len(names) - shown} more"


def _first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


# --- the model as one process builds it: its component, then its starting weights and frozen parameters ---

def whole_model(spec: RunSpec, data: Any, say: Callable[[str], None]) -> nn.Module:
    """The model as one process builds it: from its component, then (fine-tuning) its starting weights and frozen
    parameters. The seed process (parallel/seed.py) and a rank of a run that
    does not shard the model (parallel/parallelize.py) build it so."""
    from runner.engine import fit_checks
    from runner.engine import components

    module = fit_checks.check_model(spec, components.build_model(spec, data))
    if spec.model.weights:
        say(keyed("model.weights", load_weights, module, spec.model.weights).describe())
    freeze_for_run(spec, module, say)
    return fit_checks.check_model(spec, module, loaded=True)


def freeze_for_run(spec: RunSpec, module: nn.Module, say: Callable) -> None:
    """model.freeze for the whole run (no unfreeze_after_epochs): those parameters frozen, and said."""
    if spec.model.freeze and spec.model.unfreeze_after_epochs is None:
        frozen = keyed("model.freeze", freeze, module, list(spec.model.freeze))
        say(f"frozen for the whole run: {len(frozen)} parameter tensors ({', '.join(spec.model.freeze)})")


def keyed(key: str, fn, *args):
    """A fine-tuning helper whose complaint about its input (a pattern matching nothing, a file that is
    not weights) becomes one line naming the key."""
    try:
        return fn(*args)
    except SpecError:
        raise
    except ValueError as e:
        raise SpecError(f"{key}: {str(e).splitlines()[0]}") from None

"""The state of a wrapped model and its optimizer: this rank's shards for checkpoints (sharded_state, load_sharded), full
state dicts where one process needs the whole model, the local values of DTensors, and gradient norms over a mesh."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state as full (unsharded) tensors on the CPU, on every rank (a collective; what the
    memory tests compare against one process: checkpoints hold this rank's shards instead, sharded_state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(module, optimizer, options=options)
    if _nested_placements(module):  # torch gathers these in the wrong row order: gathered again here
        for name, param in module.named_parameters(remove_duplicate=False):
            if _is_nested(param):
                value = gathered(param).cpu()  # every rank joins; only those holding the full dicts keep it
                if name in model_state:
                    model_state[name] = value
                for key, moment in optimizer.state.get(param, {}).items():
                    if _is_nested(moment):
                        value = gathered(moment).cpu()
                        if name in optim_state.get("state", {}):
                            optim_state["state"][name][key] = value
    return model_state, optim_state


def full_model_state(module: nn.Module) -> dict:
    """The model's state as full tensors on the CPU (a collective under fsdp: every rank calls it)."""
    pipeline = getattr(module, "_runner_pipeline", None)
    if pipeline is not None:  # this rank's stages: every stage's part merged (parallel/pipeline.py)
        return pipeline.full_model_state()
    # imported here: torch.distributed.checkpoint costs 0.7 s of start-up before the first training line
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, param in module.named_parameters(remove_duplicate=False):
        if _is_nested(param):  # see full_state
            value = gathered(param).cpu()
            if name in state:
                state[name] = value
    return state


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2 grad norms), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total norm of `grads` over every dimension of the mesh, a plain tensor: DTensor gradients (FSDP2
    shards, tensor-parallel splits, replicated norms) and plain ones (a tensor-parallel model's unsplit layers)
    may mix, which torch's get_total_norm refuses; each placement's group is normed by torch and made full."""
    return _grad_norm(grads, norm_type, _plain(grads))


def _plain(grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is a plain tensor (one process, ddp): no DTensor to group or to make full."""
    return all(type(g) is torch.Tensor for g in grads)


def _grad_norm(grads: list[torch.Tensor], norm_type: float, plain: bool) -> torch.Tensor:
    if plain:  # torch's own, as torch.nn.utils.clip_grad_norm_ computes it: no per-gradient Python work here
        return torch.nn.utils.get_total_norm(grads, norm_type)
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    if len(groups) <= 1:
        return full_tensor(torch.nn.utils.get_total_norm(grads, norm_type))
    norms = [full_tensor(torch.nn.utils.get_total_norm(group, norm_type)) for group in groups.values()]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for gradients that may mix DTensors and plain tensors (see grad_norm): the total
    norm before clipping; every gradient scaled in place, each rank its own part of a DTensor."""
    grads = [p.grad for p in params]
    plain = _plain(grads)
    total = _grad_norm(grads, 2.0, plain)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if grads:
        local = grads if plain else [local_tensor_of(g) for g in grads]
        torch._foreach_mul_(local, scale.to(local[0].device))
    return total


def clip_grad_value(params: list[torch.Tensor], clip_value: float) -> None:
    """torch's clip_grad_value_ for gradients that may mix DTensors and plain tensors: each rank clamps its part."""
    for p in params:
        local_tensor_of(p.grad).clamp_(-clip_value, clip_value)


def _is_nested(t: torch.Tensor) -> bool:
    return hasattr(t, "placements") and len(t.placements) > 1 and _nested_placements_of(t.placements)


def gathered(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), FSDP2 shards over a strided tensor-parallel split included:
    FSDP's shards gathered into the tp rank's part first, then the tp parts (placed_like's inverse)."""
    if not _is_nested(t):
        return full_tensor(t)
    from torch.distributed.tensor import DTensor, Shard

    mesh, placements = t.device_mesh, t.placements
    tp_mesh, dp_mesh = mesh[mesh.mesh_dim_names[-1]], mesh[mesh.mesh_dim_names[-2]]
    if placements[-2].is_replicate():  # FSDP2's replicate (ddp x tp): each rank holds its whole tp part
        tp_local = t.to_local()
    else:
        dim = placements[-2].dim
        tp_shape = list(t.shape)
        tp_shape[dim] //= tp_mesh.size()
        tp_stride = torch.empty(tp_shape, device="meta").stride()
        tp_local = DTensor.from_local(t.to_local(), dp_mesh, [Shard(dim)], run_check=False,
                                      shape=torch.Size(tp_shape), stride=tp_stride).full_tensor()
    return DTensor.from_local(tp_local, tp_mesh, placements[-1:], run_check=False, shape=t.shape,
                              stride=t.stride()).full_tensor()


def _nested_placements(module: nn.Module) -> bool:
    """Whether a parameter is FSDP2-sharded over a tensor-parallel split that is itself strided (the fused qkv
    of runner/engine/parallel/tensor.py): torch's distribute_tensor cannot lay a full tensor out so."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, DTensor) and len(p.placements) > 1 and isinstance(p.placements[-1], _StridedShard)
               for p in module.parameters())


def placed_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as the DTensor `like` (this rank's part, no communication: every rank holds `full`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    full = full.to(like.device)
    mesh, placements = like.device_mesh, like.placements
    if len(placements) == 1 or not _nested_placements_of(placements):
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    # FSDP2 over a strided tensor-parallel split (the mesh's last dimension): the tp rank's part first, then
    # FSDP's chunk of it along its shard dimension (torch.chunk, as fully_shard cuts)
    tp_mesh = mesh[mesh.mesh_dim_names[-1]]
    tp_local = distribute_tensor(full, tp_mesh, placements[-1:], src_data_rank=None).to_local()
    shard = placements[-2]
    if shard.is_replicate():  # FSDP2's replicate (ddp x tp)
        local = tp_local
    else:
        dp_size, dp_index = mesh.size(mesh.ndim - 2), mesh.get_local_rank(mesh.ndim - 2)
        chunks = torch.chunk(tp_local, dp_size, dim=shard.dim)
        local = chunks[dp_index] if dp_index < len(chunks) else tp_local.narrow(shard.dim, 0, 0)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=like.shape, stride=like.stride())


def _nested_placements_of(placements) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placements[-1], _StridedShard)



# --- sharded state: what a checkpoint holds of each rank (torch.distributed.checkpoint) --------------------------
#
# A checkpoint's tensors are one flat dict: model/<name>, optim/<name>/<field>, averages/<kind>/<name>, each a
# plain tensor or a DTensor (this rank's shard, with its place in the whole). Names are the whole model's (a
# pipeline rank's `module` keeps them), so any mesh finds its own in any checkpoint; DCP reads each rank's
# pieces from whichever ranks wrote them. A parameter tied between stages (gpt's lm head = the token embedding)
# is saved under each name a process holds it by: a rank or process whose name for it is missing reads a twin's.

MODEL, OPTIM, AVERAGES = "model/", "optim/", "averages/"


def sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, list[dict]]:
    """This rank's flat state (its own shards, nothing gathered: the tensors are the model's and optimizer's own,
    so a load into them is in place) and its optimizer's parameter groups (settings and parameter names)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    options = StateDictOptions(full_state_dict=False)
    rows = _tied_rows(module) if optimizer is not None else None
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(module, options=options), {}
    elif rows is None:  # torch fills a fresh optimizer's state first (a step at lr 0), so a resume has tensors to load into
        model_state, optim_state = get_state_dict(module, optimizer, options=options)
    else:  # a pipeline's tied parameter whose state this rank holds by its rows (tied_rows.py): keyed by its name
        with rows.whole_in(optimizer):
            model_state, optim_state = get_state_dict(module, optimizer, options=options)
    flat = {MODEL + k: v for k, v in model_state.items()}
    for name, entry in optim_state.get("state", {}).items():
        flat.update({f"{OPTIM}{name}/{field}": rows.as_saved(name, v) if rows else v for field, v in entry.items()})
    return flat, list(optim_state.get("param_groups", []))


def _tied_rows(module: nn.Module) -> Any:
    """The pipeline's row shares of its tied parameters' optimizer state (parallel/tied_rows.py), or None."""
    pipeline = getattr(module, "_runner_pipeline", None)
    return getattr(pipeline, "tied_rows", None)


def saved_names(flat: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A rank's flat state under the names one process saves it by: the optimizer's state and the averages of a
    tied parameter under its first name (a pipeline rank holding only the lm head keys them by its own), so that
    a checkpoint's layout is the same at every mesh. The model's entries keep every name, as its state dict has."""
    canonical = {n: names[0] for names in tied_names(module) for n in names[1:]}
    out = {}
    for key, value in flat.items():
        if _is_strided(value):  # see _is_strided: whole over its tensor-parallel group (a collective of that group)
            value = gathered(value)
        elif _is_partial(value):
            value = _reduced(value)
        if not key.startswith(MODEL):
            prefix, name, field = _split_key(key)
            key = prefix + canonical.get(name, name) + field
        out[key] = value
    return out


def _is_strided(t: Any) -> bool:
    """A DTensor placed _StridedShard (the fused qkv of runner/engine/parallel/tensor.py: each tensor-parallel rank
    holds its rows of q, of k and of v). DCP describes a rank's piece of a tensor by one offset and one size, and
    for these it takes the offset of the first row only, as if the piece were contiguous: torch 2.14's dcp.save
    refuses them ("Failed to validate global plan: key:w has overlapping chunks", measured with tp=2 on gloo).
    Such a tensor is saved whole instead (gathered
    over its group; every rank of the group writes the same value, which DCP keeps once) and loaded whole, each
    rank laying out its part (placed_like). Only these few tensors (one per attention block) are ever whole."""
    if not hasattr(t, "placements"):
        return False
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in t.placements)


def _is_partial(t: Any) -> bool:
    """A DTensor whose value is the sum of the ranks' pieces (Partial): under tp the optimizer's moments of a
    replicated parameter whose gradient the plan left unreduced (a norm's weight under sequence parallelism).
    DCP refuses them ("not supported for DTensor with partial placements")."""
    return hasattr(t, "placements") and any(p.is_partial() for p in t.placements)


def _reduced(t: Any) -> Any:
    """A Partial DTensor made Replicate: its value summed over the group (a collective of its mesh), which is
    the value the tensor stands for, so the checkpoint holds what one process would; a load gives it back
    replicated, which the optimizer's next step reads as the same value."""
    from torch.distributed.tensor import Replicate

    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])


def tied_names(module: nn.Module) -> list[list[str]]:
    """The names of each parameter the whole model holds under several names (a pipeline rank's: the whole
    model's, which it knows from before the cut)."""
    pipeline = getattr(module, "_runner_pipeline", None)
    if pipeline is not None:
        return pipeline.tied
    shared: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    return [names for names in shared.values() if len(names) > 1]


def merged_groups(parts: list[list[dict]], tied: list[list[str]]) -> list[dict]:
    """Every rank's parameter groups as the whole model's (a pipeline's ranks each hold some parameters of each
    group): group i holds every rank's parameters of its group i, a tied parameter under its first name."""
    canonical = {n: names[0] for names in tied for n in names}
    groups: list[dict] = []
    for part in parts:
        for i, group in enumerate(part):
            if i == len(groups):
                groups.append({**group, "params": []})
            groups[i]["params"] += [canonical.get(n, n) for n in group["params"] if canonical.get(n, n) not in groups[i]["params"]]
    return groups


def load_sharded(module: nn.Module, optimizer: torch.optim.Optimizer | None, source: Any,
                 groups: list[dict] | None = None, extra: dict[str, torch.Tensor] | None = None,
                 optional: tuple[str, ...] = ()) -> set[str]:
    """This rank's model (and optimizer) state from `source`, at whatever mesh it was written: a sharded
    checkpoint folder (DCP reads this rank's pieces; a collective), or a flat dict of whole tensors (a
    one-file checkpoint: each rank lays them out as its own). `extra`: more of this rank's tensors to fill
    in place (the averages). Keys under an `optional` prefix the checkpoint lacks are left alone; returns
    those prefixes that it lacked. Raises KeyError naming a missing key, ValueError for a mismatch."""
    if not isinstance(source, dict):  # a rank on a node without rank 0's disk reads a copy of the folder
        from pathlib import Path

        from runner.engine.checkpoint import MANIFEST
        from runner.engine.unshared_disks import readable_here

        with readable_here(Path(source), MANIFEST) as here:
            return _load_sharded(module, optimizer, here, groups, extra, optional)
    return _load_sharded(module, optimizer, source, groups, extra, optional)


def _load_sharded(module: nn.Module, optimizer: torch.optim.Optimizer | None, source: Any,
                  groups: list[dict] | None, extra: dict[str, torch.Tensor] | None, optional: tuple[str, ...]) -> set[str]:
    state, _ = sharded_state(module, optimizer)
    state.update(extra or {})
    if isinstance(source, dict):
        saved = source.keys()
    else:
        from runner.engine.checkpoint import tensor_keys

        saved = tensor_keys(source).keys()
    twins = {n: names for names in tied_names(module) for n in names}
    source_of: dict[str, str] = {}  # this rank's key -> the checkpoint's key it is read from
    lacking: set[str] = set()
    for key in state:
        source_key = key if key in saved else _twin_key(key, saved, twins)
        if source_key is not None:
            source_of[key] = source_key
            continue
        prefix = next((p for p in optional if key.startswith(p)), None)
        if prefix is None:
            raise KeyError(f"the checkpoint has no {key.partition('/')[2]}")
        lacking.add(prefix)
    wanted: dict[str, Any] = {}  # the checkpoint's key -> the tensor of this rank it fills (the first asking)
    for key, source_key in source_of.items():
        value = state[key]
        if _is_strided(value) and not isinstance(source, dict):  # read whole (see _is_strided), laid out below
            value = torch.empty(value.shape, dtype=value.dtype)
        wanted.setdefault(source_key, value)
    if isinstance(source, dict):
        for source_key, like in wanted.items():
            wanted[source_key] = _placed_into(source[source_key], like)
    else:
        from torch.distributed import checkpoint as dcp

        import torch.distributed as dist

        # tensors in place; other values replaced in `wanted`
        dcp.load(wanted, checkpoint_id=str(source), no_dist=not dist.is_initialized())
    params = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, source_key in source_of.items():
            value, loaded = state[key], wanted[source_key]
            if isinstance(value, torch.Tensor):
                if _is_strided(value) and not _is_strided(loaded):  # read whole: this rank's part of it
                    local_tensor_of(value).copy_(local_tensor_of(placed_like(loaded, value)))
                elif loaded is not value:  # a second name of a tied parameter held apart here
                    local_tensor_of(value).copy_(local_tensor_of(loaded))
            elif key.startswith(OPTIM) and optimizer is not None:  # a count kept as a number
                name, _, field = key[len(OPTIM):].rpartition("/")
                optimizer.state[params[name]][field] = loaded
    if optimizer is not None and groups is not None:
        load_param_groups(module, optimizer, groups)
    return lacking


def _twin_key(key: str, saved: Any, twins: dict[str, list[str]]) -> str | None:
    """The checkpoint's key for `key` under another name of the same tied parameter."""
    prefix, name, field = _split_key(key)
    for other in twins.get(name, ()):
        candidate = prefix + other + field
        if candidate in saved:
            return candidate
    return None


def _split_key(key: str) -> tuple[str, str, str]:
    """model/<name> -> (model/, name, ""); optim/<name>/<field> -> (optim/, name, /field);
    averages/<kind>/<name> -> (averages/<kind>/, name, "")."""
    if key.startswith(OPTIM):
        name, _, field = key[len(OPTIM):].rpartition("/")
        return OPTIM, name, "/" + field
    if key.startswith(AVERAGES):
        kind, _, name = key[len(AVERAGES):].partition("/")
        return f"{AVERAGES}{kind}/", name, ""
    return MODEL, key[len(MODEL):], ""


@torch.no_grad()
def _placed_into(full: Any, like: Any) -> Any:
    """A whole tensor copied into this rank's own tensor `like` (its part of a DTensor); other values as they are."""
    if not isinstance(like, torch.Tensor) or not isinstance(full, torch.Tensor):
        return full
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} where this run's is {tuple(like.shape)}")
    local_tensor_of(like).copy_(local_tensor_of(placed_like(full, like)) if hasattr(like, "device_mesh") else full)
    return like


def load_param_groups(module: nn.Module, optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """The saved groups' settings (lr, weight decay, ...) into this optimizer's groups: each of its groups takes
    those of the saved group holding its parameters (by name: a pipeline rank holds some of each group)."""
    canonical = {n: names[0] for names in tied_names(module) for n in names}
    group_of = {canonical.get(n, n): i for i, group in enumerate(groups) for n in group["params"]}
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(canonical.get(name, name))
    for i, group in enumerate(optimizer.param_groups):
        found = next((group_of[n] for p in group["params"] for n in names.get(id(p), ()) if n in group_of), None)
        if found is None:
            if len(groups) != len(optimizer.param_groups):
                raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this run's "
                                 f"{len(optimizer.param_groups)}")
            found = i
        group.update({k: v for k, v in groups[found].items() if k != "params"})


def flat_full_state(state: dict) -> dict[str, Any]:
    """A one-file checkpoint's whole tensors under the flat keys of a sharded one (model, optimizer, averages)."""
    flat = {MODEL + k: v for k, v in state.get("model", {}).items()}
    for name, entry in (state.get("optimizer") or {}).get("state", {}).items():
        flat.update({f"{OPTIM}{name}/{field}": v for field, v in entry.items()})
    for kind, entry in ((state.get("addons") or {}).get("averages") or state.get("averages") or {}).items():
        if entry:
            flat.update({f"{AVERAGES}{kind}/{name}": v for name, v in entry.get("values", {}).items()})
    return flat

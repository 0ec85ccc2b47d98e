"""Tensor (and sequence) parallelism: each layer's weights split across the processes of mesh["tp"].

The plan comes from, in this order: the user's `parallelism.tp_plan` ({_target_: pkg.fn} -> fn(model,
tp_mesh, **params)), the model's own `parallelize_tensor(tp_mesh, sequence_parallel=..., loss_parallel=...)`
(gpt, vit), or a HuggingFace model's declared plan (`_tp_plan` / `config.base_model_tp_plan`, styles such as
"colwise" and "rowwise", translated to torch.distributed.tensor.parallel's). A model with none is refused in
one line. The plan runs before activation checkpointing and the data-parallel wrap (wrap.py), which then
shard the tensor-parallel DTensors on the data-parallel sub-mesh (FSDP x TP = a 2-D mesh).

The ranks of one tensor-parallel group read the same samples: sums of what they read run over the
data-parallel group only (collectives.py). With loss_parallel the vocabulary projection's logits stay
sharded (a DTensor) into the task's cross-entropy, which then runs under torch's loss_parallel() in the
forward and the backward (`loss_context`); evaluation gathers them whole (runner/tasks/batches.py).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from runner.specs.parallelism import ParallelismSpec
from runner.specs.run import SpecError

# attributes by which a model (or its config) declares its attention heads: tp must divide each
HEAD_ATTRIBUTES = ("n_head", "heads", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads")

_NO_CONTEXT = contextlib.nullcontext()


def plan_source(module: nn.Module, spec: ParallelismSpec, tp: int) -> str:
    """Where the tensor-parallel plan comes from: "user", "model", "huggingface"; a SpecError when nowhere."""
    if spec.tp_plan is not None:
        return "user"
    if callable(getattr(module, "parallelize_tensor", None)):
        return "model"
    if huggingface_plan(module):
        return "huggingface"
    raise SpecError(f"parallelism.tp: {tp} needs a tensor-parallel plan, but the model ({type(module).__name__}) has none; "
                    "give parallelism.tp_plan={_target_: my_pkg.plan} (fn(model, tp_mesh)), or add a method "
                    "parallelize_tensor(self, tp_mesh, *, sequence_parallel, loss_parallel) to the model")


def check(module: nn.Module, spec: ParallelismSpec, tp: int) -> None:
    """Before anything starts (the launcher, on a meta model; the engine): a plan exists and tp divides
    every head count the model declares."""
    if tp <= 1:
        return
    plan_source(module, spec, tp)
    for where, heads in declared_heads(module):
        if heads < tp or heads % tp:
            raise SpecError(f"parallelism.tp: {tp} does not divide the {heads} attention heads of {where}; allowed: a "
                            f"divisor of {heads} ({', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)})")


def check_user_plan(module: nn.Module, spec: ParallelismSpec, tp: int, model_name: str) -> None:
    """Before anything starts, on the model built on the meta device (which it changes): the user's plan
    (parallelism.tp_plan) applied on a process group that only pretends (torch's fake backend: this one process
    stands for the tp ranks, and no collective runs), its part names checked (_names_checked) and a plan that
    raises refused in one line. Not where a process group exists already (the engine's own build: the plan runs
    there on the real mesh, its names checked by `apply`)."""
    import torch.distributed as dist

    if tp <= 1 or spec.tp_plan is None or dist.is_initialized():
        return
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 -- registers the "fake" backend
    from torch._C._distributed_c10d import FakeStore
    from torch.distributed.device_mesh import DeviceMesh

    from runner.specs.components import load_target

    plan = load_target("parallelism.tp_plan", spec.tp_plan.target)
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        with _names_checked(module, spec, model_name):
            try:
                plan(module, DeviceMesh("cpu", list(range(tp))), **spec.tp_plan.params)
            except Exception as e:  # the user's plan failing its own way: what it said, on one line
                raise SpecError(f"parallelism.tp_plan: {spec.tp_plan.target} failed on {model_name} ({type(e).__name__}: "
                                f"{(str(e).splitlines() or [''])[0][:160]}); allowed: a plan that names the model's own "
                                f"parts (its children: {_children(module)})") from None
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _names_checked(module: nn.Module, spec: ParallelismSpec, model_name: str) -> Iterator[None]:
    """Around the user's plan applied: torch's parallelize_module skips a plan key that names no submodule with a
    warning, and the run then fails later or trains that layer unsplit; such a key is refused in one line. The
    plan's other warnings are shown as they would have been."""
    parts = _children(module)  # before the plan: it may replace them
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    unresolved = [str(w.message).split(" in module")[0] for w in seen if "could not be resolved" in str(w.message)]
    if unresolved:
        raise SpecError(f"parallelism.tp_plan: {spec.tp_plan.target} names a part {model_name} does not hold "
                        f"({unresolved[0]}); allowed: the model's own parts (its children: {parts})")
    for w in seen:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _children(module: nn.Module) -> str:
    return ", ".join(name for name, _ in module.named_children())


def declared_heads(module: nn.Module) -> list[tuple[str, int]]:
    """(where, count) of every attention-head count the model, its submodules or their HF configs declare."""
    found: dict[str, int] = {}
    for name, sub in module.named_modules():
        for owner, prefix in ((sub, name), (getattr(sub, "config", None), f"{name}.config".lstrip("."))):
            for attr in HEAD_ATTRIBUTES:
                value = getattr(owner, attr, None) if owner is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.setdefault(f"{prefix or type(module).__name__}.{attr}".lstrip("."), value)
    return sorted(found.items())


def apply(module: nn.Module, spec: ParallelismSpec, env: Any, model_name: str = "the model") -> None:
    """Splits `module` in place across env.mesh["tp"]; nothing when tp is 1 (env: a placed DistEnv). A user's plan
    naming a part the model does not hold is refused as check_user_plan refuses it (under the user's own torchrun
    nothing checked it before)."""
    if env.dims.tp <= 1 or env.mesh is None:
        return
    check(module, spec, env.dims.tp)
    tp_mesh = env.mesh["tp"]
    source = plan_source(module, spec, env.dims.tp)
    if source == "user":
        from runner.specs.components import load_target

        with _names_checked(module, spec, model_name):
            load_target("parallelism.tp_plan", spec.tp_plan.target)(module, tp_mesh, **spec.tp_plan.params)
    elif source == "model":
        module.parallelize_tensor(tp_mesh, sequence_parallel=spec.sequence_parallel, loss_parallel=spec.loss_parallel)
    else:
        apply_huggingface_plan(module, tp_mesh)


def shards_loss(spec: ParallelismSpec, env: Any) -> bool:
    """Whether the loss is computed on vocabulary-sharded logits (tp > 1 with loss_parallel): only then has
    `loss_context` anything to do (the step loop decides this once per run)."""
    return env.dims.tp > 1 and spec.loss_parallel


def loss_context(spec: ParallelismSpec, env: Any) -> ContextManager:
    """torch's loss_parallel() while tp > 1 with loss_parallel: cross-entropy on vocabulary-sharded logits
    (and its backward, which must run inside it too); a no-op context otherwise."""
    if shards_loss(spec, env):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return _NO_CONTEXT


def fit_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """A parameter group mixing DTensors (split by a plan) with plain tensors (layers a plan leaves whole)
    steps with the per-tensor loop: torch's foreach and fused kernels refuse such a list."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if len(kinds) > 1:
            for kernel in ("foreach", "fused"):
                if group.get(kernel):
                    group[kernel] = False


# --- what torch.distributed.tensor.parallel lacks -------------------------------------------------------


def fused_colwise(parts: int = 3) -> Any:
    """ColwiseParallel for a projection fusing `parts` outputs along its out features (attention's qkv,
    [q | k | v]): each rank keeps its columns of every part ([q_r | k_r | v_r], its own heads' q, k and v),
    where a plain Shard(0) would give rank 0 all of q. The weight is a DTensor placed _StridedShard(0,
    split_factor=parts), so its full value (checkpoints, clipping) is the unsplit weight in its usual layout;
    the module's output is the rank's local [q_r | k_r | v_r]."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedColwiseParallel(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            for param_name, param in list(module.named_parameters(recurse=False)):
                placed = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=parts)],
                                           src_data_rank=self.src_data_rank)
                module.register_parameter(param_name, nn.Parameter(placed, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        def _apply(self, module, device_mesh):
            return distribute_module(module, device_mesh, self._partition_linear_fn,
                                     lambda mod, inputs, mesh: self._prepare_input_fn(
                                         self.input_layouts, self.desired_input_layouts, mod, inputs, mesh),
                                     lambda mod, outputs, mesh: self._prepare_output_fn(
                                         self.output_layouts, self.use_local_output, mod, outputs, mesh))

    return FusedColwiseParallel(input_layouts=Replicate())


# a HuggingFace plan's style -> torch's ParallelStyle (transformers.integrations.tensor_parallel names them)
def _huggingface_styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        "local_colwise": ColwiseParallel(use_local_output=True),
        "local_rowwise": RowwiseParallel(use_local_output=True),
        "sequence_parallel": SequenceParallel(),
        "rowwise_split_input": RowwiseParallel(input_layouts=Shard(-1)),
    }


def huggingface_plan(module: nn.Module) -> dict[str, str]:
    """The declared TP plan of a HuggingFace model inside `module` (the model itself or runner's wrapper
    of it), its keys as paths from `module`; {} when there is none."""
    for name, sub in module.named_modules():
        declared = dict(getattr(sub, "_tp_plan", None) or {})
        config = getattr(sub, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(sub, "base_model_prefix", "")
        if base and prefix and hasattr(sub, prefix):
            base = {f"{prefix}.{k}": v for k, v in base.items()}
        plan = {**base, **declared}
        if plan:
            return {f"{name}.{k}" if name else k: v for k, v in plan.items()}
    return {}


def apply_huggingface_plan(module: nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    plan, styles = huggingface_plan(module), _huggingface_styles()
    unknown = sorted({style for style in plan.values() if style not in styles})
    if unknown:
        raise SpecError(f"parallelism.tp: the HuggingFace plan of {type(module).__name__} uses the style(s) "
                        f"{', '.join(unknown)}, which runner does not translate (known: {', '.join(styles)}); give "
                        "parallelism.tp_plan={_target_: my_pkg.plan}")
    tied = _tied_to_embeddings(module, plan)
    if tied:
        raise SpecError(f"parallelism.tp: {tied} is tied to the input embeddings, which the HuggingFace plan does not "
                        "split alike; set the model's tie_word_embeddings=false or give parallelism.tp_plan")
    parallelize_module(module, tp_mesh, {path: styles[style] for path, style in plan.items()})


def _tied_to_embeddings(module: nn.Module, plan: dict[str, str]) -> str:
    """A planned layer whose weight is the same tensor as an unplanned one (a tied lm_head): splitting one
    would untie them."""
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules():
        weight = getattr(sub, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(name)
    import fnmatch

    for names in owners.values():
        planned = [n for n in names if any(fnmatch.fnmatch(n, k) for k in plan)]
        if planned and len(planned) < len(names):
            return planned[0]
    return ""

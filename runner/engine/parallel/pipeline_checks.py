"""Whether a model's pipeline stages, run one after another, compute the model's own forward.

A stage is the whole model with the parts outside it replaced (nn.Identity, or None where its forward skips
them), so each stage runs the model's forward from the top. That composes to the model only where the forward
passes each block's output on and nothing else: a residual added outside the block (`x = x + block(x)` in the
model's forward) becomes `x + x` in every stage that does not hold the block, silently.

The check traces the model's forward and the stages' chain, each once, with torch's make_fx on the meta device
(every op recorded, the Python around it run for real: a forward's checks on shapes and its `if part is None`
branches take their real paths), and compares the two graphs' dataflow, parameters named by the model's names.
torch.fx's symbolic tracing would keep blocks as leaves, but it cannot run a forward that checks a shape
(gpt's, vit's). A forward the meta device cannot run (one that reads a tensor's values) is said, not refused.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from runner.specs.fields import SpecError

# ops that only rename a tensor: the same dataflow with or without them (gpt's tied head views the
# embedding's weight where the stage holds both, and not in a last stage without the embedding)
_ALIASES = ("aten.view.default", "aten.alias.default", "aten.detach.default", "aten._unsafe_view.default")


def check_stages_compose(model: nn.Module, stages: list[nn.Module], inputs: Any, model_name: str) -> str | None:
    """Refuse (SpecError, one line naming the model and the block) stages whose chain computes something other
    than the model's forward; the line to say instead (None when checked) where the forward cannot be traced.
    inputs: a batch's model inputs (a tensor, or a dict given as keyword arguments, as the first stage gets them)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from runner.tasks.batches import on_meta

    meta = on_meta(inputs)
    keys = list(meta) if isinstance(meta, dict) else None
    flat = list(meta.values()) if keys is not None else [meta]

    def first(module: nn.Module, args: tuple) -> Any:
        return module(**dict(zip(keys, args))) if keys is not None else module(*args)

    def whole(*args: Any) -> Any:
        return first(model, args)

    def chained(*args: Any) -> Any:
        out = first(stages[0], args)
        for stage in stages[1:]:
            out = stage(*out) if isinstance(out, tuple) else stage(out)
        return out

    try:
        with torch.no_grad():
            traced = [make_fx(fn)(*flat) for fn in (whole, chained)]
    except Exception as e:  # a forward the meta device cannot run, or make_fx cannot follow
        first_line = (str(e).splitlines() or [""])[0][:160]
        return (f"parallelism.pp: {model_name}'s forward cannot be traced on the meta device ({type(e).__name__}: "
                f"{first_line}), so whether its {len(stages)} stages compute it is not checked: a residual added "
                "outside a block would be counted twice")
    names: dict[int, str] = {}
    for module in (model, *stages):
        for name, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                       module.named_buffers(remove_duplicate=False)):
            names.setdefault(id(t), name)
    if _dataflow(traced[0], names) != _dataflow(traced[1], names):
        block = _last_block(model, stages)
        where = f"its block '{block}'" if block else "a block"
        raise SpecError(f"parallelism.pp: {model_name} cut into {len(stages)} stages does not compute its own forward: "
                        f"the forward passes on more than the output of {where} (a residual added outside the block, "
                        "or a block's input used after it), and a block outside a stage is nn.Identity there; allowed: "
                        "a forward that passes only each block's output on (add the residual inside the block), or "
                        "parallelism.pp=1")
    return None


def _dataflow(graph_module: torch.fx.GraphModule, names: dict[int, str]) -> int:
    """A hash of what the graph's output is computed from: each node by its op and its inputs' hashes, inputs by
    position, tensors it holds by the model's name for them (or their shape where they are not the model's)."""
    done: dict[torch.fx.Node, int] = {}
    positions = itertools.count()

    def of(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return done[arg]
        if isinstance(arg, (list, tuple)):
            return tuple(of(a) for a in arg)
        if isinstance(arg, dict):
            return tuple(sorted((k, of(v)) for k, v in arg.items()))
        return repr(arg)

    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            done[node] = hash(("input", next(positions)))
        elif node.op == "get_attr":
            t = getattr(graph_module, node.target)
            done[node] = hash(("tensor", names.get(id(t)) or (tuple(t.shape), str(t.dtype))))
        elif node.op == "call_function" and str(node.target) in _ALIASES and _same_shape(node):
            done[node] = done[node.args[0]]
        else:
            done[node] = hash((node.op, str(node.target), of(node.args), of(node.kwargs)))
        if node.op == "output":
            return done[node]
    raise AssertionError("a traced graph has an output")


def _same_shape(node: torch.fx.Node) -> bool:
    source = node.args[0]
    shapes = [getattr(n.meta.get("val"), "shape", None) if isinstance(n, torch.fx.Node) else None for n in (node, source)]
    return shapes[0] is not None and shapes[0] == shapes[1]


def _last_block(model: nn.Module, stages: list[nn.Module]) -> str | None:
    """The last part of the model the first stage holds among those some stage leaves out: the block across
    whose cut the forward passes more than its output."""
    def holds(stage: nn.Module, name: str, module: nn.Module) -> bool:
        try:
            part = stage.get_submodule(name)
        except AttributeError:  # None, or not there
            return False
        return part is module or type(part) is type(module)

    cut: list[str] = []
    for name, module in model.named_modules():
        if not name or isinstance(module, nn.Identity) or any(name.startswith(c + ".") for c in cut):
            continue
        if not all(holds(stage, name, module) for stage in stages):
            cut.append(name)
    held = [name for name in cut if holds(stages[0], name, model.get_submodule(name))]
    return held[-1] if held else None

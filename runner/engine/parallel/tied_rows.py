"""A parameter the pipeline's stages share (gpt's token embedding = its lm head), its optimizer state split by rows
between the stages holding it: each pp rank's optimizer keeps and updates only its 1 / pp of the rows, and the
updated rows are then gathered so that every copy holds the whole updated weight again.

Why: every stage holding the tied weight held its optimizer state whole. For GPT-2 under pp=2 that is two AdamW
moments of 50304 x 768 (147 MiB each) on each of the two ranks, and the foreach step's temporary of the same size,
where each rank peaks (measured: the optimizer step). Split, each rank holds half of each.

Exactness: only optimizers whose update of an element reads that element's parameter, gradient and state alone, with
the parameter's step count and its group's settings (SGD, Adam, AdamW: weight decay included), are split; a row's
update is then one process's, bit for bit, as FSDP's row shards are. Clipping and the gradient norm read the whole
summed gradient before the step, as before (the share's gradient is a view of its rows, set as the step starts).

Applies where every rank of the pp group holds the parameter as a plain tensor (a tensor-parallel or FSDP DTensor's
state is split already) and its rows divide by pp; elsewhere nothing changes.

Checkpoints: a share's state is saved as its rows of the whole tensor (a DTensor placed Shard(0) on the pp mesh)
under the parameter's name (parallel/state.py), so a checkpoint's layout is one process's, and a run at any mesh
reads its own rows or the whole.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from runner.engine.parallel.ring import ring_all_gather

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@dataclass
class Share:
    whole: nn.Parameter  # the model's parameter
    share: nn.Parameter  # a parameter viewing this rank's rows of it, which the optimizer holds in its place
    rows: slice
    names: list[str]     # the whole's names on this rank


class TiedRows:
    """The optimizer's row shares of the shared parameters on this rank."""

    def __init__(self, shares: list[Share], mesh: Any, group: dist.ProcessGroup):
        self.shares, self.mesh, self.group = shares, mesh, group
        self.pairs = [(s.whole, s.share) for s in shares]
        self._by_name = {name: s for s in shares for name in s.names}

    # --- the optimizer step -----------------------------------------------------------------------------

    def point_gradients(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the step: each share's gradient is its rows of the whole (summed, clipped) gradient, a view. A whole
        parameter without a gradient leaves its share's as it is (torch's state initialisation gives zeros)."""
        for s in self.shares:
            if s.whole.grad is not None:
                s.share.grad = s.whole.grad[s.rows]

    @torch.no_grad()
    def gather_rows(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After the step: every rank's updated rows into every copy; the whole gradient dropped (zero_grad reaches
        only the optimizer's parameters, the shares)."""
        for whole, share in self.pairs:
            if whole.device.type == "cpu":  # gloo's all_gather copies through whole-size temporaries (ring.py)
                ring_all_gather(whole.view(-1), share.detach().view(-1), self.group)
            else:
                dist.all_gather_into_tensor(whole.view(-1), share.detach().reshape(-1), group=self.group)
            whole.grad = None

    # --- checkpoints (parallel/state.py) ----------------------------------------------------------------

    @contextlib.contextmanager
    def whole_in(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """The whole parameters in the optimizer in place of their shares (their state moved along) while torch's
        state dict maps the optimizer's parameters to the model's names; the shares back after."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)  # a fresh optimizer's state made now, on the shares (torch would step the wholes)
        swap = {id(share): whole for whole, share in self.pairs}
        back = {id(whole): share for whole, share in self.pairs}
        self._swap(optimizer, swap)
        try:
            yield
        finally:
            self._swap(optimizer, back)

    @staticmethod
    def _swap(optimizer: torch.optim.Optimizer, to: dict[int, nn.Parameter]) -> None:
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in to:
                    group["params"][i] = to[id(p)]
                    if p in optimizer.state:
                        optimizer.state[to[id(p)]] = optimizer.state.pop(p)

    def as_saved(self, name: str, value: Any) -> Any:
        """A share's state tensor as its rows of the whole (a DTensor on the pp mesh), for `name` one of the shared
        parameter's names; any other value as it is."""
        s = self._by_name.get(name)
        if s is None or not isinstance(value, torch.Tensor) or value.shape != s.share.shape:
            return value  # not a share's, or a scalar (the step count): the same on every rank
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(value, self.mesh, [Shard(0)], run_check=False, shape=s.whole.shape,
                                  stride=s.whole.stride())


def split(optimizer: torch.optim.Optimizer, shared: list[tuple[nn.Parameter, list[str]]], mesh: Any) -> TiedRows | None:
    """The optimizer holding each of `shared` (a parameter every rank of the pp mesh holds, and its names on this
    rank) by this rank's rows where the optimizer and the parameter allow (module docstring); None where none is."""
    if type(optimizer) not in ELEMENTWISE:
        return None
    group, pp = mesh.get_group(), mesh.size()
    rank = dist.get_rank(group)
    shares = []
    for whole, names in shared:
        if type(whole) is not nn.Parameter or not whole.is_contiguous() or whole.dim() == 0 \
                or whole.shape[0] % pp or not whole.requires_grad:
            continue
        size = whole.shape[0] // pp
        rows = slice(rank * size, (rank + 1) * size)
        share = nn.Parameter(whole.detach()[rows])  # a view: the optimizer's step writes the whole's rows
        if _replace(optimizer, whole, share):
            shares.append(Share(whole, share, rows, names))
    if not shares:
        return None
    rows = TiedRows(shares, mesh, group)
    optimizer.register_step_pre_hook(rows.point_gradients)
    optimizer.register_step_post_hook(rows.gather_rows)
    return rows


def _replace(optimizer: torch.optim.Optimizer, whole: nn.Parameter, share: nn.Parameter) -> bool:
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p is whole:
                if optimizer.state.get(whole):  # state already made whole: left so
                    return False
                group["params"][i] = share
                return True
    return False

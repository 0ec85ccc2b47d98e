"""FSDP2's all-gather and reduce-scatter on CPU tensors (gloo) as rings of sends and receives straight into the
buffers FSDP2 allocates, set on every fully_shard-ed module (FSDPModule.set_custom_all_gather / _reduce_scatter).

Why not gloo's own collectives: they go through temporaries as large as the whole buffer. Measured on 2 ranks
(torch 2.14, 160 MB fp32): all_gather_into_tensor raised each rank's resident memory by 160 MB beyond its output,
reduce_scatter_tensor by 242 MB beyond its input and output. Under fsdp the largest buffers are the root group's
(GPT-2's tied 50257 x 768 embedding, 147 MiB whole), gathered at the first forward and reduced at the end of the
backward pass, where each rank's memory peaks. The rings move the same bytes (n - 1 steps of one shard each) and
allocate nothing: a received shard lands in its place in the all-gather's output; a reduce-scatter receives into
its output and adds into its input, whose reduced shard is then copied out.

Sums run in a fixed order (the ring's), so a run is reproducible bit for bit, resumed or not. An operation other
than SUM or AVG (PREMUL_SUM under a gradient divide factor) and CUDA tensors use torch's collective.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn


def _shards(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(flat.view(n, -1).unbind(0))


def _exchange(send: torch.Tensor, receive: torch.Tensor, group: dist.ProcessGroup) -> None:
    """One step of the ring: `send` to the next rank of `group`, `receive` from the previous, both at once."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % n),
           dist.P2POp(dist.irecv, receive, group=group, group_peer=(rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every rank's `input` (one shard) into its place in `output` (n shards, flat), in place."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    shards = _shards(output, n)
    shards[rank].copy_(input.view(-1))
    for step in range(n - 1):  # pass on the shard received last step
        _exchange(shards[(rank - step) % n], shards[(rank - step - 1) % n], group)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                        average: bool) -> None:
    """This rank's shard of the sum (or mean) of every rank's `input` (n shards, flat) into `output`. `input` is
    overwritten (partial sums), as FSDP2's reduce-scatter input is a buffer of its own that nothing reads after."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    shards, received = _shards(input, n), output.view(-1)
    for step in range(1, n):  # shard r - step has step ranks' parts summed: on to the next rank, which adds its own
        _exchange(shards[(rank - step) % n], received, group)
        shards[(rank - step - 1) % n].add_(received)
    received.copy_(shards[rank])
    if average:
        received.div_(n)


def _ring_applies(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous() and dist.get_world_size(group) > 1


def _allocate(size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class RingAllGather:
    """FSDP2's AllGather comm (torch.distributed.fsdp's protocol: allocate, then call) on a ring. `into`: the one
    parameter (FSDP2's FSDPParam) of a unit that holds no other, gathered straight into its own unsharded memory.

    FSDP2 gathers a unit into a buffer of its own, then copies each parameter out of it into the parameter's memory:
    for a moment both hold the whole unit (GPT-2's root, the tied 50257 x 768 weight alone: 2 x 147 MiB). A unit of
    one parameter sharded by rows has the buffer's layout in the parameter's own memory (its rows padded to a
    multiple of the ranks), so that memory is the buffer, and FSDP2's copy-out copies each element onto itself.
    Before FSDP2 has made that memory (the first gather), and where its layout is not the buffer's, a buffer of its
    own as before."""

    def __init__(self, into: object | None = None):
        self.into = into
        # the parameter's memory handed out, its version as it was then
        self._own: tuple[torch.Tensor, torch.autograd._unsafe_preserve_version_counter] | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        outputs = getattr(self.into, "all_gather_outputs", None) if self.into is not None else None
        if outputs and len(outputs) == 1 and len(size) == 1:
            own = outputs[0]
            if own.shape == torch.Size(size) and own.dtype == dtype and own.device == device:
                self.into.alloc_all_gather_outputs()  # FSDP2 frees the memory when it reshards; back to its size
                self._own = (own, torch.autograd._unsafe_preserve_version_counter(own))
                return own
        return _allocate(size, dtype=dtype, device=device)

    def _keep_version(self, output: torch.Tensor) -> None:
        """The parameter's memory gathered again holds the same values its saved uses read (FSDP2 gathers anew only
        what no step has changed since): its version is set back, as FSDP2's own copy-out into it does, or autograd
        would take it for modified in place."""
        own, self._own = self._own, None
        if own is not None and own[0] is output:
            own[1].__exit__(None, None, None)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        if not (_ring_applies(output_tensor, group) and input_tensor.is_contiguous()):
            if self._own is None:
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)  # done before its version is set
            self._keep_version(output_tensor)
            return None
        ring_all_gather(output_tensor, input_tensor, group)
        self._keep_version(output_tensor)
        return None  # done: FSDP2 waits only on a Work it is given


class RingReduceScatter:
    """FSDP2's ReduceScatter comm on a ring, for SUM and AVG."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None:
        kind = next((k for k in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) if op == k), None)
        if kind is None or not (_ring_applies(input_tensor, group) and output_tensor.is_contiguous()):
            # torch's collectives by the names every supported torch has (the *_single ones are recent)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        ring_reduce_scatter(output_tensor, input_tensor, group, average=kind == dist.ReduceOp.AVG)
        return None


def use_rings(modules: list[nn.Module], device: torch.device, gather_into: dict[int, object] | None = None) -> None:
    """The rings as the all-gather and reduce-scatter of every fully_shard-ed module in `modules`, on a CPU;
    `gather_into`, by id(module): a unit's one parameter, gathered into its own memory (RingAllGather)."""
    if device.type != "cpu":
        return
    for module in modules:
        module.set_custom_all_gather(RingAllGather((gather_into or {}).get(id(module))))
        module.set_custom_reduce_scatter(RingReduceScatter())

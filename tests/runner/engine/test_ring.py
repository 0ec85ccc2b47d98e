"""FSDP2's all-gather and reduce-scatter on CPU as rings (runner/engine/parallel/ring.py): the results of torch's
collectives, and no temporary as large as the buffer."""
from __future__ import annotations


def _rings(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from runner.engine.parallel.ring import RingAllGather, RingReduceScatter

    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    report: dict = {}
    for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg")):
        local = torch.randn(world * 5, generator=generator)
        ours, theirs = torch.empty(5), torch.empty(5)
        RingReduceScatter()(ours, local.clone(), group, op)
        dist.reduce_scatter_single(output=theirs, input=local.clone(), group=group, op=dist.ReduceOp.SUM)
        report[name] = (ours, theirs / world if name == "avg" else theirs)
    gathered, expected = torch.empty(world * 5), torch.empty(world * 5)
    assert RingAllGather()(gathered, report["sum"][0], group) is None
    dist.all_gather_single(expected, report["sum"][0], group=group)
    report["gathered"] = (gathered, expected)

    def rise(call) -> int:  # resident memory added by `call` beyond what was resident before it
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS:")
        call()
        return _status("VmHWM:") - before

    whole = torch.ones(world * 8 * 2 ** 20)  # 32 MiB per rank's shard: mapped apart, returned when freed
    shard = torch.ones(8 * 2 ** 20)
    dist.barrier()
    report["reduce_scatter_rise"] = rise(lambda: RingReduceScatter()(shard, whole, group, dist.ReduceOp.SUM))
    report["all_gather_rise"] = rise(lambda: RingAllGather()(whole, shard, group))
    report["shard_bytes"] = shard.numel() * 4
    report["reduced"] = bool(torch.all(shard == world))
    return report


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def test_the_rings_give_torchs_results_and_allocate_no_buffer_sized_temporary(two_ranks) -> None:
    import torch

    for report in two_ranks.run(_rings):
        for name in ("sum", "avg"):
            ours, theirs = report[name]
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert torch.equal(*report["gathered"])
        assert report["reduced"]
        # the touched pages are the buffers' own (32 MiB each); gloo's collectives added a whole buffer and more
        assert report["reduce_scatter_rise"] < report["shard_bytes"] // 2, report
        assert report["all_gather_rise"] < report["shard_bytes"] // 2, report

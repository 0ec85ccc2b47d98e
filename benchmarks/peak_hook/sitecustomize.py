"""Loaded by every Python process of a run that benchmarks/bench_rank_memory.py starts (this folder is first on
their PYTHONPATH; nothing else loads it): at the process's exit, its own peak memory into
$RUNNER_BENCH_PEAKS/<pid>.json: the resident high-water mark (VmHWM) and, where the process used CUDA,
torch.cuda.max_memory_allocated. The engine keeps no such record: a per-rank peak is the benchmark's business, and
this way every process of the run reports, workers included, without a line in the library. Workers end through
runner/cli/worker.py's exit_before_teardown, which runs the exit handlers; a process killed runs none, and the
benchmark's sampling of /proc still has it."""
import atexit
import json
import os
import sys


def _write_peak() -> None:
    folder = os.environ.get("RUNNER_BENCH_PEAKS")
    if not folder:
        return
    record = {"rank": os.environ.get("RANK"), "argv": sys.argv[:3]}
    try:
        with open("/proc/self/status") as f:
            record["vmhwm"] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        record["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


atexit.register(_write_peak)

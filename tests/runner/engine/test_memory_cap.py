"""A model too big for one process trains under fsdp (issue 34, item 5): every process of the run is capped at
CAP of data memory, below the model's training state plus what a process holds anyway; one process under the
cap ends in one line saying it ran out of memory and to use fsdp; fsdp on 4 ranks trains and resumes under it.

The cap is RLIMIT_DATA, set in the launcher before it starts (its workers inherit it). RLIMIT_AS cannot be used:
torch and its libraries reserve address space far beyond what they touch. There is no writable cgroup here (the
memory controller is cgroup v1, read-only in this container), so memory.max is out too. RLIMIT_DATA counts
private writable mappings (the heap and anonymous mmaps: every tensor) and stays close to the resident peak:
921 MiB of data for 792 MiB resident on the tiny gpt. Threads' stacks count too (8 MiB each), so the runs get
one math thread (OMP_NUM_THREADS=1): the data a process holds then does not grow with the machine's cores.

Sizes: 16 blocks 512 wide (50.4M parameters, 770 MiB of parameters, gradients and AdamW state). Measured with
one thread, uncapped: one process of this model peaks at 1863 MiB of data, one of the tiny gpt at 855 MiB (what
a process holds anyway). A rank holding a quarter of the state (193 MiB) and one block gathered at a time needs
about 855 + 193 MiB and what writing its shards takes: the cap sits between, 360 MiB below one process.
"""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

CAP = 1500 * 2**20
MODEL = ["task=language_modeling", "model=gpt", "model.n_layer=16", "model.n_embd=512", "model.n_head=2",
         "dataset=synthetic_tokens", "dataset.vocab_size=64", "dataset.block_size=16", "dataset.size=40",
         "trainer.eval_every_epoch=false", "trainer.progress_bar=off", "tracking=none"]


def _cap_data() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (CAP, CAP))


def capped_run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m runner <args>` with every process of the run capped at CAP of data memory."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "runner", *MODEL, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_cap_data)


def test_one_process_under_the_cap_is_told_it_will_not_fit_and_ends_in_one_line_saying_to_shard(tmp_path: Path) -> None:
    # batch 16: activations (~130 MiB) put the estimate clearly over what the limit leaves; at batch 4 it lands
    # within 2% of it, where what the estimate leaves out (the allocator's own overhead) decides its verdict
    done = capped_run(["trainer.max_steps=2", "dataset.batch_size=16"], tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    # the estimate at its start saw the limit coming (what RLIMIT_DATA leaves is what the process has)
    assert re.search(r"memory on rank 0 \(cpu\): .*: WILL NOT FIT", done.stdout + done.stderr)
    assert "to make it fit, try: precision=bf16; parallelism=fsdp" in done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: out of memory: could not allocate [0-9.]+ [MG]iB more on the CPU; the model's training "
                        r"state and activations do not fit this process's memory: use parallelism=fsdp "
                        r"parallelism.nproc_per_node=N to shard the parameters, gradients and optimizer state over N "
                        r"processes, or a smaller dataset.batch_size", last), last


# 4 workers, trained then resumed under the cap: 120-200 s on 2 cores (198 s in a fresh-clone CI run), most of the
# CI budget's slack; `make test-all` runs it, and the one-process case above guards the cap's mechanics in CI
@pytest.mark.slow
def test_fsdp_on_4_ranks_trains_and_resumes_a_model_one_process_cannot_hold(tmp_path: Path) -> None:
    """Built on the meta device with only this rank's shards materialised, and checkpointed in shards, each
    rank holds a quarter of the state: under the cap that one process exceeds, the run trains and resumes."""
    fsdp = ["parallelism=fsdp", "parallelism.nproc_per_node=4", "dataset.batch_size=1"]
    first = capped_run([*fsdp, "trainer.max_steps=2"], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = re.search(r"run directory: (\S+)", first.stdout + first.stderr).group(1)
    resumed = capped_run([*fsdp, "trainer.max_steps=4", f"trainer.resume={run_dir}"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(r"step 4\b", resumed.stdout + resumed.stderr)

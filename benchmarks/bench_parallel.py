"""`make bench-parallel`: each parallel dimension's step time beside one process on the same global batch.

Every case is a real `python -m runner` run of the built-in GPT (workers started by the launcher, MLflow
on): ddp and fsdp on N processes, tp=2, pp=2 with GPipe and with 1F1B, and fsdp x tp when 4 processes are
asked for (--nproc 4). The global batch is the same in every case: ddp/fsdp read batch / dp per rank, a
tensor or pipeline group reads the whole batch. A step's time is the run's logged throughput
(`throughput/tokens_per_s`, every step, the first --warmup steps left out) turned back into seconds per
global batch; the table prints its median beside the one-process step and their ratio.

For pipeline parallelism, the measured bubble beside its theory for GPipe/1F1B, (p-1)/(m+p-1) with p stages
and m micro-batches. The measured bubble is the share of a pipeline step not explained by the one-process
step split evenly over the p stages: 1 - t_one / (p x t_pp). It counts the stages' communication and any
imbalance between them as bubble too, so it is an upper bound on the schedule's idle time.

A case that fails (a dimension not built yet, a device with fewer GPUs than processes) is skipped with the
error's one line. Figures are printed, never asserted; on a CPU, processes compete for the machine's
cores (each runs --threads threads), so the ratios say what communication costs here, not what a GPU
cluster gains.
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

THROUGHPUT = "throughput/tokens_per_s"

SHAPES = {  # gpt's arguments and the token blocks: small on a CPU; on a GPU a shape that keeps a GPU busy
    "cpu": dict(model=dict(n_layer=4, n_head=4, n_embd=128), vocab_size=512, block_size=128),
    "cuda": dict(model=dict(n_layer=12, n_head=12, n_embd=768), vocab_size=50304, block_size=1024),
}


@dataclass(frozen=True)
class Case:
    """One dimension: its overrides, how many processes it starts, its data-parallel degree (the global batch
    is split over it), and for a pipeline its stages and schedule."""

    name: str
    overrides: tuple[str, ...]
    processes: int
    dp: int
    stages: int = 1
    schedule: str = ""


def cases(nproc: int, microbatches: int) -> list[Case]:
    """The dimensions benchmarked for `nproc` processes: ddp, fsdp, tp=2, pp=2 (gpipe, 1f1b), and fsdp x tp
    (tp=2) when there are 4 processes or more."""
    pipeline = ("parallelism.pp=2", f"parallelism.pp_microbatches={microbatches}")
    out = [Case(f"ddp, {nproc} processes", ("parallelism=ddp", f"parallelism.nproc_per_node={nproc}"), nproc, nproc),
           Case(f"fsdp, {nproc} processes", ("parallelism=fsdp", f"parallelism.nproc_per_node={nproc}"), nproc, nproc),
           Case("tp=2", ("parallelism.tp=2",), 2, 1),
           Case(f"pp=2 gpipe, m={microbatches}", (*pipeline, "parallelism.pp_schedule=gpipe"), 2, 1, 2, "gpipe"),
           Case(f"pp=2 1f1b, m={microbatches}", (*pipeline, "parallelism.pp_schedule=1f1b"), 2, 1, 2, "1f1b")]
    if nproc >= 4:
        out.append(Case(f"fsdp x tp=2, {nproc} processes", ("parallelism=fsdp", f"parallelism.nproc_per_node={nproc}",
                                                             "parallelism.tp=2"), nproc, nproc // 2))
    return out


def bubble_theory(stages: int, microbatches: int) -> float:
    """GPipe's and 1F1B's idle share of a step: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def measured_bubble(one_step_s: float, pipeline_step_s: float, stages: int) -> float:
    """The share of a pipeline step beyond the one-process step split evenly over its stages."""
    return 1.0 - one_step_s / (stages * pipeline_step_s)


def step_seconds(throughputs: list[float], units_per_step: int, warmup: int) -> float:
    """The median step time from per-step throughputs (units per second), the first `warmup` steps left out."""
    timed = throughputs[warmup:] or throughputs
    return statistics.median(units_per_step / t for t in timed)


@dataclass
class Row:
    name: str
    processes: int
    step_s: float | None = None  # None: skipped
    skipped: str = ""
    bubble: tuple[float, float] | None = None  # (measured, theory)


HEADER = f"{'case':<28} {'procs':>5} {'step ms':>9} {'vs one':>7}   pipeline bubble (measured / theory)"


def line(one: Row, row: Row) -> str:
    """A case's median step time beside one process's and their ratio; for a pipeline its measured bubble
    beside the theory; a skipped case with its one line."""
    if row.step_s is None:
        return f"{row.name:<28} {row.processes:>5} {'skipped':>9}           {row.skipped}"
    text = f"{row.name:<28} {row.processes:>5} {row.step_s * 1e3:>9.1f} {row.step_s / one.step_s:>7.2f}"
    if row.bubble is not None:
        text += f"   {row.bubble[0]:.2f} / {row.bubble[1]:.2f}"
    return text


def table(one: Row, rows: list[Row]) -> list[str]:
    return [HEADER, line(one, one), *(line(one, row) for row in rows)]


class Runs:
    """Runs of `python -m runner` in one temporary folder, all logging to one MLflow store."""

    def __init__(self, root: Path, base: list[str], threads: int):
        self.root, self.base, self.threads = root, base, threads
        self.db = root / "mlflow.db"

    def throughputs(self, name: str, overrides: list[str]) -> list[float]:
        """The run's logged throughput at every step; a failed run raises RuntimeError with its one line."""
        run_dir = self.root / name.replace(" ", "_").replace(",", "").replace("=", "")
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run([sys.executable, "-m", "runner", *self.base, *overrides, f"hydra.run.dir={run_dir}",
                               f"tracking.uri=sqlite:///{self.db}", f"tracking.artifact_root={self.root / 'artifacts'}"],
                              cwd=self.root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(one_line(proc.stderr))
        with sqlite3.connect(self.db) as con:
            rows = con.execute("select m.step, m.value from metrics m join params p on p.run_uuid = m.run_uuid "
                               "where p.key = 'run_dir' and p.value = ? and m.key = ? order by m.step",
                               (str(run_dir), THROUGHPUT)).fetchall()
        return [value for _, value in rows]


def one_line(stderr: str) -> str:
    """A failed run's own account: its `error:` or `runner:` line, else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith(("error:", "runner:")):
            return line
    return lines[-1] if lines else "failed without a message"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=2, help="processes for ddp/fsdp (4 or more adds fsdp x tp)")
    parser.add_argument("--batch", type=int, default=8, help="the global batch (sequences per optimizer step)")
    parser.add_argument("--microbatches", type=int, default=4, help="pp_microbatches of the pipeline cases")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process on a CPU")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    parser.add_argument("overrides", nargs="*", help="extra overrides for every run, e.g. precision=bf16")
    args = parser.parse_args(argv)
    import torch  # here: --help answers without it

    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    shape = SHAPES["cuda" if gpu else "cpu"]
    size = (args.steps + 2) * args.batch * 10 // 9 + 2 * args.batch  # train split 90%: every step a full batch
    base = ["model=gpt", *(f"model.{k}={v}" for k, v in shape["model"].items()), "dataset=synthetic_tokens",
            "task=language_modeling", f"dataset.vocab_size={shape['vocab_size']}", f"dataset.block_size={shape['block_size']}",
            f"dataset.size={size}", "dataset.val_fraction=0.05", "dataset.test_fraction=0.05",
            f"trainer.max_steps={args.steps}", "trainer.log_every_n_steps=1", "trainer.eval_every_epoch=false",
            "trainer.save_checkpoints=false", "trainer.memory_estimate=false", "trainer.progress_bar=off",
            f"trainer.device={'cuda' if gpu else 'cpu'}", *args.overrides]
    units = args.batch * shape["block_size"]  # tokens of one global batch
    where = torch.cuda.get_device_name() if gpu else f"CPU, {args.threads} thread(s) per process"
    print(f"{where}; gpt {shape['model']} at {shape['block_size']} tokens, global batch {args.batch}; "
          f"median of {args.steps - args.warmup} steps from the logged throughput", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = Runs(Path(tmp), base, args.threads)
        try:
            one = Row("one process", 1, step_seconds(runs.throughputs("one", [f"dataset.batch_size={args.batch}"]),
                                                     units, args.warmup))
        except RuntimeError as e:  # nothing to compare against
            sys.exit(f"the one-process run failed: {e}")
        print(HEADER)
        print(line(one, one), flush=True)
        for case in (c for c in cases(args.nproc, args.microbatches) if args.only in c.name):
            row = Row(case.name, case.processes)
            try:
                throughputs = runs.throughputs(case.name, [*case.overrides, f"dataset.batch_size={args.batch // case.dp}"])
                row.step_s = step_seconds(throughputs, units, args.warmup)
            except RuntimeError as e:
                row.skipped = str(e)
            if row.step_s is not None and case.stages > 1:
                row.bubble = (measured_bubble(one.step_s, row.step_s, case.stages),
                              bubble_theory(case.stages, args.microbatches))
            print(line(one, row), flush=True)


if __name__ == "__main__":
    main()

"""Which feature composes with which parallel dimension: one table, checked while the spec is built.

Each cell is built (and then names the test that runs it on 2 processes against one process, or, where
no CPU can run it, the test of its parts) or refused (one line naming the keys and values, why, and what to
use instead). `check` refuses a spec whose features meet a refused cell, and the dimension pairs that are
not built, before any run directory or worker exists (RunSpec.validate calls it). What needs the model
(BatchNorm layers) is `check_model`, called on the model built on the meta device before any run directory
exists (runner/cli/preflight_model.py, by preflight and by the launcher); what
the spec does not hold (a PBT sweep) is `check_feature`, called by the one who knows. README's Model
parallelism section holds `markdown_table()`'s text (tests/runner/specs/test_composition.py compares them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from runner.specs.fields import SpecError
from runner.specs.parallelism import ParallelismSpec, nominal_world, pp_microbatches, resolve_degrees

DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
DIMENSION_NAMES = {"dp_replicate": "dp_replicate (ddp)", "dp_shard": "dp_shard (fsdp)", "tp": "tp", "pp": "pp",
                   "cp": "cp"}


@dataclass(frozen=True)
class Cell:
    built: bool
    why: str = ""      # refused: why, then what to use instead; built: a note where one helps
    test: str = ""     # built: tests/<file>::<test> that runs the cell (see the module's docstring)


@dataclass(frozen=True)
class Feature:
    label: str
    # the keys and values that turn it on, shown in a refusal ("trainer.ema.decay=0.999"); None: off
    on: Callable[[Any], Optional[str]]


def _ema(spec: Any) -> Optional[str]:
    return f"trainer.ema.decay={spec.trainer.ema.decay:g}" if spec.trainer.ema.decay is not None else None


def _swa(spec: Any) -> Optional[str]:
    return f"trainer.swa.start_epoch={spec.trainer.swa.start_epoch}" if spec.trainer.swa.start_epoch is not None else None


def _clip(spec: Any) -> Optional[str]:
    t = spec.trainer
    if t.clip_grad_norm is not None:
        return f"trainer.clip_grad_norm={t.clip_grad_norm:g}"
    return f"trainer.clip_grad_value={t.clip_grad_value:g}" if t.clip_grad_value is not None else None


def _trial(spec: Any) -> Optional[str]:
    return f"trial.study_name={spec.trial.study_name}" if spec.trial.study_name else None


FEATURES: dict[str, Feature] = {
    "accumulation": Feature("accumulation", lambda s: f"accumulation.steps={s.accumulation.steps}"
                            if s.accumulation.steps > 1 else None),
    "clipping": Feature("clipping", _clip),
    "ema": Feature("EMA", _ema),
    "swa": Feature("SWA", _swa),
    "batchnorm": Feature("BatchNorm", lambda s: None),  # the model's layers: check_model
    "sync_batchnorm": Feature("sync_batchnorm", lambda s: "parallelism.sync_batchnorm=true"
                              if s.parallelism.sync_batchnorm else None),
    "compile": Feature("compile", lambda s: f"trainer.compile={s.trainer.compile}" if s.trainer.compile else None),
    "activation_checkpointing": Feature("activation checkpointing", lambda s: "trainer.activation_checkpointing="
                                        f"{s.trainer.activation_checkpointing}"
                                        if s.trainer.activation_checkpointing != "none" else None),
    "finders": Feature("finders (tune=lr_find, batch_size)", lambda s: f"tune={s.tune.name}" if s.tune.name else None),
    "kfold": Feature("k-fold", lambda s: f"trainer.cross_validation.folds={s.trainer.cross_validation.folds}"
                     if s.trainer.cross_validation.folds and s.trainer.cross_validation.fold is None else None),
    "pbt": Feature("PBT", lambda s: None),  # a sweeper, not a key of the run: check_feature
    "optuna": Feature("Optuna trials", _trial),
    "test_on_best": Feature("test on best", lambda s: "trainer.test_on=best" if s.trainer.test_on == "best" else None),
    "modes": Feature("eval, predict, export", lambda s: f"mode={s.mode}" if s.mode != "train" else None),
    "log_model": Feature("log_model", lambda s: f"tracking.log_model={s.tracking.log_model}"
                         if s.tracking.log_model != "none" else None),
    "memory_estimate": Feature("memory estimate", lambda s: None),  # on by default: never refused
    "profiler": Feature("profiler", lambda s: "trainer.profile=true" if s.trainer.profile else None),
    "callbacks": Feature("callbacks", lambda s: "trainer.callbacks=[...]" if s.trainer.callbacks else None),
    "fp16": Feature("fp16", lambda s: "precision=fp16" if s.precision.name == "fp16" else None),
}

CELLS = "tests/runner/specs/test_composition.py::test_a_built_cell_trains_like_one_process"
SLOW_CELLS = "tests/runner/specs/test_composition.py::test_a_slow_cell_trains_like_one_process"
CP_PARTS = ("tests/runner/engine/test_context_parallel.py::"
            "test_tokens_labels_and_positions_are_sharded_alike_and_the_shares_gradients_and_losses_add_up")
CP_NOTE = "CUDA only; its parts are tested on CPU, no GPU run yet"


def _built(test: str, why: str = "") -> Cell:
    return Cell(True, why, test)


def _no(why: str) -> Cell:
    return Cell(False, why)


def _cells(ddp: str = "", fsdp: str = "", tp: str = "", pp: str = "") -> dict[str, Cell]:
    """A feature built in every dimension that the cell tests run (ddp, fsdp, tp, pp) and in cp's parts."""
    return {"dp_replicate": _built(ddp or f"{CELLS}[ddp]"), "dp_shard": _built(fsdp or f"{CELLS}[fsdp]"),
            "tp": _built(tp or f"{CELLS}[tp]"), "pp": _built(pp or f"{CELLS}[pp]"), "cp": _built(CP_PARTS, CP_NOTE)}


ONE_PROCESS = ("runs in one process (it reads weights saved at any mesh); drop the parallelism keys")
PBT_WHY = ("PBT trains each member in one process; use parallelism=single (several members at once: "
           "hydra.sweeper.n_jobs)")

TABLE: dict[str, dict[str, Cell]] = {
    "accumulation": _cells(),
    "clipping": _cells(),
    "ema": _cells(),
    "swa": _cells(),
    "batchnorm": {
        "dp_replicate": _built("tests/runner/engine/test_parallel_memory.py::"
                               "test_ddp_trains_like_one_process_with_sync_batchnorm_and_keeps_each_ranks_statistics_without",
                               "each rank's statistics, as DDP's; sync_batchnorm for the global batch's"),
        "dp_shard": _built("tests/runner/engine/test_parallel_memory.py::"
                           "test_two_ranks_train_like_one_process_with_sync_batchnorm_and_fsdps_memory_options",
                           "each rank's statistics, as DDP's; sync_batchnorm for the global batch's"),
        "tp": _no("a BatchNorm model under tp is not tested; use ddp or fsdp"),
        # one micro-batch: a ragged batch runs at its own rows, so no padded row enters the statistics
        "pp": _built("tests/runner/engine/test_pipeline_seams.py::test_a_batchnorm_model_counts_no_padded_row_under_the_pipeline",
                     "with parallelism.pp_microbatches=1 (gpipe) only: several micro-batches are each normalised by "
                     "their own statistics, unlike one process, and are refused in one line"),
        "cp": _no("a sequence split across ranks changes BatchNorm's statistics; use ddp or fsdp"),
    },
    "sync_batchnorm": {
        "dp_replicate": _built("tests/runner/engine/test_parallel_memory.py::"
                               "test_ddp_trains_like_one_process_with_sync_batchnorm_and_keeps_each_ranks_statistics_without"),
        "dp_shard": _built("tests/runner/engine/test_parallel_memory.py::"
                           "test_two_ranks_train_like_one_process_with_sync_batchnorm_and_fsdps_memory_options"),
        **{dim: _no("SyncBatchNorm syncs over every process, and the ranks of one model replica hold the same "
                    "samples; use it with ddp, fsdp or hsdp alone") for dim in ("tp", "pp", "cp")},
    },
    "compile": {
        "dp_replicate": _built(f"{SLOW_CELLS}[ddp-compile]"), "dp_shard": _built(f"{SLOW_CELLS}[fsdp-compile]"),
        "tp": _built(f"{SLOW_CELLS}[tp-compile]"),
        "pp": _no("compiling the pipeline's stages is not built yet; use trainer.compile=false"),
        "cp": _built(CP_PARTS, CP_NOTE),
    },
    "activation_checkpointing": _cells(),
    "finders": {
        "dp_replicate": _built("tests/runner/specs/test_composition.py::"
                               "test_the_lr_finder_under_ddp_finds_one_processs_lr_and_every_rank_trains_with_it"),
        **{dim: _no("the finders under sharding or model parallelism are not tested yet; run the finder with ddp or "
                    "one process and give its suggestion to this run") for dim in ("dp_shard", "tp", "pp", "cp")},
    },
    "kfold": {
        # the folds' workers as the launcher starts them: test_cross_validation.py's slow test_ddp_folds_equal_single_...
        "dp_replicate": _built("tests/runner/specs/test_composition.py::test_k_fold_folds_under_ddp_train_like_one_processs_folds",
                               "each fold's run starts its own workers"),
        **{dim: _no("k-fold's folds under sharding or model parallelism are not tested; use ddp, or run one fold "
                    "with trainer.cross_validation.fold=k") for dim in ("dp_shard", "tp", "pp", "cp")},
    },
    "pbt": {dim: _no(PBT_WHY) for dim in DIMENSIONS},
    "optuna": {
        "dp_replicate": _built("tests/runner/specs/test_composition.py::test_an_optuna_trial_under_ddp_reports_like_one_process",
                               "each trial's run starts its own workers; rank 0 reports to the study"),
        **{dim: _no("Optuna trials under sharding or model parallelism are not tested; search with ddp or one "
                    "process") for dim in ("dp_shard", "tp", "pp", "cp")},
    },
    "test_on_best": _cells(),
    "modes": {dim: _no(ONE_PROCESS) for dim in DIMENSIONS},
    "log_model": {
        "dp_replicate": _built(f"{CELLS}[ddp]"), "dp_shard": _built(f"{CELLS}[fsdp]"), "tp": _built(f"{CELLS}[tp]"),
        "pp": _no("logging the model from the pipeline's stages is not built yet; use tracking.log_model=none "
                  "and export the checkpoint's model after the run (mode=export)"),
        "cp": _built(CP_PARTS, CP_NOTE),
    },
    "memory_estimate": {**_cells(), "pp": _built(f"{CELLS}[pp]", "each rank's own stages, without activations (no micro-step runs outside the schedule)")},
    "profiler": _cells(),
    "callbacks": _cells(),
    "fp16": {
        "dp_replicate": _built(f"{SLOW_CELLS}[ddp-fp16]", "GradScaler"),
        "dp_shard": _built(f"{SLOW_CELLS}[fsdp-fp16]", "GradScaler over the sharded gradients (inf checks all-reduced)"),
        "tp": _no("fp16's loss scaling over tensor-parallel shards is not tested; use precision=bf16 or fp32"),
        "pp": _no("fp16's loss scaling is not built into the pipeline schedules; use precision=bf16 or fp32"),
        "cp": _no("fp16's loss scaling under cp is not tested; use precision=bf16 or fp32"),
    },
}

# dimensions that do not combine, whatever the features: (the degrees > 1 that meet, why and what instead)
PAIRS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("pp", "cp"), "pp x cp is not built yet; use one of them"),
    (("pp", "dp_shard", "tp"), "pp x fsdp x tp is not built yet; use two of them"),
    (("pp", "dp_replicate", "dp_shard"), "pp x hsdp is not built yet; use pp with dp_shard (fsdp) or dp_replicate (ddp)"),
)


def degrees(par: ParallelismSpec) -> dict[str, int]:
    """The run's degrees, -1 resolved: against the processes the launcher starts, or under a torchrun the
    user started, against its WORLD_SIZE (a mismatch is refused elsewhere: mesh.py, check_parallelism)."""
    world = int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ \
        else nominal_world(par)
    try:
        return resolve_degrees(par, world)
    except SpecError:  # degrees that do not make the processes: check_parallelism says so
        return {name: max(1, getattr(par, name)) for name in DIMENSIONS}


def _split(dims: dict[str, int]) -> list[str]:
    return [d for d in DIMENSIONS if dims.get(d, 1) > 1]


def _shown(par: ParallelismSpec, dims: dict[str, int], dim: str) -> str:
    """How the user set the dimension: parallelism.tp=2, or the preset that set it (parallelism=ddp
    parallelism.nproc_per_node=2 resolves dp_replicate to 2)."""
    if getattr(par, dim) > 1:
        return f"parallelism.{dim}={getattr(par, dim)}"
    return f"parallelism={par.name} (parallelism.{dim}={dims[dim]})"


def refusal(feature: str, shown: str, par: ParallelismSpec, dims: dict[str, int]) -> Optional[str]:
    """The line refusing `feature` (turned on by `shown`) at these degrees, or None where every cell is built."""
    for dim in _split(dims):
        cell = TABLE[feature][dim]
        if not cell.built:
            return f"{shown} with {_shown(par, dims, dim)}: {cell.why}"
    return None


def check(spec: Any) -> None:
    """Refuse, in one line, a feature of `spec` in a dimension that does not build it, and dimensions that do
    not combine (before any run directory or worker exists)."""
    par = spec.parallelism
    dims = degrees(par)
    split = _split(dims)
    if not split:
        return
    for needed, why in PAIRS:
        if all(d in split for d in needed):
            shown = " with ".join(_shown(par, dims, d) for d in needed)
            raise SpecError(f"{shown}: {why}")
    for name, feature in FEATURES.items():
        shown = feature.on(spec)
        if shown is not None:
            line = refusal(name, shown, par, dims)
            if line is not None:
                raise SpecError(line)
    if spec.tune.name and spec.trainer.cross_validation.folds and spec.trainer.cross_validation.fold is None:
        raise SpecError(f"tune={spec.tune.name} with trainer.cross_validation.folds={spec.trainer.cross_validation.folds} "
                        f"and {_shown(par, dims, split[0])}: the finder runs once for every fold, in this process; "
                        "run the finder without trainer.cross_validation.folds and give its suggestion to the k-fold run")


def check_feature(feature: str, shown: str, spec: Any) -> None:
    """A feature the spec does not hold (`pbt`: the sweeper), refused where its cells are."""
    line = refusal(feature, shown, spec.parallelism, degrees(spec.parallelism))
    if line is not None:
        raise SpecError(line)


def check_model(spec: Any, model: Any) -> None:
    """What the model decides (called with the model built on the meta device, before any run directory exists):
    BatchNorm layers in a dimension that does not build them."""
    from torch.nn.modules.batchnorm import _BatchNorm

    layer = next((n for n, m in model.named_modules() if isinstance(m, _BatchNorm)), None)
    if layer is not None:
        par = spec.parallelism
        shown = f"model: {spec.model.target}'s BatchNorm layer '{layer}'"
        line = refusal("batchnorm", shown, par, degrees(par))
        if line is None and par.pp > 1 and pp_microbatches(par) > 1:  # the pp cell's condition
            line = (f"{shown} with parallelism.pp_microbatches={pp_microbatches(par)}: each micro-batch would be "
                    "normalised by its own statistics, unlike one process; use parallelism.pp_microbatches=1 with "
                    "pp_schedule=gpipe, or a norm that does not mix samples (LayerNorm, GroupNorm)")
        if line is not None:
            raise SpecError(line)


def markdown_table() -> str:
    """The table as README's Model parallelism section states it: a grid, then each reason once."""
    notes: list[str] = []

    def mark(cell: Cell) -> str:
        if cell.built and not cell.why:
            return "built"
        if cell.why not in notes:
            notes.append(cell.why)
        return f"{'built' if cell.built else '**refused**'} ({notes.index(cell.why) + 1})"

    rows = ["| feature | " + " | ".join(DIMENSION_NAMES[d] for d in DIMENSIONS) + " |",
            "|---" * (len(DIMENSIONS) + 1) + "|"]
    for name, feature in FEATURES.items():
        rows.append(f"| {feature.label} | " + " | ".join(mark(TABLE[name][d]) for d in DIMENSIONS) + " |")
    rows.append("")
    rows += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    rows.append("")
    rows.append("Dimensions that do not combine (not built yet): " + ", ".join(" x ".join(n) for n, _ in PAIRS) + ".")
    return "\n".join(rows)


# every feature has a cell in every dimension
assert all(set(cells) == set(DIMENSIONS) for cells in TABLE.values()) and set(TABLE) == set(FEATURES)

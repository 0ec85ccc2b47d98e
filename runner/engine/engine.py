"""The engine: builds every part from the run spec, then runs the step loop.

Correctness rules it keeps (../shared/DESIGN.md): the optimizer step sees the gradient of the mean
loss over every sample of all its micro-batches (normalized by their total count, so a ragged batch
changes nothing); one optimizer step is one scheduler step; fp16 unscales before clipping; a
checkpoint holds everything needed to continue as if never stopped.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import traceback
from dataclasses import dataclass

import torch

from pathlib import Path
from typing import Callable, Iterator, Sequence

from runner.engine import checkpoint, finetune, fit_checks, parallel, preemption, steps
from runner.engine.parallel import model_checks, parallelize

from runner.addons import averaging, profiling

from runner.engine.components import build_callbacks, build_task
from runner.specs import components, metric_names

from runner import startup_gc, tasks
from runner.engine import compiling, debugging, flops
from runner.addons import mlflow_model
from runner.addons.base import AddOn, AddOns, EngineView, Progress, Stop, first_stop, pause_due
from runner.addons.early_stopping import Stopping
from runner.addons.non_finite_watch import NonFiniteWatch
from runner.addons.stop_vote import StopVote
from runner.addons.overfit_goal import OverfitGoal
from runner.addons.unfreezing import GradualUnfreezing
from runner.tasks import batches
from runner.tasks.classification import Classification
from runner.addons.best_weights import BestWeights
from runner.engine.loader import BatchedTensors, make_loader, on_device, optimizer_steps
from runner.engine.monitor import Monitor, learning_rates
from runner.engine.optim import build_optimizer
from runner.engine.parallel import DistEnv, pick_device
from runner.engine.parallel import context, tensor as tensor_parallel
from runner.engine.precision import Precision
from runner.engine.resume_source import starts_over
from runner.engine.run_data import build_data
from runner.engine.schedule import build_scheduler
from runner.specs.resume import typed_keys
from runner.engine.rng import seed_everything
from runner.specs.run import RunSpec, SpecError
from runner.tracking.tracker import NullTracker, Tracker

log = logging.getLogger(__name__)

_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it has no state


@dataclass
class RunResult:
    objective: float
    best: dict[str, float]
    best_step: dict[str, int]
    final: dict[str, float]
    steps: int
    seconds: float
    samples_per_s: float = 0.0  # training samples (all ranks) per second of the whole run
    tflops: float | None = None  # achieved TFLOP/s per device over the timed training steps (runner/engine/flops.py)
    mfu: float | None = None     # tflops / the device's peak; None where no peak is known
    compile_seconds: float = 0.0  # wall time of the steps that compiled (not in the throughput)
    test_from: str = ""  # the weights the test metrics came from: "best@step 40", "last@step 60"
    pruned: str = ""     # why an Optuna pruner stopped the run (its caller raises optuna.TrialPruned); "" if not
    pp_bubble: float | None = None  # parallelism.pp: this rank's measured pipeline bubble (parallel/pipeline.py step_bubble)


class Engine:
    """`addons`: the caller's own add-ons besides the run's (runner/addons/base.py), set up with the engine's
    view like them: an Optuna trial's reporter (runner/cli/launch.py), PBT's mid-run changes (its member)."""

    def __init__(self, spec: RunSpec, tracker: Tracker | None = None, env: DistEnv | None = None,
                 addons: Sequence[AddOn] = ()):
        spec = components.resolved_spec(spec, typed_keys(spec.overrides))
        self.spec = spec
        self.tracker = tracker or NullTracker()
        self.env = env or DistEnv()
        self.device = pick_device(spec.trainer.device, self.env.local_rank)
        self.env = parallel.place(self.env, spec.parallelism, self.device)  # its parallel dimensions and device mesh
        sharded = self.env.dims.dp_shard > 1
        self.precision = Precision(spec.precision, self.device, sharded, self.env.dp_degree)
        resume_state = self._read_checkpoint(spec.trainer.resume) if spec.trainer.resume else None
        seed_everything(spec.seed, spec.trainer.deterministic)

        data = fit_checks.check_data(spec, build_data(spec))
        data = debugging.limit_data(spec, data, self.env.dp_degree)  # trainer.limit_*, overfit_batches, max_eval_batches
        self.split_sizes = {split: len(getattr(data, split)) for split in ("train", "val", "test")}
        if spec.dataset.batch_size * self.env.dp_degree > self.split_sizes["train"]:
            raise SpecError(f"dataset.batch_size: {spec.dataset.batch_size} x {self.env.dp_degree} rank(s) is more than the "
                            f"training split holds ({self.split_sizes['train']} samples); use at most "
                            f"{max(self.split_sizes['train'] // self.env.dp_degree, 1)}")
        self.task = build_task(spec.task, data.num_classes)
        metric_names.check_produced(spec, self.task, self.split_sizes)
        self.batch_transform = data.batch_transform
        self.moves_batches = self.device.type != "cpu"
        loader_args = dict(seed=spec.seed, num_workers=spec.dataset.num_workers, pin_memory=self.device.type == "cuda",
                           dp_rank=self.env.dp_rank, dp_degree=self.env.dp_degree, collate=data.collate)
        self.train_loader = make_loader(on_device(data.train, self.device), spec.dataset.batch_size, shuffle=True,
                                        **loader_args)
        self.eval_loaders = {split: make_loader(on_device(getattr(data, split), self.device), spec.dataset.batch_size,
                                                shuffle=False, **loader_args) for split in ("val", "test")}
        self._count = _unit_count(self.task, self.train_loader.dataset)  # decided once where the data fixes it
        self.accum = spec.accumulation.steps
        self.steps_per_epoch = math.ceil(self.train_loader.batch_sampler.batches_per_epoch() / self.accum)
        self.total_steps = spec.trainer.max_steps or spec.trainer.max_epochs * self.steps_per_epoch

        # preflight's checks of what the model makes of the degrees, on every rank (the user's torchrun has none)
        model_checks.check_model_composition(spec, self.env.dims, data, say=log.warning if self.env.is_main else None)
        # on the meta device where the run shards the model (parallel/parallelize.py): no rank holds it whole
        built = parallelize.build_model(spec, data, self.env, self.device, resuming=resume_state is not None)
        module = built.module = self.precision.prepare_model(built.module)
        if spec.trainer.channels_last:  # 4-D weights only; a convolution then gives channels-last outputs too
            module = built.module = module.to(memory_format=torch.channels_last)
        self.pass_labels = batches.accepts_labels(module)
        stand_in = self._prepare(batches.split_batch(self.train_loader.collate_fn.stand_in()), train=False)
        _check_loss_options(module, self.task, stand_in, self.pass_labels, spec.model.target, built.on_meta)
        # before the wrap (FSDP shards in place): the FLOPs of every micro-batch are counted on a meta twin of the model
        self.flop_count, flop_rate = flops.measure(module, stand_in, spec, self.device, self.pass_labels, self.env.world)
        self.cp_mesh = self.env.submesh("cp")  # parallelism.cp: each sequence split across these ranks (CUDA)
        if self.cp_mesh is not None:
            context.check_model(module, spec.model.target)
        # the pipeline cut, the tensor plan, activation checkpointing, the data-parallel wrap, this rank's shards, compile
        parts = parallelize.parallelize(built, spec, self.env, self.device, self.precision.param_dtype, self._pipeline_loss)
        # self.module: this rank's model, bare (under pp its stages' part, whole-model names); self.model: what steps call
        self.model, self.module, self.pipeline, self.compiled = parts.model, parts.module, parts.pipeline, parts.compiled
        self.dp_degree = self.env.dp_degree  # read once: a step's loss scale is dp degree / units
        self.clips = spec.trainer.clip_grad_norm is not None or spec.trainer.clip_grad_value is not None
        self.distributed = self.env.distributed  # one process: the step's unit count is its own, no collective asked
        # tp's vocabulary-sharded loss needs its context around the loss and its backward; otherwise a shared no-op
        self.shards_loss = tensor_parallel.shards_loss(spec.parallelism, self.env)
        self._loss_context = (lambda: tensor_parallel.loss_context(spec.parallelism, self.env)) if self.shards_loss \
            else lambda: _NO_CONTEXT
        # what clipping, the grad norm and the FLOP count walk (FSDP's are new: unfreezing sets requires_grad on
        # these); walking the module each step costs ~0.5 ms of host time on GPT-2, while the GPU waits
        self.params = self.flop_count.params = list(self.module.parameters())
        self.compiled_task = compiling.compile_loss(self.task, spec, self.device)  # None: the loss stays eager
        self.optimizer = build_optimizer(spec.optimizer, self.module, parallel.parameter_device(spec.parallelism, self.env, self.device))
        parallelize.fit_optimizer(self.optimizer, parts)
        self.progress = Progress()
        schedule = build_scheduler(spec.scheduler, self.optimizer, self.total_steps,
                                   tuple(components.typed_keys_under(spec.overrides, "scheduler")))
        # handed over to SWALR at SWA's first epoch when trainer.swa.lr is set
        self.schedule = averaging.swa_schedule(spec.trainer.swa, schedule, self.optimizer, self.progress, self.steps_per_epoch)
        # one process: the window's sums are read as they are, with no tensors built for a reduction
        self.monitor = Monitor(spec, self.tracker, self.total_steps, self.steps_per_epoch,
                               parallel.all_reduce_sum if self.env.distributed else None, self.env.is_main)
        self.monitor.flop_rate = flop_rate
        self.steps = steps.build(self, self.pipeline)  # how the model runs: the plain path's, or the pipeline's
        self.view = self._view()
        own, foreign = self._addons(spec, data), [*build_callbacks(spec), *addons]
        self.addons = AddOns([*own, *foreign], self.view)
        # FLOPs per sample that no step can change: every sample of a tensor dataset read as it is has one shape, and
        # only another's add-on or unfreezing could change which parameters train. Then the first step's count gives
        # every step's, with no walk over the parameters and no lookup per step (~10 us of a tiny step)
        self.fixed_flops = isinstance(self.train_loader.dataset, BatchedTensors) and not self.pass_labels and not foreign \
            and not any(isinstance(a, GradualUnfreezing) for a in own)
        self.finished, self.final, self.test_from = False, {}, ""
        self.resume_run_id: str | None = None       # continuing this run directory: its own MLflow run
        self.resumed_from: dict[str, str] = {}      # started from another run's checkpoint: tags naming it
        self.checkpointer: checkpoint.Checkpointer | None = None  # made at the first save (trainer.async_checkpoint)
        if resume_state is not None:
            self._load_state(resume_state)
        # `python -m runner` paused Python's collector for its start-up (runner/startup_gc.py): what exists now lives
        # as long as the run, and is kept out of the collections training makes
        startup_gc.resume(freeze=True)

    def _addons(self, spec: RunSpec, data) -> list[AddOn]:
        """The run's add-ons (runner/addons/base.py), in the order their hooks run; a new one is one line here.
        Those the engine also calls itself (the averages' metrics, the test, the watch, the profiler's phases)
        keep a name."""
        view = self.view
        self.averages = averaging.Averages(view)  # EMA/SWA of the weights; nothing when both are off
        self.watch = NonFiniteWatch(spec, self.device)
        self.best_weights = BestWeights(view, self.averages)  # trainer.test_on=best: the best weights, kept to test on
        self.stopping = Stopping(spec.trainer.early_stopping)
        self.logged_model = mlflow_model.ModelLogger(spec, view, data, self.best_weights)  # tracking.log_model
        self.profiler = profiling.build(view)  # trainer.profile; otherwise a no-op
        return [
            self.averages,                                                 # trainer.ema, trainer.swa
            self.watch,                                                    # trainer.max_non_finite_steps
            *self._unfreezing(spec),                                       # model.unfreeze_after_epochs
            OverfitGoal(spec, self.steps_per_epoch, parallel.all_reduce_sum),  # trainer.overfit_batches
            self.best_weights,                                             # trainer.test_on
            self.stopping,                                                 # trainer.early_stopping
            self.logged_model,                                             # tracking.log_model
            self.profiler,                                                 # trainer.profile
            StopVote(self.env.distributed),                                # SIGTERM/SIGHUP: all ranks stop at one step
        ]

    def _unfreezing(self, spec: RunSpec) -> list[AddOn]:
        if not (spec.model.freeze and spec.model.unfreeze_after_epochs is not None):
            return []
        # after the optimizer: a frozen parameter is in it already and simply gets no gradient until unfrozen
        unfreezer = finetune.keyed("model.freeze", finetune.Unfreezer, self.module, list(spec.model.freeze),
                                   spec.model.unfreeze_after_epochs)
        return [GradualUnfreezing(unfreezer, list(spec.model.freeze))]

    def _view(self) -> EngineView:
        """What the add-ons see of the engine. Functions rather than bound methods where a tool (a test, a
        finder) may put another in the engine's place."""
        return EngineView(
            spec=self.spec, env=self.env, device=self.device, module=self.module, optimizer=self.optimizer,
            schedule=self.schedule, progress=self.progress, total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch, tracker=self.tracker, say=self.monitor.say,
            evaluate=lambda split: {**self.evaluate(split), **self.averages.evaluate(split)},
            evaluate_model=lambda split: self.evaluate(split),
            best_step=lambda metric: self.monitor.best_step.get(metric),
            train_batches=self._train_batches, forward=self.steps.forward, untimed=lambda: self.monitor.window.paused(),
            parts=tuple(self.steps.parts()), holds_batchnorm=self.steps.holds_batchnorm())

    # --- the step loop ------------------------------------------------------------------------

    def fit(self) -> RunResult:
        self.tracker.start(self.spec, self.resume_run_id)
        started, stop = time.perf_counter(), Stop("finished before")
        try:  # from here on, whatever fails ends the MLflow run FAILED (or KILLED), never RUNNING
            batch = self.spec.dataset.batch_size
            self.tracker.set_tags({"world_size": str(self.env.world), "dp_degree": str(self.env.dp_degree),
                                   "per_rank_batch_size": str(batch),
                                   "global_batch_size": str(batch * self.accum * self.env.dp_degree), **self.resumed_from})
            if self.finished:
                log.info("the run already finished at step %d: nothing left to do", self.progress.step)
            else:
                if self.spec.trainer.memory_estimate:
                    self.steps.report_memory()
                with debugging.anomaly_detection(self.spec, lambda: self.progress.step):
                    stop = self._train()
                self.addons.on_train_end(stop)  # the overfit goal's line, the profile, SWA's BatchNorm statistics
                if stop.paused:
                    self.pause()
                elif not stop.pruned:
                    self._finish_training()
            if stop.paused:  # no summary or plot yet: the run goes on
                self.monitor.close()
            else:
                self.monitor.finish(self.final, self.progress.step, pruned=stop.pruned)
            bubble = self.steps.bubble()
            if bubble is not None:  # rank 0's: the first stage's
                self.tracker.set_tags({"pp_bubble": f"{bubble:.4f}"})
            self._commit_checkpoint()  # trainer.async_checkpoint: a pruned run's last save
            preemption.run_finished()  # a preemption from here on leaves the run FINISHED (exit 0, no requeue)
            self.tracker.finish("FINISHED")
        except KeyboardInterrupt:
            self.monitor.close()
            self.tracker.finish("KILLED")
            raise
        except BaseException as e:
            self.monitor.close()
            self.tracker.set_tags({"runner.outcome": "failed"})
            self.tracker.log_text("".join(traceback.format_exception(e)), "error.txt")
            self.tracker.finish("FAILED")
            raise
        seconds, rates = time.perf_counter() - started, self.monitor.run_rates()
        return RunResult(self.monitor.objective(), self.monitor.best, self.monitor.best_step, self.final,
                         self.progress.step, seconds, self.monitor.samples_seen / seconds, rates.get("throughput/tflops"),
                         rates.get("throughput/mfu"), self.monitor.compile_clock.seconds, self.test_from,
                         stop.reason if stop.pruned else "", self.steps.bubble())

    @preemption.at_step_boundaries()  # a signal stops the run at the next step boundary (the loop votes)
    def _train(self) -> Stop:
        """Trains to the run's last step, or until an evaluation says stop; returns why it stopped."""
        trainer, p = self.spec.trainer, self.progress
        stop = pause_due(trainer.stop_at_step, p.step, self.total_steps)
        global_micro_batch = self.spec.dataset.batch_size * self.env.dp_degree
        train_size = self.split_sizes["train"]
        monitor, addons, profiler, model_steps = self.monitor, self.addons, self.profiler, self.steps
        model_steps.train_mode(True)
        monitor.window.start()
        while stop is None and p.step < self.total_steps and (trainer.max_steps or p.epoch < trainer.max_epochs):
            self.train_loader.batch_sampler.set_epoch(p.epoch, start=p.samples_in_epoch)
            addons.on_epoch_start(p.epoch)  # gradual unfreezing
            for micro_batches in profiler.steps(optimizer_steps(self.train_loader, self.accum)):
                logs = monitor.step_starts(p.step + 1)
                # a log step's own rates, read before the scheduler moves them, and its grad norm
                lrs = learning_rates(self.optimizer) if logs else None
                loss_sum, samples, grad_norm = self.train_step(micro_batches)
                p.step += 1
                seen = p.samples_in_epoch + len(micro_batches) * global_micro_batch
                p.samples_in_epoch = seen if seen < train_size else train_size  # (min() costs ~1.3k instructions)
                # a profiled step is timed apart, like one that compiled: neither is throughput
                monitor.on_step(p.step, loss_sum, samples, grad_norm, lrs, self.precision.skipped_steps,
                                model_steps.last_step_flops, timed=not profiler.profiling)
                # the EMA, the non-finite watch, the overfit goal, the stop vote (SIGTERM/SIGHUP), a user's callbacks
                stop = addons.on_step_end(p.step, loss_sum, samples)
                evaluate = trainer.eval_every_n_steps and p.step % trainer.eval_every_n_steps == 0
                save = trainer.checkpoint_every_n_steps and p.step % trainer.checkpoint_every_n_steps == 0
                signum = 0
                if evaluate or save or stop is not None:
                    with self.monitor.window.paused():  # throughput counts training time only
                        if evaluate:
                            stop = first_stop([stop, self._evaluate_and_watch()])
                        signum = stop.signal if stop is not None else 0  # every rank stops here, with this step's checkpoint
                        if signum or (stop is None and save):
                            self.save_checkpoint()
                if signum:
                    raise preemption.Stopped(signum, p.step, self.spec.run_dir if self.env.is_main else None)
                if stop is None and trainer.stop_at_step is not None:  # PBT's round boundary
                    stop = pause_due(trainer.stop_at_step, p.step, self.total_steps)
                if p.step >= self.total_steps or stop is not None:
                    break
            if p.samples_in_epoch >= self.split_sizes["train"]:  # the epoch ran to its end
                p.epoch, p.samples_in_epoch = p.epoch + 1, 0
                self.addons.on_epoch_end(p.epoch)  # SWA takes the weights in
                if trainer.eval_every_epoch and stop is None:
                    with self.monitor.window.paused():
                        stop = self._evaluate_and_watch()
        return stop or Stop("the last step")

    def _finish_training(self) -> None:
        """Validate if the last step was not (a run shorter than an epoch, or one resumed after its last
        step), test, and write the final checkpoint: a run resumed after this has nothing left to do.
        The run trained to its end: what that validation would decide (stop, prune) no longer matters."""
        self._evaluate_and_watch()
        self.final = self.best_weights.test()
        self.test_from = self.best_weights.source
        self.tracker.set_tags({"test_from": self.test_from})
        self.finished = True
        self.save_checkpoint()
        self.addons.on_run_end(self.final)  # the model logged to MLflow

    def train_step(self, micro_batches: list) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """One optimizer step: this rank's loss sum, units and the grad norm (log steps, or clipping); its
        FLOPs (this rank's) are left in steps.last_step_flops."""
        step_batches, counts = [], []
        for raw in micro_batches:  # a loop: a list(map()) and a comprehension cost a tiny step ~4k instructions more
            batch = batches.split_batch(raw)
            step_batches.append(batch)
            # samples, or tokens that are not padding; a stand-in for an empty share counts 0
            counts.append(0 if batch.empty else self._count(batch.labels))
        # The mean over every unit of the step on all replicas: DDP/FSDP average gradients over the
        # data-parallel replicas, so each one's sum is scaled by dp degree / (units on all replicas),
        # whatever each holds.
        # (A step of no units at all, e.g. only padding, has a loss sum of 0: any scale keeps it 0.)
        return self.steps.train_step(step_batches, counts)

    def _pipeline_loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        """The pipeline's last stage's loss: the task's, summed over the labels' units."""
        return batches.loss_sum(output, tasks.Batch(None, labels), 0, self.task, self.spec.model.target)

    def _train_batches(self) -> Iterator[tasks.Batch]:
        """One pass over the training split in this epoch's order, prepared as a step prepares its batches
        (no augmentation by batch transforms): SWA's BatchNorm statistics."""
        self.train_loader.batch_sampler.set_epoch(self.progress.epoch)
        for raw in self.train_loader:
            yield self.precision.prepare_batch(batches.to_device(batches.split_batch(raw), self.device))

    def _prepare(self, batch: tasks.Batch, train: bool) -> tasks.Batch:
        # on the CPU every batch is where it trains already; elsewhere a tensor's .to() there would return it as it is
        if self.moves_batches and not _on_device(batch, self.device):
            batch = batches.to_device(batch, self.device)
        if self.precision.casts_batches:
            batch = self.precision.prepare_batch(batch)
        if train and self.batch_transform is not None and not batch.empty:  # a stand-in's loss counts 0 anyway
            inputs, labels = self.batch_transform(batch.inputs, batch.labels)  # mixup/cutmix: soft labels
            batch = tasks.Batch(inputs, labels)
        return batch

    # --- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, split: str) -> dict[str, float]:
        """The task's metrics over the whole split, each sample counted once. Every rank runs as many
        batches (a stand-in where its share of the last one is empty), so FSDP's collectives stay in step."""
        if not self.split_sizes[split]:
            return {}  # an empty split reports nothing
        self.steps.train_mode(False)
        totals: dict[str, torch.Tensor] = {}
        count = 0
        for raw in self.eval_loaders[split]:
            batch = self._prepare(batches.split_batch(raw), train=False)
            n = 0 if batch.empty else self.task.count(batch.labels)
            for name, value in self.steps.eval_sums(batch, n).items():
                totals[name] = totals.get(name, 0) + value.double()
            count += n
        names = sorted(totals)  # every rank ran a batch (a stand-in at least): the same names in one order
        totals = self.steps.finish_eval(totals)  # under pp: the last stage's sums reach every stage
        values = parallel.all_reduce_sum([totals[n] for n in names] + [torch.tensor(float(count), device=self.device)])
        *sums, n = [v.item() for v in values]
        return tasks.metric_values(self.task, dict(zip(names, sums)), n, split)

    def _evaluate_and_watch(self) -> Stop | None:
        """Validates once per step, whatever asks; returns why training stops here (pruned, early stopping)."""
        p = self.progress
        if p.last_eval_step == p.step:
            return None
        p.last_eval_step = p.step
        self.watch.check(parallel.all_reduce_max)  # no evaluation of weights that already diverged
        metrics = self.view.evaluate("val")  # the model's and its averaged weights'
        self.steps.train_mode(True)
        if metrics:
            self.schedule.on_eval(metrics)
        self.monitor.on_eval(metrics, p.step, p.epoch)
        stop = self.addons.after_evaluation(metrics)  # the best weights kept, an Optuna pruner, early stopping
        if stop is not None:
            self.monitor.say(stop.reason)
        return stop

    # --- checkpoints: everything needed to continue as if never stopped ---------------------------

    def save_checkpoint(self) -> Path | None:
        """Every rank writes its own shards of the model, optimizer and averages (no rank gathers the whole state);
        rank 0 adds the record (spec, progress, schedule, monitor, every rank's RNG and log window). With
        trainer.async_checkpoint the shards are written while training goes on (the final checkpoint is waited for)."""
        if not self.spec.trainer.save_checkpoints:  # debug=fast: nothing to resume from is wanted
            return None
        self.watch.check(parallel.all_reduce_max)  # a checkpoint never holds diverged weights
        tensors, groups = parallel.sharded_state(self.module, self.optimizer)
        tensors = parallel.saved_names({**tensors, **self.averages.sharded_state()}, self.module)
        groups = parallel.gather_objects(groups)  # parameter names and settings: a pipeline rank holds some of each group
        rng = parallel.gather_objects(checkpoint.rng_state())  # each rank's own streams
        log_windows = parallel.gather_objects(self.monitor.window.state_dict())  # each rank's own losses
        addons = self.addons.state_dict()  # the averages' counts (their tensors are in `tensors`), ...
        record = None
        if self.env.is_main:
            # metrics up to this step are in the run's journal before the checkpoint exists: a kill after it loses none
            self.tracker.flush(wait=False)
            record = {
                "spec": self.spec.to_yaml(),
                "optimizer_groups": parallel.merged_groups(groups, parallel.tied_names(self.module)),
                "schedule": self.schedule.state_dict(),
                "precision": self.precision.state_dict(),
                "rng": rng,
                "progress": vars(self.progress).copy(),
                "monitor": self.monitor.state_dict(),
                "log_windows": log_windows,
                "finished": self.finished,
                "final": self.final,
                "test_from": self.test_from,
                "mlflow_run_id": self.tracker.run_id or "",
                "addons": addons,  # one entry per add-on with state, by its name
            }
        if self.checkpointer is None:
            self.checkpointer = checkpoint.Checkpointer(self.spec.trainer.async_checkpoint)
        self._commit_checkpoint()  # the save before this one, if it is still in flight
        path = self.checkpointer.save(Path(self.spec.run_dir) / "checkpoints" / f"step-{self.progress.step:08d}.pt",
                                      self.progress.step, tensors, record, keep=self.spec.trainer.keep_checkpoints)
        if self.checkpointer.async_save and not (self.finished or self._stopping()):
            return path  # committed when the next save starts, or the run ends
        self.checkpointer.wait()
        if self.env.is_main:
            self.addons.after_checkpoint(path)
        return path

    def _stopping(self) -> bool:
        """Whether this save is the run's last before it stops (a pause, a preemption): waited for at once. Every
        rank decides alike (a signal reaches one rank; StopVote stopped them all)."""
        if self.spec.trainer.stop_at_step == self.progress.step:
            return True
        signalled = torch.tensor(float(preemption.signalled()))
        return bool(parallel.all_reduce_max([signalled])[0] > 0)

    def _commit_checkpoint(self) -> None:
        """An asynchronous save still in flight is committed before the run ends (every rank calls it)."""
        committed = self.checkpointer.wait() if self.checkpointer is not None else None
        if committed is not None and self.env.is_main:
            self.addons.after_checkpoint(committed)

    def pause(self) -> None:
        """trainer.stop_at_step: validated at this step (population-based training ranks members by it) and
        checkpointed; neither tested nor finished, so a resume trains on along the same schedule."""
        self._evaluate_and_watch()
        self.save_checkpoint()
        self.tracker.set_tags({"runner.outcome": "paused", "runner.paused_at_step": str(self.progress.step)})

    def _read_checkpoint(self, where: str) -> dict | None:
        """Rank 0 verifies the checkpoint and hands its record to every rank (None: starting over); each rank then
        reads its own shards (_load_state). A one-file checkpoint (written before they were sharded) is read whole."""
        state = None
        if self.env.is_main and not starts_over(Path(where)):
            path, state = checkpoint.read(where)
            state["path"] = str(path)
        return parallel.broadcast_object(state)

    def _load_state(self, state: dict) -> None:
        # a sharded folder is read by DCP, each rank its own pieces at this run's mesh; a one-file checkpoint's
        # whole tensors are laid out by each rank as its own
        source = parallel.flat_full_state(state) if "model" in state else Path(state["path"])
        groups = state["optimizer_groups"] if "optimizer_groups" in state else state["optimizer"]["param_groups"]
        try:
            parallel.load_sharded(self.module, self.optimizer, source, groups, extra=self.averages.sharded_state(),
                                  optional=(parallel.AVERAGES,))
        except (RuntimeError, ValueError, KeyError) as e:
            raise SpecError(f"trainer.resume: the checkpoint does not fit this run's model/optimizer ({str(e).splitlines()[0]})") from None
        tensor_parallel.fit_optimizer(self.optimizer)  # the checkpoint's groups carry the kernel flags of its own mesh
        self.schedule.load_state_dict(state["schedule"])
        self.precision.load_state_dict(state["precision"])
        rng = state["rng"]
        checkpoint.set_rng_state(rng[self.env.rank] if len(rng) == self.env.world else rng[0])
        vars(self.progress).update(state["progress"])  # in place: the add-ons hold this object
        self.monitor.load_state_dict(state["monitor"], step=self.progress.step)
        self.monitor.window.load_state_dict(state.get("log_windows", []), self.env.rank, self.env.world, self.device)
        self.addons.load_state_dict(checkpoint.addon_states(state))  # after the monitor: the best weights ask for its best step
        # Extended (a larger trainer.max_steps/max_epochs): a finished run trains on and ends again.
        self.finished = bool(state.get("finished")) and (self.progress.step >= self.total_steps or self.stopping.stopped_early)
        self.final = dict(state.get("final") or {})
        self.test_from = self.best_weights.source = state.get("test_from", "")
        source_run = state.get("mlflow_run_id") or ""
        if _inside(Path(state["path"]), Path(self.spec.run_dir)):
            self.resume_run_id = source_run or None  # continuing this run directory: reattach to its run
        else:  # another run's checkpoint starts a new run, which names where it came from
            self.resumed_from = {"runner.resumed_from_checkpoint": state["path"]}
            if source_run:
                self.resumed_from["runner.resumed_from_run"] = source_run
        log.info("resuming at step %d (epoch %d, sample %d of the epoch) from %s", self.progress.step,
                 self.progress.epoch, self.progress.samples_in_epoch, state["path"])


def _unit_count(task: tasks.Task, train: torch.utils.data.Dataset) -> Callable[[torch.Tensor], int | torch.Tensor]:
    """The task's unit count of a training micro-batch; the batch's length where the split fixes it: a tensor dataset
    read as it is (no collate), whose labels are class ids on the CPU none of which is IGNORE, so that every sample
    counts one, as the task's count would find again each step (listing a batch's labels costs ~9 us of a tiny step)."""
    if type(task).count is not Classification.count or not isinstance(train, BatchedTensors) or len(train.tensors) != 2:
        return task.count
    labels = train.tensors[1]
    if labels.is_cpu and labels.dim() == 1 and not labels.is_floating_point() and not bool((labels == tasks.IGNORE).any()):
        return _length
    return task.count


def _length(labels: torch.Tensor) -> int:
    """A tensor's length: its shape's first (len() runs Tensor.__len__'s Python, .size(0) parses its argument, each
    ~1k instructions more a step)."""
    return labels.shape[0]


def _on_device(batch: tasks.Batch, device: torch.device) -> bool:
    """Whether a batch of plain tensors is on `device` already (a dataset kept there, or a CPU run)."""
    inputs, labels = batch.inputs, batch.labels
    return (isinstance(inputs, torch.Tensor) and isinstance(labels, torch.Tensor) and inputs.device == device
            and labels.device == device)


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())

def _check_loss_options(module: torch.nn.Module, task: tasks.Task, stand_in: tasks.Batch, pass_labels: bool,
                        model: str, on_meta: bool) -> None:
    """batches.check_loss_options; on a model built on the meta device, on a meta copy of the stand-in. A model
    the meta device cannot run (one reading its inputs' values) is not checked here: a loss option it cannot
    apply is still refused in one line, by its first step's loss (batches.own_loss)."""
    if not on_meta:
        batches.check_loss_options(module, task, stand_in, pass_labels, model)
        return
    try:
        batches.check_loss_options(module, task, batches.on_meta(stand_in), pass_labels, model)
    except SpecError:
        raise
    except Exception:  # noqa: BLE001 (see the docstring)
        pass

"""Bad input as a user types it: one line `error: <key>: ...`, exit code 2, no traceback, nothing made.

Every case runs the CLI's entry (`runner.__main__.cli`). Most run in this process with sys.argv set,
so a case costs a config composition rather than an interpreter start; the `SUB` cases run the real
`python -m runner` in a fresh process, as a user does. Cases the CLI must catch before Hydra starts
the run ("preflight") also show that the run never began: Hydra's job function is replaced by one
that fails the test, and no outputs/ directory appears. Every case points MLflow at one sqlite store,
made once for the module (making one costs seconds of migrations), and checks that the case added no
run to it.
"""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.runner.cli.test_cli import mlflow_runs

SUB = "subprocess"
PRE = "preflight"  # caught before Hydra starts the run
RUN = "run"        # caught once the run has started (needs torch, the device, the data or a file's content)


def case(args: str | list[str], expected: str, stage: str = PRE, *, sub: bool = False, owner: str | None = None,
         run: bool = True) -> pytest.param:
    args = args.split() if isinstance(args, str) else args
    marks = [pytest.mark.xfail(strict=False, run=run, reason=f"needs {owner}'s change")] if owner else []
    return pytest.param(args, expected, stage, sub, marks=marks, id=" ".join(args))


CASES = [
    # --- the override grammar and Hydra's own errors
    case("=3", "error: =3: not a valid override (no key before '=')", sub=True),
    case("optimizer.lr=[1", "error: optimizer.lr: 'optimizer.lr=[1' is not a valid override"),
    case("optimizer.lr", "error: optimizer.lr: 'optimizer.lr' is not a valid override"),
    case("optimizer.lr='1", "error: optimizer.lr: \"optimizer.lr='1\" is not a valid override"),
    case("optimizer.lr=${nope}", "error: optimizer.lr: cannot resolve an interpolation (Interpolation key 'nope' not found)",
         sub=True),
    case("seed=${oc.env:RUNNER_TEST_NO_SUCH_VARIABLE}", "error: seed: cannot resolve an interpolation"),
    case("hydra.run.dir=${nope}", "error: hydra.run.dir: cannot resolve it (Interpolation key 'nope' not found)"),
    case("dataset=digits,mnist", "error: dataset: 'digits,mnist' is a sweep; add -m", sub=True),
    case("optimizer.lr=0.1,0.2", "error: optimizer.lr: '0.1,0.2' is a sweep; add -m"),
    case("--no-such-flag", "error: --no-such-flag: unknown flag"),
    case("-m --cfg job", "error: --multirun: cannot be combined with --cfg; give one of --multirun (-m), --cfg,"),
    case("+seed=3", "error: seed: Could not append to config. An item is already at 'seed'."),
    case("~trainer.nope", "error: trainer.nope: Could not delete from config."),
    case("hydra.job.chdir=maybe", "error: hydra.job.chdir: Value 'maybe' is not a valid bool"),
    # --- unknown keys: the closest existing key
    # what Lightning's and HF Trainer's users type: runner's key for it, not the nearest spelling (issue 26, 4)
    case("trainer.accumulate_grad_batches=4", "error: trainer.accumulate_grad_batches: unknown key; Lightning's "
         "accumulate_grad_batches is runner's +accum=N (accumulation.steps); keys under trainer:"),
    case("trainer.gradient_clip_val=1", "error: trainer.gradient_clip_val: unknown key; Lightning's gradient_clip_val is "
         "runner's trainer.clip_grad_norm"),
    case("fast_dev_run=true", "error: fast_dev_run: unknown key; Lightning's fast_dev_run is runner's debug=fast", sub=True),
    case("trainer.precision=bf16", "error: trainer.precision: unknown key; Lightning's precision is runner's precision "
         "group: precision=bf16 (bf16-mixed)"),
    case("precision=16-mixed", "error: precision: unknown option '16-mixed'; Lightning's precision=16-mixed is runner's "
         "precision=fp16; choose one of"),
    case("parallelism=fsdp2", "error: parallelism: unknown option 'fsdp2'; Lightning's strategy=fsdp2 is runner's "
         "parallelism=fsdp; choose one of"),
    case("learning_rate=0.1", "error: learning_rate: unknown key; HF Trainer's learning_rate is runner's optimizer.lr"),
    case("optimizer.gradient_accumulation_steps=2", "error: optimizer.gradient_accumulation_steps: unknown key; HF "
         "Trainer's gradient_accumulation_steps is runner's +accum=N"),
    case("optimizer.lrr=0.1", "error: optimizer.lrr: unknown key; did you mean optimizer.lr? keys under optimizer:",
         sub=True),
    case("trainer.max_epoch=3", "error: trainer.max_epoch: unknown key; did you mean trainer.max_epochs?", sub=True),
    case("sed=1", "error: sed: unknown key; did you mean seed?", sub=True),
    case("optimiser.lr=0.1", "error: optimiser: unknown key; did you mean optimizer?"),
    case("model.hiden=[64]", "error: model.hiden: unknown key; did you mean model.hidden?"),
    case("trainer.early_stoping.monitor=val/loss", "error: trainer.early_stoping: unknown key; did you mean "
         "trainer.early_stopping?"),
    case("hydra.nope=1", "error: hydra.nope: unknown key"),
    case("accum=4", "error: accum: the shorthand is added with a plus: +accum=N"),
    case("+optimizer.lrr=0.1", "error: optimizer.lrr: unknown key for torch.optim.Adam; did you mean lr? accepted keys: "),
    case("dataset.shape=[1,8,8]", "error: dataset.shape: unknown key; did you mean dataset.split_seed? keys under dataset: _target_"),
    # a user's option from the search path: the keys of their own component
    case([f"hydra.searchpath=[file://{Path(__file__).parents[1] / 'user_pkg' / 'conf'}]", "model=wide_net",
          "model.widht=16"], "error: model.widht: unknown key; did you mean model.width? keys under model: _target_, "
         "depth, freeze, unfreeze_after_epochs, weights, width"),
    case("optimizer=sgd optimizer.betas=[0.9,0.99]", "error: optimizer.betas: unknown key; "),
    # --- config-group options
    case("precision=fp17", "error: precision: unknown option 'fp17'; did you mean fp16? choose one of bf16, bf16_true, "
         "fp16, fp32, fp8, tf32", sub=True),
    case("optimizer=adamm", "error: optimizer: unknown option 'adamm'; did you mean adam? choose one of adafactor,"),
    case("dataset=mnits", "error: dataset: unknown option 'mnits'; did you mean mnist?"),
    case("model=resnet", "error: model: unknown option 'resnet'; did you mean resnet18?"),
    case("scheduler=cosin", "error: scheduler: unknown option 'cosin'; did you mean cosine?"),
    case("parallelism=dp", "error: parallelism: unknown option 'dp'"),
    case("tracking=wandb", "error: tracking: unknown option 'wandb'; choose one of mlflow, none"),
    case("hparams_search=nope", "error: hparams_search: unknown option 'nope'; choose one of digits_optuna"),
    case("hydra/launcher=nope", "error: hydra/launcher: unknown option 'nope'; choose one of basic"),
    case("-m optimizer=sgd,adamx", "error: optimizer: unknown option 'adamx'; did you mean adam"),
    case("precision.name=fp17", "error: precision.name: unknown option 'fp17'"),
    case("optimizer._target_=torch.optim.Adamm", "error: optimizer._target_: cannot import 'torch.optim.Adamm'"),
    # --- values: types, ranges, finiteness
    case("optimizer.lr=abc", "error: optimizer.lr: 'abc' is not a number; allowed: a value > 0", sub=True),
    case("optimizer.lr=-1", "error: optimizer.lr: -1.0 is out of range; allowed: a value > 0", sub=True),
    case("optimizer.lr=0", "error: optimizer.lr: 0.0 is out of range; allowed: a value > 0"),
    case("optimizer.lr=inf", "error: optimizer.lr: inf is not a finite number; allowed: a value > 0", sub=True),
    case("optimizer.lr=1e400", "error: optimizer.lr: inf is not a finite number"),
    case("optimizer.lr=-inf", "error: optimizer.lr: -inf is not a finite number"),
    case("optimizer.lr=nan", "error: optimizer.lr: nan is not a number"),
    # a denormal is above 0 yet trains as 0 does: a positive real is at least float32's smallest normal number
    case("optimizer.lr=1e-320", "error: optimizer.lr: 1e-320 is too small to act; allowed: a value >= 1.17549e-38 "
         "(float32's smallest normal number"),
    case("optimizer.eps=1e-39", "error: optimizer.eps: 1e-39 is too small to act; allowed: a value >= 1.17549e-38"),
    case(["optimizer.lr=1" + "0" * 400], "error: optimizer.lr: 100000000000... (401 digits) is too large"),
    case("optimizer.weight_decay=inf", "error: optimizer.weight_decay: inf is not a finite number"),
    case("optimizer.weight_decay=-0.1", "error: optimizer.weight_decay: -0.1 is out of range; allowed: a value >= 0"),
    case("optimizer.eps=1e400", "error: optimizer.eps: inf is not a finite number"),
    case("optimizer=sgd optimizer.momentum=1", "error: optimizer.momentum: 1.0 is out of range; allowed: a value >= 0 and < 1"),
    case("optimizer.betas=[0.9]", "error: optimizer.betas: [0.9] is not allowed; give a list of 2 numbers"),
    case("optimizer.betas=[0.9,1.5]", "error: optimizer.betas[1]: 1.5 is out of range"),
    case("optimizer.betas=[0.9,inf]", "error: optimizer.betas[1]: inf is not a finite number"),
    case("optimizer.betas=0.9", "error: optimizer.betas: 0.9 is not a list"),
    case("optimizer.impl=fast", "error: optimizer.impl: 'fast' is not allowed; choose one of auto, fused, foreach, for_loop"),
    case("trainer.clip_grad_norm=inf", "error: trainer.clip_grad_norm: inf is not a finite number"),
    case("trainer.clip_grad_norm=0", "error: trainer.clip_grad_norm: 0.0 is out of range; allowed: a value > 0"),
    case("trainer.clip_grad_value=1e400", "error: trainer.clip_grad_value: inf is not a finite number"),
    case("trainer.clip_grad_norm=1 trainer.clip_grad_value=1", "error: trainer.clip_grad_value: set either clip_grad_norm "
         "or clip_grad_value, not both"),
    case("dataset.batch_size=0", "error: dataset.batch_size: 0 is out of range; allowed: a value > 0"),
    case("dataset.batch_size=100000000", "error: dataset.batch_size: 100000000 is out of range; allowed: a value > 0 and "
         "<= 1048576", sub=True),
    case("dataset.batch_size=1.5", "error: dataset.batch_size: 1.5 is not an integer"),
    case("dataset.batch_size=abc", "error: dataset.batch_size: 'abc' is not an integer"),
    case("dataset.val_fraction=1", "error: dataset.val_fraction: val_fraction + test_fraction must be < 1"),
    case("dataset.val_fraction=0.6 dataset.test_fraction=0.5", "error: dataset.val_fraction: val_fraction + test_fraction "
         "must be < 1"),
    case("dataset.num_workers=-1", "error: dataset.num_workers: -1 is out of range; allowed: a value >= 0"),
    case("dataset=synthetic dataset.shape=[3,0,32]", "error: dataset.shape: [3, 0, 32] is not allowed; every size must be > 0", RUN),
    case("dataset=synthetic dataset.num_classes=1", "error: dataset.num_classes: 1 is out of range; allowed: a value > 1", RUN),
    case("dataset=synthetic dataset.size=1e400", "error: dataset.size: inf is not an integer"),
    # bench: random token blocks (dataset=synthetic_tokens) and trainer.channels_last
    case("dataset=synthetic_tokens model=gpt task=language_modeling dataset.vocab_size=1",
         "error: dataset.vocab_size: 1 is out of range; allowed: an integer >= 2", RUN),
    case("dataset=synthetic_tokens model=gpt task=language_modeling dataset.val_fraction=0.6 dataset.test_fraction=0.5",
         "error: dataset.val_fraction: val_fraction + test_fraction must be < 1"),
    case("trainer.channels_last=sometimes", "error: trainer.channels_last: 'sometimes' is not a boolean; use true or false"),
    # in this process: a refusal at the run stage from a real process is the tf32 case's (a run) and n_trials' (a sweep)
    case("model.hidden=[0,128]", "error: model.hidden: [0, 128] is not allowed; every width must be > 0", RUN),
    case("model.hidden=[-5]", "error: model.hidden: [-5] is not allowed", RUN),
    case("model.hidden=[99999999999]", "error: model.hidden: building MLP with model.hidden=[99999999999] failed (", RUN),
    case("model.hidden=128", "error: model.hidden: 128 is not a list"),
    case("model=cnn model.channels=[32,0]", "error: model.channels: [32, 0] is not allowed", RUN),
    case("model.dropout=1", "error: model.dropout: 1.0 is out of range; allowed: 0 <= dropout < 1", RUN),
    case("+accum=0", "error: accumulation.steps: 0 is out of range; allowed: a value > 0", sub=True),
    case("+accum=4 accumulation.steps=2", "error: accum: +accum=4 conflicts with accumulation.steps=2; set only one",
         sub=True),
    case("accumulation.steps=-1", "error: accumulation.steps: -1 is out of range"),
    case("trainer.max_epochs=0", "error: trainer.max_epochs: 0 is out of range; allowed: a value > 0"),
    case("trainer.max_epochs=1e400", "error: trainer.max_epochs: inf is not an integer"),
    case("trainer.max_steps=1.5", "error: trainer.max_steps: 1.5 is not an integer"),
    case("trainer.device=tpu", "error: trainer.device: 'tpu' is not allowed; choose one of auto, cpu, cuda"),
    case("trainer.progress_bar=maybe", "error: trainer.progress_bar: 'maybe' is not allowed; choose one of auto, on, off"),
    case("trainer.max_non_finite_steps=0", "error: trainer.max_non_finite_steps: 0 is out of range; allowed: a value > 0"),
    case("scheduler=warmup_cosine scheduler.warmup=-1", "error: scheduler.warmup: -1.0 is out of range"),
    case("scheduler=step scheduler.gamma=inf", "error: scheduler.gamma: inf is not a finite number"),
    case("scheduler=onecycle scheduler.pct_start=1", "error: scheduler.pct_start: 1.0 is out of range", RUN),
    case("scheduler=multistep scheduler.milestones=[0.5,-1]", "error: scheduler.milestones: -1 is out of range", RUN),
    case("precision=fp16 precision.init_scale=inf", "error: precision.init_scale: inf is not a finite number"),
    case("seed=-1", "error: seed: -1 is out of range; allowed: a value >= 0"),
    case("seed=abc", "error: seed: 'abc' is not an integer"),
    case("tracking.experiment=[a]", "error: tracking.experiment: ['a'] is not a string"),
    # --- parallelism
    case("parallelism.nnodes=2", "error: parallelism.nnodes: 2 needs several processes but parallelism=single runs one; "
         "add parallelism=ddp or parallelism=fsdp", sub=True),
    case("parallelism.nproc_per_node=4", "error: parallelism.nproc_per_node: 4 needs several processes"),
    case("parallelism=ddp parallelism.node_rank=3", "error: parallelism.nnodes: 1, but parallelism.node_rank=3 names "
         "machine 3 of several; set parallelism.nnodes to the number of machines (at least 4)"),
    case("parallelism=ddp parallelism.nnodes=2 parallelism.node_rank=3", "error: parallelism.node_rank: 3 is out of "
         "range; allowed: 0 to nnodes-1 (1)"),
    case("parallelism=ddp parallelism.rdzv_endpoint=nohost", "error: parallelism.rdzv_endpoint: 'nohost' is not host:port"),
    case("parallelism=ddp parallelism.rdzv_timeout=inf", "error: parallelism.rdzv_timeout: inf is not a finite number"),
    # --- metric names: what the run evaluates, and when
    case("trainer.early_stopping.monitor=val/los", "error: trainer.early_stopping.monitor: 'val/los' is not a metric this "
         "run evaluates; did you mean val/loss? choose one of val/acc, val/loss", sub=True),
    case("trainer.early_stopping.monitor=test/acc", "error: trainer.early_stopping.monitor: 'test/acc' is evaluated only "
         "at the end of the run; choose one of val/acc, val/loss"),
    case("trainer.early_stopping.monitor=train/loss", "error: trainer.early_stopping.monitor: 'train/loss' is not a metric "
         "this run evaluates"),
    case("objective.metric=val/accuracy", "error: objective.metric: 'val/accuracy' is not a metric this run evaluates; "
         "did you mean val/acc?", sub=True),
    case("objective.metric=acc", "error: objective.metric: 'acc' is not a metric this run evaluates"),
    case("dataset.val_fraction=0", "error: objective.metric: 'val/acc' is never evaluated in this run: "
         "dataset.val_fraction=0 leaves no validation split"),
    case("dataset.val_fraction=0 objective.metric=test/acc trainer.early_stopping.monitor=val/loss",
         "error: trainer.early_stopping.monitor: 'val/loss' is never evaluated in this run: dataset.val_fraction=0"),
    case("dataset.test_fraction=0 objective.metric=test/acc", "error: objective.metric: 'test/acc' is never evaluated in "
         "this run: dataset.test_fraction=0 leaves no test split"),
    case("trainer.eval_every_epoch=false trainer.early_stopping.monitor=val/loss", "error: "
         "trainer.early_stopping.monitor: 'val/loss' is never evaluated in this run: trainer.eval_every_epoch=false and "
         "trainer.eval_every_n_steps=0 never evaluate"),
    case("trainer.eval_every_epoch=false scheduler=plateau", "error: scheduler.monitor: 'val/loss' is never evaluated "
         "in this run"),
    case("scheduler=plateau scheduler.monitor=val/los", "error: scheduler.monitor: 'val/los' is not a metric this run "
         "evaluates; did you mean val/loss?"),
    case("scheduler=plateau scheduler.monitor=test/loss", "error: scheduler.monitor: 'test/loss' is evaluated only at "
         "the end of the run"),
    # --- a multirun: every value of an enumerable sweep is checked before the first job starts
    case("-m optimizer.lr=0.1,-1", "error: optimizer.lr: -1.0 is out of range", sub=True),
    case("-m trainer.early_stopping.monitor=val/loss,val/los", "error: trainer.early_stopping.monitor: 'val/los' is not"),
    case("-m optimizer=sgd,adam optimizer.lrr=1", "error: optimizer.lrr: unknown key; did you mean optimizer.lr?"),
    # --- the run directory
    case("hydra.run.dir=/proc/runner-test/run", "error: hydra.run.dir: cannot write the run directory "
         "/proc/runner-test/run (directories cannot be created there)", sub=True),
    case("hydra.run.dir={file}/run", "error: hydra.run.dir: cannot write the run directory {file}/run ({file} is a "
         "file, not a directory)", sub=True),
    case("hydra.run.dir={readonly}/run", "error: hydra.run.dir: cannot write the run directory {readonly}/run ("),
    case("hydra.run.dir={full}/run", "error: hydra.run.dir: cannot write the run directory {full}/run (disk full)"),
    case("-m hydra.sweep.dir=/proc/runner-test optimizer.lr=0.1,0.01", "error: hydra.sweep.dir: cannot write the run "
         "directory /proc/runner-test"),
    # --- what a run names outside itself
    case("trainer.resume=/nowhere/last.pt", "error: trainer.resume: '/nowhere/last.pt' does not exist"),
    case("trainer.resume={tmp}", "error: trainer.resume: no checkpoint in {tmp}"),
    case("precision=tf32 trainer.device=cpu", "error: precision: tf32 needs an NVIDIA GPU", RUN, sub=True),
    case("precision=fp8 trainer.device=cpu", "error: precision: fp8 needs an NVIDIA GPU", RUN),
    case("optimizer=sgd optimizer.momentum=0 optimizer.nesterov=true", "error: optimizer.nesterov: SGD refuses it "
         "(Nesterov momentum requires a momentum", RUN),
    case("scheduler=warmup_cosine scheduler.warmup=100000", "error: scheduler.warmup: 100000", RUN),
    case("dataset=mnist dataset.root={tmp}/datasets", "error: dataset.root: mnist not found in", RUN),
    case("trainer.resume={foreign_ckpt}", "error: trainer.resume: ", RUN),
    case("trainer.resume={empty_ckpt}", "error: trainer.resume: ", RUN),
    case("trainer.resume={garbage_ckpt}", "error: trainer.resume: ", RUN),
    case("trainer.resume={truncated_ckpt}", "error: trainer.resume: ", RUN),
    case("trainer.resume={evil_ckpt}", "error: trainer.resume: ", RUN),
    case("dataset.batch_size=5000 trainer.max_steps=2", "error: dataset.batch_size: 5000", RUN),
    case("tracking.uri=nope://store", "error: tracking.uri: ", RUN),
    case("tracking.uri=sqlite:////proc/runner-test/mlflow.db", "error: tracking.uri: ", RUN),
    case("tracking.uri=sqlite:///{readonly}/mlflow.db", "error: tracking.uri: ", RUN),
    case("tracking.uri=http://127.0.0.1:1", "error: tracking.uri: ", RUN),
    # a store in a folder that does not exist (issue 26, 1.5): made silently before, as only outputs/ may be
    case("tracking.uri=sqlite:///{tmp}/no/such/dir/mlflow.db", "error: tracking.uri: the folder {tmp}/no/such/dir does "
         "not exist; create it (mkdir -p {tmp}/no/such/dir)", RUN),
    # --- cli (issue 13): options of every group from the user's search path, and their unknown names
    case([f"hydra.searchpath=[file://{Path(__file__).parents[1] / 'user_pkg' / 'conf'}]", "optimizer=my_sdg"],
         "error: optimizer: unknown option 'my_sdg'; did you mean my_sgd? choose one of adafactor, adagrad, adam, adamw, "
         "lamb, lion, muon, my_sgd, "),
    case([f"hydra.searchpath=[file://{Path(__file__).parents[1] / 'user_pkg' / 'conf'}]", "experiment=my_prest"],
         "error: experiment: unknown option 'my_prest'; did you mean my_preset?"),
    # --- cli (issue 13): a component nested in a user's model arguments has its keys checked
    case(["model._target_=tests.user_pkg.blocks.ActNet", "+model.activation={_target_: torch.nn.LeakyReLU, negative_slop: 0.2}"],
         "error: model.activation.negative_slop: unknown key for torch.nn.LeakyReLU; did you mean negative_slope? "
         "accepted keys: inplace, negative_slope"),
    case(["model._target_=tests.user_pkg.blocks.Tower", "model.hidden=[8]"], "error: model.hidden: [8] is not an integer"),
    # --- issue 13 (helper `data`): built-ins complain as a user's code does; mistakes refused in one line
    # the key the user typed is the one named (issue 26, section 2): they changed the dataset, not the model
    case("dataset=imdb", "error: dataset: dataset runner.data.text.imdb gives token ids, but model "
         "runner.models.mlp.MLP reads tensors (it takes input_shape); choose a dataset of tensors or another model"),
    case("model._target_=logging.DEBUG", "error: model._target_: 'logging.DEBUG' is not a class or function (it is "
         "int 10); give a dotted path to a class or function importable from here", RUN),
    case("dataset._target_=math.pi", "error: dataset._target_: 'math.pi' is not a class or function (it is float "
         "3.141592653589793)", RUN),
    case("model=gpt", "error: model: runner.models.gpt.GPT reads token ids (it takes vocab_size), but dataset "
         "runner.data.digits.build gives tensors; choose a model for tensors or another dataset", RUN),
    case("task=regression", "error: task: regression learns from real values, but dataset runner.data.digits.build "
         "labels its samples with class ids; use task=classification", RUN),
    case("experiment=cifar10_resnet task=language_modeling dataset.root={cifar}", "error: task: language_modeling "
         "learns from token ids per position, but dataset runner.data.cifar.build labels its samples with class ids; "
         "use task=classification", RUN),
    case("dataset=cifar10 dataset.root={corrupt_cifar}", "error: dataset.root: {corrupt_cifar}/cifar-10-batches-py/"
         "data_batch_2 is not a CIFAR-10 python batch (UnpicklingError: ", RUN),
    case("model.weights={other_weights}", "error: model.weights: {other_weights} fills 0% of this model's values (0 "
         "of 50826; 0 tensors fit, 4 have another shape, 2 are not in the file); at least 50% must load: these look "
         "like the weights of another architecture", RUN),
    case("model=hf model.path={pretrained} dataset=text_classification dataset.train_file={reviews} "
         "dataset.max_length=32 dataset.tokenizer=null", "error: dataset.tokenizer: the data's token ids are not "
         "those of the pretrained model at {pretrained} (the data's tokenizer has ", RUN),
    # the key the user typed, not the one their value reached (issue 26, section 2): a size, a model's folder, a
    # data folder, the data's length against a pretrained model's
    case("dataset=fashion_mnist dataset.root={tmp}/datasets", "error: dataset.root: fashion_mnist not found in {tmp}/"
         "datasets/FashionMNIST/raw (idx ubyte files); set download=true to fetch it, or root=<the folder holding "
         "FashionMNIST/raw>", RUN),
    case("model=hf model.path={tmp}/nowhere dataset=text_classification dataset.train_file={reviews}", "error: "
         "model.path: '{tmp}/nowhere' does not exist; allowed: a local directory written by save_pretrained (the model "
         "and its tokenizer; nothing is downloaded)", RUN),
    case("model=hf model.path={file} dataset=text_classification dataset.train_file={reviews}", "error: model.path: "
         "'{file}' is a file, not a directory; allowed: a local directory written by save_pretrained", RUN),
    case("model=hf model.path={tmp} dataset=text_classification dataset.train_file={reviews}", "error: model.path: "
         "{tmp} holds no tokenizer (no tokenizer.json or vocabulary files); save the model's tokenizer there with "
         "tokenizer.save_pretrained, or give a tokenizer.json (the data reads the model's tokenizer from model.path)", RUN),
    case("model=hf model.path={pretrained} dataset=text_classification dataset.train_file={reviews} "
         "dataset.max_length=100000", "error: dataset.max_length: the data's sequences of 100000 tokens are longer than "
         "the 64 positions of the pretrained model at {pretrained}; allowed: at most 64", RUN),
    # a key of a mapping left empty (the HF config's settings): "did you mean model.config? keys under model.config: "
    case("model=hf model.config.dim=64", "error: model.config.dim: model.config holds no keys yet, so a new one is "
         "added with a plus: +model.config.dim=<value>"),
    # a schedule class that fails its first steps or gives a negative lr: a traceback after step 1, or training at -lr
    case("scheduler._target_=torch.optim.lr_scheduler.StepLR +scheduler.step_size=0", "error: scheduler.step_size: "
         "StepLR fails at its step 1 (ZeroDivisionError: integer modulo by zero); allowed: settings StepLR can step "
         "with", RUN),
    case("scheduler._target_=torch.optim.lr_scheduler.ExponentialLR +scheduler.gamma=-1", "error: scheduler.gamma: "
         "ExponentialLR gives the learning rate -0.001 at step 1; allowed: settings whose learning rate stays finite "
         "and >= 0", RUN),
    # an architecture made for 224x224 images on 8x8 digits: torch's traceback at the first step before
    case("model=timm model.name=vit_tiny_patch16_224", "error: model.name: 'vit_tiny_patch16_224' cannot read this "
         "data's 1x8x8 images (AssertionError: ", RUN),
    # --- the PBT sweeper's inputs (helper pbt): refused before any member or the MLflow parent run exists
    case("-m hparams_search=digits_pbt scheduler.warmup=interval(0,10)", "error: scheduler.warmup: interval(0,10): "
         "population-based training changes only hyperparameters that may change in the middle of a run; allowed: "
         "optimizer.lr, optimizer.lr_multipliers.*, optimizer.weight_decay,", RUN),
    # an interval the key's check refuses at one end: the interval named, not a member's sampled value
    case("-m hparams_search=digits_pbt optimizer.lr=interval(-1,0.1)", "error: optimizer.lr: interval(-1,0.1): its low "
         "-1.0 is out of range; allowed: a value > 0", RUN),
    case("-m hparams_search=digits_pbt optimizer.momentum=interval(0.5,1.5)", "error: optimizer.momentum: "
         "interval(0.5,1.5): its high 1.5 is out of range; allowed: a value >= 0 and < 1", RUN),
    case("-m hparams_search=digits_pbt hydra.sweeper.quantile=0.9", "error: hydra.sweeper.quantile: 0.9; allowed: "
         "above 0 and at most 0.5", RUN),
    case("-m hparams_search=digits_pbt hydra.sweeper.pb2_kappa=-1", "error: hydra.sweeper.pb2_kappa: -1.0; allowed: 0 or "
         "more", RUN),
    case("-m hparams_search=digits_pbt hydra.sweeper.perturb=[0.8,-1.2]", "error: hydra.sweeper.perturb: [0.8, -1.2]; "
         "allowed: a list of positive factors", RUN),
    case("-m hparams_search=digits_pbt hydra.sweeper.resample_probability=2", "error: "
         "hydra.sweeper.resample_probability: 2.0; allowed: a probability from 0 to 1", RUN),
    # --- the Optuna sweeper's inputs (helper sweep): refused before the study or its MLflow parent run exists
    case("-m hparams_search=digits_optuna optimizer.lr=interval(0.1,0.001)", "error: optimizer.lr: interval(0.1,0.001): "
         "its low 0.1 is above its high 0.001; allowed: interval(low, high) with low <= high", RUN),
    case("-m hparams_search=digits_optuna optimizer.lr=tag(log,interval(-1,0.1))", "error: optimizer.lr: "
         "tag(log,interval(-1,0.1)): a log scale needs low > 0, got -1.0", RUN),
    case("-m hparams_search=digits_optuna optimizer.lr=tag(logg,interval(0.001,0.1))", "error: optimizer.lr: "
         "tag(logg,interval(0.001,0.1)): unknown tag 'logg'; allowed: log", RUN),
    case("-m hparams_search=digits_optuna trainer.max_epochs=range(5,1)", "error: trainer.max_epochs: range(5,1) has "
         "no values; allowed: range(start, stop) with start < stop", sub=True),
    case("-m hparams_search=digits_optuna hydra.sweeper.heartbeat_interval=0", "error: "
         "hydra.sweeper.heartbeat_interval: 0 is out of range; allowed: an integer >= 1 (seconds), or null: off", RUN),
    case(["-m", "hparams_search=digits_optuna", "hydra.sweeper.study_name=''"], "error: hydra.sweeper.study_name: '' "
         "is not a name; allowed: a non-empty name", RUN),
    case("-m hparams_search=digits_optuna hydra/sweeper/pruner=median hydra.sweeper.pruner.n_warmup_steps=-1",
         "error: hydra.sweeper.pruner: MedianPruner: Number of warmup steps cannot be negative, but got "
         "n_warmup_steps=-1.", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.pruner._target_=nope", "error: hydra.sweeper.pruner._target_: "
         "'nope' cannot be imported; allowed: a pruner class such as optuna.pruners.MedianPruner", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.direction=up", "error: hydra.sweeper.direction: 'up' is not a "
         "direction; allowed: minimize, maximize", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.custom_search_space=no_such_module.space",
         "error: hydra.sweeper.custom_search_space: cannot import 'no_such_module.space' (No module named "
         "'no_such_module'); allowed: the dotpath of a function", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.storage=sqlite:///{tmp}/no/such/dir/optuna.db",
         "error: hydra.sweeper.storage: sqlite:///{tmp}/no/such/dir/optuna.db: the directory {tmp}/no/such/dir does not "
         "exist", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.storage=nosql://host/db", "error: hydra.sweeper.storage: "
         "'nosql://host/db' has an unknown scheme 'nosql://'", RUN),
    # an Optuna journal on a read-only or full disk (issue 26, section 2): Optuna's traceback before
    case("-m hparams_search=digits_optuna hydra.sweeper.storage={readonly}/journal.log", "error: hydra.sweeper.storage: "
         "cannot write the journal file {readonly}/journal.log (", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.storage={full}/journal.log", "error: hydra.sweeper.storage: "
         "cannot write the journal file {full}/journal.log (No space left on device); free space, or name a journal "
         "file on a writable disk with hydra.sweeper.storage=<file>", RUN),
    # a read-only sweep directory, for either sweeper
    case("-m hparams_search=digits_optuna hydra.sweep.dir={readonly}/sweep", "error: hydra.sweep.dir: cannot write "
         "the run directory {readonly}/sweep ("),
    case("-m hparams_search=digits_pbt hydra.sweep.dir={readonly}/sweep", "error: hydra.sweep.dir: cannot write "
         "the run directory {readonly}/sweep ("),
    case("-m hparams_search=digits_optuna hydra.sweeper.n_jobs=0", "error: hydra.sweeper.n_jobs: 0 is out of range; "
         "allowed: an integer >= 1, or -1", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.max_failure_rate=2", "error: hydra.sweeper.max_failure_rate: "
         "2.0 is out of range; allowed: a share of n_trials from 0.0", RUN),
    case("-m hparams_search=digits_optuna hydra.sweeper.n_trials=-1", "error: hydra.sweeper.n_trials: -1 is out of "
         "range; allowed: an integer >= 1", RUN, sub=True),
    # --- tasks (issue 13, part `task`): a task option that would do nothing is refused
    case([f"hydra.searchpath=[file://{Path(__file__).parents[1] / 'user_pkg' / 'conf'}]", "dataset=shares",
          "model._target_=tests.user_pkg.shares.OwnLossNet", "task.label_smoothing=0.1"],
         "error: task.label_smoothing: 0.1 cannot apply: tests.user_pkg.shares.OwnLossNet returns its own loss and no "
         "logits, so the task does not compute the loss; remove task.label_smoothing, or return logits from the model", RUN),
    case("task=regression task.label_smoothing=0.1",
         "error: task.label_smoothing: unknown key; keys under task: _target_"),
    # --- tasks, optimizers and schedules named by _target_ (a user's from tests/user_pkg): keys against the callable
    case("optimizer._target_=tests.user_pkg.training.Lion optimizer.eps=1e-8", "error: optimizer.eps: unknown key for "
         "tests.user_pkg.training.Lion; accepted keys: betas, lr, weight_decay"),
    case("optimizer._target_=tests.user_pkg.training.Lion optimizer.betas=[0.9,1.5]", "error: optimizer.betas[1]: 1.5 is "
         "out of range; allowed: a value >= 0 and < 1"),
    case("+optimizer.fused=true", "error: optimizer.fused: decided by optimizer.impl for torch.optim.Adam; remove it"),
    case("optimizer._target_=torch.optim.NAdam +optimizer.momentum_decay=-1", "error: optimizer.momentum_decay: NAdam "
         "refuses it (Invalid momentum_decay value: -1", RUN),
    case("scheduler._target_=tests.user_pkg.training.halving +scheduler.evry=3", "error: scheduler.evry: unknown key for "
         "tests.user_pkg.training.halving; did you mean every? accepted keys: every"),
    case("scheduler._target_=tests.user_pkg.training.halving +scheduler.every=0", "error: scheduler.every: 0 is not "
         "allowed; give a number of optimizer steps >= 1", RUN),
    case("scheduler=cosine scheduler.min_lr_ratio=2", "error: scheduler.min_lr_ratio: 2.0 is out of range; allowed: a "
         "value >= 0 and <= 1", RUN),
    case("scheduler=plateau scheduler.monitor=null", "error: scheduler.monitor: ReduceLROnPlateau steps on an evaluation "
         "metric; set scheduler.monitor=val/loss", RUN),
    case("task._target_=tests.user_pkg.training.FocalLoss +task.gama=2", "error: task.gama: unknown key for "
         "tests.user_pkg.training.FocalLoss; did you mean gamma? accepted keys: gamma"),
    case("task._target_=tests.user_pkg.training.FocalLoss +task.gamma=-1", "error: task.gamma: -1.0 is not allowed; "
         "give a number >= 0", RUN),
    # --- issue 14, runner-side inputs (helper records): components that break their contract, the run directory
    # a user's own engine add-on (trainer.callbacks): checked against its class like any component
    case(["trainer.callbacks=[{_target_: tests.user_pkg.callbacks.StepCounter, scael: 2}]"],
         "error: trainer.callbacks[0].scael: unknown key for tests.user_pkg.callbacks.StepCounter; did you mean scale?"),
    case(["trainer.callbacks=[{_target_: tests.user_pkg.callbacks.NotAnAddOn}]"],
         "error: trainer.callbacks[0]._target_: tests.user_pkg.callbacks.NotAnAddOn is not an engine add-on"),
    case("model._target_=5", "error: model._target_: 5 is not a dotted path to a callable"),
    case("model._target_=builtins.dict", "error: model._target_: builtins.dict returned a dict, not a torch.nn.Module",
         RUN),
    case("model._target_=torch.nn.ReLU", "error: model._target_: torch.nn.ReLU has no parameters: there is nothing to "
         "train", RUN),
    case("model.freeze=[*]", "error: model.freeze: ['*'] freezes every parameter of runner.models.mlp.MLP: nothing is "
         "left to train", RUN),
    case("model.unfreeze_after_epochs=1", "error: model.unfreeze_after_epochs: 1 needs model.freeze (the parameters to "
         "unfreeze)"),
    case("model.weights={nan_weights}", "error: model.weights: {nan_weights} holds NaN or inf (in ", RUN),
    case("dataset._target_=tests.user_pkg.broken.splits_as_list", "error: dataset._target_: "
         "tests.user_pkg.broken.splits_as_list returned a list, not DataSplits", RUN),
    case("dataset._target_=tests.user_pkg.broken.failing_builder", "error: dataset._target_: "
         "tests.user_pkg.broken.failing_builder raised KeyError ('labels')", RUN),
    case("dataset=text_lm model=gpt task=language_modeling dataset.files=[{garbage_ckpt}]", "error: dataset.files: "
         "'{garbage_ckpt}' is not a text file (it holds binary data)", RUN),
    case("dataset=text_lm model=gpt task=language_modeling dataset.files=[{file}] dataset.root={readonly}",
         "error: dataset.root: cannot write the token cache under {readonly}/.cache (read-only file system)", RUN),
    case("trainer.resume={readonly_run}", "error: trainer.resume: cannot write the run directory {readonly_run} "
         "(read-only file system)", RUN),
    case("dataset=text_lm model=gpt task=classification dataset.files=[{file}] dataset.block_size=2",
         "error: task: classification learns from class ids", RUN),
    case("task=language_modeling dataset=digits model=mlp", "error: task: language_modeling learns from token ids per "
         "position", RUN),
    # --- more keys of the parts named by _target_, the trainer and the objective: one line before the run starts
    case("scheduler._target_=nope", "error: scheduler._target_: 'nope' is not a dotted path to a callable"),
    case("task._target_=runner.tasks.Nope", "error: task._target_: cannot import 'runner.tasks.Nope' (AttributeError: "
         "module 'runner.tasks' has no attribute 'Nope')"),
    case("optimizer._target_=torch.optim.NoSuch", "error: optimizer._target_: cannot import 'torch.optim.NoSuch'"),
    case("task._target_=builtins.len", "error: task._target_: builtins.len is not a task class; name a subclass of "
         "runner.tasks.Task"),
    case("scheduler=sgdr scheduler.cycle_mult=1.5", "error: scheduler.cycle_mult: 1.5 is not an integer"),
    case(["optimizer.lr_multipliers={a.*: -1}"], "error: optimizer.lr_multipliers.a.*: -1.0 is out of range; allowed: "
         "a value >= 0"),
    case("optimizer.lr_multipliers=3", "error: optimizer.lr_multipliers: 3 is not a mapping; expected one like "
         "{'backbone.*': 0.1}"),
    case("optimizer=sgd optimizer.nesterov=maybe", "error: optimizer.nesterov: 'maybe' is not a boolean; use true or false"),
    case("optimizer=adamw optimizer.betas=[0.9,0.999,0.5]", "error: optimizer.betas: [0.9, 0.999, 0.5] is not allowed; "
         "give a list of 2 numbers"),
    case("trainer.early_stopping.mode=up", "error: trainer.early_stopping.mode: 'up' is not allowed; choose one of min, max"),
    case("trainer.early_stopping.patience=0", "error: trainer.early_stopping.patience: 0 is out of range; allowed: a "
         "value > 0"),
    case("trainer.early_stopping.min_delta=-1", "error: trainer.early_stopping.min_delta: -1.0 is out of range; allowed: "
         "a value >= 0"),
    case("trainer.log_every_n_steps=0", "error: trainer.log_every_n_steps: 0 is out of range; allowed: a value > 0"),
    case("trainer.checkpoint_every_n_steps=-1", "error: trainer.checkpoint_every_n_steps: -1 is out of range; allowed: "
         "a value >= 0"),
    case("trainer.keep_checkpoints=0", "error: trainer.keep_checkpoints: 0 is out of range; allowed: a value > 0"),
    # --- weight averaging (helper averaging: runner/addons/averaging.py)
    case("trainer.ema.decay=1.5", "error: trainer.ema.decay: 1.5 is out of range; allowed: a value > 0 and < 1"),
    case("trainer.ema.decay=0", "error: trainer.ema.decay: 0.0 is out of range; allowed: a value > 0 and < 1"),
    case("trainer.ema.warmup=true", "error: trainer.ema.warmup: true needs trainer.ema.decay (the EMA it warms up)"),
    case("trainer.swa.lr=0.05", "error: trainer.swa.lr: 0.05 needs trainer.swa.start_epoch (the epoch SWA starts)"),
    case("trainer.max_epochs=3 trainer.swa.start_epoch=3", "error: trainer.swa.start_epoch: 3 is never reached "
         "(trainer.max_epochs=3 ends with epoch 2); allowed: 0 to 2"),
    case("trainer.max_steps=30 trainer.swa.start_epoch=1", "error: trainer.swa.start_epoch: 1 is never reached: the run "
         "trains 30 steps, 1 complete epoch(s) of 20 steps; allowed: 0 to 0", RUN),
    case("objective.metric=val/ema/acc", "error: objective.metric: 'val/ema/acc' is a metric of the EMA weights, which "
         "this run does not keep; set trainer.ema.decay (e.g. 0.999), or watch val/acc"),
    case("trainer.early_stopping.monitor=val/swa/loss", "error: trainer.early_stopping.monitor: 'val/swa/loss' is a "
         "metric of the SWA weights, which this run does not keep; set trainer.swa.start_epoch"),
    case("trainer.eval_every_n_steps=-1", "error: trainer.eval_every_n_steps: -1 is out of range; allowed: a value >= 0"),
    case("trainer.max_steps=0", "error: trainer.max_steps: 0 is out of range; allowed: a value > 0"),
    case("trainer.deterministic=maybe", "error: trainer.deterministic: 'maybe' is not a boolean; use true or false"),
    case("objective.direction=up", "error: objective.direction: 'up' is not allowed; choose one of maximize, minimize"),
    case("parallelism=fsdp parallelism.max_restarts=-1", "error: parallelism.max_restarts: -1 is out of range; allowed: "
         "a value >= 0"),
    case("tracking.run_name=[a]", "error: tracking.run_name: ['a'] is not a string"),
    case("model.unfreeze_after_epochs=-1", "error: model.unfreeze_after_epochs: -1 is out of range; allowed: a value >= 0"),
    case("model.freeze=5", "error: model.freeze: 5 is not a list"),
    case("precision=fp16 precision.init_scale=0", "error: precision.init_scale: 0.0 is out of range; allowed: a value > 0"),
    case("dataset.num_workers=abc", "error: dataset.num_workers: 'abc' is not an integer; allowed: a value >= 0"),
    # --- the profiler (trainer.profile, runner/addons/profiling.py)
    case("trainer.profile=true trainer.profile_steps=0", "error: trainer.profile_steps: 0 is out of range; allowed: a value > 0"),
    case("trainer.profile_skip_steps=-1", "error: trainer.profile_skip_steps: -1 is out of range; allowed: a value >= 0"),
    case("trainer.profile=sometimes", "error: trainer.profile: 'sometimes' is not a boolean; use true or false"),
    # --- compile modes and MFU (helper "speed", issue 15)
    case("trainer.compile=maybe", "error: trainer.compile: 'maybe' is not allowed; choose one of false, true, default, "
                                  "reduce-overhead, max-autotune"),
    case("trainer.compile=1", "error: trainer.compile: 1 is not allowed; choose one of false, true, default, "
                              "reduce-overhead, max-autotune"),
    case("trainer.peak_tflops=0", "error: trainer.peak_tflops: 0.0 is out of range; allowed: a value > 0"),
    case("trainer.peak_tflops=fast", "error: trainer.peak_tflops: 'fast' is not a number; allowed: a value > 0"),
    # --- issue 15, the finders (helper finders): tune=lr_find, tune=batch_size
    case("tune=lr_fnd", "error: tune: unknown option 'lr_fnd'; did you mean lr_find? choose one of batch_size, lr_find"),
    case("tune.min_lr=1e-5", "error: tune: no tune option is chosen, so it has no keys; choose one first: "
         "tune=<batch_size|lr_find>"),
    case("tune=lr_find tune.min_lr=1 tune.max_lr=0.1", "error: tune.min_lr: 1 is not below tune.max_lr (0.1); the sweep "
         "rises from min_lr to max_lr"),
    case("tune=lr_find tune.smoothing=1", "error: tune.smoothing: 1.0 is out of range; allowed: a value >= 0 and < 1"),
    case("tune=lr_find tune.steps=5", "error: tune.steps: 5 is out of range; allowed: a value >= 10 and <= 100000"),
    case("tune=lr_find tune.diverge_factor=1", "error: tune.diverge_factor: 1.0 is out of range; allowed: a value > 1"),
    case("tune=lr_find tune.keep_global_batch=true", "error: tune.keep_global_batch: unknown key; keys under tune: apply, "
         "diverge_factor, max_lr, min_lr, name, smoothing, steps"),
    case("tune=batch_size tune.max_batch_size=1", "error: tune.max_batch_size: 1 is out of range; allowed: a value >= 2"),
    case("tune=batch_size tune.pick=max", "error: tune.pick: 'max' is not allowed; choose one of knee, largest"),
    case("tune=batch_size tune.knee_tolerance=1", "error: tune.knee_tolerance: 1.0 is out of range; allowed: a value >= 0 "
         "and < 1"),
    # a sweep that diverges at once has no curve to read: found when it runs, before its MLflow run exists
    case("tune=lr_find tune.min_lr=1e6 tune.max_lr=1e7 tune.steps=10 optimizer=sgd", "error: tune.min_lr: the "
         "loss diverged within 2 steps of the sweep; lower tune.min_lr (the sweep started at 1e+06)", RUN),
    # --- issue 15 (helper memory): activation checkpointing, sync_batchnorm, fsdp's memory options
    case("trainer.activation_checkpointing=some", "error: trainer.activation_checkpointing: 'some' is not allowed; "
         "choose one of none, full, selective"),
    case("parallelism.sync_batchnorm=true", "error: parallelism.sync_batchnorm: true needs several processes but "
         "parallelism=single runs one (its BatchNorm already sees the whole batch); add parallelism=ddp or parallelism=fsdp"),
    case("parallelism=ddp parallelism.cpu_offload=true", "error: parallelism.cpu_offload: parallelism=ddp has no cpu_offload"),
    case("parallelism=ddp +parallelism.reshard_after_forward=false", "error: parallelism.reshard_after_forward: false is an "
         "fsdp option, but parallelism=ddp; use parallelism=fsdp or drop it"),
    case("parallelism=fsdp parallelism.cpu_offload=maybe", "error: parallelism.cpu_offload: 'maybe' is not a boolean; "
         "use true or false"),
    case("trainer.memory_estimate=2", "error: trainer.memory_estimate: 2 is not a boolean"),
    # --- `runner reproduce` and `runner compare` (issue 16, section 3): the store is the matrix's own, empty
    case("reproduce 0123456789abcdef0123456789abcdef", "error: run id: 0123456789abcdef0123456789abcdef: no such "
         "MLflow run in sqlite:///"),
    case("compare no-such-experiment", "error: compare: no-such-experiment: neither an experiment nor a run id in "
         "sqlite:///"),
    case("reproduce", "error: reproduce: the following arguments are required: run_id; usage: runner reproduce"),
    case("compare", "error: compare: the following arguments are required: targets; usage: runner compare"),
    case("reproduce abc tracking.uri=sqlite:///{tmp}/none.db", "error: --uri: sqlite:///{tmp}/none.db: no MLflow store at"),
    # --- issue 16 (helper evalpredict): mode=eval|predict on a trained run
    case("mode=eval", "error: trainer.resume: mode=eval needs a trained run; give trainer.resume=<run dir | "
         "checkpoint file | MLflow run id>"),
    case("mode=export trainer.resume={tmp}/nothing_here", "error: trainer.resume: '{tmp}/nothing_here' does not exist; "
         "give a checkpoint file or a run directory"),
    case("mode=eval trainer.resume={tmp} eval.splits=[]", "error: eval.splits: [] evaluates nothing; allowed: a list "
         "of val and test"),
    case("mode=eval trainer.resume={tmp} eval.splits=[test,test]", "error: eval.splits: ['test', 'test'] names a split "
         "twice"),
    case("mode=evaluate", "error: mode: 'evaluate' is not allowed; choose one of train, eval, predict, export"),
    case("mode=predict trainer.resume={tmp} predict.input={tmp}/no_such_images", "error: predict.input: "
         "'{tmp}/no_such_images' does not exist; give a folder of images or a text file with one input per line"),
    case("mode=eval trainer.resume=0123456789abcdef0123456789abcdef", "error: trainer.resume: 0123456789abcdef0123456789"
         "abcdef is no run directory, checkpoint file or MLflow run in sqlite:///", RUN),
    # --- issue 16 (helper besttest): trainer.test_on, trainer.resume=latest
    case("trainer.test_on=first", "error: trainer.test_on: 'first' is not allowed; choose one of best, last"),
    case("trainer.resume=latest", "error: trainer.resume: latest finds no training run under {tmp}/outputs/runs (no "
         "directory there holds the spec.yaml of one); give a run directory or a checkpoint file"),
    # --- issue 16 (helper mlmodel): tracking.log_model
    case("tracking.log_model=best_val", "error: tracking.log_model: 'best_val' is not allowed; choose one of best, last, none"),
    # --- debug presets (conf/debug/, runner/specs/debug.py)
    case("debug=nope", "error: debug: unknown option 'nope'; choose one of anomaly, fast, limit, overfit, profile"),
    case("debug=limit trainer.limit_train=0", "error: trainer.limit_train: 0.0 is out of range; allowed: a value > 0 and <= 1"),
    case("debug=overfit trainer.overfit_batches=-1", "error: trainer.overfit_batches: -1 is out of range; allowed: a value >= 0"),
    # --- issue 17 (helper kfold): k-fold cross-validation, trainer.cross_validation
    case("trainer.cross_validation.folds=1", "error: trainer.cross_validation.folds: 1 is out of range; allowed: a value >= 2"),
    case("trainer.cross_validation.folds=5000", "error: trainer.cross_validation.folds: 5000 is more than the 1527 "
         "samples of train+val; allowed: 2 to 1527", RUN),
    case("trainer.cross_validation.folds=3 dataset.val_fraction=0", "error: trainer.cross_validation.folds: 3 folds "
         "train+val, but dataset.val_fraction=0 leaves no validation split; set dataset.val_fraction > 0"),
    case("trainer.cross_validation.folds=2 trainer.cross_validation.fold=0 trainer.max_steps=1 "
         "trainer.cross_validation.parent_run=0123456789abcdef0123456789abcdef", "error: "
         "trainer.cross_validation.parent_run: 0123456789abcdef0123456789abcdef is no MLflow run in sqlite:///", RUN),
    case("trainer.cross_validation.fold=1", "error: trainer.cross_validation.fold: 1 needs trainer.cross_validation.folds"),
    case("trainer.cross_validation.folds=3 trainer.cross_validation.fold=3", "error: trainer.cross_validation.fold: 3 "
         "is out of range; allowed: 0 to 2 (trainer.cross_validation.folds=3)"),
    # --- issue 23 (helper spec): model-parallel degrees, their keys, context parallelism
    case("parallelism=hsdp parallelism.nproc_per_node=2 parallelism.dp_replicate=2 parallelism.dp_shard=2",
         "error: parallelism: the degrees make 4 process(es) (dp_replicate=2 x dp_shard=2) but the run has 2 "
         "(nproc_per_node=2 x nnodes=1); their product must equal the number of processes", sub=True),
    case("parallelism=fsdp parallelism.nproc_per_node=8 parallelism.dp_shard=2 parallelism.tp=2", "error: parallelism: "
         "the degrees make 4 process(es) (dp_shard=2 x tp=2) but the run has 8 (nproc_per_node=8 x nnodes=1)"),
    case("parallelism=fsdp parallelism.tp=3", "error: parallelism.dp_shard: -1 takes the processes the other degrees "
         "leave, but 2 process(es) (nproc_per_node=2 x nnodes=1) do not divide by 3 (dp_shard=-1 x tp=3)"),
    case("parallelism=fsdp parallelism.pp=-1", "error: parallelism.dp_shard: -1, but parallelism.pp is -1 already; "
         "at most one degree takes the processes left"),
    case("parallelism.tp=-1", "error: parallelism.tp: -1 takes the processes the other degrees leave, but "
         "parallelism=single starts tp x pp x cp processes; give a number of processes"),
    case("parallelism=ddp parallelism.pp=0", "error: parallelism.pp: 0 is not a degree; allowed: a positive number"),
    case("parallelism.cp=-2", "error: parallelism.cp: -2 is out of range; allowed: a value >= -1"),
    case("parallelism.tp=2 parallelism.dp_shard=2", "error: parallelism.dp_shard: 2 needs several processes but "
         "parallelism=single runs one; add parallelism=ddp, fsdp or hsdp"),
    case("parallelism.pp=2 parallelism.pp_schedule=gpipe parallelism.pp_stages_per_rank=2", "error: "
         "parallelism.pp_stages_per_rank: 2, but pp_schedule=gpipe holds one stage per rank"),
    case("parallelism.pp=2 parallelism.pp_schedule=interleaved_1f1b parallelism.pp_stages_per_rank=1", "error: "
         "parallelism.pp_stages_per_rank: 1, but pp_schedule=interleaved_1f1b holds several stages per rank"),
    case("parallelism.pp=2 parallelism.pp_schedule=zbv_zero_bubble parallelism.pp_stages_per_rank=4", "error: "
         "parallelism.pp_stages_per_rank: 4, but pp_schedule=zbv_zero_bubble holds exactly 2 stages per rank"),
    case("parallelism.pp=2 parallelism.pp_microbatches=65", "error: parallelism.pp_microbatches: 65 micro-batches "
         "cannot be cut from a batch of 64 (dataset.batch_size, per data-parallel rank); allowed: 1 to 64"),
    case("parallelism.pp_schedule=gpipe", "error: parallelism.pp_schedule: gpipe, but parallelism.pp=1 cuts no "
         "pipeline; set parallelism.pp (e.g. 2) or drop it"),
    case("parallelism.pp_plan={_target_:my_pkg.stage}", "error: parallelism.pp_plan: set, but parallelism.pp=1 cuts "
         "no pipeline"),
    case("parallelism.tp_plan={_target_:my_pkg.plan}", "error: parallelism.tp_plan: set, but parallelism.tp=1 splits "
         "no layer; set parallelism.tp (e.g. 2) or drop it"),
    case("parallelism.sequence_parallel=false", "error: parallelism.sequence_parallel: false, but parallelism.tp=1 "
         "splits no layer"),
    case("parallelism.loss_parallel=false", "error: parallelism.loss_parallel: false, but parallelism.tp=1 splits no layer"),
    case("parallelism=ddp parallelism.tp=2 parallelism.sync_batchnorm=true", "error: parallelism.sync_batchnorm=true "
         "with parallelism.tp=2: SyncBatchNorm syncs over every process"),
    case("model=gpt dataset=synthetic_tokens task=language_modeling parallelism.cp=2 trainer.device=cpu", "error: "
         "parallelism.cp: 2, but context parallelism needs CUDA (torch's context-parallel attention runs on GPUs) and "
         "trainer.device=cpu"),
]


class Places:
    """The files and directories a case names: {tmp}, {file}, {readonly}, {full} and checkpoints."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.mounts: list[Path] = []

    def fill(self, text: str) -> str:
        for name in ("file", "readonly", "full", "foreign_ckpt", "empty_ckpt", "garbage_ckpt", "truncated_ckpt", "evil_ckpt",
                     "cifar", "corrupt_cifar", "other_weights", "pretrained", "reviews", "nan_weights", "readonly_run"):
            if "{" + name + "}" in text:
                text = text.replace("{" + name + "}", str(getattr(self, name)()))
        return text.replace("{tmp}", str(self.tmp))

    def file(self) -> Path:
        path = self.tmp / "a_file"
        path.write_text("not a directory")
        return path

    def readonly(self) -> Path:
        path = self.tmp / "readonly"
        if os.geteuid() != 0:
            path.mkdir(exist_ok=True)
            (path / "mlflow.db").touch()
            path.chmod(0o555)
            return path
        # root writes through permission bits: a read-only mount is what refuses it
        self._mount(path, "size=1m")
        (path / "mlflow.db").touch()
        if subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        return path

    def full(self) -> Path:
        path = self.tmp / "full"
        self._mount(path, "size=256k")
        try:
            with open(path / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
        return path

    def _mount(self, path: Path, options: str) -> None:
        path.mkdir(exist_ok=True)
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                               capture_output=True).returncode:
            pytest.skip("needs root to mount a small tmpfs")
        self.mounts.append(path)

    def unmount(self) -> None:
        for path in self.mounts:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)

    def _save(self, name: str, obj: object) -> Path:
        import torch

        path = self.tmp / name
        torch.save(obj, path)
        return path

    def foreign_ckpt(self) -> Path:
        return self._save("foreign.pt", {"step": 1})

    def empty_ckpt(self) -> Path:
        path = self.tmp / "empty.pt"
        path.touch()
        return path

    def garbage_ckpt(self) -> Path:
        path = self.tmp / "garbage.pt"
        path.write_bytes(bytes(range(256)) * 64)
        return path

    def truncated_ckpt(self) -> Path:
        import torch

        path = self._save("truncated.pt", {"model": {"w": torch.zeros(1000)}, "progress": {"step": 1}})
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return path

    def evil_ckpt(self) -> Path:
        return self._save("evil.pt", _Evil(str(self.tmp / "pwned")))

    def cifar(self) -> Path:
        from tests.data.test_cifar import _write_cifar

        if not (self.tmp / "cifar").exists():
            _write_cifar(self.tmp / "cifar")
        return self.tmp / "cifar"

    def corrupt_cifar(self) -> Path:
        root = self.cifar()
        (root / "cifar-10-batches-py" / "data_batch_2").write_bytes(b"\x80\x02not a pickle at all")
        return root

    def other_weights(self) -> Path:
        import torch

        # the default MLP's names (64 -> 256 -> 128 -> 10) at another width: another architecture's file
        return self._save("other.pt", {"1.weight": torch.zeros(32, 64), "1.bias": torch.zeros(32),
                                       "3.weight": torch.zeros(16, 32), "3.bias": torch.zeros(16)})

    def pretrained(self) -> Path:
        from tests.models.test_hf import pretrained_dir

        return pretrained_dir(self.tmp / "distilbert")

    def reviews(self) -> Path:
        from tests.models.test_hf import write_reviews

        return write_reviews(self.tmp / "reviews.csv")
    def nan_weights(self) -> Path:
        """The default model's state dict, every value NaN."""
        from runner.engine import components
        from runner.engine.run_data import build_data
        from tests.conftest import compose_spec

        spec = compose_spec([], self.tmp / "weights_run")
        model = components.build_model(spec, build_data(spec))
        return self._save("nan_weights.pt", {k: v.float().fill_(float("nan")) for k, v in model.state_dict().items()})

    def readonly_run(self) -> Path:
        """A run killed before its first checkpoint (its spec.yaml alone), on a read-only mount."""
        from tests.conftest import compose_spec

        path = self.tmp / "readonly_run"
        self._mount(path, "size=1m")
        (path / "spec.yaml").write_text(compose_spec(["trainer.max_steps=2"], path).to_yaml())
        if subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        return path


class _Evil:
    """Unpickling this runs a shell command: a checkpoint must never be loaded with full pickle."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, migrated_mlflow_store: Path) -> Path:
    import shutil

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    shutil.copy(migrated_mlflow_store, db)
    return db


@pytest.fixture
def places(tmp_path: Path):
    p = Places(tmp_path)
    yield p
    p.unmount()


def _hydra_must_not_start() -> None:
    raise AssertionError("the CLI let this through to Hydra's run: preflight should have refused it")


def run_in_process(args: list[str], cwd: Path, stage: str, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    import runner.__main__ as entry
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["runner", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    if stage == PRE:
        monkeypatch.setattr(entry, "main", _hydra_must_not_start)
    GlobalHydra.instance().clear()
    try:
        entry.cli()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
        logging.getLogger().handlers.clear()  # Hydra's job logging wrote to this test's captured streams
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, expected, stage, sub", CASES)
def test_bad_input_is_one_line_exit_2_and_nothing_made(args: list[str], expected: str, stage: str, sub: bool,
                                                       places: Places, store: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    runs_before = mlflow_runs(store)
    args = [places.fill(a) for a in args]
    if not any(a.startswith("tracking.uri=") for a in args):
        args.append(f"tracking.uri=sqlite:///{store}")
    expected = places.fill(expected)
    if sub:
        proc = run_cli(args, cwd=tmp_path, timeout=120)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = run_in_process(args, tmp_path, stage, monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(expected), err[-3000:]
    assert "Traceback" not in err + out
    # a real process prints nothing else: a refusal while the store opened in the background printed up
    # to 2,000 lines of SQLAlchemy's mapper set-up on stdout
    assert not sub or not out.strip(), out[-3000:]
    assert mlflow_runs(store) == runs_before
    assert not (tmp_path / "pwned").exists()
    if stage == PRE:
        assert not (tmp_path / "outputs").exists()
        for arg in args:
            if arg.startswith("hydra.run.dir="):
                assert not Path(arg.split("=", 1)[1]).exists()
    # a refused run leaves no run directory: the corrected command may use it, trainer.resume=latest never picks it
    assert not list((tmp_path / "outputs").rglob("spec.yaml")) if (tmp_path / "outputs").exists() else True


def test_the_matrix_is_wide() -> None:
    assert len(CASES) >= 85
    assert 15 <= sum(1 for c in CASES if c.values[3]) <= 25  # real processes, the rest in this one


MLP_KEYS_OFF = ["~model.hidden", "~model.dropout", "~model.norm", "trainer.max_steps=2"]


@pytest.mark.parametrize("model, outputs", [("three_scores", 3), ("thirty_scores", 30)])
def test_a_model_whose_outputs_do_not_fit_the_datas_classes_is_refused_in_one_line(
        model: str, outputs: int, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Before: 3 outputs for 10 classes failed with torch's traceback at the first label >= 3; 30 trained silently."""
    args = [f"model._target_=tests.user_pkg.broken.{model}", *MLP_KEYS_OFF, f"tracking.uri=sqlite:///{store}"]
    code, out, err = run_in_process(args, tmp_path, RUN, monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (f"error: model: it outputs {outputs} scores per sample, but the data has 10 "
                                            "classes; allowed: a model with 10 outputs (a model taking num_classes "
                                            "gets it from the data)")
    assert "Traceback" not in err + out


def test_a_user_model_whose_forward_raises_is_one_line_naming_its_code_with_the_traceback_kept(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The user's own program failed (exit 1, not a refused input): their line, the traceback in error.txt."""
    import tests.user_pkg.broken as broken

    run_dir = tmp_path / "run"
    args = ["model._target_=tests.user_pkg.broken.raising_forward", *MLP_KEYS_OFF, f"tracking.uri=sqlite:///{store}",
            f"hydra.run.dir={run_dir}"]
    code, out, err = run_in_process(args, tmp_path, RUN, monkeypatch, capsys)
    assert code == 1
    line = next(n for n, text in enumerate(Path(broken.__file__).read_text().splitlines(), 1)
                if "this model is not finished" in text)
    assert err.strip().splitlines()[-1] == (f"error: model: tests.user_pkg.broken.raising_forward raised ValueError: this "
                                            f"model is not finished (at {broken.__file__}:{line}, in forward); the "
                                            f"traceback is in {run_dir / 'error.txt'}")
    assert "Traceback" not in err + out
    assert (run_dir / "error.txt").read_text().startswith("Traceback (most recent call last):")


def test_the_corrected_command_runs_in_the_directory_a_refused_run_named(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Before: the refused run left spec.yaml there, and the corrected command was refused ("already holds a run")."""
    run_dir = tmp_path / "mine"
    common = [f"hydra.run.dir={run_dir}", f"tracking.uri=sqlite:///{store}", "trainer.max_steps=1"]
    code, _, err = run_in_process(["trainer.cross_validation.folds=5000", *common], tmp_path, RUN, monkeypatch, capsys)
    assert code == 2 and "trainer.cross_validation.folds: 5000" in err
    assert not run_dir.exists()
    code, _, err = run_in_process(common, tmp_path, RUN, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert (run_dir / "spec.yaml").exists() and list((run_dir / "checkpoints").glob("*.pt"))


# Input the workers refuse as the engine is built (the model, the schedule, the data): found only once the model, the
# loader and the schedule exist, so after the launcher wrote spec.yaml and started them (issue 35, item 13: "refused
# cases still leave spec.yaml"). Before: rank 0's line, torch's agent's "failed (exitcode: 2)" line and "workers
# failed: rank 0 (exit code 2), ...", exit 1, and the run directory with its spec.yaml left, so the corrected
# command was refused as "already holds a run".
# A launcher and two workers cost 10-30 s: CI runs the model's case, the schedule's and the data's are slow.
WORKER_REFUSALS = [
    pytest.param("model.hidden=[0,128]", "error: model.hidden: [0, 128] is not allowed; every width must be > 0",
                 id="model"),
    pytest.param("scheduler=warmup_cosine scheduler.warmup=100000", "error: scheduler.warmup: 100000 (100000 steps) is "
                 "not allowed; the warmup must be shorter than the run's 200 optimizer steps", id="schedule",
                 marks=pytest.mark.slow),
    pytest.param("dataset.batch_size=5000 trainer.max_steps=2", "error: dataset.batch_size: 5000 x 2 rank(s) is more "
                 "than the training split holds", id="data", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("args, expected", WORKER_REFUSALS)
def test_input_the_workers_refuse_is_one_line_exit_2_and_leaves_no_run_directory(args: str, expected: str, store: Path,
                                                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    runs_before = mlflow_runs(store)
    proc = run_cli(["parallelism=ddp", "parallelism.nproc_per_node=2", *args.split(), f"tracking.uri=sqlite:///{store}",
                    f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run_dir.exists()
    assert mlflow_runs(store) == runs_before


@pytest.mark.slow  # five runs; in CI the matrix asserts no refused run leaves a directory, and
# tests/runner/addons/test_best_weights.py that latest passes over an eval/predict run's spec.yaml
def test_resume_latest_goes_on_with_the_newest_training_run_past_predict_eval_and_refused_runs_and_says_which(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Issue 26, section 3. Before: after a mode=predict run, resume=latest restarted training from step 0 in the
    predict run's folder and logged its steps into the MLflow run named predict; a refused run's folder was a run."""
    from runner.engine import checkpoint

    runs = tmp_path / "outputs" / "runs"
    common = [f"tracking.uri=sqlite:///{store}", "trainer.progress_bar=off", "trainer.memory_estimate=false"]
    code, _, err = run_in_process([f"hydra.run.dir={runs / 'trained'}", "trainer.max_steps=2", *common], tmp_path, RUN,
                                  monkeypatch, capsys)
    assert code == 0, err[-2000:]
    for mode in ("predict", "eval"):  # each written after the training run (export writes no spec.yaml)
        code, _, err = run_in_process([f"mode={mode}", f"trainer.resume={runs / 'trained'}",
                                       f"hydra.run.dir={runs / mode}", *common], tmp_path, RUN, monkeypatch, capsys)
        assert code == 0 and (runs / mode / "spec.yaml").is_file(), err[-2000:]
    code, _, _ = run_in_process([f"hydra.run.dir={runs / 'refused'}", "precision=tf32", "trainer.device=cpu", *common],
                                tmp_path, RUN, monkeypatch, capsys)
    assert code == 2 and not (runs / "refused").exists()
    code, out, err = run_in_process(["trainer.resume=latest", "trainer.max_steps=3", *common], tmp_path, RUN,
                                    monkeypatch, capsys)
    assert code == 0, err[-2000:]
    newest = sorted((runs / "trained" / "checkpoints").glob("*.pt"), key=lambda p: p.stat().st_mtime)[-1]
    assert f"trainer.resume=latest: {runs / 'trained'}, the newest run (its checkpoints/" in out + err
    assert checkpoint.load(newest)["progress"]["step"] == 3  # trained on from step 2, in its own directory
    assert not any((runs / mode / "checkpoints").exists() for mode in ("predict", "eval"))

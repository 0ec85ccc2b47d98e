# Two commands: `make run` trains the default, `make test` runs the tests (both install first).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install run test test-all test-cluster bench bench-gpu bench-hpo bench-hpo-slots bench-pbt bench-memory bench-ranks bench-parallel ui clean

install: $(VENV)/.installed

# runner requires the Optuna sweeper (sweeper/, its own distribution) by name: naming its folder
# installs it from this checkout
# setuptools says "Editable installation ... be careful with folders in your working directory" (11 lines)
# for each editable package it builds, whatever it is told; that note is dropped, its other warnings are kept
$(VENV)/.installed: pyproject.toml sweeper/pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -c constraints.txt -e ./sweeper -e '.[dev,postgres,cluster]'
	touch $@

run: install            ## train the default run; pass overrides as ARGS="optimizer=adamw +accum=4"
	$(PY) -m runner $(ARGS)

test: install           ## the test suite CI runs (slow tests excluded), in two processes (pytest-xdist)
	$(PY) -m pytest -q -m "not slow" -n 2 --durations=25

test-all: install       ## every test, slow ones included
	$(PY) -m pytest -q

test-cluster: install   ## the tests on real servers (PostgreSQL, mlflow server, a one-host SLURM cluster) and Hydra's launchers
	$(PY) -m pytest -q -m cluster

bench: install          ## start-up times beside their targets; engine vs a hand-written loop, steps interleaved: digits MLP, CNN, the ResNet and GPT presets; ratio and us overhead
	$(PY) -m benchmarks.bench $(ARGS)

bench-gpu: install      ## GPT-2 124M tokens/s and MFU; ResNet-18 CIFAR shape samples/s beside a hand loop (small shapes on a CPU)
	$(PY) -m benchmarks.bench_gpu $(ARGS)

bench-hpo: install      ## the digits Optuna study, 20 trials, hyperband pruning vs none: epochs, wall time, best value
	$(PY) -m benchmarks.bench_hpo

bench-hpo-slots: install ## 2 slots vs 1 on short trials (toy app instant / 1 s, digits 1 epoch): seconds and ratios
	$(PY) -m benchmarks.bench_hpo --slots $(ARGS)

bench-pbt: install      ## PBT and PB2 (4 members) vs random search, same total steps, digits MLP with SGD: best val/loss, wall time
	$(PY) -m benchmarks.bench_pbt $(ARGS)

bench-memory: install   ## activation checkpointing on gpt, none/selective/full: activation memory, step time (and peak on CUDA); ARGS="--compile" under torch.compile
	$(PY) -m benchmarks.bench_memory $(ARGS)

bench-ranks: install    ## each rank's peak memory (fsdp 2 and 4, tp=2, pp=2) beside one process's and the ideal, GPT-2 124M and 355M; ARGS="--models gpt2 --cases fsdp2,tp2"
	$(PY) -m benchmarks.bench_rank_memory $(ARGS)

bench-parallel: install ## gpt: ddp, fsdp, tp=2, pp=2 (gpipe, 1f1b), fsdp x tp (ARGS="--nproc 4"): step time beside one process, same global batch; pp bubble vs (p-1)/(m+p-1)
	$(PY) -m benchmarks.bench_parallel $(ARGS)

ui: install             ## the MLflow UI over the local store, experiments opening on their runs table
	$(PY) -m runner.tracking.mlflow_ui --backend-store-uri sqlite:///outputs/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf outputs multirun

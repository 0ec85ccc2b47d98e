"""Resume: `trainer.resume=<run dir | checkpoint>` continues a run from that run's own spec.

Hydra composes today's defaults plus today's overrides; a resumed run must not pick those up for
anything the user did not retype (max_epochs, and with it the schedule, would silently change). So
the spec saved with the run (inside every checkpoint, and as spec.yaml) is the base, and only the
overrides typed with the resume are applied on top, and only where they change how long the run
goes, where it runs, or where it logs. An override that changes what is trained stops the resume
with one line naming the key, the saved value and the new one.

Where the run goes on:
- a run directory: in place. Same run directory, same MLflow run, newest good checkpoint; a run stopped
  before its first checkpoint starts over from its spec.yaml (each step already logged stays logged once).
- a checkpoint file: a new run (this invocation's run directory, a new MLflow run tagged with the
  run it came from), so another run's records are never written into.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from runner.specs.fields import set_dotted
from runner.specs.parallelism import nominal_world, resolve_degrees
from runner.specs.run import COMPONENT_GROUPS, RunSpec, SpecError

# What an override given with a resume may change: how long, where it runs, where it logs.
MAY_CHANGE = ("trainer.max_steps", "trainer.max_epochs", "trainer.device", "trainer.progress_bar",
              "trainer.log_every_n_steps", "trainer.checkpoint_every_n_steps", "trainer.keep_checkpoints",
              "trainer.async_checkpoint", "trainer.resume", "trainer.slurm_requeue", "trainer.stop_at_step", "trainer.test_on", "trainer.compile", "trainer.peak_tflops", "trainer.deterministic", "dataset.num_workers",
              "dataset.root", "dataset.download", "trainer.profile", "parallelism.", "tracking.", "trial.",
              "weights.")  # which weights leave the run (tracking.log_model's average), not what is trained
# These may change only together, keeping the global batch (a checkpoint is portable across strategies).
BATCH_KEYS = ("dataset.batch_size", "accumulation.steps")


def resumed_spec(spec: RunSpec, saved: RunSpec, target: Path, in_place: bool) -> RunSpec:
    """The spec a resume of `target` runs: `saved`, the spec the run was trained with, with the allowed typed
    overrides of `spec` applied; one line naming the key for an override that changes what is trained.
    `in_place`: the resume goes on in `target`, a run directory (else in this invocation's). Reading `saved`
    from the run directory or checkpoint is runner/engine/resume_source.py's plan."""
    typed = typed_keys(spec.overrides)
    new_flat, saved_flat = spec.flat(), saved.flat()
    merged = saved.to_dict()
    for key in sorted(new_flat):
        if not _typed(key, typed) or new_flat[key] == saved_flat.get(key) or key in ("run_dir", "overrides"):
            continue
        if not (key.startswith(MAY_CHANGE) or key in BATCH_KEYS):
            raise SpecError(f"{key}: the resumed run was trained with {saved_flat.get(key)!r}, this resume sets "
                            f"{new_flat[key]!r}; a resume continues the run's own spec and may change only how long it "
                            "trains (trainer.max_steps/max_epochs), where it runs (device, parallelism, data workers) "
                            "and where it logs (tracking.*)")
        set_dotted(merged, key, new_flat[key])
    if not _typed("trainer.stop_at_step", typed):  # a paused run's resume goes on unless it pauses again
        merged["trainer"]["stop_at_step"] = None
    merged["run_dir"] = str(target) if in_place else spec.run_dir
    merged["overrides"] = list(saved.overrides if in_place else spec.overrides)
    merged["trainer"]["resume"] = str(target)
    resumed = RunSpec.from_yaml(yaml.safe_dump(merged))
    _check_global_batch(saved, resumed)
    return resumed


def typed_keys(overrides: tuple[str, ...]) -> set[str]:
    """Keys the user typed: `optimizer.lr=0.1` -> optimizer.lr; a group choice `precision=bf16` -> precision.name
    (`optimizer=sgd` -> every key of the component: `optimizer.`); `+accum=4` -> accumulation.steps."""
    keys = set()
    for override in overrides:
        key, sep, _ = override.lstrip("+~").partition("=")
        if not sep or key.startswith("hydra"):
            continue
        if key == "accum":
            key = "accumulation.steps"
        elif "." not in key and key not in ("seed", "run_dir"):
            # a group choice: the option's name, or for components and whole-group moves every key
            key = key + "." if key in ("parallelism", "tracking", *COMPONENT_GROUPS) else f"{key}.name"
        keys.add(key)
    return keys


def _typed(key: str, typed: set[str]) -> bool:
    return key in typed or any(t.endswith(".") and key.startswith(t) for t in typed)


def _dp_degree(spec: RunSpec) -> int:
    degrees = resolve_degrees(spec.parallelism, nominal_world(spec.parallelism))
    return degrees["dp_replicate"] * degrees["dp_shard"]  # the replicas that split each global batch


def _check_global_batch(saved: RunSpec, resumed: RunSpec) -> None:
    def global_batch(s: RunSpec) -> int:
        return s.dataset.batch_size * s.accumulation.steps * _dp_degree(s)

    if global_batch(saved) != global_batch(resumed):
        raise SpecError(f"parallelism: the resumed run was trained with a global batch of {global_batch(saved)} "
                        f"(dataset.batch_size x accumulation.steps x ranks), this resume gives {global_batch(resumed)}; "
                        "keep it by adjusting dataset.batch_size or +accum together with the number of ranks")

"""The population: P members trained in rounds of `ready` optimizer steps, exploit and explore between rounds.

Each member is an ordinary run (its own run directory and MLflow child run of the population's parent)
that pauses at each round's boundary with its checkpoint (trainer.stop_at_step: the schedule still plans
the whole run). At a boundary the members are ranked by the objective's last validation; each member of
the bottom `quantile` copies a member of the top quantile: that member's checkpoint (weights, optimizer,
schedule position, data position, RNG) becomes its own, with its own MLflow run id, and its seed, which
orders the data. It then explores (runner/search/pbt/explore.py) and goes on with the changed hyperparameters.

The population's state (members, their hyperparameters and lineage, the rounds done, the random state)
is pbt_state.json in the sweep directory, written atomically after each round: a killed population run
again on the same sweep directory goes on from its last completed round with the same members. A member
whose round finished before the kill (its result file exists) is not trained again.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from runner.engine import checkpoint
from runner.files import atomic_write
from runner.search.pbt import explore
from runner.search.pbt.member import SWEEP_PID_ENV
from runner.specs.fields import set_dotted
from runner.specs.run import RunSpec, SpecError

log = logging.getLogger(__name__)
STATE_FILE = "pbt_state.json"


@dataclass(frozen=True)
class Settings:
    population: int = 4
    ready: int = 50                         # optimizer steps per round
    quantile: float = 0.25                  # bottom fraction that exploits, top fraction it copies from
    explore: str = "pbt"                    # pbt | pb2
    perturb: tuple[float, ...] = (0.8, 1.2)
    resample_probability: float = 0.25
    n_jobs: int = 1                         # members trained at once (each in its own process when > 1, or
                                            # handed together to the Hydra launcher: runner/search/pbt/launcher.py)
    seed: int = 0
    pb2_kappa: float = 2.0

    def check(self, base: RunSpec) -> None:
        if self.population < 2:
            raise SpecError(f"hydra.sweeper.population: {self.population}; a population needs at least 2 members")
        if not 0 < self.quantile <= 0.5:
            raise SpecError(f"hydra.sweeper.quantile: {self.quantile}; allowed: above 0 and at most 0.5")
        if self.explore not in ("pbt", "pb2"):
            raise SpecError(f"hydra.sweeper.explore: {self.explore!r}; choose pbt or pb2")
        if self.ready < 1 or self.n_jobs < 1:
            key, value = ("ready", self.ready) if self.ready < 1 else ("n_jobs", self.n_jobs)
            raise SpecError(f"hydra.sweeper.{key}: {value}; allowed: 1 or more")
        if not self.perturb or any(not (f > 0 and math.isfinite(f)) for f in self.perturb):
            raise SpecError(f"hydra.sweeper.perturb: {list(self.perturb)}; allowed: a list of positive factors the "
                            "values are multiplied by, e.g. [0.8, 1.2]")
        if not 0 <= self.resample_probability <= 1:
            raise SpecError(f"hydra.sweeper.resample_probability: {self.resample_probability}; allowed: a probability "
                            "from 0 to 1")
        if not self.pb2_kappa >= 0:
            raise SpecError(f"hydra.sweeper.pb2_kappa: {self.pb2_kappa}; allowed: 0 or more (the weight of the GP's "
                            "uncertainty in pb2's upper confidence bound)")
        if not base.trainer.max_steps:
            raise SpecError("trainer.max_steps: null; population-based training plans its rounds in optimizer steps: "
                            "set trainer.max_steps")


class Population:
    def __init__(self, base: RunSpec, space: dict[str, explore.Dim], settings: Settings, sweep_dir: Path,
                 parent_run_id: str | None = None, on_round: Callable[[int], None] | None = None,
                 launched: Any = None):
        settings.check(base)
        self.base, self.space, self.settings = base, space, settings
        self.sweep_dir = Path(sweep_dir)
        self.parent_run_id = parent_run_id
        self.on_round = on_round  # called after each completed round (tests simulate a crash there)
        # the Hydra launcher's jobs (runner/search/pbt/launcher.py's LauncherMembers); None: PBT's own processes
        self.launched = launched
        total = base.trainer.max_steps
        self.boundaries = list(range(settings.ready, total, settings.ready)) + [total]
        self.maximize = base.objective.direction == "maximize"

    # --- state ------------------------------------------------------------------------------

    def _state_path(self) -> Path:
        return self.sweep_dir / STATE_FILE

    def _new_state(self) -> dict[str, Any]:
        rng = random.Random(self.settings.seed)
        members = []
        for i in range(self.settings.population):
            members.append({"id": i, "run_dir": str(self.sweep_dir / f"member-{i}"), "seed": self.base.seed + i,
                            "hparams": explore.sample(self.space, rng), "lineage": [], "objectives": [],
                            "schedule": [], "run_id": ""})
        return {"round": 0, "boundaries": self.boundaries, "members": members, "best_per_round": [],
                "rng": _rng_to_json(rng), "pb2_history": []}

    def _save(self, state: dict[str, Any]) -> None:
        atomic_write(self._state_path(), json.dumps(state, indent=1))

    def load_or_start(self) -> dict[str, Any]:
        if self._state_path().is_file():
            state = json.loads(self._state_path().read_text())
            if state["boundaries"] != self.boundaries or len(state["members"]) != self.settings.population:
                raise SpecError(f"hydra.sweeper: {self._state_path()} holds a population of {len(state['members'])} "
                                f"with rounds ending at {state['boundaries']}; this sweep asks for {self.settings.population} "
                                f"members and {self.boundaries}: use another sweep directory")
            log.info("PBT: resuming the population in %s after round %d of %d", self.sweep_dir, state["round"],
                     len(self.boundaries))
            return state
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        state = self._new_state()
        self._save(state)
        return state

    # --- rounds -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        state = self.load_or_start()
        while state["round"] < len(self.boundaries):
            r = state["round"]
            boundary = self.boundaries[r]
            results = self._train_round(state, r, boundary)
            for member, result in zip(state["members"], results):
                member["objectives"].append([boundary, result["objective"]])
                member["run_id"] = result["run_id"] or member["run_id"]
            best = ranked(state["members"], self.maximize)[0]
            state["best_per_round"].append([boundary, best["objectives"][-1][1], best["id"]])
            self._log_parent({"pbt/best_objective": best["objectives"][-1][1]}, boundary)
            if r + 1 < len(self.boundaries):
                self._exploit_and_explore(state, r, boundary)
            state["round"] = r + 1
            self._save(state)
            log.info("PBT round %d/%d (step %d): best %s %.4f (member %d)", r + 1, len(self.boundaries), boundary,
                     self.base.objective.metric, best["objectives"][-1][1], best["id"])
            if self.on_round is not None:
                self.on_round(r + 1)
        return state

    def _member_spec(self, member: dict[str, Any], r: int, boundary: int) -> RunSpec:
        tree = self.base.to_dict()
        tree["run_dir"], tree["seed"] = member["run_dir"], member["seed"]
        for key, value in member["hparams"].items():
            set_dotted(tree, key, value)
        last = boundary >= self.base.trainer.max_steps
        # after round 0, or a round 0 killed after a checkpoint (a signal writes one): go on from it
        goes_on = r > 0 or checkpoint.has_checkpoint(member["run_dir"])
        tree["trainer"].update(stop_at_step=None if last else boundary, resume=member["run_dir"] if goes_on else None,
                               test_on="last")  # best-weights files are per run: a copied state cannot name them
        tree["tracking"]["run_name"] = f"pbt member {member['id']}"
        return RunSpec.from_yaml(yaml.safe_dump(tree))

    def _train_round(self, state: dict[str, Any], r: int, boundary: int) -> list[dict[str, Any]]:
        jobs = []
        for member in state["members"]:
            job_dir = Path(member["run_dir"]) / "pbt"
            job_dir.mkdir(parents=True, exist_ok=True)
            result = job_dir / f"result-{boundary:08d}.json"
            lineage = member["lineage"][-1] if member["lineage"] else None
            tags = {"pbt.member": str(member["id"]), "pbt.lineage": json.dumps(member["lineage"])}
            if lineage is not None:
                tags.update({"pbt.copied_member": str(lineage["from"]), "pbt.copied_at_step": str(lineage["step"])})
            new = _new_this_round(member, r, self.boundaries)
            job = {"spec": self._member_spec(member, r, boundary).to_yaml(), "parent_run_id": self.parent_run_id,
                   "hparams": member["hparams"] if new else {}, "tags": tags, "result": str(result),
                   "round_start": self.boundaries[r - 1] if r else 0}
            if self.launched is not None:
                job.update(self.launched.job_fields())
            path = job_dir / f"job-{boundary:08d}.json"
            path.write_text(json.dumps(job))
            jobs.append((path, result))
            if new:  # the member's hyperparameter schedule: from which step on it trained with which values
                member["schedule"].append([self.boundaries[r - 1] if r else 0, dict(member["hparams"])])
        todo = [(p, res) for p, res in jobs if not res.is_file()]  # a resumed round: finished members stay finished
        if self.launched is not None:
            self.launched([p for p, _ in todo])
        elif self.settings.n_jobs == 1:
            for path, _ in todo:
                _run_in_process(path)
        else:
            with ThreadPoolExecutor(self.settings.n_jobs) as pool:
                try:
                    for code, path in pool.map(_run_subprocess, [p for p, _ in todo]):
                        if code != 0:
                            raise RuntimeError(f"PBT member job {path} failed (exit code {code}); see its runner.log")
                except KeyboardInterrupt:  # Ctrl-C, SIGTERM/SIGHUP: the members stop with the sweep (at a step
                    # boundary, their checkpoint written, their runs KILLED) before the pool is left
                    _stop_members()
                    raise
        return [json.loads(res.read_text()) for _, res in jobs]

    def _exploit_and_explore(self, state: dict[str, Any], r: int, boundary: int) -> None:
        rng = _rng_from_json(state["rng"])
        order = ranked(state["members"], self.maximize)
        n = max(1, int(len(order) * self.settings.quantile))
        finite = [m for m in order if math.isfinite(m["objectives"][-1][1])]  # not diverged (NaN)
        if not finite:
            raise SpecError(f"hydra.sweeper.params: every member diverged by step {boundary} (a NaN "
                            f"{self.base.objective.metric}); narrow the space toward smaller lrs, or clip gradients")
        # the bottom quantile and every diverged member copy one of the top quantile's finite members
        top = finite[:n]
        bottom = [m for m in order if m not in top and (m in order[-n:] or m not in finite)]
        for member in state["members"]:  # PB2's data: how much each member improved in this round
            objectives = member["objectives"]
            if len(objectives) >= 2:
                gain = objectives[-1][1] - objectives[-2][1]
                if math.isfinite(gain):
                    state["pb2_history"].append([r, dict(member["hparams"]), gain if self.maximize else -gain])
        history = [(h[0], h[1], h[2]) for h in state["pb2_history"] if h[0] >= r - 3]  # recent rounds only
        for member in bottom:
            source = rng.choice(top)
            copy_checkpoint(Path(source["run_dir"]), Path(member["run_dir"]), member["run_id"])
            member["seed"] = source["seed"]  # the data order is the seed's: it goes with the copied position
            member["schedule"] = [list(e) for e in source["schedule"]]  # its trajectory up to here is the source's
            if self.settings.explore == "pb2":
                member["hparams"] = explore.pb2_propose(self.space, history, r + 1, rng, self.settings.pb2_kappa)
            else:
                member["hparams"] = explore.perturb(source["hparams"], self.space, rng, self.settings.perturb,
                                                    self.settings.resample_probability)
            member["lineage"].append({"from": source["id"], "step": boundary, "run": source["run_id"]})
            member["objectives"][-1] = list(source["objectives"][-1])  # it stands where its source stands
            log.info("PBT: member %d copies member %d at step %d and explores %s", member["id"], source["id"], boundary,
                     ", ".join(f"{k}={v:.4g}" for k, v in member["hparams"].items()))
        state["rng"] = _rng_to_json(rng)

    def _log_parent(self, metrics: dict[str, float], step: int) -> None:
        if not self.parent_run_id:
            return
        from runner.tracking.mlflow_store import open_client

        client = open_client(self.base.tracking.uri)
        for key, value in metrics.items():
            if math.isfinite(value):
                client.log_metric(self.parent_run_id, key, value, step=step)


def ranked(members: list[dict[str, Any]], maximize: bool) -> list[dict[str, Any]]:
    """Best first by the objective at the last boundary; a NaN objective last."""
    def key(m: dict[str, Any]) -> float:
        value = m["objectives"][-1][1]
        return -math.inf if math.isnan(value) else (value if maximize else -value)
    return sorted(members, key=key, reverse=True)


def _new_this_round(member: dict[str, Any], r: int, boundaries: list[int]) -> bool:
    """Whether the member's hyperparameters are new this round: its first, or right after it copied another."""
    return r == 0 or bool(member["lineage"]) and member["lineage"][-1]["step"] == boundaries[r - 1]


def copy_checkpoint(source_dir: Path, target_dir: Path, target_run_id: str) -> Path:
    """The source's newest checkpoint as the target's own: exact in every tensor, but naming the target's
    MLflow run, so the target's run goes on in its own records."""
    path, state = checkpoint.read(source_dir)  # a sharded folder: its record only; its shards are linked
    keep = RunSpec.from_yaml(state["spec"]).trainer.keep_checkpoints
    if path.is_dir():
        return checkpoint.copy(path, target_dir / "checkpoints", {"mlflow_run_id": target_run_id}, keep)
    state["mlflow_run_id"] = target_run_id  # a one-file checkpoint (written before they were sharded)
    step = int(state["progress"]["step"])
    return checkpoint.save(target_dir / "checkpoints", step, state, keep)


def _run_in_process(job: Path) -> None:
    from runner.search.pbt.member import run_job

    run_job(job)


_running: set[subprocess.Popen] = set()  # the member processes of this sweep now (n_jobs > 1)
_running_lock = threading.Lock()


def _run_subprocess(job: Path) -> tuple[int, Path]:
    # the member watches this process: it stops (as on SIGTERM) when the sweep dies, even by SIGKILL
    env = {**os.environ, SWEEP_PID_ENV: str(os.getpid())}
    with open(job.with_suffix(".log"), "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runner.search.pbt.member", str(job)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
        with _running_lock:
            _running.add(proc)
        try:
            code = proc.wait()
        finally:
            with _running_lock:
                _running.discard(proc)
    return code, job


def _stop_members() -> None:
    """SIGTERM to every member process still running: each stops as a signalled run does."""
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def _rng_to_json(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from_json(data: list) -> random.Random:
    rng = random.Random()
    rng.setstate((data[0], tuple(data[1]), data[2]))
    return rng

"""The sweeper's claim on a study (storage.once_per_study: runner's one MLflow parent run per study), raced by
real processes on sqlite and on a real PostgreSQL server (tests/servers/postgres.py): exactly one process
makes the value and all get it; a maker still at work keeps its claim however long it takes; a claim whose
maker was killed is taken over as soon as its process is gone, and one whose maker stopped stamping it
(frozen, or on another host) once its stamp has stood still for silent_s, not after a fixed wait (it was
120 s). The claim goes through Optuna's public API only, and leaves no claim study behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from tests.servers.postgres import postgres_database, postgres_server, wait_until  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]
CLAIMANT = '''
import json, os, sys, time
from pathlib import Path
from hydra_plugins.runner_optuna_sweeper.storage import once_per_study, open_storage

url, attr, where, silent_s, make_s = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])

def make():
    with open(where / f"{attr}.makers", "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(make_s)
    return f"made by {os.getpid()}"

if os.environ.get("CLAIM_BEAT_S"):  # a maker that misses its beats, as a process starved of CPU does
    import hydra_plugins.runner_optuna_sweeper.storage as storage
    storage.CLAIM_BEAT_S = float(os.environ["CLAIM_BEAT_S"])
if os.environ.get("MAKE_UNTIL"):  # the value is made once this file exists (the test says when)
    make_until = Path(os.environ["MAKE_UNTIL"])
    def make():
        with open(where / f"{attr}.makers", "a") as f:
            f.write(f"{os.getpid()}\\n")
        while not make_until.exists():
            time.sleep(0.05)
        return f"made by {os.getpid()}"
import optuna  # imported before the mark: a racer that marked is about to read the claim
(where / f"{attr}.started-{os.getpid()}").touch()
value, made = once_per_study(open_storage(url), "s", attr, make, silent_s=silent_s)
print(json.dumps({"value": value, "made": made, "pid": os.getpid()}))
'''


def claimant(where: Path, url: str, attr: str, silent_s: float, make_s: float, **env_extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "sweeper")]), **env_extra}
    return subprocess.Popen([sys.executable, str(where / "claimant.py"), url, attr, str(where), str(silent_s),
                             str(make_s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def makers(where: Path, attr: str) -> list[int]:
    file = where / f"{attr}.makers"
    return [int(line) for line in file.read_text().split()] if file.exists() else []


def outcomes(procs: list[subprocess.Popen]) -> list[dict]:
    found = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def race(where: Path, url: str, attr: str, silent_s: float, n: int = 3) -> tuple[list[dict], float]:
    """n claimants started together; what each got, and the seconds until the last one had it."""
    began = time.monotonic()
    got = outcomes([claimant(where, url, attr, silent_s, 0.3) for _ in range(n)])
    return got, time.monotonic() - began


def holder(where: Path, url: str, attr: str) -> subprocess.Popen:
    """A claimant that makes its value for 10 minutes: returned once it holds the claim and is making it."""
    proc = claimant(where, url, attr, 600, 600)
    assert wait_until(lambda: makers(where, attr) == [proc.pid] or proc.poll() is not None, 120), proc.communicate()
    assert proc.poll() is None, proc.communicate()
    return proc


@pytest.fixture
def storages(tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The storage URL with study "s" made; the script every claimant runs in tmp_path."""
    url = (request.getfixturevalue("postgres_database") if request.param == "postgresql"
           else f"sqlite:///{tmp_path / 'study.db'}")
    optuna.create_study(study_name="s", storage=url)
    (tmp_path / "claimant.py").write_text(CLAIMANT)
    return url


def one_maker(got: list[dict], where: Path, attr: str, before: list[int] = ()) -> None:
    made = [g for g in got if g["made"]]
    assert len(made) == 1 and makers(where, attr) == [*before, made[0]["pid"]], (got, makers(where, attr))
    assert {g["value"] for g in got} == {f"made by {made[0]['pid']}"}


def no_claim_left(url: str) -> None:
    assert optuna.get_all_study_names(url) == ["s"]


def killed_makers_claim_is_taken_over_when_its_process_is_gone(where: Path, url: str) -> None:
    held = holder(where, url, "parent")
    held.kill()
    held.wait()
    # the stamp's silence would take an hour, past the racers' own deadline: only the dead pid can hand the claim
    # over, so the race ending at all shows it did (no clock read: a busy machine's speed decides nothing)
    got, _ = race(where, url, "parent", silent_s=3600, n=2)
    one_maker(got, where, "parent", before=[held.pid])
    no_claim_left(url)


@pytest.mark.parametrize("storages", ["sqlite"], indirect=True)
def test_a_killed_makers_claim_is_taken_over_as_soon_as_its_process_is_gone_and_one_racer_makes_the_value(
        tmp_path: Path, storages: str) -> None:
    killed_makers_claim_is_taken_over_when_its_process_is_gone(tmp_path, storages)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("storages", ["sqlite", "postgresql"], indirect=True)
def test_racing_processes_make_the_value_once_whoever_holds_the_claim_and_however_it_ends(
        tmp_path: Path, storages: str) -> None:
    url = storages
    got, _ = race(tmp_path, url, "fresh", silent_s=60, n=4)  # nobody holds it: one of four makes it
    one_maker(got, tmp_path, "fresh")
    # a live maker working longer than silent_s keeps its claim: its stamp moves
    slow = claimant(tmp_path, url, "slow", 2, 6)
    assert wait_until(lambda: makers(tmp_path, "slow") == [slow.pid], 120)
    got, _ = race(tmp_path, url, "slow", silent_s=2)
    one_maker([*got, *outcomes([slow])], tmp_path, "slow")
    if storages == "postgresql":
        killed_makers_claim_is_taken_over_when_its_process_is_gone(tmp_path, url)
    # a frozen maker (SIGSTOP: its process lives, its stamp stands still) loses its claim after silent_s
    frozen = holder(tmp_path, url, "frozen")
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        got, _ = race(tmp_path, url, "frozen", silent_s=3)
        assert time.monotonic() - stopped >= 3
        one_maker(got, tmp_path, "frozen", before=[frozen.pid])
    finally:
        frozen.kill()
        frozen.wait()
    no_claim_left(url)


@pytest.mark.parametrize("storages", ["sqlite"], indirect=True)
def test_a_live_maker_on_this_host_that_misses_its_beats_keeps_its_claim(tmp_path: Path, storages: str) -> None:
    """Issue 35 item 12: under a heavy load a live sweep process missed its beat and a second one made a second
    parent run for the study. A maker that beats once and never again, alive on this host, keeps its claim
    while racers that count 0.2 s of silence as lost wait; the value is made once, by it."""
    release = tmp_path / "release"
    holder_proc = claimant(tmp_path, storages, "late", 600, 0, CLAIM_BEAT_S="3600", MAKE_UNTIL=str(release))
    assert wait_until(lambda: makers(tmp_path, "late") == [holder_proc.pid] or holder_proc.poll() is not None, 120)
    racers = [claimant(tmp_path, storages, "late", 0.2, 0) for _ in range(2)]
    # the racers have started and had many times their 0.2 s of silence to judge the claim lost (a lower bound:
    # a slower machine only waits longer), or one already made the value a second time
    assert wait_until(lambda: len(list(tmp_path.glob("late.started-*"))) == 3 or makers(tmp_path, "late")[1:], 120)
    wait_until(lambda: makers(tmp_path, "late")[1:], 5)
    release.touch()
    got = outcomes([holder_proc, *racers])
    one_maker(got, tmp_path, "late")
    no_claim_left(storages)


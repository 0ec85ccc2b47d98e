"""The suite's temporary directories are its own: other pytest runs on the machine cannot remove them."""
from __future__ import annotations

import getpass
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

PROBE = '''
import os, time
from pathlib import Path

def test_holds_its_tmp_path(tmp_path):
    (tmp_path / "mine").write_text("x")
    Path(os.environ["PROBE_OUT"]).write_text(str(tmp_path))
    deadline = time.monotonic() + 60
    while not Path(os.environ["PROBE_GO"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "mine").read_text() == "x"
'''


def test_a_foreign_pytest_cannot_remove_the_suites_temporary_directories(tmp_path: Path) -> None:
    """A run of this suite (the probe, with tests/temp_base.py, which tests/conftest.py loads) keeps its tmp_path while a
    foreign pytest runs twice beside it: once with pytest's defaults, once emptying pytest-of-<user>
    (as `--basetemp` there does; pytest's own cleanup of that folder spares only directories whose
    lock it sees). TMPDIR is this test's own, so the machine's other runs are not touched."""
    temproot = tmp_path / "tmp"
    temproot.mkdir()
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "test_probe.py").write_text(PROBE)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "test_foreign.py").write_text("def test_one(tmp_path):\n    assert tmp_path.exists()\n")
    out, go = tmp_path / "probe_out", tmp_path / "probe_go"
    env = {**os.environ, "TMPDIR": str(temproot), "PROBE_OUT": str(out), "PROBE_GO": str(go)}
    env.pop("PYTEST_ADDOPTS", None)
    ours = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.temp_base", "-p", "no:cacheprovider",
                             str(tmp_path / "ours")], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not out.exists() and ours.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), ours.communicate()[0]
        held = Path(out.read_text())
        assert held.is_relative_to(temproot / f"runner-tests-{os.getuid()}"), held
        pytest_of_user = temproot / f"pytest-of-{getpass.getuser()}"
        for extra in ([], ["--basetemp", str(pytest_of_user)]):
            foreign = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra,
                                      str(tmp_path / "foreign")], cwd=tmp_path / "foreign", env=env,
                                     capture_output=True, text=True, timeout=120)
            assert foreign.returncode == 0, foreign.stdout
        assert (held / "mine").read_text() == "x"
    finally:
        go.write_text("")
        output = ours.communicate(timeout=120)[0]
    assert ours.returncode == 0, output

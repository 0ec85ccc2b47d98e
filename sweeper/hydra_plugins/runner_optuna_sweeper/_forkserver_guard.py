"""Imported by the trial fork server (and only there) as it starts: it dies with the sweep.

multiprocessing's fork server exits when the sweep's end of its 'alive' pipe closes, but it hands a
copy of that end to every process it forks, so while trials run it never sees the sweep go: a
SIGKILLed sweep left its fork server and trials running to the end. Here the kernel kills the fork
server with its parent (PR_SET_PDEATHSIG), and each trial, having the same setting towards the fork
server (_slots), is interrupted in turn. The sweep names itself in RUNNER_SWEEP_PID; anywhere but in
a direct child of that process this module does nothing.
"""
import os
import signal

from hydra_plugins.runner_optuna_sweeper._slots import SWEEP_PID_ENV, die_with_parent

if os.environ.get(SWEEP_PID_ENV) == str(os.getppid()):
    die_with_parent(signal.SIGKILL, int(os.environ[SWEEP_PID_ENV]))

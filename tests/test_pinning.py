"""rollout.cpu_affinity / train.cpu_affinity: the rollout side's PROCESSES go to the rollout cores, the
trainer process's THREADS stay on the trainer's (they share its interpreter lock: one preempted on a busy
rollout core while holding it stalls training; moerl.train.components.pinned)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from moerl.runtime.procs import pdeathsig_preexec
from moerl.train.components import pinned

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs two usable cores (Linux)")


@pytest.fixture
def cores():
    """(trainer core, rollout core); this thread pinned to the trainer's for the test, restored after."""
    before = os.sched_getaffinity(0)
    trainer, rollout = min(before), max(before)
    os.sched_setaffinity(0, {trainer})
    yield trainer, rollout
    os.sched_setaffinity(0, before)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_pinned_gives_processes_the_cores_and_gives_threads_back(cores):
    trainer, rollout = cores
    stop = threading.Event()
    with pinned([rollout]):
        assert os.sched_getaffinity(0) == {rollout}
        proc = _sleeper()
        thread = threading.Thread(target=stop.wait, daemon=True)
        thread.start()
        assert os.sched_getaffinity(thread.native_id) == {rollout}  # inherited inside the block
    try:
        assert os.sched_getaffinity(0) == {trainer}
        assert os.sched_getaffinity(thread.native_id) == {trainer}  # moved back at the exit
        assert os.sched_getaffinity(proc.pid) == {rollout}  # the process keeps the rollout cores
    finally:
        stop.set()
        proc.kill()
        proc.wait()


def test_pinned_leaves_older_threads_alone(cores):
    trainer, rollout = cores
    stop = threading.Event()
    older = threading.Thread(target=stop.wait, daemon=True)
    older.start()
    os.sched_setaffinity(older.native_id, {rollout})  # some thread of the process with cores of its own
    try:
        with pinned([rollout]):
            pass
        assert os.sched_getaffinity(older.native_id) == {rollout}
    finally:
        stop.set()


def test_pdeathsig_preexec_pins_the_child_whichever_thread_starts_it(cores):
    """A process started later by a thread on the trainer's cores (failover's spawner restarting a server, the
    reward dispatcher replacing a worker) still gets the cores it was given."""
    trainer, rollout = cores
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            preexec_fn=pdeathsig_preexec(os.getpid(), cpu_affinity=[rollout]))
    plain = _sleeper()
    try:
        assert os.sched_getaffinity(proc.pid) == {rollout}
        assert os.sched_getaffinity(plain.pid) == {trainer}  # without it: the forking thread's cores
    finally:
        for p in (proc, plain):
            p.kill()
            p.wait()


def test_a_server_the_cluster_spawns_later_gets_the_recorded_cores(cores, tmp_path):
    """RolloutCluster records the cores of the thread that starts it; a server it spawns later (failover's
    spawner thread, on the trainer's cores) is pinned to them all the same."""
    from moerl.rollout.launcher import RolloutCluster

    trainer, rollout = cores
    cluster = RolloutCluster(str(tmp_path), 1, log_dir=str(tmp_path))
    cluster._cpu_affinity = {rollout}  # what start() records under pinned_start
    child = cluster._spawn("server 0", 0, "http://127.0.0.1:1", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert os.sched_getaffinity(child.proc.pid) == {rollout}
    finally:
        child.proc.kill()
        child.proc.wait()
        child.log_file.close()


def test_the_http_worker_process_gets_the_rollout_cores(cores):
    """The producer's HTTP worker (a process: rollout-side work) is pinned to rollout.cpu_affinity from its
    first instruction, while the thread that starts it stays on the trainer's cores."""
    from moerl.rollout.http_worker import HttpWorker

    trainer, rollout = cores
    worker = HttpWorker(timeout_s=5.0, cpu_affinity=[rollout]).start()
    try:
        assert os.sched_getaffinity(worker.proc.pid) == {rollout}
        assert os.sched_getaffinity(0) == {trainer}
    finally:
        worker.close()

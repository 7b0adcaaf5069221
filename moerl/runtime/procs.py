"""Child processes that die with their parent, and a child environment free of torchrun's variables
(leaf module: standard library only).

* :func:`die_with_parent` / :func:`pdeathsig_preexec`: Linux ``prctl(PR_SET_PDEATHSIG, sig)``
  (prctl(2)) through ctypes, so a rollout server, the router, a reward worker or a torchrun worker is
  signalled when the process (strictly: the thread) that started it dies, even by SIGKILL, when no
  Python cleanup runs. No-op on other systems.
* :func:`child_env`: ``os.environ`` without the variables torchrun sets for its workers (RANK,
  WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ...). A process that rank 0 starts is not a rank of the
  training job; inheriting ``TORCHELASTIC_USE_AGENT_STORE=True`` makes ``torch.distributed.rendezvous
  ("tcp://...")`` in that process (SGLang's ``init_custom_process_group``, the reference server's
  weight-update group) connect as a client to a store it assumes the elastic agent hosts, instead of
  creating it, which hung ``rollout.weight_sync=distributed`` under torchrun.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Iterable, Mapping, Optional

__all__ = ["TORCHRUN_ENV_KEYS", "child_env", "current_cpu_affinity", "die_with_parent", "pdeathsig_preexec",
           "die_with_torchrun_agent", "pinned"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# What torch.distributed.run (torch/distributed/elastic/agent/server/local_elastic_agent.py) puts into
# each worker's environment, plus the TORCHELASTIC_* / TORCH_NCCL_* prefixes handled in child_env.
TORCHRUN_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_TORCHRUN_ENV_PREFIXES = ("TORCHELASTIC_",)
# loaded once here: a Popen preexec_fn runs between fork and exec, where dlopen may deadlock
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def child_env(base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) without torchrun's per-worker variables
    (:data:`TORCHRUN_ENV_KEYS` and every ``TORCHELASTIC_*``), for processes a rank starts that are not
    ranks of its job (rollout servers, router, reward workers)."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in TORCHRUN_ENV_KEYS or key.startswith(_TORCHRUN_ENV_PREFIXES):
            del env[key]
    return env


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: Optional[int] = None) -> bool:
    """Ask the kernel to send ``sig`` to THIS process when its parent (the thread that forked it)
    dies: ``prctl(PR_SET_PDEATHSIG, sig)`` (Linux). If ``expected_parent`` is given and the parent is
    already another process (it died before the call, the child was re-parented), exit at once with
    status 1. Returns True when the death signal is set, False on other systems.

    Raises:
        OSError: prctl refused (errno named).
    """
    if _LIBC is None:
        return False
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
    return True


def current_cpu_affinity() -> Optional[set[int]]:
    """The calling thread's cores (``os.sched_getaffinity(0)``), or None where the OS cannot tell: what an
    object that starts processes later from another thread records, to give them as ``cpu_affinity`` to
    :func:`pdeathsig_preexec`."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def pdeathsig_preexec(parent_pid: int, sig: int = signal.SIGKILL,
                      cpu_affinity: Optional[Iterable[int]] = None) -> Callable[[], None]:
    """``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when ``parent_pid`` (the caller,
    ``os.getpid()``) dies, and exits at once if it already has. Set the death signal from the thread
    that lives as long as the child should (the kernel tracks the forking thread). ``cpu_affinity``
    (cores, or None = inherit the forking thread's): the child is pinned to them (os.sched_setaffinity)
    before it executes anything, whichever thread starts it; best effort (cores no longer allowed, e.g.
    after a cpuset change: the child keeps the forking thread's)."""
    cores = None if cpu_affinity is None else set(cpu_affinity)

    def fn() -> None:
        if cores and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, cores)
            except OSError:
                pass
        die_with_parent(sig, expected_parent=parent_pid)

    return fn


def die_with_torchrun_agent(grace_s: float = 20.0) -> bool:
    """In a torchrun worker (``TORCHELASTIC_RUN_ID`` set): end this process when its elastic agent dies.

    A SIGTERMed agent forwards SIGTERM to its workers, but a SIGKILLed one (OOM killer, ``kill -9``,
    a scheduler's hard stop) forwards nothing, and the workers, rank 0's rollout servers and reward
    workers ran on. Here the kernel sends SIGTERM to the worker when the agent dies
    (:func:`die_with_parent`), so rank 0's handlers stop its servers as on a forwarded SIGTERM; a
    daemon thread SIGKILLs the worker ``grace_s`` seconds after the agent's death if it is still alive
    (its main thread blocked in a collective that never returns), and the servers then get their own
    death signal. Returns True when set up, False outside torchrun or off Linux.
    """
    if not os.environ.get("TORCHELASTIC_RUN_ID") or not die_with_parent(signal.SIGTERM):
        return False
    import threading
    import time

    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(0.5)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="moerl-agent-watch", daemon=True).start()
    return True


@contextlib.contextmanager
def pinned(cores: Iterable[int]):
    """The calling thread pinned to ``cores`` (os.sched_setaffinity) inside the block, so the processes
    started there inherit them; its own affinity is restored after, and so is that of every Python thread
    started inside the block (a reward pool's dispatcher, the broker's reader, the cluster's monitor and
    spawner, and threads those start before they are moved): they share the trainer's interpreter lock,
    and one of them preempted on a busy rollout core while holding it stalls the training thread.
    tools/bench_async.py, async staleness 1: the update took 1.09-1.34x sync's with the producer and push
    threads on the rollout core, 0.97-1.02x on the trainer's. Processes those threads start later get
    the rollout cores explicitly (moerl.runtime.procs.pdeathsig_preexec ``cpu_affinity``). Empty
    ``cores``: no-op."""
    cores = list(cores or [])
    if not cores:
        yield
        return
    mine, before = os.sched_getaffinity(0), set(threading.enumerate())
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
        moved: set = set()
        while True:  # until no new thread shows up (one started by a thread not yet moved)
            new = [t for t in threading.enumerate() if t not in before and t not in moved]
            if not new:
                break
            for t in new:
                moved.add(t)
                if t.native_id is not None and t.is_alive():
                    try:
                        os.sched_setaffinity(t.native_id, mine)
                    except OSError:  # ended meanwhile
                        pass

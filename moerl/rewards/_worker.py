"""The reward worker process: ``python -c "from moerl.rewards._worker import main; main(FD)"``.

Started by ``moerl.rewards.pool.RewardPool`` with ``subprocess.Popen`` (fork + exec of a fresh
interpreter, like multiprocessing's "spawn" start method, but without re-importing the trainer's
``__main__``, which would pull torch into every worker). FD is one end of a socket pair wrapped in a
``multiprocessing.connection.Connection``.

Protocol (pickled tuples): parent -> child: first an init dict, then ``(task_id, kind, payload)`` per
task, ``None`` to stop; child -> parent: ``("ready", pid)`` or ``("init_error", message)`` once, then
``(task_id, "ok", result)`` / ``(task_id, "error", repr)`` per task. The child exits when the parent
closes its end or dies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable


def call_reward(fn: Callable, kind: str, payload: tuple) -> Any:
    """Run one task: ``"sample"`` -> ``normalize_reward(fn(response, label, metadata))``;
    ``"group"`` -> ``normalize_group_reward(fn(responses, label, metadata), len(responses))``;
    ``"model"`` -> ``fn.score(prompts, responses)`` (a ``RewardModel``). Exceptions propagate."""
    from moerl.rewards.registry import normalize_group_reward, normalize_reward

    if kind == "sample":
        response, label, metadata = payload
        return normalize_reward(fn(response, label, metadata))
    if kind == "group":
        responses, label, metadata = payload
        return normalize_group_reward(fn(list(responses), label, metadata), len(responses))
    if kind == "model":
        prompts, responses = payload
        return fn.score(prompts, responses)
    raise ValueError(f"unknown reward task kind {kind!r}")


def watch_parent(ppid: int) -> None:
    """Exit this process (os._exit(0)) once its parent ``ppid`` is gone (checked every 0.5 s; run in a daemon
    thread: it works even while the main thread hangs in user code)."""
    while True:  # exit when orphaned, even if a reward function hangs in the main thread
        if os.getppid() != ppid:
            os._exit(0)
        time.sleep(0.5)


def child_setup(fd: int) -> tuple[Any, dict]:
    """Start-up of a child of moerl.rewards.pool.start_child (a reward worker, the RewardBroker): ignore
    SIGINT (Ctrl-C is the trainer's, which closes the pool), read the init dict from the socket ``fd``, exit
    once orphaned (watch_parent on init["parent_pid"]) and take the parent's sys.path (init["sys_path"]).
    Returns (the Connection, the init dict)."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    init = conn.recv()
    threading.Thread(target=watch_parent, args=(init["parent_pid"],), daemon=True).start()
    sys.path[:] = init["sys_path"]
    return conn, init


def main(fd: int) -> None:
    """Worker entry point (see the module docstring)."""
    conn, init = child_setup(fd)
    try:
        if init["kind"] == "model":
            from moerl.rewards.model import RewardModel

            fn: Any = RewardModel(init["model_path"], init["batch_size"], device=init["device"])
        else:
            from moerl.rewards.registry import resolve_reward_fn

            fn = resolve_reward_fn(init["function"], group=init["group"])
    except BaseException as e:  # noqa: BLE001 - any start-up failure is reported, not raised
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        tid, kind, payload = msg
        try:
            out = ("ok", call_reward(fn, kind, payload))
        except Exception as e:  # noqa: BLE001 - the pool turns it into error_value
            out = ("error", repr(e)[:2000])
        conn.send((tid, *out))

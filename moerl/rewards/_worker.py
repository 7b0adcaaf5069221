"""The reward worker process: ``python -c "from moerl.rewards._worker import main; main(FD)"``.

Started by ``moerl.rewards.pool.RewardPool`` with ``subprocess.Popen`` (fork + exec of a fresh
interpreter, like multiprocessing's "spawn" start method, but without re-importing the trainer's
``__main__``, which would pull torch into every worker). FD is one end of a socket pair wrapped in a
``multiprocessing.connection.Connection``.

Protocol (pickled tuples): parent -> child: first an init dict, then ``(task_id, kind, payload)`` per
task, ``None`` to stop; child -> parent: ``("ready", pid)`` or ``("init_error", message)`` once, then
``(task_id, "ok", result)`` / ``(task_id, "error", repr)`` per task. The child exits when the parent
closes its end or dies.

Task kinds (``call_reward``): ``"samples"`` (payload ``(responses, label, metadata)``: a contiguous chunk
of one group's responses, with ``reward.group`` false), scored one response at a time; each response's
exception is caught on its own, so the answer is always ``"ok"`` with a list of per-response outcomes
(``score_samples``): one message back per chunk instead of one per response. ``"sample"`` (one
response), ``"group"`` (a group function's whole group) and ``"model"`` (a reward-model batch) answer
``"error"`` with the exception's repr when they raise.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence


def score_samples(fn: Callable, responses: Sequence[str], label: str, metadata: Any) -> list[tuple[str, Any]]:
    """Score ``responses`` (one group's, or a chunk of it) one at a time with the per-sample function ``fn``.

    Returns:
        one outcome per response, in order: ``("ok", (score, metrics))`` (``normalize_reward`` of
        ``fn(response, label, metadata)``: a float and a dict of float metrics) or ``("error", repr)``
        (the ``repr`` of the ``Exception`` it raised, at most 2000 characters). A raising response does
        not stop the others. A ``BaseException`` that is no ``Exception`` (SystemExit, ...) propagates.
    """
    from moerl.rewards.registry import normalize_reward

    out: list[tuple[str, Any]] = []
    for response in responses:
        try:
            out.append(("ok", normalize_reward(fn(response, label, metadata))))
        except Exception as e:  # noqa: BLE001 - this response gets error_value, the others go on
            out.append(("error", repr(e)[:2000]))
    return out


def call_reward(fn: Callable, kind: str, payload: tuple) -> Any:
    """Run one task: ``"sample"`` -> ``normalize_reward(fn(response, label, metadata))``;
    ``"samples"`` -> ``score_samples(fn, responses, label, metadata)`` (per-response outcomes; a response's
    exception does not propagate); ``"group"`` -> ``normalize_group_reward(fn(responses, label, metadata),
    len(responses))``; ``"model"`` -> ``fn.score(prompts, responses)`` (a ``RewardModel``). Other exceptions
    propagate; an unknown kind raises ValueError."""
    from moerl.rewards.registry import normalize_group_reward, normalize_reward

    if kind == "samples":
        responses, label, metadata = payload
        return score_samples(fn, responses, label, metadata)
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

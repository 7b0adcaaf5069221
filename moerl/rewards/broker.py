"""``RewardBroker``: a ``RewardPool`` run in a child process, off the trainer's interpreter.

``RewardPool`` keeps one dispatcher thread in the process that owns it: it sends every task to a worker,
waits on the workers' pipes, watches the deadlines and hands each result back (one wake-up of the caller's
event loop per task: a chunk of a group's responses, see moerl.rewards.pool). In ``train.mode``
one_step_off / async that process is the trainer, and the dispatcher's interpreter-lock time is taken from
training: py-spy ``--gil`` on tools/bench_async.py's async run (128 samples per step, then one task per
sample) showed it holding the trainer's GIL about 34 ms per step, the largest of the rollout side's threads
there.

``RewardBroker`` starts ``python -c "from moerl.rewards.broker import main; main(FD)"``, which builds the
``RewardPool`` (same arguments: workers, per-task timeouts, crash isolation, reward model) and serves its
calls; the trainer process only pickles one message per group and reads one answer per group (a reader
thread resolves the call's future: one wake-up of the producer's loop per group). ``python
tools/bench_rewards.py`` (the demo's 16 groups x 8 per step): the caller's CPU per step 16.7-19.3 ms with
RewardPool (its dispatcher thread), 2.6-3.0 ms with RewardBroker (13-16 ms in the broker process), when the
pool sent one task per sample; since it sends a group's responses in ``num_workers`` chunks (32 tasks per
step instead of 128), on a 2-core machine: 4.3-4.9 ms with RewardPool (15.8-16.0 before on the same
machine), 2.1 ms with RewardBroker (5.3-5.7 ms in the broker process, 10.7 before). The pool's semantics
are unchanged: a hanging, raising or crashing sample gets ``error_value`` within ``timeout_s`` and its
worker is replaced, inside the broker process.

Wire (``multiprocessing.connection.Connection`` over a socket pair): parent -> child: an init dict, then
``(call_id, method, args)`` per call (method: score_group, score, stats, wait_ready), None to stop;
child -> parent: ``("ready", pid)`` or ``("init_error", exception)`` once, then ``("log", line)`` (the
pool's log lines, forwarded to the parent's ``log``) and ``(call_id, ok, value_or_exception)``. A log line
of a call is sent before its answer. The broker runs calls concurrently (a thread per call in flight, up to
:data:`MAX_CONCURRENT_CALLS`).

Failure: the broker runs no reward code itself (its workers do; with ``num_workers=0`` it scores inline,
without a timeout, as the pool does then), but it imports the ``reward.function`` module once, as the pool
does, to refuse a bad spec. If it dies anyway, every call in flight and every later
call raises ``RuntimeError`` naming it (the run stops; nothing is scored silently wrong). It is SIGKILLed
when the thread that built it exits (PR_SET_PDEATHSIG: build it on a thread that outlives it, as the
trainer's main thread does) and exits when orphaned; it ignores SIGINT (Ctrl-C is the trainer's, which
closes the broker). ``stats()["seconds"]`` is timed inside the broker (without the round trip).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

from moerl.rewards.pool import RewardResult

#: calls the broker process runs at once (each waits on its pool futures in a thread of the broker)
MAX_CONCURRENT_CALLS = 64
_METHODS = ("score_group", "score", "stats", "wait_ready")


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(f"{type(e).__name__}: {e}")


class RewardBroker:
    """A :class:`moerl.rewards.pool.RewardPool` in a child process (module docstring), with the pool's API:
    ``score_group``, ``ascore_group``, ``score``, ``stats``, ``wait_ready``, ``close``, context manager.

    Args:
        function: ``reward.function`` (as RewardPool).
        log: called in this process with each of the pool's log lines (timeouts, exceptions, crashes).
        start_timeout_s: seconds to wait for the broker to build its pool (its workers start in the
            background, as with RewardPool; ``wait_ready`` waits for them).
        **pool_kwargs: RewardPool's keyword arguments (group, num_workers, timeout_s, error_value,
            model_path, model_weight, rule_weight, model_batch_size, model_device).

    Raises:
        RewardConfigError: the pool refused its arguments (bad spec, timeout_s <= 0, ...): the same error
            RewardPool raises, from the broker process.
        RuntimeError: the broker process could not start, died, or did not answer in ``start_timeout_s``.

    Thread-safe like RewardPool. Results are RewardResult objects, equal to the pool's.
    """

    def __init__(self, function: str, *, log: Callable[[str], Any] = print, start_timeout_s: float = 120.0,
                 **pool_kwargs):
        from moerl.rewards.pool import start_child

        self.function, self.pool_kwargs, self._log = function, dict(pool_kwargs), log
        self.num_workers = int(pool_kwargs.get("num_workers", 2))
        self._lock = threading.Lock()  # _pending, _closed, _broken
        self._send_lock = threading.Lock()  # one message on the socket at a time
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._closed = False
        self._broken: Optional[BaseException] = None
        try:
            self._popen, self._conn = start_child("moerl.rewards.broker", {
                "function": function, "kwargs": self.pool_kwargs, "sys_path": list(sys.path),
                "parent_pid": os.getpid()})
        except OSError as e:
            raise RuntimeError(f"could not start the reward pool process ({sys.executable}): {e}") from e
        self.pid = self._popen.pid
        try:
            if not self._conn.poll(start_timeout_s):
                raise RuntimeError(f"the reward pool process (pid {self.pid}) did not start in {start_timeout_s:g} s")
            msg = self._conn.recv()
        except (EOFError, OSError):
            msg = ("init_error", RuntimeError(f"the reward pool process (pid {self.pid}) exited during start-up "
                                              f"(exit code {self._exit_code()}); see its stderr above"))
        except BaseException:
            self._kill()
            raise
        if msg[0] != "ready":
            self._kill()
            raise msg[1]
        self._reader = threading.Thread(target=self._read, name="moerl-reward-broker", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ the pool's API
    def score_group(self, uid: str, prompt: Any, responses: Sequence[str], label: str,
                    metadata: Any = None) -> list[RewardResult]:
        """RewardPool.score_group, in the broker process (same arguments, results and errors; also
        RuntimeError if the broker died)."""
        return self._call("score_group", uid, prompt, list(responses), label, metadata).result()

    async def ascore_group(self, uid: str, prompt: Any, responses: Sequence[str], label: str,
                           metadata: Any = None) -> list[RewardResult]:
        """``score_group`` for an asyncio event loop (awaits one answer per group without blocking the loop)."""
        return await asyncio.wrap_future(self._call("score_group", uid, prompt, list(responses), label, metadata))

    def score(self, items: Sequence[tuple[str, str, Any]]) -> list[RewardResult]:
        """RewardPool.score (evaluation items), in the broker process."""
        return self._call("score", list(items)).result()

    def stats(self) -> dict[str, float]:
        """RewardPool.stats of the broker's pool."""
        return self._call("stats").result()

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """RewardPool.wait_ready of the broker's pool (its workers started)."""
        self._call("wait_ready", timeout).result()

    def close(self) -> None:
        """Close the pool (its workers stop; calls in flight fail with RuntimeError) and end the broker
        (SIGKILL if it has not exited 5 s later). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            with self._send_lock:
                self._conn.send(None)
        except (OSError, ValueError):
            pass
        try:
            self._popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._kill()
        self._reader.join(timeout=5.0)
        self._conn.close()

    def __enter__(self) -> "RewardBroker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if hasattr(self, "_reader"):
                self.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: str, *args) -> Future:
        fut: Future = Future()
        # running from the start: an awaiting task that is cancelled (a producer shutting down) cannot cancel
        # it, so the reader's set_result never meets a cancelled future (InvalidStateError would end the reader)
        fut.set_running_or_notify_cancel()
        cid = next(self._ids)
        data = pickle.dumps((cid, method, args), protocol=pickle.HIGHEST_PROTOCOL)  # outside the locks; raises
        with self._lock:  # for arguments that cannot be pickled, before anything is registered
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            if self._broken is not None:
                raise self._broken
            self._pending[cid] = fut
        try:
            with self._send_lock:  # not _lock: the reader resolves answers while a long message is sent
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:
            with self._lock:
                self._pending.pop(cid, None)
            raise RuntimeError(f"the reward pool process (pid {self.pid}) is gone: {e}") from e
        return fut

    def _read(self) -> None:
        failure: Optional[BaseException] = None
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "log":
                    try:
                        self._log(msg[1])
                    except Exception:  # noqa: BLE001 - a broken logger must not lose a reward
                        pass
                    continue
                cid, ok, value = msg
                with self._lock:
                    fut = self._pending.pop(cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(value) if ok else fut.set_exception(value)
        except BaseException as e:  # noqa: BLE001 - an unreadable answer: no caller may wait for ever
            failure = RuntimeError(f"an answer of the reward pool process (pid {self.pid}) could not be read: {e!r}")
        finally:
            if failure is None:
                failure = RuntimeError("RewardPool is closed") if self._closed else RuntimeError(
                    f"the reward pool process (pid {self.pid}) died (exit code {self._exit_code()}); the run cannot "
                    "score rollouts (see its stderr above)")
            with self._lock:
                self._broken = self._broken or failure
                pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(failure)

    def _exit_code(self) -> Optional[int]:
        try:
            return self._popen.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def _kill(self) -> None:
        try:
            self._popen.kill()
        except OSError:
            pass
        self._popen.wait()


def main(fd: int) -> None:
    """Broker entry point (see the module docstring)."""
    from concurrent.futures import ThreadPoolExecutor

    from moerl.rewards._worker import child_setup
    from moerl.rewards.pool import RewardPool

    conn, init = child_setup(fd)
    lock = threading.Lock()

    def send(msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # may raise: run() then answers the error
        with lock:
            try:
                conn.send_bytes(data)
            except (OSError, ValueError):  # the parent is gone; watch_parent ends this process
                pass

    try:
        pool = RewardPool(init["function"], log=lambda line: send(("log", line)), **init["kwargs"])
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        send(("init_error", _portable(e)))
        return
    send(("ready", os.getpid()))

    def run(cid: int, method: str, args: tuple) -> None:
        try:
            if method not in _METHODS:
                raise ValueError(f"RewardBroker: unknown method {method!r}")
            send((cid, True, getattr(pool, method)(*args)))
        except BaseException as e:  # noqa: BLE001 - the caller's future raises it (a result that cannot be
            send((cid, False, _portable(e)))  # pickled included: every call gets an answer)

    calls = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_CALLS, thread_name_prefix="moerl-reward-call")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is None:
                break
            calls.submit(run, *msg)
    finally:
        pool.close()  # calls in flight fail with "RewardPool is closed"
        calls.shutdown(wait=True)
        conn.close()

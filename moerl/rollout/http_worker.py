"""A child process that makes the rollout producer's HTTP requests, off the trainer's interpreter.

In ``train.mode`` one_step_off / async the RolloutManager's producer (an asyncio loop in a thread of the
trainer process) keeps up to a batch of /generate requests in flight. With aiohttp in that thread, the
HTTP framing and the JSON encoding / decoding of every request (about 0.6 ms of CPU each, 0.07-0.09 s
per demo step of 128 samples) run under the trainer's interpreter lock, and every torch op the trainer
releases the lock for can be followed by a wait for the producer to hand it back. :class:`HttpWorker`
moves the requests into a child process (``python -m moerl.rollout.http_worker``, pinned to
``rollout.cpu_affinity``; the producer thread itself stays on the trainer's cores): the trainer process
only pickles the request body and unpickles the decoded answer through a socket pair. :class:`moerl.rollout.client.RolloutClient`
uses it for single attempts (``RolloutClient.worker``); its retry policy, failover checks
(``cluster.check_alive``) and result-id checks stay in the trainer process, unchanged.

Wire: ``multiprocessing.connection.Connection`` framing over ``socket.socketpair()``. Parent -> child:
``(request_id, url, payload)`` (POST JSON) or None (exit). Child -> parent: a list of ``(request_id,
status, body, error)``: status and the decoded JSON (text for HTTP >= 400), or status None and an error
string ("ClientConnectorError: ...") for a connection error, timeout or undecodable body, exactly the
failures RolloutClient retries. Answers that arrive within ``REPLY_COALESCE_S`` of each other travel as one
message, so a burst of answers wakes the producer (and takes the trainer's interpreter lock) once, not
once per request. The child exits when the socket closes (the parent closed it or died) and gets
SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG), so no worker outlives its trainer. A worker
that died is restarted by the next request, with one line on stderr ("[moerl] rollout HTTP worker (pid N)
died (signal SIGKILL); its requests in flight are retried; restarted as pid M"). It runs
in its own session and ignores SIGINT: a terminal's Ctrl-C is the trainer's (as for the servers and the
reward workers), so it neither dies of it nor prints a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Optional, Sequence


#: seconds the child waits after an answer for more answers to send with it (one wake-up of the parent)
REPLY_COALESCE_S = 0.002


class HttpWorkerError(RuntimeError):
    """The worker process could not be started (the message says why)."""


class HttpWorker:
    """POST JSON through a child process (see the module docstring). Thread model: :meth:`post` is awaited
    from ONE event loop (the producer's); :meth:`close` may be called from any thread once that loop no
    longer posts. A worker that died is started again by the next :meth:`post` (the requests it had in
    flight fail with an error string, which RolloutClient retries like a connection error).

    Args:
        timeout_s: per-request timeout (whole response), seconds.
        max_connections: the child's connection pool size.
        cpu_affinity: cores for the child (``os.sched_setaffinity``); empty: inherit.
    Raises:
        ValueError: timeout_s <= 0 or max_connections < 1.
    """

    def __init__(self, timeout_s: float = 600.0, max_connections: int = 512,
                 cpu_affinity: Sequence[int] = ()):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.timeout_s = float(timeout_s)
        self.max_connections = int(max_connections)
        self.cpu_affinity = list(cpu_affinity)
        self.proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._reading = False  # the reader is registered on self._loop
        self.starts = 0  # processes started so far (restarts after a death included)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "HttpWorker":
        """Start the child process (a no-op while one is running). Returns self.

        Raises:
            HttpWorkerError: the process could not be started.
        """
        if self.proc is not None and self.proc.poll() is None and self._conn is not None:
            return self
        self._drop_conn("the HTTP worker was restarted")
        from moerl.runtime.procs import child_env, pdeathsig_preexec

        old = self.proc

        ours, theirs = socket.socketpair()
        cfg = json.dumps({"fd": theirs.fileno(), "timeout_s": self.timeout_s,
                          "max_connections": self.max_connections})
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "moerl.rollout.http_worker", cfg],
                                         pass_fds=[theirs.fileno()], env=child_env(), stdin=subprocess.DEVNULL,
                                         # own session (as the servers): a terminal's Ctrl-C is the trainer's
                                         start_new_session=True, preexec_fn=pdeathsig_preexec(
                                             os.getpid(), cpu_affinity=self.cpu_affinity or None))
        except OSError as e:
            ours.close()
            raise HttpWorkerError(f"could not start the HTTP worker process ({sys.executable} -m "
                                  f"moerl.rollout.http_worker): {e}") from e
        finally:
            theirs.close()
        ours.setblocking(True)
        self._conn = Connection(ours.detach())
        self.starts += 1
        if old is not None:  # a restart: say so (the retried requests are otherwise silent)
            print(f"[moerl] rollout HTTP worker (pid {old.pid}) {_ended(old)}; its requests in flight are "
                  f"retried; restarted as pid {self.proc.pid}", file=sys.stderr, flush=True)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the child to exit (then kill it after ``timeout_s``); requests in flight fail."""
        conn, proc = self._conn, self.proc
        self._drop_conn("the HTTP worker was closed")
        if proc is not None:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None
        del conn

    def _drop_conn(self, why: str) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._reading and self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(conn.fileno())
                except (ValueError, OSError, RuntimeError):
                    pass
            self._reading = False
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
            conn.close()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                try:
                    fut.get_loop().call_soon_threadsafe(_set_result, fut, (None, None, f"HttpWorkerExit: {why}"))
                except RuntimeError:  # that loop is closed: nobody awaits it any more
                    pass

    # ------------------------------------------------------------------ requests
    async def post(self, url: str, payload: Any) -> tuple[Optional[int], Any, Optional[str]]:
        """POST ``payload`` as JSON to ``url`` from the child. Returns ``(status, body, None)`` (body: the
        decoded JSON for status < 400, else the response text) or ``(None, None, error)`` for a
        connection error, timeout, undecodable answer or a worker that died meanwhile."""
        loop = asyncio.get_running_loop()
        if self._conn is None or self.proc is None or self.proc.poll() is not None:
            self.start()
        if self._loop is not loop or not self._reading:
            self._loop = loop
            loop.add_reader(self._conn.fileno(), self._on_readable)
            self._reading = True
        rid = next(self._ids)
        fut = loop.create_future()
        self._pending[rid] = fut
        try:
            self._conn.send((rid, url, payload))
        except (OSError, ValueError) as e:  # the child is gone: fail this one, restart on the next post
            self._pending.pop(rid, None)
            self._drop_conn(f"the HTTP worker's socket failed: {e}")
            return None, None, f"HttpWorkerExit: {type(e).__name__}: {e}"
        return await fut

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                for rid, status, body, err in conn.recv():
                    fut = self._pending.pop(rid, None)
                    if fut is not None and not fut.done():
                        fut.set_result((status, body, err))
        except (EOFError, OSError) as e:  # the child exited: fail what was in flight, restart on the next post
            code = self.proc.poll() if self.proc is not None else None
            self._drop_conn(f"the HTTP worker process exited (status {code}): {type(e).__name__}")


def _ended(proc: subprocess.Popen) -> str:
    """How a worker process ended, for the restart line: 'died (signal SIGKILL)', 'exited (status 1)',
    or 'lost its socket' while it still runs (it exits when it reads the close)."""
    import signal

    code = proc.poll()
    if code is None:
        return "lost its socket"
    if code < 0:
        try:
            return f"died (signal {signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited (status {code})"


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


# ---------------------------------------------------------------------------------------- child process


async def _serve(conn: Connection, timeout_s: float, max_connections: int) -> None:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(10.0, timeout_s))
    session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=max_connections),
                                    trust_env=False)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    tasks: set = set()
    outbox: list = []

    def flush() -> None:
        batch = outbox[:]
        outbox.clear()
        try:
            conn.send(batch)
        except (OSError, ValueError):
            done.set()

    async def one(rid: int, url: str, payload: Any) -> None:
        try:
            async with session.post(url, json=payload) as r:
                status = r.status
                body = await (r.json(content_type=None) if status < 400 else r.text())
            out = (rid, status, body, None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # what RolloutClient retries
            out = (rid, None, None, f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - reported to the parent, which retries or raises
            out = (rid, None, None, f"{type(e).__name__}: {e}")
        if not outbox:
            loop.call_later(REPLY_COALESCE_S, flush)
        outbox.append(out)

    def on_readable() -> None:
        try:
            while conn.poll():
                msg = conn.recv()
                if msg is None:
                    done.set()
                    return
                t = loop.create_task(one(*msg))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        except (EOFError, OSError):
            done.set()

    loop.add_reader(conn.fileno(), on_readable)
    try:
        await done.wait()
    finally:
        loop.remove_reader(conn.fileno())
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()


def main(argv: Optional[list[str]] = None) -> int:
    """Child entry point: ``python -m moerl.rollout.http_worker '{"fd": N, "timeout_s": ..., ...}'``."""
    import signal

    # Ctrl-C is the trainer's (its handler stops the run; this process then exits with its socket); a
    # KeyboardInterrupt here would only print a traceback under the trainer's exit message
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = json.loads((argv if argv is not None else sys.argv[1:])[0])  # pinned before exec (HttpWorker.start)
    conn = Connection(int(cfg["fd"]))
    try:
        asyncio.run(_serve(conn, float(cfg["timeout_s"]), int(cfg["max_connections"])))
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

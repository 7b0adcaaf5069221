"""The RolloutManager's producer in a child process (``rollout.producer_process``), off the trainer's core.

In ``train.mode`` one_step_off / async the producer (:class:`moerl.rollout.manager.RolloutManager`: the
sampler's draws, prompt encoding, the /generate requests, result parsing, decoding and reward dispatch)
runs while the trainer trains. As a thread of the trainer process it shares the trainer's core and
interpreter lock: about 0.013 s of core-0 CPU per demo step (tools/bench_async.py, py-spy), and every
torch op the training thread releases the lock for may be followed by a wait for the producer to give it
back. :class:`RolloutManagerProcess` runs the whole RolloutManager in a child process instead
(``python -m moerl.rollout.producer_process``, on the trainer's cores unless ``rollout.producer_cpu_affinity``
says otherwise, its reward workers on ``rollout.cpu_affinity``; dying with the thread that started it:
PR_SET_PDEATHSIG), as verl's and slime's rollout workers are processes of their own.
The child has its own RolloutClient (aiohttp in its own event loop: no separate HTTP worker) and its own
:class:`moerl.rewards.RewardPool` (reward.* keys; the trainer's pool still scores evaluations).

What stays in the trainer: the weight push itself (its export and send, through the trainer's
RolloutCluster) and the cluster (failover restarts). The servers' pause and continue around an async push
are sent by the child (on its cores, rollout.producer_cpu_affinity) to the URLs the trainer names; a server that fails them there
is handed back to the trainer's cluster (:meth:`RolloutManagerProcess._update_now`). The child sees the cluster through
:class:`_ClusterView`: the live server URLs, the failover flag and the cluster's fatal error, sent by the
trainer when they change (polled every ``CLUSTER_POLL_S``) and before every batch.

Wire: three ``multiprocessing.connection.Connection`` socket pairs, each strictly request -> answer from
one trainer thread at a time, carrying plain pickles (by value, so torch tensors travel too): ``main`` (the spec, then get_batch / state_dict / close; the training
thread), ``push`` (begin / hold / end of a weight update; the push thread), ``cluster`` (one-way cluster
views). An answer is ``("ok", value)`` or ``("err", exception)`` (an exception that cannot be pickled
travels as a RuntimeError with its type and text). An exchange that does not complete (the child died, or
e.g. KeyboardInterrupt between the request and its answer) leaves the answer unread: the proxy is broken
from then on (every later call raises ProducerProcessError saying what happened, rather than reading the
wrong answer), and close() only waits ``CLOSE_TIMEOUT_S`` for the child to exit before killing it.

The resume contract is the RolloutManager's (its module docstring): ``state_dict`` is the child's.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from moerl.rollout.common import control_urls, plain_http_client, post_control
from moerl.rollout.manager import _PushWaiter, _version_int, background_push, pause_mode, paused_push

#: seconds between the trainer's checks of its cluster for a changed live-server list or a fatal error
CLUSTER_POLL_S = 0.25
#: seconds close() waits for the child's answer to its close message, then for it to exit (then it is killed)
CLOSE_TIMEOUT_S = 30.0
#: seconds close() waits for a background weight push still in flight (the loop itself waits for every push
#: before its evals and exports, so only an error path gets here; a push wedged longer is left behind)
PUSH_LAND_TIMEOUT_S = 600.0


class ProducerProcessError(RuntimeError):
    """The producer process could not start, exited while the trainer needed it, or its connection is out of
    step after an exchange that did not complete (the message says how)."""


class _ClusterView:
    """The child's picture of the trainer's RolloutCluster: what RolloutManager / RolloutClient read of it
    (``failover``, ``num_servers``, ``server_urls``, ``extra_worker_urls``, ``live_server_urls()``,
    ``check_alive()``). ``fatal`` is the text of the cluster's check_alive error (a server died without
    failover, or failover gave up), raised here as a RolloutError with its text (the trainer raises the
    original, with its attributes, from its own cluster)."""

    def __init__(self, view: dict):
        self._lock = threading.Lock()
        self.failover = bool(view["failover"])
        self.num_servers = int(view["num_servers"])
        self.server_urls = list(view["server_urls"])
        self.extra_worker_urls = list(view["extra_worker_urls"])
        self._live, self._fatal = list(view["live"]), view["fatal"]

    def update(self, live: list, fatal: Optional[str]) -> None:
        with self._lock:
            self._live, self._fatal = list(live), fatal

    def live_server_urls(self) -> list:
        with self._lock:
            return list(self._live)

    def check_alive(self) -> None:
        with self._lock:
            fatal = self._fatal
        if fatal is not None:
            from moerl.rollout.errors import RolloutError

            raise RolloutError(fatal)


def cluster_view(cluster) -> dict:
    """The picklable view of ``cluster`` (a RolloutCluster or a double) that :class:`_ClusterView` holds."""
    live = getattr(cluster, "live_server_urls", None)
    fatal = None
    try:
        check = getattr(cluster, "check_alive", None)
        if check is not None:
            check()
    except Exception as e:  # the trainer raises the original itself (RolloutManagerProcess._check_cluster)
        fatal = f"{type(e).__name__}: {e}"
    return {"failover": bool(getattr(cluster, "failover", False)),
            "num_servers": int(getattr(cluster, "num_servers", 1) or 1),
            "server_urls": list(getattr(cluster, "server_urls", None) or []),
            "extra_worker_urls": list(getattr(cluster, "extra_worker_urls", None) or []),
            "live": list(live() if callable(live) else getattr(cluster, "server_urls", None) or []),
            "fatal": fatal}


def _send(conn: Connection, obj: Any) -> None:
    """Send ``obj`` pickled by value (plain pickle): Connection.send's ForkingPickler would pass a torch tensor
    (R3's routed_experts) as shared memory, which a process started by Popen cannot receive (multiprocessing
    authkey)."""
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _answer(conn: Connection, fn: Callable[[], Any]) -> None:
    try:
        out = ("ok", fn())
    except BaseException as e:  # noqa: BLE001 - every error goes back to the trainer
        out = ("err", e)
    try:
        data = pickle.dumps(out)
        if out[0] == "err":
            pickle.loads(data)  # an exception whose constructor needs other arguments does not unpickle
    except Exception:  # not picklable: its type and text
        e = out[1] if out[0] == "err" else None
        data = pickle.dumps(("err", RuntimeError(f"{type(e).__name__}: {e}" if e is not None else "unpicklable answer")))
    conn.send_bytes(data)


class RolloutManagerProcess(_PushWaiter):
    """The RolloutManager API (start / close / get_batch / update_weights / wait_weights / state_dict,
    ``version``) with the manager in a child process (module docstring). Same arguments as
    :func:`moerl.train.components.rollout_manager` builds a RolloutManager from, but picklable: no
    callables. A weight push runs here (on a background thread with rollout.background_push, one at a
    time); the child pauses and continues the servers around it when a group is in flight, and a server
    that fails that there is paused / continued through ``cluster`` (:meth:`_update_now`).

    Args:
        cluster: the trainer's RolloutCluster (pause_generation, continue_generation, check_alive,
            live_server_urls, failover, server_urls, extra_worker_urls).
        spec: what the child builds its RolloutManager from: router_url, timeout_s, max_retries, cfg,
            sampler, tokenizer, system_prompt, eos_id, num_steps, version, steps_done, state,
            routing_shape, reward_cpu_affinity (cores of its reward workers; see :func:`_child_manager`).
        cpu_affinity: cores of the child (rollout.producer_cpu_affinity); empty: the caller's.
        log: line printer.
    Raises:
        ProducerProcessError: (start) the child could not start or failed to build its manager.
    """

    def __init__(self, *, cluster, spec: dict, cpu_affinity=(), log: Callable[[str], None] = print):
        cfg = spec["cfg"]
        self.cluster, self.spec, self.log = cluster, spec, log
        self.cpu_affinity = list(cpu_affinity or [])
        self.mode = cfg.train.mode
        self.version = int(spec["version"])
        self.background_push = background_push(cfg)
        self.proc: Optional[subprocess.Popen] = None
        #: what the child reports once its producer started: ``gc_frozen`` (objects it moved to the permanent GC
        #: generation first: train.freeze_gc; 0 = none)
        self.child_info: dict = {}
        self._main = self._push = self._cluster_conn = None
        self._push_thread: Optional[threading.Thread] = None
        self._push_error: Optional[BaseException] = None
        self._poller: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._sent_view: Optional[tuple] = None
        self._view_lock = threading.Lock()
        self._broken: Optional[str] = None  # why an exchange did not complete: the wire is out of step
        self.pause_mode = pause_mode(cfg.rollout)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RolloutManagerProcess":
        from moerl.runtime.procs import child_env, pdeathsig_preexec

        pairs = [socket.socketpair() for _ in range(3)]
        fds = [theirs.fileno() for _, theirs in pairs]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moerl.rollout.producer_process", ",".join(map(str, fds))], pass_fds=fds,
                env=child_env(), stdin=subprocess.DEVNULL, start_new_session=True,  # Ctrl-C is the trainer's
                preexec_fn=pdeathsig_preexec(os.getpid(), cpu_affinity=self.cpu_affinity or None))
        except OSError as e:
            for a, b in pairs:
                a.close()
                b.close()
            raise ProducerProcessError(f"could not start the rollout producer process ({sys.executable} -m "
                                       f"moerl.rollout.producer_process): {e}") from e
        conns = []
        for ours, theirs in pairs:
            theirs.close()
            ours.setblocking(True)
            conns.append(Connection(ours.detach()))
        self._main, self._push, self._cluster_conn = conns
        spec = dict(self.spec, cluster=cluster_view(self.cluster))
        self._sent_view = (tuple(spec["cluster"]["live"]), spec["cluster"]["fatal"])
        try:
            self.child_info = self._call(self._main, ("start", spec), "start")
        except BaseException:
            self._stop.set()
            self.close()
            raise
        self._poller = threading.Thread(target=self._poll_cluster, name="moerl-producer-cluster", daemon=True)
        self._poller.start()
        return self

    def close(self) -> None:
        """Stop the child after a push in flight has landed (its error, if any, is logged; one that has not landed
        after ``PUSH_LAND_TIMEOUT_S`` is left behind, with a warning). The child is asked
        to close (unless the wire is broken: then its connections are just closed) and waited for at most
        ``CLOSE_TIMEOUT_S`` for the answer, then as long again to exit; then it is killed."""
        t = self._push_thread
        if t is not None:
            t.join(timeout=PUSH_LAND_TIMEOUT_S)
        if t is not None and t.is_alive():
            self._push_thread = None  # a daemon thread; its call to the child ends when the child exits (below)
            self.log(f"WARNING: the weight push in flight did not land within {PUSH_LAND_TIMEOUT_S:g} s; stopping the "
                     "rollout producer process without it")
        else:
            try:
                self.wait_weights()
            except Exception as e:
                self.log(f"WARNING: the last weight push failed: {type(e).__name__}: {e}")
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        if self._main is not None:
            try:
                self._call(self._main, ("close",), "close", timeout=CLOSE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the run is ending anyway
                self.log(f"WARNING: the rollout producer process did not close cleanly: {e}")
        for c in (self._main, self._push, self._cluster_conn):
            if c is not None:
                c.close()
        self._main = self._push = self._cluster_conn = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "RolloutManagerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ wire
    def _call(self, conn: Connection, msg: tuple, what: str, timeout: Optional[float] = None) -> Any:
        """One request -> answer exchange on ``conn`` (``timeout``: seconds to wait for the answer; None: no
        limit). One that does not complete breaks the proxy (module docstring)."""
        if self._broken is not None:
            raise ProducerProcessError(f"the connection to the rollout producer process is out of step "
                                       f"({self._broken}): {what} not sent")
        try:
            _send(conn, msg)
            if timeout is not None and not conn.poll(timeout):
                raise ProducerProcessError(f"the rollout producer process (pid {getattr(self.proc, 'pid', None)}) "
                                           f"did not answer {what} within {timeout:g} s")
            kind, value = _recv(conn)
        except (EOFError, OSError) as e:
            raise self._died(what, e) from e
        except BaseException as e:  # e.g. KeyboardInterrupt between the request and its answer
            self._broken = self._broken or f"{what} did not complete: {type(e).__name__}" + (f": {e}" if str(e) else "")
            raise
        if kind == "err":
            self._check_cluster()
            raise value
        return value

    def _died(self, what: str, e: BaseException) -> BaseException:
        """The error to raise for a connection that failed with ``e`` during ``what`` (the proxy is broken
        from now on): the cluster's own error if it has one (a dead server is the better explanation), else
        a ProducerProcessError with the child's exit status."""
        code = self.proc.poll() if self.proc is not None else None
        died = (f"the rollout producer process (pid {getattr(self.proc, 'pid', None)}) exited during {what} "
                f"(status {code}; its output is above)")
        self._broken = self._broken or died
        try:
            self._check_cluster()
        except Exception as cluster_error:  # noqa: BLE001 - raised by the caller
            return cluster_error
        return ProducerProcessError(died)

    def _check_cluster(self) -> None:
        check = getattr(self.cluster, "check_alive", None)
        if check is not None:
            check()

    def _send_view(self) -> None:
        view = cluster_view(self.cluster)
        key = (tuple(view["live"]), view["fatal"])
        with self._view_lock:
            if key != self._sent_view and self._cluster_conn is not None:
                _send(self._cluster_conn, (view["live"], view["fatal"]))
                self._sent_view = key

    def _poll_cluster(self) -> None:
        while not self._stop.wait(CLUSTER_POLL_S):
            try:
                self._send_view()
            except (OSError, ValueError):
                return

    # ------------------------------------------------------------------ trainer side
    def get_batch(self, step: int):
        """:meth:`RolloutManager.get_batch <moerl.rollout.manager.RolloutManager.get_batch>` in the child.

        Raises:
            what the child's get_batch raised (the trainer's own cluster error first: RolloutServerDiedError),
            or a failed background push's own error; ProducerProcessError if the child died (also when the
            cluster view could not be sent to it) or the wire is broken.
        """
        try:
            try:
                self._send_view()
            except (EOFError, OSError) as e:
                raise self._died(f"get_batch({step})", e) from e
            return self._call(self._main, ("get_batch", step), f"get_batch({step})")
        except BaseException:
            t = self._push_thread
            if t is not None:  # a failed push stops the child's producer: raise the push's own error
                t.join(timeout=60)  # it ends once the child (or its death) has answered its last call
                if not t.is_alive():
                    self.wait_weights()
            raise

    def state_dict(self) -> dict:
        """The child's resume cursor (after a push in flight has landed).

        Raises:
            what a background push raised; ProducerProcessError if the child died or the wire is broken.
        """
        self.wait_weights()
        return self._call(self._main, ("state_dict",), "state_dict")

    def update_weights(self, push: Optional[Callable[[], Any]], step: int, version: Optional[int] = None) -> None:
        """As :meth:`RolloutManager.update_weights <moerl.rollout.manager.RolloutManager.update_weights>`:
        the push (and the servers' pause / continue) runs here, with rollout.background_push on a thread
        (``version`` is the trainer's from now on, the child's begin_push); the child holds its requests
        meanwhile (one_step_off: waits until none is in flight first). Without background push the version
        becomes push()'s once it has landed, as in the RolloutManager (no begin_push).

        Raises:
            what the push (or a previous background push) raised; ProducerProcessError if the child died or
            the wire is broken.
        """
        self.wait_weights()
        if push is None:
            self._call(self._push, ("end", step, None, None, False), "update_weights")
            return
        if not self.background_push:
            self.version = _version_int(self._update_now(push, step), self.version + 1)  # as the child's end_push
            return
        self.version = self.version + 1 if version is None else int(version)
        self._call(self._push, ("begin", self.version), "update_weights")

        def run() -> None:
            try:
                self._update_now(push, step)
            except BaseException as e:  # surfaces in wait_weights
                self._push_error = e

        self._push_thread = threading.Thread(target=run, name="moerl-weight-push", daemon=True)
        self._push_thread.start()

    def _update_now(self, push: Callable[[], Any], step: int) -> Any:
        """Hold the child's requests, push, end the push; returns push()'s version. In async mode the CHILD
        pauses the servers (``hold``: the URLs the trainer's cluster would pause, :func:`control_urls`) and
        continues them (``end``) on its kept-alive connections, so their HTTP CPU is the child's (on
        rollout.producer_cpu_affinity), not the trainer process's; a server that refused or did not answer the child hands the call back to the
        trainer's cluster (RolloutCluster.pause_generation / continue_generation: failover skips a dead
        server, else it is named). A failed hold, pause, push or continue still ends the push (failed: the
        child's producer stops, its get_batch raises; the trainer raises the error)."""
        t0 = time.monotonic()
        try:
            urls = control_urls(self.cluster) if self.cluster is not None else []
            hold = self._call(self._push, ("hold", urls), "update_weights")  # "none" | "paused" | "pause"
            version, seconds = paused_push(self.cluster if hold == "pause" else None, self.pause_mode, push, t0)
            if self._call(self._push, ("end", step, version, seconds, False), "update_weights") == "continue":
                self.cluster.continue_generation()  # the child's continue failed: the cluster's rules decide
                self._call(self._push, ("end", step, version, seconds, False), "update_weights")
        except BaseException:
            try:  # the child resumes its requests; it stops producing (its get_batch raises, the push error wins)
                self._call(self._push, ("end", step, None, None, True), "update_weights")
            except Exception:
                pass
            raise
        return version


# ---------------------------------------------------------------------- child
def _child_manager(spec: dict):
    """The child's RolloutManager, RewardPool, cluster view and the httpx client of its pause / continue calls,
    from the trainer's ``spec``. While the reward workers start, it makes that client and (train.freeze_gc, as the
    trainer's moerl.train.components.frozen_gc) moves what this process holds to the permanent GC generation
    (never undone: the process ends with RL), so that neither runs during the first draw: importing httpx there
    (50-130 ms on the busy rollout core) made async's first batch 40-50 ms slower than sync's, and a full
    collection walks ~280,000 start-up objects (torch, the tokenizer) for ~0.1 s."""
    from moerl.data.tokenizer import PromptEncoder, decode_response
    from moerl.rewards import reward_pool_from_config
    from moerl.rollout.client import RolloutClient
    from moerl.rollout.manager import RolloutManager
    from moerl.runtime.procs import pinned

    cfg = spec["cfg"]
    view = _ClusterView(spec["cluster"])
    tokenizer = spec["tokenizer"]
    encoder = PromptEncoder(tokenizer, spec["system_prompt"])
    with pinned(spec.get("reward_cpu_affinity") or ()):  # the workers on the rollout cores, its threads here
        pool = reward_pool_from_config(cfg.reward, log=_log)
    http = None
    try:
        http = plain_http_client(view.server_urls + view.extra_worker_urls, 600.0)
        if getattr(cfg.train, "freeze_gc", True):
            gc.collect()
            gc.freeze()
        # workers up before the first group, else the first batch waits for their start (~0.2-0.5 s here); a reward
        # model loads first (the first batch needed it anyway), for at most rollout.startup_timeout_s
        try:
            pool.wait_ready(timeout=cfg.rollout.startup_timeout_s)
        except TimeoutError:  # the producer starts anyway, its first scores wait
            _log(f"reward workers not ready after rollout.startup_timeout_s={cfg.rollout.startup_timeout_s} s: "
                 "producing anyway")
        client = RolloutClient(spec["router_url"], timeout_s=spec["timeout_s"], max_retries=spec["max_retries"],
                               cluster=view)
        manager = RolloutManager(
            client=client, cluster=view, sampler=spec["sampler"], encode=encoder,
            decode=lambda ids: decode_response(tokenizer, ids), reward_fn=pool, cfg=cfg, eos_id=spec["eos_id"],
            num_steps=spec["num_steps"], version=spec["version"], steps_done=spec["steps_done"], state=spec["state"],
            routing_shape=spec["routing_shape"], log=_log)
    except BaseException:
        if http is not None:
            http.close()
        pool.close()
        raise
    manager.client_process = False  # this process is already off the trainer: aiohttp in its own loop
    manager.background_push = False  # the trainer runs the push; this side only holds and resumes
    return manager, pool, view, http


def _close(manager, pool) -> None:
    """Stop the producer, then the reward workers (idempotent)."""
    manager.close()
    pool.close()


def _log(msg: str) -> None:
    print(f"[moerl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _serve_push(conn: Connection, manager, http) -> None:
    """Answer the trainer's push messages: ``("begin", version)``; ``("hold", urls)``: hold the requests and,
    in async mode, pause ``urls`` here -> "none" (no pause needed), "paused" (done here) or "pause" (a server
    failed here: the trainer's cluster pauses them); ``("end", step, version, seconds, failed)``: continue
    what was paused here, then :meth:`RolloutManager.end_push` -> "done", or "continue" (a server failed the
    continue here: nothing ended yet, the trainer continues them and sends ``end`` again). ``http``: the
    httpx client of the pause / continue calls (closed on return)."""
    state = {"paused": [], "http": http}

    def control(path: str, mode: Optional[str], urls: list, timeout_s: float) -> bool:
        return not any(post_control(urls, path, mode, timeout_s, state["http"]).values())

    def handle(msg: tuple) -> Any:
        if msg[0] == "begin":
            return manager.begin_push(msg[1])
        if msg[0] == "hold":
            if not manager.hold_for_push():
                return "none"
            urls = list(msg[1])
            if not control("/pause_generation", manager.pause_mode, urls, 600.0):
                return "pause"
            state["paused"] = urls
            return "paused"
        if msg[0] == "end":
            _, step, version, seconds, failed = msg
            urls, state["paused"] = state["paused"], []
            if urls:
                t = time.monotonic()
                ok = control("/continue_generation", None, urls, 60.0)
                if not ok and not failed:
                    return "continue"
                if seconds is not None:
                    seconds = (*seconds[:2], seconds[2] + time.monotonic() - t)
            manager.end_push(step, version, seconds, failed=failed)
            return "done"
        raise ValueError(f"unknown push message {msg[0]!r}")

    try:
        while True:
            try:
                msg = _recv(conn)
                _answer(conn, lambda: handle(msg))
            except (EOFError, OSError):  # the trainer is gone (or closed the wire before the answer)
                return
    finally:
        state["http"].close()


def _serve_cluster(conn: Connection, view: _ClusterView) -> None:
    while True:
        try:
            live, fatal = _recv(conn)
        except (EOFError, OSError):
            return
        view.update(live, fatal)


def main(argv: Optional[list[str]] = None) -> int:
    """Child entry point: ``python -m moerl.rollout.producer_process MAIN_FD,PUSH_FD,CLUSTER_FD``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; the sockets close with it
    main_fd, push_fd, cluster_fd = (int(x) for x in (argv if argv is not None else sys.argv[1:])[0].split(","))
    conn, push_conn, cluster_conn = Connection(main_fd), Connection(push_fd), Connection(cluster_fd)
    msg = _recv(conn)
    if msg[0] != "start":
        raise ProducerProcessError(f"expected the start message, got {msg[0]!r}")
    built: dict = {}

    def build() -> dict:
        manager, pool, view, http = _child_manager(msg[1])
        try:
            manager.start()  # its first draw starts at once
        except BaseException:
            http.close()
            _close(manager, pool)
            raise
        built.update(manager=manager, pool=pool, view=view, http=http)
        return {"gc_frozen": gc.get_freeze_count()}

    _answer(conn, build)
    if "manager" not in built:
        return 1
    manager, pool = built["manager"], built["pool"]
    for target, args in ((_serve_push, (push_conn, manager, built["http"])), (_serve_cluster, (cluster_conn, built["view"]))):
        threading.Thread(target=target, args=args, daemon=True).start()
    try:
        while True:
            try:
                msg = _recv(conn)
                if msg[0] == "get_batch":
                    _answer(conn, lambda: manager.get_batch(msg[1]))
                elif msg[0] == "state_dict":
                    _answer(conn, manager.state_dict)
                elif msg[0] == "close":
                    _answer(conn, lambda: _close(manager, pool))
                    return 0
                else:
                    _answer(conn, lambda: (_ for _ in ()).throw(ValueError(f"unknown message {msg[0]!r}")))
            except (EOFError, OSError):  # the trainer is gone (or closed the wire before the answer: a broken proxy)
                return 0
    finally:
        _close(manager, pool)


if __name__ == "__main__":
    sys.exit(main())

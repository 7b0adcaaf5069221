"""Start N rollout servers and the real sglang-router as child processes, and keep them accounted for.

    with RolloutCluster(model_path, num_servers=2, base_port=31000, router_port=30000,
                        log_dir="runs/x/rollout_logs") as cluster:
        client = RolloutClient(cluster.router_url, cluster=cluster)
        ...

Children: server i runs ``python -m moerl.rollout.server --model-path M --host H --port base_port+i
--num-threads T`` (or ``server_command(i, port)``), the router runs ``python -m
sglang_router.launch_router --host H --port router_port --worker-urls URL... --policy P
--prometheus-host 127.0.0.1 --prometheus-port <a free port below 32768>``. Each gets OMP_NUM_THREADS=T,
OMP_WAIT_POLICY=PASSIVE, TORCHDYNAMO_DISABLE=1, its stdout+stderr in ``log_dir/<name>.log``, its own
session (terminal Ctrl-C reaches only the trainer, whose handler shuts the cluster down) and
PR_SET_PDEATHSIG=SIGKILL on Linux, so a SIGKILLed trainer takes its children with it. (PDEATHSIG fires
when the *thread* that started the child exits: create the cluster in the main thread or in a thread
that outlives it.) shutdown() runs at exit, on SIGTERM / SIGINT (then the previous handler runs), and
when the ``with`` block ends.

Failover (``failover=True``): a monitor thread polls every server process and its GET /health
(every ``health_check_interval_s``; ``health_failure_threshold`` failed checks in a row count as a
hung server, which is SIGKILLed). A dead server is removed from sglang-router (DELETE
/workers/{id}, sglang-router 0.3.x worker API), so its in-flight and later requests go to the other
servers (sglang-router retries a request whose worker connection broke on another worker; the
client retries what still fails, with the same ``rid``). The server is then restarted on its port,
waits for /health, receives the CURRENT weights from the restorer registered by the last weight
update (:meth:`RolloutCluster.update_weights` / :meth:`set_weight_restorer`) and must report that
weight_version on /get_model_info, and only then is added back to the router (POST /workers
{"url"}), so it never serves a request with stale weights. ``max_restarts`` restarts per server; one
more death (or a restart that fails) makes :meth:`check_alive` raise RolloutServerDiedError.

Pause / continue (async RL, weight updates while requests are in flight):
:meth:`RolloutCluster.pause_generation` / :meth:`RolloutCluster.continue_generation` POST SGLang's
/pause_generation {"mode"} / /continue_generation to every live server and every extra worker URL
(sglang-router 0.3.2 answers 404 to both: it does not forward them); a restarted server comes back
unpaused.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import errno
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import httpx

from moerl.rollout.common import (DEFAULT_PAUSE_MODE, check_pause_mode, claim_ports, control_urls,
                                  managed_server_urls, per_server, plain_http_client, post_control, version_dirname)
from moerl.rollout.errors import (HealthTimeoutError, PortInUseError, RolloutError,
                                  RolloutServerDiedError, RolloutStartupError, ServerExitedError, WeightSyncError)
from moerl.runtime.procs import child_env, current_cpu_affinity, pdeathsig_preexec

ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")


def port_is_free(host: str, port: int) -> bool:
    """True if a listening socket could bind ``host:port`` now (SO_REUSEADDR, as uvicorn does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def check_ports_free(host: str, base_port: int, num_servers: int, router_port: int) -> None:
    """The ports a rollout cluster listens on, free on ``host`` now: servers ``base_port ..
    base_port + num_servers - 1`` and the router's ``router_port`` (``moerl train`` checks them before any
    compute; :meth:`RolloutCluster.check_ports` before it starts anything).

    Raises:
        PortInUseError: naming the first taken port, the recipe key to change and a free-looking value.
        moerl.errors.PortError: ``host`` is not an address of this machine (cannot listen there).
    """
    from moerl.errors import PortError

    last = base_port + num_servers - 1
    ports = [(base_port + i, "rollout.base_port", f"rollout server {i}; servers use rollout.base_port .. "
              f"rollout.base_port + {num_servers - 1} = {base_port}..{last}") for i in range(num_servers)]
    for port, key, what in ports + [(router_port, "rollout.router_port", "sglang-router")]:
        try:
            free = port_is_free(host, port)
        except OSError as e:  # not an address of this machine
            raise PortError(f"rollout.host={host!r}: cannot listen on {host}:{port} ({e})", key="rollout.host",
                            hint="give rollout.host an address of this machine (127.0.0.1, auto)") from None
        if not free:
            raise PortInUseError(f"port {port} on {host} ({what}) is already in use; change {key} in the recipe "
                                 f"or on the command line (e.g. {key}={port + 100}) or stop what holds it")


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_below_ephemeral(host: str = "127.0.0.1", exclude: Sequence[int] = (), low: int = 20000,
                              high: int = 32767) -> int:
    """A port in ``low..high`` (default 20000..32767, below Linux's ephemeral range 32768-60999) that
    is free right now, chosen at random and not in ``exclude`` nor handed out before in this process
    (:func:`moerl.rollout.common.claim_ports`, shared with ``free_port_block``). Below the ephemeral range,
    the client sockets of other processes cannot take it between this check and the listener's bind.

    Raises:
        ValueError: ``low``/``high`` outside 1..65535 or low > high.
        RuntimeError: no free port, not handed out before in this process, found in 500 random tries.
    """
    if not (0 < low <= high < 65536):
        raise ValueError(f"need 0 < low <= high < 65536, got low={low}, high={high}")
    rng = random.Random()
    skip = set(exclude)
    for _ in range(500):
        port = rng.randint(low, high)
        if port not in skip and claim_ports(range(port, port + 1), lambda p: port_is_free(host, p)):
            return port
    raise RuntimeError(f"no free port in {low}..{high} on {host} not handed out before in this process "
                       "(500 random tries)")


def wait_healthy(url: str, proc: Optional[subprocess.Popen] = None, timeout_s: float = 120.0,
                 what: str = "rollout server", *, path: str = "/health", log_path: Optional[str] = None,
                 interval_s: float = 0.2, progress_every_s: Optional[float] = 10.0,
                 check: Optional[Callable[[], None]] = None) -> None:
    """Block until ``GET url+path`` answers HTTP 200 (the SGLang / moerl.rollout.server health check).

    Each round, every ``interval_s`` seconds: ``check()`` if given (whatever it raises ends the
    wait, e.g. another child died or the caller shut down), then ``proc.poll()`` if a process is
    given, then one GET with a 2 s timeout (connection errors and other statuses mean "not yet").
    It polls at least once, even with ``timeout_s`` <= 0.

    Args:
        url: base URL of the server, e.g. ``http://127.0.0.1:31000`` (a trailing / is ignored).
        proc: the server's process, if this process started it; None for an external server.
        timeout_s: seconds to wait in all.
        what: how the server is named in messages (e.g. "server 0").
        path: the health endpoint.
        log_path: the server's log file; its last lines go into the error when the process exits.
            Without it, the process's stderr is read if it is a pipe.
        interval_s: seconds between rounds.
        progress_every_s: for an external server (``proc`` None), print a line to stderr every
            this many seconds while it does not answer ("waiting for URL: N s of timeout T s");
            None: never. A child process has its own log, so none is printed for one.
        check: called at the start of every round; raise from it to stop waiting.

    Raises:
        ServerExitedError (a RolloutStartupError, so a RuntimeError): ``proc`` exited first; the
            message names the URL, the exit code or signal and the last lines of its log / stderr.
        HealthTimeoutError (a RolloutStartupError and a TimeoutError): no HTTP 200 within
            ``timeout_s``; the message names the URL, the timeout and the last answer or error.
        whatever ``check`` raises.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    base = url.rstrip("/")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    next_progress = t0 + progress_every_s if progress_every_s else None
    last = "no answer yet"
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            if check is not None:
                check()
            if proc is not None:
                rc = proc.poll()
                if rc is not None:
                    tail = _exit_tail(proc, log_path)
                    where = f"; log {log_path}" if log_path else ""
                    raise ServerExitedError(
                        f"{what} ({base}, pid {proc.pid}) exited with {describe_returncode(rc)} before "
                        f"answering {path}{where}" + (f", last lines:\n{tail}" if tail else ""),
                        url=base, returncode=rc)
            try:
                r = client.get(base + path)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            now = time.monotonic()
            if now > deadline:
                where = f"; log {log_path}" if log_path else ""
                raise HealthTimeoutError(f"{what} ({base}) did not answer {path} with HTTP 200 within "
                                         f"{timeout_s:g} s (last: {last}){where}", url=base, timeout_s=timeout_s)
            if proc is None and next_progress is not None and now >= next_progress:
                print(f"[moerl rollout] waiting for {what} {base}{path}: {now - t0:.0f} s of timeout "
                      f"{timeout_s:.0f} s (last: {last})", file=sys.stderr, flush=True)
                next_progress = now + progress_every_s
            time.sleep(min(interval_s, max(0.0, deadline - now) + 0.01))


def _exit_tail(proc: subprocess.Popen, log_path: Optional[str], n: int = 30) -> str:
    """Last lines of an exited process's log file, or of its stderr when that is a pipe."""
    if log_path:
        return tail_file(log_path, n)
    if proc.stderr is None:
        return ""
    try:
        _, err = proc.communicate(timeout=1.0)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return ""
    if isinstance(err, bytes):
        err = err.decode("utf-8", "replace")
    return "\n".join((err or "").splitlines()[-n:])


def describe_returncode(rc: int) -> str:
    """'exit code N' or 'signal SIGKILL' (Popen convention: negative = killed by that signal)."""
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def tail_file(path: str, n: int = 30) -> str:
    """Last ``n`` lines of a text file ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def disk_restorer(model_path: str, weight_version: str, timeout_s: float = 600.0) -> Callable[[str], None]:
    """A failover restorer: ``restore(url)`` POSTs SGLang's /update_weights_from_disk
    {model_path, weight_version} to one server (model_path: the HF safetensors directory of that
    version, readable by the server). Raises WeightSyncError when the server refuses."""
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
    path = os.path.abspath(os.fspath(model_path))

    def restore(url: str) -> None:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            r = client.post(url.rstrip("/") + "/update_weights_from_disk",
                            json={"model_path": path, "weight_version": weight_version})
        try:
            ok = r.status_code == 200 and r.json().get("success", False)
        except ValueError:
            ok = False
        if not ok:
            raise WeightSyncError(f"{url} refused /update_weights_from_disk {path}: HTTP {r.status_code} "
                                  f"{r.text[:500]}")

    return restore


def tensor_restorer(hf_state_dict, weight_version: str, bucket_bytes: int = 64 << 20) -> Callable[[str], None]:
    """A failover restorer that re-sends ``hf_state_dict`` ({HF name: tensor}, kept referenced, so
    one CPU copy of the weights stays alive until the next update) through
    moerl.rollout.weight_sync.sync_weights_from_tensor to one server. The tensors must stay unchanged
    while this restorer is registered: moerl.train.weight_sync.WeightSync's export arena
    (moerl.rollout.shm_arena) keeps the slot they live in until another slot is published, and such
    an all-shared dict is re-sent in one request."""
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")

    def restore(url: str) -> None:
        from moerl.rollout.weight_sync import sync_weights_from_tensor

        sync_weights_from_tensor([url], hf_state_dict, weight_version, bucket_bytes=bucket_bytes)

    return restore


def failover_restorer(weight_sync: str, hf_state_dict, weight_version: str, out_root=None,
                      bucket_bytes: int = 64 << 20) -> Callable[[str], None]:
    """The restorer the trainer registers after a weight update in ``weight_sync`` mode: disk mode
    reloads ``out_root/weights_<version>`` (written by the update) with /update_weights_from_disk;
    the other modes re-send the state dict with :func:`tensor_restorer` (reference-server wire format)."""
    if weight_sync == "disk" and out_root is not None:
        path = os.path.join(os.fspath(out_root), version_dirname(weight_version))
        if os.path.isdir(path):
            return disk_restorer(path, weight_version)
    return tensor_restorer(hf_state_dict, weight_version, bucket_bytes)


class _ShutDown(Exception):
    """Raised by a wait_healthy check when the cluster shuts down while a restart waits."""


def format_failover_event(rec: dict, max_restarts: Optional[int] = None) -> str:
    """One readable line for a failover event of :class:`RolloutCluster` (a dict of
    ``failover_events``: t, index, url, event, plus pid / reason / restart / weight_version /
    down_s / error by event), e.g. ``[moerl] rollout failover: server 1 (http://127.0.0.1:31001)
    back in the router with weights version 3, 2.1 s after it died (signal SIGKILL)``."""
    i, url = rec.get("index"), rec.get("url")
    who = f"server {i}" + (f" ({url})" if url else "")
    ev = rec.get("event")
    wv = rec.get("weight_version")
    weights = f"weights version {wv}" if wv is not None else "its initial weights (no update yet)"
    if ev == "died":
        what = f"died ({rec.get('reason', 'unknown reason')}, pid {rec.get('pid')}); taking it out of the router"
    elif ev == "removed_from_router":
        what = "removed from the router; restarting it"
    elif ev == "restarted":
        of = f" of {max_restarts}" if max_restarts is not None else ""
        what = f"restarted as pid {rec.get('pid')} (restart {rec.get('restart')}{of}); waiting for /health"
    elif ev == "restored":
        what = f"restored to {weights}" if wv is not None else "has no weight update to restore (initial weights)"
    elif ev == "rejoined":
        what = f"back in the router with {weights}"
        if rec.get("down_s") is not None:
            what += f", {rec['down_s']:.1f} s after it died ({rec.get('reason') or 'unknown reason'})"
    elif ev == "gave_up":
        err = str(rec.get("error", "")).splitlines()
        what = f"given up: {err[0] if err else 'unknown error'}"
    else:
        extra = ", ".join(f"{k}={v}" for k, v in rec.items() if k not in ("t", "index", "url", "event"))
        what = f"{ev}" + (f" ({extra})" if extra else "")
    return f"[moerl] rollout failover: {who} {what}"


@dataclass
class _Child:
    name: str  # "server 0" / "router"
    index: Optional[int]  # server index, None for the router
    url: str
    log_path: str
    proc: subprocess.Popen
    log_file: object


class RolloutCluster:
    """N rollout servers + sglang-router as child processes (a context manager).

    Args:
        model_path: HF model directory each server loads.
        num_servers: number of servers (ports base_port .. base_port + num_servers - 1).
        host: address every child binds (and the URLs use).
        base_port: first server port (recipe key rollout.base_port).
        router_port: router port (recipe key rollout.router_port).
        router_policy: sglang-router --policy: round_robin | cache_aware | random | power_of_two.
        threads_per_server: torch threads and OMP_NUM_THREADS of each server.
        dtype: reference servers' ``--dtype`` (rollout.dtype): "float32" | "bfloat16", the dtype they
            load and serve the model in; None passes no --dtype (the server's default, float32).
        startup_timeout_s: seconds to wait for all servers and then the router to answer.
        log_dir: directory of the children's logs (default: a new temp dir).
        tokenizer_path: passed to the reference server as --tokenizer-path.
        server_command: optional ``f(index, port) -> argv`` to run another server (e.g. real SGLang).
        extra_env: extra environment variables for every child.
        server_env: optional ``f(index) -> dict`` of extra environment variables for server i only
            (e.g. CUDA_VISIBLE_DEVICES of its GPUs).
        extra_worker_urls: servers not started here (other nodes, external URLs from the recipe)
            that the router also fronts; they are waited for but not restarted or checked.
        peer_worker_urls: the subset of ``extra_worker_urls`` that moerl started on other nodes
            (moerl.rollout.sglang_launcher); colocated placement releases / resumes their memory
            (:meth:`colocated_server_urls`), unlike external URLs, which are not moerl's.
        failover: restart dead servers and route around them (see the module docstring).
        max_restarts: restarts allowed per server (failover only).
        health_check_interval_s: seconds between liveness checks of the monitor (failover only).
        health_check_timeout_s: timeout of one GET /health (failover only).
        health_failure_threshold: failed GET /health in a row before a live process counts as hung
            and is killed and restarted (failover only).
        request_log: reference servers only: server i appends its request log (see
            moerl.rollout.server ``--request-log``) to ``log_dir/server_<i>.requests.jsonl``.

    Raises (from start()/__enter__):
        ValueError: bad arguments (overlapping ports, unknown policy, missing model_path).
        PortInUseError: a needed port is taken (nothing is started); names port and recipe key.
        RolloutStartupError: a child exited or did not answer in time (message has its log tail).
    """

    def __init__(self, model_path: str, num_servers: int, host: str = "127.0.0.1",
                 base_port: int = 31000, router_port: int = 30000,
                 router_policy: str = "round_robin", threads_per_server: int = 1,
                 startup_timeout_s: float = 120.0, log_dir: Optional[str] = None,
                 tokenizer_path: Optional[str] = None,
                 server_command: Optional[Callable[[int, int], Sequence[str]]] = None,
                 extra_env: Optional[dict] = None, shutdown_grace_s: float = 10.0,
                 failover: bool = False, max_restarts: int = 3, health_check_interval_s: float = 0.5,
                 health_check_timeout_s: float = 5.0, health_failure_threshold: int = 3,
                 request_log: bool = False, server_env: Optional[Callable[[int], dict]] = None,
                 extra_worker_urls: Sequence[str] = (), peer_worker_urls: Sequence[str] = (),
                 dtype: Optional[str] = None):
        if num_servers < 0 or (num_servers == 0 and not extra_worker_urls):
            raise ValueError(f"num_servers must be >= 1 (or 0 with extra_worker_urls), got {num_servers}")
        if router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {router_policy!r}")
        if threads_per_server < 1:
            raise ValueError(f"threads_per_server must be >= 1, got {threads_per_server}")
        if dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"rollout.dtype must be float32 or bfloat16, got {dtype!r}")
        if max_restarts < 0 or health_failure_threshold < 1:
            raise ValueError(f"max_restarts must be >= 0 and health_failure_threshold >= 1, got "
                             f"{max_restarts} and {health_failure_threshold}")
        if not (health_check_interval_s > 0 and health_check_timeout_s > 0):
            raise ValueError("health_check_interval_s and health_check_timeout_s must be > 0")
        if server_command is None and num_servers and not os.path.isdir(model_path):
            raise ValueError(f"model_path {model_path!r} is not a directory")
        server_ports = list(range(base_port, base_port + max(1, num_servers)))
        if router_port in server_ports:
            raise ValueError(f"rollout.router_port={router_port} falls inside the server ports "
                             f"{base_port}..{server_ports[-1]} (rollout.base_port + num_servers); "
                             f"change one of them")
        if not (0 < base_port and server_ports[-1] < 65536 and 0 < router_port < 65536):
            raise ValueError(f"ports must be in 1..65535 (rollout.base_port={base_port}, "
                             f"num_servers={num_servers}, rollout.router_port={router_port})")
        self.model_path = model_path
        self.num_servers = num_servers
        self.host = host
        self.base_port = base_port
        self.router_port = router_port
        self.router_policy = router_policy
        self.threads_per_server = threads_per_server
        self.dtype = dtype
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = log_dir
        self.tokenizer_path = tokenizer_path
        self.server_command = server_command
        self.extra_env = dict(extra_env or {})
        self.server_env = server_env
        self.extra_worker_urls = [u.rstrip("/") for u in extra_worker_urls]
        self.peer_worker_urls = [u.rstrip("/") for u in peer_worker_urls]
        stray = [u for u in self.peer_worker_urls if u not in self.extra_worker_urls]
        if stray:
            raise ValueError(f"peer_worker_urls {stray} are not among extra_worker_urls {self.extra_worker_urls}: "
                             f"other nodes' servers must also be behind the router")
        self.shutdown_grace_s = shutdown_grace_s
        self.server_urls = [f"http://{host}:{p}" for p in server_ports[:num_servers]]
        self.router_url = f"http://{host}:{router_port}"
        self._servers: list[_Child] = []
        self._router: Optional[_Child] = None
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self._prev_handlers: dict[int, object] = {}
        self.failover = failover
        self.max_restarts = max_restarts
        self.health_check_interval_s = health_check_interval_s
        self.health_check_timeout_s = health_check_timeout_s
        self.health_failure_threshold = health_failure_threshold
        self.request_log = request_log
        self.failover_events: list[dict] = []  # one dict per death / restart / rejoin (see _event)
        self._died_at: dict[int, tuple[float, Optional[str]]] = {}  # index -> (time.time(), reason)
        self.restarts = [0] * num_servers
        self._down: set[int] = set()  # server indices out of the router (dead or restarting)
        self._fatal: Optional[RolloutError] = None
        self._weights_lock = threading.RLock()
        self._weight_version: Optional[str] = None
        self._restorer: Optional[Callable[[str], None]] = None
        self._stop = threading.Event()
        self._monitor: Optional[threading.Thread] = None
        self._restart_threads: dict[int, threading.Thread] = {}
        # Restarted servers are spawned by one long-lived thread: PR_SET_PDEATHSIG fires when the
        # spawning THREAD exits, so a short-lived restart thread would take its server with it.
        self._spawn_q: "queue.Queue" = queue.Queue()
        self._spawner: Optional[threading.Thread] = None
        self._cpu_affinity: Optional[set] = None  # cores of the thread that started the cluster (see start)
        self._http = None  # http_client(): kept-alive connections for pause / continue / weight pushes

    # ------------------------------------------------------------------ start

    def __enter__(self) -> "RolloutCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def check_ports(self) -> None:
        """Raise PortInUseError naming the first taken port and the recipe key to change
        (:func:`check_ports_free`)."""
        check_ports_free(self.host, self.base_port, len(self.server_urls), self.router_port)

    def _env(self, index: Optional[int] = None) -> dict:
        env = child_env()  # servers and router are not ranks of a torchrun job (moerl.runtime.procs)
        t = str(self.threads_per_server)
        env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OMP_WAIT_POLICY": "PASSIVE",
                    "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
                    "TOKENIZERS_PARALLELISM": "false"})
        # The children import moerl from the same tree as this process, wherever their cwd is.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update(self.extra_env)
        if index is not None and self.server_env is not None:
            env.update({k: str(v) for k, v in self.server_env(index).items()})
        return env

    def _spawn(self, name: str, index: Optional[int], url: str, argv: Sequence[str]) -> _Child:
        log_path = os.path.join(self.log_dir, name.replace(" ", "_") + ".log")
        log_file = open(log_path, "ab", buffering=0)
        log_file.write(f"# {' '.join(argv)}\n".encode())
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, env=self._env(index), start_new_session=True,
                                preexec_fn=pdeathsig_preexec(os.getpid(), cpu_affinity=self._cpu_affinity),
                                close_fds=True)
        return _Child(name, index, url, log_path, proc, log_file)

    def _server_argv(self, i: int, port: int) -> list[str]:
        if self.server_command is not None:
            return list(self.server_command(i, port))
        argv = [sys.executable, "-m", "moerl.rollout.server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(port), "--num-threads", str(self.threads_per_server)]
        if self.dtype is not None:
            argv += ["--dtype", self.dtype]
        if self.tokenizer_path:
            argv += ["--tokenizer-path", self.tokenizer_path]
        if self.request_log:
            argv += ["--request-log", self.request_log_path(i)]
        return argv

    def request_log_path(self, i: int) -> str:
        """Path of server i's request log (reference servers started with request_log=True)."""
        return os.path.join(self.log_dir or "", f"server_{i}.requests.jsonl")

    def _router_argv(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host,
                "--port", str(self.router_port), "--worker-urls", *self.server_urls, *self.extra_worker_urls,
                "--policy", self.router_policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self._prometheus_port()), "--log-level", "warn",
                "--worker-startup-timeout-secs", str(max(1, int(self.startup_timeout_s))),
                "--worker-startup-check-interval", "1"]

    def _prometheus_port(self) -> int:
        """The router's Prometheus port (sglang-router 0.3.2 cannot turn the exporter off; its
        default 29000 would clash between clusters): free, below the ephemeral range, and none of
        this cluster's server / router ports."""
        return free_port_below_ephemeral(
            "127.0.0.1", exclude=[self.router_port, *range(self.base_port, self.base_port + max(1, self.num_servers))])

    def start(self) -> "RolloutCluster":
        """Check ports, start the servers, wait for /health, start the router, wait for /readiness."""
        with self._lock:
            if self._started:
                raise RuntimeError("RolloutCluster.start() called twice")
            self.check_ports()
            # every server, the router and a server restarted later (by the spawner thread) get the cores of
            # the thread starting the cluster (moerl.train.components.pinned_start: rollout.cpu_affinity)
            self._cpu_affinity = current_cpu_affinity()
            if self.log_dir is None:
                self.log_dir = tempfile.mkdtemp(prefix="moerl_rollout_")
            os.makedirs(self.log_dir, exist_ok=True)
            self._started = True
            atexit.register(self.shutdown)
            self._install_signal_handlers()
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            for i, url in enumerate(self.server_urls):
                self._servers.append(self._spawn(f"server {i}", i, url,
                                                 self._server_argv(i, self.base_port + i)))
            self._wait_ready(self._servers, "/health", deadline)
            self._wait_external(deadline)
            self._router = self._spawn("router", None, self.router_url, self._router_argv())
            self._wait_router(deadline)
            if self.failover:
                self._spawner = threading.Thread(target=self._spawner_loop, name="moerl-rollout-spawner",
                                                 daemon=True)
                self._spawner.start()
                self._monitor = threading.Thread(target=self._monitor_loop, name="moerl-rollout-monitor",
                                                 daemon=True)
                self._monitor.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _startup_error(self, child: _Child, what: str) -> RolloutStartupError:
        return RolloutStartupError(
            f"{child.name} ({child.url}, pid {child.proc.pid}) {what}; log {child.log_path}, last lines:\n"
            f"{tail_file(child.log_path)}")

    def _wait_ready(self, children: list[_Child], path: str, deadline: float) -> None:
        """:func:`wait_healthy` for each child in turn (until ``deadline``, time.monotonic()), while
        watching the children not yet ready: the first that exits or times out is named."""
        children = list(children)
        for k, child in enumerate(children):
            rest = children[k + 1:]

            def others_alive(rest=rest) -> None:
                for c in rest:
                    rc = c.proc.poll()
                    if rc is not None:
                        raise self._startup_error(c, f"exited during startup with {describe_returncode(rc)}")

            try:
                wait_healthy(child.url, child.proc, timeout_s=deadline - time.monotonic(), what=child.name,
                             path=path, log_path=child.log_path, check=others_alive)
            except ServerExitedError as e:
                raise self._startup_error(child, f"exited during startup with "
                                                 f"{describe_returncode(e.returncode)}") from None
            except HealthTimeoutError:
                raise self._startup_error(child, f"did not answer {path} within "
                                          f"{self.startup_timeout_s:.0f} s (startup_timeout_s)") from None

    def _wait_external(self, deadline: float) -> None:
        """:func:`wait_healthy` for each of ``extra_worker_urls`` (no process to poll: a progress line
        every 10 s) until ``deadline``, while the servers started here must stay alive."""

        def servers_alive() -> None:
            for c in self._servers:
                rc = c.proc.poll()
                if rc is not None:
                    raise self._startup_error(c, f"exited while waiting for the external servers with "
                                                 f"{describe_returncode(rc)}")

        for url in self.extra_worker_urls:
            try:
                wait_healthy(url, None, timeout_s=deadline - time.monotonic(), what="external rollout server",
                             check=servers_alive)
            except HealthTimeoutError as e:
                raise RolloutStartupError(f"{e} (startup_timeout_s={self.startup_timeout_s:.0f}); check "
                                          f"rollout.external_urls / the other nodes' servers") from None

    def _wait_router(self, deadline: float) -> None:
        """Router up and all workers registered healthy (GET /readiness reports healthy_workers)."""
        child = self._router
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                rc = child.proc.poll()
                if rc is not None:
                    raise self._startup_error(child, f"exited during startup with {describe_returncode(rc)}")
                for s in self._servers:
                    if s.proc.poll() is not None:
                        raise self._startup_error(s, f"exited during router startup with "
                                                  f"{describe_returncode(s.proc.returncode)}")
                try:
                    r = client.get(self.router_url + "/readiness")
                    if r.status_code == 200 and r.json().get("healthy_workers", 0) >= self.num_servers + len(self.extra_worker_urls):
                        return
                except (httpx.TransportError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise self._startup_error(child, f"did not report {self.num_servers} healthy workers on "
                                              f"/readiness within {self.startup_timeout_s:.0f} s")
                time.sleep(0.2)

    # ------------------------------------------------------------------ liveness

    @property
    def pids(self) -> list[int]:
        """Process ids of the servers (in order) and then the router."""
        return [c.proc.pid for c in self._children()]

    def _children(self) -> list[_Child]:
        return self._servers + ([self._router] if self._router is not None else [])

    def check_alive(self) -> None:
        """Raise RolloutServerDiedError naming the first child (server index or router) that exited."""
        if self._closed:
            raise RuntimeError("the rollout cluster was shut down")
        if self._fatal is not None:
            raise self._fatal
        for child in self._children():
            if self.failover and child.index is not None:
                continue  # the monitor restarts dead servers; _fatal is set when it cannot
            rc = child.proc.poll()
            if rc is not None:
                raise RolloutServerDiedError(
                    f"rollout {child.name} ({child.url}, pid {child.proc.pid}) died: "
                    f"{describe_returncode(rc)}; log {child.log_path}, last lines:\n{tail_file(child.log_path, 15)}",
                    index=child.index, url=child.url, pid=child.proc.pid, returncode=rc)

    # ------------------------------------------------------------------ weights and failover

    @property
    def current_weight_version(self) -> Optional[str]:
        """The weight_version of the last :meth:`update_weights` / :meth:`set_weight_restorer` (None before)."""
        return self._weight_version

    def live_server_urls(self) -> list[str]:
        """URLs of the servers that are running and in the router (not dead or being restarted)."""
        with self._lock:
            return [c.url for c in self._servers if c.index not in self._down and c.proc.poll() is None]

    def freeze_gc(self, timeout_s: float = 60.0) -> dict[str, Optional[str]]:
        """SGLang's POST /freeze_gc, in parallel, on the servers moerl started
        (:meth:`colocated_server_urls`: this cluster's live ones and other nodes' moerl servers; never
        rollout.external_urls): each moves its live Python objects to the permanent GC generation, so its
        later collections skip the model and start-up state. Best effort (a speed measure): returns
        ``{url: None}`` for each server frozen, ``{url: reason}`` for one that refused (an SGLang without
        the route answers 404) or failed; never raises for a server."""
        urls = self.colocated_server_urls()

        def one(url: str) -> Optional[str]:
            try:
                r = httpx.post(url + "/freeze_gc", timeout=timeout_s, trust_env=False)
            except httpx.HTTPError as e:
                return f"{type(e).__name__}: {e}"
            return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"

        return dict(zip(urls, per_server(urls, one)))

    def colocated_server_urls(self) -> list[str]:
        """The servers colocated placement releases / resumes memory on: :meth:`live_server_urls`
        (this cluster's own) followed by ``peer_worker_urls`` (servers moerl started on other nodes,
        each colocated with that node's trainer ranks); never the other ``extra_worker_urls``
        (rollout.external_urls: started elsewhere, not moerl's to release)."""
        return self.live_server_urls() + list(self.peer_worker_urls)

    def weights_lock(self) -> "threading.RLock":
        """Hold while pushing weights to :meth:`live_server_urls` and registering the restorer, so a
        server restarting meanwhile is restored with the weights the others end up with."""
        return self._weights_lock

    def set_weight_restorer(self, weight_version: str, restore: Optional[Callable[[str], None]]) -> None:
        """Record the current weight_version and ``restore(server_url)``, which pushes those weights
        to one (restarted) server; failover calls it and then checks the server reports
        ``weight_version`` before the server rejoins the router."""
        if not isinstance(weight_version, str) or not weight_version:
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
        with self._weights_lock:
            self._weight_version, self._restorer = weight_version, restore

    def update_weights(self, weight_version: str, push: Callable[[list[str]], None],
                       restore: Optional[Callable[[str], None]] = None) -> list[str]:
        """Push new weights to the servers, safe against a concurrent server restart.

        Runs ``push(urls)`` under the weights lock (a restarting server is restored either before,
        with the old weights and then again, or after, with these); ``urls`` are
        :meth:`live_server_urls` with failover (possibly [] while every server restarts: push still
        runs, e.g. disk mode writes the version directory the restorer loads) and all
        ``server_urls`` without (a dead server then fails the push and is named), followed by every
        ``extra_worker_urls`` (other nodes' servers, external URLs: they serve rollouts behind the
        router, so they must get the weights too). If push fails
        because a server died meanwhile (failover on; its death can show a moment after the HTTP
        error, see :meth:`wait_for_dead`), it is retried once on the servers still alive; the dead
        one gets ``restore`` when it restarts. Then records ``weight_version`` and ``restore`` (see
        :meth:`set_weight_restorer`). Returns the URLs that were updated. The trainer's weight sync
        (moerl.train.weight_sync.WeightSync) goes through here.

        Raises:
            the push's exception when no server died (or failover is off, or the retry failed too);
            RolloutServerDiedError naming the server when one is dead and failover is off or gave up.
        """
        with self._weights_lock:
            for attempt in range(2):
                managed = managed_server_urls(self)
                # servers behind the router that this cluster did not start (other nodes, external URLs)
                # serve rollouts too: they get every update (no failover for them: a failure raises)
                urls = control_urls(self, managed)
                try:
                    push(urls)
                    break
                except Exception:
                    # a SIGKILLed server's sockets close a moment before it can be reaped: give its death
                    # (if that is what failed the push) time to show before deciding
                    died = self.wait_for_dead(managed)
                    self.check_alive()  # a dead server is named (failover off / given up)
                    if attempt == 1 or not self.failover or not died:
                        raise
            self.set_weight_restorer(weight_version, restore)
            return urls

    # ------------------------------------------------------------------ pause / continue generation

    def http_client(self):
        """The cluster's ``httpx.Client`` for control calls and weight pushes to its servers (made on first
        use, kept alive until :meth:`shutdown`; thread-safe). A new client per call cost the trainer's core
        about 1 ms of CPU per pause, continue and push in async RL; a kept-alive connection half of that.
        Default timeout 600 s (a call may pass its own)."""
        with self._lock:
            if self._http is None:
                self._http = plain_http_client(list(self.server_urls) + list(self.extra_worker_urls), 600.0)
            return self._http

    def pause_generation(self, mode: str = DEFAULT_PAUSE_MODE, timeout_s: float = 600.0) -> list[str]:
        """SGLang's POST /pause_generation {"mode": mode} to every server this cluster knows, in
        parallel: its live servers (all of ``server_urls`` without failover) and every
        ``extra_worker_urls`` (other nodes' servers, external URLs), as :meth:`update_weights` pushes
        to them. sglang-router does not forward /pause_generation, so the router is not asked.

        Each server answers once it is paused (see moerl.rollout.client.RolloutClient
        .apause_generation for the modes): with "abort" its running requests have been answered
        (the tokens so far, finish_reason abort) and its queued ones aborted; with "retract" /
        "in_place" no new batch starts and the running one is suspended at its next step
        (in_place; "retract": SGLang retracts it, the reference server finishes it first). New /generate requests wait on every server until
        :meth:`continue_generation`, so a weight update in between cannot race a generation.
        Idempotent. A server that died (failover on) is skipped the way :meth:`update_weights`
        skips it: it is restarted later and comes back UNPAUSED (restored to the current weights
        before it rejoins the router), so requests it gets then run at once.

        Args:
            mode: "abort" (default) | "retract" | "in_place".
            timeout_s: per server (a pause waits for the running batch of "retract", for the next
                decode step with "in_place").
        Returns: the URLs that were paused.
        Raises:
            ValueError: a bad ``mode`` (nothing is sent).
            RolloutServerDiedError: a server died (failover off, or failover gave up on it).
            RolloutError: a live server (or an external URL) refused or did not answer; names each.
        """
        return self._control_servers("/pause_generation", check_pause_mode(mode), timeout_s)

    def continue_generation(self, timeout_s: float = 60.0) -> list[str]:
        """SGLang's POST /continue_generation to the same servers as :meth:`pause_generation`;
        scheduling resumes and the requests that waited start. Returns the URLs continued; a dead
        server is tolerated (failover) or named (RolloutServerDiedError) as there; RolloutError
        names a live server that refused."""
        return self._control_servers("/continue_generation", None, timeout_s)

    def _control_servers(self, path: str, mode: Optional[str], timeout_s: float) -> list[str]:
        """POST ``path`` (pause with ``mode``, or continue when None) to every server, in parallel;
        see :meth:`pause_generation` for which servers, the failover rule and the errors."""
        managed = managed_server_urls(self)
        urls = control_urls(self, managed)
        errors = post_control(urls, path, mode, timeout_s, self.http_client())
        failed = [u for u in urls if errors[u]]
        if failed:
            # a SIGKILLed server's sockets close a moment before it can be reaped (see update_weights)
            own = [u for u in failed if u in managed]
            died = self.wait_for_dead(own) if own else []
            self.check_alive()  # a dead server is named (failover off / given up)
            refused = [u for u in failed if u not in died]
            if refused:
                raise RolloutError(f"{path} failed on {len(refused)} of {len(urls)} servers:\n"
                                   + "\n".join(errors[u] for u in refused))
        return [u for u in urls if u not in failed]

    def wait_for_dead(self, urls: Sequence[str], timeout_s: float = 5.0) -> list[str]:
        """The servers among ``urls`` that are no longer live, waiting up to ``timeout_s`` for one to
        show up: a SIGKILLed server's sockets close (the client sees ConnectError / a reset) a moment
        before its process can be reaped, so an HTTP failure can precede ``proc.poll()``."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = set(self.live_server_urls())
            died = [u for u in urls if u not in live]
            if died or time.monotonic() > deadline:
                return died
            time.sleep(0.05)

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        """Block until every server is up and in the router (no restart pending).

        Raises:
            RolloutServerDiedError: failover gave up on a server; TimeoutError: still restarting.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            with self._lock:
                down = sorted(self._down)
            if not down:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout servers {down} still restarting after {timeout_s:.0f} s")
            time.sleep(0.1)

    def _event(self, index: Optional[int], event: str, **kw) -> None:
        """Record one failover event in ``failover_events`` (a dict: t, index, url, event, and the
        event's fields) and print it as one readable line (:func:`format_failover_event`)."""
        rec = {"t": time.time(), "index": index, "event": event, **kw}
        if index is not None and index < len(self.server_urls):
            rec["url"] = self.server_urls[index]
        with self._lock:
            if event == "died":
                self._died_at[index] = (rec["t"], kw.get("reason"))
            elif event == "rejoined" and index in self._died_at:
                t_died, reason = self._died_at.pop(index)
                rec.update(down_s=round(rec["t"] - t_died, 3), reason=reason)
            self.failover_events.append(rec)
        print(format_failover_event(rec, self.max_restarts), file=sys.stderr, flush=True)

    def _monitor_loop(self) -> None:
        """Failover monitor: process poll + GET /health of every live server each interval."""
        fails = [0] * self.num_servers
        with httpx.Client(timeout=self.health_check_timeout_s, trust_env=False) as client:
            while not self._stop.wait(self.health_check_interval_s):
                with self._lock:
                    live = [c for c in self._servers if c.index not in self._down]
                for child in live:
                    if self._stop.is_set():
                        return
                    rc = child.proc.poll()
                    reason = None
                    if rc is not None:
                        reason = describe_returncode(rc)
                    else:
                        try:
                            ok = client.get(child.url + "/health").status_code == 200
                        except httpx.HTTPError:
                            ok = False
                        fails[child.index] = 0 if ok else fails[child.index] + 1
                        if fails[child.index] >= self.health_failure_threshold:
                            reason = f"{fails[child.index]} failed health checks in a row (killed)"
                            child.proc.kill()
                            child.proc.wait()
                    if reason is not None:
                        fails[child.index] = 0
                        self._on_server_failure(child, reason)

    def _on_server_failure(self, child: _Child, reason: str) -> None:
        i = child.index
        with self._lock:
            if self._closed or i in self._down:
                return
            self._down.add(i)
        self._event(i, "died", pid=child.proc.pid, reason=reason)
        t = threading.Thread(target=self._restart, args=(child,), name=f"moerl-restart-{i}", daemon=True)
        self._restart_threads[i] = t
        t.start()

    def _restart(self, old: _Child) -> None:
        """Remove from the router, restart, restore the current weights, verify, rejoin the router."""
        i, url = old.index, old.url
        try:
            self._router_remove(url)
            self._event(i, "removed_from_router")
            while True:
                if self._closed:
                    return
                if self.restarts[i] >= self.max_restarts:
                    raise RolloutServerDiedError(
                        f"rollout server {i} ({url}) died again after {self.restarts[i]} restarts "
                        f"(max_restarts); log {old.log_path}, last lines:\n{tail_file(old.log_path, 15)}",
                        index=i, url=url, pid=old.proc.pid, returncode=old.proc.returncode or 0)
                self.restarts[i] += 1
                try:
                    old.log_file.close()
                except OSError:
                    pass
                with self._lock:
                    if self._closed:
                        return
                    fut: concurrent.futures.Future = concurrent.futures.Future()
                    self._spawn_q.put((fut, (f"server {i}", i, url, self._server_argv(i, self.base_port + i))))
                    child = fut.result()
                    self._servers[i] = child
                self._event(i, "restarted", pid=child.proc.pid, restart=self.restarts[i])
                if self._wait_healthy(child):
                    break
                old = child  # died during startup: try again (counts as a restart)
            with self._weights_lock:
                version = self._weight_version
                if self._restorer is not None:
                    self._restorer(url)
                if version is not None:
                    from moerl.rollout.weight_sync import verify_weight_version

                    verify_weight_version([url], version)
                self._event(i, "restored", weight_version=version)
                self._router_add(url)
                with self._lock:
                    self._down.discard(i)
            self._event(i, "rejoined", weight_version=version)
        except BaseException as e:  # noqa: BLE001 - reported through check_alive()
            if not self._closed:
                err = e if isinstance(e, RolloutError) else RolloutServerDiedError(
                    f"failover of rollout server {i} ({url}) failed: {type(e).__name__}: {e}",
                    index=i, url=url, pid=old.proc.pid, returncode=old.proc.returncode or 0)
                self._fatal = err
                self._event(i, "gave_up", error=str(err)[:500])

    def _spawner_loop(self) -> None:
        """Run _spawn for the restart threads (see __init__); ends at shutdown."""
        while True:
            item = self._spawn_q.get()
            if item is None:
                return
            fut, args = item
            try:
                fut.set_result(self._spawn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting restart thread
                fut.set_exception(e)

    def _wait_healthy(self, child: _Child) -> bool:
        """True when the restarted server answers /health; False if it exited first or the cluster
        was shut down meanwhile.

        Raises:
            RolloutStartupError: not healthy within startup_timeout_s.
        """

        def not_closed() -> None:
            if self._closed:
                raise _ShutDown

        try:
            wait_healthy(child.url, child.proc, timeout_s=self.startup_timeout_s, what=child.name,
                         log_path=child.log_path, check=not_closed)
        except (_ShutDown, ServerExitedError):
            return False
        except HealthTimeoutError:
            raise self._startup_error(child, f"did not answer /health within "
                                      f"{self.startup_timeout_s:.0f} s after a restart") from None
        return True

    def router_workers(self) -> list[dict]:
        """sglang-router's worker list (GET /workers: dicts with id, url, is_healthy, ...)."""
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            r = client.get(self.router_url + "/workers")
            r.raise_for_status()
            return list(r.json().get("workers", []))

    def _router_remove(self, url: str, timeout_s: float = 30.0) -> None:
        """DELETE /workers/{id} for every router entry of ``url``; wait until the list drops it."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            while True:
                ids = [w["id"] for w in self.router_workers() if w.get("url") == url]
                if not ids:
                    return
                for wid in ids:
                    client.delete(f"{self.router_url}/workers/{wid}")
                if time.monotonic() > deadline:
                    raise RolloutError(f"sglang-router did not drop worker {url} within {timeout_s:.0f} s")
                time.sleep(0.1)

    def _router_add(self, url: str) -> None:
        """POST /workers {"url"}; wait until the router lists ``url`` healthy (startup_timeout_s)."""
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            r = client.post(self.router_url + "/workers", json={"url": url})
            if r.status_code >= 400:
                raise RolloutError(f"sglang-router refused to add worker {url}: HTTP {r.status_code} {r.text[:300]}")
            while True:
                if any(w.get("url") == url and w.get("is_healthy", True) for w in self.router_workers()):
                    return
                if time.monotonic() > deadline:
                    raise RolloutError(f"sglang-router did not list worker {url} as healthy within "
                                       f"{self.startup_timeout_s:.0f} s")
                time.sleep(0.1)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL those still alive after shutdown_grace_s, reap all. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            children = self._children()
            for c in children:
                if c.proc.poll() is None:
                    try:
                        c.proc.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + self.shutdown_grace_s
            for c in children:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            for c in children:
                if c.proc.poll() is None:
                    try:
                        c.proc.kill()
                    except ProcessLookupError:
                        pass
                    c.proc.wait()
                try:
                    c.log_file.close()
                except OSError:
                    pass
            self._restore_signal_handlers()
            self._spawn_q.put(None)
            if self._http is not None:
                self._http.close()
                self._http = None
            try:
                atexit.unregister(self.shutdown)
            except Exception:
                pass

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works in the main thread; atexit + PDEATHSIG still apply
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:
                # the process ignores it (e.g. SIGINT in a job started in the background by a
                # non-interactive shell): respect that; atexit and PDEATHSIG still clean up
                continue
            self._prev_handlers[sig] = prev
            signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            # If a later handler chained onto ours, leave it; ours then just forwards to prev.
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.shutdown()  # restores prev as the installed handler
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

"""Start N rollout servers and the real sglang-router as child processes, and keep them accounted for.

    with RolloutCluster(model_path, num_servers=2, base_port=31000, router_port=30000,
                        log_dir="runs/x/rollout_logs") as cluster:
        client = RolloutClient(cluster.router_url, cluster=cluster)
        ...

Children: server i runs ``python -m moerl.rollout.server --model-path M --host H --port base_port+i
--num-threads T`` (or ``server_command(i, port)``), the router runs ``python -m
sglang_router.launch_router --host H --port router_port --worker-urls URL... --policy P
--prometheus-host 127.0.0.1 --prometheus-port <free port>``. Each gets OMP_NUM_THREADS=T,
OMP_WAIT_POLICY=PASSIVE, TORCHDYNAMO_DISABLE=1, its stdout+stderr in ``log_dir/<name>.log``, its own
session (terminal Ctrl-C reaches only the trainer, whose handler shuts the cluster down) and
PR_SET_PDEATHSIG=SIGKILL on Linux, so a SIGKILLed trainer takes its children with it. (PDEATHSIG fires
when the *thread* that started the child exits: create the cluster in the main thread or in a thread
that outlives it.) shutdown() runs at exit, on SIGTERM / SIGINT (then the previous handler runs), and
when the ``with`` block ends.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import os
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

from moerl.rollout.errors import PortInUseError, RolloutServerDiedError, RolloutStartupError

_PR_SET_PDEATHSIG = 1
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")


def _pdeathsig_preexec(parent_pid: int) -> Callable[[], None]:
    """preexec_fn for Popen: SIGKILL this child when its parent dies (Linux prctl); no-op elsewhere."""

    def fn() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent_pid:  # parent died before prctl took effect
                os._exit(1)

    return fn


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


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
        startup_timeout_s: seconds to wait for all servers and then the router to answer.
        log_dir: directory of the children's logs (default: a new temp dir).
        tokenizer_path: passed to the reference server as --tokenizer-path.
        server_command: optional ``f(index, port) -> argv`` to run another server (e.g. real SGLang).
        extra_env: extra environment variables for every child.

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
                 extra_env: Optional[dict] = None, shutdown_grace_s: float = 10.0):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        if router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {router_policy!r}")
        if threads_per_server < 1:
            raise ValueError(f"threads_per_server must be >= 1, got {threads_per_server}")
        if server_command is None and not os.path.isdir(model_path):
            raise ValueError(f"model_path {model_path!r} is not a directory")
        server_ports = list(range(base_port, base_port + num_servers))
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
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = log_dir
        self.tokenizer_path = tokenizer_path
        self.server_command = server_command
        self.extra_env = dict(extra_env or {})
        self.shutdown_grace_s = shutdown_grace_s
        self.server_urls = [f"http://{host}:{p}" for p in server_ports]
        self.router_url = f"http://{host}:{router_port}"
        self._servers: list[_Child] = []
        self._router: Optional[_Child] = None
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self._prev_handlers: dict[int, object] = {}

    # ------------------------------------------------------------------ start

    def __enter__(self) -> "RolloutCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def check_ports(self) -> None:
        """Raise PortInUseError naming the first taken port and the recipe key to change."""
        for i, url in enumerate(self.server_urls):
            port = self.base_port + i
            if not port_is_free(self.host, port):
                raise PortInUseError(
                    f"port {port} on {self.host} (rollout server {i}) is already in use; change "
                    f"rollout.base_port (servers use rollout.base_port .. rollout.base_port + "
                    f"{self.num_servers - 1}) or stop the process holding it")
        if not port_is_free(self.host, self.router_port):
            raise PortInUseError(f"port {self.router_port} on {self.host} (sglang-router) is already in "
                                 f"use; change rollout.router_port or stop the process holding it")

    def _env(self) -> dict:
        env = dict(os.environ)
        t = str(self.threads_per_server)
        env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OMP_WAIT_POLICY": "PASSIVE",
                    "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
                    "TOKENIZERS_PARALLELISM": "false"})
        # The children import moerl from the same tree as this process, wherever their cwd is.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update(self.extra_env)
        return env

    def _spawn(self, name: str, index: Optional[int], url: str, argv: Sequence[str]) -> _Child:
        log_path = os.path.join(self.log_dir, name.replace(" ", "_") + ".log")
        log_file = open(log_path, "ab", buffering=0)
        log_file.write(f"# {' '.join(argv)}\n".encode())
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, env=self._env(), start_new_session=True,
                                preexec_fn=_pdeathsig_preexec(os.getpid()), close_fds=True)
        return _Child(name, index, url, log_path, proc, log_file)

    def _server_argv(self, i: int, port: int) -> list[str]:
        if self.server_command is not None:
            return list(self.server_command(i, port))
        argv = [sys.executable, "-m", "moerl.rollout.server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(port), "--num-threads", str(self.threads_per_server)]
        if self.tokenizer_path:
            argv += ["--tokenizer-path", self.tokenizer_path]
        return argv

    def _router_argv(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host,
                "--port", str(self.router_port), "--worker-urls", *self.server_urls,
                "--policy", self.router_policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), "--log-level", "warn",
                "--worker-startup-timeout-secs", str(max(1, int(self.startup_timeout_s))),
                "--worker-startup-check-interval", "1"]

    def start(self) -> "RolloutCluster":
        """Check ports, start the servers, wait for /health, start the router, wait for /readiness."""
        with self._lock:
            if self._started:
                raise RuntimeError("RolloutCluster.start() called twice")
            self.check_ports()
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
            self._router = self._spawn("router", None, self.router_url, self._router_argv())
            self._wait_router(deadline)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _startup_error(self, child: _Child, what: str) -> RolloutStartupError:
        return RolloutStartupError(
            f"{child.name} ({child.url}, pid {child.proc.pid}) {what}; log {child.log_path}, last lines:\n"
            f"{tail_file(child.log_path)}")

    def _wait_ready(self, children: list[_Child], path: str, deadline: float) -> None:
        pending = list(children)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for child in list(pending):
                    rc = child.proc.poll()
                    if rc is not None:
                        raise self._startup_error(child, f"exited during startup with {describe_returncode(rc)}")
                    try:
                        if client.get(child.url + path).status_code == 200:
                            pending.remove(child)
                    except httpx.TransportError:
                        pass
                if pending:
                    if time.monotonic() > deadline:
                        raise self._startup_error(pending[0], f"did not answer {path} within "
                                                  f"{self.startup_timeout_s:.0f} s (startup_timeout_s)")
                    time.sleep(0.2)

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
                    if r.status_code == 200 and r.json().get("healthy_workers", 0) >= self.num_servers:
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
        for child in self._children():
            rc = child.proc.poll()
            if rc is not None:
                raise RolloutServerDiedError(
                    f"rollout {child.name} ({child.url}, pid {child.proc.pid}) died: "
                    f"{describe_returncode(rc)}; log {child.log_path}, last lines:\n{tail_file(child.log_path, 15)}",
                    index=child.index, url=child.url, pid=child.proc.pid, returncode=rc)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL those still alive after shutdown_grace_s, reap all. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
            try:
                atexit.unregister(self.shutdown)
            except Exception:
                pass

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works in the main thread; atexit + PDEATHSIG still apply
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)
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

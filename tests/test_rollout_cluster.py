"""RolloutCluster with real server subprocesses behind the real sglang-router."""

from __future__ import annotations

import ast
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import psutil
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.rollout.client import RolloutClient, group_requests, parse_generate_item  # noqa: E402
from moerl.rollout.common import free_port_block  # noqa: E402
from moerl.rollout.errors import (PortInUseError, RolloutRequestError, RolloutServerDiedError,
                                  RolloutStartupError)  # noqa: E402
from moerl.rollout.launcher import RolloutCluster, port_is_free  # noqa: E402
from moerl.rollout.server import ReferenceEngine  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint, refusing_port  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_moe_checkpoint(path, seed=0)
    return path


def _free_ports(n_servers: int) -> tuple[int, int]:
    """(base_port, router_port): base..base+n-1 for the servers and the next one for the router, a block that
    no other caller in this process was handed (moerl.rollout.common.free_port_block)."""
    base = free_port_block(n_servers + 1)
    return base, base + n_servers


def _live_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_cluster_generate_kill_and_shutdown(ckpt, tmp_path):
    before = {p.pid for p in _live_children()}
    base, router = _free_ports(2)
    cluster = RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=router,
                             threads_per_server=1, startup_timeout_s=90, log_dir=str(tmp_path / "logs"))
    with cluster:
        assert cluster.server_urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        assert cluster.router_url == f"http://127.0.0.1:{router}"
        pids = cluster.pids
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
        assert sorted(os.listdir(tmp_path / "logs")) == ["router.log", "server_0.log", "server_1.log"]
        cluster.check_alive()

        # generate through the router, one request per sample; equal to an in-process engine
        sp = {"temperature": 1.0, "max_new_tokens": 8}
        reqs = [b for g in range(6) for b in
                group_requests([4, 5, 13, 6, 15][: 3 + g % 3], 4, sp, seeds=[10 * g + k for k in range(4)],
                               rid=f"s0-g{g}")]
        client = RolloutClient(cluster.router_url, timeout_s=60, max_retries=2, cluster=cluster)
        outs = client.generate_many(reqs, max_concurrency=8)
        local = ReferenceEngine(ckpt)
        assert len(outs) == 24
        for req, out in zip(reqs, outs):
            assert isinstance(out, dict) and out["meta_info"]["id"] == req["rid"]
            assert out["output_ids"] == local.generate(req)["output_ids"]
            item = parse_generate_item(out)
            assert item.weight_version == "default" and len(item.rollout_log_probs) == len(item.response_ids)
        groups = [[tuple(o["output_ids"]) for o in outs[4 * g: 4 * g + 4]] for g in range(6)]
        assert all(len(set(gr)) > 1 for gr in groups), "samples of a group must differ"
        # a batched input_ids request with one sampling_params dict also passes the router
        both = client.generate_many([{"input_ids": [[4, 5], [6, 7, 8]], "sampling_params": sp}])[0]
        assert isinstance(both, list) and len(both) == 2
        # sglang-router refuses a list of sampling_params (HTTP 422), so the client raises at once
        with pytest.raises(RolloutRequestError, match="422"):
            client.generate_many([{"input_ids": [[4, 5]], "sampling_params": [sp]}])
        # each server also answers directly (weight sync talks to servers, not to the router)
        for url in cluster.server_urls:
            r = RolloutClient(url, timeout_s=30, max_retries=0).generate_many(
                [{"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}}])
            assert len(r[0]["output_ids"]) <= 2

        # pause / continue: sglang-router does not forward them (404), the cluster calls each server
        for path in ("/pause_generation", "/continue_generation"):
            assert httpx.post(cluster.router_url + path, json={}, timeout=30).status_code == 404
        assert cluster.pause_generation("abort") == cluster.server_urls
        waiting = threading.Thread(target=lambda: outs.append(client.generate_many(reqs[:1])))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive()  # paused servers hold the request
        assert cluster.continue_generation() == cluster.server_urls
        waiting.join(60)
        assert outs[-1][0]["output_ids"] == outs[0]["output_ids"]

        # kill -9 server 1: check_alive and the client name it
        victim = pids[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.time() + 10
        while cluster._servers[1].proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(RolloutServerDiedError) as ei:
            cluster.check_alive()
        err = ei.value
        assert err.index == 1 and err.pid == victim and err.url == cluster.server_urls[1]
        assert err.returncode == -signal.SIGKILL
        assert "server 1" in str(err) and "SIGKILL" in str(err) and str(victim) in str(err)
        with pytest.raises(RolloutServerDiedError, match="server 1"):
            client.generate_many(reqs[:2])
        with pytest.raises(RolloutServerDiedError, match="server 1"):  # without failover a dead server is named
            cluster.pause_generation("retract")
    # shutdown (by the with block) leaves no child process behind
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert {p.pid for p in _live_children()} == before
    with pytest.raises(RuntimeError, match="shut down"):
        cluster.check_alive()


def test_port_in_use_fails_before_starting_anything(ckpt, tmp_path):
    before = {p.pid for p in _live_children()}
    base, router = _free_ports(2)
    for taken, key in ((base + 1, "rollout.base_port"), (router, "rollout.router_port")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", taken))
            s.listen(1)
            cluster = RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=router,
                                     log_dir=str(tmp_path / "logs"))
            with pytest.raises(PortInUseError) as ei:
                cluster.start()
            assert str(taken) in str(ei.value) and key in str(ei.value)
        assert {p.pid for p in _live_children()} == before
        assert not os.path.exists(tmp_path / "logs")
    with pytest.raises(ValueError, match="rollout.router_port"):
        RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=base + 1)


def test_server_crash_during_startup_reports_its_log(tmp_path):
    before = {p.pid for p in _live_children()}
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    base, router = _free_ports(1)
    cluster = RolloutCluster(str(empty), num_servers=1, base_port=base, router_port=router,
                             startup_timeout_s=60, log_dir=str(tmp_path / "logs"))
    with pytest.raises(RolloutStartupError) as ei:
        cluster.start()
    msg = str(ei.value)
    assert "server 0" in msg and "exited during startup" in msg and "server_0.log" in msg
    assert "config.json" in msg or "Error" in msg  # the tail of the server's own traceback
    assert {p.pid for p in _live_children()} == before


def test_children_die_when_the_trainer_is_sigkilled(ckpt, tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the process that owns the cluster; its servers and router follow."""
    base, router = _free_ports(1)
    script = textwrap.dedent(f"""
        import sys, time
        from moerl.rollout.launcher import RolloutCluster
        c = RolloutCluster({ckpt!r}, num_servers=1, base_port={base}, router_port={router},
                           log_dir={str(tmp_path / 'logs')!r}).start()
        print(" ".join(map(str, c.pids)), flush=True)
        time.sleep(600)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = owner.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, line
        assert all(psutil.pid_exists(p) for p in pids)
        owner.kill()
        owner.wait()
        def running(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        deadline = time.time() + 60  # generous: a loaded 2-core machine delivers signals late
        alive = pids
        while alive and time.time() < deadline:
            alive = [p for p in pids if running(p)]
            time.sleep(0.1)
        assert alive == []
    finally:
        if owner.poll() is None:
            owner.kill()


def test_ctrl_c_shuts_the_cluster_down_then_raises_keyboardinterrupt(ckpt, tmp_path):
    """SIGINT to the owner: the cluster's handler terminates every child, then the previous handler
    (Python's KeyboardInterrupt) runs; the owner reports its children's exit codes."""
    base, router = _free_ports(1)
    script = textwrap.dedent(f"""
        import faulthandler, signal, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's dump of a hang
        # an interactive program's SIGINT (a job started in the background by a non-interactive
        # shell, as CI may do, inherits SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from moerl.rollout.launcher import RolloutCluster
        c = RolloutCluster({ckpt!r}, num_servers=1, base_port={base}, router_port={router},
                           log_dir={str(tmp_path / 'logs')!r}).start()
        try:
            print(" ".join(map(str, c.pids)), flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", [ch.proc.returncode for ch in c._children()], flush=True)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    err_path = tmp_path / "owner_stderr.txt"  # a file: a pipe nobody reads could fill up
    with open(err_path, "w") as err_f:
        owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err_f, text=True,
                                 env=dict(os.environ, PYTHONPATH=root))

    def hung(what: str) -> None:  # seen once in a loaded fast suite: say where every thread of the owner was
        owner.send_signal(signal.SIGUSR1)
        time.sleep(2)
        owner.kill()
        pytest.fail(f"the owner {what}; its stderr and threads:\n{err_path.read_text()[-6000:]}")

    try:
        with selectors.DefaultSelector() as sel:  # epoll: select() refuses the fds > 1023 of a busy worker
            sel.register(owner.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=120):
                hung("did not start the cluster within 120 s")
        line = owner.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, f"owner printed {line!r}; stderr:\n{err_path.read_text()[-3000:]}"
        owner.send_signal(signal.SIGINT)
        try:
            out, _ = owner.communicate(timeout=90)  # liveness bound only (slow when the 2 cores are busy)
        except subprocess.TimeoutExpired:
            hung("did not exit within 90 s of SIGINT")
        assert out.startswith("KeyboardInterrupt"), out
        codes = ast.literal_eval(out.split(" ", 1)[1])  # e.g. [0, 0]
        assert all(rc is not None for rc in codes)  # reaped before the interrupt reached the loop
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                       for p in pids)
    finally:
        if owner.poll() is None:
            owner.kill()


class _DeadCluster:
    def __init__(self):
        self.calls = 0

    def check_alive(self):
        self.calls += 1
        if self.calls > 1:
            raise RolloutServerDiedError("rollout server 0 (http://x, pid 1) died: signal SIGKILL",
                                         index=0, url="http://x", pid=1, returncode=-9)


def test_client_retries_then_names_the_dead_server():
    with refusing_port() as port:  # nothing listens there
        client = RolloutClient(f"http://127.0.0.1:{port}", timeout_s=5, max_retries=2, backoff_s=0.01)
        with pytest.raises(RolloutRequestError, match="after 3 attempts.*Connect"):
            client.generate_many([{"input_ids": [4, 5]}])
        dead = _DeadCluster()
        client = RolloutClient(f"http://127.0.0.1:{port}", timeout_s=5, max_retries=2, backoff_s=0.01, cluster=dead)
        with pytest.raises(RolloutServerDiedError, match="server 0") as ei:
            client.generate_many([{"input_ids": [4, 5]}])
        assert ei.value.index == 0 and dead.calls == 2  # checked before the attempt and after its failure


def test_an_ignored_signal_stays_ignored(tmp_path):
    """A process that ignores SIGINT (background job of a non-interactive shell) keeps ignoring it:
    the cluster does not hook it (so a stray SIGINT does not stop the servers), SIGTERM still is."""
    c = RolloutCluster(str(tmp_path), num_servers=1, base_port=31000, router_port=30000)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        c._install_signal_handlers()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == c._on_signal
        c._restore_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


# ----------------------------------------------------------------------------- wait_healthy


class _Health:
    """A /health endpoint in a thread (http.server) that answers ``statuses`` in turn, then 200."""

    def __init__(self, statuses):
        import http.server
        import threading

        self.statuses, self.gets = list(statuses), 0
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server API
                outer.gets += 1
                code = outer.statuses.pop(0) if outer.statuses else 200
                self.send_response(code if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_wait_healthy_returns_at_the_first_200():
    from moerl.rollout.launcher import wait_healthy

    srv = _Health([503, 503])
    try:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            wait_healthy(srv.url + "/", proc, timeout_s=20, interval_s=0.02)
        finally:
            proc.kill()
            proc.wait()
        assert srv.gets == 3  # 503, 503, 200: returned at the first 200 and not before
    finally:
        srv.close()


def test_wait_healthy_names_the_url_exit_code_and_log_tail_of_a_dead_process(tmp_path):
    from moerl.rollout.errors import ServerExitedError
    from moerl.rollout.launcher import wait_healthy

    with refusing_port() as port:  # nothing listens there
        url = f"http://127.0.0.1:{port}"
        code = "import sys; print('loading weights'); print('boom: no config.json', file=sys.stderr); sys.exit(3)"
        log = tmp_path / "s.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)
        with pytest.raises(RuntimeError) as ei:
            wait_healthy(url, proc, timeout_s=60, what="server 3", log_path=str(log))
        msg = str(ei.value)
        assert isinstance(ei.value, ServerExitedError) and ei.value.returncode == 3 and ei.value.url == url
        assert f"server 3 ({url}, pid {proc.pid}) exited with exit code 3" in msg
        assert "loading weights" in msg and "boom: no config.json" in msg and str(log) in msg
        # no log file: the tail of the process's stderr pipe; killed by a signal: named
        proc = subprocess.Popen([sys.executable, "-c", "import os, sys, signal; print('dying', file=sys.stderr, "
                                 "flush=True); os.kill(os.getpid(), signal.SIGKILL)"], stderr=subprocess.PIPE)
        with pytest.raises(ServerExitedError, match=r"(?s)exited with signal SIGKILL.*dying"):
            wait_healthy(url, proc, timeout_s=60)


def test_wait_healthy_times_out_on_a_silent_external_url_with_progress_lines(capsys):
    from moerl.rollout.errors import RolloutStartupError
    from moerl.rollout.launcher import wait_healthy

    with refusing_port() as port:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as ei:
            wait_healthy(url, None, timeout_s=1.0, what="external rollout server", interval_s=0.05,
                         progress_every_s=0.3)
        took = time.monotonic() - t0
        assert 1.0 <= took < 10.0
        assert isinstance(ei.value, RolloutStartupError) and ei.value.url == url and ei.value.timeout_s == 1.0
        assert f"({url}) did not answer /health with HTTP 200 within 1 s (last: Connect" in str(ei.value)
        lines = [ln for ln in capsys.readouterr().err.splitlines()
                 if f"waiting for external rollout server {url}" in ln]
        assert 1 <= len(lines) <= 4, lines  # every 0.3 s (at ~0.3, 0.6, 0.9 s; fewer on a loaded machine)
        assert all("s of timeout 1 s" in ln for ln in lines)
        # a child process has its own log: no progress lines for it; a 503 is reported as the last answer
        srv = _Health([503] * 10_000)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with pytest.raises(TimeoutError, match=r"within 0.5 s \(last: HTTP 503\)"):
                wait_healthy(srv.url, proc, timeout_s=0.5, interval_s=0.05, progress_every_s=0.1)
        finally:
            proc.kill()
            proc.wait()
            srv.close()
        assert "waiting for" not in capsys.readouterr().err


def test_wait_healthy_check_ends_the_wait():
    from moerl.rollout.launcher import wait_healthy

    with refusing_port() as port:
        url = f"http://127.0.0.1:{port}"
        calls = []

        def check():
            calls.append(1)
            if len(calls) == 3:
                raise KeyError("stop")

        with pytest.raises(KeyError, match="stop"):
            wait_healthy(url, None, timeout_s=60, interval_s=0.01, check=check)
        assert len(calls) == 3


def test_startup_names_the_server_that_dies_while_another_is_still_starting(tmp_path):
    """Server 0 never answers, server 1 exits: the cluster names server 1 at once (not a timeout of 0)."""
    base, router = _free_ports(2)
    # server 0 holds its port without listening: nobody else (another xdist worker's server) can answer there
    argv = {0: lambda port: [sys.executable, "-c", "import socket, time; s = socket.socket(); "
                             f"s.bind(('127.0.0.1', {port})); time.sleep(60)"],
            1: lambda port: [sys.executable, "-c", "import sys; print('server one failed'); sys.exit(5)"]}
    cluster = RolloutCluster(str(tmp_path), num_servers=2, base_port=base, router_port=router, startup_timeout_s=60,
                             log_dir=str(tmp_path / "logs"), server_command=lambda i, port: argv[i](port))
    t0 = time.monotonic()
    with pytest.raises(RolloutStartupError) as ei:
        cluster.start()
    msg = str(ei.value)
    assert time.monotonic() - t0 < 30
    assert "server 1" in msg and "exited during startup with exit code 5" in msg and "server one failed" in msg
    # a server that never answers: named with the recipe key to raise
    cluster = RolloutCluster(str(tmp_path), num_servers=1, base_port=base, router_port=router, startup_timeout_s=1,
                             log_dir=str(tmp_path / "logs2"), server_command=lambda i, port: argv[0](port))
    with pytest.raises(RolloutStartupError, match=r"server 0 .*did not answer /health within 1 s \(startup_timeout_s\)"):
        cluster.start()


def test_startup_names_an_external_url_that_never_answers(tmp_path):
    base, router = _free_ports(1)
    with refusing_port() as port:
        dead = f"http://127.0.0.1:{port}"
        cluster = RolloutCluster(str(tmp_path), num_servers=0, base_port=base, router_port=router, startup_timeout_s=1,
                                 log_dir=str(tmp_path / "logs"), extra_worker_urls=[dead + "/"])
        with pytest.raises(RolloutStartupError, match=rf"external rollout server \({dead}\) did not answer /health "
                                                      r".*rollout.external_urls"):
            cluster.start()
        assert cluster._router is None  # the router is started only once every server answers


def test_router_prometheus_port_is_free_and_below_the_ephemeral_range(tmp_path):
    from moerl.rollout.launcher import free_port_below_ephemeral

    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    base, router = _free_ports(2)
    c = RolloutCluster(str(tmp_path), num_servers=2, base_port=base, router_port=router)
    for _ in range(20):
        argv = c._router_argv()
        port = int(argv[argv.index("--prometheus-port") + 1])
        assert port < min(lo, 32768) and port not in (base, base + 1, router) and port_is_free("127.0.0.1", port)
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    # exclude is honoured even when it leaves a single candidate; a port handed out is not handed out again in
    # this process (two picks before anything binds must differ)
    from moerl.rollout.common import _HANDED_OUT_PORTS

    lo2 = next(p for p in range(25000, 26000, 2) if port_is_free("127.0.0.1", p + 1) and p + 1 not in _HANDED_OUT_PORTS)
    assert free_port_below_ephemeral(exclude=[lo2], low=lo2, high=lo2 + 1) == lo2 + 1
    with pytest.raises(RuntimeError, match="not handed out before"):
        free_port_below_ephemeral(exclude=[lo2], low=lo2, high=lo2 + 1)
    with pytest.raises(ValueError, match="low"):
        free_port_below_ephemeral(low=30000, high=20000)


def test_failover_events_print_as_one_readable_line():
    from moerl.rollout.launcher import format_failover_event

    u = "http://127.0.0.1:31001"
    base = {"t": 0.0, "index": 1, "url": u}
    cases = [
        ({"event": "died", "pid": 123, "reason": "signal SIGKILL"},
         f"server 1 ({u}) died (signal SIGKILL, pid 123); taking it out of the router"),
        ({"event": "removed_from_router"}, f"server 1 ({u}) removed from the router; restarting it"),
        ({"event": "restarted", "pid": 456, "restart": 1}, f"server 1 ({u}) restarted as pid 456 (restart 1 of 3); "
                                                            f"waiting for /health"),
        ({"event": "restored", "weight_version": "3"}, f"server 1 ({u}) restored to weights version 3"),
        ({"event": "restored", "weight_version": None}, f"server 1 ({u}) has no weight update to restore "
                                                         f"(initial weights)"),
        ({"event": "rejoined", "weight_version": "3", "down_s": 2.125, "reason": "signal SIGKILL"},
         f"server 1 ({u}) back in the router with weights version 3, 2.1 s after it died (signal SIGKILL)"),
        ({"event": "gave_up", "error": "rollout server 1 died again after 3 restarts\nlog tail"},
         f"server 1 ({u}) given up: rollout server 1 died again after 3 restarts"),
    ]
    for rec, want in cases:
        line = format_failover_event({**base, **rec}, max_restarts=3)
        assert line == "[moerl] rollout failover: " + want
        assert "\n" not in line and "{" not in line


def test_cluster_records_url_and_downtime_with_its_failover_events(tmp_path, capsys):
    c = RolloutCluster(str(tmp_path), num_servers=2, base_port=31000, router_port=30000, failover=True)
    c._event(1, "died", pid=7, reason="signal SIGKILL")
    time.sleep(0.2)
    c._event(1, "rejoined", weight_version="4")
    died, rejoined = c.failover_events
    assert died["url"] == c.server_urls[1] and died["event"] == "died" and died["pid"] == 7
    assert rejoined["reason"] == "signal SIGKILL" and 0.2 <= rejoined["down_s"] < 5
    assert abs(rejoined["down_s"] - (rejoined["t"] - died["t"])) < 1e-3
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"[moerl] rollout failover: server 1 ({c.server_urls[1]}) died (signal SIGKILL, pid 7); " \
                     f"taking it out of the router"
    assert err[1].startswith(f"[moerl] rollout failover: server 1 ({c.server_urls[1]}) back in the router with "
                             f"weights version 4, ") and err[1].endswith(" s after it died (signal SIGKILL)")


def test_update_weights_reaches_the_servers_it_did_not_start(tmp_path):
    """Other nodes' servers and rollout.external_urls serve rollouts behind the router: every weight update
    must reach them as well as this cluster's own servers (with and without failover)."""
    base, router = _free_ports(1)
    ext = ["http://10.0.0.2:30000/", "http://10.0.0.3:30000"]
    for failover in (False, True):
        c = RolloutCluster(str(tmp_path), num_servers=1, base_port=base, router_port=router, failover=failover,
                           extra_worker_urls=ext)
        pushed = []
        got = c.update_weights("v1", pushed.append)
        own = [] if failover else c.server_urls  # not started: no live server of its own with failover
        assert pushed == [own + ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]] and got == pushed[0]
        assert c.current_weight_version == "v1"

        def failing(urls):
            raise ConnectionError("external server down")

        with pytest.raises(ConnectionError):  # an external server failing is not mistaken for a dead own server
            c.update_weights("v2", failing)
        assert c.current_weight_version == "v1"


def test_port_check_resolves_rollout_host_auto():
    """moerl train's port pre-check (moerl.train.setup.check_ports_free) with rollout.host=auto checks this
    node's address (it used to pass the literal "auto" to bind: socket.gaierror) and still names a taken
    port."""
    from types import SimpleNamespace

    from moerl.rollout.sglang_launcher import resolve_host
    from moerl.train.setup import check_ports_free

    base, router = _free_ports(1)
    check_ports_free(SimpleNamespace(host="auto", base_port=base, num_servers=1, router_port=router))
    with socket.socket() as s:
        s.bind((resolve_host("auto"), base))
        s.listen(1)
        with pytest.raises(PortInUseError, match=rf"port {base} on .* rollout.base_port"):
            check_ports_free(SimpleNamespace(host="auto", base_port=base, num_servers=1, router_port=router))


class _Proc:
    """A server process stand-in whose poll() reports SIGKILL from monotonic time ``dies_at`` on (None: never)."""

    def __init__(self, dies_at=None):
        self.dies_at, self.pid, self.returncode = dies_at, 1, None

    def poll(self):
        if self.dies_at is not None and time.monotonic() >= self.dies_at:
            self.returncode = -9
        return self.returncode


def test_pause_and_continue_reach_every_server_and_tolerate_a_dead_one(ckpt, tmp_path):
    """pause_generation / continue_generation go to the cluster's live servers and to its external
    URLs (in-process reference servers here). A server that dies meanwhile (connection refused a moment
    before its process can be reaped) is skipped with failover (it comes back unpaused after its restart)
    and named without; a live server or external URL that fails is named."""
    from moerl.rollout.errors import RolloutError
    from moerl.rollout.inprocess import serve_in_thread
    from moerl.rollout.launcher import _Child

    base, router = _free_ports(2)
    own, ext = ReferenceEngine(ckpt), ReferenceEngine(ckpt)
    try:
        with serve_in_thread(own, port=base) as u0, serve_in_thread(ext) as ue:
            for failover in (True, False):
                c = RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=router, failover=failover,
                                   extra_worker_urls=[ue])
                u1 = c.server_urls[1]  # nothing listens there: the server is dying
                c._servers = [_Child("server 0", 0, u0, "", _Proc(), None),
                              _Child("server 1", 1, u1, "", _Proc(time.monotonic() + 0.3), None)]
                with pytest.raises(ValueError, match="mode must be one of"):
                    c.pause_generation("halt")
                if not failover:
                    with pytest.raises(RolloutServerDiedError, match=rf"server 1 \({u1}"):
                        c.pause_generation()
                    continue
                assert c.pause_generation("retract") == [u0, ue] and own.paused and ext.paused
                assert c.continue_generation() == [u0, ue] and not own.paused and not ext.paused
            # an external URL that does not answer is an error naming it (it is no server of this cluster)
            dead_ext = f"http://127.0.0.1:{router}"
            c = RolloutCluster(ckpt, num_servers=1, base_port=base, router_port=router + 1, failover=True,
                               extra_worker_urls=[dead_ext])
            c._servers = [_Child("server 0", 0, u0, "", _Proc(), None)]
            with pytest.raises(RolloutError, match=rf"/pause_generation failed on 1 of 2 servers:\n.*{dead_ext}"):
                c.pause_generation()
            assert own.paused  # the live server was paused all the same
            own.continue_generation()
    finally:
        own.close()
        ext.close()

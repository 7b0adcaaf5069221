"""RolloutCluster with real server subprocesses behind the real sglang-router."""

from __future__ import annotations

import ast
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.rollout.client import RolloutClient, group_requests, parse_generate_item  # noqa: E402
from moerl.rollout.errors import (PortInUseError, RolloutRequestError, RolloutServerDiedError,
                                  RolloutStartupError)  # noqa: E402
from moerl.rollout.launcher import RolloutCluster, port_is_free  # noqa: E402
from moerl.rollout.server import ReferenceEngine  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_moe_checkpoint(path, seed=0)
    return path


def _free_ports(n_servers: int) -> tuple[int, int]:
    """(base_port, router_port) with base..base+n-1 and router free right now."""
    for _ in range(200):
        base = random.randint(20000, 32000 - n_servers - 1)  # below the ephemeral range (32768+)
        ports = list(range(base, base + n_servers + 1))
        if all(port_is_free("127.0.0.1", p) for p in ports):
            return base, ports[-1]
    raise RuntimeError("no free port range found")


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
        import signal, time
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
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=root))
    try:
        pids = [int(x) for x in owner.stdout.readline().split()]
        assert len(pids) == 2
        owner.send_signal(signal.SIGINT)
        out, _ = owner.communicate(timeout=90)  # liveness bound only (slow when the 2 cores are busy)
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
    port = _free_ports(0)[0]  # nothing listens there
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

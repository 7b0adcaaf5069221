"""Rollout failover: kill -9 of one of two reference servers (behind the real sglang-router) in the
middle of a 64-prompt x 4-sample rollout.

Independent references: every sample's tokens and log-probs are recomputed by an in-process
ReferenceEngine loaded from the same weight-version directory (a sample depends only on its prompt,
its sampling_seed and the weights, not on the server that produced it), and the servers' own request
logs (JSON lines written by each process) show what was in flight at the kill and in which order the
restarted process was called.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.rollout.client import RolloutClient, group_requests, parse_generate_item  # noqa: E402
from moerl.rollout.launcher import RolloutCluster, disk_restorer  # noqa: E402
from moerl.rollout.server import ReferenceEngine, load_safetensors_dir  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint  # noqa: E402
from moerl.rollout.weight_sync import sync_weights_from_disk  # noqa: E402

from _mp_helpers import free_port_block  # noqa: E402

N_PROMPTS, N_SAMPLES, VERSION = 64, 4, "v7"


def _read_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _requests(prefix: str, n_prompts: int, n_samples: int) -> list[dict]:
    sp = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12, "stop_token_ids": [1]}
    out = []
    for g in range(n_prompts):
        prompt = [3 + (g * 7 + j) % 40 for j in range(3 + g % 5)]
        out += group_requests(prompt, n_samples, sp, seeds=[1000 * g + k for k in range(n_samples)],
                              rid=f"{prefix}-g{g}")
    return out


@pytest.mark.slow  # 13-27 s on 2 shared cores
def test_kill9_mid_rollout_returns_every_sample_once_and_restart_gets_current_weights(tmp_path):
    from transformers import AutoConfig

    ckpt = str(tmp_path / "tiny")
    make_tiny_moe_checkpoint(ckpt, seed=0)
    # The weights the servers must use: the checkpoint perturbed, published as weight_version v7.
    g = torch.Generator().manual_seed(5)
    new_sd = {n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in load_safetensors_dir(ckpt)}
    base = free_port_block(3)
    cluster = RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=base + 2,
                             startup_timeout_s=120, log_dir=str(tmp_path / "logs"), failover=True,
                             health_check_interval_s=0.2, request_log=True, max_restarts=2)
    with cluster:
        root = tmp_path / "weights"
        cluster.update_weights(
            VERSION, lambda urls: sync_weights_from_disk(urls, new_sd, AutoConfig.from_pretrained(ckpt), root, VERSION),
            restore=disk_restorer(str(root / f"weights_{VERSION}"), VERSION))
        assert cluster.current_weight_version == VERSION

        reqs = _requests("fo", N_PROMPTS, N_SAMPLES)
        assert len(reqs) == 256
        client = RolloutClient(cluster.router_url, timeout_s=120, max_retries=2, cluster=cluster)
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(outs=client.generate_many(reqs, max_concurrency=256)))
        log0 = cluster.request_log_path(0)
        old_pid = cluster.pids[0]
        worker.start()
        # kill -9 server 0 as soon as it has rollout requests in flight
        deadline = time.monotonic() + 60
        while not any(r["path"] == "/generate" and r["event"] == "recv" and str(r.get("rid", "")).startswith("fo-")
                      for r in _read_log(log0)):
            assert time.monotonic() < deadline, "server 0 never received a rollout request"
            time.sleep(0.02)
        time.sleep(0.1)
        os.kill(old_pid, signal.SIGKILL)
        worker.join(180)
        assert not worker.is_alive(), "the rollout did not finish after the kill"
        outs = result["outs"]

        # server 0 had requests in flight that it never answered
        old_log = [r for r in _read_log(log0) if r["pid"] == old_pid and r["path"] == "/generate"]
        recv = {r["rid"] for r in old_log if r["event"] == "recv"}
        done = {r["rid"] for r in old_log if r["event"] == "done"}
        lost = recv - done
        assert lost, "the kill did not hit any in-flight request; the test exercised nothing"

        # every sample exactly once, keyed by its rid, equal to an independent in-process engine
        assert [o["meta_info"]["id"] for o in outs] == [r["rid"] for r in reqs]
        assert len({o["meta_info"]["id"] for o in outs}) == 256
        ref = ReferenceEngine(str(root / f"weights_{VERSION}"), tokenizer_path=ckpt)
        try:
            pending = [ref.submit(r) for r in reqs]
            expect = [ref.response(p) for p in pending]
        finally:
            ref.close()
        for req, out, exp in zip(reqs, outs, expect):
            item = parse_generate_item(out)
            assert item.weight_version == VERSION
            assert out["output_ids"] == exp["output_ids"], req["rid"]
            lp_ref = [e[0] for e in exp["meta_info"]["output_token_logprobs"]]
            # float32: the server batches the in-flight requests differently from the reference engine
            # (and the restarted server differently again), so sums round differently; 0.3-perturbed
            # weights give log-probs down to ~-10, hence a relative term (v0's weights differ by >1e-1)
            assert item.rollout_log_probs == pytest.approx(lp_ref, rel=2e-5, abs=1e-5)
        assert lost <= {o["meta_info"]["id"] for o in outs}
        # the lost requests were served by the surviving server, each request once there
        log1 = [r for r in _read_log(cluster.request_log_path(1)) + _read_log(log0)
                if r["pid"] != old_pid and r["path"] == "/generate" and r["event"] == "done"
                and r["status"] == 200 and str(r.get("rid", "")).startswith("fo-")]
        survivors = [r["rid"] for r in log1]
        assert lost <= set(survivors) and len(survivors) == len(set(survivors))
        assert set(survivors) | done == {r["rid"] for r in reqs}

        # the dead server was restarted, got v7 before rejoining the router
        cluster.wait_serving(timeout_s=120)
        events = [e for e in cluster.failover_events if e["index"] == 0]
        assert [e["event"] for e in events] == ["died", "removed_from_router", "restarted", "restored", "rejoined"]
        new_pid = cluster.pids[0]
        assert new_pid != old_pid and events[2]["pid"] == new_pid and events[3]["weight_version"] == VERSION
        assert sorted(w["url"] for w in cluster.router_workers()) == sorted(cluster.server_urls)

        # a second rollout reaches the restarted server too, with the current weights
        reqs2 = _requests("after", 8, 2)
        outs2 = client.generate_many(reqs2)
        new_log = [r for r in _read_log(log0) if r["pid"] == new_pid]
        first_gen = next(k for k, r in enumerate(new_log) if r["path"] == "/generate")
        upd = [k for k, r in enumerate(new_log) if r["path"] == "/update_weights_from_disk" and r["event"] == "done"]
        assert upd and upd[0] < first_gen, "the restarted server served before it received the weights"
        assert new_log[upd[0]]["status"] == 200 and new_log[upd[0]]["weight_version"] == VERSION
        assert all(r["weight_version"] == VERSION for r in new_log[upd[0]:] if r["event"] == "done")
        served_new = {r["rid"] for r in new_log if r["path"] == "/generate" and r["event"] == "done"}
        assert served_new, "the router sent nothing to the restarted server"
        ref = ReferenceEngine(str(root / f"weights_{VERSION}"), tokenizer_path=ckpt)
        try:
            for req, out in zip(reqs2, outs2):
                assert out["meta_info"]["weight_version"] == VERSION
                assert out["output_ids"] == ref.generate(req)["output_ids"]
        finally:
            ref.close()
        cluster.check_alive()


def test_failover_gives_up_after_max_restarts_and_names_the_server(tmp_path):
    """max_restarts=0: the dead server leaves the router, the other keeps serving, and
    check_alive() raises RolloutServerDiedError naming the server."""
    from moerl.rollout.errors import RolloutServerDiedError

    ckpt = str(tmp_path / "tiny")
    make_tiny_moe_checkpoint(ckpt, seed=0)
    base = free_port_block(3)
    with RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=base + 2, startup_timeout_s=120,
                        log_dir=str(tmp_path / "logs"), failover=True, health_check_interval_s=0.2,
                        max_restarts=0) as cluster:
        os.kill(cluster.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while cluster._fatal is None:
            assert time.monotonic() < deadline, "failover did not give up"
            time.sleep(0.1)
        with pytest.raises(RolloutServerDiedError, match=r"server 1 .*max_restarts") as e:
            cluster.check_alive()
        assert e.value.index == 1 and e.value.url == cluster.server_urls[1]
        assert [w["url"] for w in cluster.router_workers()] == [cluster.server_urls[0]]
        assert cluster.live_server_urls() == [cluster.server_urls[0]]
        out = RolloutClient(cluster.router_url, max_retries=0).generate_many(_requests("x", 2, 2))
        assert len(out) == 4 and all(o["meta_info"]["weight_version"] == "default" for o in out)


class _DyingProc:
    """A child process stand-in whose poll() reports SIGKILL from monotonic time ``dies_at`` on (None: never)."""

    def __init__(self, dies_at):
        self.dies_at, self.pid, self.returncode = dies_at, 1, None

    def poll(self):
        if self.dies_at is not None and time.monotonic() >= self.dies_at:
            self.returncode = -9
        return self.returncode


def test_weight_push_that_fails_as_a_server_dies_is_retried_on_the_survivor(tmp_path):
    """kill -9 closes a server's sockets a moment before its process can be reaped: the push sees
    ConnectError while proc.poll() still says alive. update_weights waits for the death to show
    and retries on the live server instead of failing the run (reviewer's race, failover on)."""
    from moerl.rollout.launcher import _Child

    c = RolloutCluster(str(tmp_path), num_servers=2, base_port=31000, router_port=30000, failover=True)

    u0, u1 = c.server_urls
    c._servers = [_Child("server 0", 0, u0, "", _DyingProc(None), None),
                  _Child("server 1", 1, u1, "", _DyingProc(time.monotonic() + 0.5), None)]
    calls = []

    def push(urls):
        calls.append(list(urls))
        if len(calls) == 1:
            raise ConnectionError(f"{u1}: Connection refused")

    assert c.update_weights("7", push) == [u0]
    assert calls == [[u0, u1], [u0]] and c.current_weight_version == "7"
    # no death: the push error is the caller's (nothing to fail over to)
    c._servers[1] = _Child("server 1", 1, u1, "", _DyingProc(None), None)

    def broken(urls):
        raise ValueError("bad weights")

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="bad weights"):
        c.update_weights("8", broken)
    assert time.monotonic() - t0 < 30


def test_weight_push_that_fails_as_a_server_dies_names_it_without_failover(tmp_path):
    """rollout.failover=false: the push fails (connection refused) a moment before the killed server can be
    reaped; update_weights waits for the death to show and raises RolloutServerDiedError naming that server
    (not the bare connection error)."""
    from moerl.rollout.errors import RolloutServerDiedError
    from moerl.rollout.launcher import _Child

    c = RolloutCluster(str(tmp_path), num_servers=2, base_port=31000, router_port=30000, failover=False)
    u0, u1 = c.server_urls
    c._servers = [_Child("server 0", 0, u0, "", _DyingProc(None), None),
                  _Child("server 1", 1, u1, "", _DyingProc(time.monotonic() + 0.5), None)]

    def push(urls):
        assert urls == [u0, u1]
        raise ConnectionError(f"{u1}: Connection refused")

    with pytest.raises(RolloutServerDiedError, match=rf"server 1 \({u1}"):
        c.update_weights("3", push)
    assert c.current_weight_version is None


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_trainer_weight_sync_goes_through_the_cluster_retry(tmp_path, monkeypatch, mode):
    """moerl.train.weight_sync.WeightSync pushes through RolloutCluster.update_weights: the same race as
    above (server 1's sockets close before its process can be reaped) ends in one retry on the
    survivor, a rebuilt distributed group, and the restorer of this version registered; without
    failover every server gets the push and the dead one is named."""
    from types import SimpleNamespace

    import moerl.train.weight_sync as loop
    from moerl.config.schema import RolloutConfig
    from moerl.rollout.errors import RolloutServerDiedError
    from moerl.rollout.launcher import _Child

    sd = {"w": torch.ones(2)}
    pushes, restorers = [], []

    def fake_sync(m, urls, hf_sd, version, *, updater=None, out_root=None, tp_cache=None, **kw):
        pushes.append((list(urls), version, None if updater is None else list(updater.server_urls)))
        assert tp_cache == {}  # WeightSync.tp_sizes: empty at first, emptied after the failed push
        tp_cache.update((u, 1) for u in urls)  # what server_tp_sizes stores
        if m == "disk":  # what sync_weights_from_disk leaves behind: the version directory
            os.makedirs(os.path.join(out_root, f"weights_{version}"), exist_ok=True)
        if len(pushes) == 1:
            raise ConnectionError(f"{urls[-1]}: Connection refused")

    def fake_restorer(weight_sync, hf_sd, version, out_root, bucket_bytes):
        restorers.append((weight_sync, hf_sd is sd, version, os.path.isdir(os.path.join(out_root, f"weights_{version}"))))
        return lambda url: restorers.append(("restore", url))

    monkeypatch.setattr(loop, "sync_weights", fake_sync)
    monkeypatch.setattr(loop, "failover_restorer", fake_restorer)
    actor = SimpleNamespace(export_hf_state_dict=lambda dst: sd)

    def weight_sync(failover, dies_at):
        c = RolloutCluster(str(tmp_path), num_servers=2, base_port=31000, router_port=30000, failover=failover)
        u0, u1 = c.server_urls
        c._servers = [_Child("server 0", 0, u0, "", _DyingProc(None), None),
                      _Child("server 1", 1, u1, "", _DyingProc(dies_at), None)]
        real, c.calls = c.update_weights, []
        c.update_weights = lambda *a, **kw: c.calls.append(a[0]) or real(*a, **kw)  # spy: the loop's way in
        ro = RolloutConfig(weight_sync=mode, failover=failover)
        ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=ro), run_dir=tmp_path, hf_config=None)
        return c, loop.WeightSync(ctx, c, version=2)

    c, ws = weight_sync(True, time.monotonic() + 0.5)
    u0, u1 = c.server_urls
    assert ws(actor) == "3" and c.calls == ["3"]
    group = [[u0, u1], [u0]] if mode == "distributed" else [None, None]
    assert pushes == [([u0, u1], "3", group[0]), ([u0], "3", group[1])]
    assert ws.tp_sizes == {u0: 1}  # the survivor's, kept for the next push
    if mode == "distributed":
        assert ws.updater.server_urls == [u0]  # the group of the failed push was dropped, a new one made
    assert c.current_weight_version == "3" and not restorers  # the restorer is built when a server restarts
    c._restorer(u1)
    assert restorers == [(mode, True, "3", mode == "disk"), ("restore", u1)]

    # failover off: the push goes to every server (the dead one too) and the dead one is named
    pushes.clear()
    c, ws = weight_sync(False, time.monotonic())
    with pytest.raises(RolloutServerDiedError, match="server 1"):
        ws(actor)
    assert [p[0] for p in pushes] == [c.server_urls] and c.current_weight_version is None and c.calls == ["3"]


@pytest.mark.parametrize("mode", ["distributed", "tensor", "disk"])
def test_trainer_weight_sync_with_every_server_restarting_records_the_version(tmp_path, mode):
    """Failover on and every own server down (dead or restarting): update_weights pushes to [].
    The RL step must not die on it (DistributedWeightUpdater([]) raised ValueError): the push is a
    no-op (disk still writes the version directory), the version and restorer are recorded, and
    a group built for the servers that died is torn down. Real sync_weights, no server at all."""
    from types import SimpleNamespace

    import moerl.train.weight_sync as loop
    from moerl.config.schema import RolloutConfig
    from moerl.rollout.launcher import _Child

    ckpt = str(tmp_path / "ckpt")
    model = make_tiny_moe_checkpoint(ckpt, seed=0)
    sd = dict(load_safetensors_dir(ckpt))
    base = free_port_block(3)
    c = RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=base + 2, failover=True)
    u0, u1 = c.server_urls
    c._servers = [_Child("server 0", 0, u0, "", _DyingProc(0.0), None),  # both already dead
                  _Child("server 1", 1, u1, "", _DyingProc(0.0), None)]
    ro = RolloutConfig(weight_sync=mode, failover=True)
    ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=ro), run_dir=tmp_path, hf_config=model.config)
    ws = loop.WeightSync(ctx, c, version=2)
    closed = []
    if mode == "distributed":  # the group of the last push, to the servers that have since died
        ws.updater = SimpleNamespace(server_urls=[u0, u1], close=lambda: closed.append(True))
    actor = SimpleNamespace(export_hf_state_dict=lambda dst, out_alloc=None: sd if out_alloc is None else {
        n: out_alloc(n, t.shape, t.dtype).copy_(t) for n, t in sd.items()})  # tensor mode: into the arena
    assert c.live_server_urls() == []
    assert ws(actor) == "3"
    assert c.current_weight_version == "3" and c._restorer is not None
    assert ws.updater is None and closed == ([True] if mode == "distributed" else [])
    vdir = tmp_path / "weights" / "weights_3"
    assert vdir.is_dir() == (mode == "disk")
    if mode == "disk":  # what the restorer will load: the trainer's tensors
        back = dict(load_safetensors_dir(str(vdir)))
        assert set(back) == set(sd) and all(torch.equal(back[n], sd[n]) for n in sd)

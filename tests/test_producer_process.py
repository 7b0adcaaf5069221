"""rollout.producer_process (moerl.rollout.producer_process): the RolloutManager in a child process hands the
trainer the same batches as the RolloutManager thread it replaces, keeps the staleness bound with weight
updates cut into running requests, and reports a child that dies or a push that fails.

Reference: the in-process RolloutManager on the same simulated servers (tests/test_rollout_manager.py's
FakeServers, here behind a real HTTP endpoint so that the child process can reach them), the same prompts,
tokenizer and reward function.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from moerl.data.dataset import PromptSampler
from moerl.data.tokenizer import PromptEncoder, build_tokenizer, decode_response
from moerl.rollout.client import RolloutClient
from moerl.rollout.manager import RolloutManager
import moerl.rollout.producer_process as producer_process
from moerl.rollout.producer_process import ProducerProcessError, RolloutManagerProcess
from test_rollout_manager import PROMPT_LEN, STOP, FakeServers

REWARD_PY = '''
def reward(response, label):
    return float(len(response) % 2)
'''


class HttpFakeServers(FakeServers):
    """FakeServers on a real port (aiohttp, a thread of the test process), and the cluster API the
    producer process reads (server_urls, live_server_urls, check_alive, failover)."""

    failover = False
    num_servers = 1
    extra_worker_urls: list = []

    def __init__(self, **kw):
        super().__init__(**kw)
        from aiohttp import web

        self.dead = None
        self.pause_via: list[str] = []  # "http" (SGLang's endpoint: the producer child) or "cluster" (the trainer)
        self.refuse: set[str] = set()  # control paths answered HTTP 503
        ready = threading.Event()

        async def generate(request):
            return web.json_response(await self.post("/generate", await request.json()))

        def control(path, call):
            async def handle(request):
                if path in self.refuse:
                    return web.Response(status=503, text="refused by the test")
                body = await request.json()
                # FakeServers.pause_generation blocks until the aborted requests are answered: off this loop
                await asyncio.get_running_loop().run_in_executor(None, lambda: call(body, via="http"))
                return web.json_response({"message": "ok", "status": "ok"})
            return handle

        def serve():
            loop = asyncio.new_event_loop()
            self.loop = loop
            app = web.Application()
            app.router.add_post("/generate", generate)
            app.router.add_post("/pause_generation", control(
                "/pause_generation", lambda b, via: self.pause_generation(b.get("mode", "abort"), via=via)))
            app.router.add_post("/continue_generation", control(
                "/continue_generation", lambda b, via: self.continue_generation()))
            runner = web.AppRunner(app)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.server_urls = [f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"]
            ready.set()
            loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        ready.wait(10)

    def live_server_urls(self):
        return list(self.server_urls)

    def pause_generation(self, mode: str = "abort", via: str = "cluster"):
        self.pause_via.append(via)
        return super().pause_generation(mode)

    def check_alive(self):
        if self.dead:
            raise RuntimeError(self.dead)


def _cfg(reward_path, mode="async", max_staleness=1, B=4, n=2, max_new=8):
    return SimpleNamespace(
        seed=7,
        train=SimpleNamespace(mode=mode, max_staleness=max_staleness, staleness_policy="wait",
                              partial_rollout_mask_old=False),
        rollout=SimpleNamespace(n_samples_per_prompt=n, rollout_batch_size=B, dynamic_sampling=False,
                                max_oversample_factor=3.0, max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                                top_k=-1, placement="disaggregated", max_inflight_groups=None, group_requests=True,
                                pause_mode="abort", backend="sglang", startup_timeout_s=5.0),
        data=SimpleNamespace(prompt_key="prompt", label_key="label"),
        reward=SimpleNamespace(function=f"{reward_path}:reward", group=False, num_workers=0, timeout_s=10.0,
                               error_value=0.0, model_path=None, model_weight=1.0, rule_weight=1.0,
                               model_batch_size=16))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def reward_path(tmp_path):
    p = tmp_path / "reward_fn.py"
    p.write_text(REWARD_PY)
    return str(p)


def _rows():
    return [{"prompt": f"{i:03d}+{i:03d}=", "label": str(2 * i)} for i in range(40)]


def _process(servers, cfg, tok, num_steps):
    spec = dict(router_url=servers.server_urls[0], timeout_s=30.0, max_retries=0, cfg=cfg,
                sampler=PromptSampler(_rows(), cfg.rollout.rollout_batch_size, 3), tokenizer=tok, system_prompt=None,
                eos_id=STOP, num_steps=num_steps, version=servers.version, steps_done=0, state=None,
                routing_shape=None)
    return RolloutManagerProcess(cluster=servers, spec=spec, log=lambda m: None)


def _thread(servers, cfg, tok, num_steps):
    from moerl.rewards.registry import resolve_reward_fn

    fn = resolve_reward_fn(cfg.reward.function)
    client = RolloutClient(servers.server_urls[0], timeout_s=30.0, max_retries=0, cluster=servers)
    return RolloutManager(client=client, cluster=servers, sampler=PromptSampler(_rows(), cfg.rollout.rollout_batch_size, 3),
                          encode=PromptEncoder(tok, None), decode=lambda ids: decode_response(tok, ids),
                          reward_fn=lambda text, label: float(fn(text, label)), cfg=cfg, eos_id=STOP,
                          num_steps=num_steps, version=servers.version, log=lambda m: None)


def _run(mgr, servers, num_steps):
    out = []
    with mgr:
        for step in range(1, num_steps + 1):
            b = mgr.get_batch(step)
            out.append([(s.metadata["uid"], s.prompt_ids, s.response_ids, s.rollout_log_probs, s.token_versions,
                         s.reward, s.loss_mask) for s in b.samples] + [b.trainer_version])
            mgr.update_weights(servers.push, step)
        mgr.wait_weights()
        state = mgr.state_dict()
    return out, state


def test_child_process_gives_the_thread_managers_batches(tok, reward_path):
    """async with max_staleness 0: every batch starts after the previous push, so the batches are
    deterministic; the child's equal the in-process manager's, and so does the resume cursor."""
    runs = {}
    for kind, make in (("thread", _thread), ("process", _process)):
        servers = HttpFakeServers()
        cfg = _cfg(reward_path, max_staleness=0)
        runs[kind] = _run(make(servers, cfg, tok, 5), servers, 5)
    assert runs["process"] == runs["thread"]
    batches, _ = runs["process"]
    assert {r for b in batches for (*_, r, _m) in b[:-1]} == {0.0, 1.0}  # the reward function really ran


@pytest.mark.parametrize("freeze", [True, False])
def test_the_child_freezes_its_start_up_objects_out_of_the_gc_as_train_freeze_gc_says(tok, reward_path, freeze):
    """train.freeze_gc: while its reward workers start, before its first draw, the child moves its start-up
    objects (torch, the tokenizer, the spec) to the permanent GC generation, as the trainer does; otherwise a
    full collection walks them mid-rollout."""
    servers = HttpFakeServers()
    cfg = _cfg(reward_path, max_staleness=0)
    cfg.train.freeze_gc = freeze
    with _process(servers, cfg, tok, 1) as mgr:
        info = dict(mgr.child_info)
        assert len(mgr.get_batch(1).samples) == 8
    assert (info["gc_frozen"] > 10_000) if freeze else (info["gc_frozen"] == 0)


def test_child_process_keeps_the_staleness_bound_through_cut_requests(tok, reward_path):
    servers = HttpFakeServers(token_s=0.01)
    cfg = _cfg(reward_path, max_staleness=1)
    batches, _ = _run(_process(servers, cfg, tok, 8), servers, 8)
    ages, uids = [], []
    for step, b in enumerate(batches, start=1):
        trainer_version = b[-1]
        assert trainer_version == step - 1
        for uid, prompt, resp, lps, versions, _r, mask in b[:-1]:
            assert len(resp) == len(lps) == len(versions) == len(mask)
            shift = len(prompt) - PROMPT_LEN  # FakeServers counts positions from a 4-token prompt
            for j, (v, lp) in enumerate(zip(versions, lps)):  # each token's version is its producer's
                assert lp == pytest.approx(-(v + 1) / 100 - (j + shift) / 1000)
            ages += [trainer_version - v for v in versions]
            uids.append(uid)
    assert max(ages) <= 1 and max(ages) == 1
    assert len(uids) == len(set(uids)) == 8 * 4 * 2
    # the pushes that found the next batch's groups in flight (each push but the last, unless the groups
    # finished first) paused the servers, from the child (SGLang's endpoint, off the trainer's core)
    assert 1 <= servers.pauses <= 7 and servers.pause_via == ["http"] * servers.pauses and not servers.paused


@pytest.mark.parametrize("refused", ["/pause_generation", "/continue_generation"])
def test_a_server_that_refuses_the_childs_pause_or_continue_is_handed_to_the_trainers_cluster(tok, reward_path,
                                                                                          refused):
    """The child pauses and continues the servers itself; one that refuses (HTTP 503 here) goes back to the
    trainer's cluster, whose rules decide (failover skips a dead server, else it is named): the servers are
    paused all the same (by the pushes that found the next batch's groups in flight: each but the last,
    the next batch starting as soon as the trainer takes one), continued after it, and the staleness bound
    holds."""
    servers = HttpFakeServers(token_s=0.01)
    servers.refuse = {refused}
    batches, _ = _run(_process(servers, _cfg(reward_path, max_staleness=1), tok, 4), servers, 4)
    via = "cluster" if refused == "/pause_generation" else "http"
    assert 1 <= servers.pauses <= 3 and servers.pause_via == [via] * servers.pauses and not servers.paused
    assert [b[-1] for b in batches] == [0, 1, 2, 3]
    assert max(b[-1] - v for b in batches for *_, versions, _r, _m in b[:-1] for v in versions) <= 1


def test_a_dead_child_and_a_failed_push_are_reported(tok, reward_path):
    # slow tokens: batch 2 (8 tokens, 0.4 s) cannot be ready before the failed push (milliseconds) has ended
    servers = HttpFakeServers(token_s=0.05)
    cfg = _cfg(reward_path, max_staleness=1)
    mgr = _process(servers, cfg, tok, 6).start()
    try:
        mgr.get_batch(1)

        def bad_push():
            raise ValueError("push refused")

        mgr.update_weights(bad_push, 1)
        with pytest.raises(ValueError, match="push refused"):
            mgr.get_batch(2)  # the child stops producing; the trainer raises the push's own error
        os.kill(mgr.proc.pid, signal.SIGKILL)
        mgr.proc.wait()
        with pytest.raises(ProducerProcessError, match="exited during get_batch"):
            mgr.get_batch(2)
    finally:
        mgr.close()


def _within(seconds, fn, *args):
    """``fn(*args)`` on a thread of its own: its value, or its error raised here; fails the test when it has
    not returned after ``seconds`` (a hang fails instead of blocking the run)."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _kill(mgr):
    if mgr.proc is not None and mgr.proc.poll() is None:
        mgr.proc.kill()
        mgr.proc.wait(10)


def test_an_interrupted_exchange_breaks_the_proxy_instead_of_reading_its_answer_later(tok, reward_path, monkeypatch):
    """KeyboardInterrupt between a request and its answer leaves the answer unread: the next call raises
    ProducerProcessError (it would have read the state_dict answer as its batch), and close() does not wait on
    the wire: the child sees its connections close and exits by itself."""
    servers = HttpFakeServers()
    mgr = _process(servers, _cfg(reward_path), tok, 4).start()
    try:
        recv = producer_process._recv

        def interrupted(conn):
            monkeypatch.setattr(producer_process, "_recv", recv)
            raise KeyboardInterrupt

        monkeypatch.setattr(producer_process, "_recv", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mgr.state_dict()  # the request went out, the child answers it; the answer stays unread
        for _ in range(2):  # every later call, without reading (or sending) anything
            with pytest.raises(ProducerProcessError,
                               match=r"out of step \(state_dict did not complete: KeyboardInterrupt\): get_batch\(1\)"):
                _within(20, mgr.get_batch, 1)
        t0 = time.monotonic()
        _within(20, mgr.close)
        assert time.monotonic() - t0 < 15
        assert mgr.proc.returncode == 0  # it exited on its own (not killed)
    finally:
        _kill(mgr)


def test_close_does_not_wait_forever_for_a_child_that_does_not_answer(tok, reward_path, monkeypatch):
    """A child that never answers the close message (stopped here) is waited for CLOSE_TIMEOUT_S, then killed."""
    monkeypatch.setattr(producer_process, "CLOSE_TIMEOUT_S", 1.0, raising=False)
    servers = HttpFakeServers()
    mgr = _process(servers, _cfg(reward_path), tok, 4).start()
    logs = []
    mgr.log = logs.append
    try:
        mgr.get_batch(1)
        os.kill(mgr.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _within(15, mgr.close)
        assert time.monotonic() - t0 < 10
        assert mgr.proc.returncode == -signal.SIGKILL
        assert any("did not answer close within 1 s" in m for m in logs), logs
    finally:
        _kill(mgr)


def test_close_does_not_wait_forever_for_a_push_that_does_not_land(tok, reward_path, monkeypatch):
    """A background push wedged in push() (a server that never answers) is waited for PUSH_LAND_TIMEOUT_S by
    close(), which then stops the child anyway and says so."""
    monkeypatch.setattr(producer_process, "PUSH_LAND_TIMEOUT_S", 1.0)
    servers = HttpFakeServers()
    cfg = _cfg(reward_path, max_staleness=1)
    mgr = _process(servers, cfg, tok, 6).start()
    assert mgr.background_push
    logs, wedged = [], threading.Event()
    mgr.log = logs.append
    try:
        mgr.get_batch(1)
        mgr.update_weights(lambda: wedged.wait(60), 1)
        t0 = time.monotonic()
        _within(20, mgr.close)
        assert time.monotonic() - t0 < 15
        assert any("did not land within 1 s" in m for m in logs), logs
        assert mgr.proc.wait(10) is not None
    finally:
        wedged.set()
        _kill(mgr)


def test_a_failed_hold_still_ends_the_push(tok, reward_path, monkeypatch):
    """The child's hold raises (an unknown message here): the push is still ended as failed, so the child's
    producer stops and its get_batch raises, rather than handing out batches (or waiting forever) with the push
    still marked in flight."""
    servers = HttpFakeServers()
    mgr = _process(servers, _cfg(reward_path, max_staleness=1), tok, 6).start()
    call = mgr._call
    try:
        mgr.get_batch(1)
        monkeypatch.setattr(mgr, "_call", lambda conn, msg, what, **kw: call(
            conn, ("hold-refused",) if msg[0] == "hold" else msg, what, **kw))
        mgr.update_weights(servers.push, 1)
        with pytest.raises(ValueError, match="unknown push message 'hold-refused'"):
            _within(20, mgr.wait_weights)  # the push's own error
        with pytest.raises(RuntimeError, match="the weight push after step 1 failed"):
            _within(20, mgr.get_batch, 2)  # the child got end(failed=True); the wire is still in step
        assert servers.pauses == 0
    finally:
        _within(60, mgr.close)


def test_get_batch_on_a_dead_child_reports_it_when_the_cluster_view_cannot_be_sent(tok, reward_path):
    servers = HttpFakeServers()
    mgr = _process(servers, _cfg(reward_path), tok, 4).start()
    try:
        mgr.get_batch(1)
        os.kill(mgr.proc.pid, signal.SIGKILL)
        mgr.proc.wait(30)
        servers.server_urls = servers.server_urls + ["http://127.0.0.1:9"]  # get_batch sends the changed view first
        with pytest.raises(ProducerProcessError, match=r"exited during get_batch\(2\) \(status -9"):
            _within(20, mgr.get_batch, 2)
    finally:
        _within(60, mgr.close)


def test_a_push_without_background_push_sets_the_version_as_the_thread_manager(tok, reward_path):
    """rollout.background_push false: the update is the RolloutManager's (hold, push, end; no begin_push), so
    the version after it is push()'s, or the previous one + 1 when push() returns none (begin_push first would
    count that + 1 twice in the child)."""
    got = {}
    for kind, make in (("thread", _thread), ("process", _process)):
        servers = HttpFakeServers()
        cfg = _cfg(reward_path, max_staleness=1)
        cfg.rollout.background_push = False
        with make(servers, cfg, tok, 3) as mgr:
            assert mgr.background_push is False
            mgr.get_batch(1)
            mgr.update_weights(lambda: servers.push() and None, 1)
            got[kind] = (_within(20, mgr.get_batch, 2).trainer_version, mgr.version)
            assert servers.pauses <= 1 and not servers.paused  # paused when batch 2's groups were in flight
    assert got["process"] == got["thread"] == (1, 1)


def test_the_wire_carries_torch_tensors_from_a_popen_child(tmp_path):
    """R3 batches hold routed_experts tensors: a child started by Popen sends one through the wire's pickles
    (Connection.send's ForkingPickler would pass it as shared memory the trainer cannot receive)."""
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection

    import torch

    from moerl.rollout.producer_process import _recv

    ours, theirs = socket.socketpair()
    code = ("import sys, torch; from multiprocessing.connection import Connection; "
            "from moerl.rollout.producer_process import _answer; "
            "_answer(Connection(int(sys.argv[1])), lambda: {'routed': torch.arange(12, dtype=torch.int32).view(3, 4)})")
    proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    conn = Connection(ours.detach())
    kind, value = _recv(conn)
    assert proc.wait(60) == 0
    assert kind == "ok" and torch.equal(value["routed"], torch.arange(12, dtype=torch.int32).view(3, 4))


def test_an_exception_that_does_not_unpickle_travels_as_its_text():
    import socket
    from multiprocessing.connection import Connection

    from moerl.rollout.errors import RolloutServerDiedError
    from moerl.rollout.producer_process import _answer, _recv

    a, b = socket.socketpair()
    ca, cb = Connection(a.detach()), Connection(b.detach())

    def die():
        raise RolloutServerDiedError("server 0 died", index=0, url="http://x", pid=1, returncode=-9)

    _answer(ca, die)
    kind, err = _recv(cb)
    assert kind == "err" and isinstance(err, RuntimeError) and "RolloutServerDiedError: server 0 died" in str(err)

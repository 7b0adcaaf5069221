"""RolloutManager (moerl.rollout.manager) against a simulated SGLang server pool: the staleness bound
holds for every trained token in every mode and policy, async with max_staleness 0 reproduces sync,
one_step_off trains on the previous version, weight updates cut and resume responses (per-token
versions and behaviour log-probs kept, partial_rollout_mask_old honoured), a cut response is never
scored as complete, dynamic sampling counts what it draws and drops, and a resume from the cursor
neither loses nor repeats a group.

The simulated servers are independent of the manager: each token is a deterministic function of the
request's rid and position, its log-prob encodes the weight version that produced it, and a pause
(mode abort) cuts every running request after the tokens it has produced so far, like SGLang.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from types import SimpleNamespace

import pytest

from moerl.data.dataset import PromptSampler
from moerl.rollout.manager import MAX_SEGMENTS, RolloutManager

PROMPT_LEN = 4
STOP = 1


def _h(*keys) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, keys)).encode()).digest()[:4], "little")


class FakeServers:
    """An SGLang-like server pool: /generate with per-token delay, pause (abort) / continue, versions.

    A response's full length is ``2 + _h(base rid) % (max_new - 1)`` tokens (the last one the stop token
    when it fits); token j of response ``base rid`` is ``10 + _h(base rid, j) % 50``, whatever segment
    produces it; its log-prob is ``-(version + 1) / 100 - j / 1000``, so a test can read which version
    produced each token.
    """

    def __init__(self, token_s: float = 0.002, max_new: int = 8, abort_first: int = 0, abort_after: int = 1):
        self.version = 0
        self.token_s = token_s
        self.max_new = max_new
        self.paused = False
        self._lock = threading.Lock()
        self._running: dict[int, dict] = {}
        self.pauses = 0
        self.requests: list[str] = []
        self.abort_first = abort_first  # answer the first N segments of every response with an abort ...
        self.abort_after = abort_after  # ... after this many tokens
        self.max_running = 0  # most requests generating at once
        self.batches: list[list[str]] = []  # rids of each batched request (rollout.group_requests)

    async def post(self, path: str, body: dict):
        assert path == "/generate"
        if isinstance(body["rid"], list):  # SGLang's batch form: one result per prompt, in order
            self.batches.append(list(body["rid"]))
            assert len(body["input_ids"]) == len(body["sampling_params"]) == len(body["rid"])
            return list(await asyncio.gather(*(
                self._one({"input_ids": ids, "sampling_params": sp, "rid": rid})
                for ids, sp, rid in zip(body["input_ids"], body["sampling_params"], body["rid"]))))
        return await self._one(body)

    async def _one(self, body: dict) -> dict:
        while self.paused:
            await asyncio.sleep(0.001)
        rid = body["rid"]
        base = rid.split("-r")[0]
        with self._lock:
            self.requests.append(rid)
            req = {"abort": False}
            self._running[id(req)] = req
            self.max_running = max(self.max_running, len(self._running))
            version = self.version
        done = len(body["input_ids"]) - PROMPT_LEN
        total = 2 + _h(base) % (self.max_new - 1)
        budget = body["sampling_params"]["max_new_tokens"]
        toks, lps, finish = [], [], None
        segment = int(rid.split("-r")[1]) if "-r" in rid else 0
        try:
            for j in range(done, done + budget):
                await asyncio.sleep(self.token_s)
                if req["abort"] or (segment < self.abort_first and j >= done + self.abort_after):
                    finish = {"type": "abort", "message": "Abort request"}
                    break
                tok = STOP if j == total - 1 else 10 + _h(base, j) % 50
                toks.append(tok)
                lps.append(-(version + 1) / 100 - j / 1000)
                if tok == STOP:
                    finish = {"type": "stop", "matched": STOP}
                    break
            if finish is None:
                finish = {"type": "length", "length": budget}
        finally:
            with self._lock:
                self._running.pop(id(req), None)
        return {"text": "", "output_ids": toks,
                "meta_info": {"id": rid, "finish_reason": finish, "weight_version": str(version),
                              "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, toks)]}}

    # cluster side (called from the trainer thread)
    def pause_generation(self, mode: str = "abort"):
        assert mode == "abort"
        self.pauses += 1
        self.paused = True
        with self._lock:
            for req in self._running.values():
                req["abort"] = True
        while True:  # SGLang answers once the aborted requests are out
            with self._lock:
                if not self._running:
                    return []
            time.sleep(0.001)

    def continue_generation(self):
        self.paused = False
        return []

    def push(self) -> int:
        self.version += 1
        return self.version


def _cfg(mode="async", max_staleness=1, policy="wait", B=4, n=2, max_new=8, mask_old=False, dynamic=False,
         factor=3.0, max_inflight=None, group=None):
    return SimpleNamespace(
        seed=7,
        train=SimpleNamespace(mode=mode, max_staleness=max_staleness, staleness_policy=policy,
                              partial_rollout_mask_old=mask_old),
        rollout=SimpleNamespace(n_samples_per_prompt=n, rollout_batch_size=B, dynamic_sampling=dynamic,
                                max_oversample_factor=factor, max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                                top_k=-1, placement="disaggregated", max_inflight_groups=max_inflight,
                                group_requests=group),
        data=SimpleNamespace(prompt_key="prompt", label_key="label"))


def _manager(servers, cfg, num_steps, state=None, steps_done=0, reward=None):
    rows = [{"prompt": f"p{i}", "label": str(i)} for i in range(50)]
    reward = reward or (lambda text, label: float(_h(text, label) % 2))
    return RolloutManager(client=servers, cluster=servers, sampler=PromptSampler(rows, cfg.rollout.rollout_batch_size, 3),
                          encode=lambda t: [2] * PROMPT_LEN, decode=lambda ids: " ".join(map(str, ids)),
                          reward_fn=reward, cfg=cfg, eos_id=STOP, num_steps=num_steps, version=servers.version,
                          steps_done=steps_done, state=state, log=lambda m: None)


def _run(servers, cfg, num_steps, train_s=0.01, manager=None, first=1, stop_after=None):
    """Simulated trainer: take each batch, 'train', push. Returns (batches, manager)."""
    mgr = manager or _manager(servers, cfg, num_steps)
    out = []
    with mgr:
        for step in range(first, num_steps + 1):
            batch = mgr.get_batch(step)
            out.append(batch)
            time.sleep(train_s * (1 + step % 3))
            mgr.update_weights(servers.push, step)
            if stop_after == step:
                return out, mgr
    return out, mgr


def _check_versions(batch, servers_version_before_push):
    """Per-token versions are the ones the simulated server encoded in the log-probs."""
    for s in batch.samples:
        assert len(s.token_versions) == len(s.response_ids) == len(s.rollout_log_probs) == len(s.loss_mask)
        for j, (v, lp) in enumerate(zip(s.token_versions, s.rollout_log_probs)):
            assert lp == pytest.approx(-(v + 1) / 100 - j / 1000)
        assert batch.trainer_version == servers_version_before_push


@pytest.mark.parametrize("group", [True, False])  # rollout.group_requests: one batched request per group or per sample
@pytest.mark.parametrize("policy", ["wait", "drop"])
@pytest.mark.parametrize("eta", [1, 2, 4])
def test_staleness_bound_holds_for_every_trained_token(eta, policy, group):
    servers = FakeServers(token_s=0.003)
    batches, mgr = _run(servers, _cfg(max_staleness=eta, policy=policy, group=group), num_steps=14, train_s=0.01)
    assert bool(servers.batches) == group
    ages, uids, resumed, dropped = [], [], 0, 0
    for step, b in enumerate(batches, start=1):
        _check_versions(b, step - 1)
        for s in b.samples:
            trained = [b.trainer_version - v for v, m in zip(s.token_versions, s.loss_mask) if m]
            assert trained and max(trained) <= eta, (step, s.metadata["uid"], s.token_versions)
            ages += trained
            uids.append(s.metadata["uid"])
        resumed += b.metrics["rollout/resumed_segments"]
        dropped += b.metrics["rollout/dropped_stale_groups"]
        # the batch stays full; every drawn group is accounted for: trained or dropped as stale
        assert len(b.groups) == 4
        assert b.metrics["rollout/drawn_groups"] == 4 + b.metrics["rollout/dropped_stale_groups"]
    assert len(uids) == len(set(uids))  # no sample trained twice
    assert max(ages) >= 1  # the run really was off-policy
    # weight updates landed in flight and cut responses; the servers were paused exactly by the updates
    # that found a group in flight (rollout/paused_pushes of the batches after them; the last push's is
    # still in the manager's counters)
    paused = sum(b.metrics["rollout/paused_pushes"] for b in batches) + mgr._counters["paused_pushes"]
    assert resumed > 0 and servers.pauses == paused > 0
    if policy == "wait":
        assert dropped == 0  # the gate alone keeps the bound


def test_async_with_staleness_0_reproduces_sync():
    runs = {}
    for mode in ("sync", "async"):
        servers = FakeServers()
        batches, _ = _run(servers, _cfg(mode=mode, max_staleness=0), num_steps=6)
        runs[mode] = [[(s.metadata["uid"], s.response_ids, s.rollout_log_probs, s.token_versions, s.reward,
                        s.loss_mask) for s in b.samples] + [b.trainer_version] for b in batches]
        assert all(v == b.trainer_version for b in batches for s in b.samples for v in s.token_versions)
    assert runs["async"] == runs["sync"]


def test_one_step_off_trains_each_batch_one_version_late_and_never_cuts():
    servers = FakeServers()
    batches, _ = _run(servers, _cfg(mode="one_step_off", max_staleness=1), num_steps=6, train_s=0.02)
    assert servers.pauses == 0 and not any("-r" in r for r in servers.requests)
    for step, b in enumerate(batches, start=1):
        want = 0 if step == 1 else 1  # batch k+1 was generated while step k trained
        assert {b.trainer_version - v for s in b.samples for v in s.token_versions} == {want}, step


@pytest.mark.parametrize("group", [True, False])
@pytest.mark.parametrize("mask_old", [False, True])
def test_resumed_responses_keep_per_token_versions_and_mask_old(mask_old, group):
    servers = FakeServers(token_s=0.004)
    batches, _ = _run(servers, _cfg(max_staleness=2, mask_old=mask_old, group=group), num_steps=8, train_s=0.01)
    mixed = [s for b in batches for s in b.samples if len(set(s.token_versions)) > 1]
    assert mixed, "no response spanned two versions"
    for s in mixed:
        newest = max(s.token_versions)
        # each token's version is the one of the segment that produced it (versions never decrease)
        assert s.token_versions == sorted(s.token_versions) and s.metadata["segments"] > 1
        want = [int(v == newest) if mask_old else 1 for v in s.token_versions]
        assert s.loss_mask == want
        # the whole response is the one the server would give uncut (same tokens, in order)
        base = s.metadata["uid"]
        d, g, k = base.split("-")
        total = 2 + _h(f"s{d}-g{g}-{k}") % 7
        assert len(s.response_ids) == total and s.response_ids[-1] == STOP and s.status == "completed"


@pytest.mark.parametrize("group", [True, False])
def test_a_cut_response_is_continued_before_it_is_scored_and_given_up_after_max_segments(group):
    scored = []

    def reward(text, label):
        scored.append(text)
        return 1.0

    servers = FakeServers(abort_first=2)  # every response is cut after 1 token, twice, then finishes
    cfg = _cfg(mode="sync", n=2, B=2, group=group)
    batches, _ = _run(servers, cfg, num_steps=2, manager=_manager(servers, cfg, 2, reward=reward))
    for b in batches:
        for s in b.samples:
            assert s.metadata["segments"] == min(3, len(s.response_ids)) >= 2
            assert s.status == "completed" and s.response_ids[-1] == STOP
    full = {" ".join(map(str, s.response_ids)) for b in batches for s in b.samples}
    assert set(scored) == full and len(scored) == 8  # only whole responses were scored, each once
    servers = FakeServers(abort_first=MAX_SEGMENTS + 1, abort_after=0)  # never finishes: the group is dropped, counted
    mgr = _manager(servers, _cfg(mode="sync", n=2, B=2, group=group), num_steps=1, reward=reward)
    with mgr:
        b = mgr.get_batch(1)
    assert b.groups == [] and b.metrics["rollout/failed_groups"] == 8  # each replaced, up to 4 x rollout_batch_size


def test_dynamic_sampling_collects_groups_with_signal_and_counts_the_rest():
    servers = FakeServers()
    cfg = _cfg(mode="sync", B=4, n=4, dynamic=True, factor=2.0)
    batches, _ = _run(servers, cfg, num_steps=5)
    for b in batches:
        m = b.metrics
        assert all(len({s.reward for s in g}) == 2 for g in b.groups)  # every kept group has variance
        assert m["rollout/drawn_groups"] == len(b.groups) + m["rollout/dropped_no_signal_groups"]
        assert m["rollout/drawn_groups"] <= 8  # max_oversample_factor * rollout_batch_size
        assert len(b.groups) == 4 or m["rollout/drawn_groups"] == 8
    assert sum(b.metrics["rollout/dropped_no_signal_groups"] for b in batches) > 0


def test_resume_from_the_cursor_loses_and_repeats_no_group():
    cfg = _cfg(max_staleness=2, policy="wait")
    servers = FakeServers()
    first, mgr = _run(servers, cfg, num_steps=10, stop_after=4)  # killed after step 4 (buffer full)
    state = mgr.state_dict()
    assert state["draw"] == 5 and state["skip"] == 0
    mgr2 = _manager(servers, cfg, num_steps=10, state=state, steps_done=4)
    rest, _ = _run(servers, cfg, num_steps=10, manager=mgr2, first=5)
    uids = [s.metadata["uid"] for b in first + rest for s in b.samples]
    assert len(uids) == len(set(uids)) == 10 * 4 * 2
    assert {u.rsplit("-", 2)[0] for u in uids} == {str(d) for d in range(1, 11)}  # draws 1..10, in order
    # the resumed run draws the prompts the uninterrupted run would have
    servers3 = FakeServers()
    whole, _ = _run(servers3, cfg, num_steps=10)
    assert [s.prompt for b in whole for s in b.samples] == [s.prompt for b in first + rest for s in b.samples]


def test_colocated_placement_is_refused_outside_sync():
    cfg = _cfg(mode="async")
    cfg.rollout.placement = "colocated"
    with pytest.raises(ValueError, match="rollout.placement"):
        _manager(FakeServers(), cfg, num_steps=1)


def test_drop_policy_keeps_every_batch_full_and_counts_what_it_drops():
    """staleness_policy=drop runs one batch ahead; what is over the bound when taken is dropped and
    replaced by the next group, so every step trains rollout_batch_size groups (no empty steps)."""
    servers = FakeServers(token_s=0.003)
    batches, _ = _run(servers, _cfg(max_staleness=0, policy="drop"), num_steps=8, train_s=0.01)
    for b in batches:
        assert len(b.groups) == 4
        assert all(b.trainer_version == v for s in b.samples for v in s.token_versions)
    assert sum(b.metrics["rollout/dropped_stale_groups"] for b in batches) > 0


REWARD_FILE = '''
import time


def hangs_on_one(response, label, metadata):
    if label == "HANG" and int(response.split()[0]) % 2 == 0:
        time.sleep(3600)  # a verifier that never returns
    return float(len(response) % 2)


def group_echo(responses, label, metadata):
    # each response's score says how many responses the function saw and where this one sits
    return [{"score": float(len(responses)), "position": float(i), "label": float(label)}
            for i, r in enumerate(responses)]
'''


def test_reward_pool_in_the_manager_counts_a_hanging_verifier_and_group_functions_see_their_group(tmp_path):
    """Scores come from moerl.rewards.RewardPool workers: a response whose verifier hangs gets
    reward.error_value within timeout_s (counted in rollout/reward_errors, the run goes on), every other
    response keeps its score; a group function sees exactly the n responses of its own prompt, in order."""
    from moerl.rewards.pool import RewardPool

    f = tmp_path / "rewards.py"
    f.write_text(REWARD_FILE)
    servers = FakeServers()
    cfg = _cfg(mode="sync", B=2, n=4)
    rows = [{"prompt": f"p{i}", "label": "HANG" if i == 0 else str(i)} for i in range(6)]
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    with RewardPool(f"{f}:hangs_on_one", num_workers=2, timeout_s=1.0, error_value=-1.0, log=lambda m: None) as pool:
        mgr = RolloutManager(client=servers, cluster=servers, sampler=PromptSampler(rows, 2, 0),
                             encode=lambda t: [2] * PROMPT_LEN, decode=decode, reward_fn=pool, cfg=cfg, eos_id=STOP,
                             num_steps=3, version=0, log=lambda m: None)
        t0 = time.monotonic()
        batches, _ = _run(servers, cfg, num_steps=3, manager=mgr)
        assert time.monotonic() - t0 < 30
    hung = errors = 0
    for b in batches:
        errors += b.metrics["rollout/reward_errors"]
        for s in b.samples:
            text = decode(s.response_ids)
            if s.label == "HANG" and s.response_ids[0] % 2 == 0:
                hung += 1
                assert s.reward == -1.0 and s.metadata["reward_error"] == "timeout"
            else:
                assert s.reward == float(len(text) % 2) and "reward_error" not in s.metadata
    assert 1 <= hung < 4 and errors == hung  # (the fake servers' tokens are a fixed function of the rid)
    servers = FakeServers()
    with RewardPool(f"{f}:group_echo", group=True, num_workers=1, timeout_s=10.0, log=lambda m: None) as pool:
        mgr = RolloutManager(client=servers, cluster=servers, sampler=PromptSampler(rows[1:], 2, 0),
                             encode=lambda t: [2] * PROMPT_LEN, decode=decode, reward_fn=pool, cfg=cfg, eos_id=STOP,
                             num_steps=2, version=0, log=lambda m: None)
        batches, _ = _run(servers, cfg, num_steps=2, manager=mgr)
    for b in batches:
        for g in b.groups:
            assert [s.reward for s in g] == [4.0] * 4
            assert [s.metadata["reward_metrics"]["position"] for s in g] == [0.0, 1.0, 2.0, 3.0]
            assert {s.metadata["reward_metrics"]["label"] for s in g} == {float(g[0].label)}
        assert b.metrics["reward/position"] == 1.5


def test_weight_update_phases_are_timed_into_the_next_batch():
    """rollout/pause_s, push_s, continue_s: wall seconds of the updates since the previous batch; a push
    that sleeps 50 ms shows at least that in push_s of the next batch (none in the first: no update yet)."""
    servers = FakeServers()
    mgr = _manager(servers, _cfg(mode="async", max_staleness=1), num_steps=3)

    def slow_push() -> int:
        time.sleep(0.05)
        return servers.push()

    with mgr:
        first = mgr.get_batch(1)
        mgr.update_weights(slow_push, 1)
        second = mgr.get_batch(2)
        mgr.update_weights(None, 2)  # a skipped update: nothing timed
        third = mgr.get_batch(3)
    assert first.metrics["rollout/push_s"] == 0.0 == first.metrics["rollout/pause_s"]
    assert 0.05 <= second.metrics["rollout/push_s"] < 5.0
    assert second.metrics["rollout/pause_s"] >= 0.0 and second.metrics["rollout/continue_s"] >= 0.0
    assert third.metrics["rollout/push_s"] == 0.0


@pytest.mark.parametrize("cap", [None, 2, 8])
def test_groups_in_flight_never_exceed_max_inflight_groups(cap):
    """rollout.max_inflight_groups: at most cap groups (cap * n requests) generate at once (null = one batch,
    rollout_batch_size groups); staleness 2 would let two batches run ahead, so 8 is reachable only uncapped;
    the batches are the same groups in the same order whatever the cap."""
    B, n = 4, 2
    servers = FakeServers(token_s=0.004)
    batches, _ = _run(servers, _cfg(max_staleness=2, B=B, n=n, max_inflight=cap), num_steps=6, train_s=0.03)
    limit = (cap if cap is not None else B) * n
    assert servers.max_running <= limit, (servers.max_running, limit)
    if cap == 8:
        assert servers.max_running > B * n  # the cap is not what bounds it here: the staleness gate is
    uids = [[s.metadata["uid"] for s in b.samples] for b in batches]
    ref, _ = _run(FakeServers(token_s=0.004), _cfg(mode="sync", B=B, n=n), num_steps=6, train_s=0.0)
    assert uids == [[s.metadata["uid"] for s in b.samples] for b in ref]


def _cfg_bg(background, **kw):
    cfg = _cfg(**kw)
    cfg.rollout.background_push = background
    return cfg


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_background_push_returns_at_once_and_the_bound_still_holds(eta):
    """rollout.background_push: update_weights returns before a 60 ms push has landed; the next batch is
    counted against the exported version (trainer_version = step - 1) and every trained token is at most
    max_staleness versions older, although groups started while a push was in flight ran on the old
    weights; with max_staleness 0 the trainer's demand does not start groups before the push has landed, so
    every token is on-policy and the batches equal a foreground run's token for token. The servers take
    30 ms to pause (an in_place pause waits for the next decode step), so a request sent right after
    update_weights returned would run on the old weights."""
    class SlowPause(FakeServers):
        def pause_generation(self, mode: str = "abort"):
            time.sleep(0.03)
            return super().pause_generation(mode)

    def run(background):
        servers = SlowPause(token_s=0.002)
        mgr = _manager(servers, _cfg_bg(background, max_staleness=eta), num_steps=8)
        returned, batches = [], []

        def slow_push() -> int:
            time.sleep(0.06)
            return servers.push()

        with mgr:
            for step in range(1, 9):
                b = mgr.get_batch(step)
                batches.append(b)
                assert b.trainer_version == step - 1
                t0 = time.monotonic()
                mgr.update_weights(slow_push, step, version=step)
                returned.append(time.monotonic() - t0)
                time.sleep(0.25)  # training the next batch takes longer than the push
        return batches, returned, servers

    batches, returned, servers = run(True)
    assert max(returned) < 0.06  # not the 90 ms pause + push: only the previous push's join (done by then)
    assert servers.version == 8  # every push landed (close waits for the last one)
    ages = [b.trainer_version - v for b in batches for s in b.samples
            for v, m in zip(s.token_versions, s.loss_mask) if m]
    assert max(ages) <= eta
    assert sum(b.metrics["rollout/dropped_stale_groups"] for b in batches) == 0  # the gate alone keeps it
    if eta == 0:
        # at staleness 0 no group is in flight at a push (the next batch needs its weights), so no push
        # pauses the servers (hold_for_push skips the pause) and the foreground path waits for the push alone
        fg, returned_fg, fg_servers = run(False)
        assert servers.pauses == fg_servers.pauses == 0
        assert min(returned_fg) >= 0.06
        key = [[(s.metadata["uid"], s.response_ids, s.rollout_log_probs, s.token_versions) for s in b.samples]
               for b in fg]
        assert key == [[(s.metadata["uid"], s.response_ids, s.rollout_log_probs, s.token_versions)
                        for s in b.samples] for b in batches]
    else:
        assert max(ages) >= 1  # it did run off-policy


def test_a_push_pauses_the_servers_exactly_when_a_group_is_in_flight():
    """async: hold_for_push asks for a pause (True) only when a group is in flight once the requests are
    held. Batch 2's requests held back by the server (in flight) -> the push after step 1 pauses the servers
    and continues them; batch 3's groups finished before the push after step 2 -> no pause
    (rollout/paused_pushes counts the first only)."""
    servers = FakeServers(token_s=0.002)
    release = threading.Event()
    real_one = servers._one

    async def one(body):
        while body["rid"].startswith("s2-") and not release.is_set():  # draw 2 = batch 2 stays in flight
            await asyncio.sleep(0.001)
        return await real_one(body)

    servers._one = one

    def wait_until(cond):
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert cond()

    with _manager(servers, _cfg(max_staleness=1), num_steps=3) as mgr:
        b1 = mgr.get_batch(1)
        wait_until(lambda: mgr._inflight > 0)  # batch 2's groups started (allowed at staleness 1)
        mgr.update_weights(servers.push, 1)
        mgr.wait_weights()
        assert servers.pauses == 1 and not servers.paused
        release.set()
        b2 = mgr.get_batch(2)
        wait_until(lambda: len(mgr._fifo) == 4 and mgr._inflight == 0)  # batch 3 generated and scored
        mgr.update_weights(servers.push, 2)
        mgr.wait_weights()
        assert servers.pauses == 1  # nothing in flight: no pause
        b3 = mgr.get_batch(3)
    assert [b.metrics["rollout/paused_pushes"] for b in (b1, b2, b3)] == [0, 1, 0]
    assert [b.trainer_version for b in (b1, b2, b3)] == [0, 1, 2]
    assert all(v == 1 for s in b2.samples for v in s.token_versions)  # held until after the push


def test_a_group_started_after_a_hold_without_pause_sends_nothing_until_the_push_ends():
    """hold_for_push returned False (nothing in flight), so the servers are not paused: a group the producer
    starts before end_push (here: the gate opened by hand while the push is held) must wait for end_push
    before it sends a request, since the servers would run it while their weights change."""
    servers = FakeServers(token_s=0.002)
    with _manager(servers, _cfg(max_staleness=0), num_steps=3) as mgr:
        mgr.get_batch(1)  # staleness 0: batch 2 waits for the push after step 1, nothing is in flight
        time.sleep(0.05)
        sent = len(servers.requests)
        assert mgr.hold_for_push() is False and mgr._inflight == 0
        with mgr._cv:
            mgr.steps_done = 1  # what end_push would do, without resuming the requests
        mgr._kick()
        deadline = time.monotonic() + 5
        while mgr._inflight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.1)
        assert mgr._inflight > 0 and len(servers.requests) == sent  # started, and held before sending
        servers.push()
        mgr.end_push(1, 1, (0.0, 0.0, 0.0))
        b2 = mgr.get_batch(2)
    assert len(servers.requests) > sent and servers.pauses == 0
    assert all(v == 1 for s in b2.samples for v in s.token_versions)  # generated under the pushed weights


def test_a_request_still_running_for_a_failed_group_makes_the_push_pause():
    """A group that gave up (a response cut too often) leaves _inflight while its other samples' requests may
    still run on the servers (per-sample requests): hold_for_push counts those requests as in flight."""
    servers = FakeServers(token_s=0.002)
    with _manager(servers, _cfg(max_staleness=0), num_steps=3) as mgr:
        mgr.get_batch(1)
        time.sleep(0.05)
        assert mgr._inflight == 0 and mgr._active_requests == 0
        with mgr._cv:
            mgr._active_requests += 1  # an orphaned request at the server (see _run_group's gather)
        assert mgr.hold_for_push() is True
        with mgr._cv:
            mgr._active_requests -= 1
        mgr.end_push(1, 1, (0.0, 0.0, 0.0))


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # the check it never ran
def test_hold_for_push_returns_when_the_producer_loop_stops_without_running_its_check():
    """The producer loop can stop (its _produce raised) and close without running the hold's callback: the
    push does not wait for it forever, it sees the loop gone and pushes without a pause."""
    servers = FakeServers()
    mgr = _manager(servers, _cfg(max_staleness=1), num_steps=3)
    loop = asyncio.new_event_loop()  # never run: its callbacks never execute
    mgr._loop, mgr._unpaused = loop, asyncio.Event()
    mgr._thread = threading.Thread(target=lambda: (time.sleep(0.8), loop.close()), daemon=True)
    mgr._thread.start()
    got, t0 = [], time.monotonic()
    waiter = threading.Thread(target=lambda: got.append(mgr.hold_for_push()), daemon=True)
    waiter.start()
    waiter.join(10)  # a hang fails here instead of blocking the test run
    assert got == [False] and 0.7 < time.monotonic() - t0 < 5


def test_a_failed_background_push_surfaces_in_wait_weights_and_get_batch():
    """The error of a push on the background thread is raised by the next wait_weights (checkpoint, eval,
    next export) or get_batch, never lost; the servers are continued (not left paused)."""
    servers = FakeServers()
    mgr = _manager(servers, _cfg_bg(None, max_staleness=1), num_steps=4)

    def failing_push() -> int:
        raise RuntimeError("server refused the weights")

    with mgr:
        mgr.get_batch(1)
        mgr.update_weights(failing_push, 1, version=1)
        with pytest.raises(RuntimeError, match="refused the weights"):
            mgr.wait_weights()
        assert not servers.paused
        with pytest.raises(RuntimeError, match="refused the weights"):
            mgr.get_batch(2)


@pytest.mark.parametrize("aligned", [True, False])
def test_aligned_batches_start_a_draw_only_when_the_previous_one_finished(aligned):
    """rollout.aligned_batches (max_inflight_groups = rollout_batch_size): no request of draw d + 1 starts
    while one of draw d is still generating, so the server gets each batch whole; without it the next
    draw's groups trickle in as slots free up (the simulated server records when each request runs).
    The batches are the same groups either way."""
    class Timed(FakeServers):
        spans: list = []

        async def _one(self, body):  # each sample, whether sent alone or in a group's batched request
            t0 = time.monotonic()
            out = await super()._one(body)
            self.spans.append((int(body["rid"].split("-")[0][1:]), t0, time.monotonic()))
            return out

    servers = Timed(token_s=0.004)
    servers.spans = []
    cfg = _cfg(max_staleness=2)
    cfg.rollout.aligned_batches = aligned
    batches, _ = _run(servers, cfg, num_steps=6, train_s=0.03)
    overlaps = sum(1 for d1, s1, e1 in servers.spans for d2, s2, e2 in servers.spans
                   if d2 == d1 + 1 and s2 < e1 - 1e-4)  # a request of the next draw started before this one ended
    if aligned:
        assert overlaps == 0
    else:
        assert overlaps > 0  # the run does trickle without the rule: the check above can fail
    ref, _ = _run(FakeServers(token_s=0.004), _cfg(mode="sync"), num_steps=6, train_s=0.0)
    assert [[s.metadata["uid"] for s in b.samples] for b in batches] == \
        [[s.metadata["uid"] for s in b.samples] for b in ref]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_the_producer_and_push_threads_stay_on_the_trainer_cores():
    """rollout.cpu_affinity pins the rollout side's processes only: the producer and push threads share the
    trainer's interpreter lock, so they run on the trainer's cores (a lock holder preempted on a busy rollout
    core stalls training), and the trainer thread's affinity is unchanged."""
    before = os.sched_getaffinity(0)
    trainer, rollout = min(before), max(before)
    servers = FakeServers()
    cfg = _cfg_bg(None, max_staleness=1)
    cfg.rollout.cpu_affinity = [rollout]
    seen = []

    def push() -> int:
        seen.append(os.sched_getaffinity(0))
        return servers.push()

    os.sched_setaffinity(0, {trainer})  # train.cpu_affinity: this thread is the trainer's
    try:
        mgr = _manager(servers, cfg, num_steps=2)
        with mgr:
            assert os.sched_getaffinity(mgr._thread.native_id) == {trainer}
            mgr.get_batch(1)
            mgr.update_weights(push, 1, version=1)
            mgr.wait_weights()
            assert os.sched_getaffinity(0) == {trainer}
    finally:
        os.sched_setaffinity(0, before)
    assert seen == [{trainer}]


def test_one_step_off_starts_no_request_while_a_background_push_is_sent():
    """one_step_off pushes with nothing in flight: while a (background) push runs no request starts, even the
    extra groups dynamic sampling draws (they would wait behind the update on the server)."""
    class Recorded(FakeServers):
        async def post(self, path, body):
            self.starts.append(time.monotonic())
            return await super().post(path, body)

    servers = Recorded(token_s=0.002)
    servers.starts = []
    windows = []
    mgr = _manager(servers, _cfg_bg(None, mode="one_step_off", max_staleness=1, dynamic=True), num_steps=5)

    def slow_push() -> int:
        t0 = time.monotonic()
        time.sleep(0.2)
        windows.append((t0, time.monotonic()))
        return servers.push()

    with mgr:
        for step in range(1, 6):
            mgr.get_batch(step)
            mgr.update_weights(slow_push, step, version=step)
    assert len(windows) == 5 and servers.starts
    assert not [t for t in servers.starts for a, b in windows if a < t < b]


def test_group_requests_batch_each_group_and_give_the_samples_of_one_request_per_sample():
    """rollout.group_requests: each round of a group is ONE batched request (SGLang's batch form) holding the
    samples still generating: all n first, then only the ones a weight update cut, each from its own prefix
    (rid -r<segment>); the samples (tokens, behaviour log-probs, versions, rewards, masks) are the ones of one
    request per sample, in sync and across in-flight updates (async, responses cut and resumed)."""
    runs = {}
    for group in (True, False):
        for mode, kw in (("sync", dict(abort_first=1)), ("async", dict(token_s=0.004))):
            servers = FakeServers(**kw)
            batches, _ = _run(servers, _cfg(mode=mode, max_staleness=0, n=3, group=group), num_steps=4)
            runs[group, mode] = [[(s.metadata["uid"], s.response_ids, s.rollout_log_probs, s.token_versions,
                                   s.reward, s.loss_mask, s.metadata["segments"]) for s in b.samples] for b in batches]
            if not group:
                assert servers.batches == []
                continue
            assert servers.batches and sorted(r for b in servers.batches for r in b) == sorted(servers.requests)
            for rids in servers.batches:  # one group per request, each of its samples at most once
                assert len({r.split("-")[0] + r.split("-")[1] for r in rids}) == 1 and len(set(rids)) == len(rids)
            if mode == "sync":  # every response cut once after its first token: two rounds of 3 per group
                firsts = [b for b in servers.batches if not any("-r" in r for r in b)]
                assert len(firsts) == 4 * 4 and all(len(b) == 3 for b in firsts)
                assert all(len(b) == 3 and all(r.endswith("-r1") for r in b) for b in servers.batches if b not in firsts)
    assert runs[True, "sync"] == runs[False, "sync"]
    assert runs[True, "async"] == runs[False, "async"]
    assert any(seg > 1 for b in runs[True, "sync"] for *_, seg in b)


class _Flaky:
    """A server reachable at one URL: fails (RolloutRequestError, as after the client's retries) the first
    ``fail`` batched requests, or refuses them (HTTP 4xx) when ``refuse``."""

    def __init__(self, servers: FakeServers, fail: int = 0, refuse: bool = False):
        self.servers, self.fail, self.refuse, self.posts = servers, fail, refuse, 0
        self.worker = None

    async def post(self, path, body):
        from moerl.rollout.errors import RolloutRequestError, RolloutRequestRefusedError

        self.posts += 1
        if self.refuse:
            raise RolloutRequestRefusedError("POST /generate was refused: HTTP 400: bad")
        if self.posts <= self.fail:
            raise RolloutRequestError("POST /generate failed after 3 attempts; last error: ClientConnectorError")
        return await self.servers.post(path, body)

    async def aclose(self):
        pass


@pytest.mark.parametrize("group", [True, False], ids=["group_requests", "r3_per_sample"])
@pytest.mark.parametrize("failover", [True, False])
def test_a_group_whose_server_fails_is_resent_to_the_next_one_and_none_is_lost_or_repeated(failover, group,
                                                                                         monkeypatch):
    """rollout.group_requests sends each group straight to a server (groups round-robin), never to the router;
    so does moe.routing_replay=r3 with per-sample requests (the router drops return_routed_experts).
    A server that fails a group (dead, being restarted by failover) gets it re-sent to the next live server,
    with the same rids and seeds, and while no server is live the group waits for one: every step trains the
    groups and samples a healthy run trains, none twice, and the re-sends are counted. Without failover the
    failure surfaces (get_batch raises, naming a dead server); a refused request (HTTP 4xx) is never re-sent."""
    from moerl.rollout.errors import RolloutRequestError, RolloutRequestRefusedError, RolloutServerDiedError

    def run(fail, refuse=False, failover=True, dies=False, down_s=0.0):
        servers = FakeServers()
        servers.failover = failover
        servers.checks = 0
        urls = {"http://a": _Flaky(servers, fail=fail, refuse=refuse), "http://b": _Flaky(servers)}
        up_at = time.monotonic() + down_s  # before: every server is down (being restarted): none is live
        servers.live_server_urls = lambda: list(urls) if time.monotonic() >= up_at else []

        def check_alive():
            servers.checks += 1
            if dies and urls["http://a"].posts and not failover:  # its process is gone once it failed a request
                raise RolloutServerDiedError("rollout server 0 (http://a) died: signal SIGKILL", index=0,
                                             url="http://a", pid=1, returncode=-9)

        servers.check_alive = check_alive
        mgr = _manager(servers, _cfg(mode="sync", group=group), num_steps=3)
        mgr._direct_client = lambda url: urls[url]
        mgr.client = None  # the router: a batched (or r3) request must never go there
        mgr.failover_wait_s = 2.0
        if not group:  # r3: requests ask for the routed experts (the fake server returns none: not decoded)
            mgr.routing_shape = (1, 1)
            monkeypatch.setattr("moerl.rollout.manager.routed_experts_of", lambda out, s, shape: None)
        batches, _ = _run(servers, _cfg(mode="sync", group=group), num_steps=3, manager=mgr)
        return batches, urls, servers

    def samples(batches):
        return [[(s.metadata["uid"], s.response_ids, s.rollout_log_probs) for s in b.samples] for b in batches]

    healthy, urls, _ = run(0)
    # 12 groups (of 2 samples) round-robin over the two servers: one request per group, or per sample with r3
    assert urls["http://a"].posts == urls["http://b"].posts == (6 if group else 12)
    if not failover:
        with pytest.raises(RolloutRequestError, match="failed after"):
            run(2, failover=False)
        # a server process that died is named (the cluster's check after the failure), not a bare HTTP error
        with pytest.raises(RolloutServerDiedError, match="server 0"):
            run(2, failover=False, dies=True)
        with pytest.raises(RolloutRequestError, match="no live rollout server"):
            run(0, failover=False, down_s=0.5)
        return
    # every server down for a while (a lone server restarting): the groups wait for one, nothing lost
    t0 = time.monotonic()
    batches, urls, _ = run(0, down_s=0.5)
    assert samples(batches) == samples(healthy) and time.monotonic() - t0 >= 0.5
    batches, urls, servers = run(3)
    assert samples(batches) == samples(healthy)
    uids = [u for b in samples(batches) for u, *_ in b]
    assert len(uids) == len(set(uids)) == 3 * 4 * 2
    assert sum(b.metrics["rollout/failover_resends"] for b in batches) == 3
    assert servers.checks >= urls["http://a"].posts + urls["http://b"].posts  # the cluster checked before each
    with pytest.raises(RolloutRequestRefusedError):
        run(0, refuse=True)


def test_an_overlapping_producer_shortens_the_gil_switch_interval_until_close():
    """The producer thread shares the trainer's GIL: in one_step_off / async, starting it lowers
    sys.getswitchinterval() to PRODUCER_SWITCH_INTERVAL_S until close() (a shorter one is kept); sync leaves
    it alone."""
    import sys

    from moerl.rollout.manager import PRODUCER_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        for mode, start, during in (("async", 0.005, PRODUCER_SWITCH_INTERVAL_S),
                                    ("one_step_off", 0.005, PRODUCER_SWITCH_INTERVAL_S),
                                    ("async", PRODUCER_SWITCH_INTERVAL_S / 2, PRODUCER_SWITCH_INTERVAL_S / 2),
                                    ("sync", 0.005, 0.005)):
            sys.setswitchinterval(start)
            mgr = _manager(FakeServers(), _cfg(mode=mode), num_steps=1).start()
            try:
                assert sys.getswitchinterval() == pytest.approx(during), mode
            finally:
                mgr.close()
            assert sys.getswitchinterval() == pytest.approx(start), mode
    finally:
        sys.setswitchinterval(before)

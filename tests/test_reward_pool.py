"""RewardPool (moerl/rewards/pool.py): sandboxed scoring with timeouts, exceptions and crashes; the same
tests on RewardBroker (moerl/rewards/broker.py: the pool in a child process), plus the broker's own
failure modes."""

from __future__ import annotations

import asyncio
import os
import textwrap
import threading
import time

import pytest

from moerl.rewards import RewardBroker, RewardConfigError, RewardPool, RewardResult, RewardValueError

# A user reward file outside the package. Responses are commands: "sleep" hangs, "raise" raises,
# "die" kills its worker with os._exit(3), "wait:<path>" waits until <path> exists; anything else is
# scored 1.0 iff it equals the label, with a "len" metric.
_USER = textwrap.dedent('''
    import os, time

    def per_sample(response, label, metadata):
        if response == "sleep":
            time.sleep(3600)
        if response == "raise":
            raise RuntimeError("bad reward")
        if response == "die":
            os._exit(3)
        if response.startswith("wait:"):
            while not os.path.exists(response[5:]):
                time.sleep(0.01)
        return {"score": float(response == label) * metadata.get("scale", 1.0), "len": len(response)}

    def two_arg(response, label):
        return float(response == label)

    def group_echo(responses, label, metadata):
        # Each response is an integer; every sample sees the sum of ITS group and its group size.
        if "sleep" in responses:
            time.sleep(3600)
        if "die" in responses:
            os._exit(3)
        total = sum(int(r) for r in responses)
        order = sorted(range(len(responses)), key=lambda i: int(responses[i]))
        return [{"score": float(order.index(i)), "sum": total, "n": len(responses), "self": int(r)}
                for i, r in enumerate(responses)]
''')

TIMEOUT = 1.5


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_rewards") / "my_rewards.py"
    path.write_text(_USER)
    return str(path)


def _started(cls, user_file, timeout_s):
    """A started pool / broker of two workers over ``per_sample`` (error_value -1), collecting its log lines
    in ``.logs``; a context manager."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        logs: list[str] = []
        with cls(f"{user_file}:per_sample", num_workers=2, timeout_s=timeout_s, error_value=-1.0,
                 log=logs.append) as p:
            p.wait_ready(timeout=60)
            p.logs = logs
            yield p

    return cm()


@pytest.fixture(scope="module", params=[RewardPool, RewardBroker], ids=["pool", "broker"])
def pool(user_file, request):
    with _started(request.param, user_file, TIMEOUT) as p:
        yield p


def _scores(results):
    return [r.score for r in results]


def test_plain_group(pool):
    out = pool.score_group("g-plain", "q", ["a", "b", "a"], "a", {"scale": 2.0})
    assert all(isinstance(r, RewardResult) for r in out)
    assert _scores(out) == [2.0, 0.0, 2.0]
    assert [r.metrics for r in out] == [{"len": 1.0}] * 3
    assert [r.error for r in out] == [None] * 3
    assert _scores(pool.score_group("g-json", "q", ["a"], "a", '{"scale": 3.0}')) == [3.0]  # JSON metadata
    with pytest.raises(RewardValueError):
        pool.score_group("g-bad", "q", ["a"], "a", "not json")


@pytest.mark.parametrize(
    "bad,counter,error",
    [("sleep", "timeouts", "timeout"), ("raise", "exceptions", "exception: RuntimeError('bad reward')"),
     ("die", "crashes", "worker died (exit code 3)")],
)
def test_failures_are_isolated(pool, bad, counter, error):
    before = pool.stats()
    uid = f"g-{bad}"
    t0 = time.monotonic()
    out = pool.score_group(uid, "q", ["a", bad, "b", "a"], "a", {})
    elapsed = time.monotonic() - t0
    # 4 responses, 2 workers: chunks [0..1] and [2..3]. A hang costs its chunk's limit (2 x TIMEOUT), then its
    # own limit when the chunk is scored again one response at a time (the culprit was unknown).
    assert elapsed < (3 * TIMEOUT if bad == "sleep" else TIMEOUT) + 1.0
    assert _scores(out) == [1.0, -1.0, 0.0, 1.0]  # error_value only for the bad sample
    assert [r.error for r in out] == [None, error, None, None]
    assert out[1].metrics == {}
    after = pool.stats()
    assert after[counter] == before[counter] + 1
    assert after["scored"] == before["scored"] + 4
    # a killed / dead worker is replaced: the chunk's, then the culprit's when it is scored alone again
    assert after["respawns"] == before["respawns"] + (0 if bad == "raise" else 2)
    assert sum(after[k] for k in ("timeouts", "exceptions", "crashes")) == \
        sum(before[k] for k in ("timeouts", "exceptions", "crashes")) + 1
    assert len([m for m in pool.logs if f"{uid}[1]" in m]) == 1  # logged once, with the sample uid
    # the pool keeps working: the next groups are scored right (replacement workers included)
    for k in range(3):
        assert _scores(pool.score_group(f"{uid}-next{k}", "q", ["a", "x", "a", "a"], "a", {})) == [1.0, 0.0, 1.0, 1.0]


FAST = 0.5  # timeout_s of the chunk tests: a hanging response costs its chunk's 4 x FAST, then FAST alone


@pytest.fixture(scope="module", params=[RewardPool, RewardBroker], ids=["pool", "broker"])
def fast_pool(user_file, request):
    with _started(request.param, user_file, FAST) as p:
        yield p


def _within(seconds: float, fn):
    """fn() run in a daemon thread; fails the test (instead of hanging it) if it takes over ``seconds``."""
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("r", _catch(fn)), daemon=True)
    th.start()
    th.join(seconds)
    assert "r" in box, f"no result within {seconds} s"
    if isinstance(box["r"], BaseException):
        raise box["r"]
    return box["r"]


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("timeouts", "exceptions", "crashes", "respawns", "tasks", "scored")}


def test_chunk_bounds():
    from moerl.rewards.pool import _chunks

    assert _chunks(8, 2) == [(0, 4), (4, 8)]
    assert _chunks(8, 3) == [(0, 3), (3, 6), (6, 8)]  # sizes 3, 3, 2
    assert _chunks(3, 8) == [(0, 1), (1, 2), (2, 3)]  # never more chunks than responses
    assert _chunks(1, 2) == [(0, 1)] and _chunks(0, 2) == []


def test_group_of_8_is_two_tasks_scored_like_one_per_sample(fast_pool):
    """num_workers=2, reward.group false: a group of 8 goes out as 2 chunks of 4 (2 task messages instead of
    8) and its scores are those of scoring each response alone (``score``: one task per item), in order."""
    responses = ["a", "b", "a", "cc", "a", "a", "x", "a"]
    before = fast_pool.stats()
    out = _within(30, lambda: fast_pool.score_group("g-eight", "q", responses, "a", {"scale": 2.0}))
    d = _delta(fast_pool.stats(), before)
    assert _scores(out) == [2.0, 0.0, 2.0, 0.0, 2.0, 2.0, 0.0, 2.0]
    assert [r.metrics for r in out] == [{"len": 1.0}] * 3 + [{"len": 2.0}] + [{"len": 1.0}] * 4
    assert [r.error for r in out] == [None] * 8
    assert d == {"timeouts": 0, "exceptions": 0, "crashes": 0, "respawns": 0, "tasks": 2, "scored": 8}
    before = fast_pool.stats()
    alone = _within(30, lambda: fast_pool.score([(r, "a", {"scale": 2.0}) for r in responses]))
    assert [(r.score, r.metrics, r.error) for r in alone] == [(r.score, r.metrics, r.error) for r in out]
    assert _delta(fast_pool.stats(), before)["tasks"] == 8  # evaluation items stay one task each


def test_chunk_with_a_raising_sample(fast_pool):
    before = fast_pool.stats()
    out = _within(30, lambda: fast_pool.score_group("g-craise", "q", ["a", "b", "raise", "a", "a", "b", "a", "a"],
                                                    "a", {}))
    assert _scores(out) == [1.0, 0.0, -1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert [r.error for r in out] == [None, None, "exception: RuntimeError('bad reward')"] + [None] * 5
    # answered inside the chunk's one message: no rescoring, no worker replaced
    assert _delta(fast_pool.stats(), before) == {"timeouts": 0, "exceptions": 1, "crashes": 0, "respawns": 0,
                                                 "tasks": 2, "scored": 8}
    lines = [m for m in fast_pool.logs if "g-craise" in m]
    assert len(lines) == 1 and "g-craise[2] raised RuntimeError('bad reward')" in lines[0]


@pytest.mark.parametrize("bad,counter,error", [("sleep", "timeouts", "timeout"),
                                               ("die", "crashes", "worker died (exit code 3)")])
def test_chunk_that_hangs_or_crashes_is_rescored_one_at_a_time(fast_pool, bad, counter, error):
    """The culprit of a chunk that times out / kills its worker is unknown: the chunk is logged once and its 4
    responses are scored again one task each; only the culprit gets error_value, counted once as if every
    response had been scored alone. Respawns: the chunk's worker, then the culprit's."""
    uid = f"g-c{bad}"
    responses = ["a", "b", "a", bad, "a", "b", "a", "a"]
    before = fast_pool.stats()
    t0 = time.monotonic()
    out = _within(30, lambda: fast_pool.score_group(uid, "q", responses, "a", {}))
    elapsed = time.monotonic() - t0
    assert _scores(out) == [1.0, 0.0, 1.0, -1.0, 1.0, 0.0, 1.0, 1.0]
    assert [r.error for r in out] == [None, None, None, error] + [None] * 4
    assert out[3].metrics == {}
    expected = {"timeouts": 0, "exceptions": 0, "crashes": 0, "respawns": 2, "tasks": 2 + 4, "scored": 8}
    expected[counter] = 1
    assert _delta(fast_pool.stats(), before) == expected
    if bad == "sleep":  # the chunk's limit (4 x FAST), then the culprit's own (FAST), plus a worker's start
        assert 5 * FAST <= elapsed < 5 * FAST + 2.0
    chunk_lines = [m for m in fast_pool.logs if f"{uid}[0..3]" in m]
    assert len(chunk_lines) == 1 and "(4 samples)" in chunk_lines[0] and "one at a time" in chunk_lines[0]
    culprit = [m for m in fast_pool.logs if f"{uid}[3]" in m]
    assert len(culprit) == 1 and "error_value" in culprit[0]
    assert not [m for m in fast_pool.logs if f"{uid}[4..7]" in m]  # the other chunk was fine
    # the replacement workers score the next group as one chunk each again
    before = fast_pool.stats()
    assert _scores(_within(30, lambda: fast_pool.score_group(f"{uid}-next", "q", ["a", "x", "a"], "a", {}))) == \
        [1.0, 0.0, 1.0]
    assert _delta(fast_pool.stats(), before)["tasks"] == 2


def test_all_workers_crash_then_recover(pool):
    out = pool.score_group("g-allcrash", "q", ["die", "die", "die", "a"], "a", {})
    assert _scores(out) == [-1.0, -1.0, -1.0, 1.0]
    assert _scores(pool.score_group("g-after", "q", ["a", "b"], "a", {})) == [1.0, 0.0]


def test_concurrent_callers(pool):
    results: dict[int, list[float]] = {}

    def worker(k: int) -> None:
        label = str(k)
        results[k] = _scores(pool.score_group(f"g-thread{k}", "q", [label, "no", label], label, {}))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [1.0, 0.0, 1.0] for k in range(6)}


def test_score_items(pool):
    out = pool.score([("a", "a", {}), ("b", "a", None), ("raise", "a", {}), ("c", "c", '{"scale": 0.5}')])
    assert _scores(out) == [1.0, 0.0, -1.0, 0.5]
    assert out[2].error.startswith("exception:")


def test_ascore_group_does_not_block_the_loop(pool, tmp_path):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        flag = tmp_path / "flag"
        # The reward waits for a file that only another coroutine on the same loop creates: if
        # ascore_group blocked the loop, the file would never appear and the sample would time out.
        pending = asyncio.run_coroutine_threadsafe(
            pool.ascore_group("g-async", "q", ["a", f"wait:{flag}"], "a", {}), loop)

        async def make_flag():
            await asyncio.sleep(0.05)
            flag.write_text("")

        asyncio.run_coroutine_threadsafe(make_flag(), loop).result(timeout=TIMEOUT)
        out = pending.result(timeout=30)
        assert _scores(out) == [1.0, 0.0] and [r.error for r in out] == [None, None]
        async def several():
            return await asyncio.gather(*(pool.ascore_group(f"g-async{k}", "q", [str(k), "x"], str(k), {})
                                          for k in range(4)))

        many = asyncio.run_coroutine_threadsafe(several(), loop).result(30)
        assert [_scores(o) for o in many] == [[1.0, 0.0]] * 4
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.mark.parametrize("cls", [RewardPool, RewardBroker], ids=["pool", "broker"])
def test_group_function_sees_exactly_its_group(user_file, cls):
    logs: list[str] = []
    with cls(f"{user_file}:group_echo", group=True, num_workers=2, timeout_s=TIMEOUT, error_value=-1.0,
             log=logs.append) as p:
        groups = {f"u{k}": [str(10 * k + j) for j in (3, 1, 2)] for k in range(5)}
        results: dict[str, list[RewardResult]] = {}
        threads = [threading.Thread(target=lambda u=u, g=g: results.__setitem__(u, p.score_group(u, "q", g, "", {})))
                   for u, g in groups.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for u, g in groups.items():
            out = results[u]
            assert _scores(out) == [2.0, 0.0, 1.0]  # ranks within the group
            assert [r.metrics["self"] for r in out] == [float(x) for x in g]  # same order
            assert {r.metrics["n"] for r in out} == {3.0}
            assert {r.metrics["sum"] for r in out} == {float(sum(int(x) for x in g))}
        # a hanging / crashing group function: the whole group gets error_value, counted once
        t0 = time.monotonic()
        out = p.score_group("g-hang", "q", ["1", "sleep"], "", {})
        assert time.monotonic() - t0 < TIMEOUT + 1.0
        assert [(r.score, r.error) for r in out] == [(-1.0, "timeout")] * 2
        out = p.score_group("g-die", "q", ["1", "die", "2"], "", {})
        assert [(r.score, r.error) for r in out] == [(-1.0, "worker died (exit code 3)")] * 3
        assert _scores(p.score_group("g-ok", "q", ["5", "4"], "", {})) == [1.0, 0.0]
        s = p.stats()
        assert (s["timeouts"], s["crashes"], s["exceptions"]) == (1, 1, 0)
        assert len([m for m in logs if "g-hang" in m]) == 1 and len([m for m in logs if "g-die" in m]) == 1
        # evaluation (one greedy response per prompt): each item is a group of one
        out = p.score([("7", "", {}), ("sleep", "", {}), ("9", "", {})])
        assert [(r.score, r.error) for r in out] == [(0.0, None), (-1.0, "timeout"), (0.0, None)]
        assert [r.metrics.get("n") for r in out] == [1.0, None, 1.0] and out[2].metrics["self"] == 9.0


def test_inline_mode(user_file):
    logs: list[str] = []
    with RewardPool(f"{user_file}:per_sample", num_workers=0, error_value=-2.0, log=logs.append) as p:
        out = p.score_group("g-inline", "q", ["a", "raise", "b"], "a", {})
        assert [(r.score, r.error) for r in out] == [(1.0, None), (-2.0, "exception: RuntimeError('bad reward')"),
                                                     (0.0, None)]
        assert p.stats()["exceptions"] == 1 and len(logs) == 1 and "g-inline[1]" in logs[0]
        assert _scores(asyncio.run(p.ascore_group("g-ainline", "q", ["a"], "a", {}))) == [1.0]
        assert _scores(p.score([("a", "a", {}), ("b", "a", {})])) == [1.0, 0.0]
    with RewardPool(f"{user_file}:group_echo", group=True, num_workers=0) as p:
        assert _scores(p.score_group("g", "q", ["7", "5"], "", {})) == [1.0, 0.0]
        assert [r.metrics["sum"] for r in p.score([("7", "", {}), ("5", "", {})])] == [7.0, 5.0]


def test_two_arg_and_builtin_in_workers(user_file):
    with RewardPool(f"{user_file}:two_arg", num_workers=1) as p:
        assert _scores(p.score_group("g", "q", ["x", "y"], "x", {"ignored": 1})) == [1.0, 0.0]
    with RewardPool("math", num_workers=1, timeout_s=30) as p:
        out = p.score_group("g-math", "q", ["\\boxed{\\frac{1}{2}}", "0.5", "\\boxed{3}"], "1/2", {})
        assert _scores(out) == [1.0, 1.0, 0.0]


def test_bad_specs_refused_at_construction(user_file):
    with pytest.raises(RewardConfigError, match="reward.function=.*has no attribute 'nope'"):
        RewardPool(f"{user_file}:nope")
    with pytest.raises(RewardConfigError, match="reward.function=.*group reward function"):
        RewardPool(f"{user_file}:two_arg", group=True)
    with pytest.raises(RewardConfigError, match="reward.model_path"):
        RewardPool("exact_match", model_path="/no/such/model")
    with pytest.raises(RewardConfigError, match="reward.timeout_s"):
        RewardPool("exact_match", timeout_s=0)


def test_worker_start_failure_is_reported(tmp_path):
    # The spec resolves in this process but not in a fresh worker (the module only exists here).
    import sys
    import types

    mod = types.ModuleType("moerl_test_only_here")
    mod.fn = lambda r, l: 1.0
    sys.modules["moerl_test_only_here"] = mod
    try:
        with RewardPool("moerl_test_only_here:fn", num_workers=1) as p:
            with pytest.raises(RewardConfigError, match="could not start \\(reward.function\\).*moerl_test_only_here"):
                p.wait_ready(timeout=60)
            with pytest.raises(RewardConfigError):
                p.score_group("g", "q", ["a"], "a", {})
    finally:
        del sys.modules["moerl_test_only_here"]


def test_closed_pool_refuses(user_file):
    p = RewardPool(f"{user_file}:per_sample", num_workers=1)
    procs = list(p._procs)
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.score_group("g", "q", ["a"], "a", {})
    assert all(proc.popen.poll() is not None for proc in procs)  # workers are gone


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_reward_workers_start_on_the_rollout_cores(user_file):
    """rollout.cpu_affinity: the run's RewardPool (moerl.train.components.reward_pool) starts its workers on
    the rollout cores (rollout-side host work, off an emulated training device), and so does its dispatcher
    thread when it replaces a dead worker, while that thread itself stays on the trainer's cores (it shares the
    trainer's interpreter lock); the trainer's own affinity is left as it was."""
    from types import SimpleNamespace

    from moerl.config.schema import RecipeConfig
    from moerl.train.components import reward_pool

    mine = os.sched_getaffinity(0)
    core = max(mine)
    base = RecipeConfig()
    cfg = base.model_copy(update={"rollout": base.rollout.model_copy(update={"cpu_affinity": [core]}),
                                  "reward": base.reward.model_copy(update={"function": f"{user_file}:per_sample",
                                                                           "num_workers": 1})})
    with reward_pool(SimpleNamespace(cfg=cfg)) as pool:
        assert os.sched_getaffinity(0) == mine
        assert [os.sched_getaffinity(p.popen.pid) for p in pool._procs] == [{core}]
        assert os.sched_getaffinity(pool._thread.native_id) == mine
        first = pool._procs[0].popen.pid
        (r,) = pool.score_group("u0", "q", ["die"], "a", {})  # the worker dies; the dispatcher replaces it
        assert r.error == "worker died (exit code 3)"
        pool.wait_ready(timeout=60)
        assert pool.stats()["respawns"] == 1 and pool._procs[0].popen.pid != first
        assert os.sched_getaffinity(pool._procs[0].popen.pid) == {core}
        (r,) = pool.score_group("u1", "q", ["a"], "a", {})  # the replacement scores
        assert r.error is None and r.score == 1.0


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # a zombie has exited
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_broker_refuses_bad_specs_like_the_pool(user_file):
    """The pool's construction errors come back from the broker process with their type and message."""
    with pytest.raises(RewardConfigError, match="reward.function=.*has no attribute 'nope'"):
        RewardBroker(f"{user_file}:nope")
    with pytest.raises(RewardConfigError, match="reward.timeout_s"):
        RewardBroker("exact_match", timeout_s=0)


def test_broker_death_fails_calls_by_name_and_takes_its_workers(user_file, tmp_path):
    """A broker killed with calls in flight: the pending call and every later one raise RuntimeError naming
    the reward pool process (never a hang or a silent score), and its workers die with it (PR_SET_PDEATHSIG)."""
    b = RewardBroker(f"{user_file}:per_sample", num_workers=2, timeout_s=60)
    try:
        b.wait_ready(timeout=60)
        workers = _children(b.pid)
        assert len(workers) == 2
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("r", _catch(
            lambda: b.score_group("g-pending", "q", [f"wait:{tmp_path / 'never'}"], "a", {}))), daemon=True)
        th.start()
        time.sleep(0.3)
        os.kill(b.pid, 9)
        th.join(30)
        assert isinstance(box["r"], RuntimeError) and "reward pool process" in str(box["r"]) \
            and "died (exit code -9)" in str(box["r"]), box
        with pytest.raises(RuntimeError, match="reward pool process .* died"):
            b.score_group("g-after", "q", ["a"], "a", {})
        assert all(_gone(w) for w in workers)
    finally:
        b.close()


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001
        return e


def test_closed_broker_refuses_and_is_gone(user_file):
    b = RewardBroker(f"{user_file}:per_sample", num_workers=1)
    b.wait_ready(timeout=60)
    workers = _children(b.pid)
    b.close()
    b.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        b.score_group("g", "q", ["a"], "a", {})
    assert b._popen.poll() is not None and all(_gone(w) for w in workers)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
@pytest.mark.parametrize("mode,pool_process,cls", [("sync", None, RewardPool), ("async", None, RewardBroker),
                                                   ("one_step_off", None, RewardBroker), ("async", False, RewardPool),
                                                   ("sync", True, RewardBroker)])
def test_run_picks_the_pool_process_by_mode(mode, pool_process, cls):
    """reward.pool_process null: the pool runs in a broker process when scoring overlaps training
    (one_step_off / async), in a thread of the trainer in sync; true / false force it. The broker process
    (and so its workers) starts on the rollout cores, its reader thread in the trainer stays on the
    trainer's cores."""
    from types import SimpleNamespace

    from moerl.config.schema import RecipeConfig
    from moerl.train.components import reward_pool

    base = RecipeConfig()
    core = max(os.sched_getaffinity(0))
    cfg = base.model_copy(update={
        "train": base.train.model_copy(update={"mode": mode}),
        "reward": base.reward.model_copy(update={"pool_process": pool_process}),
        "rollout": base.rollout.model_copy(update={"cpu_affinity": [core]})})
    with reward_pool(SimpleNamespace(cfg=cfg)) as pool:
        assert type(pool) is cls
        if cls is RewardBroker:
            assert os.sched_getaffinity(pool.pid) == {core}
            assert os.sched_getaffinity(pool._reader.native_id) == os.sched_getaffinity(0)
        (r,) = pool.score_group("u0", "1 + 1 =", ["2"], "2")
        assert r.error is None and r.score == 1.0


def test_broker_survives_a_cancelled_awaiting_task(user_file, tmp_path):
    """A producer shutting down cancels the task awaiting ascore_group; the answer that arrives later must not
    end the broker's reader: later calls (the final evaluation) are still answered."""
    with RewardBroker(f"{user_file}:per_sample", num_workers=1, timeout_s=30) as b:
        b.wait_ready(timeout=60)
        flag = tmp_path / "flag"

        async def cancelled() -> None:
            task = asyncio.ensure_future(b.ascore_group("g-cancel", "q", [f"wait:{flag}"], "a", {}))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancelled())
        flag.write_text("")  # the cancelled call's answer comes back now
        time.sleep(0.3)
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("r", b.score_group("g-later", "q", ["a", "b"], "a", {})),
                              daemon=True)
        th.start()
        th.join(30)  # a dead reader would leave this call waiting forever
        assert "r" in box and _scores(box["r"]) == [1.0, 0.0]


def test_broker_reader_failure_fails_calls_instead_of_hanging(user_file):
    """Anything that ends the broker's reader thread (here a logger raising a BaseException while it forwards
    the pool's log line of a raising sample) fails the call in flight and every later call by name."""
    class Boom(BaseException):
        pass

    def log(line: str) -> None:
        raise Boom()

    with RewardBroker(f"{user_file}:per_sample", num_workers=1, log=log) as b:
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("r", _catch(
            lambda: b.score_group("g-boom", "q", ["raise"], "a", {}))), daemon=True)
        th.start()
        th.join(30)
        assert isinstance(box.get("r"), RuntimeError) and "could not be read" in str(box["r"]), box
        with pytest.raises(RuntimeError, match="could not be read"):
            b.score_group("g-after", "q", ["a"], "a", {})


def test_broker_refuses_unpicklable_arguments_and_goes_on(user_file):
    with RewardBroker(f"{user_file}:per_sample", num_workers=1) as b:
        with pytest.raises(TypeError):
            b.score_group("g-lock", "q", ["a"], "a", {"lock": threading.Lock()})
        assert b._pending == {}
        assert _scores(b.score_group("g-ok", "q", ["a"], "a", {})) == [1.0]

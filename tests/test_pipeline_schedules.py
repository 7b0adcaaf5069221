"""Schedules as data (moerl.pipeline.schedules) and the bubble simulator (moerl.pipeline.simulator).

References are independent of the code under test: the published bubble expressions of the DualPipe README
(1F1B (PP-1)(F+B), ZB1P (PP-1)(F+B-2W), DualPipe (PP/2-1)(F&B+B-3W); B = full backward), a hand-worked
1F1B timeline, and brute-force counting of the action lists.
"""

import itertools

import pytest

from moerl.pipeline.schedules import (
    Action,
    gpipe_on_layout,
    Schedule,
    ScheduleError,
    SCHEDULE_NAMES,
    build_schedule,
    comm_plan,
    dualpipe,
    dualpipev,
    one_f_one_b,
    validate_fifo,
    validate_schedule,
    zb1p,
)
from moerl.pipeline.simulator import Costs, simulate

CASES = [("1f1b", 2, 8), ("1f1b", 4, 9), ("zb1p", 4, 8), ("zb1p", 3, 5), ("dualpipe", 2, 4), ("dualpipe", 4, 8),
         ("dualpipe", 4, 16), ("dualpipe", 8, 20), ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("dualpipev", 4, 11),
         ("dualpipev", 3, 7)]


@pytest.mark.parametrize("name,P,M", CASES)
def test_every_chunk_microbatch_has_one_f_b_w(name, P, M):
    s = build_schedule(name, P, M)
    counts = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            for kind, c, m in a.parts():
                assert s.chunk_rank[c] == r
                counts[(kind, c, m)] = counts.get((kind, c, m), 0) + 1
    expected_chunks = {"1f1b": P, "zb1p": P, "dualpipe": 2 * P, "dualpipev": 2 * P}[name]
    assert s.num_chunks == expected_chunks
    # brute force: every micro-batch visits every stage exactly once
    for m in range(M):
        assert sorted(s.chunk_stage[c] for c in s.routes[m]) == list(range(s.num_stages))
        for c in s.routes[m]:
            for kind in "FBW":
                assert counts[(kind, c, m)] == 1
    assert sum(counts.values()) == 3 * M * len(s.routes[0])


def test_layouts():
    v = dualpipev(4, 8)
    assert [v.stages_of_rank(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v.input_ranks() == {0} and v.loss_ranks() == {0}
    d = dualpipe(4, 8)
    # rank r holds stage r (copy 0) and stage PP-1-r (copy 1)
    assert [sorted(d.stages_of_rank(r)) for r in range(4)] == [[0, 3], [1, 2], [1, 2], [0, 3]]
    assert d.input_ranks() == {0, 3} and d.loss_ranks() == {0, 3}
    assert d.routes[0] == (0, 1, 2, 3) and [d.chunk_rank[c] for c in d.routes[7]] == [3, 2, 1, 0]


def test_p2p_implied_by_actions():
    v = dualpipev(2, 4)
    # rank 1 holds stages 1 and 2: F of stage 1 receives from rank 0, hands stage 2 its input locally
    recvs, sends = v.p2p(1, Action("F", 1, 0))
    assert [(p.op, p.peer, p.what, p.chunk) for p in recvs] == [("recv", 0, "act", 0)]
    assert sends == []
    # backward of stage 2 gets d(loss)/d(out of stage 2) from rank 0 and hands stage 1 its grad locally
    recvs, sends = v.p2p(1, Action("BW", 2, 0))
    assert [(p.op, p.peer, p.what, p.chunk) for p in recvs] == [("recv", 0, "grad", 2)] and sends == []
    # rank 0: F of stage 0 sends to rank 1; B of stage 3 (loss chunk) receives nothing, sends to rank 1
    recvs, sends = v.p2p(0, Action("FB", 0, 1, 3, 0))
    assert recvs == []
    assert [(p.op, p.peer, p.what, p.chunk) for p in sends] == [("send", 1, "act", 0), ("send", 1, "grad", 2)]


def test_rejects_bad_sizes_with_the_rule():
    with pytest.raises(ValueError, match="even pp size"):
        dualpipe(3, 12)
    with pytest.raises(ValueError, match=r"M >= 2\*PP"):
        dualpipe(4, 6)
    with pytest.raises(ValueError, match="M even"):
        dualpipe(4, 9)
    with pytest.raises(ValueError, match=r"M >= 2\*PP"):
        dualpipev(4, 7)
    with pytest.raises(ValueError, match="pipeline_schedule"):
        build_schedule("gpipe", 2, 4)
    with pytest.raises(TypeError):
        one_f_one_b(2.0, 4)


def test_checker_catches_deadlock_missing_and_misplaced():
    s = one_f_one_b(2, 2)
    # swap rank 1's order so it waits for a backward before the forward it depends on
    bad = Schedule(s.name, 2, 2, s.chunk_rank, s.chunk_stage, s.routes,
                   (s.actions[0], (Action("BW", 1, 0), Action("F", 1, 0), Action("F", 1, 1), Action("BW", 1, 1))))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(bad)
    missing = Schedule(s.name, 2, 2, s.chunk_rank, s.chunk_stage, s.routes, (s.actions[0], s.actions[1][:-1]))
    with pytest.raises(ScheduleError, match="missing"):
        validate_schedule(missing)
    misplaced = Schedule(s.name, 2, 2, s.chunk_rank, s.chunk_stage, s.routes, (s.actions[1], s.actions[0]))
    with pytest.raises(ScheduleError, match="held by rank"):
        validate_schedule(misplaced)
    dup = Schedule(s.name, 2, 2, s.chunk_rank, s.chunk_stage, s.routes,
                   (s.actions[0] + (Action("W", 0, 0),), s.actions[1]))
    with pytest.raises(ScheduleError, match="twice"):
        validate_schedule(dup)


def test_1f1b_timeline_hand_worked():
    # PP=2, M=2, F=1, B=2.  rank1 order F0 BW0 F1 BW1: F0[1,2] BW0[2,4] F1[4,5] BW1[5,7];
    # rank0 order F0 F1 BW0 BW1: F0[0,1] F1[1,2] BW0[4,6] BW1[7,9].  Makespan 9 = (M+PP-1)(F+B);
    # each rank is busy M(F+B) = 6, so the bubble is (PP-1)(F+B) = 3 on both.
    r = simulate(one_f_one_b(2, 2), Costs(F=1, B=2, W=1))
    assert [(s, e) for s, e, _ in r.timeline[0]] == [(0, 1), (1, 2), (4, 6), (7, 9)]
    assert [(s, e) for s, e, _ in r.timeline[1]] == [(1, 2), (2, 4), (4, 5), (5, 7)]
    assert r.makespan == 9 and r.bubble == [3.0, 3.0]


def _equal_cost_settings():
    # "equal cost": every chunk costs the same, the input-grad backward equals the forward (B - W = F)
    # and W <= F, the assumptions of the published expressions; F&B from no overlap (F+B) down to B.
    for F, W in itertools.product([1.0, 1.5, 2.0], [0.25, 0.5, 1.0]):
        if W > F:
            continue
        B = F + W
        for FB in (F + B, (F + 2 * B) / 2, B):
            yield F, B, W, FB


@pytest.mark.parametrize("P", [2, 4, 6, 8])
def test_simulator_reproduces_published_bubbles(P):
    for F, B, W, FB in _equal_cost_settings():
        for M in (2 * P, 2 * P + 2, 3 * P):
            costs = Costs(F=F, B=B, W=W, FB=FB)
            # bubble = makespan - busy time; the published figure is the worst rank's
            b = max(simulate(one_f_one_b(P, M), costs).bubble)
            assert b == pytest.approx((P - 1) * (F + B))
            b = max(simulate(zb1p(P, M), costs).bubble)
            assert b == pytest.approx((P - 1) * (F + B - 2 * W))
            if P % 2 == 0 and M % 2 == 0:
                b = max(simulate(dualpipe(P, M), costs).bubble)
                assert b == pytest.approx((P / 2 - 1) * (FB + B - 3 * W))
            # DualPipeV on P ranks is one half of a DualPipe on 2P ranks: PP = 2P in the expression
            b = max(simulate(dualpipev(P, M), costs).bubble)
            assert b == pytest.approx((2 * P / 2 - 1) * (FB + B - 3 * W))


def test_peak_activations():
    P, M = 4, 12
    c = Costs(F=1, B=2, W=1)
    assert simulate(one_f_one_b(P, M), c).peak_activations == [4, 3, 2, 1]  # P - r
    assert simulate(zb1p(P, M), c).peak_activations == [4, 4, 4, 4]  # same peak as 1F1B
    # DualPipe: PP + 1 chunk activations per rank (README table)
    assert simulate(dualpipe(P, M), c).peak_activations == [P + 1] * P
    # DualPipeV: 2P + 1 half-size chunks (= DualPipe on 2P ranks)
    assert simulate(dualpipev(P, M), c).peak_activations == [2 * P + 1] * P


def test_simulator_comm_latency_and_per_chunk_costs():
    # 1F1B PP=2 M=1 with comm latency c: F0 on r0 [0,1], F on r1 [1+c, 2+c], B on r1 [2+c, 4+c], B r0 [4+2c, 6+2c]
    r = simulate(one_f_one_b(2, 1), Costs(F=1, B=2, W=1, comm=0.5))
    assert r.makespan == pytest.approx(7.0)
    r = simulate(one_f_one_b(2, 1), Costs(F=[1, 3], B=[2, 4], W=[1, 1]))
    assert r.makespan == pytest.approx(1 + 3 + 4 + 2)


def test_simulator_measured_fb_per_chunk_pair():
    # dualpipev(1, 4) on one rank (chunks 0 and 1): F0.0 F1.0 F0.1 BW1.0 F1.1&B0.0 F0.2&B1.1 F1.2&B0.1
    # F0.3&B1.2 F1.3&B0.2 BW1.3 B0.3 W0.3; with F=1, B=2, W=1 (B0.3 = 1) everything is serial on one rank:
    # 3 F + 2 BW + 5 FB + B + W; an FB of pair (1, 0) costs 10, the pair (0, 1) keeps F + B = 3
    s = dualpipev(1, 4)
    fbs = [(a.chunk, a.chunk_b) for a in s.actions[0] if a.kind == "FB"]
    assert fbs == [(1, 0), (0, 1), (1, 0), (0, 1), (1, 0)]
    base = simulate(s, Costs(F=1, B=2, W=1)).makespan
    assert base == pytest.approx(3 * 1 + 2 * 2 + 5 * 3 + 1 + 1)
    assert simulate(s, Costs(F=1, B=2, W=1, FB={(1, 0): 10})).makespan == pytest.approx(base + 3 * (10 - 3))
    assert simulate(s, Costs(F=1, B=2, W=1, FB=4)).makespan == pytest.approx(base + 5 * (4 - 3))


def test_fallback_for_too_few_microbatches_keeps_the_layout():
    for name, P in [("dualpipev", 2), ("dualpipev", 4), ("dualpipe", 2), ("dualpipe", 4)]:
        full = build_schedule(name, P, 4 * P)
        for M in range(1, 2 * P + 1):
            s = build_schedule(name, P, M, fallback=True)  # validated inside (no deadlock, one F/B/W each)
            assert s.chunk_rank == full.chunk_rank and s.chunk_stage == full.chunk_stage
            if M < 2 * P or (name == "dualpipe" and M % 2):
                assert s.name == name + "-gpipe"
                # GPipe on a pipeline of K hops with F=1, B=2: makespan (M + K - 1) * 3 for a V route
                # (all stages on distinct time slots): K = 2P chunks for dualpipev, P for dualpipe with M=1
                if M == 1:
                    K = len(s.routes[0])
                    assert simulate(s, Costs(F=1, B=2, W=1)).makespan == pytest.approx(K * 3)
            else:
                assert s.name == name
    with pytest.raises(ValueError, match=r"M >= 2\*PP"):
        build_schedule("dualpipev", 4, 3)
    with pytest.raises(ValueError, match="even pp size"):
        gpipe_on_layout("dualpipe", 3, 2)


# ----------------------------------------------------------------------------------------------------------
# tag-free (FIFO per pair) communication plan


def _replay_fifo(s, plan, forward_only=False):
    """Independent replay of a plan with asynchronous sends and FIFO matching: returns each ordered
    pair's (sent, received) message lists; asserts every action finds its inputs received before it runs
    and that the replay terminates."""
    P = s.num_ranks
    acts = []
    for r in range(P):
        a = list(s.actions[r])
        if forward_only:
            a = [Action("F", c, m) for x in a for k, c, m in x.parts() if k == "F"]
        acts.append(a)
    sent = {(p, q): [] for p in range(P) for q in range(P)}
    got = {(p, q): [] for p in range(P) for q in range(P)}
    have = [set() for _ in range(P)]
    pos = [0] * P  # next batch of each rank
    rnd = [0] * P  # next round in that batch
    posted = [False] * P  # that round's sends are out
    while any(pos[r] < len(plan[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(plan[r]):
                batch = plan[r][pos[r]]
                if rnd[r] < len(batch):
                    sends, recvs = batch[rnd[r]]
                    if not posted[r]:
                        for x in sends:
                            sent[(r, x.peer)].append((x.what, x.chunk, x.microbatch))
                        posted[r] = moved = True
                    # the receives complete once the peer posted the message at that FIFO position
                    count = {}
                    for v in recvs:
                        count[v.peer] = count.get(v.peer, 0) + 1
                    if any(len(got[(p, r)]) + n > len(sent[(p, r)]) for p, n in count.items()):
                        break
                    for v in recvs:
                        msg = (v.what, v.chunk, v.microbatch)
                        assert sent[(v.peer, r)][len(got[(v.peer, r)])] == msg  # FIFO delivers this one
                        got[(v.peer, r)].append(msg)
                        have[r].add(msg)
                    rnd[r] += 1
                    posted[r] = False
                    moved = True
                    continue
                if pos[r] < len(acts[r]):  # the action runs: its inputs must be here
                    for v in s.p2p(r, acts[r][pos[r]])[0]:
                        assert (v.what, v.chunk, v.microbatch) in have[r]
                pos[r] += 1
                rnd[r] = 0
                moved = True
        assert moved, f"replay stuck at batches {pos}"
    return sent, got


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_fifo_plan_of_real_schedules_replays(name):
    for P in (2, 3, 4):
        for M in (1, 2, P, 2 * P, 2 * P + 2, 3 * P + 1):
            try:
                s = build_schedule(name, P, M, fallback=True)
            except ValueError:
                continue  # dualpipe needs an even pp size
            validate_fifo(s)
            for fo in (False, True):
                sent, got = _replay_fifo(s, comm_plan(s, forward_only=fo), fo)
                assert sent == got  # every message received exactly once, in its pair's send order
                n_msgs = sum(len(v) for v in sent.values())
                # brute-force count: one activation and one gradient message per cross-rank route hop
                hops = sum(s.chunk_rank[a] != s.chunk_rank[b] for rt in s.routes for a, b in zip(rt, rt[1:]))
                assert n_msgs == (1 if fo else 2) * hops


def _crossed_1f1b(M=2):
    """PP=2: rank 0 sends activations 0, 1, ...; rank 1 consumes them in reverse order."""
    base = one_f_one_b(2, M)
    r0 = tuple(Action("F", 0, m) for m in range(M)) + tuple(Action("BW", 0, m) for m in range(M))
    r1 = tuple(a for m in reversed(range(M)) for a in (Action("F", 1, m), Action("BW", 1, m)))
    return Schedule("crossed", 2, M, base.chunk_rank, base.chunk_stage, base.routes, (r0, r1))


def test_fifo_validator_rejects_crossed_orders_without_buffering():
    s = _crossed_1f1b()
    validate_schedule(s)  # fine with tag matching (and with the buffering FIFO plan, checked inside)
    # naive tag-free posting: rank 1 first posts the receive of act 1, but rank 0 sent act 0 first
    with pytest.raises(ScheduleError, match=r"FIFO mismatch on pair 0->1: message #0 is \('h', 'act', 0, 0\)"):
        validate_fifo(s, buffer_early=False)
    validate_fifo(s)
    # hand-worked plan of rank 1: before its first action it takes act 0 then act 1 (two segments of
    # rank 0, in send order); it then sends grad 1 (after BW1) and grad 0 (after BW0)
    plan = comm_plan(s)[1]
    assert [[(x.what, x.microbatch) for x in rv] for _, rv in plan[0]] == [[("act", 0)], [("act", 1)]]
    sends = [(x.what, x.microbatch) for b in plan for sd, _ in b for x in sd]
    assert sends == [("grad", 1), ("grad", 0)]
    # rank 0 needs grad 0 first, so it takes grad 1 with it before BW0 (its 3rd action)
    assert [[(x.what, x.microbatch) for x in rv] for _, rv in comm_plan(s)[0][2]] == [[("grad", 1)], [("grad", 0)]]


def test_fifo_blocking_sends_model():
    A = Action
    base = zb1p(2, 3)
    # both ranks send with no receive in the same batch and then wait for each other: rank 0 sends act 1
    # (before F2) while rank 1 sends grad 0 (before W0); each blocks until the other posts the receive
    r0 = (A("F", 0, 0), A("F", 0, 1), A("F", 0, 2), A("B", 0, 0), A("W", 0, 0), A("B", 0, 1), A("W", 0, 1),
          A("B", 0, 2), A("W", 0, 2))
    r1 = (A("F", 1, 0), A("B", 1, 0), A("W", 1, 0), A("F", 1, 1), A("B", 1, 1), A("W", 1, 1), A("F", 1, 2),
          A("B", 1, 2), A("W", 1, 2))
    lone = Schedule("lone", 2, 3, base.chunk_rank, base.chunk_stage, base.routes, (r0, r1))
    validate_fifo(lone)  # asynchronous sends: fine
    with pytest.raises(ScheduleError, match=r"deadlocks under FIFO.*send h:act0\.1 to 1.*send h:grad0\.0 to 0"):
        validate_fifo(lone, blocking_sends=True)
    # 1F1B pairs each send with the peer's matching receive (Megatron's send_forward_recv_backward)
    for M in (1, 2, 5, 8):
        validate_fifo(one_f_one_b(2, M), blocking_sends=True)
    # zero-warm-up 1F1B: rank 0's batch {send act 0, recv grad 0} would wait for grad 0's header before
    # the act 0 tensor goes out, which rank 1 needs to produce grad 0: the plan gives the send its own round
    s = one_f_one_b(2, 2)
    zw = Schedule("zw", 2, 2, s.chunk_rank, s.chunk_stage, s.routes,
                  ((A("F", 0, 0), A("BW", 0, 0), A("F", 0, 1), A("BW", 0, 1)), s.actions[1]))
    validate_fifo(zw, blocking_sends=True)
    b1 = comm_plan(zw, blocking_sends=True)[0][1]
    assert [([(x.what, x.microbatch) for x in sd], [(x.what, x.microbatch) for x in rv]) for sd, rv in b1] == \
        [([("act", 0)], []), ([], [("grad", 0)])]
    assert [[(x.what, x.microbatch) for x in sd] for sd, _ in comm_plan(zw)[0][1]] == [[("act", 0)]]


def test_weight_steps_follow_input_grad_order_per_chunk():
    """Transformer Engine's delay_wgrad_compute queue is FIFO per module, so W of a chunk must run in its
    B order (an unsplit BW counting as B then W): true of every split schedule; a swapped pair is named."""
    import dataclasses

    from moerl.pipeline.schedules import Action
    from moerl.pipeline.wgrad_store import check_fifo_weight_order

    for name in ("zb1p", "dualpipe", "dualpipev"):
        for P in (2, 4):
            for M in (2 * P, 2 * P + 2, 4 * P):
                s = build_schedule(name, P, M)
                for r in range(P):
                    check_fifo_weight_order(s, r)
    s = build_schedule("zb1p", 1, 2)  # F0.0 B0.0 W0.0 F0.1 B0.1 W0.1
    acts = list(s.actions[0])
    acts[2], acts[5] = Action("W", 0, 1), Action("W", 0, 0)  # ... B0.0 W0.1 ... B0.1 W0.0: 0.1 not B'd yet
    swapped = dataclasses.replace(s, actions=(tuple(acts),))
    with pytest.raises(ValueError, match=r"chunk 0 runs W in micro-batch order \[1, 0\] but B in \[0, 1\]"):
        check_fifo_weight_order(swapped, 0)

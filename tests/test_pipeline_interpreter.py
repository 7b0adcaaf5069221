"""The pipeline interpreter on gloo (moerl.pipeline.interpreter).

Reference: the same stage modules run without pipelining in the parent process (micro-batch after
micro-batch, loss.backward() each).  Losses and forward-only outputs must be bitwise equal; gradients
must satisfy 1 - 2*sum(xy)/sum(x^2+y^2) < 1e-12 (DualPipe: after summing the two mirrored copies).

NCCL emulation: every worker forces the tag of every ``torch.distributed.P2POp`` to 0 (and records the
tags the interpreter asked for), so gloo, like NCCL, can only match the messages of a pair of ranks in
posting order; a message landing in the wrong buffer would fail the header check or the comparison.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _mp_helpers import free_port_block  # noqa: E402

from moerl.pipeline.interpreter import PipelineInterpreter, sync_mirrored_grads  # noqa: E402
from moerl.pipeline.schedules import build_schedule  # noqa: E402

D, BATCH = 16, 3


class Stage(torch.nn.Module):
    """Residual MLP block; stage 0 also has a token embedding (its input is an int64 tensor)."""

    def __init__(self, stage: int, num_stages: int):
        super().__init__()
        g = torch.Generator().manual_seed(1000 + stage)
        self.first, self.last = stage == 0, stage == num_stages - 1
        if self.first:
            self.emb = torch.nn.Parameter(torch.randn(11, D, generator=g))
        self.w1 = torch.nn.Parameter(torch.randn(D, 2 * D, generator=g) / D ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(2 * D, D, generator=g) / D ** 0.5)
        if self.last:
            self.head = torch.nn.Parameter(torch.randn(D, 5, generator=g))

    def forward(self, x):
        if self.first:
            x = self.emb[x]
        x = x + torch.tanh(x @ self.w1) @ self.w2
        return x @ self.head if self.last else x


def criterion(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1)) / 4.0


def make_data(M: int):
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randint(0, 11, (BATCH, 2), generator=g) for _ in range(M)]
    labels = [torch.randint(0, 5, (BATCH, 2), generator=g) for _ in range(M)]
    return inputs, labels


def _force_tag0(tags: list, ops: list | None = None) -> None:
    """Test-only switch emulating NCCL's tag-blind matching on gloo: every P2POp created from now on in
    this process gets tag 0; the tag asked for is appended to ``tags`` (and ``(op, group, peer)`` to ``ops``)."""
    import torch.distributed as dist

    base = dist.P2POp

    class TagZeroP2POp(base):
        def __new__(cls, op, tensor, peer=None, group=None, tag=0, *args, **kwargs):
            return base.__new__(cls, op, tensor, peer, group, 0, *args, **kwargs)

        def __init__(self, op, tensor, peer=None, group=None, tag=0, *args, **kwargs):
            tags.append(tag)
            if ops is not None:
                ops.append((op, group, peer))
            super().__init__(op, tensor, peer, group, 0, *args, **kwargs)

    dist.P2POp = TagZeroP2POp


def _worker(rank, world, port, sched, M, out_dir, split="retrace"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    tags: list = []
    _force_tag0(tags)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        S = sched.num_stages
        modules = {c: Stage(sched.chunk_stage[c], S) for c in sched.chunks_of_rank(rank)}
        inputs, labels = make_data(M)
        interp = PipelineInterpreter(sched, modules, criterion, split_backward=split)
        res = interp.run(inputs, labels, return_outputs=True)
        sync_mirrored_grads(sched, modules)
        fwd = interp.run(inputs, None, forward_only=True)
        grads = {c: {n: p.grad.clone() for n, p in m.named_parameters()} for c, m in modules.items()}
        torch.save({"losses": res.losses, "outputs": res.outputs, "fwd": fwd.outputs, "grads": grads,
                    "stages": {c: sched.chunk_stage[c] for c in modules}, "tags": tags},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def reference(num_stages: int, M: int):
    # bitwise comparison: same intra-op thread count as the workers (earlier tests may change ours)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(num_stages, M)
    finally:
        torch.set_num_threads(threads)


def _reference(num_stages: int, M: int):
    stages = [Stage(s, num_stages) for s in range(num_stages)]
    inputs, labels = make_data(M)
    losses, outputs = [], []
    for x, y in zip(inputs, labels):
        for st in stages:
            x = st(x)
        outputs.append(x.detach())
        loss = criterion(x, y)
        loss.backward()
        losses.append(loss.detach())
    grads = [{n: p.grad.clone() for n, p in st.named_parameters()} for st in stages]
    return losses, outputs, grads


def rel_err(x, y):
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def run_case(name, P, M, tmp_path, split="retrace", sched=None):
    """Run schedule ``name`` (or the given ``sched``) on P gloo workers with all tags forced to 0 and
    compare with the unpipelined reference."""
    port = free_port_block(1)
    if sched is None:
        sched = build_schedule(name, P, M, fallback=True)
    mp.start_processes(_worker, args=(P, port, sched, M, str(tmp_path), split), nprocs=P, join=True,
                       start_method="spawn")
    check_against_reference(name, sched, [torch.load(tmp_path / f"rank{r}.pt") for r in range(P)])


def check_against_reference(name, sched, per_rank):
    """Compare one pipeline's per-rank results (losses, outputs, fwd, grads, stages, tags) with the
    unpipelined reference."""
    M = sched.num_microbatches
    ref_losses, ref_outputs, ref_grads = reference(sched.num_stages, M)
    got_losses, got_out, got_fwd = {}, {}, {}
    seen_stages = {}
    for r, d in enumerate(per_rank):
        for m, v in d["losses"].items():
            assert m not in got_losses
            got_losses[m] = v
        got_out.update(d["outputs"])
        got_fwd.update(d["fwd"])
        for c, g in d["grads"].items():
            seen_stages.setdefault(d["stages"][c], []).append(g)
        assert d["tags"] and set(d["tags"]) == {0}, (r, sorted(set(d["tags"])))  # tag-free protocol
    assert sorted(got_losses) == list(range(M))
    for m in range(M):
        assert torch.equal(got_losses[m], ref_losses[m]), (m, got_losses[m], ref_losses[m])
        assert torch.equal(got_out[m], ref_outputs[m])
        assert torch.equal(got_fwd[m], ref_outputs[m])
    assert sorted(seen_stages) == list(range(sched.num_stages))
    for s, copies in seen_stages.items():
        assert len(copies) == (2 if name == "dualpipe" else 1)  # (dualpipe M=1: copy 1 idle, zero grads)
        for g in copies:
            assert g.keys() == ref_grads[s].keys()
            for n in g:
                assert rel_err(g[n], ref_grads[s][n]) < 1e-12, (s, n)
        if len(copies) == 2:  # mirrored copies hold the same summed gradient
            assert all(torch.equal(copies[0][n], copies[1][n]) for n in copies[0])


@pytest.mark.parametrize("name,M", [("dualpipe", 8), ("dualpipev", 10)])
def test_pp2_matches_unpipelined(name, M, tmp_path):
    run_case(name, 2, M, tmp_path)


@pytest.mark.slow
# odd and tiny M (warm-up longer than the batch, M < 2 * pp); the even M of every schedule are the fast suite's
# (test_pp2_matches_unpipelined) and PP=4's below
@pytest.mark.parametrize("name,M", [("1f1b", 8), ("zb1p", 9), ("dualpipev", 3), ("dualpipe", 1)])
def test_pp2_matches_unpipelined_1f1b_zb1p(name, M, tmp_path):
    run_case(name, 2, M, tmp_path)


def test_pp2_crossed_orders_buffer_early(tmp_path):
    """Hand-made schedule whose ranks consume micro-batches in the opposite order of their peer: rank 1
    runs F/BW of micro-batch 3, 2, 1, 0 (rank 0 sends act 0 first), rank 0 runs BW 0..3 (rank 1 sends
    grad 3 first).  Without tags each must receive the earlier messages first and buffer them."""
    from moerl.pipeline.schedules import Action, Schedule, comm_plan, one_f_one_b

    M = 4
    base = one_f_one_b(2, M)
    r0 = tuple(Action("F", 0, m) for m in range(M)) + tuple(Action("BW", 0, m) for m in range(M))
    r1 = tuple(a for m in reversed(range(M)) for a in (Action("F", 1, m), Action("BW", 1, m)))
    sched = Schedule("crossed", 2, M, base.chunk_rank, base.chunk_stage, base.routes, (r0, r1))
    # rank 1's first action needs act 3: it takes acts 0..3 at once, in rank 0's send order
    first = comm_plan(sched)[1][0]
    assert [[(x.what, x.microbatch) for x in recvs] for _, recvs in first] == [[("act", m)] for m in range(M)]
    run_case("crossed", 2, M, tmp_path, sched=sched)


@pytest.mark.parametrize("name", ["dualpipev"])
def test_pp2_torch_split_backward(name, tmp_path):
    run_case(name, 2, 8, tmp_path, split="torch")


@pytest.mark.slow
# dualpipe-12 is slow_extra (CI's 30-min budget): in CI stay DualPipe's torch split on Megatron stages at PP 2
# (test_pipeline_megatron [dualpipe-torch]), the torch split at PP 4 (zb1p-8 here) and DualPipe at PP 4 with the retrace
# split (test_pp4_matches_unpipelined[dualpipe-16]). What leaves CI: DualPipe at PP 4 with the torch split.
@pytest.mark.parametrize("name,M", [("zb1p", 8), pytest.param("dualpipe", 12, marks=pytest.mark.slow_extra)])
def test_pp4_torch_split_backward(name, M, tmp_path):
    run_case(name, 4, M, tmp_path, split="torch")


@pytest.mark.slow
# one M per schedule (CI time): M = 2 * pp for DualPipeV (its shortest full schedule), 3 * pp and 4 * pp for the rest
@pytest.mark.parametrize("name,M", [("1f1b", 12), ("zb1p", 12), ("dualpipe", 16), ("dualpipev", 8)])
def test_pp4_matches_unpipelined(name, M, tmp_path):
    run_case(name, 4, M, tmp_path)


def _naive_worker(rank, port, sched, out_dir):
    """Run ``sched`` with the naive tag-free plan (each action receives what it needs, in its own order)
    and tags forced to 0; record the error this rank raised."""
    import datetime

    import torch.distributed as dist

    from moerl.pipeline import interpreter
    from moerl.pipeline.schedules import _build_plan

    torch.set_num_threads(1)
    _force_tag0([])
    interpreter.comm_plan = lambda s, forward_only=False: _build_plan(s, forward_only, set(), False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    modules = {c: Stage(sched.chunk_stage[c], 2) for c in sched.chunks_of_rank(rank)}
    inputs, labels = make_data(sched.num_microbatches)
    try:
        interpreter.PipelineInterpreter(sched, modules, criterion).run(inputs, labels)
        msg = "no error"
    except Exception as e:  # noqa: BLE001 - the message is the result
        msg = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"naive{rank}.txt"), "w") as f:
        f.write(msg)


def test_tag0_on_gloo_matches_in_posting_order(tmp_path):
    """Negative control of the NCCL emulation: with tags forced to 0, the naive plan of the crossed
    schedule makes rank 1's first receive (meant for act 3) get rank 0's first send (act 0); the header
    check reports exactly that, so gloo with tag 0 matches a pair's messages in posting order."""
    from moerl.pipeline.schedules import Action, Schedule, one_f_one_b

    M = 4
    base = one_f_one_b(2, M)
    r0 = tuple(Action("F", 0, m) for m in range(M)) + tuple(Action("BW", 0, m) for m in range(M))
    r1 = tuple(a for m in reversed(range(M)) for a in (Action("F", 1, m), Action("BW", 1, m)))
    sched = Schedule("crossed", 2, M, base.chunk_rank, base.chunk_stage, base.routes, (r0, r1))
    mp.start_processes(_naive_worker, args=(free_port_block(1), sched, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    msg = (tmp_path / "naive1.txt").read_text()
    assert "expected act of (chunk 0, micro-batch 3) from pp rank 0 but got ('act', 0, 0)" in msg, msg


def test_interpreter_argument_errors():
    sched = build_schedule("dualpipev", 2, 4)
    with pytest.raises(ValueError, match="missing"):
        PipelineInterpreter(sched, {0: Stage(0, 4)}, criterion, pp_rank=0)
    with pytest.raises(ValueError, match="not held"):
        PipelineInterpreter(sched, {0: Stage(0, 4), 3: Stage(3, 4), 1: Stage(1, 4)}, criterion, pp_rank=0)
    interp = PipelineInterpreter(sched, {0: Stage(0, 4), 3: Stage(3, 4)}, criterion, pp_rank=0)
    with pytest.raises(ValueError, match="inputs"):
        interp.run(None, None)
    with pytest.raises(ValueError, match="labels"):
        interp.run(make_data(4)[0], None)


# ---------------------------------------------------------------------------------------------------------
# Directed p2p channels (one 2-rank process group per direction of each communicating pair)


def test_channel_pairs_hand_worked():
    """channel_pairs: both directions of consecutive-chunk ranks and of mirrored-copy ranks (worked by hand
    from the layouts: 1F1B/DualPipeV chain 0-1-2-3; DualPipe adds the twins 0-3 and 1-2)."""
    from moerl.pipeline.interpreter import channel_pairs

    chain = [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)]
    assert channel_pairs(build_schedule("1f1b", 4, 8)) == chain
    assert channel_pairs(build_schedule("zb1p", 4, 8)) == chain
    assert channel_pairs(build_schedule("dualpipev", 4, 8)) == chain
    assert channel_pairs(build_schedule("dualpipe", 4, 8)) == sorted(chain + [(0, 3), (3, 0)])
    assert channel_pairs(build_schedule("1f1b", 1, 2)) == []


def test_p2p_argument_errors():
    from moerl.pipeline.interpreter import Channel, P2PChannels

    sched = build_schedule("1f1b", 2, 4)
    mods = {0: Stage(0, 2)}
    with pytest.raises(ValueError, match="p2p must be"):
        PipelineInterpreter(sched, mods, criterion, pp_rank=0, p2p="nccl")
    with pytest.raises(TypeError, match="p2p must be"):
        PipelineInterpreter(sched, mods, criterion, pp_rank=0, p2p=3)
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        PipelineInterpreter(sched, mods, criterion, pp_rank=0, p2p="directed")
    full = {(0, 1): Channel(None, 1, 1), (1, 0): Channel(None, 1, 1)}
    with pytest.raises(ValueError, match="channels of pp rank 1"):
        PipelineInterpreter(sched, mods, criterion, pp_rank=0, p2p=P2PChannels(1, (0, 1), full))
    with pytest.raises(ValueError, match=r"no channel 1 -> 0"):  # the gradients come back on (1, 0)
        PipelineInterpreter(sched, mods, criterion, pp_rank=0, p2p=P2PChannels(0, (0, 1), {(0, 1): full[(0, 1)]}))
    interp = PipelineInterpreter(sched, mods, criterion, pp_rank=0, p2p=P2PChannels(0, (0, 1), full))
    assert interp.channels.get(0, 1) is full[(0, 1)]
    assert PipelineInterpreter(sched, mods, criterion, pp_rank=0).channels is None  # default off dist: shared


def _directed_worker(rank, world, port, cases, out_dir, pp_groups, with_shared):
    """For each (name, M): run the schedule (``with_shared``: over the shared pipeline group, then) over
    directed channels, on fresh identical modules; assert bitwise-equal losses/outputs/gradients of the two
    runs in here, check that every p2p op of the directed run went on the channel of its direction, and save
    the directed results."""
    import torch.distributed as dist

    from moerl.pipeline.interpreter import make_p2p_channels

    torch.set_num_threads(1)
    tags: list = []
    ops: list = []
    _force_tag0(tags, ops)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = None
        if pp_groups is not None:  # every rank creates every pipeline group, in the same order
            for ranks in pp_groups:
                g = dist.new_group(ranks)
                if rank in ranks:
                    group, my_ranks = g, ranks
        else:
            my_ranks = list(range(world))
        pp_rank = my_ranks.index(rank)
        P = len(my_ranks)
        for name, M in cases:
            sched = build_schedule(name, P, M)
            inputs, labels = make_data(M)
            got = {}
            for mode in ("shared", "directed") if with_shared else ("directed",):
                modules = {c: Stage(sched.chunk_stage[c], sched.num_stages) for c in sched.chunks_of_rank(pp_rank)}
                if mode == "directed":
                    ch = make_p2p_channels(sched, group)
                    # the map: exactly this rank's directions of the layout, each a 2-rank group of its own
                    from moerl.pipeline.interpreter import channel_pairs

                    assert ch.pp_rank == pp_rank and list(ch.global_ranks) == my_ranks
                    assert sorted(ch.channels) == [d for d in channel_pairs(sched) if pp_rank in d]
                    for (a, b), c in ch.channels.items():
                        other = my_ranks[b if a == pp_rank else a]
                        assert c.peer == other and dist.get_process_group_ranks(c.group) == sorted([rank, other])
                        assert c.group_peer == dist.get_group_rank(c.group, other)
                        assert c.group is not ch.channels[(b, a)].group
                    direction = {id(c.group): d for d, c in ch.channels.items()}
                    ops.clear()
                interp = PipelineInterpreter(sched, modules, criterion, group=group,
                                             p2p=ch if mode == "directed" else mode)
                res = interp.run(inputs, labels, return_outputs=True)
                sync_mirrored_grads(sched, modules, group=group, channels=interp.channels)
                fwd = interp.run(inputs, None, forward_only=True)
                got[mode] = {"losses": res.losses, "outputs": res.outputs, "fwd": fwd.outputs,
                             "grads": {c: {n: p.grad.clone() for n, p in m.named_parameters()}
                                       for c, m in modules.items()},
                             "stages": {c: sched.chunk_stage[c] for c in modules}, "tags": list(tags)}
                if mode == "directed":
                    assert ops
                    for op, g, peer in ops:  # a channel carries one direction only
                        a, b = direction[id(g)]
                        if op is dist.isend:
                            assert a == pp_rank and peer == my_ranks[b], (op, a, b, peer)
                        else:
                            assert op is dist.irecv and b == pp_rank and peer == my_ranks[a], (op, a, b, peer)
                    assert {direction[id(g)] for _, g, _ in ops} == set(ch.channels)  # every channel used
            di = got["directed"]
            torch.save(di, os.path.join(out_dir, f"{name}_{M}_rank{rank}.pt"))
            if not with_shared:
                continue
            sh = got["shared"]
            for key in ("losses", "outputs", "fwd"):
                assert sh[key].keys() == di[key].keys()
                assert all(torch.equal(sh[key][m], di[key][m]) for m in sh[key]), (name, key)
            for c in sh["grads"]:
                assert all(torch.equal(sh["grads"][c][n], di["grads"][c][n]) for n in sh["grads"][c]), (name, c)
    finally:
        dist.destroy_process_group()


def run_directed(P, cases, tmp_path, pp_groups=None, with_shared=True):
    """Run ``cases`` on gloo through directed channels (see ``_directed_worker``) and compare every pipeline's
    results with the unpipelined reference."""
    world = P if pp_groups is None else sum(len(g) for g in pp_groups)
    mp.start_processes(_directed_worker, args=(world, free_port_block(1), cases, str(tmp_path), pp_groups,
                                               with_shared),
                       nprocs=world, join=True, start_method="spawn")
    for name, M in cases:
        sched = build_schedule(name, P, M)
        for ranks in pp_groups or [list(range(P))]:
            check_against_reference(name, sched, [torch.load(tmp_path / f"{name}_{M}_rank{r}.pt") for r in ranks])


def test_pp2_directed_channels_all_schedules(tmp_path):
    run_directed(2, [("1f1b", 8), ("zb1p", 9), ("dualpipe", 8), ("dualpipev", 10)], tmp_path)


def test_pp4_directed_channels_all_schedules(tmp_path):
    # directed only (the shared runs of these schedules are the slow-marked pp4 tests above)
    run_directed(4, [("1f1b", 8), ("zb1p", 8), ("dualpipe", 8), ("dualpipev", 8)], tmp_path, with_shared=False)


def test_directed_channels_pipeline_subgroups(tmp_path):
    """World 4 = two pipelines of pp 2 (pipeline groups {0, 2} and {1, 3}, as with dp = 2): every rank takes
    part in creating both pipelines' channels, each rank gets only its own pipeline's, both pipelines run."""
    run_directed(2, [("dualpipe", 8), ("zb1p", 8)], tmp_path, pp_groups=[[0, 2], [1, 3]], with_shared=False)

"""Issue #14, one copy: the trainer's HF export written straight into a two-slot shared-memory arena
(moerl.rollout.shm_arena), sent in ONE /update_weights_from_tensor per server, and the double buffer
that keeps the failover restorer's weights intact while the next version is exported.

Independent references: the private export (gather_megatron_to_hf without out_alloc, bitwise), the
trainer's weights as given (bitwise, against the served parameters), the engine's own call log
(requests counted where the server receives them), torch's /dev/shm handles (file names) and hand
arithmetic for offsets and sizes.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import httpx
import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.rollout.inprocess import serve_in_thread  # noqa: E402
from moerl.rollout.server import ReferenceEngine, load_safetensors_dir  # noqa: E402
from moerl.rollout.shm_arena import SharedExportArena  # noqa: E402
from moerl.rollout.weight_sync import SharedBucketBuffers, sync_weights_from_tensor  # noqa: E402

MiB = 1 << 20


def _handle(t: torch.Tensor) -> bytes:
    """The /dev/shm file name of ``t``'s storage (torch's file_system handle)."""
    return t.untyped_storage()._share_filename_cpu_()[1]


def _fill(slot, sd: dict) -> dict:
    """What an export with ``out_alloc=slot.alloc`` returns: every tensor copied into the slot."""
    return {n: slot.alloc(n, t.shape, t.dtype).copy_(t) for n, t in sd.items()}


def _served_equal(engine: ReferenceEngine, sd: dict) -> list[str]:
    """Names whose served parameter (slice) differs from ``sd`` bitwise."""
    return [k for k, t in sd.items() if not torch.equal(engine.mapper.resolve(k, t)[0], t)]


def _count_updates(engine: ReferenceEngine) -> list:
    """Log every /update_weights_from_tensor the engine receives: (number of tensors, weight_version)."""
    from moerl.rollout.tensor_serde import deserialize, named_tensors_from_payload

    calls, real = [], engine.update_weights_from_tensor

    def logged(blobs, load_format=None, flush_cache=True, weight_version=None):
        calls.append(weight_version)
        return real(blobs, load_format, flush_cache, weight_version)

    engine.update_weights_from_tensor = logged
    return calls


def test_arena_alternates_reuses_its_files_and_grows():
    """Slots alternate before any publish; next() never returns the published slot (an unpublished
    export's slot is reused); a slot grows past its first storage, settles into ONE storage of the
    bytes used on its next use (the other slot starts at that size), and from then on every tensor lands at the same offset of the same
    /dev/shm file; 64-byte alignment; bad allocations are refused by name."""
    g = torch.Generator().manual_seed(0)
    sd = {"b": torch.randn(7, 3, generator=g).to(torch.bfloat16),  # 42 B -> 64 B span, in the 1 MiB first storage
          "a": torch.randn(300_000, generator=g),  # 1,200,000 B: does not fit there -> a 2 MiB second storage
          "c": torch.randint(0, 9, (5,), generator=g)}  # int64, 40 B, after "a"
    arena = SharedExportArena(initial_bytes=MiB)
    assert [arena.next().index for _ in range(3)] == [0, 1, 0]  # nothing published: alternate

    arena = SharedExportArena(initial_bytes=MiB)
    s0 = arena.next()
    out0 = _fill(s0, sd)
    assert all(out0[n].is_shared() and torch.equal(out0[n], sd[n]) for n in sd)
    assert len(s0.storages) == 2 and s0.nbytes == MiB + 2 * MiB  # 1 MiB, then round_up(1,200,000 B) = 2 MiB
    assert s0.used == 64 + 1_200_000 + 64
    arena.publish(s0)
    s1 = arena.next()
    assert s1.index == 1 and arena.next().index == 1  # s1 never published (a failed push): reused
    out1 = _fill(s1, sd)
    assert len(s1.storages) == 1 and s1.nbytes == 2 * MiB  # sized from slot 0's export: one file at once
    arena.publish(s1)
    s0b = arena.next()
    assert s0b is s0 and torch.equal(out0["a"], sd["a"])  # begun again: one storage of the bytes used last time
    assert len(s0.storages) == 1 and s0.nbytes == 2 * MiB
    first = _fill(s0, sd)
    ptrs = {n: t.data_ptr() for n, t in first.items()}
    base = s0.storages[0].data_ptr()
    assert [ptrs[n] - base for n in sd] == [0, 64, 1_200_064]  # in order, 64-byte aligned
    assert all(p % 64 == 0 for p in ptrs.values())
    arena.publish(s0)
    assert torch.equal(out1["a"], sd["a"])  # the other slot was left alone
    handle = _handle(first["a"])
    for _ in range(4):  # steady state: same file, same offsets, both slots
        s = arena.next()
        again = _fill(s, sd)
        arena.publish(s)
        if s is s0:
            assert _handle(again["a"]) == handle and {n: t.data_ptr() for n, t in again.items()} == ptrs
    assert arena.nbytes == 4 * MiB

    s = arena.next()
    s.alloc("x", (2,), torch.float32)
    with pytest.raises(ValueError, match="already allocated"):
        s.alloc("x", (2,), torch.float32)
    with pytest.raises(ValueError, match="dtype must be a torch.dtype"):
        s.alloc("y", (2,), "float32")
    with pytest.raises(ValueError, match="negative"):
        s.alloc("z", (-1, 2), torch.float32)
    with pytest.raises(ValueError, match="another arena"):
        arena.publish(SharedExportArena().next())
    with pytest.raises(ValueError, match="initial_bytes"):
        SharedExportArena(initial_bytes=0)
    with pytest.raises(ValueError, match="slots must be 1 or 2"):
        SharedExportArena(slots=3)

    single = SharedExportArena(initial_bytes=MiB, slots=1)  # no restorer: one slot, reused every export
    one = single.next()
    _fill(one, sd)  # grows over two storages
    assert single.next() is one and len(one.storages) == 1  # settled into one
    keep = _handle(_fill(one, sd)["a"])
    assert single.next() is one and _handle(_fill(one, sd)["a"]) == keep and single.nbytes == 2 * MiB
    with pytest.raises(ValueError, match="cannot publish"):
        single.publish(one)


def test_export_into_the_arena_equals_the_private_export_bitwise(dist, monkeypatch):
    """gather_megatron_to_hf(out_alloc=slot.alloc) of a tiny Qwen3-MoE (tied embeddings and a dense
    layer): same keys, order, dtypes and values as the private export, every tensor in the arena's
    shared storage; both the distributed path (dst=0 of a world of one) and the path without
    torch.distributed."""
    import torch.distributed as tdist

    from moerl.checkpoint.hf_convert import (ShardLayout, gather_megatron_to_hf, hf_to_megatron,
                                             load_megatron_state_dict)
    from moerl.models.qwen3_moe import build_gpt_model
    from test_hf_convert import random_hf_model

    ref = random_hf_model(tie_word_embeddings=True, mlp_only_layers=[0])
    model = build_gpt_model(ref.config).eval()
    load_megatron_state_dict(model, hf_to_megatron(ref.state_dict(), ref.config))
    arena = SharedExportArena(initial_bytes=MiB)
    for world in ("dist", "no dist"):
        if world == "no dist":
            monkeypatch.setattr(tdist, "is_initialized", lambda: False)
        private = gather_megatron_to_hf(model.state_dict(), ref.config, ShardLayout(), dst=0)
        slot = arena.next()
        shared = gather_megatron_to_hf(model.state_dict(), ref.config, ShardLayout(), dst=0, out_alloc=slot.alloc)
        assert list(shared) == list(private) == slot.names and len(private) > 20
        assert all(shared[k].dtype == private[k].dtype and torch.equal(shared[k], private[k]) for k in private)
        assert all(t.is_shared() and t.untyped_storage().data_ptr() in {s.data_ptr() for s in slot.storages}
                   for t in shared.values())
        assert not any(t.is_shared() for t in private.values())
        params = {p.data_ptr() for p in model.parameters()}
        assert not any(t.data_ptr() in params for t in private.values())  # a copy, not the live weights


def test_an_all_shared_dict_goes_in_one_request_and_a_mixed_one_in_buckets(ckpts):
    """Every tensor in the arena: the server receives exactly ONE update (carrying the version) and
    serves the trainer's weights bitwise, with no bucket buffer used; the same dict with some tensors
    private goes the bucketed way (several requests, the version on the last) and is still exact."""
    sds = [dict(load_safetensors_dir(p)) for p in ckpts]
    engine = ReferenceEngine(ckpts[0])
    calls = _count_updates(engine)
    arena, bufs = SharedExportArena(), SharedBucketBuffers()
    try:
        with serve_in_thread(engine) as url:
            slot = arena.next()
            sd = _fill(slot, sds[1])
            assert _served_equal(engine, sds[1]) != []  # the server starts from model A
            n = sync_weights_from_tensor([url], sd, "one", bucket_bytes=30_000, buffers=bufs)
            assert n == 1 and calls == ["one"] and bufs.nbytes == 0
            assert _served_equal(engine, sds[1]) == []
            arena.publish(slot)

            slot = arena.next()
            mixed = _fill(slot, sds[0])
            names = sorted(mixed)
            for k in names[::3]:
                mixed[k] = sds[0][k].clone()  # private tensors: these must be staged in bucket buffers
            calls.clear()
            n = sync_weights_from_tensor([url], mixed, "mixed", bucket_bytes=30_000, buffers=bufs)
            assert n == len(calls) > 2 and calls[-1] == "mixed" and set(calls[:-1]) == {None}
            assert bufs.nbytes > 0 and _served_equal(engine, sds[0]) == []
    finally:
        arena.release()
        bufs.release()
        engine.close()


def test_failover_restore_after_the_next_export_sends_the_published_version(ckpts, tmp_path):
    """moerl.train.weight_sync.WeightSync with rollout.weight_sync=tensor and a server on 127.0.0.1
    exports into its arena and pushes in one request. The restorer of version 2 restores a fresh
    server to version 2's weights bitwise even when called after version 3 was exported (double
    buffer), and still after version 3's push failed and version 4 was exported; once 4 is
    published the restorer sends 4's weights."""
    import moerl.train.weight_sync as loop
    from moerl.config.schema import RolloutConfig
    from moerl.rollout.testing import make_tiny_moe_checkpoint

    extra = str(tmp_path / "model_c")
    make_tiny_moe_checkpoint(extra, seed=2)
    weights = [dict(load_safetensors_dir(p)) for p in (*ckpts, extra)]  # A, B, C
    current = {}
    actor = SimpleNamespace(export_hf_state_dict=lambda dst, out_alloc=None: {
        n: (out_alloc(n, t.shape, t.dtype) if out_alloc else torch.empty_like(t)).copy_(t)
        for n, t in current.items()})
    live, fresh = ReferenceEngine(ckpts[0]), ReferenceEngine(ckpts[0])
    live_calls = _count_updates(live)
    try:
        with serve_in_thread(live) as url, serve_in_thread(fresh) as fresh_url, contextlib.ExitStack() as stack:
            hooks = {}

            def update_weights(version, push, restore=None):  # RolloutCluster.update_weights, one server
                if "before_push" in hooks:
                    hooks.pop("before_push")()
                push([url])
                cluster.version, cluster.restore = version, restore

            # the cluster's kept-alive client (RolloutCluster.http_client), its requests' paths recorded
            paths: list[str] = []
            http = httpx.Client(timeout=60, trust_env=False, event_hooks={"request": [lambda r: paths.append(r.url.path)]})
            stack.callback(http.close)
            cluster = SimpleNamespace(server_urls=[url], extra_worker_urls=[], colocated_server_urls=lambda: [],
                                      update_weights=update_weights, http_client=lambda: http)
            ro = RolloutConfig(weight_sync="tensor", failover=True, weight_sync_bucket_mb=0.03)  # ~31 KB: many buckets
            ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=ro), run_dir=tmp_path, hf_config=None)
            ws = loop.WeightSync(ctx, cluster, version=0)
            assert ws.arena is not None

            current.update(weights[0])
            assert ws(actor) == "1" and live_calls == ["1"] and _served_equal(live, weights[0]) == []
            current.update(weights[1])
            assert ws(actor) == "2" and live_calls == ["1", "2"] and _served_equal(live, weights[1]) == []
            v2_slot = ws.arena.published

            def restore_then_fail():  # version 3 is exported (into the other slot) when this runs
                cluster.restore(fresh_url)
                assert _served_equal(fresh, weights[1]) == []
                raise ConnectionError("push of version 3 failed")

            current.update(weights[2])
            hooks["before_push"] = restore_then_fail
            with pytest.raises(ConnectionError):
                ws(actor)
            assert ws.arena.published == v2_slot and cluster.version == "2"
            current.update(weights[0])  # version 4 goes into the slot of the failed version 3, not version 2's
            hooks["before_push"] = lambda: cluster.restore(fresh_url)
            assert ws(actor) == "4"
            assert _served_equal(fresh, weights[1]) == [] and _served_equal(live, weights[0]) == []
            assert ws.arena.published == 1 - v2_slot
            cluster.restore(fresh_url)
            assert _served_equal(fresh, weights[0]) == []
            assert fresh.weight_version == "4" and live.weight_version == "4"
            assert live_calls == ["1", "2", "4"]  # one request per sync
            # the server's tp_size was asked once (WeightSync.tp_sizes), its weight_version after every push
            assert paths.count("/get_server_info") == 1 and ws.tp_sizes == {url: 1}
            assert paths.count("/get_model_info") == 3 and paths.count("/update_weights_from_tensor") == 3

            # without failover there is no restorer to protect: one slot, overwritten by every export
            ctx.cfg.rollout = RolloutConfig(weight_sync="tensor", failover=False, weight_sync_bucket_mb=0.03)
            ws = loop.WeightSync(ctx, cluster, version=4)
            current.update(weights[2])
            assert len(ws.arena.slots) == 1 and ws(actor) == "5" and cluster.restore is None
            assert live_calls[-1:] == ["5"] and len(live_calls) == 4 and _served_equal(live, weights[2]) == []
    finally:
        live.close()
        fresh.close()


_TWO_RANK_WORKER = r"""
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from moerl.checkpoint.hf_convert import ShardLayout, gather_megatron_to_hf, hf_to_megatron, megatron_to_hf
from moerl.rollout.shm_arena import SharedExportArena
from test_hf_convert import random_hf_model
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
ref = random_hf_model(tie_word_embeddings=False)
sd = hf_to_megatron(ref.state_dict(), ref.config)  # both ranks hold every tensor: rank 0 sends each one
want = megatron_to_hf(sd, ref.config)
arena, facts = SharedExportArena(initial_bytes=1 << 20), {}
for case, dst in (("p2p", 1), ("broadcast", None)):
    slot = arena.next()
    got = gather_megatron_to_hf(sd, ref.config, ShardLayout(), dst=dst, out_alloc=slot.alloc)
    if rank == 1:
        storages = {s.data_ptr() for s in slot.storages}
        facts[case] = dict(n=len(got), same_keys=list(got) == list(want),
                           bitwise=all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want),
                           in_arena=all(t.untyped_storage().data_ptr() in storages for t in got.values()),
                           allocated=slot.names == list(want))
if rank == 1:
    json.dump(facts, open(out, "w"))
dist.destroy_process_group()
"""


def test_rank_dst_receives_straight_into_the_arena(tmp_path):
    """Two gloo ranks: rank 1 (dst=1, and the broadcast path dst=None) receives every tensor rank 0
    sends straight into its arena slot; bitwise megatron_to_hf of the same weights."""
    import json
    import subprocess
    import sys

    from _mp_helpers import free_port_block

    here = os.path.dirname(os.path.abspath(__file__))
    port, out = free_port_block(1), str(tmp_path / "facts.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(here)}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANK_WORKER, str(r), str(port), out, here], env=env)
             for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    facts = json.load(open(out))
    for case in ("p2p", "broadcast"):
        f = facts[case]
        assert f["n"] > 20 and f["same_keys"] and f["bitwise"] and f["in_arena"] and f["allocated"], (case, f)

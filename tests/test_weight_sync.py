"""Weight sync, all three modes (disk | tensor | distributed), against the reference rollout server.

Independent references: the trainer's tensors as read by safetensors from checkpoint B (compared
with the served parameters), and log-probs of a transformers model loaded by transformers' own
loader from checkpoint B (compared with the server's output_token_logprobs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("MOERL_WEIGHT_SYNC_TIMEOUT_S", "60")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from moerl.config.schema import RolloutConfig  # noqa: E402
from moerl.rollout.launcher import wait_healthy  # noqa: E402
from moerl.rollout.server import ReferenceEngine, create_app, load_safetensors_dir  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint  # noqa: E402
from moerl.rollout.weight_sync import (  # noqa: E402
    DistributedWeightUpdater, WeightSyncError, make_buckets, sync_weights, verify_weight_version)

sys.path.insert(0, os.path.dirname(__file__))
from _mp_helpers import free_port_block  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[4, 5, 13, 6, 15], [7, 8, 15]]
TINY, HUGE = 64, 1 << 40  # bytes: smaller than any tensor of the model / larger than the model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    a, b = str(tmp_path_factory.mktemp("wa")), str(tmp_path_factory.mktemp("wb"))
    make_tiny_moe_checkpoint(a, seed=0)
    make_tiny_moe_checkpoint(b, seed=1)
    return a, b


@pytest.fixture(scope="module")
def trainer_sd(ckpts):
    """The 'trainer' weights: checkpoint B's HF tensors as read by safetensors."""
    return {n: t for n, t in load_safetensors_dir(ckpts[1])}


@pytest.fixture(scope="module")
def ref_b(ckpts):
    return AutoModelForCausalLM.from_pretrained(ckpts[1], dtype=torch.float32).eval()


def _served_mismatches(engine: ReferenceEngine, sd: dict) -> list[str]:
    """HF names whose served parameter (slice) differs from the trainer tensor."""
    return [n for n, t in sd.items() if not torch.equal(engine.mapper.resolve(n, t)[0], t)]


def _sample(client, version: str) -> list[dict]:
    outs = []
    for i, p in enumerate(PROMPTS):
        r = client.post("/generate", json={"input_ids": p, "return_logprob": True, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 11 + i, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["weight_version"] == version
        outs.append(out)
    return outs


def _check_logprobs(outs: list[dict], ref_model) -> None:
    """Server log-probs equal log_softmax of an independent transformers forward of the same tokens."""
    for p, out in zip(PROMPTS, outs):
        resp = out["output_ids"]
        lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            logits = ref_model(input_ids=torch.tensor([p + resp])).logits[0].float()
        ref = torch.log_softmax(logits[len(p) - 1: len(p) - 1 + len(resp)], -1).gather(
            1, torch.tensor(resp)[:, None]).squeeze(1)
        torch.testing.assert_close(lps, ref, atol=1e-4, rtol=0)


def _fresh(path):
    engine = ReferenceEngine(path)
    return engine, TestClient(create_app(engine))


@pytest.mark.parametrize("bucket", [TINY, HUGE], ids=["bucket<tensor", "bucket>model"])
@pytest.mark.parametrize("mode", ["disk", "tensor", "distributed"])
def test_each_mode_makes_the_served_weights_equal_the_trainers(mode, bucket, ckpts, trainer_sd, ref_b, tmp_path):
    engine, client = _fresh(ckpts[0])
    url = str(client.base_url)
    matrices = {n for n, t in trainer_sd.items() if t.dim() >= 2}  # norms are all ones in both checkpoints
    assert set(_served_mismatches(engine, trainer_sd)) >= matrices  # A really differs from B
    updater = DistributedWeightUpdater([url], http_client=client, timeout_s=60) if mode == "distributed" else None
    version = f"{mode}-{bucket}"
    try:
        sync_weights(mode, [url], trainer_sd, version, bucket_bytes=bucket, hf_config=AutoConfig.from_pretrained(
            ckpts[1]), out_root=tmp_path, updater=updater, http_client=client)
        assert _served_mismatches(engine, trainer_sd) == []
        assert client.get("/get_model_info").json()["weight_version"] == version
        _check_logprobs(_sample(client, version), ref_b)
        if mode == "disk":
            files = [f for f in os.listdir(tmp_path / f"weights_{version}") if f.endswith(".safetensors")]
            assert len(files) == (len(trainer_sd) if bucket == TINY else 1)
        if mode == "distributed":  # the group persists: a second sync reuses it
            assert updater.world_size == 2 and updater.rank_offsets == [1]
            pg = updater._pg
            updater.sync(make_buckets(trainer_sd, bucket), version + "b")
            assert updater._pg is pg and client.get("/get_model_info").json()["weight_version"] == version + "b"
    finally:
        if updater is not None:
            updater.close()
        engine.close()


def test_bucket_counts(trainer_sd):
    assert len(make_buckets(trainer_sd, TINY)) == len(trainer_sd)
    assert len(make_buckets(trainer_sd, HUGE)) == 1
    sizes = [t.numel() * t.element_size() for t in trainer_sd.values()]
    cap = 3 * max(sizes)
    buckets = make_buckets(trainer_sd, cap)
    assert [n for b in buckets for n in b] == list(trainer_sd)  # order kept, nothing lost
    assert all(sum(t.numel() * t.element_size() for t in b.values()) <= cap for b in buckets)


def test_weight_version_is_checked(ckpts, trainer_sd):
    engine, client = _fresh(ckpts[0])
    url = str(client.base_url)
    updater = DistributedWeightUpdater([url], http_client=client, timeout_s=60)
    try:
        updater.sync(make_buckets(trainer_sd, 20_000), "1")
        with pytest.raises(WeightSyncError, match="reports weight_version '1'"):
            verify_weight_version([url], "2", http_client=client)
        # SGLang semantics: a partial sync is applied and its version set (the sender's business)
        partial = {k: v for k, v in trainer_sd.items() if "q_norm" not in k}
        updater.sync(make_buckets(partial, 20_000), "2")
        assert client.get("/get_model_info").json()["weight_version"] == "2"
        # a refused bucket (unknown name) is still received in full: the group stays in step
        with pytest.raises(WeightSyncError, match="matches no parameter"):
            updater.sync([{"model.nope.weight": torch.zeros(3)}], "bad")
        assert client.get("/get_model_info").json()["weight_version"] == "2"
        updater.sync(make_buckets(trainer_sd, 20_000), "3")
        assert client.get("/get_model_info").json()["weight_version"] == "3"
        assert _served_mismatches(engine, trainer_sd) == []
    finally:
        updater.close()
        engine.close()


def test_empty_buckets_do_not_break_the_distributed_sync(ckpts, trainer_sd):
    engine, client = _fresh(ckpts[0])
    url = str(client.base_url)
    updater = DistributedWeightUpdater([url], http_client=client, timeout_s=60)
    try:
        updater.update_bucket({})  # nothing to send on this rank: no broadcast, the server answers at once
        buckets = make_buckets(trainer_sd, 30_000)
        with_gaps = [{}] + [x for b in buckets for x in (b, {})]
        assert updater.sync(with_gaps, "7") == len(with_gaps)
        assert _served_mismatches(engine, trainer_sd) == []
        assert client.get("/get_model_info").json()["weight_version"] == "7"
        # a sync that sends nothing at all just sets the version (SGLang semantics), without hanging
        assert updater.sync([], "8") == 1
        assert client.get("/get_model_info").json()["weight_version"] == "8"
        # after close() the servers forgot the group; a new updater builds a fresh one
        updater.close()
        r = client.post("/update_weights_from_distributed", json={
            "names": [], "dtypes": [], "shapes": [], "group_name": updater.group_name})
        assert r.status_code == 400 and "init_weights_update_group" in r.json()["message"]
        updater = DistributedWeightUpdater([url], http_client=client, timeout_s=60)
        updater.sync(make_buckets(trainer_sd, HUGE), "9")
        assert client.get("/get_model_info").json()["weight_version"] == "9"
    finally:
        updater.close()
        engine.close()


def test_a_server_refusing_fails_fast_instead_of_hanging_the_broadcast(ckpts, trainer_sd):
    engine, client = _fresh(ckpts[0])
    updater = DistributedWeightUpdater([str(client.base_url)], http_client=client, timeout_s=60)
    try:
        updater.init_group()
        r = client.post("/destroy_weights_update_group", json={"group_name": updater.group_name})
        assert r.status_code == 200 and r.json()["success"]
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="init_weights_update_group"):
            updater.sync(make_buckets(trainer_sd, HUGE), "x")  # nobody receives the broadcast
        assert time.monotonic() - t0 < 20  # not the 60 s group timeout
        assert client.get("/get_model_info").json()["weight_version"] == "default"
    finally:
        updater.close()
        engine.close()


def test_server_refuses_bad_group_requests(ckpts):
    engine, client = _fresh(ckpts[0])
    try:
        r = client.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"})
        assert r.status_code == 400 and "gloo" in r.json()["message"]
        r = client.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2, "backend": "gloo"})
        assert r.status_code == 400 and "rank_offset" in r.json()["message"]
        r = client.post("/init_weights_update_group", json={"master_address": "127.0.0.1"})
        assert r.status_code == 400 and "master_port" in r.json()["message"]
        r = client.post("/update_weights_from_distributed", json={"names": ["x"], "dtypes": ["float32"]})
        assert r.status_code == 400 and "shapes" in r.json()["message"]
    finally:
        engine.close()


def test_sync_weights_argument_errors(trainer_sd):
    with pytest.raises(ValueError, match="rollout.weight_sync must be one of"):
        sync_weights("nccl", ["http://x"], trainer_sd, "1")
    with pytest.raises(ValueError, match="hf_config and out_root"):
        sync_weights("disk", ["http://x"], trainer_sd, "1")
    with pytest.raises(ValueError, match="DistributedWeightUpdater"):
        sync_weights("distributed", ["http://x"], trainer_sd, "1")
    with pytest.raises(ValueError, match="backend"):
        DistributedWeightUpdater(["http://x"], backend="mpi")
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_buckets(trainer_sd, 0)
    cfg = RolloutConfig(weight_sync="distributed", weight_sync_bucket_mb=0.5)
    assert cfg.weight_sync == "distributed" and cfg.weight_sync_bucket_mb == 0.5
    with pytest.raises(ValueError, match="weight_sync_bucket_mb"):
        RolloutConfig(weight_sync_bucket_mb=0)


_GATHER_WORKER = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from moerl.rollout.weight_sync import gather_buckets
    dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2,
                            init_method="tcp://127.0.0.1:" + sys.argv[2])
    me = dist.get_rank()
    sd = torch.load(sys.argv[3])
    names = list(sd)
    cases = {"split": (names[:7], names[7:]), "rank1_empty": (names, [])}
    out = {}
    for case, owned in cases.items():
        local = {n: sd[n] for n in owned[me]}
        got = list(gather_buckets(local, int(sys.argv[4]), dst=0))
        if me == 0:
            torch.save(got, sys.argv[5] + "." + case)
        out[case] = [len(b) for b in got]
    json.dump(out, open(sys.argv[5] + f".{me}.json", "w"))
    dist.destroy_process_group()
""")


def test_uneven_layouts_gather_then_sync(ckpts, trainer_sd, tmp_path):
    """Two trainer ranks own disjoint subsets (or rank 1 owns nothing); gather_buckets walks them
    in buckets to rank 0 (ranks with nothing in a bucket skip it) and the buckets sync the server."""
    sd_path, out = tmp_path / "sd.pt", str(tmp_path / "out")
    torch.save(trainer_sd, sd_path)
    bucket = 6_000
    port = free_port_block(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-c", _GATHER_WORKER, str(r), str(port), str(sd_path), str(bucket),
                               out], env=env) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    counts = [json.load(open(f"{out}.{r}.json")) for r in (0, 1)]
    names = list(trainer_sd)
    for case, owned_by_1 in (("split", names[7:]), ("rank1_empty", [])):
        got = torch.load(f"{out}.{case}")
        assert len(counts[1][case]) == len(got) and set(counts[1][case]) == {0}  # rank 1 yields {} per bucket
        assert [n for b in got for n in b] == [n for n in names if n not in owned_by_1] + owned_by_1
        for b in got:
            assert len(b) == 1 or sum(t.numel() * t.element_size() for t in b.values()) <= bucket
            for n, t in b.items():
                assert torch.equal(t, trainer_sd[n]), n
        if case == "split":
            assert any(all(n in owned_by_1 for n in b) for b in got)  # buckets where rank 0 owns nothing
            assert any(all(n not in owned_by_1 for n in b) for b in got)  # ... and where rank 1 owns nothing
            engine, client = _fresh(ckpts[0])
            updater = DistributedWeightUpdater([str(client.base_url)], http_client=client, timeout_s=60)
            try:
                updater.sync(got, "uneven")
                assert _served_mismatches(engine, trainer_sd) == []
            finally:
                updater.close()
                engine.close()


def test_two_server_processes_all_three_modes(ckpts, trainer_sd, ref_b, tmp_path):
    """Two real uvicorn servers; the distributed group has world size 3 (trainer + 2 servers)."""
    ref_a = AutoModelForCausalLM.from_pretrained(ckpts[0], dtype=torch.float32).eval()
    sd_a = {n: t for n, t in load_safetensors_dir(ckpts[0])}
    base = free_port_block(2)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-m", "moerl.rollout.server", "--model-path", ckpts[0], "--port",
                               str(base + i), "--log-file", str(tmp_path / f"s{i}.log")], env=env) for i in range(2)]
    updater = None
    try:
        for i, (u, p) in enumerate(zip(urls, procs)):
            wait_healthy(u, p, timeout_s=120.0, what=f"server {i}", log_path=str(tmp_path / f"s{i}.log"))
        updater = DistributedWeightUpdater(urls, timeout_s=60)
        cfg = AutoConfig.from_pretrained(ckpts[1])
        plan = [("distributed", trainer_sd, ref_b), ("tensor", sd_a, ref_a), ("disk", trainer_sd, ref_b),
                ("distributed", sd_a, ref_a)]
        for k, (mode, sd, ref) in enumerate(plan):
            sync_weights(mode, urls, sd, f"v{k}", bucket_bytes=50_000, hf_config=cfg, out_root=tmp_path / "w",
                         updater=updater)
            for u in urls:
                with httpx.Client(base_url=u, timeout=60, trust_env=False) as c:
                    _check_logprobs(_sample(c, f"v{k}"), ref)
        assert updater.world_size == 3 and updater.rank_offsets == [1, 2]
    finally:
        if updater is not None:
            updater.close()
        for p in procs:
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------- master address, no server


def _weight_sync(tmp_path, cluster, **rollout):
    """moerl.train.weight_sync.WeightSync over ``cluster`` (not started) with a recipe's rollout section."""
    from types import SimpleNamespace

    import moerl.train.weight_sync as loop

    ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=RolloutConfig(**rollout)), run_dir=tmp_path, hf_config=None)
    return loop.WeightSync(ctx, cluster, version=0)


def test_master_address_auto_is_resolved_and_loopback_refused_with_remote_servers(tmp_path, monkeypatch):
    """rollout.host=auto used to reach _free_port("auto") unresolved ("no free port on auto"); now
    it resolves like the servers' host (gethostbyname(gethostname())), and a loopback / wildcard
    master address is refused, naming the field and the fix, when a server runs on another machine."""
    import socket

    import psutil

    from moerl.rollout import sglang_launcher as sl
    from moerl.rollout.launcher import RolloutCluster
    from moerl.rollout.weight_sync import _free_port, resolve_master_address

    here = socket.gethostbyname(socket.gethostname())  # the independent reference for "auto"
    base = free_port_block(2)
    local = RolloutCluster(str(tmp_path), num_servers=1, base_port=base, router_port=base + 1)
    ws = _weight_sync(tmp_path, local, weight_sync="distributed", host="auto")
    assert ws.master_address == here
    assert 20000 <= _free_port(ws.master_address) < 32000  # bindable: the rendezvous can listen there
    with pytest.raises(WeightSyncError, match="rollout.weight_sync_master_address"):
        _free_port("auto")  # an unresolvable name is named as such at once, not after 500 bind attempts

    remote = "http://10.255.0.2:30000"  # an address of no interface here
    assert "10.255.0.2" not in {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    mixed = RolloutCluster(str(tmp_path), num_servers=1, base_port=base, router_port=base + 1,
                           extra_worker_urls=[remote])
    for kw in ({"host": "127.0.0.1"}, {"host": "0.0.0.0"}, {"host": "auto", "weight_sync_master_address": "localhost"}) \
            + (({"host": "auto"},) if here.startswith("127.") else ()):
        with pytest.raises(ValueError, match=r"rollout\.weight_sync_master_address") as e:
            _weight_sync(tmp_path, mixed, weight_sync="distributed", **kw)
        assert "rollout.host" in str(e.value) and remote in str(e.value)
    assert _weight_sync(tmp_path, mixed, weight_sync="distributed", host="0.0.0.0",
                        weight_sync_master_address="10.1.2.3").master_address == "10.1.2.3"
    assert _weight_sync(tmp_path, mixed, weight_sync="disk", host="127.0.0.1").master_address is None  # not used

    # the recipe check (moerl train, before any work): external URLs and other nodes' servers
    with pytest.raises(ValueError, match=r"rollout\.weight_sync_master_address"):
        sl.check_rollout_environment(RolloutConfig(weight_sync="distributed", external_urls=[remote]))
    sl.check_rollout_environment(RolloutConfig(weight_sync="distributed", external_urls=["http://127.0.0.1:30000"]))
    sl.check_rollout_environment(RolloutConfig(weight_sync="disk", external_urls=[remote]))
    monkeypatch.setattr(sl, "sglang_available", lambda: True)
    multi = dict(weight_sync="distributed", backend="sglang", gpu_ids=[0], host="0.0.0.0")
    sl.check_rollout_environment(RolloutConfig(**multi), nnodes=1)
    with pytest.raises(ValueError, match=r"2 other node"):
        sl.check_rollout_environment(RolloutConfig(**multi), nnodes=3)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun: 2 nodes
    with pytest.raises(ValueError, match=r"1 other node"):
        sl.check_rollout_environment(RolloutConfig(**multi))
    sl.check_rollout_environment(RolloutConfig(**multi, weight_sync_master_address="10.1.2.3"))
    assert resolve_master_address(None, "10.1.2.3", [remote]) == "10.1.2.3"


def test_an_empty_server_list_pushes_to_nobody(ckpts, trainer_sd, tmp_path):
    """Failover with every own server restarting hands update_weights []: distributed must not
    build a group (DistributedWeightUpdater([]) is still an error), tensor sends nothing, disk still
    writes the version directory the restorer loads (read back equal to the trainer's tensors)."""
    with pytest.raises(ValueError, match="server_urls is empty"):
        DistributedWeightUpdater([])
    assert sync_weights("distributed", [], trainer_sd, "3") is None
    from moerl.rollout.weight_sync import sync_weights_from_tensor

    assert sync_weights_from_tensor([], trainer_sd, "3", bucket_bytes=TINY) == 0
    cfg = AutoConfig.from_pretrained(ckpts[1])
    sync_weights("disk", [], trainer_sd, "3", hf_config=cfg, out_root=str(tmp_path))
    back = dict(load_safetensors_dir(str(tmp_path / "weights_3")))
    assert set(back) == set(trainer_sd) and all(torch.equal(back[n], trainer_sd[n]) for n in trainer_sd)


def test_server_tp_sizes_asks_only_the_servers_missing_from_its_cache(ckpts):
    """server_tp_sizes(cache=...) (the trainer's WeightSync.tp_sizes): a server already in the cache is not
    asked again, a new one is asked once and stored; without a cache every call asks."""
    from moerl.rollout.weight_sync import server_tp_sizes

    engine, client = _fresh(ckpts[0])
    asked = []
    real_get = client.get
    client.get = lambda url, **kw: asked.append(url) or real_get(url, **kw)
    url = str(client.base_url).rstrip("/")
    try:
        cache = {"http://other:1": 4}
        assert server_tp_sizes([url, "http://other:1"], http_client=client, cache=cache) == [1, 4]
        assert cache == {"http://other:1": 4, url: 1} and asked == [url + "/get_server_info"]
        assert server_tp_sizes([url], http_client=client, cache=cache) == [1] and len(asked) == 1
        assert server_tp_sizes([url], http_client=client) == [1] and len(asked) == 2
    finally:
        engine.close()

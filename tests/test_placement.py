"""Colocated placement issues release / resume around training in the right order, read back from
the reference server's own request log (one JSON line per call, written by the server process);
disaggregated placement issues none. The expected order is the colocated protocol written out by
hand: release everything before training, resume weights before the weight update, resume the KV
cache before the next generation."""

from __future__ import annotations

import json
import os

import httpx
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.rollout.client import RolloutClient, group_requests  # noqa: E402
from moerl.rollout.launcher import RolloutCluster  # noqa: E402
from moerl.rollout.placement import RolloutPlacement  # noqa: E402
from moerl.rollout.server import load_safetensors_dir  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint, refusing_port  # noqa: E402
from moerl.rollout.weight_sync import sync_weights_from_tensor  # noqa: E402

from _mp_helpers import free_port_block  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_moe_checkpoint(ckpt, seed=0)
    base = free_port_block(2)
    c = RolloutCluster(ckpt, num_servers=1, base_port=base, router_port=base + 1, startup_timeout_s=120,
                       log_dir=str(tmp_path_factory.mktemp("logs")), request_log=True)
    with c:
        c.ckpt = ckpt
        yield c


def _log(cluster) -> list[dict]:
    with open(cluster.request_log_path(0)) as f:
        return [json.loads(line) for line in f if line.strip()]


def _calls(records: list[dict]) -> list[str]:
    """Answered calls in order, generate runs collapsed: 'generate', 'release:all', 'resume:weights', ..."""
    out = []
    for r in records:
        if r["event"] != "done" or r["path"] in ("/health", "/get_model_info"):
            continue
        p = r["path"].lstrip("/")
        if p.endswith("memory_occupation"):
            tags = r.get("tags")
            p = p.split("_")[0] + ":" + ("all" if tags is None else ",".join(tags))
        if not out or out[-1] != p or p != "generate":
            out.append(p)
    return out


def _rollout(cluster, step: int) -> list[dict]:
    reqs = group_requests([4, 5, 6], 2, {"max_new_tokens": 4}, seeds=[step, step + 100], rid=f"s{step}")
    return RolloutClient(cluster.router_url, cluster=cluster).generate_many(reqs)


def _run_steps(cluster, placement: RolloutPlacement, trainer: list, n_steps: int, tag: str) -> int:
    sd = dict(load_safetensors_dir(cluster.ckpt))
    for step in range(1, n_steps + 1):
        outs = _rollout(cluster, step)
        if step > 1:  # the rollout ran on the weights pushed after the previous step's training
            assert all(o["meta_info"]["weight_version"] == f"{tag}{step - 1}" for o in outs)
        placement.before_train()
        trainer.append(("train", step))
        sd = {k: v + 0.01 for k, v in sd.items()}  # "training"
        placement.before_weight_sync()
        sync_weights_from_tensor(cluster.server_urls, sd, f"{tag}{step}")
        placement.before_rollout()
    return n_steps


def test_colocated_release_resume_order_from_server_log(cluster):
    start = len(_log(cluster))
    trainer: list = []
    placement = RolloutPlacement("colocated", cluster.server_urls,
                                 offload_trainer=lambda: trainer.append(("offload",)),
                                 reload_trainer=lambda: trainer.append(("reload",)))
    _run_steps(cluster, placement, trainer, 2, "c")
    assert all(o["meta_info"]["weight_version"] == "c2" for o in _rollout(cluster, 3))
    calls = _calls(_log(cluster)[start:])
    # (sync_weights_from_tensor reads each server's tp_size first: one copy of the payload per TP rank)
    step = ["release:all", "resume:weights", "get_server_info", "update_weights_from_tensor",
            "resume:kv_cache,cuda_graph", "generate"]
    assert calls == ["generate"] + step + step, calls
    # trainer side: offload before the servers' weights come back, reload only after a release
    assert trainer == [("train", 1), ("offload",), ("reload",), ("train", 2), ("offload",)]
    acts = [a for _, a, _ in placement.events]
    assert acts == ["release_memory_occupation", "offload_trainer", "resume_memory_occupation:weights",
                    "resume_memory_occupation:kv_cache,cuda_graph",
                    "release_memory_occupation", "reload_trainer", "offload_trainer",
                    "resume_memory_occupation:weights", "resume_memory_occupation:kv_cache,cuda_graph"]
    # the server saw each release before the trainer's offload hook ran, and the resume after it
    log = [r for r in _log(cluster)[start:] if r["event"] == "done"]
    t_release = [r["t"] for r in log if r["path"] == "/release_memory_occupation"]
    t_resume_w = [r["t"] for r in log if r["path"] == "/resume_memory_occupation" and r.get("tags") == ["weights"]]
    t_offload = [t for _, a, t in placement.events if a == "offload_trainer"]
    assert all(a <= b <= c for a, b, c in zip(t_release, t_offload, t_resume_w)) and len(t_offload) == 2


def test_server_refuses_generate_and_updates_while_released(cluster):
    url = cluster.server_urls[0]
    with httpx.Client(timeout=30, trust_env=False) as c:
        assert c.post(url + "/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        r = c.post(url + "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "kv_cache" in r.text
        assert c.post(url + "/release_memory_occupation", json={"tags": None}).status_code == 200
        r = c.post(url + "/update_weights_from_disk", json={"model_path": cluster.ckpt})
        assert r.status_code == 400 and "weights" in r.text
        assert c.post(url + "/release_memory_occupation", json={"tags": ["gpu"]}).status_code == 400
        assert c.post(url + "/resume_memory_occupation", json={}).status_code == 200
        # ignore_eos: an unseeded sample may be eos at the first token (a 1-token answer, seen in CI)
        r = c.post(url + "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2,
                                                                                    "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text


def test_disaggregated_issues_no_memory_calls(cluster):
    start = len(_log(cluster))
    trainer: list = []
    placement = RolloutPlacement("disaggregated", cluster.server_urls,
                                 offload_trainer=lambda: trainer.append(("offload",)))
    _run_steps(cluster, placement, trainer, 1, "d")
    assert _calls(_log(cluster)[start:]) == ["generate", "get_server_info", "update_weights_from_tensor"]
    assert trainer == [("train", 1)] and placement.events == []
    with pytest.raises(ValueError, match="rollout.placement"):
        RolloutPlacement("shared")


def test_colocated_releases_other_nodes_servers_but_not_external_urls(cluster, tmp_path, monkeypatch):
    """Multi-node colocated: global rank 0's cluster fronts other nodes' moerl-started servers
    (peer_worker_urls, colocated with their node's trainer ranks: they must release / resume too)
    and rollout.external_urls (not moerl's: never released). The 'other node' here is the running
    reference server; the external URL is a closed port, so any call to it would fail the phase."""
    from types import SimpleNamespace

    import moerl.train.weight_sync as loop
    from moerl.config.schema import RolloutConfig
    from moerl.rollout import sglang_launcher as sl

    peer = cluster.server_urls[0]
    with refusing_port() as port:  # nothing listens there
        external = f"http://127.0.0.1:{port}"
        # launch_sglang_rollout on global rank 0 of a 2-node job whose node 0 starts no server itself
        monkeypatch.setattr(sl, "gather_server_urls", lambda local: list(local) + [peer])
        node0 = sl.launch_sglang_rollout(cluster.ckpt, rollout_gpu_ids=[], router_port=free_port_block(1),
                                         external_urls=[external + "/"])
        assert node0.extra_worker_urls == [peer, external] and node0.peer_worker_urls == [peer]
        assert node0.colocated_server_urls() == [peer]  # not started: no live server of its own

        ro = RolloutConfig(placement="colocated")
        ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=ro), run_dir=tmp_path, hf_config=None)
        ws = loop.WeightSync(ctx, node0)
        assert ws.placement.server_urls() == [peer]
        start = len(_log(cluster))
        ws.placement.before_train()
        ws.placement.before_rollout()
        assert _calls(_log(cluster)[start:]) == ["release:all", "resume:weights", "resume:kv_cache,cuda_graph"]
        assert len(_rollout(cluster, 9)) == 2  # the server serves again (1 prompt x 2 samples)

        with pytest.raises(ValueError, match="peer_worker_urls"):  # a peer must be behind the router
            RolloutCluster("", num_servers=0, server_command=lambda i, p: [], extra_worker_urls=[external],
                           peer_worker_urls=[peer])


def test_colocated_trainer_hooks_wait_for_every_rank(tmp_path, monkeypatch):
    """With several trainer ranks (rank 0 alone talks to the servers) a barrier follows every trainer
    offload and precedes every reload: rank 0 resumes the servers only after every rank offloaded,
    and no rank reloads before rank 0 released the servers (on its node or another)."""
    from types import SimpleNamespace

    import moerl.train.weight_sync as loop
    from moerl.config.schema import RolloutConfig
    from moerl.train.offload import ActorOffloader

    order = []
    from moerl.runtime import world

    monkeypatch.setattr(world, "world_size", lambda: 2)
    monkeypatch.setattr(world.tdist, "barrier", lambda *a, **kw: order.append("barrier"))
    monkeypatch.setattr(ActorOffloader, "offload", lambda self: order.append("offload") or 0)
    monkeypatch.setattr(ActorOffloader, "reload", lambda self: order.append("reload") or 0)
    ctx = SimpleNamespace(cfg=SimpleNamespace(rollout=RolloutConfig(placement="colocated")), run_dir=tmp_path,
                          hf_config=None)
    ws = loop.WeightSync(ctx, None)  # a rank other than 0: no cluster, no server calls
    ws.placement.before_weight_sync()
    ws.placement.before_train()
    assert order == ["offload", "barrier", "barrier", "reload"]


def test_freeze_gc_on_the_servers_moerl_started(cluster, monkeypatch):
    """SGLang's /freeze_gc (GET or POST) answers 200 "Garbage collection frozen.\\n" and changes no answer;
    RolloutCluster.freeze_gc reaches every server moerl started and names, without raising, one that fails."""
    url = cluster.server_urls[0]
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(timeout=30, trust_env=False) as c:
        before = c.post(url + "/generate", json=body).json()["output_ids"]
        r = c.get(url + "/freeze_gc")
        assert r.status_code == 200 and r.text == "Garbage collection frozen.\n"
        assert cluster.freeze_gc() == {url: None}
        assert c.post(url + "/generate", json=body).json()["output_ids"] == before
    with refusing_port() as port:  # another node's moerl server that is down
        closed = f"http://127.0.0.1:{port}"
        monkeypatch.setattr(cluster, "peer_worker_urls", [closed])
        out = cluster.freeze_gc()
        assert out[url] is None and "ConnectError" in out[closed]


@pytest.mark.parametrize("enabled", [True, False])
def test_train_freeze_gc_freezes_the_trainer_and_warns_per_refusing_server(enabled, monkeypatch):
    """train.freeze_gc: around the RL loop the trainer process keeps its live objects in the permanent
    generation (unfrozen at the exit) and asks the cluster to do the same on its servers; a server that
    refuses is named in one warning; off: nothing."""
    import gc
    from types import SimpleNamespace

    from moerl.train import components

    logs: list[str] = []
    calls: list[int] = []
    monkeypatch.setattr(components, "log", logs.append)
    cluster = SimpleNamespace(freeze_gc=lambda: calls.append(1) or {"http://a": None, "http://b": "HTTP 404: Not Found"})
    ctx = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(freeze_gc=enabled)))
    gc.unfreeze()
    try:
        with components.frozen_gc(ctx, cluster):
            assert (gc.get_freeze_count() > 0) == enabled and calls == ([1] if enabled else [])
        assert gc.get_freeze_count() == 0
        assert len(logs) == (1 if enabled else 0) and all("http://b/freeze_gc" in m and "404" in m for m in logs)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("mode,given,on_cpu,want", [
    ("async", None, True, 512), ("one_step_off", None, True, 512), ("sync", None, True, 0),
    ("sync", 8, True, 8), ("async", 0, True, 0), ("async", None, False, 0)])
def test_train_warm_memory_mb_touches_that_many_fresh_pages_before_rl(mode, given, on_cpu, want):
    """train.warm_memory_mb: null = 512 MiB in the overlapped modes on CPU, 0 in sync and on GPUs; the MiB it
    reports were really touched: the process's minor page faults (getrusage, the kernel's count) grow by at
    least that many pages, and the memory is unmapped again (nothing kept)."""
    import mmap
    import resource
    from types import SimpleNamespace

    from moerl.train import components

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    got = components.warm_page_pool(SimpleNamespace(warm_memory_mb=given, mode=mode), on_cpu=on_cpu)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert got == want
    assert faults >= want * (1 << 20) // mmap.PAGESIZE
    if not want:
        assert faults < 1000


def test_train_warm_memory_mb_never_fails_the_run(monkeypatch):
    """A value above a quarter of the available memory touches that quarter (warned); a mapping the system
    refuses is skipped (warned): the warm-up is a speed-up, never an error."""
    import mmap
    from types import SimpleNamespace

    from moerl.train import components

    logs: list[str] = []
    monkeypatch.setattr(components, "log", logs.append)
    monkeypatch.setattr(components, "_available_mib", lambda: 40)
    assert components.warm_page_pool(SimpleNamespace(warm_memory_mb=10**9, mode="async"), on_cpu=True) == 10
    assert "train.warm_memory_mb=1000000000" in logs[-1] and "10 MiB" in logs[-1]

    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(components, "_available_mib", lambda: None)
    monkeypatch.setattr(mmap, "mmap", refuse)
    assert components.warm_page_pool(SimpleNamespace(warm_memory_mb=64, mode="async"), on_cpu=True) == 0
    assert "train.warm_memory_mb=64" in logs[-1] and "skipped" in logs[-1]

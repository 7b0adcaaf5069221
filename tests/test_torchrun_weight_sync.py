"""`rollout.weight_sync=distributed` inside a torchrun job.

The bug: with more than one trainer rank (any torchrun launch) the first sync hung right after
"trainer: 2 ranks". torchrun puts TORCHELASTIC_USE_AGENT_STORE=True into every worker's environment,
and ``torch.distributed.rendezvous("tcp://...")`` then only CONNECTS to a store it assumes the elastic
agent hosts; the updater's rank 0 used that call, so nobody listened on the weight-update group's
port and both the trainer and the servers waited for it (py-spy: both in
torch/distributed/rendezvous.py _create_c10d_store, the agent-store branch). The fix makes rank 0 host
the store itself, and starts servers without torchrun's variables (moerl.runtime.procs.child_env).

References: the served parameters equal the trainer's tensors (read by safetensors); the torchrun run's
step-0 check compares the server's log-probs with Megatron's (the weights the servers got by broadcast).
"""

from __future__ import annotations

import torch


def test_distributed_sync_from_a_torchrun_worker(ckpts, monkeypatch):
    """The updater run with a torchrun worker's environment (TORCHELASTIC_USE_AGENT_STORE=True, no agent
    store anywhere) creates its group and delivers the weights. Before the fix: WeightSyncError
    'timed out' after timeout_s (the rendezvous waited for a store nobody hosted)."""
    from fastapi.testclient import TestClient

    from moerl.rollout.server import ReferenceEngine, create_app, load_safetensors_dir
    from moerl.rollout.weight_sync import DistributedWeightUpdater, make_buckets

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MOERL_WEIGHT_SYNC_TIMEOUT_S", "20")  # the server side's rendezvous: fail, never hang
    trainer_sd = {n: t for n, t in load_safetensors_dir(ckpts[1])}
    engine = ReferenceEngine(ckpts[0])
    client = TestClient(create_app(engine))
    updater = DistributedWeightUpdater([str(client.base_url)], http_client=client, timeout_s=20)
    try:
        assert any(not torch.equal(engine.mapper.resolve(n, t)[0], t) for n, t in trainer_sd.items())
        updater.sync(make_buckets(trainer_sd, 1 << 20), "7")
        assert client.get("/get_model_info").json()["weight_version"] == "7"
        assert [n for n, t in trainer_sd.items() if not torch.equal(engine.mapper.resolve(n, t)[0], t)] == []
    finally:
        updater.close()
        engine.close()


def test_child_env_drops_torchrun_variables(monkeypatch):
    from moerl.runtime.procs import child_env

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("MOERL_KEEP_ME", "x")
    env = child_env()
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env and "LOCAL_RANK" not in env and "MASTER_PORT" not in env
    assert env["MOERL_KEEP_ME"] == "x" and env["PATH"]

# The torchrun run with 2 trainer ranks and rollout.weight_sync=distributed (it hung before the fix) is
# tests/test_torchrun_signals.py's: one job checks the sync and the clean stop (CI's slow budget).

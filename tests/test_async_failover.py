"""Async RL with a rollout server killed mid-run: kill -9 of one of two reference servers (behind the
real sglang-router) while the RolloutManager produces ahead under max_staleness 2 and weight updates
pause, push and continue in flight. Every consumed sample is unique, none is lost (each draw's every
group and sample is trained exactly once), and the staleness bound still holds for every trained token.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.data.dataset import PromptSampler  # noqa: E402
from moerl.rollout.client import RolloutClient  # noqa: E402
from moerl.rollout.launcher import RolloutCluster, disk_restorer  # noqa: E402
from moerl.rollout.manager import RolloutManager  # noqa: E402
from moerl.rollout.server import load_safetensors_dir  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint  # noqa: E402
from moerl.rollout.weight_sync import sync_weights_from_disk  # noqa: E402

from _mp_helpers import free_port_block  # noqa: E402

STEPS, B, N = 8, 4, 4


def _until_generating(manager: RolloutManager, timeout_s: float = 5.0) -> None:
    """Wait (bounded) until the producer has groups in flight and they have run a few decode steps."""
    deadline = time.monotonic() + timeout_s
    while manager._inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.03)


@pytest.mark.slow  # ~40 s on 2 shared cores
def test_async_run_survives_a_killed_server_without_losing_or_repeating_samples(tmp_path):
    from transformers import AutoConfig

    ckpt = str(tmp_path / "tiny")
    make_tiny_moe_checkpoint(ckpt, seed=0)
    hf_config = AutoConfig.from_pretrained(ckpt)
    base_sd = dict(load_safetensors_dir(ckpt))
    base = free_port_block(3)
    cluster = RolloutCluster(ckpt, num_servers=2, base_port=base, router_port=base + 2, startup_timeout_s=120,
                             log_dir=str(tmp_path / "logs"), failover=True, health_check_interval_s=0.2,
                             max_restarts=2)
    recipe = SimpleNamespace(
        seed=3, train=SimpleNamespace(mode="async", max_staleness=2, staleness_policy="wait",
                                      partial_rollout_mask_old=False),
        rollout=SimpleNamespace(n_samples_per_prompt=N, rollout_batch_size=B, dynamic_sampling=False,
                                max_oversample_factor=1.0, max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=-1,
                                placement="disaggregated"),
        data=SimpleNamespace(prompt_key="prompt", label_key="label"))
    rows = [{"prompt": [3 + (7 * i + j) % 40 for j in range(3 + i % 4)], "label": str(i)} for i in range(40)]
    versions = {"v": 0}
    root = tmp_path / "weights"

    def push() -> int:  # a new weight version every step (the weights perturbed by the step number)
        versions["v"] += 1
        v = str(versions["v"])
        sd = {k: t + 1e-3 * versions["v"] for k, t in base_sd.items()}
        cluster.update_weights(v, lambda urls: sync_weights_from_disk(urls, sd, hf_config, root, v),
                               restore=disk_restorer(str(root / f"weights_{v}"), v))
        return versions["v"]

    with cluster:
        push()  # version 1 everywhere before RL starts
        manager = RolloutManager(
            client=RolloutClient(cluster.router_url, timeout_s=120, max_retries=2, cluster=cluster),
            cluster=cluster, sampler=PromptSampler(rows, B, 0), encode=list, decode=str,
            reward_fn=lambda text, label: float(len(text) % 2), cfg=recipe, eos_id=1, num_steps=STEPS,
            version=versions["v"], log=print)
        batches, killed = [], None
        with manager:
            for step in range(1, STEPS + 1):
                b = manager.get_batch(step)
                batches.append(b)
                if step == 3:  # requests of later batches are in flight now: kill -9 server 0
                    killed = cluster.pids[0]
                    os.kill(killed, signal.SIGKILL)
                # "training" takes less time than a batch's generation, so the push lands while later
                # batches' requests are running (they come back cut and are resumed with the new weights)
                _until_generating(manager)
                manager.update_weights(push, step)
        events = [e["event"] for e in cluster.failover_events if e["index"] == 0]
    assert killed is not None and "died" in events and "restarted" in events, events
    uids = [s.metadata["uid"] for b in batches for s in b.samples]
    assert len(uids) == len(set(uids)), "a sample was trained twice"
    want = {f"{d}-{g}-{k}" for d in range(1, STEPS + 1) for g in range(B) for k in range(N)}
    assert set(uids) == want, f"lost: {sorted(want - set(uids))[:10]}"
    for b in batches:
        assert b.metrics["rollout/dropped_stale_groups"] == 0 and b.metrics["rollout/failed_groups"] == 0
        for s in b.samples:
            assert s.status in ("completed", "truncated") and len(s.token_versions) == len(s.response_ids)
            assert max(b.trainer_version - v for v in s.token_versions) <= 2
    print("resumed segments per batch:", [b.metrics["rollout/resumed_segments"] for b in batches])
    assert sum(b.metrics["rollout/resumed_segments"] for b in batches) > 0  # updates landed in flight
    assert torch.tensor([b.trainer_version for b in batches]).tolist() == list(range(1, STEPS + 1))

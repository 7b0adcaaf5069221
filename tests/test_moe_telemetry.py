"""MoETelemetry (moerl.moe.telemetry): tokens_per_expert equal a brute-force recount from the router
logits, EP=2 on gloo gives the EP=1 counts for the same batch, only the intended passes are counted,
and the collapse / dead-expert alerts fire on a collapsed router and stay silent on a balanced one.

Run the EP worker by hand: python -m torch.distributed.run --nproc_per_node 2 tests/test_moe_telemetry.py OUT.json
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mp_helpers as h  # noqa: E402

from moerl.moe.telemetry import MoETelemetry, load_stats  # noqa: E402

E, K, H = 8, 2, 8


@pytest.fixture(autouse=True)
def _fresh_aux_loss_tracker():
    """Megatron's aux-loss tracker is process-global and sized by the first model's num_layers:
    empty it around each test so tiny 1-layer routers here do not break other tests' models."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    yield
    get_moe_layer_wise_logging_tracker().clear()


def make_router(score_function: str = "softmax"):
    """A standalone Megatron TopKRouter (layer 1) whose logits are the input's features."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from moerl.models.qwen3_moe import make_hf_config, transformer_config_from_hf

    fields = dict(h.TINY_FIELDS, num_hidden_layers=1, hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=4, num_experts=E, num_experts_per_tok=K)
    cfg = transformer_config_from_hf(make_hf_config(fields), moe_aux_loss_coeff=0.0,
                                     moe_router_load_balancing_type="none")
    router = TopKRouter(config=cfg, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E, H))
    return router


# ----------------------------------------------------------------------------- alerts
def test_collapse_and_dead_expert_alerts_fire_on_collapsed_router(dist, tmp_path, caplog):
    router = make_router()
    path = tmp_path / "moe_telemetry.jsonl"
    tel = MoETelemetry(router, jsonl_path=str(path), entropy_threshold=0.5, dead_expert_steps=3)
    g = torch.Generator().manual_seed(0)
    # experts 0 and 1 win every token: load entropy ln 2 / ln 8 = 1/3 < 0.5
    skew = torch.tensor([6.0, 6.0] + [-6.0] * (E - 2))
    reports = []
    with caplog.at_level(logging.WARNING, logger="moerl.moe.telemetry"):
        for step in range(1, 4):
            router(torch.randn(10, 3, H, generator=g) + skew)
            reports.append(tel.step_end(step))
    for r in reports:
        assert r["tokens_per_expert"][0] == [30, 30] + [0] * (E - 2)
        assert r["metrics"]["collapse_alert"] == 1.0
        assert r["metrics"]["layer0/entropy_norm"] == pytest.approx(math.log(2) / math.log(E))
        assert r["metrics"]["layer0/imbalance"] == pytest.approx(30 / (60 / E))
    # an expert with no tokens for 3 consecutive steps: the alert fires at step 3, not before
    assert [r["metrics"]["dead_expert_alert"] for r in reports] == [0.0, 0.0, 1.0]
    assert "experts [2, 3, 4, 5, 6, 7]" in reports[2]["alerts"][-1]
    assert any("routing collapse: layer 0" in rec.message for rec in caplog.records)
    assert any("dead experts: layer 0" in rec.message for rec in caplog.records)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(d["step"], d["layer"], d["tokens_per_expert"]) for d in lines] == [
        (s, 0, [30, 30] + [0] * (E - 2)) for s in (1, 2, 3)]
    assert len(lines[2]["alerts"]) == 2 and len(lines[0]["alerts"]) == 1
    tel.close()


def test_alerts_stay_silent_on_balanced_router(dist, caplog):
    router = make_router()
    tel = MoETelemetry(router, entropy_threshold=0.5, dead_expert_steps=3)
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="moerl.moe.telemetry"):
        for step in range(5):
            router(torch.randn(64, 2, H, generator=g))
            r = tel.step_end(step)
            assert r["alerts"] == [] and r["metrics"]["collapse_alert"] == 0.0
            assert r["metrics"]["dead_expert_alert"] == 0.0
            assert r["metrics"]["layer0/entropy_norm"] > 0.9
            assert sum(r["tokens_per_expert"][0]) == 64 * 2 * K
    assert not caplog.records


def test_load_stats_by_hand():
    s = load_stats(torch.tensor([3, 1, 0, 0]))
    # p = [3/4, 1/4, 0, 0]: H = -(0.75 ln 0.75 + 0.25 ln 0.25); imbalance = 3 / 1
    h_ = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert s["entropy"] == pytest.approx(h_) and s["entropy_norm"] == pytest.approx(h_ / math.log(4))
    assert s["imbalance"] == 3.0 and s["dead_experts"] == 2.0 and s["tokens"] == 4.0


def test_bad_arguments_are_named(dist):
    router = make_router()
    with pytest.raises(ValueError, match="mode"):
        MoETelemetry(router, mode="logprob")
    with pytest.raises(ValueError, match="entropy_threshold"):
        MoETelemetry(router, entropy_threshold=2.0)
    with pytest.raises(ValueError, match="no Megatron MoE router"):
        MoETelemetry(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- counts on a real model
def _forward(model, tokens):
    from moerl.models.qwen3_moe import causal_attention_mask

    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    return model(tokens, pos, causal_attention_mask(s))


def test_counts_equal_brute_force_recount_and_only_update_passes_count(dist):
    from moerl.models.qwen3_moe import build_gpt_model, make_hf_config

    hf = make_hf_config(h.TINY_FIELDS)
    model = build_gpt_model(hf)
    tel = MoETelemetry(model)
    inputs = {}  # layer -> router input captured by an independent pre-hook
    for r in tel._routers:
        r.register_forward_pre_hook(lambda m, a, _l=int(r.layer_number) - 1: inputs.__setitem__(_l, a[0].detach()))
    tokens, _ = h.fixed_batch(hf.vocab_size, batch=3, seq=10)
    model.train()
    _forward(model, tokens)  # update pass: counted
    expected = {}
    for r in tel._routers:
        layer = int(r.layer_number) - 1
        logits = inputs[layer].reshape(-1, hf.hidden_size).double() @ r.weight.double().t()
        top = torch.topk(logits, hf.num_experts_per_tok, dim=-1).indices  # norm_topk_prob: top-k of logits
        expected[layer] = torch.bincount(top.flatten(), minlength=hf.num_experts).tolist()
    assert sorted(expected) == [0, 1]
    assert all(sum(v) == 3 * 10 * hf.num_experts_per_tok for v in expected.values())
    # a log-prob pass (eval, no_grad), a paused pass: not counted
    model.eval()
    with torch.no_grad():
        _forward(model, tokens)
    model.train()
    with tel.paused():
        _forward(model, tokens)
    report = tel.step_end(0)
    assert report["tokens_per_expert"] == expected
    # mode "all" counts the log-prob pass too
    tel.mode = "all"
    model.eval()
    with torch.no_grad():
        _forward(model, tokens)
    assert tel.step_end(1)["tokens_per_expert"] == expected
    tel.close()
    _forward(model, tokens)
    assert tel.step_end(2) == {"tokens_per_expert": {}, "alerts": [], "metrics": {}}


def ep_counts(rows: slice) -> dict:
    """tokens_per_expert of one update-pass forward of the tiny model (test_hf_convert's weights)
    on ``rows`` of the fixed batch, reduced over all ranks."""
    from test_hf_convert import FIELDS, random_hf_model

    from moerl.models.qwen3_moe import make_hf_config
    from moerl.train.actor import MegatronActor

    actor = MegatronActor(make_hf_config(FIELDS), trainable=False)
    actor.load_hf_state_dict(random_hf_model().state_dict())
    tel = MoETelemetry(actor.model)
    tokens, _ = h.fixed_batch(FIELDS["vocab_size"], batch=4, seq=12)
    actor.model.train()
    _forward(actor.model, tokens[rows])
    report = tel.step_end(0)
    return {str(k): v for k, v in report["tokens_per_expert"].items()}


@pytest.mark.slow
def test_ep2_counts_equal_ep1_counts(dist, tmp_path):
    out = tmp_path / "ep2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(h.free_port()), str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, env=h.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ep2 = json.loads(out.read_text())
    ep1 = ep_counts(slice(0, 4))
    assert ep2["ep_size"] == 2 and ep2["dp_size"] == 2
    assert ep2["counts"] == ep1
    assert all(sum(v) == 4 * 12 * 2 for v in ep1.values())


if __name__ == "__main__":  # torchrun worker: EP=2 (dp_size 2), each rank routes half of the batch
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    info = init_distributed(ep_size=2, seed=0, num_threads=1)
    try:
        counts = ep_counts(slice(2 * info.rank, 2 * info.rank + 2))
        if info.rank == 0:
            Path(sys.argv[1]).write_text(json.dumps({"ep_size": 2, "dp_size": info.dp_size, "counts": counts}))
    finally:
        destroy_distributed()
    from moerl.cli import exit_without_teardown

    exit_without_teardown(0)  # results written: skip the module teardown (about 1 s of CPU per rank)

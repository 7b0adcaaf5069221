"""MoE balancing (moerl.moe.config): the recipe keys reach Megatron-Core's TopKRouter, and the router's
balancing losses equal values worked by hand (REFERENCE.md sec. 2) on a tiny routing example; the
aux-loss-free expert bias (Megatron's finalize_model_grads helper) moves a skewed router toward balance."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moerl.config import ConfigError, load_config
from moerl.models.qwen3_moe import make_hf_config, transformer_config_from_hf
from moerl.moe.config import moe_actor_kwargs, moe_transformer_overrides, validate_moe

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_arith.yaml"
E, K, H = 4, 2, 8  # experts, top-k, hidden (router logits = the first E input features)
FIELDS = dict(num_hidden_layers=1, hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
              num_experts=E, num_experts_per_tok=K, moe_intermediate_size=8, intermediate_size=16,
              max_position_embeddings=16, rope_theta=10000.0, rms_norm_eps=1e-6, norm_topk_prob=True,
              tie_word_embeddings=False, vocab_size=32)

# Router probabilities of 4 tokens (logits = log p, so softmax gives p back exactly).
#   t1 -> top-2 {0,1}; t2 -> {1,2}; t3 -> {2,3}; t4 -> {0,1}
P = torch.tensor([[0.4, 0.3, 0.2, 0.1],
                  [0.1, 0.4, 0.3, 0.2],
                  [0.2, 0.1, 0.4, 0.3],
                  [0.5, 0.3, 0.1, 0.1]], dtype=torch.float64)


@pytest.fixture(autouse=True)
def _fresh_aux_loss_tracker():
    """Megatron's aux-loss tracker is process-global and sized by the first model's num_layers:
    empty it around each test so tiny 1-layer routers here do not break other tests' models."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    yield
    get_moe_layer_wise_logging_tracker().clear()


def moe(**kw):
    base = dict(z_loss_coeff=0.0, score_function="softmax", expert_bias=False, bias_update_rate=1e-3,
                topk_scaling_factor=None, num_groups=None, group_topk=None, capacity_factor=None,
                pad_to_capacity=False, token_drop_policy="probs", token_dispatcher="alltoall")
    base.update(kw)
    return SimpleNamespace(**base)


def algo(lb="aux_loss", coeff=1e-2):
    return SimpleNamespace(moe_load_balancing_type=lb, moe_aux_loss_coeff=coeff)


def make_router(moe_cfg, algorithm):
    """A Megatron TopKRouter built from the recipe keys, whose logits equal the first E input features."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    cfg = transformer_config_from_hf(make_hf_config(FIELDS), **moe_transformer_overrides(moe_cfg, algorithm))
    router = TopKRouter(config=cfg, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :E] = torch.eye(E)
    return router, cfg


def as_input(logits_sbe: torch.Tensor) -> torch.Tensor:
    """[S, B, E] logits -> [S, B, H] router input."""
    s, b, _ = logits_sbe.shape
    x = torch.zeros(s, b, H)
    x[..., :E] = logits_sbe.float()
    return x


def tracked(name: str, clear: bool = True) -> float:
    """Layer 1's value (loss / coeff) in Megatron's aux-loss tracker, then clear the tracker."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    value = float(get_moe_layer_wise_logging_tracker()[name]["values"][0])
    if clear:
        clear_aux_losses_tracker()
    return value


# ----------------------------------------------------------------------------- mapping and validation
def test_recipe_keys_map_onto_transformer_config(dist):
    m = moe(z_loss_coeff=1e-3, score_function="sigmoid", expert_bias=True, bias_update_rate=2e-3,
            topk_scaling_factor=2.5, num_groups=2, group_topk=1, capacity_factor=1.5, pad_to_capacity=True,
            token_dispatcher="allgather")
    cfg = transformer_config_from_hf(make_hf_config(FIELDS), **moe_transformer_overrides(m, algo("seq_aux_loss", 1e-4)))
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == ("seq_aux_loss", 1e-4, 1e-3)
    assert (cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias, cfg.moe_router_bias_update_rate) == (
        "sigmoid", True, 2e-3)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert (cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity, cfg.moe_token_dispatcher_type) == (
        1.5, True, "allgather")
    kw = moe_actor_kwargs(SimpleNamespace(moe=moe(), algorithm=algo("none", 0.0)))
    assert kw["moe_load_balancing_type"] == "none" and kw["moe_aux_loss_coeff"] == 0.0
    assert kw["config_overrides"]["moe_z_loss_coeff"] is None  # 0 = off
    assert "moe_aux_loss_coeff" not in kw["config_overrides"]


@pytest.mark.parametrize("overrides, needles", [
    (["moe.expert_bias=true"], ["moe.expert_bias", "moe.score_function=sigmoid"]),
    (["moe.num_groups=2"], ["moe.num_groups", "moe.group_topk", "set together"]),
    (["moe.num_groups=3", "moe.group_topk=1"], ["model.hf_config.num_experts (8)", "moe.num_groups (3)"]),
    (["moe.num_groups=4", "moe.group_topk=3"], ["moe.group_topk (3)", "num_experts_per_tok (2)"]),
    (["moe.num_groups=8", "moe.group_topk=1"], ["experts per group", "moe.group_topk"]),
    (["moe.pad_to_capacity=true"], ["moe.pad_to_capacity", "moe.capacity_factor"]),
    (["algorithm.moe_load_balancing_type=seq_aux_loss"], ["seq_aux_loss", "train.pack"]),
    (["moe.token_dispatcher=deepep"], ["moe.token_dispatcher"]),
    (["moe.entropy_threshold=1.5"], ["moe.entropy_threshold"]),
])
def test_bad_moe_keys_are_named(overrides, needles):
    with pytest.raises(ConfigError) as ei:
        load_config(TINY, overrides)
    for needle in needles:
        assert needle in str(ei.value), (needle, str(ei.value))


def test_good_combinations_load():
    cfg = load_config(TINY, ["moe.score_function=sigmoid", "moe.expert_bias=true", "moe.num_groups=4",
                             "moe.group_topk=2", "algorithm.moe_load_balancing_type=seq_aux_loss", "train.pack=false"])
    assert cfg.moe.expert_bias and cfg.moe.num_groups == 4


def test_flex_dispatcher_on_cpu_fails_naming_deepep(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(TINY, ["moe.token_dispatcher=flex"])  # a recipe may be planned anywhere
    with pytest.raises(ValueError) as ei:
        moe_actor_kwargs(cfg)
    msg = str(ei.value)
    for needle in ("moe.token_dispatcher=flex", "DeepEP", "v1.2.1", "from source", "deep-ep"):
        assert needle in msg, (needle, msg)
    assert moe_actor_kwargs(cfg, check_hardware=False)["config_overrides"]["moe_flex_dispatcher_backend"] == "deepep"


def test_conflicting_balancing_spellings_are_named():
    alg = SimpleNamespace(moe_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
                          model_fields_set={"moe_load_balancing_type", "moe_aux_loss_coeff"})
    with pytest.raises(ValueError, match="moe.aux_loss_coeff .* algorithm.moe_aux_loss_coeff"):
        validate_moe(SimpleNamespace(aux_loss_coeff=0.0), algorithm=alg)


# ----------------------------------------------------------------------------- losses worked by hand
def test_aux_loss_and_z_loss_by_hand(dist):
    # logits = log p + c_t: softmax is unchanged, logsumexp(logits_t) = c_t
    c = torch.tensor([1.0, 2.0, 0.0, -1.0], dtype=torch.float64)
    logits = (P.log() + c[:, None]).reshape(4, 1, E)  # [S=4, B=1, E]
    router, _ = make_router(moe(z_loss_coeff=1e-3), algo("aux_loss", 1e-2))
    probs, routing_map = router(as_input(logits))
    assert routing_map.tolist() == [[True, True, False, False], [False, True, True, False],
                                    [False, False, True, True], [True, True, False, False]]
    # f = counts / (T k) = [2, 3, 2, 1] / 8 ; P = column means = [0.3, 0.275, 0.25, 0.175]
    # L_aux / alpha = E * sum_i f_i P_i = 4 * (0.6 + 0.825 + 0.5 + 0.175) / 8 = 1.05
    assert tracked("load_balancing_loss", clear=False) == pytest.approx(1.05, rel=1e-5)
    # z-loss / coeff = mean_t c_t^2 = (1 + 4 + 0 + 1) / 4 = 1.5
    assert tracked("z_loss") == pytest.approx(1.5, rel=1e-5)
    # top-k gates renormalised (norm_topk_prob): t1 -> 0.4/0.7, 0.3/0.7
    assert probs[0, :2].tolist() == pytest.approx([4 / 7, 3 / 7], rel=1e-5)


def test_seq_aux_loss_by_hand(dist):
    # [S=2, B=2]: sequence b0 = (t1, t3), sequence b1 = (t2, t4)
    logits = P.log().reshape(2, 2, E)
    router, _ = make_router(moe(), algo("seq_aux_loss", 1e-4))
    router(as_input(logits))
    # DeepSeek-V3: f_i = E / (k T) * count_i (T = 2 tokens per sequence), P_i = mean affinity
    #   b0: counts [1,1,1,1] -> f = [1,1,1,1], P = [0.3,0.2,0.3,0.2] -> sum f P = 1.0
    #   b1: counts [1,2,1,0] -> f = [1,2,1,0], P = [0.3,0.35,0.2,0.15] -> sum f P = 1.2
    # Megatron averages over the sequences: (1.0 + 1.2) / 2 = 1.1
    assert tracked("seq_load_balancing_loss") == pytest.approx(1.1, rel=1e-5)


def test_global_aux_loss_accumulates_counts_over_micro_batches(dist):
    router, _ = make_router(moe(), algo("global_aux_loss", 1e-2))
    router(as_input(P.log().reshape(4, 1, E)))
    assert tracked("global_load_balancing_loss") == pytest.approx(1.05, rel=1e-5)  # = aux_loss on the first
    # second micro-batch: 4 copies of t1 -> counts [4,4,0,0], P = [0.4,0.3,0.2,0.1]
    router(as_input(P[:1].log().expand(4, E).reshape(4, 1, E)))
    # counts averaged over the 2 micro-batches: ([2,3,2,1] + [4,4,0,0]) / 2 = [3,3.5,1,0.5]
    # f = [3,3.5,1,0.5] / 8 ; E * sum f P = 4 * (1.2 + 1.05 + 0.2 + 0.05) / 8 = 1.25
    # (the per-micro-batch aux_loss would be 4 * (1.6 + 1.2) / 8 = 1.4)
    assert tracked("global_load_balancing_loss") == pytest.approx(1.25, rel=1e-5)


def test_sigmoid_scores_aux_loss_by_hand(dist):
    # sigmoid scores are normalised per token for the aux loss: s / sum_j s_j
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0], [1.0, 0.0, 0.5, -0.5]], dtype=torch.float64)
    router, _ = make_router(moe(score_function="sigmoid"), algo("aux_loss", 1e-2))
    router(as_input(logits.reshape(2, 1, E)))
    s = torch.sigmoid(logits)
    s = s / s.sum(-1, keepdim=True)
    # t0 top-2 {3, 1}; t1 top-2 {0, 2}: counts [1,1,1,1] -> f = 1/4 each -> E * sum f P = sum_i P_i = 1
    assert tracked("load_balancing_loss") == pytest.approx(float(s.mean(0).sum()) * 1.0, rel=1e-5)
    assert float(s.mean(0).sum()) == pytest.approx(1.0)


def test_group_limited_routing_stays_in_chosen_groups(dist):
    router, _ = make_router(moe(num_groups=2, group_topk=1), algo("none", 0.0))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1, E, generator=g, dtype=torch.float64)
    _, routing_map = router(as_input(logits))
    for t in range(16):
        chosen = routing_map[t].nonzero().flatten().tolist()
        groups = {e // 2 for e in chosen}
        assert len(chosen) == K and len(groups) == 1
        # norm_topk_prob (pre_softmax off): groups ranked by the sum of their top-(k / group_topk) = 2 logits
        z = logits[t, 0]
        best_group = int(torch.argmax(torch.stack([z[0:2].sum(), z[2:4].sum()])))
        assert groups == {best_group}


# ----------------------------------------------------------------------------- aux-loss-free bias
def test_expert_bias_moves_skewed_router_toward_balance(dist):
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias, reset_model_temporary_tensors

    rate = 0.02
    router, cfg = make_router(moe(score_function="sigmoid", expert_bias=True, bias_update_rate=rate), algo("none", 0.0))
    skew = torch.tensor([1.5, 0.5, -0.5, -1.5])
    g = torch.Generator().manual_seed(1)
    imbalance = []
    for step in range(80):
        logits = (torch.randn(64, 1, E, generator=g) * 0.5 + skew).double()
        bias_before = router.expert_bias.clone()
        probs, routing_map = router(as_input(logits))
        counts = routing_map.sum(0).double()
        assert router.local_tokens_per_expert.tolist() == counts.tolist()
        imbalance.append(float(counts.max() / counts.mean()))
        # gates use the unbiased sigmoid scores, renormalised over the chosen experts
        s = torch.sigmoid(logits.reshape(-1, E).float()) * routing_map
        assert torch.allclose(probs, s / s.sum(-1, keepdim=True), atol=1e-6)
        _update_router_expert_bias([router], cfg)  # what finalize_model_grads runs after each step
        reset_model_temporary_tensors(cfg, [router])
        # b_i += gamma * sign(mean_count - count_i)  (arXiv 2408.15664)
        expected = bias_before + rate * torch.sign(counts.mean() - counts).float()
        assert torch.allclose(router.expert_bias, expected, atol=1e-7)
    assert imbalance[0] == pytest.approx(2.0)  # experts 0 and 1 take everything at first
    assert sum(imbalance[-10:]) / 10 < 1.35, imbalance[-10:]
    b = router.expert_bias.tolist()
    assert b[0] < b[1] < b[2] < b[3] or (b[0] < b[3] and b[1] < b[2]), b
    assert math.isclose(sum(imbalance[:5]) / 5, 2.0, abs_tol=0.1)


@pytest.mark.parametrize("overrides, needle", [
    (["moe.score_function=sigmoid"], "moe.score_function=sigmoid"),
    (["moe.score_function=sigmoid", "moe.expert_bias=true"], "moe.expert_bias=true"),
    (["moe.num_groups=4", "moe.group_topk=2"], "moe.num_groups=4"),
    (["moe.capacity_factor=1.5"], "moe.capacity_factor=1.5"),
    (["moe.topk_scaling_factor=2.0"], "moe.topk_scaling_factor=2.0"),
])
def test_train_refuses_routers_the_rollout_engines_cannot_run(overrides, needle):
    from moerl.moe.config import check_rollout_routing_matches

    cfg = load_config(TINY, overrides)  # valid for planning
    with pytest.raises(ValueError) as ei:
        check_rollout_routing_matches(cfg.moe)
    assert needle in str(ei.value) and "sampling policy" in str(ei.value)
    check_rollout_routing_matches(load_config(TINY, ["moe.topk_scaling_factor=1.0"]).moe)  # same as HF: fine

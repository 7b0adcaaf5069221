"""DeepSeek-V3 family (moerl.models.families.deepseek_v3): Megatron-Core (MLA, shared experts, sigmoid router
with the expert bias, group-limited routing, scaled gates, dense first layer) against transformers'
DeepseekV3ForCausalLM forward on the same weights, and exact HF <-> Megatron round trips (whole and sharded).

Reference: transformers 5's own DeepseekV3 forward (its router: sigmoid + e_score_correction_bias, group
scores = sum of the top-2 biased scores, gates renormalised and scaled by routed_scaling_factor; its
experts: a per-expert loop over the fused gate_up / down tensors). Megatron's router code is different
(moe_utils.group_limited_topk / topk_routing_with_score_function) and so is its expert dispatch (alltoall
dispatcher, SequentialMLP), so agreement is not by construction.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_convert import randomize_weights_  # noqa: E402

from moerl.checkpoint.hf_convert import (  # noqa: E402
    ShardLayout,
    fused_experts_to_per_expert,
    hf_to_megatron,
    load_megatron_state_dict,
    megatron_to_hf,
    merge_megatron_shards,
)
from moerl.models.families import deepseek_v3 as ds  # noqa: E402
from moerl.models.families import get_family  # noqa: E402
from moerl.models.gpt import build_gpt_model, causal_attention_mask  # noqa: E402

ATOL = 1e-4  # fp32; the measured floor is printed by the test (-s)

FIELDS = dict(
    num_hidden_layers=3,
    hidden_size=48,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=20,  # non-square expert widths (20 x 48)
    intermediate_size=56,
    n_shared_experts=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    rope_theta=5000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    vocab_size=96,
)


def random_hf_model(seed=0, **changes):
    """A tiny fp32 transformers DeepseekV3ForCausalLM with non-trivial weights everywhere (transformers
    initialises the router and the expert bias to zeros and norms to ones, which would hide mapping
    mistakes); the expert bias is large enough to change which experts are chosen."""
    from transformers import DeepseekV3ForCausalLM

    config = ds.make_hf_config({**FIELDS, **changes})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float().eval()
    g = randomize_weights_(model, seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    return model


def hf_state(model) -> dict:
    """transformers' in-memory state dict incl. the expert-bias buffers (persistent)."""
    return dict(model.state_dict())


def on_disk(model) -> dict:
    sd = fused_experts_to_per_expert(hf_state(model), model.config)
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


CASES = [
    pytest.param({}, id="mla-groups-sigmoid-bias"),
    pytest.param(dict(tie_word_embeddings=True, q_lora_rank=None, n_group=1, topk_group=1,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "mscale": 1.0, "mscale_all_dim": 1.0}, rope_theta=None),
                 id="tied-no-qlora-yarn"),
]


@pytest.mark.parametrize("changes", CASES)
def test_logits_match_transformers_and_round_trip_is_exact(dist, changes):
    changes = {k: v for k, v in changes.items() if v is not None}
    fields_rope = "rope_parameters" in changes
    ref = random_hf_model(**({k: v for k, v in changes.items()} if not fields_rope else changes))
    cfg = ref.config
    assert get_family(cfg) is ds.FAMILY
    model = build_gpt_model(cfg).eval()
    tc = model.config
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_topk_scaling_factor) == \
        ("sigmoid", True, 2.5)
    assert tc.moe_layer_freq == [0, 1, 1] and tc.moe_shared_expert_intermediate_size == 20

    load_megatron_state_dict(model, hf_to_megatron(hf_state(ref), cfg))
    b, s = 3, 13
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        ours = model(tokens, pos, causal_attention_mask(s))
        theirs = ref(input_ids=tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"\n[{changes and 'variant' or 'base'}] max |logit| {theirs.abs().max().item():.3f}, max abs diff {diff:.2e}")
    assert theirs.abs().max() > 1.0
    assert diff <= ATOL
    if not changes:  # the expert bias decides routing here: without it Megatron's logits move well off
        sd = model.state_dict()
        biases = [k for k in sd if k.endswith("mlp.router.expert_bias")]
        assert len(biases) == 2
        with torch.no_grad():
            saved = [sd[k].clone() for k in biases]
            for k in biases:
                sd[k].zero_()
            assert (model(tokens, pos, causal_attention_mask(s)) - theirs).abs().max() > 100 * ATOL
            for k, v in zip(biases, saved):
                sd[k].copy_(v)

    exported = megatron_to_hf(model.state_dict(), cfg)
    expected = on_disk(ref)
    assert set(exported) == set(expected)
    for k, v in expected.items():
        assert torch.equal(exported[k], v), k


LAYOUTS = [
    dict(tp_size=2), dict(ep_size=2), dict(pp_size=2), dict(tp_size=2, ep_size=2, etp_size=1), dict(pp_size=3, ep_size=4),
]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda d: "-".join(f"{k[:-5]}{v}" for k, v in d.items()))
def test_sharded_round_trip_is_exact(sizes):
    """Cut the HF model into every rank's Megatron shard (TP / EP / PP rules) and merge the shards back:
    bit-identical HF tensors; a TP shard holds half the heads of q_b / kv_b; the MLA down projections, the
    router, its bias and the latent norms are replicated."""
    tp, ep, pp = sizes.get("tp_size", 1), sizes.get("ep_size", 1), sizes.get("pp_size", 1)
    ref = random_hf_model(seed=3, num_hidden_layers=4 if pp == 2 else 3)
    cfg = ref.config
    expected = on_disk(ref)
    tp, ep, pp = sizes.get("tp_size", 1), sizes.get("ep_size", 1), sizes.get("pp_size", 1)
    etp = sizes.get("etp_size", tp)
    shards = {}
    for t in range(tp):
        for e in range(ep):
            for p in range(pp):
                layout = ShardLayout(tp_size=tp, tp_rank=t, ep_size=ep, ep_rank=e, pp_size=pp, pp_rank=p,
                                     etp_size=etp, etp_rank=t if etp == tp else 0)
                shards[layout] = hf_to_megatron(expected, cfg, layout)
    if tp == 2:
        one = shards[next(iter(shards))]
        nh = cfg.num_attention_heads
        assert one["decoder.layers.0.self_attention.linear_q_up_proj.weight"].shape == \
            (nh // 2 * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank)
        assert one["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape == \
            (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size)  # replicated (see layer_spec)
        assert one["decoder.layers.1.mlp.router.expert_bias"].shape == (cfg.n_routed_experts,)
    if ep == 4:
        assert any("local_experts.1." in k for sd in shards.values() for k in sd)  # E / ep = 2 per rank
        assert not any("local_experts.2." in k for sd in shards.values() for k in sd)
    merged = merge_megatron_shards(shards, cfg)
    assert set(merged) == set(expected)
    for k, v in expected.items():
        assert torch.equal(merged[k], v), k


def test_expert_bias_update_follows_the_loads_transformers_routes(dist):
    """Aux-loss-free balancing on the family's model: after a forward, Megatron's bias update (what
    finalize_model_grads runs) moves each MoE layer's bias by rate * sign(mean load - load), where the loads
    are counted from transformers' own router (DeepseekV3TopkRouter's top-k indices on the same tokens)."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias, reset_model_temporary_tensors

    rate = 0.01
    ref = random_hf_model(seed=5)
    cfg = ref.config
    model = build_gpt_model(cfg, moe_router_bias_update_rate=rate).eval()
    load_megatron_state_dict(model, hf_to_megatron(hf_state(ref), cfg))
    counts = {}

    def hook(layer):
        def fn(module, args, out):
            counts[layer] = torch.bincount(out[2].reshape(-1), minlength=cfg.n_routed_experts).double()
        return fn

    handles = [ref.model.layers[l].mlp.gate.register_forward_hook(hook(l)) for l in (1, 2)]
    tokens = torch.randint(0, cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref(input_ids=tokens)
    model(tokens, torch.arange(12).expand(4, 12), causal_attention_mask(12))  # counts loads only with grad on
    for h in handles:
        h.remove()
    routers = [model.decoder.layers[l].mlp.router for l in (1, 2)]
    before = [r.expert_bias.clone() for r in routers]
    _update_router_expert_bias(routers, model.config)
    reset_model_temporary_tensors(model.config, routers)
    for l, r, b in zip((1, 2), routers, before):
        c = counts[l]
        assert c.sum() == 4 * 12 * cfg.num_experts_per_tok and c.max() > c.mean()  # skewed at this init
        assert torch.allclose(r.expert_bias, b + rate * torch.sign(c.mean() - c).float(), atol=1e-7)
    exported = megatron_to_hf(model.state_dict(), cfg)  # the updated bias is what the servers receive
    assert torch.equal(exported["model.layers.1.mlp.gate.e_score_correction_bias"], routers[0].expert_bias)


@pytest.mark.parametrize("changes, needle", [
    (dict(n_group=2, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok // topk_group"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, rope_theta=None), "rope_type"),
    (dict(num_nextn_predict_layers=1, first_k_dense_replace=3), "num_nextn_predict_layers=1 needs an MoE last"),
])
def test_unmapped_features_are_refused_naming_the_key(changes, needle):
    fields = {k: v for k, v in {**FIELDS, **changes}.items() if v is not None}
    with pytest.raises(ValueError, match=needle) as ei:
        ds.transformer_config_from_hf(ds.make_hf_config(fields), tp_size=1, pp_size=1, ep_size=1)
    assert "model.hf_config" in str(ei.value)


def test_recipe_router_keys_must_agree_with_the_hf_config():
    cfg = ds.make_hf_config(FIELDS)
    with pytest.raises(ValueError) as ei:
        ds.transformer_config_from_hf(cfg, tp_size=1, pp_size=1, ep_size=1, moe_router_score_function="softmax",
                                      moe_router_enable_expert_bias=False, moe_router_num_groups=None)
    msg = str(ei.value)
    assert "set moe.score_function: 'sigmoid'" in msg and "set moe.expert_bias: True" in msg
    assert "set moe.num_groups: 2" in msg
    tc = ds.transformer_config_from_hf(cfg, tp_size=1, pp_size=1, ep_size=1, moe_router_score_function="sigmoid",
                                       moe_router_enable_expert_bias=True, moe_router_num_groups=2,
                                       moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk, tc.q_lora_rank) == (2, 1, 24)
    with pytest.raises(ValueError, match="model.layer_spec=local"):
        ds.transformer_config_from_hf(cfg, tp_size=1, pp_size=1, ep_size=1, layer_spec="transformer_engine")


def test_make_hf_config_names_bad_fields():
    with pytest.raises(ValueError, match="missing required field"):
        ds.make_hf_config({k: v for k, v in FIELDS.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="unknown DeepSeek-V3 config field"):
        ds.make_hf_config({**FIELDS, "num_kv_heads": 2})
    with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible by n_group=3"):
        ds.make_hf_config({**FIELDS, "n_group": 3})
    assert ds.make_hf_config({**FIELDS, "num_local_experts": 8}).n_routed_experts == 8


def test_mtp_layers_refused_where_not_built():
    """MTP: a negative depth, pp_size > 1 and a critic's value head are refused naming the key; without the
    key no MTP layer is built (transformers' DeepseekV3Config defaults to one)."""
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be an int >= 0"):
        ds.make_hf_config({**FIELDS, "num_nextn_predict_layers": -1})
    assert ds.mtp_layers(ds.make_hf_config(FIELDS)) == 0 and ds.mtp_hf_shapes(ds.make_hf_config(FIELDS)) == {}
    cfg = ds.make_hf_config({**FIELDS, "num_nextn_predict_layers": 1})
    with pytest.raises(ValueError, match="parallel.pp_size=1"):
        ds.transformer_config_from_hf(cfg, tp_size=1, pp_size=2, ep_size=1)
    with pytest.raises(ValueError, match="value head"):
        ds.conversion_rules(cfg, head="value")
    shapes = ds.mtp_hf_shapes(cfg)
    assert shapes["model.layers.3.eh_proj.weight"] == (48, 96) and shapes["model.layers.3.mlp.gate.weight"] == (8, 48)
    assert {k for r in ds.conversion_rules(cfg) for k in r.hf_keys if k.startswith("model.layers.3.")} == set(shapes)


def test_mla_without_transformer_engine_needs_the_cpu_patch(dist):
    """The CPU patch mla_te_placeholders removes 'isinstance() arg 2 must be a type' (Megatron's TE extension
    hands out mocks when TE is absent, and multi_latent_attention believes TE is there)."""
    from moerl.runtime.cpu_compat import without_patch

    cfg = ds.make_hf_config(FIELDS)
    with without_patch("mla_te_placeholders"):
        with pytest.raises(TypeError, match="isinstance"):
            build_gpt_model(cfg)
    assert build_gpt_model(cfg) is not None


def test_rl_accepts_the_deepseek_router_and_refuses_others():
    """moerl train's refusal of sigmoid / bias / group / scaling routers is lifted for DeepSeek-V3 (the reference
    rollout server runs transformers' DeepseekV3TopkRouter), as long as the recipe keys equal the HF config."""
    from types import SimpleNamespace

    from moerl.moe.config import check_rollout_routing_matches

    facts = ds.router_facts(ds.make_hf_config(FIELDS))
    keys = dict(score_function="sigmoid", expert_bias=True, num_groups=2, group_topk=1, capacity_factor=None,
                topk_scaling_factor=2.5)
    check_rollout_routing_matches(SimpleNamespace(**keys), facts, "DeepSeek-V3")
    with pytest.raises(ValueError) as ei:
        check_rollout_routing_matches(SimpleNamespace(**{**keys, "expert_bias": False, "topk_scaling_factor": None}),
                                      facts, "DeepSeek-V3")
    assert "moe.expert_bias=false (rollout: e_score_correction_bias)" in str(ei.value)
    assert "moe.topk_scaling_factor=None (rollout: 2.5)" in str(ei.value)
    with pytest.raises(ValueError, match="moe.score_function=sigmoid"):  # Qwen3-MoE (no facts) still refuses it
        check_rollout_routing_matches(SimpleNamespace(**keys))


def test_expert_bias_counts_skip_padding_tokens(dist):
    """moerl's router patch (moerl.moe.balancing._apply_expert_bias): Megatron-Core 0.16.1 fails on
    ``routing_map [T, E] & ~padding_mask [T]``; the counts must be the routing map's column sums over the
    real tokens only."""
    from moerl.moe.balancing import install_balancing_losses

    model = build_gpt_model(ds.make_hf_config(FIELDS))
    router = install_balancing_losses(model)[0]
    x = torch.randn(6, 2, FIELDS["hidden_size"], generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(6, 2, dtype=torch.bool)
    pad[4:, 1] = True  # the second row ends in two padding tokens
    router.local_tokens_per_expert.zero_()
    _, routing_map = router(x, padding_mask=pad)
    assert router.local_tokens_per_expert.tolist() == routing_map[~pad.reshape(-1)].sum(0).tolist()
    assert router.local_tokens_per_expert.sum() == 10 * FIELDS["num_experts_per_tok"]


def test_reference_server_updates_the_expert_bias():
    """The reference rollout server's weight mapper takes e_score_correction_bias (a transformers buffer) like a
    weight: a sync without it is incomplete, a sync with it sets the served router's bias."""
    from moerl.rollout.engine_weights import WeightMapper

    ref = random_hf_model(seed=4)
    mapper = WeightMapper(ref)
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    new = torch.arange(8, dtype=torch.float32) / 10
    covered = mapper.apply([(name, new)])
    assert torch.equal(ref.model.layers[2].mlp.gate.e_score_correction_bias, new)
    assert name not in mapper.missing(covered) and "model.layers.1.mlp.gate.e_score_correction_bias" in \
        mapper.missing(covered)


def test_recipe_builds_the_deepseek_config():
    """configs/tiny_deepseek_v3.yaml -> the family's HF config; DeepSeek keys on a Qwen3-MoE recipe are named."""
    from pathlib import Path

    from moerl.config.loader import ConfigError, load_config

    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_deepseek_v3.yaml")
    cfg = load_config(recipe, [])
    fields = dict(cfg.model.hf_config.family_fields(), vocab_size=64)
    hf = get_family(cfg.model.hf_config.model_type).make_hf_config(fields)
    assert (hf.model_type, hf.n_routed_experts, hf.n_group, hf.topk_group, hf.first_k_dense_replace) == \
        ("deepseek_v3", 8, 2, 1, 1)
    from moerl.moe.config import check_rollout_routing_matches

    check_rollout_routing_matches(cfg.moe, ds.router_facts(hf), "DeepSeek-V3")  # the recipe's keys agree
    with pytest.raises(ConfigError, match="model.hf_config.q_lora_rank is a DeepSeek-V3 key"):
        load_config(recipe, ["model.hf_config.model_type=qwen3_moe"])


# ----------------------------------------------------------------------------- layouts on gloo (slow)
# one PPO step of the actor on a 4-layer DeepSeek-V3 (layer 0 dense) with the expert-bias update on, in each
# layout, against one process: loss, grad norm, log-probs, the updated weights and expert biases (HF export)
DS_LAYOUTS = {"ref": dict(nproc=1), "tp2ep2": dict(nproc=2, tp=2, ep=2, etp=1), "pp2": dict(nproc=2, pp=2),
              "dualpipev": dict(nproc=2, pp=2, schedule="dualpipev")}
DS_MODEL = dict(num_hidden_layers=4, vocab_size=100)  # vocab of test_parallel_layouts.global_samples


def run_ds_layout(case: str, out_dir) -> None:
    import json
    import sys
    from pathlib import Path

    import torch.distributed as tdist

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_parallel_layouts import ADAM_EPS, rank_log_probs_and_ppo_step

    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.actor import MegatronActor

    spec = DS_LAYOUTS[case]
    info = init_distributed(tp_size=spec.get("tp", 1), pp_size=spec.get("pp", 1), ep_size=spec.get("ep", 1),
                            etp_size=spec.get("etp"), seed=0, num_threads=1)
    try:
        hf = random_hf_model(seed=0, **DS_MODEL)
        actor = MegatronActor(hf.config, lr=1e-3, adam_eps=ADAM_EPS, clip_grad=1.0, moe_aux_loss_coeff=0.0,
                              moe_load_balancing_type="none", config_overrides={"moe_router_bias_update_rate": 0.05},
                              pipeline_schedule=spec.get("schedule", "1f1b"))
        actor.load_hf_state_dict(hf_state(hf))
        lp, metrics = rank_log_probs_and_ppo_step(actor, hf, info)
        export = actor.export_hf_state_dict(dst=0)
        everything = [None] * info.world_size
        tdist.all_gather_object(everything, dict(rank=info.rank, lp=lp, metrics=metrics))
        if info.rank == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            torch.save(export, Path(out_dir) / f"{case}.pt")
            (Path(out_dir) / f"{case}.json").write_text(json.dumps(everything))
    finally:
        destroy_distributed()


def _launch_ds(case: str, out_dir) -> tuple[list, dict]:
    import json
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _mp_helpers as h

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(DS_LAYOUTS[case]["nproc"]),
           "--master_addr", "127.0.0.1", "--master_port", str(h.free_port()), str(Path(__file__).resolve()),
           case, str(out_dir)]
    proc = subprocess.run(cmd, env=h.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun {case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((Path(out_dir) / f"{case}.json").read_text()), torch.load(Path(out_dir) / f"{case}.pt")


@pytest.mark.slow
def test_deepseek_layouts_match_one_process(tmp_path):
    """TP=2 + EP=2 (expert-TP 1, sequence parallel), PP=2 (1F1B) and PP=2 with DualPipeV on gloo reproduce one
    process: loss and grad norm (1e-5), log-probs (1e-5), every updated weight (max |diff| / max |ref| <= 1e-5)
    and the updated expert biases (the aux-loss-free update counts the same tokens in every layout)."""
    ref_ranks, ref_export = _launch_ds("ref", tmp_path)
    init = on_disk(random_hf_model(seed=0, **DS_MODEL))
    bias = [k for k in ref_export if k.endswith("e_score_correction_bias")]
    assert len(bias) == 3 and all(not torch.equal(ref_export[k], init[k]) for k in bias)  # the update ran
    ref = ref_ranks[0]
    for case in ("tp2ep2", "pp2", "dualpipev"):
        ranks, export = _launch_ds(case, tmp_path)
        for r in ranks:
            assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-5, (case, r["metrics"], ref["metrics"])
            assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
            worst = max(abs(a - b) for k, v in r["lp"].items() for a, b in zip(v, ref["lp"][k]))
            assert worst <= 1e-5, (case, r["rank"], worst)
        assert set(export) == set(ref_export)
        for k, want in ref_export.items():
            rel = float((export[k] - want).abs().max() / want.abs().max().clamp_min(1e-30))
            assert rel <= 1e-5, (case, k, rel)


if __name__ == "__main__":
    import sys

    run_ds_layout(sys.argv[1], sys.argv[2])
    from moerl.cli import exit_without_teardown

    exit_without_teardown(0)  # results written: skip the module teardown (about 1 s of CPU per rank)


def test_convert_tool_round_trips_a_tiny_deepseek_v3(tmp_path, capsys):
    """tools/convert_checkpoint.py (its main, in this process): transformers' save_pretrained of a DeepSeek-V3
    -> torch_dist -> HF gives every tensor back bit for bit, the expert biases included."""
    import importlib.util
    from pathlib import Path

    from moerl.checkpoint.hf_io import load_hf_state_dict

    spec = importlib.util.spec_from_file_location("convert_checkpoint", Path(__file__).resolve().parents[1]
                                                  / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ref = random_hf_model(seed=6)
    ref.save_pretrained(tmp_path / "hf")
    saved = load_hf_state_dict(tmp_path / "hf")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in saved
    assert tool.main(["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert tool.main(["mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--config", str(tmp_path / "hf"),
                      "--out", str(tmp_path / "back")]) == 0
    back = load_hf_state_dict(tmp_path / "back")
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    capsys.readouterr()


@pytest.mark.parametrize("changes", [{}, dict(tie_word_embeddings=True, q_lora_rank=None)], ids=["untied", "tied-noq"])
def test_planner_counts_transformers_parameters(changes):
    """moerl's memory planner sizes a DeepSeek-V3 from the family's shape (MLA, shared expert, dense first layer):
    total parameters equal transformers' model; active = total minus the unchosen routed experts."""
    from moerl.parallel.memory_model import ModelShape, total_params

    ref = random_hf_model(**changes)
    counts = total_params(ModelShape.from_hf_config(ref.config))
    assert counts["total"] == sum(p.numel() for p in ref.parameters())
    per_expert = 3 * FIELDS["hidden_size"] * FIELDS["moe_intermediate_size"]
    assert counts["total"] - counts["active"] == 2 * (8 - 2) * per_expert  # 2 MoE layers, 6 unchosen experts


def test_r3_replays_the_rollout_routing_of_the_sigmoid_bias_group_router(dist):
    """R3 with DeepSeek-V3: the reference server's recorder (HFRoutingRecorder on transformers' DeepseekV3TopkRouter,
    dense layer 0 left -1) records the biased, group-limited choice; a Megatron model whose expert bias was zeroed
    routes differently on its own, but forced to the recorded experts (moerl.moe.routing_replay) gives
    transformers' logits again (the gates use the unbiased sigmoid scores of the chosen experts)."""
    from types import SimpleNamespace

    from moerl.moe.routing_replay import HFRoutingRecorder, RoutingReplay

    ref = random_hf_model(seed=8)
    cfg = ref.config
    model = build_gpt_model(cfg).eval()
    sd = hf_to_megatron(hf_state(ref), cfg)
    load_megatron_state_dict(model, {k: (torch.zeros_like(v) if k.endswith("expert_bias") else v) for k, v in sd.items()})
    b, s = 2, 9
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(13))
    rec = HFRoutingRecorder(ref)
    with torch.no_grad(), rec.recording():
        theirs = ref(input_ids=tokens).logits
    routed = rec.collect(b)  # [B, S, L, K]
    assert routed.shape == (b, s, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert (routed[:, :, 0] == -1).all() and (routed[:, :, 1:] >= 0).all()
    mask, pos = causal_attention_mask(s), torch.arange(s).expand(b, s)
    with torch.no_grad():
        free = model(tokens, pos, mask)
    assert (free - theirs).abs().max() > 100 * ATOL  # without the bias the model routes elsewhere
    replay = RoutingReplay(model, "r3")
    mb = SimpleNamespace(routed_experts=routed, tokens=tokens, packed_tokens=None)
    replay.before_forward(mb)
    with torch.no_grad():
        forced = model(tokens, pos, mask)
    replay.after_forward(mb)
    replay.remove()
    assert (forced - theirs).abs().max() <= ATOL


# ----------------------------------------------------------------------------- multi-token prediction
def _mtp_reference(seed=3, lam=0.3, tied=False):
    """A DeepSeek-V3 with one MTP layer in DeepSeek's HF layout, and its hand-built training loss.

    The weights come from a transformers DeepseekV3ForCausalLM with L + 1 layers (layer L is the MTP
    layer's decoder layer, an MoE layer) plus random enorm / hnorm / eh_proj / shared_head.norm. The
    reference loss is written out from the DeepSeek-V3 report (sec. 2.2) with transformers' modules:
    h = norm(layers[:L](embed(t))); main = masked mean CE(lm_head(h), labels);
    h' = layers[L](eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])); mtp = masked mean CE(lm_head(shared_head.norm(h')),
    labels_{i+1}) with the mask shifted too (the last position drops out); loss = main + lam * mtp (D = 1).
    Returns (hf config with num_nextn_predict_layers=1, HF on-disk state dict, tokens, labels, mask, loss,
    main, mtp, {hf key: grad})."""
    L = 2
    big = random_hf_model(seed, num_hidden_layers=L + 1, tie_word_embeddings=tied)
    big.config._attn_implementation = "eager"
    cfg = ds.make_hf_config({**FIELDS, "num_hidden_layers": L, "num_nextn_predict_layers": 1,
                             "tie_word_embeddings": tied})
    H, g = cfg.hidden_size, torch.Generator().manual_seed(seed + 5)
    extra = {"enorm.weight": 1.0 + 0.3 * torch.randn(H, generator=g), "hnorm.weight": 1.0 + 0.3 * torch.randn(H, generator=g),
             "eh_proj.weight": 0.08 * torch.randn(H, 2 * H, generator=g),
             "shared_head.norm.weight": 1.0 + 0.3 * torch.randn(H, generator=g)}
    extra = {k: v.requires_grad_() for k, v in extra.items()}
    b, s = 3, 11
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    mask = torch.ones(b, s)
    mask[:, -1] = 0
    mask[0, :3] = 0  # a prompt part
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    attn = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None].expand(b, 1, s, s)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def masked_ce(logits, y, m):
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        return (ce * m.reshape(-1)).sum() / m.sum()

    def shift(x):  # Megatron-Core's roll_tensor: left by one, zero filled
        out = torch.roll(x, -1, dims=1).clone()
        out[:, -1] = 0
        return out

    m = big.model
    h = m.embed_tokens(tokens)
    pe = m.rotary_emb(h, pos)
    for layer in m.layers[:L]:
        h = layer(h, attention_mask=attn, position_ids=pos, position_embeddings=pe)
    h = m.norm(h)
    main = masked_ce(big.lm_head(h), labels, mask)
    x = torch.cat([rms(m.embed_tokens(shift(tokens)), extra["enorm.weight"]), rms(h, extra["hnorm.weight"])], -1)
    x = m.layers[L](x @ extra["eh_proj.weight"].T, attention_mask=attn, position_ids=pos, position_embeddings=pe)
    mtp = masked_ce(big.lm_head(rms(x, extra["shared_head.norm.weight"])), shift(labels), shift(mask))
    loss = main + lam * mtp
    loss.backward()
    grads = {k: p.grad for k, p in big.named_parameters() if p.grad is not None}
    grads = fused_experts_to_per_expert(grads, big.config)
    grads.update({f"model.layers.{L}.{k}": v.grad for k, v in extra.items()})
    sd = on_disk(big)
    sd.update({f"model.layers.{L}.{k}": v.detach() for k, v in extra.items()})
    sd[f"model.layers.{L}.embed_tokens.weight"] = sd["model.embed_tokens.weight"]
    sd[f"model.layers.{L}.shared_head.head.weight"] = sd["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return cfg, sd, tokens, labels, mask, loss.detach(), main.detach(), mtp.detach(), grads


def test_mtp_loss_and_gradient_match_a_hand_built_reference(dist):
    """Megatron-Core's MTP (built by the family from num_nextn_predict_layers=1, weights from DeepSeek's HF
    layout) against the loss written out by hand with transformers' modules: the main loss, the MTP loss
    (Megatron's tracker) and every parameter's gradient of main + lambda * MTP (lambda = 0.3); the HF ->
    Megatron -> HF round trip with the MTP layer is exact."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    lam = 0.3
    cfg, sd, tokens, labels, mask, ref_loss, ref_main, ref_mtp, ref_grads = _mtp_reference(lam=lam)
    model = build_gpt_model(cfg, mtp_loss_scaling_factor=lam)
    assert model.config.mtp_num_layers == 1 and model.mtp_process
    load_megatron_state_dict(model, hf_to_megatron(sd, cfg))
    exported = megatron_to_hf(model.state_dict(), cfg)
    assert set(exported) == set(sd)
    for k, v in sd.items():
        assert torch.equal(exported[k], v), k

    model.train()
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    s = tokens.shape[1]
    ce = model(tokens, torch.arange(s).unsqueeze(0).expand_as(tokens), causal_attention_mask(s),
               labels=labels, loss_mask=mask)
    main = (ce * mask).sum() / mask.sum()
    main.backward()
    mtp = MTPLossLoggingHelper.tracker["values"][0]
    grads = {k: p.grad for k, p in model.named_parameters()}
    grads.update({k: torch.zeros_like(v) for k, v in model.state_dict().items()
                  if k.endswith("expert_bias")})
    ours = megatron_to_hf(grads, cfg)
    print(f"\nmain {main.item():.6f} vs {ref_main.item():.6f}, mtp {mtp.item():.6f} vs {ref_mtp.item():.6f}")
    assert abs(main.item() - ref_main.item()) < 1e-5 and abs(mtp.item() - ref_mtp.item()) < 1e-5
    assert ref_mtp.item() > 1.0 and abs((main + lam * mtp).item() - ref_loss.item()) < 1e-5
    worst = max((ours[k] - g).abs().max().item() for k, g in ref_grads.items())
    scale = max(g.abs().max().item() for g in ref_grads.values())
    print(f"max |grad diff| {worst:.2e} (max |grad| {scale:.2e}) over {len(ref_grads)} tensors")
    assert set(ref_grads) <= set(ours) and worst <= 1e-5
    # the MTP term matters: the MTP-only weights have gradients, and without it the embedding's would differ
    assert ref_grads["model.layers.2.eh_proj.weight"].abs().max() > 1e-3


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_convert_tool_round_trips_mtp_layers(tmp_path, capsys, tied):
    """tools/convert_checkpoint.py with an MTP layer in DeepSeek's HF layout (model.layers.{L}.enorm / hnorm /
    eh_proj / shared_head.* / embed_tokens + a full MoE decoder layer): HF -> torch_dist -> HF is bit-identical
    (the torch_dist checkpoint holds Megatron's mtp.layers.0.*); an MTP copy of the embedding that differs from
    the main one is refused (Megatron shares it)."""
    import importlib.util
    from pathlib import Path

    from moerl.checkpoint.hf_io import load_hf_state_dict, save_hf_checkpoint

    spec = importlib.util.spec_from_file_location("convert_checkpoint", Path(__file__).resolve().parents[1]
                                                  / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg, sd = _mtp_reference(seed=8, tied=tied)[:2]
    assert ("lm_head.weight" in sd) != tied and "model.layers.2.eh_proj.weight" in sd
    save_hf_checkpoint(sd, cfg, str(tmp_path / "hf"))
    assert tool.main(["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert tool.main(["mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--config", str(tmp_path / "hf"),
                      "--out", str(tmp_path / "back")]) == 0
    back = load_hf_state_dict(tmp_path / "back")
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    bad = dict(sd, **{"model.layers.2.embed_tokens.weight": sd["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match="shares them"):
        hf_to_megatron(bad, cfg)
    capsys.readouterr()


# ----------------------------------------------------------------------------- the demo (not in CI)
def _load_imbalance(jsonl) -> tuple[float, float, int]:
    """(mean max/mean expert load over the MoE layers and the first 50 RL steps, the same over the last 50,
    number of steps) from a run's moe_telemetry.jsonl, read by tools/inspect_experts.py."""
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.spec_from_file_location("inspect_experts", Path(__file__).resolve().parents[1]
                                                  / "tools" / "inspect_experts.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    data = tool.load_telemetry(jsonl)
    imb, _ = tool.imbalance_and_entropy(data["counts"])
    return float(np.nanmean(imb[:50])), float(np.nanmean(imb[-50:])), len(data["steps"])


@pytest.mark.demo
def test_tiny_deepseek_v3_demo_rl_gain(tmp_path):
    """`moerl train configs/tiny_deepseek_v3.yaml` as shipped (run dir and ports changed): the step-0 check
    passes (trainer and reference servers agree on the sigmoid + bias group-limited routing), RL raises held-out
    greedy accuracy by >= 10 points over the warm start, and the aux-loss-free expert bias lowers the max/mean
    expert load (moe_telemetry.jsonl, first vs last 50 RL steps, mean over the MoE layers)."""
    import json
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    from _mp_helpers import free_port_block

    repo = Path(__file__).resolve().parents[1]
    base = free_port_block(3)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "moerl.cli", "train", str(repo / "configs" / "tiny_deepseek_v3.yaml"),
                        f"output_dir={tmp_path / 'run'}", "rollout.num_servers=2", f"rollout.base_port={base}",
                        f"rollout.router_port={base + 2}"], capture_output=True, text=True, timeout=2400, cwd=repo)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(json.dumps(summary, indent=2))
    print("\n".join(line for line in r.stdout.splitlines() if "EVAL" in line or "step-0" in line.lower()))
    first, last, steps = _load_imbalance(tmp_path / "run" / "moe_telemetry.jsonl")
    print(f"max/mean expert load: first 50 steps {first:.3f}, last 50 {last:.3f} ({steps} steps); "
          f"wall time {time.time() - t0:.0f} s")
    m = re.search(r"EVAL after RL: greedy accuracy [0-9.]+ on (\d+) held-out prompts", r.stdout)
    assert m and int(m.group(1)) >= 200
    assert summary["step0_check"]["logprob_pass"] and summary["step0_check"]["ratio_pass"]
    assert summary["accuracy_after_rl"] - summary["accuracy_after_warm_start"] >= 0.10, summary
    assert steps >= 100 and last < first


def test_sft_step_trains_the_mtp_layers_with_the_weighted_loss(dist):
    """MegatronActor.train_step with moerl's SFT loss on a DeepSeek-V3 with one MTP layer: the reported
    sft_loss and mtp_loss equal the hand-built main and MTP losses, and the global gradient norm (before
    clipping) equals the norm of the hand-built gradient of main + lambda * MTP (lambda = 0.3), not of the main
    loss alone; the log-prob forward (no labels) runs without the MTP block and gives the main head's values."""
    from moerl.train.actor import MegatronActor
    from moerl.train.batching import MicroBatch
    from moerl.train.losses import sft_loss

    lam = 0.3
    cfg, sd, tokens, labels, mask, ref_loss, ref_main, ref_mtp, ref_grads = _mtp_reference(lam=lam)
    ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())).item()
    actor = MegatronActor(cfg, lr=1e-3, moe_aux_loss_coeff=0.0, moe_load_balancing_type="none",
                          config_overrides={"mtp_loss_scaling_factor": lam})
    actor.load_hf_state_dict(sd)
    b = tokens.shape[0]
    mb = MicroBatch(tokens=tokens, labels=labels, loss_mask=mask, advantages=torch.zeros(b),
                    sample_indices=list(range(b)), response_starts=[0] * b, response_lengths=[tokens.shape[1]] * b)
    lp = actor.compute_log_probs([mb], temperature=1.0)[0][1]
    main_from_lp = -(lp * mask).sum() / mask.sum()
    m = actor.train_step([mb], sft_loss(int(mask.sum())), temperature=1.0)
    print(f"\nsft_loss {m['sft_loss']:.6f} (ref {ref_main.item():.6f}), mtp_loss {m['mtp_loss']:.6f} "
          f"(ref {ref_mtp.item():.6f}), grad_norm {m['grad_norm']:.6f} (ref {ref_norm:.6f})")
    assert abs(main_from_lp.item() - ref_main.item()) < 1e-5
    assert abs(m["sft_loss"] - ref_main.item()) < 1e-5 and abs(m["mtp_loss"] - ref_mtp.item()) < 1e-5
    assert abs(m["grad_norm"] - ref_norm) < 1e-5 * ref_norm
    main_only = _mtp_reference(lam=0.0)[-1]  # the main loss alone gives another norm
    main_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in main_only.values())).item()
    assert abs(m["grad_norm"] - main_norm) > 1e-3 * ref_norm, (main_norm, ref_norm)


def test_recipe_with_mtp_layers_and_what_the_servers_get():
    """A tiny_deepseek_v3 recipe with num_nextn_predict_layers=1 loads (MTP trained in SFT); with a critic or
    pp_size 2 it is refused naming the keys. The rollout servers get the weights without the MTP
    layer (model.layers.{L}.*) and a config with num_nextn_predict_layers=0; the HF export keeps them."""
    from pathlib import Path

    from moerl.config.loader import ConfigError, load_config
    from moerl.train.weight_sync import rollout_weights

    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny_deepseek_v3.yaml"
    cfg = load_config(recipe, ["model.hf_config.num_nextn_predict_layers=1"])
    assert cfg.model.hf_config.num_nextn_predict_layers == 1
    for extra in (["algorithm.advantage_estimator=gae", "algorithm.policy_loss=ppo"], ["parallel.pp_size=2"]):
        with pytest.raises(ConfigError, match="num_nextn_predict_layers=1"):
            load_config(recipe, ["model.hf_config.num_nextn_predict_layers=1", *extra])
    hf_cfg, sd = _mtp_reference(seed=4)[:2]
    sent, sent_cfg = rollout_weights(cfg.rollout, sd, hf_cfg)
    assert set(sent) == {k for k in sd if not k.startswith("model.layers.2.")} and len(sent) < len(sd)
    assert sent_cfg.num_nextn_predict_layers == 0 and hf_cfg.num_nextn_predict_layers == 1
    assert all(sent[k] is sd[k] for k in sent)

"""Model-family registry (moerl.models.families) and the Mixtral family (issue #16).

References: transformers' own ``MixtralForCausalLM`` forward on the same weights (logits), transformers'
own ``save_pretrained`` (the on-disk tensor names and bytes a round trip must reproduce), and the
unsharded conversion (for the TP / EP shard round trip).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_convert import batch, hf_logits, megatron_logits, randomize_weights_  # noqa: E402

from moerl.checkpoint.hf_convert import (  # noqa: E402
    ShardLayout,
    fused_experts_to_per_expert,
    hf_to_megatron,
    load_megatron_state_dict,
    megatron_to_hf,
    merge_megatron_shards,
)
from moerl.errors import ModelError  # noqa: E402
from moerl.models.families import get_family, supported_model_types  # noqa: E402
from moerl.models.gpt import build_gpt_model, causal_attention_mask, transformer_config_from_hf  # noqa: E402

ATOL = 1e-4
# tiny Mixtral: expert width 48 != hidden 64 (non-square expert matrices), GQA 4 heads / 2 groups
MIXTRAL = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6)


def random_mixtral(seed=0, **changes):
    """A tiny fp32 transformers Mixtral in eval mode with non-trivial weights everywhere (norms away from 1,
    a router with spread-out logits, so that mapping mistakes change the logits)."""
    from transformers import MixtralForCausalLM

    config = get_family("mixtral").make_hf_config({**MIXTRAL, **changes})
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config).float().eval()
    randomize_weights_(model, seed, router_suffix="block_sparse_moe.gate.weight")
    return model


def saved_state_dict(model, path) -> dict:
    """What transformers' save_pretrained writes (its own in-memory -> on-disk conversion)."""
    from moerl.checkpoint.hf_io import load_hf_state_dict

    model.save_pretrained(str(path))
    return load_hf_state_dict(path)


def test_registry_lists_families_and_refuses_others():
    types = supported_model_types()
    assert {"qwen3_moe", "mixtral"} <= set(types)
    assert get_family("mixtral").name == "Mixtral" and get_family({"model_type": "qwen3_moe"}).name == "Qwen3-MoE"
    for other in ("llama", "gpt2", None):
        with pytest.raises(ModelError) as e:
            get_family(other, key="--hf")
        assert "--hf" in str(e.value) and "mixtral (Mixtral)" in str(e.value) and "qwen3_moe (Qwen3-MoE)" in str(e.value)
    from transformers import LlamaConfig

    with pytest.raises(ModelError, match="'llama' is not supported"):
        build_gpt_model(LlamaConfig())  # before parallel_state is even looked at


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mixtral_logits_match_transformers_and_round_trip_is_exact(dist, tmp_path, tied):
    ref = random_mixtral(tie_word_embeddings=tied)
    cfg = ref.config
    tc = transformer_config_from_hf(cfg)
    assert tc.qk_layernorm is False and tc.moe_router_pre_softmax is False and tc.moe_ffn_hidden_size == 48
    model = build_gpt_model(cfg).eval()
    assert model.share_embeddings_and_output_weights == tied
    assert not any("layernorm" in k and ("q_" in k or "k_" in k) for k in model.state_dict())  # no QK-norm

    load_megatron_state_dict(model, hf_to_megatron(ref.state_dict(), cfg))  # transformers 5 fused in-memory keys
    tokens, pos = batch(cfg.vocab_size)
    ours, theirs = megatron_logits(model, tokens, pos), hf_logits(ref, tokens)
    assert ours.shape == theirs.shape == (*tokens.shape, cfg.vocab_size)
    assert theirs.abs().max() > 1.0
    diff = (ours - theirs).abs().max().item()
    print(f"mixtral {'tied' if tied else 'untied'}: max |logits diff| = {diff:.2e}")
    assert diff <= ATOL

    # Megatron -> HF: exactly transformers' save_pretrained tensors (block_sparse_moe ... w1/w2/w3)
    on_disk = saved_state_dict(ref, tmp_path / "hf")
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in on_disk
    assert tuple(on_disk["model.layers.0.block_sparse_moe.experts.0.w2.weight"].shape) == (64, 48)
    exported = megatron_to_hf(model.state_dict(), cfg)
    assert set(exported) == set(on_disk)
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    assert fused_experts_to_per_expert(ref.state_dict(), cfg).keys() >= set(on_disk)
    # the on-disk names convert to the same Megatron tensors as the fused in-memory ones
    a, b = hf_to_megatron(on_disk, cfg), hf_to_megatron(ref.state_dict(), cfg)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_mixtral_gate_up_order_is_visible(dist):
    """Swapping each expert's w1 (gate) and w3 (up) on disk changes the logits far beyond ATOL: the logit
    test above would catch a gate/up mix-up."""
    ref = random_mixtral()
    cfg = ref.config
    sd = fused_experts_to_per_expert(ref.state_dict(), cfg)
    swapped = {k.replace(".w1.", ".wX.").replace(".w3.", ".w1.").replace(".wX.", ".w3."): v for k, v in sd.items()}
    model = build_gpt_model(cfg).eval()
    load_megatron_state_dict(model, hf_to_megatron(swapped, cfg))
    tokens, pos = batch(cfg.vocab_size)
    assert (megatron_logits(model, tokens, pos) - hf_logits(ref, tokens)).abs().max().item() > 100 * ATOL


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(ep_size=2), dict(tp_size=2, ep_size=2, pp_size=2)],
                         ids=["tp2", "ep2", "tp2-ep2-pp2"])
def test_mixtral_shards_merge_back_bit_for_bit(layout):
    ref = random_mixtral(seed=2)
    cfg = ref.config
    sd = fused_experts_to_per_expert(ref.state_dict(), cfg)
    tp, ep, pp = layout.get("tp_size", 1), layout.get("ep_size", 1), layout.get("pp_size", 1)
    shards = {}
    for t in range(tp):
        for e in range(ep):
            for p in range(pp):
                lay = ShardLayout(tp_size=tp, tp_rank=t, ep_size=ep, ep_rank=e, pp_size=pp, pp_rank=p)
                shards[lay] = hf_to_megatron(sd, cfg, lay)
    some = next(iter(shards.values()))
    if ep > 1:
        assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in some
        assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in some
    back = merge_megatron_shards(shards, cfg)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="num_local_experts=4 is not divisible by ep_size=3"):
        hf_to_megatron(sd, cfg, ShardLayout(ep_size=3, ep_rank=0))


def test_mixtral_config_checks_and_names():
    fam = get_family("mixtral")
    cfg = fam.make_hf_config({**MIXTRAL, "num_experts": 4, "moe_intermediate_size": 48})  # recipe spellings
    assert cfg.num_local_experts == 4 and cfg.intermediate_size == 48 and fam.moe_layer_pattern(cfg) == [1, 1]
    r = fam.router(cfg)
    assert (r.score_function, r.topk, r.normalize_topk, r.expert_bias) == ("softmax", 2, True, False)
    with pytest.raises(ValueError, match="num_experts=8 disagrees with num_local_experts=4"):
        fam.make_hf_config({**MIXTRAL, "num_experts": 8})
    with pytest.raises(ValueError, match="sliding_window=16"):
        fam.make_hf_config({**MIXTRAL, "sliding_window": 16})
    assert fam.make_hf_config({**MIXTRAL, "sliding_window": 64}).sliding_window == 64  # covers every position
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        fam.make_hf_config({**MIXTRAL, "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match="unknown Mixtral config field"):
        fam.make_hf_config({**MIXTRAL, "mlp_only_layers": [0]})
    names = fam.hf_disk_names
    for disk, mem in [("model.layers.3.block_sparse_moe.experts.12.w1.weight", "model.layers.3.mlp.experts.12.gate_proj.weight"),
                      ("model.layers.3.block_sparse_moe.experts.0.w3.weight", "model.layers.3.mlp.experts.0.up_proj.weight"),
                      ("model.layers.0.block_sparse_moe.experts.7.w2.weight", "model.layers.0.mlp.experts.7.down_proj.weight"),
                      ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.gate.weight"),
                      ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight")]:
        assert names.canonical(disk) == mem and names.disk(mem) == disk


def test_convert_tool_round_trips_a_tiny_mixtral(tmp_path, capsys):
    """tools/convert_checkpoint.py (its main, in this process): HF Mixtral -> torch_dist -> HF reproduces every
    tensor of transformers' save_pretrained bit for bit, tied and untied in one go (untied here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", Path(__file__).resolve().parents[1]
                                                  / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ref = random_mixtral(seed=5)
    on_disk = saved_state_dict(ref, tmp_path / "hf")
    assert tool.main(["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert tool.main(["mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--config", str(tmp_path / "hf"),
                      "--out", str(tmp_path / "back")]) == 0
    from moerl.checkpoint.hf_io import load_hf_state_dict

    back = load_hf_state_dict(tmp_path / "back")
    assert set(back) == set(on_disk) and all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    capsys.readouterr()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_planner_shape_of_mixtral_counts_transformers_parameters(tied):
    """moerl's memory planner sizes a Mixtral from its family's shape: total parameters equal transformers'
    model (no q/k norms, expert width intermediate_size), active = all but the unrouted experts."""
    from moerl.parallel.memory_model import ModelShape, total_params

    ref = random_mixtral(tie_word_embeddings=tied)
    counts = total_params(ModelShape.from_hf_config(ref.config))
    assert counts["total"] == sum(p.numel() for p in ref.parameters())
    per_expert = 3 * 64 * 48
    assert counts["active"] == counts["total"] - 2 * (4 - 2) * per_expert  # 2 layers, 4 experts, top-2


def test_reference_server_weight_mapper_loads_mixtral_disk_names(tmp_path):
    """The reference rollout server's weight updates (moerl.rollout.engine_weights.WeightMapper) take Mixtral's
    on-disk names (block_sparse_moe ... w1/w3/w2, what the trainer's gather sends): model B given model A's
    saved tensors computes A's logits exactly; a partial update names the missing on-disk tensors."""
    from moerl.rollout.engine_weights import WeightMapper

    a, b = random_mixtral(seed=1), random_mixtral(seed=2)
    on_disk = saved_state_dict(a, tmp_path / "a")
    tokens, _ = batch(a.config.vocab_size)
    assert not torch.equal(hf_logits(a, tokens), hf_logits(b, tokens))
    mapper = WeightMapper(b)
    partial = {k: v for k, v in on_disk.items() if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"}
    covered = mapper.apply(list(partial.items()))
    assert mapper.missing(covered) == ["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    covered |= mapper.apply(list(on_disk.items()))
    assert mapper.missing(covered) == []
    assert torch.equal(hf_logits(a, tokens), hf_logits(b, tokens))


def test_tiny_mixtral_recipe_builds_the_mixtral_config():
    """configs/tiny_mixtral.yaml: model.hf_config.model_type=mixtral reaches the Mixtral family's make_hf_config
    with the recipe's spellings (num_experts, moe_intermediate_size); another model_type, or dense layers on a
    Mixtral, is a recipe error."""
    from moerl.config import ConfigError, load_config

    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny_mixtral.yaml"
    hf = load_config(recipe).model.hf_config
    fields = dict(hf.family_fields(), vocab_size=320)
    cfg = get_family(hf.model_type).make_hf_config(fields)
    assert type(cfg).__name__ == "MixtralConfig"
    assert (cfg.num_local_experts, cfg.intermediate_size, cfg.num_experts_per_tok, cfg.head_dim) == (8, 128, 2, 32)
    with pytest.raises(ConfigError, match="model.hf_config.model_type 'llama'"):
        load_config(recipe, ["model.hf_config.model_type=llama"])
    with pytest.raises(ConfigError, match="model.hf_config.mlp_only_layers"):
        load_config(recipe, ["model.hf_config.mlp_only_layers=[0]"])
    # the recipe's intermediate_size is a dense width: Mixtral (all MoE) takes the expert width only
    assert get_family("mixtral").make_hf_config(dict(load_config(recipe, ["model.hf_config.intermediate_size=999"])
                                                     .model.hf_config.family_fields(), vocab_size=320)).intermediate_size == 128


def test_r3_replays_the_reference_servers_mixtral_routing(dist):
    """R3 with Mixtral: the reference server's recorder (HFRoutingRecorder on transformers' MixtralTopKRouter,
    ``mlp.gate`` in memory) records exactly the experts Megatron's router picks for the same weights: forcing
    Megatron to them (moerl.moe.routing_replay, r3) leaves its logits at transformers' within ATOL, while
    forcing it to another model's routing moves them far (the replay does force)."""
    from types import SimpleNamespace

    from moerl.moe.routing_replay import HFRoutingRecorder, RoutingReplay

    ref, other = random_mixtral(seed=8), random_mixtral(seed=9)
    cfg = ref.config
    model = build_gpt_model(cfg).eval()
    load_megatron_state_dict(model, hf_to_megatron(ref.state_dict(), cfg))
    b, s = 2, 9
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(13))
    routes = {}
    for name, hf in (("ref", ref), ("other", other)):
        rec = HFRoutingRecorder(hf)
        with torch.no_grad(), rec.recording():
            logits = hf(input_ids=tokens).logits
        routes[name] = rec.collect(b)  # [B, S, L, K]
        rec.remove()
        if name == "ref":
            theirs = logits
    assert routes["ref"].shape == (b, s, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert (routes["ref"] >= 0).all() and not torch.equal(routes["ref"], routes["other"])
    mask, pos = causal_attention_mask(s), torch.arange(s).expand(b, s)
    replay = RoutingReplay(model, "r3")
    forced = {}
    for name, r in routes.items():
        mb = SimpleNamespace(routed_experts=r, tokens=tokens, packed_tokens=None)
        replay.before_forward(mb)
        with torch.no_grad():
            forced[name] = model(tokens, pos, mask)
        replay.after_forward(mb)
    replay.remove()
    assert (forced["ref"] - theirs).abs().max().item() <= ATOL
    assert (forced["other"] - theirs).abs().max().item() > 100 * ATOL

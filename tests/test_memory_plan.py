"""Memory planner (moerl.parallel.memory_plan, `moerl plan`): parameter counts against the built
Megatron model and transformers, published totals of the large recipes, and hand-worked bytes.

Per-rank counts in TP/PP/EP layouts are checked against the built model in
tests/test_parallel_layouts.py (slow, torchrun)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_convert import FIELDS, random_hf_model  # noqa: E402

from moerl.checkpoint.hf_convert import ShardLayout  # noqa: E402
from moerl.config import load_config  # noqa: E402
from moerl.models.qwen3_moe import build_gpt_model, make_hf_config  # noqa: E402
from moerl.parallel.memory_plan import (  # noqa: E402
    GIB,
    ModelShape,
    main,
    plan_from_recipe,
    plan_memory,
    rank_param_counts,
    total_params,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "changes",
    [dict(), dict(tie_word_embeddings=True), dict(num_hidden_layers=4, mlp_only_layers=[1, 3]),
     dict(decoder_sparse_step=2)],
    ids=["untied", "tied", "dense-layers", "sparse-step"],
)
def test_param_counts_equal_built_model_and_transformers(dist, changes):
    cfg = make_hf_config({**FIELDS, **changes})
    model = build_gpt_model(cfg)
    built = sum(p.numel() for p in model.parameters())
    counts = rank_param_counts(cfg, ShardLayout())
    assert counts["total"] == built
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts["expert"] == experts
    hf = random_hf_model(**changes)  # transformers counts a tied embedding once, like the planner's total
    assert total_params(cfg)["total"] == hf.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_recipe_shape_equals_hf_config_shape():
    cfg = load_config(REPO / "configs" / "tiny_arith.yaml", ["model.hf_config.vocab_size=320"])
    fields = cfg.model.hf_config.model_dump()
    assert ModelShape.from_recipe(cfg, 320) == ModelShape.from_hf_config(make_hf_config(fields))


def test_large_recipes_match_published_parameter_counts():
    """Qwen3-30B-A3B: 30.5B total, 3.3B activated (model card); DeepSeek-V3: 671B total, 37B
    activated per token (arXiv 2412.19437, without the 14B multi-token-prediction module)."""
    qwen = plan_from_recipe(load_config(REPO / "configs" / "qwen3_30b_a3b.yaml"), seq_length=4096).model_params
    assert qwen["total"] == pytest.approx(30.5e9, rel=0.005) and qwen["active"] == pytest.approx(3.3e9, rel=0.02)
    ds = plan_from_recipe(load_config(REPO / "configs" / "deepseek_v3_671b.yaml"), seq_length=4096).model_params
    assert ds["total"] == pytest.approx(671e9, rel=0.002) and ds["active"] == pytest.approx(37e9, rel=0.02)


def test_large_recipes_are_shape_only_or_trainable_as_declared():
    ds = load_config(REPO / "configs" / "deepseek_v3_671b.yaml")
    assert ds.layout_dp_size(256) == 16
    assert ds.check_world_size(256) == 16  # a deepseek_v3 family recipe (issue 16): no longer shape-only
    qwen = load_config(REPO / "configs" / "qwen3_30b_a3b.yaml")
    assert qwen.check_world_size(8) == 2


def test_hand_worked_bytes():
    """One dense layer, untied, fp32 vs bf16, replicated vs distributed optimizer, by hand."""
    s = ModelShape(num_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                   vocab_size=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
                   intermediate_size=10, moe_layers=(False, True), tie_word_embeddings=False)
    h, d = 8, 4
    attn = (2 + 2) * d * h + 2 * d * h + h + 2 * d  # qkv, proj, input norm, q/k norms = 208
    dense_layer = attn + h + 3 * h * 10  # + pre-MLP norm + SwiGLU = 456
    moe_dense = attn + h + 4 * h  # + router = 248
    experts = 4 * 3 * h * 6  # 576
    total = 2 * 16 * h + h + dense_layer + moe_dense + experts  # embeddings, final norm
    assert total_params(s) == {"total": total, "active": total - experts // 2, "expert": experts,
                               "dense": total - experts}
    # world 2 = dp 2: weights 2 B, grads 4 B (fp32 reduce), Adam 8 B + master 4 B, sharded by dp 2
    p = plan_memory(s, world_size=2, params_dtype="bfloat16", use_distributed_optimizer=True,
                    seq_length=3, micro_batch_size=1, flash_attention=False)
    st = p.stages[0]
    assert (st.weights, st.grads, st.optimizer) == (2 * total, 4 * total, 12 * total / 2)
    fp32 = plan_memory(s, world_size=2, params_dtype="float32", seq_length=3).stages[0]
    assert (fp32.weights, fp32.optimizer) == (4 * total, 8 * total)
    # activations, elements per token: dense layer: 4H + (q,k,v + qk-norm inputs + attn out) + softmax
    # nh*S + SwiGLU 3F; MoE layer: 4H + router 2E fp32 (= 4E bf16 units) + attention + k (H + 3I)
    attn_acts = (2 + 2) * d + (2 + 1) * d + 2 * d + 2 * 3
    dense_acts = 4 * h + attn_acts + 3 * 10
    moe_acts = 4 * h + 4 * 4 + attn_acts + 2 * (h + 3 * 6)
    logits = 16 * (2 + 8)  # bf16 logits + two fp32 copies, bytes per token
    tokens = 3
    assert st.activations["none"] == pytest.approx(tokens * (2 * (dense_acts + moe_acts) + logits))
    assert st.activations["selective"] == pytest.approx(tokens * (2 * (dense_acts + moe_acts - 2 * 2 * 3) + logits))
    assert st.activations["full"] == pytest.approx(tokens * (2 * (2 * h + max(dense_acts, moe_acts)) + logits))


def test_tensor_and_pipeline_split_the_memory():
    shape = ModelShape.from_hf_config(make_hf_config({**FIELDS, "num_hidden_layers": 4}))
    one = plan_memory(shape, world_size=1, seq_length=64, params_dtype="bfloat16").stages[0]
    tp2 = plan_memory(shape, world_size=2, tp_size=2, seq_length=64, params_dtype="bfloat16").stages[0]
    ep2 = plan_memory(shape, world_size=2, ep_size=2, seq_length=64, params_dtype="bfloat16").stages[0]
    # TP splits every matrix except the replicated norms and router; EP halves only the experts
    assert tp2.params < one.params / 2 + one.params / 10 and tp2.params_expert * 2 == one.params_expert
    assert ep2.params_dense == one.params_dense and ep2.params_expert * 2 == one.params_expert
    # sequence parallelism divides the activations by tp (experts whole: etp 1); with etp = tp every
    # expert rank keeps the gathered tokens' H-wide inputs, so a bit more than half
    tp2e1 = plan_memory(shape, world_size=2, tp_size=2, etp_size=1, seq_length=64, params_dtype="bfloat16").stages[0]
    assert tp2e1.activations["none"] == pytest.approx(one.activations["none"] / 2)
    assert one.activations["none"] / 2 < tp2.activations["none"] < one.activations["none"]
    no_sp = plan_memory(shape, world_size=2, tp_size=2, seq_length=64, sequence_parallel=False).stages[0]
    assert no_sp.activations["none"] > tp2.activations["none"]
    pp = plan_memory(shape, world_size=2, pp_size=2, seq_length=64, num_microbatches=8)
    assert [st.layers for st in pp.stages] == [2, 2] and [st.in_flight for st in pp.stages] == [2, 1]
    assert pp.stages[0].params + pp.stages[1].params == one.params
    assert all(st.activations["full"] < st.activations["selective"] <= st.activations["none"] for st in pp.stages)
    with pytest.raises(ValueError, match="divisible"):
        plan_memory(shape, world_size=3, tp_size=2)


def test_rank_counts_follow_the_layout_rules():
    cfg = make_hf_config({**FIELDS, "num_hidden_layers": 4, "mlp_only_layers": [1], "tie_word_embeddings": True})
    whole = rank_param_counts(cfg, ShardLayout())["total"]
    # pp 2, uneven: the stages add up to the model plus the last stage's copy of the tied embedding
    stages = [rank_param_counts(cfg, ShardLayout(pp_size=2, pp_rank=r, num_layers_in_first_pipeline_stage=1))
              for r in range(2)]
    assert sum(c["total"] for c in stages) == whole + cfg.vocab_size * cfg.hidden_size
    # tp 2 + ep 2 with etp 1 on the same ranks: experts whole but half of them
    c = rank_param_counts(cfg, ShardLayout(tp_size=2, ep_size=2, etp_size=1))
    assert c["expert"] == rank_param_counts(cfg, ShardLayout())["expert"] // 2


def test_cli_plan(capsys):
    assert main([str(REPO / "configs" / "deepseek_v3_671b.yaml"), "--seq-length", "4096"]) == 0
    out = capsys.readouterr().out
    assert "671.03 B parameters" in out and "pp stage 15" in out and "peak:" in out
    assert main([str(REPO / "configs" / "qwen3_30b_a3b.yaml"), "parallel.recompute=none", "--json",
                 "--seq-length", "2048"]) == 0
    d = json.loads(capsys.readouterr().out)["memory"]
    assert d["world_size"] == 8 and d["dp_size"] == 2 and d["expert_dp_size"] == 1 and d["recompute"] == "none"
    st = d["stages"][0]
    assert st["total"]["none"] == pytest.approx(st["weights"] + st["grads"] + st["optimizer"] + st["reference"]
                                                + st["activations"]["none"])
    assert st["reference"] == st["weights"]  # algorithm.reference_policy: a frozen copy of the weights
    assert 20 * GIB < st["total"]["full"] < 141 * GIB  # fits one H200
    # impossible layouts fail with the rule, exit code 2
    assert main([str(REPO / "configs" / "tiny_arith.yaml"), "parallel.tp_size=2", "--world-size", "3"]) == 2
    assert "must be divisible by parallel.tp_size * parallel.pp_size" in capsys.readouterr().err
    from moerl.cli import COMMANDS

    assert COMMANDS["plan"][0]([str(REPO / "configs" / "tiny_arith.yaml"), "hardware.max_prompt_tokens=16"]) == 0
    assert "1.37 M parameters" in capsys.readouterr().out

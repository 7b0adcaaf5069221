"""Qwen3-MoE family (``model_type`` "qwen3_moe"): HF config, Megatron-Core config / layer spec, weight rules.

Moved unchanged from moerl/models/qwen3_moe.py and the Qwen3 parts of moerl/checkpoint/hf_convert.py
(issue #16); the old import paths re-export these names.

* ``make_hf_config(fields)``: a ``transformers.Qwen3MoeConfig`` from recipe fields;
* ``transformer_config_from_hf(hf_config, ...)``: the matching megatron ``TransformerConfig`` (QK RMSNorm
  through the layer spec, ``norm_topk_prob=True <-> moe_router_pre_softmax=False``; see
  moerl.models.families.common);
* ``conversion_rules(hf_config, ...)``: HF <-> Megatron weight rules (names in moerl.checkpoint.hf_convert's
  module docstring): attention with q/k norms, router ``mlp.gate``, experts ``mlp.experts.{e}.{gate,up,down}_proj``,
  dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so;
* ``FAMILY``: the registered :class:`moerl.models.families.ModelFamily`.

Router (transformers Qwen3MoeSparseMoeBlock): softmax over the E router logits, top-k, renormalised to sum 1
iff ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any, Mapping

from moerl.models.families import ModelFamily, ParamRule, RouterFacts, register
from moerl.models.families.common import (
    head_rules,
    attention_rules,
    check_gpt_features,
    dense_mlp_rules,
    embedding_rules,
    expert_rules,
    gpt_block_spec,
    gpt_model_kwargs,
    gpt_transformer_config,
    gqa_planner_shape,
    hf_config_from_fields,
    hf_num_experts,
)

__all__ = [
    "FAMILY",
    "conversion_rules",
    "hf_moe_layer_pattern",
    "make_hf_config",
    "router_facts",
    "transformer_config_from_hf",
]

_REQUIRED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "vocab_size",
)

# Names accepted besides Qwen3MoeConfig's own fields (transformers 4 / 5 spellings).
_ALIASES = {"num_local_experts": "num_experts"}
_EXTRA_FIELDS = {"head_dim", "rope_theta", "torch_dtype", "dtype", "architectures", "model_type"}


def _qwen3_moe_config_cls():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig


def make_hf_config(fields: Mapping[str, Any]):
    """Build a ``transformers.Qwen3MoeConfig`` from recipe fields.

    Args:
        fields: mapping with at least num_hidden_layers, hidden_size, num_attention_heads,
            num_key_value_heads, num_experts (or num_local_experts), num_experts_per_tok,
            moe_intermediate_size, vocab_size; optionally head_dim (default hidden_size //
            num_attention_heads), intermediate_size (dense MLP layers), max_position_embeddings,
            rope_theta (or rope_parameters={"rope_type": "default", "rope_theta": ...}),
            rms_norm_eps, norm_topk_prob, tie_word_embeddings, mlp_only_layers,
            decoder_sparse_step, and any other Qwen3MoeConfig field.

    Returns:
        transformers.Qwen3MoeConfig (transformers 5 stores rope_theta in ``rope_parameters`` and
        num_experts as ``num_local_experts``; read them with ``hf_rope_theta``/``hf_num_experts``).

    Raises:
        TypeError: ``fields`` is not a mapping.
        ValueError: a required field is missing, a field is unknown, two spellings of one field
            disagree, or the sizes are inconsistent (message names the field).
    """
    return hf_config_from_fields(_qwen3_moe_config_cls(), fields, family="Qwen3-MoE", required=_REQUIRED_FIELDS,
                                 aliases=_ALIASES, extra_fields=_EXTRA_FIELDS, experts_field="num_experts",
                                 int_fields=("head_dim", "intermediate_size", "max_position_embeddings"))


def hf_moe_layer_pattern(hf_config) -> list[int]:
    """Per-layer 1 (MoE) / 0 (dense MLP), with transformers' rule: layer i is MoE iff
    i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    n_exp = hf_num_experts(hf_config)
    return [
        int(i not in mlp_only and n_exp > 0 and (i + 1) % step == 0)
        for i in range(hf_config.num_hidden_layers)
    ]


def transformer_config_from_hf(hf_config, **kw: Any):
    """Megatron-Core ``TransformerConfig`` equivalent to a Qwen3-MoE HF config: QK RMSNorm, MoE where
    :func:`hf_moe_layer_pattern` says, expert width ``moe_intermediate_size``, dense width ``intermediate_size``,
    ``norm_topk_prob`` <-> ``moe_router_pre_softmax=False``.

    Args:
        hf_config: transformers Qwen3MoeConfig (or any config with the same fields).
        **kw: keyword arguments of moerl.models.families.common.gpt_transformer_config (moe_aux_loss_coeff,
            moe_router_load_balancing_type, params_dtype, tp_size, pp_size, ep_size, etp_size,
            sequence_parallel, layer_spec, and any TransformerConfig field as an override).

    Returns:
        megatron.core.transformer.TransformerConfig.

    Raises:
        ValueError: a feature this builder does not map (attention bias, sliding window,
            non-silu activation, rope scaling) or a bad params_dtype.
    """
    return gpt_transformer_config(
        hf_config,
        family="Qwen3-MoE",
        qk_layernorm=True,
        pattern=hf_moe_layer_pattern(hf_config),
        num_experts=hf_num_experts(hf_config),
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        ffn_hidden_size=_dense_ffn(hf_config),
        normalize_topk=bool(getattr(hf_config, "norm_topk_prob", False)),
        **kw,
    )


def conversion_rules(hf_config, expert_bias: bool = False, head: str = "lm",
                     layer_spec: str = "local") -> list[ParamRule]:
    """All parameter rules for an unsharded Qwen3-MoE model (tp = ep = pp = 1), in model order.

    ``layer_spec``: "local" (Megatron-Core's local layer spec, the names in moerl.checkpoint.hf_convert's
    docstring) or "transformer_engine" (the TE spec, ``common.TE_NAMES``): the input RMSNorm is fused into
    QKV (``self_attention.linear_qkv.layer_norm_weight``), a dense layer's pre-MLP RMSNorm into fc1
    (``mlp.linear_fc1.layer_norm_weight``), and experts are TEGroupedMLP's
    (``mlp.experts.linear_fc1.weight{e}`` / ``linear_fc2.weight{e}``); MoE layers keep
    ``pre_mlp_layernorm.weight``. The HF names and their order are the same for both.

    ``head="value"``: the output layer is a value model's scalar head (``output_layer.weight`` [1, H],
    ``output_layer.bias`` [1] <-> ``score.weight``, ``score.bias``; replicated, never tied) instead of
    the LM head.

    ``expert_bias`` adds, per MoE layer, Megatron's aux-loss-free routing bias
    ``mlp.router.expert_bias`` [E] (arXiv 2408.15664; a persistent buffer when
    moe_router_enable_expert_bias) <-> HF ``mlp.gate.e_score_correction_bias`` [E] (the name
    DeepSeek-V3's HF checkpoints use for the same bias); replicated over TP, one per layer.

    Raises:
        ValueError: an unknown head or layer_spec.
    """
    from moerl.checkpoint.hf_convert import check_head_and_spec

    te = check_head_and_spec(head, layer_spec) == "transformer_engine"
    num_experts = hf_num_experts(hf_config)
    rules = embedding_rules()
    for l, is_moe in enumerate(hf_moe_layer_pattern(hf_config)):
        rules += attention_rules(l, te, qk_norm=True, is_moe=bool(is_moe))
        if is_moe:
            rules += expert_rules(l, te, num_experts, "mlp.", _EXPERT_NAMES, expert_bias)
        else:
            rules += dense_mlp_rules(l)
    return rules + head_rules(hf_config, head)


_EXPERT_NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def router_facts(hf_config) -> RouterFacts:
    """Qwen3-MoE's router as transformers computes it: softmax, top-k, renormalised iff norm_topk_prob."""
    return RouterFacts("softmax", int(hf_config.num_experts_per_tok), bool(getattr(hf_config, "norm_topk_prob", False)))


def shard_checks(hf_config) -> list:
    """(field, value, size_name) pairs the layout must divide (heads and vocabulary by TP, experts by EP,
    expert width by expert-TP, dense width by TP when there are dense layers)."""
    checks = [
        ("num_key_value_heads", hf_config.num_key_value_heads, "tp_size"),
        ("num_attention_heads", hf_config.num_attention_heads, "tp_size"),
        ("vocab_size", hf_config.vocab_size, "tp_size"),
        ("num_experts", hf_num_experts(hf_config), "ep_size"),
        ("moe_intermediate_size", hf_config.moe_intermediate_size, "etp_size"),
    ]
    if not all(hf_moe_layer_pattern(hf_config)):
        checks.append(("intermediate_size", hf_config.intermediate_size, "tp_size"))
    return checks


def _dense_ffn(hf_config) -> int:
    return getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size


def planner_shape(hf_config) -> dict:
    """moerl.parallel.memory_model.ModelShape fields of a Qwen3-MoE config."""
    return gqa_planner_shape(hf_config, expert_width=hf_config.moe_intermediate_size, dense_width=_dense_ffn(hf_config),
                             pattern=hf_moe_layer_pattern(hf_config), qk_layernorm=True)


FAMILY = register(ModelFamily(
    model_type="qwen3_moe",
    name="Qwen3-MoE",
    hf_config_cls=_qwen3_moe_config_cls,
    make_hf_config=make_hf_config,
    transformer_config_from_hf=transformer_config_from_hf,
    layer_spec=gpt_block_spec,
    conversion_rules=conversion_rules,
    moe_layer_pattern=hf_moe_layer_pattern,
    num_experts=hf_num_experts,
    router=router_facts,
    shard_checks=shard_checks,
    expert_ffn_size=lambda hf_config: int(hf_config.moe_intermediate_size),
    dense_ffn_size=_dense_ffn,
    gpt_model_kwargs=gpt_model_kwargs,
    planner_shape=planner_shape,
    check_hf_config=lambda hf_config: check_gpt_features(hf_config, "Qwen3-MoE"),
    value_head_arch="Qwen3MoeForTokenClassification",
))

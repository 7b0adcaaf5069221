"""Mixtral family (``model_type`` "mixtral"): HF config, Megatron-Core config / layer spec, weight rules.

What Mixtral is, as transformers' ``MixtralForCausalLM`` (5.x, modeling_mixtral.py) computes it: a
Llama-style decoder (RMSNorm, RoPE, grouped-query attention without biases and without QK-norm) whose every
MLP is a sparse MoE block: router ``gate`` (linear, no bias) -> softmax over the E = ``num_local_experts``
logits -> top-k (``num_experts_per_tok``) -> the k weights renormalised to sum 1 (MixtralTopKRouter), experts
SwiGLU ``w2(silu(w1 x) * w3 x)`` of width ``intermediate_size``. No shared experts, no dense layers.

Megatron-Core equivalent (moerl.models.families.common.gpt_transformer_config): ``qk_layernorm=False``,
``num_moe_experts = num_local_experts``, ``moe_ffn_hidden_size = intermediate_size``, softmax router with
``moe_router_pre_softmax=False`` (softmax over the top-k logits == softmax, top-k, renormalise), every layer
MoE, GPT block spec (local or Transformer Engine).

Weights (HF on disk, what ``save_pretrained`` writes and SGLang loads)::

    model.layers.{l}.self_attn.{q,k,v,o}_proj.weight      as Qwen3-MoE (no q/k norms)
    model.layers.{l}.block_sparse_moe.gate.weight         [E, H]  router  <-> decoder.layers.{l}.mlp.router.weight
    model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight [I, H] gate \\  <-> ...local_experts.{e}.linear_fc1
    model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight [I, H] up   /      = [w1; w3]
    model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight [H, I] down     <-> ...local_experts.{e}.linear_fc2

transformers 5 renames these in memory (``mlp.gate``, fused ``mlp.experts.gate_up_proj`` [E, 2I, H] /
``down_proj`` [E, H, I]); ``FAMILY.hf_disk_names`` maps the per-expert names both ways.

Not mapped (``check_hf_config`` raises ValueError naming the field): a ``sliding_window`` shorter than
``max_position_embeddings`` (Mistral-style windowed attention), ``router_jitter_noise`` > 0 (transformers
multiplies the MoE input by uniform noise in training, which Megatron's router jitter does not reproduce),
attention bias, a non-silu activation, RoPE scaling.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from moerl.models.families import ModelFamily, NameMap, ParamRule, RouterFacts, register
from moerl.models.families.common import (
    attention_rules,
    check_gpt_features,
    embedding_rules,
    expert_rules,
    gpt_block_spec,
    gpt_model_kwargs,
    gpt_transformer_config,
    gqa_planner_shape,
    head_rules,
    hf_config_from_fields,
    hf_num_experts,
)

__all__ = [
    "FAMILY",
    "check_hf_config",
    "conversion_rules",
    "make_hf_config",
    "moe_layer_pattern",
    "recipe_fields",
    "router_facts",
    "transformer_config_from_hf",
]

_NAME = "Mixtral"
_REQUIRED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_local_experts",
    "num_experts_per_tok",
    "intermediate_size",
    "vocab_size",
)
# moerl's recipe / Qwen3 spellings accepted for Mixtral's fields
_ALIASES = {"num_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size"}
_EXTRA_FIELDS = {"head_dim", "rope_theta", "torch_dtype", "dtype", "architectures", "model_type"}
_EXPERT_NAMES = ("w1.weight", "w3.weight", "w2.weight")  # gate, up, down


def hf_config_cls():
    """``transformers.MixtralConfig`` (imported lazily)."""
    from transformers import MixtralConfig

    return MixtralConfig


def make_hf_config(fields: Mapping[str, Any]):
    """Build a ``transformers.MixtralConfig`` from recipe fields.

    Args:
        fields: mapping with at least num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
            num_local_experts (or num_experts), num_experts_per_tok, intermediate_size (the expert width; or
            moe_intermediate_size), vocab_size; optionally head_dim (default hidden_size // num_attention_heads),
            max_position_embeddings, rope_theta (or rope_parameters), rms_norm_eps, tie_word_embeddings and any
            other MixtralConfig field.

    Returns:
        transformers.MixtralConfig.

    Raises:
        TypeError: ``fields`` is not a mapping.
        ValueError: a required field is missing, a field is unknown, two spellings of one field disagree, the
            sizes are inconsistent, or a feature the builder does not map (:func:`check_hf_config`).
    """
    cfg = hf_config_from_fields(hf_config_cls(), fields, family=_NAME, required=_REQUIRED_FIELDS, aliases=_ALIASES,
                                extra_fields=_EXTRA_FIELDS, experts_field="num_local_experts",
                                int_fields=("head_dim", "max_position_embeddings"))
    check_hf_config(cfg)
    return cfg


#: recipe ``model.hf_config`` key (Qwen3-MoE naming) -> MixtralConfig field; the recipe's ``intermediate_size``
#: (dense MLP width) does not apply: every Mixtral layer is MoE, of width ``moe_intermediate_size``
RECIPE_KEYS = {"num_hidden_layers": "num_hidden_layers", "hidden_size": "hidden_size",
               "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
               "head_dim": "head_dim", "num_experts": "num_local_experts", "num_experts_per_tok": "num_experts_per_tok",
               "moe_intermediate_size": "intermediate_size", "max_position_embeddings": "max_position_embeddings",
               "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
               "vocab_size": "vocab_size",
               "initializer_range": "initializer_range"}


def recipe_problem(recipe: Mapping[str, Any]) -> Optional[str]:
    """Why a recipe's ``model.hf_config`` (Qwen3-MoE naming, moerl.config.schema.HFModelConfig) cannot be a
    Mixtral, or None: dense layers (``mlp_only_layers``) or ``norm_topk_prob: false`` (Mixtral always
    renormalises its top-k weights)."""
    if recipe.get("mlp_only_layers"):
        return (f"model.hf_config.mlp_only_layers {list(recipe['mlp_only_layers'])}: every Mixtral layer is MoE; "
                "remove mlp_only_layers")
    if recipe.get("norm_topk_prob") is False:
        return "model.hf_config.norm_topk_prob=false: Mixtral always renormalises its top-k weights; remove it"
    return None


def recipe_fields(recipe: Mapping[str, Any]) -> dict:
    """:func:`make_hf_config` fields from a recipe's ``model.hf_config`` dump (:data:`RECIPE_KEYS`; None values
    left to MixtralConfig's defaults).

    Raises:
        ValueError: :func:`recipe_problem`.
    """
    why = recipe_problem(recipe)
    if why:
        raise ValueError(why)
    return {dst: recipe[src] for src, dst in RECIPE_KEYS.items() if recipe.get(src) is not None}


def check_hf_config(hf_config) -> None:
    """Features of a Mixtral config the Megatron builder does not map (see the module docstring).

    Raises:
        ValueError: naming the field and the value that works.
    """
    check_gpt_features(hf_config, _NAME)
    window = getattr(hf_config, "sliding_window", None)
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if window is not None and (max_pos is None or int(window) < int(max_pos)):
        raise ValueError(f"sliding_window={window} (< max_position_embeddings={max_pos}) is not supported: moerl "
                         "builds full causal attention; set sliding_window to null")
    jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise ValueError(f"router_jitter_noise={jitter} is not supported (transformers scales the MoE input by "
                         "uniform noise in training; Megatron's router jitter differs); set it to 0.0")


def moe_layer_pattern(hf_config) -> list[int]:
    """Every Mixtral layer is MoE: ``[1] * num_hidden_layers``."""
    return [1] * int(hf_config.num_hidden_layers)


def transformer_config_from_hf(hf_config, **kw: Any):
    """Megatron-Core ``TransformerConfig`` equivalent to a Mixtral HF config (no QK-norm, all layers MoE,
    expert width ``intermediate_size``, softmax top-k renormalised).

    Args:
        hf_config: transformers MixtralConfig.
        **kw: keyword arguments of moerl.models.families.common.gpt_transformer_config (moe_aux_loss_coeff,
            moe_router_load_balancing_type, params_dtype, tp/pp/ep/etp_size, sequence_parallel, layer_spec,
            TransformerConfig overrides).

    Returns:
        megatron.core.transformer.TransformerConfig.

    Raises:
        ValueError: a feature this builder does not map (:func:`check_hf_config`) or a bad params_dtype.
    """
    check_hf_config(hf_config)
    return gpt_transformer_config(
        hf_config,
        family=_NAME,
        qk_layernorm=False,
        pattern=moe_layer_pattern(hf_config),
        num_experts=hf_num_experts(hf_config),
        moe_ffn_hidden_size=hf_config.intermediate_size,
        ffn_hidden_size=hf_config.intermediate_size,
        normalize_topk=True,
        **kw,
    )


def conversion_rules(hf_config, expert_bias: bool = False, head: str = "lm",
                     layer_spec: str = "local") -> list[ParamRule]:
    """All parameter rules for an unsharded Mixtral model (tp = ep = pp = 1), in model order: embedding,
    per layer input norm, QKV (packed per query group), o_proj, pre-MLP norm, router
    ``block_sparse_moe.gate`` (+ ``e_score_correction_bias`` with ``expert_bias``), per expert
    fc1 = [w1; w3] and fc2 = w2; final norm; ``lm_head`` (absent when tied) or a value head (``head="value"``).
    ``layer_spec`` "transformer_engine" gives the TE spec's names (moerl.checkpoint.hf_convert.TE_NAMES).

    Raises:
        ValueError: an unknown head or layer_spec.
    """
    from moerl.checkpoint.hf_convert import check_head_and_spec

    te = check_head_and_spec(head, layer_spec) == "transformer_engine"
    num_experts = hf_num_experts(hf_config)
    rules = embedding_rules()
    for l in range(hf_config.num_hidden_layers):
        rules += attention_rules(l, te, qk_norm=False, is_moe=True)
        rules += expert_rules(l, te, num_experts, "block_sparse_moe.", _EXPERT_NAMES, expert_bias)
    return rules + head_rules(hf_config, head)


def router_facts(hf_config) -> RouterFacts:
    """Mixtral's router as transformers computes it: softmax, top-k, renormalised."""
    return RouterFacts("softmax", int(hf_config.num_experts_per_tok), True)


def shard_checks(hf_config) -> list:
    """(field, value, size_name): heads and vocabulary by TP, experts by EP, expert width by expert-TP."""
    return [
        ("num_key_value_heads", hf_config.num_key_value_heads, "tp_size"),
        ("num_attention_heads", hf_config.num_attention_heads, "tp_size"),
        ("vocab_size", hf_config.vocab_size, "tp_size"),
        ("num_local_experts", hf_num_experts(hf_config), "ep_size"),
        ("intermediate_size", hf_config.intermediate_size, "etp_size"),
    ]


def planner_shape(hf_config) -> dict:
    """moerl.parallel.memory_model.ModelShape fields of a Mixtral config (every layer MoE, no q/k norms)."""
    return gqa_planner_shape(hf_config, expert_width=hf_config.intermediate_size,
                             dense_width=hf_config.intermediate_size, pattern=moe_layer_pattern(hf_config),
                             qk_layernorm=False)


_E = r"\.(\d+)\."
FAMILY = register(ModelFamily(
    model_type="mixtral",
    name=_NAME,
    hf_config_cls=hf_config_cls,
    make_hf_config=make_hf_config,
    transformer_config_from_hf=transformer_config_from_hf,
    layer_spec=gpt_block_spec,
    conversion_rules=conversion_rules,
    moe_layer_pattern=moe_layer_pattern,
    num_experts=hf_num_experts,
    router=router_facts,
    shard_checks=shard_checks,
    expert_ffn_size=lambda hf_config: int(hf_config.intermediate_size),
    dense_ffn_size=lambda hf_config: int(hf_config.intermediate_size),
    gpt_model_kwargs=gpt_model_kwargs,
    planner_shape=planner_shape,
    hf_disk_names=NameMap(
        to_canonical=(
            (r"\.block_sparse_moe\.experts" + _E + r"w1\.weight$", r".mlp.experts.\1.gate_proj.weight"),
            (r"\.block_sparse_moe\.experts" + _E + r"w3\.weight$", r".mlp.experts.\1.up_proj.weight"),
            (r"\.block_sparse_moe\.experts" + _E + r"w2\.weight$", r".mlp.experts.\1.down_proj.weight"),
            (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        ),
        to_disk=(
            (r"\.mlp\.experts" + _E + r"gate_proj\.weight$", r".block_sparse_moe.experts.\1.w1.weight"),
            (r"\.mlp\.experts" + _E + r"up_proj\.weight$", r".block_sparse_moe.experts.\1.w3.weight"),
            (r"\.mlp\.experts" + _E + r"down_proj\.weight$", r".block_sparse_moe.experts.\1.w2.weight"),
            (r"\.mlp\.gate\.", ".block_sparse_moe.gate."),
        ),
    ),
    check_hf_config=check_hf_config,
    value_head_arch="MixtralForTokenClassification",
))

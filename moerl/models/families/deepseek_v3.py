"""DeepSeek-V3 (HF ``model_type`` "deepseek_v3") as a Megatron-Core GPTModel with multi-latent attention.

One module for the family (like Megatron-Bridge's ``deepseek_v3`` bridge; read for shape, not copied):

* :func:`make_hf_config`: a ``transformers.DeepseekV3Config`` from recipe fields;
* :func:`transformer_config_from_hf`: the equivalent Megatron-Core 0.16 ``MLATransformerConfig``;
* :func:`layer_spec`: the decoder block spec (local spec with MLA on CPU);
* :func:`conversion_rules`: HF <-> Megatron parameter rules (``moerl.checkpoint.hf_convert.ParamRule``)
  with their TP / EP / PP shard facts;
* :func:`moe_layer_pattern`, :func:`num_experts`: the dense/MoE layer pattern and routed experts.

Architecture (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 2.1; transformers'
``modeling_deepseek_v3.py``) and the Megatron-Core fields it maps to:

=======================================  ==================================================================
HF DeepseekV3Config                      Megatron-Core MLATransformerConfig
=======================================  ==================================================================
q_lora_rank, kv_lora_rank                q_lora_rank, kv_lora_rank (q_lora_rank None: one q projection)
qk_nope_head_dim, qk_rope_head_dim       qk_head_dim, qk_pos_emb_head_dim
v_head_dim                               v_head_dim
rope_parameters (default | yarn)         rope_type "rope" | "yarn", rotary_base, rotary_scaling_factor,
                                         original_max_position_embeddings, beta_fast/slow, mscale(_all_dim)
rope_interleave=True                     Megatron's MLA RoPE de-interleaves the rotary dims itself
                                         (rope_utils ``multi_latent_attention`` branch): plain weight copies
n_routed_experts, num_experts_per_tok    num_moe_experts, moe_router_topk
moe_intermediate_size, n_shared_experts  moe_ffn_hidden_size, moe_shared_expert_intermediate_size
                                         = n_shared_experts * moe_intermediate_size
sigmoid scores + e_score_correction_bias moe_router_score_function="sigmoid", moe_router_enable_expert_bias
n_group, topk_group                      moe_router_num_groups, moe_router_group_topk (n_group > 1)
routed_scaling_factor                    moe_router_topk_scaling_factor
norm_topk_prob                           Megatron's sigmoid router always renormalises the top-k gates
                                         (so norm_topk_prob=False is refused unless top-k = 1)
first_k_dense_replace                    moe_layer_freq = [0] * k + [1] * (L - k); ffn_hidden_size =
                                         intermediate_size (dense layers)
rms_norm_eps                             layernorm_epsilon (all RMSNorms incl. q_a / kv_a layernorms)
=======================================  ==================================================================

Group-limited routing: transformers scores each group by the sum of its top-2 biased scores,
Megatron-Core by the sum of its top ``topk // group_topk``; they agree when
``num_experts_per_tok // topk_group == 2`` (DeepSeek-V3: 8 // 4), which :func:`transformer_config_from_hf`
requires when n_group > 1.

Weights (HF on-disk names, what SGLang loads; Megatron local layer spec names)::

    model.layers.{l}.self_attn.q_a_proj.weight           [q_lora, H]      self_attention.linear_q_down_proj.weight
    model.layers.{l}.self_attn.q_a_layernorm.weight      [q_lora]         self_attention.q_layernorm.weight
    model.layers.{l}.self_attn.q_b_proj.weight           [nh*(dn+dr), q_lora]  self_attention.linear_q_up_proj.weight
    model.layers.{l}.self_attn.q_proj.weight             (q_lora_rank None)    self_attention.linear_q_proj.weight
    model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight [kv_lora+dr, H]  self_attention.linear_kv_down_proj.weight
    model.layers.{l}.self_attn.kv_a_layernorm.weight     [kv_lora]        self_attention.kv_layernorm.weight
    model.layers.{l}.self_attn.kv_b_proj.weight          [nh*(dn+dv), kv_lora] self_attention.linear_kv_up_proj.weight
    model.layers.{l}.self_attn.o_proj.weight             [H, nh*dv]       self_attention.linear_proj.weight
    model.layers.{l}.mlp.gate.weight                     [E, H]           mlp.router.weight
    model.layers.{l}.mlp.gate.e_score_correction_bias    [E] fp32         mlp.router.expert_bias
    model.layers.{l}.mlp.experts.{e}.{gate,up}_proj      [I, H]           mlp.experts.local_experts.{e}.linear_fc1 = [gate; up]
    model.layers.{l}.mlp.experts.{e}.down_proj           [H, I]           mlp.experts.local_experts.{e}.linear_fc2
    model.layers.{l}.mlp.shared_experts.{gate,up}_proj   [Is, H]          mlp.shared_experts.linear_fc1 = [gate; up]
    model.layers.{l}.mlp.shared_experts.down_proj        [H, Is]          mlp.shared_experts.linear_fc2
    model.layers.{l}.mlp.{gate,up,down}_proj             (l < first_k_dense_replace)  mlp.linear_fc1 / linear_fc2

The per-head layouts agree (q_b rows per head = [nope, rope]; kv_b rows per head = [k_nope, v];
kv_a rows = [kv latent, k rope]), so every rule is a copy or a [gate; up] concatenation.
Shards: the q/kv down projections (q_a_proj, kv_a_proj_with_mqa) are replicated plain linears (see
:func:`layer_spec`), the q/kv up projections are column-parallel (split by heads on dim 0),
linear_proj is row-parallel (dim 1); norms, router and expert bias are replicated; routed experts
split over EP (and expert-TP), shared experts over TP like a dense MLP.

Multi-token prediction (DeepSeek-V3 report sec. 2.2; ``num_nextn_predict_layers`` = D > 0): Megatron-Core's
``MultiTokenPredictionBlock`` (``mtp_num_layers`` = D, ``mtp_loss_scaling_factor`` = lambda; built by
:func:`gpt_model_kwargs` through ``get_gpt_mtp_block_spec`` from the last decoder layer's spec, which must be
an MoE layer as DeepSeek's MTP layer is). MTP layer d (0-based) is HF layer ``L + d`` (L = num_hidden_layers)
in DeepSeek's checkpoint layout, which transformers' DeepseekV3 forward ignores (export adds them, import
reads them)::

    model.layers.{L+d}.enorm.weight              [H]        mtp.layers.{d}.enorm.weight
    model.layers.{L+d}.hnorm.weight              [H]        mtp.layers.{d}.hnorm.weight
    model.layers.{L+d}.eh_proj.weight            [H, 2H]    mtp.layers.{d}.eh_proj.weight (input [enorm(emb); hnorm(h)])
    model.layers.{L+d}.shared_head.norm.weight   [H]        mtp.layers.{d}.final_layernorm.weight
    model.layers.{L+d}.embed_tokens.weight       [V, H]     = embedding.word_embeddings.weight (shared)
    model.layers.{L+d}.shared_head.head.weight   [V, H]     = output_layer.weight (or the embedding when tied)
    model.layers.{L+d}.{self_attn,mlp,...}.*                mtp.layers.{d}.transformer_layer.* (as a decoder layer)

Megatron-Core shares the embedding and the output head with the main model, so the two per-layer copies
are written from them and, on import, must equal them (else refused). The MTP layers need pp_size = 1 here.
Megatron-Core's MTP loss needs ``labels`` in the forward (GPTModel adds lambda / D * its masked token-mean
cross entropy to the gradient through ``MTPLossAutoScaler``): moerl's SFT step passes them
(moerl.train.actor, a loss marked ``trains_mtp``), every other forward (log-probs, RL updates) runs with the
MTP block off; the rollout servers get the weights without the MTP layers (:func:`without_mtp`), the HF
exports keep them.

The Transformer Engine layer spec (MLA's fused TELayerNormColumnParallelLinear up projections) is not
built by this module yet: a TE spec is refused with a clear error.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from moerl.models.families import ModelFamily, ParamRule, RouterFacts, register
from moerl.models.families.common import LAYER_SPECS, hf_config_from_fields, register_packer, shared_moe_fields

__all__ = [
    "FAMILY",
    "MODEL_TYPE",
    "DISPLAY_NAME",
    "check_hf_config",
    "conversion_rules",
    "mla_core_attention_class",
    "mtp_hf_shapes",
    "mtp_layers",
    "planner_shape",
    "router_facts",
    "shard_checks",
    "hf_config_cls",
    "layer_spec",
    "make_hf_config",
    "moe_layer_pattern",
    "num_experts",
    "rope_settings",
    "transformer_config_from_hf",
    "without_mtp",
]

MODEL_TYPE = "deepseek_v3"
DISPLAY_NAME = "DeepSeek-V3"

_REQUIRED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vocab_size",
)
_ALIASES = {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts",
            "num_nextn_predict_layers": "num_mtp_layers"}  # transformers 5 field: num_mtp_layers
_EXTRA_FIELDS = {"rope_theta", "head_dim", "torch_dtype", "dtype", "architectures", "model_type"}  # besides the class fields


def hf_config_cls():
    """``transformers.DeepseekV3Config`` (imported lazily; transformers >= 4.51 has it)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config


def make_hf_config(fields: Mapping[str, Any]):
    """Build a ``transformers.DeepseekV3Config`` from recipe fields (``model.hf_config``).

    Args:
        fields: at least num_hidden_layers, hidden_size, num_attention_heads, n_routed_experts (or
            num_local_experts / num_experts), num_experts_per_tok, moe_intermediate_size,
            intermediate_size (dense layers), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
            v_head_dim, vocab_size; optionally q_lora_rank (None = one q projection),
            n_shared_experts, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
            first_k_dense_replace, rope_theta or rope_parameters, rms_norm_eps,
            max_position_embeddings, tie_word_embeddings, num_nextn_predict_layers and any other
            DeepseekV3Config field. num_key_value_heads defaults to num_attention_heads (MLA has
            no GQA).

    Returns:
        transformers.DeepseekV3Config.

    Raises:
        TypeError: ``fields`` is not a mapping.
        ValueError: a missing / unknown field, two spellings disagreeing, a size < 1, or
            inconsistent group sizes (each message names the ``model.hf_config.*`` key).
    """
    if not isinstance(fields, Mapping):
        raise TypeError(f"make_hf_config expects a mapping of config fields, got {type(fields).__name__}")
    kw = dict(fields)
    # MLA has no GQA: one KV "head" per query head; head_dim is transformers' qk_rope_head_dim
    if "num_attention_heads" in kw:
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    if "qk_rope_head_dim" in kw:  # transformers' rotary embedding is sized by head_dim
        if kw.setdefault("head_dim", kw["qk_rope_head_dim"]) != kw["qk_rope_head_dim"]:
            raise ValueError(f"model.hf_config.head_dim={kw['head_dim']} must equal qk_rope_head_dim="
                             f"{kw['qk_rope_head_dim']} for DeepSeek-V3 (or be left out)")
    for name in ("n_group", "topk_group"):
        kw.setdefault(name, 1)
    kw.setdefault("first_k_dense_replace", 0)
    if "num_nextn_predict_layers" not in kw:  # transformers' default is 1 MTP layer; a recipe asks for them
        kw.setdefault("num_mtp_layers", 0)
    cfg = hf_config_from_fields(hf_config_cls(), kw, family="DeepSeek-V3", required=_REQUIRED_FIELDS,
                                aliases=_ALIASES, extra_fields=_EXTRA_FIELDS, experts_field="n_routed_experts",
                                int_fields=("q_lora_rank", "n_shared_experts", "n_group", "topk_group",
                                            "max_position_embeddings"))
    if cfg.n_routed_experts % cfg.n_group:
        raise ValueError(f"model.hf_config.n_routed_experts={cfg.n_routed_experts} is not divisible by "
                         f"n_group={cfg.n_group}")
    if cfg.topk_group > cfg.n_group:
        raise ValueError(f"model.hf_config.topk_group={cfg.topk_group} exceeds n_group={cfg.n_group}")
    d = cfg.num_mtp_layers
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
        raise ValueError(f"model.hf_config.num_nextn_predict_layers must be an int >= 0, got {d!r}")
    k = cfg.first_k_dense_replace
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= cfg.num_hidden_layers:
        raise ValueError(f"model.hf_config.first_k_dense_replace must be an int in [0, num_hidden_layers], got {k!r}")
    return cfg


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer (``n_routed_experts``; shared experts not counted)."""
    return int(hf_config.n_routed_experts)


def moe_layer_pattern(hf_config) -> list[int]:
    """Per layer 1 (MoE) / 0 (dense MLP): transformers' rule ``layer_idx >= first_k_dense_replace``."""
    k = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    return [int(i >= k) for i in range(hf_config.num_hidden_layers)]


def mtp_layers(hf_config) -> int:
    """Multi-token prediction depth D (HF ``num_nextn_predict_layers``, transformers 5 ``num_mtp_layers``; 0 = none)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def mtp_hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """On-disk HF tensor name -> shape of the MTP layers (DeepSeek's layout, module docstring), which
    transformers' DeepseekV3ForCausalLM does not hold: each is a decoder layer ``L + d`` (shapes from
    transformers' model with L + D layers, built on the meta device) plus enorm / hnorm / shared_head.norm
    [H], eh_proj [H, 2H], embed_tokens and shared_head.head [V, H]. Empty without MTP layers."""
    depth = mtp_layers(hf_config)
    if not depth:
        return {}
    import copy

    from transformers import AutoModelForCausalLM

    from moerl.checkpoint.hf_convert import fused_experts_to_per_expert

    L, H, V = int(hf_config.num_hidden_layers), int(hf_config.hidden_size), int(hf_config.vocab_size)
    longer = copy.deepcopy(hf_config)
    longer.num_hidden_layers, longer.num_nextn_predict_layers = L + depth, 0
    with torch.device("meta"):
        sd = AutoModelForCausalLM.from_config(longer).state_dict()
    layers = tuple(f"model.layers.{L + d}." for d in range(depth))
    out = {k: tuple(v.shape) for k, v in fused_experts_to_per_expert(sd, longer).items() if k.startswith(layers)}
    for prefix in layers:
        out.update({prefix + "enorm.weight": (H,), prefix + "hnorm.weight": (H,), prefix + "eh_proj.weight": (H, 2 * H),
                    prefix + "shared_head.norm.weight": (H,), prefix + "embed_tokens.weight": (V, H),
                    prefix + "shared_head.head.weight": (V, H)})
    return out


def without_mtp(hf_state_dict: Mapping[str, Any], hf_config):
    """``(state dict, config)`` without the MTP layers: what the rollout servers get (they run the main model;
    transformers' DeepseekV3 has no MTP parameters). Tensors of HF layers >= num_hidden_layers are dropped and
    the config is a copy with num_nextn_predict_layers = 0; both are returned as given without MTP layers."""
    if not mtp_layers(hf_config):
        return hf_state_dict, hf_config
    import copy

    L = int(hf_config.num_hidden_layers)

    def is_mtp(key: str) -> bool:
        parts = key.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= L

    config = copy.deepcopy(hf_config)
    config.num_nextn_predict_layers = 0
    return {k: v for k, v in hf_state_dict.items() if not is_mtp(k)}, config


def rope_settings(hf_config) -> dict[str, Any]:
    """MLATransformerConfig RoPE fields for ``hf_config.rope_parameters`` (or transformers 4's
    ``rope_theta`` / ``rope_scaling``).

    "default" -> ``rope_type="rope"`` (with rotary_scaling_factor=1 and mscale_all_dim=0, so
    Megatron's softmax scale is 1/sqrt(qk_head_dim + qk_rope_head_dim), as transformers');
    "yarn" -> ``rope_type="yarn"`` with factor, original_max_position_embeddings, beta_fast,
    beta_slow, mscale, mscale_all_dim (YaRN, arXiv 2309.00071; DeepSeek-V2/V3's mscale: both
    libraries scale cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the
    softmax by mscale(factor, mscale_all_dim)^2).

    Raises:
        ValueError: another rope type, or rope_interleave=False (naming model.hf_config.*).
    """
    if not getattr(hf_config, "rope_interleave", True):
        raise ValueError("model.hf_config.rope_interleave=false is not supported: Megatron-Core's MLA de-interleaves "
                         "the rotary dims (DeepSeek's layout); use rope_interleave=true")
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("model.hf_config has no rope_theta (rope_parameters['rope_theta'])")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return dict(rope_type="rope", rotary_base=float(theta), rotary_scaling_factor=1.0, mscale=1.0,
                    mscale_all_dim=0.0)
    if rope_type == "yarn":
        return dict(
            rope_type="yarn",
            rotary_base=float(theta),
            rotary_scaling_factor=float(params["factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                                 or hf_config.max_position_embeddings),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 1.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    raise ValueError(f"model.hf_config.rope_parameters.rope_type={rope_type!r} is not supported for DeepSeek-V3; "
                     "use 'default' or 'yarn'")


def transformer_config_from_hf(
    hf_config,
    *,
    moe_aux_loss_coeff: float = 0.0,
    moe_router_load_balancing_type: str = "none",
    params_dtype: torch.dtype = torch.float32,
    tp_size: Optional[int] = None,
    pp_size: Optional[int] = None,
    ep_size: Optional[int] = None,
    etp_size: Optional[int] = None,
    sequence_parallel: Optional[bool] = None,
    layer_spec: str = "local",
    **overrides: Any,
):
    """Megatron-Core ``MLATransformerConfig`` equivalent to a DeepSeek-V3 HF config (table above).

    Args:
        hf_config: transformers DeepseekV3Config.
        moe_aux_loss_coeff, moe_router_load_balancing_type: Megatron's balancing loss; DeepSeek-V3
            balances with the expert bias instead (default "none" / 0).
        params_dtype: torch.float32 | bfloat16 | float16.
        tp_size, pp_size, ep_size, etp_size: parallel sizes; None reads Megatron parallel_state
            (1 when not initialised); etp defaults to tp.
        sequence_parallel: None = on iff tp_size > 1 (Megatron needs it for MoE with TP).
        layer_spec: "local" | "auto" (both build the local spec here) | "transformer_engine"
            (refused: not built for MLA by moerl yet).
        **overrides: any MLATransformerConfig field, applied last (e.g.
            moe_router_bias_update_rate, moe_token_dispatcher_type, recompute_granularity).

    The router always carries the expert bias (``moe_router_enable_expert_bias=True``, HF's
    e_score_correction_bias; Megatron updates it in finalize_model_grads by
    ``moe_router_bias_update_rate``, arXiv 2408.15664) and computes in fp32 like transformers'.

    Returns:
        megatron.core.transformer.transformer_config.MLATransformerConfig.

    Raises:
        ValueError: attention_bias, non-silu activation, norm_topk_prob=False with top-k > 1, a
            group split transformers and Megatron score differently (num_experts_per_tok //
            topk_group != 2), an unsupported rope type, a TE layer spec, a bad params_dtype, or a
            router override (recipe ``moe.score_function`` / ``expert_bias`` / ``num_groups`` /
            ``group_topk`` / ``topk_scaling_factor``) that contradicts the HF config.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    check_hf_config(hf_config)
    n_group, topk_group = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
    spec = overrides.pop("transformer_impl", None) or layer_spec
    if spec not in LAYER_SPECS:
        raise ValueError(f"model.layer_spec must be one of {list(LAYER_SPECS)}, got {spec!r}")
    if spec == "transformer_engine":
        raise ValueError("model.layer_spec=transformer_engine is not built for DeepSeek-V3 (MLA) by moerl yet; "
                         "set model.layer_spec=local (or auto, which builds the local spec for this family)")
    pattern = moe_layer_pattern(hf_config)
    kwargs: dict[str, Any] = dict(
        ffn_hidden_size=hf_config.intermediate_size,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        **rope_settings(hf_config),
        rotary_percent=1.0,
        qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm through the layer spec
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(int(hf_config.n_shared_experts) * hf_config.moe_intermediate_size
                                             if hf_config.n_shared_experts else None),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        moe_router_topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        moe_router_dtype="fp32",
        transformer_impl="local",
        **shared_moe_fields(hf_config, pattern=pattern, num_experts=num_experts(hf_config),
                            moe_aux_loss_coeff=moe_aux_loss_coeff,
                            moe_router_load_balancing_type=moe_router_load_balancing_type, params_dtype=params_dtype,
                            tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, etp_size=etp_size,
                            sequence_parallel=sequence_parallel),
    )
    depth = mtp_layers(hf_config)
    if depth:
        if (pp_size or kwargs.get("pipeline_model_parallel_size") or 1) > 1:
            raise ValueError(f"model.hf_config.num_nextn_predict_layers={depth}: moerl builds DeepSeek-V3's MTP "
                             "layers with parallel.pp_size=1 only; set parallel.pp_size=1 or num_nextn_predict_layers=0")
        if not pattern[-1]:
            raise ValueError(f"model.hf_config.num_nextn_predict_layers={depth} needs an MoE last decoder layer "
                             "(DeepSeek's MTP layer is an MoE layer; Megatron-Core copies the last layer's spec): "
                             "set first_k_dense_replace < num_hidden_layers")
        kwargs["mtp_num_layers"] = depth
        kwargs["mtp_loss_scaling_factor"] = 0.1  # Megatron-Core's default lambda; overridable
    _check_router_overrides(kwargs, overrides)
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


#: Megatron router fields fixed by the HF config, and the recipe keys that set them (moerl.moe.config)
_ROUTER_KEYS = (
    ("moe_router_score_function", "moe.score_function"),
    ("moe_router_enable_expert_bias", "moe.expert_bias"),
    ("moe_router_num_groups", "moe.num_groups"),
    ("moe_router_group_topk", "moe.group_topk"),
    ("moe_router_topk_scaling_factor", "moe.topk_scaling_factor"),
)


def _check_router_overrides(fields: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """The router is the HF config's (transformers computes it at rollout): an override (from the recipe's
    ``moe.*`` keys, moerl.moe.config.moe_transformer_overrides) that contradicts it is refused, naming
    the recipe key and the value to set."""
    bad = [f"{key}={overrides[name]!r} (set {key}: {fields[name]!r})" for name, key in _ROUTER_KEYS
           if name in overrides and overrides[name] != fields[name]]
    if bad:
        raise ValueError("DeepSeek-V3's router is fixed by model.hf_config (sigmoid scores, e_score_correction_bias, "
                         "n_group / topk_group, routed_scaling_factor) and the rollout engine runs it as is; these "
                         "recipe keys contradict it: " + "; ".join(bad))


_MLA_CORE_ATTENTION = None


def mla_core_attention_class():
    """The local (CPU) core attention for MLA (built once, lazily: it subclasses a Megatron module).

    :class:`moerl.models.packed_attention.PackedDotProductAttention` (Megatron-Core's local
    ``DotProductAttention`` plus packed THD input) taking MLA's ``k_channels`` / ``v_channels``.
    Megatron-Core 0.16.1's ``DotProductAttention`` has no such arguments (``MultiLatentAttention``
    passes them: "unexpected keyword argument 'k_channels'", the "MLA with the local spec" failure
    of CPU_MEGATRON.md) and sizes its output as ``kv_channels * heads``. Its arithmetic needs only
    the output width changed: query / key ``[s, b, np, dn + dr]``, value ``[s, b, np, dv]`` ->
    context ``[s, b, np * dv]`` (or ``[T, np * dv]`` packed); the softmax scale is the one MLA
    passes (1/sqrt(dn + dr), times YaRN's mscale^2).
    """
    global _MLA_CORE_ATTENTION
    if _MLA_CORE_ATTENTION is not None:
        return _MLA_CORE_ATTENTION
    from moerl.models.packed_attention import PackedDotProductAttention

    class MLACoreAttention(PackedDotProductAttention):
        __doc__ = mla_core_attention_class.__doc__

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                     pg_collection=None):
            super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                             attention_type=attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            if k_channels is not None and softmax_scale is None:
                self.softmax_scale = 1.0 / float(k_channels) ** 0.5
            if v_channels is not None:
                self.hidden_size_per_attention_head = v_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    _MLA_CORE_ATTENTION = MLACoreAttention
    return MLACoreAttention


def layer_spec(hf_config, transformer_config, layer_spec_kind: str = "local", vp_stage: Optional[int] = None):
    """The decoder block spec of this pipeline stage: Megatron-Core's local GPT spec with multi-latent
    attention (``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``, which reads
    ``multi_latent_attention``, ``qk_layernorm`` and ``moe_layer_freq`` from the config: MLASelfAttention
    with RMSNorm q/kv latent norms, column-parallel up projections, dense SwiGLU MLPs in the first
    ``first_k_dense_replace`` layers, MoE layers with SequentialMLP experts and a SharedExpertMLP),
    core attention :func:`mla_core_attention_class`, and the q/kv down projections replicated over TP
    (Megatron-Core's ``post_training.modelopt.layers.Linear``, a torch Linear whose weight gradient
    finalize_model_grads all-reduces over TP under sequence parallelism; initialised by torch's default
    Linear init, not ``init_method``): with the local spec's ColumnParallelLinear there, Megatron-Core
    0.16.1's backward of the gathered latent gave a wrong kv_a_proj_with_mqa gradient at TP = 2.

    Args:
        hf_config: DeepseekV3Config (unused beyond the config's fields; kept for the registry's shape).
        transformer_config: from :func:`transformer_config_from_hf`.
        layer_spec_kind: "local" (or "auto", which is local for this family).
        vp_stage: virtual pipeline stage or None.

    Raises:
        ValueError: layer_spec_kind "transformer_engine" (not built for MLA yet; names model.layer_spec).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if layer_spec_kind not in ("local", "auto"):
        raise ValueError(f"model.layer_spec={layer_spec_kind!r}: moerl builds DeepSeek-V3 (MLA) with the local layer "
                         "spec only; set model.layer_spec=local")
    block = get_gpt_decoder_block_spec(transformer_config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    from megatron.core.post_training.modelopt.layers import Linear

    core = mla_core_attention_class()
    for spec in block.layer_specs:
        sub = spec.submodules.self_attention.submodules
        if sub.core_attention is DotProductAttention:
            sub.core_attention = core
        # replicated down projections (what the TE spec's duplicated TELinear does): with the local spec's
        # ColumnParallelLinear, Megatron-Core 0.16.1 gathers the latent and keeps k_pos_emb whole, and the
        # backward of that gather takes each rank's slice of a gradient that holds only its own heads'
        # part: kv_a_proj_with_mqa's gradient came out wrong at TP=2 (0.2 % off in the grad norm)
        sub.linear_q_down_proj = Linear
        sub.linear_kv_down_proj = Linear
    return block


def conversion_rules(hf_config, expert_bias: bool = True, head: str = "lm",
                     layer_spec: str = "local") -> list:
    """All parameter rules of an unsharded DeepSeek-V3 model (tp = ep = pp = 1), in model order.

    Args:
        hf_config: DeepseekV3Config.
        expert_bias: include ``mlp.router.expert_bias`` <-> ``mlp.gate.e_score_correction_bias``
            per MoE layer. DeepSeek-V3's router always has it, so the rules include it whatever is
            passed (the argument is kept for the registry's common signature).
        head: "lm" (``lm_head.weight``, absent when tied) | "value" (``score.weight`` [1, H] and
            ``score.bias`` [1], a critic's scalar head, replicated, never tied).
        layer_spec: "local" only (the names in the module docstring).

    Returns:
        list of ``moerl.checkpoint.hf_convert.ParamRule`` (kinds "copy", "gate_up" and, with MTP layers,
        "shared": the embedding / lm_head with their MTP copies, see the module docstring; ``tp_dim``
        0 for column-parallel tensors, 1 for row-parallel, None for replicated (incl. MLA's down
        projections); ``layer`` / ``expert`` the global indices).

    Raises:
        ValueError: an unknown head, a layer spec other than "local", or a value head with MTP layers.
    """
    del expert_bias  # always present for this family
    if head not in ("lm", "value"):
        raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    if layer_spec != "local":
        raise ValueError(f"layer_spec={layer_spec!r}: DeepSeek-V3 (MLA) has local-spec names only; use 'local'")
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    L, depth = int(hf_config.num_hidden_layers), mtp_layers(hf_config)
    if depth and head != "lm":
        raise ValueError(f"model.hf_config.num_nextn_predict_layers={depth}: a value head (critic) of a model with "
                         "MTP layers is not built; set num_nextn_predict_layers=0 for the critic")
    mtp_embeds = tuple(f"model.layers.{L + d}.embed_tokens.weight" for d in range(depth))
    mtp_heads = tuple(f"model.layers.{L + d}.shared_head.head.weight" for d in range(depth))
    embed_keys = ("model.embed_tokens.weight",) + mtp_embeds + (mtp_heads if tied and head == "lm" else ())
    rules = [ParamRule("embedding.word_embeddings.weight", embed_keys, "copy" if len(embed_keys) == 1 else "shared",
                       tp_dim=0)]

    def copy(mc: str, hf: str, layer: int, tp_dim: Optional[int] = None, expert: Optional[int] = None):
        rules.append(ParamRule(mc, (hf,), "copy", tp_dim=tp_dim, layer=layer, expert=expert))

    def swiglu(mc: str, hf: str, layer: int, expert: Optional[int] = None):
        rules.append(ParamRule(mc + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                               "gate_up", tp_dim=0, layer=layer, expert=expert))
        copy(mc + "linear_fc2.weight", hf + "down_proj.weight", layer, tp_dim=1, expert=expert)

    def decoder_layer(hf: str, mc: str, l: Optional[int], is_moe: bool):
        ha, ma = hf + "self_attn.", mc + "self_attention."
        copy(mc + "input_layernorm.weight", hf + "input_layernorm.weight", l)
        if hf_config.q_lora_rank is None:
            copy(ma + "linear_q_proj.weight", ha + "q_proj.weight", l, tp_dim=0)
        else:
            copy(ma + "linear_q_down_proj.weight", ha + "q_a_proj.weight", l)
            copy(ma + "linear_q_up_proj.weight", ha + "q_b_proj.weight", l, tp_dim=0)
            copy(ma + "q_layernorm.weight", ha + "q_a_layernorm.weight", l)
        copy(ma + "linear_kv_down_proj.weight", ha + "kv_a_proj_with_mqa.weight", l)
        copy(ma + "linear_kv_up_proj.weight", ha + "kv_b_proj.weight", l, tp_dim=0)
        copy(ma + "kv_layernorm.weight", ha + "kv_a_layernorm.weight", l)
        copy(ma + "linear_proj.weight", ha + "o_proj.weight", l, tp_dim=1)
        copy(mc + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", l)
        if not is_moe:
            swiglu(mc + "mlp.", hf + "mlp.", l)
            return
        copy(mc + "mlp.router.weight", hf + "mlp.gate.weight", l)
        copy(mc + "mlp.router.expert_bias", hf + "mlp.gate.e_score_correction_bias", l)
        for e in range(num_experts(hf_config)):
            swiglu(mc + f"mlp.experts.local_experts.{e}.", hf + f"mlp.experts.{e}.", l, expert=e)
        if hf_config.n_shared_experts:
            swiglu(mc + "mlp.shared_experts.", hf + "mlp.shared_experts.", l)

    for l, is_moe in enumerate(moe_layer_pattern(hf_config)):
        decoder_layer(f"model.layers.{l}.", f"decoder.layers.{l}.", l, is_moe)
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    for d in range(depth):  # MTP layers (pp = 1 only, so no layer index: every stage-0 shard holds them)
        hf, mc = f"model.layers.{L + d}.", f"mtp.layers.{d}."
        for mc_name, hf_name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_layernorm", "shared_head.norm")):
            copy(mc + mc_name + ".weight", hf + hf_name + ".weight", None)
        copy(mc + "eh_proj.weight", hf + "eh_proj.weight", None, tp_dim=0)
        decoder_layer(hf, mc + "transformer_layer.", None, True)
    if head == "value":
        rules += [ParamRule("output_layer.weight", ("score.weight",), "copy"),
                  ParamRule("output_layer.bias", ("score.bias",), "copy")]
    elif not tied:
        keys = ("lm_head.weight",) + mtp_heads
        rules.append(ParamRule("output_layer.weight", keys, "copy" if len(keys) == 1 else "shared", tp_dim=0))
    return rules


def _shared_to_mcore(tensors, hf_config):
    """Packer "shared": one Megatron tensor stored under several HF keys (the embedding / head and their MTP
    copies); the copies must be equal (Megatron-Core's MTP shares them)."""
    for t in tensors[1:]:
        if not torch.equal(t, tensors[0]):
            raise ValueError("DeepSeek-V3 MTP layer's embed_tokens / shared_head.head differ from the main model's "
                             "embed_tokens / lm_head; Megatron-Core's MTP shares them (num_nextn_predict_layers)")
    return tensors[0]


def _shared_to_hf(tensor, hf_config):
    """Inverse of :func:`_shared_to_mcore`: the embedding (plus each MTP layer's embed_tokens, plus its
    shared_head.head when tied) or the untied lm_head (plus each MTP layer's shared_head.head)."""
    depth = mtp_layers(hf_config)
    return [tensor] * (1 + depth + (depth if bool(getattr(hf_config, "tie_word_embeddings", False)) else 0))


register_packer("shared", _shared_to_mcore, _shared_to_hf)


def router_facts(hf_config) -> RouterFacts:
    """DeepSeek-V3's router as transformers' ``DeepseekV3TopkRouter`` computes it (the rollout reference):
    sigmoid scores, ``e_score_correction_bias`` added for the choice only, group-limited top-k (n_group,
    topk_group; None when n_group = 1), gates renormalised iff norm_topk_prob and scaled by
    routed_scaling_factor. Megatron-Core computes the same router (:func:`transformer_config_from_hf`)."""
    n_group = int(hf_config.n_group or 1)
    return RouterFacts(
        score_function="sigmoid",
        topk=int(hf_config.num_experts_per_tok),
        normalize_topk=bool(getattr(hf_config, "norm_topk_prob", True)),
        expert_bias=True,
        num_groups=n_group if n_group > 1 else None,
        group_topk=int(hf_config.topk_group) if n_group > 1 else None,
        scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        reference_implements=True,
    )


def shard_checks(hf_config) -> list:
    """(field, value, size_name) pairs a layout must divide: heads, vocabulary and the dense / shared-expert
    widths by TP; routed experts by EP; the expert width by expert-TP."""
    checks = [
        ("num_attention_heads", hf_config.num_attention_heads, "tp_size"),
        ("vocab_size", hf_config.vocab_size, "tp_size"),
        ("n_routed_experts", num_experts(hf_config), "ep_size"),
        ("moe_intermediate_size", hf_config.moe_intermediate_size, "etp_size"),
    ]
    if hf_config.n_shared_experts:
        checks.append(("n_shared_experts * moe_intermediate_size",
                       hf_config.n_shared_experts * hf_config.moe_intermediate_size, "tp_size"))
    if not all(moe_layer_pattern(hf_config)):
        checks.append(("intermediate_size", hf_config.intermediate_size, "tp_size"))
    return checks


def check_hf_config(hf_config) -> None:
    """Refuse, before any model is built, DeepSeek-V3 features this family does not map (each message names
    the ``model.hf_config`` key): attention bias, non-silu activation, rope types other than default / yarn,
    rope_interleave=false, norm_topk_prob=false with top-k > 1, a group split scored differently by
    transformers and Megatron-Core (see the module docstring).

    Raises:
        ValueError.
    """
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("model.hf_config.attention_bias=true is not supported (DeepSeek-V3 has no attention bias)")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model.hf_config.hidden_act={act!r} is not supported; DeepSeek-V3 uses 'silu' (SwiGLU)")
    rope_settings(hf_config)
    topk = int(hf_config.num_experts_per_tok)
    if not getattr(hf_config, "norm_topk_prob", True) and topk > 1:
        raise ValueError("model.hf_config.norm_topk_prob=false: Megatron-Core's sigmoid router always renormalises the "
                         "top-k gates; set norm_topk_prob=true (DeepSeek-V3's value)")
    n_group, topk_group = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
    if n_group > 1 and topk // topk_group != 2:
        raise ValueError(
            f"model.hf_config.num_experts_per_tok // topk_group = {topk} // {topk_group} must be 2: transformers "
            "scores a group by its top-2 experts, Megatron-Core by its top (num_experts_per_tok // topk_group); "
            "choose num_experts_per_tok = 2 * topk_group (DeepSeek-V3: 8 and 4) or n_group = 1")


def _dense_ffn(hf_config) -> int:
    return int(hf_config.intermediate_size)


def planner_shape(hf_config) -> dict:
    """moerl.parallel.memory_model.ModelShape fields of a DeepSeek-V3 config (MLA shapes, shared experts)."""
    from moerl.parallel.memory_model import MLAShape

    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=hf_config.num_attention_heads,
        head_dim=hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim,
        vocab_size=hf_config.vocab_size,
        num_experts=num_experts(hf_config),
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        intermediate_size=_dense_ffn(hf_config),
        moe_layers=tuple(bool(x) for x in moe_layer_pattern(hf_config)),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        shared_expert_intermediate_size=int(hf_config.n_shared_experts or 0) * hf_config.moe_intermediate_size,
        mla=MLAShape(q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
                     qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
                     v_head_dim=hf_config.v_head_dim),
    )


def gpt_model_kwargs(hf_config, transformer_config) -> dict:
    """GPTModel arguments: ``position_embedding_type="rope"``; MLA builds its own rotary embedding from the
    MLATransformerConfig (GPTModel builds none when ``multi_latent_attention``). With
    ``transformer_config.mtp_num_layers`` also ``mtp_block_spec``: Megatron-Core's
    ``get_gpt_mtp_block_spec`` (local backend) around the last decoder layer's spec of :func:`layer_spec`."""
    kw: dict[str, Any] = dict(position_embedding_type="rope")
    if getattr(transformer_config, "mtp_num_layers", None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        block = layer_spec(hf_config, transformer_config)
        kw["mtp_block_spec"] = get_gpt_mtp_block_spec(transformer_config, block, use_transformer_engine=False)
    return kw


FAMILY = register(ModelFamily(
    model_type=MODEL_TYPE,
    name=DISPLAY_NAME,
    hf_config_cls=hf_config_cls,
    make_hf_config=make_hf_config,
    transformer_config_from_hf=transformer_config_from_hf,
    layer_spec=layer_spec,
    conversion_rules=conversion_rules,
    moe_layer_pattern=moe_layer_pattern,
    num_experts=num_experts,
    router=router_facts,
    shard_checks=shard_checks,
    expert_ffn_size=lambda hf_config: int(hf_config.moe_intermediate_size),
    dense_ffn_size=_dense_ffn,
    gpt_model_kwargs=gpt_model_kwargs,
    planner_shape=planner_shape,
    check_hf_config=check_hf_config,
    value_head_arch="DeepseekV3ForTokenClassification",
))

"""Building blocks shared by the model families (moerl.models.families): GQA + SwiGLU-MoE GPT models.

* HF config readers that hide transformers 4/5 naming differences (``hf_head_dim``, ``hf_rope_theta``,
  ``hf_num_experts``);
* the Megatron-Core layer spec choice (``resolve_layer_spec``: local / Transformer Engine) and the GPT
  decoder block spec (:func:`gpt_block_spec`);
* the ``TransformerConfig`` fields every RMSNorm + RoPE + SwiGLU + softmax-router family shares
  (:func:`gpt_transformer_config`; the equivalence facts of shared design CPU_MEGATRON.md:
  ``rotary_interleaved=False``, ``layernorm_epsilon = rms_norm_eps``, ``kv_channels = head_dim``,
  ``num_query_groups = num_key_value_heads``, ``normalize top-k <-> moe_router_pre_softmax=False``);
* the packers that turn HF tensors into a Megatron tensor and back (``PACKERS``: "copy", "qkv" packed per
  query group, "gate_up" = SwiGLU fc1 [gate; up]) and the per-layer rule builders (:func:`attention_rules`,
  :func:`expert_rules`, :func:`dense_mlp_rules`, :func:`embedding_rules`, :func:`head_rules`);
* the Transformer Engine spec's parameter names (``TE_NAMES``).

Moved here unchanged from moerl/models/qwen3_moe.py and moerl/checkpoint/hf_convert.py (issue #16).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from moerl.models.families import ParamRule

__all__ = [
    "LAYER_SPECS",
    "PACKERS",
    "TE_INSTALL",
    "TE_NAMES",
    "attention_rules",
    "causal_attention_mask",
    "check_gpt_features",
    "dense_mlp_rules",
    "embedding_rules",
    "expert_rules",
    "gpt_block_spec",
    "gpt_model_kwargs",
    "gpt_transformer_config",
    "gqa_planner_shape",
    "hf_config_from_fields",
    "hf_head_dim",
    "hf_num_experts",
    "hf_rope_theta",
    "head_rules",
    "register_packer",
    "resolve_layer_spec",
    "unfuse_experts",
]


# --------------------------------------------------------------------------------------------
# Readers that hide transformers 4/5 naming differences
# --------------------------------------------------------------------------------------------


def hf_num_experts(hf_config) -> int:
    """Number of routed experts (``num_experts``; ``num_local_experts`` in transformers 5 / Mixtral;
    ``n_routed_experts`` in DeepSeek-V3).

    Raises:
        ValueError: the config has none of these fields set.
    """
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    raise ValueError("hf_config has neither num_experts nor num_local_experts")


def hf_head_dim(hf_config) -> int:
    """Attention head dimension (``head_dim``, default hidden_size // num_attention_heads)."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def hf_rope_theta(hf_config) -> float:
    """RoPE base. transformers 5 keeps it in ``rope_parameters["rope_theta"]``, 4 in ``rope_theta``.

    Raises:
        ValueError: a rope scaling type other than "default" (not implemented in this builder).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported; only 'default' RoPE is")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise ValueError("hf_config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    return float(theta)


def hf_config_from_fields(cls, fields: Mapping[str, Any], *, family: str, required: Sequence[str],
                          aliases: Mapping[str, str], extra_fields: Iterable[str], experts_field: str,
                          int_fields: Sequence[str] = ()):
    """A transformers config ``cls(**fields)`` after the checks every family's ``make_hf_config`` makes.

    Args:
        cls: the transformers config class (a dataclass in transformers 5: its fields are the known names).
        fields: the recipe fields.
        family: display name for messages ("Qwen3-MoE").
        required: fields that must be given (after aliases).
        aliases: other spellings -> the class's field (e.g. {"num_local_experts": "num_experts"}).
        extra_fields: further accepted names (head_dim, rope_theta, dtype, model_type, ...).
        experts_field: the field holding the routed expert count (num_experts_per_tok must not exceed it).
        int_fields: more fields that must be ints >= 1 when given (besides ``required``).

    Rules: ``rope_theta`` becomes ``rope_parameters={"rope_type": "default", "rope_theta": ...}``;
    ``model_type`` is dropped; num_attention_heads % num_key_value_heads == 0; head_dim defaults to
    hidden_size // num_attention_heads.

    Raises:
        TypeError: ``fields`` is not a mapping.
        ValueError: a required field is missing, a field is unknown, two spellings of one field
            disagree, or the sizes are inconsistent (message names the field).
    """
    if not isinstance(fields, Mapping):
        raise TypeError(f"make_hf_config expects a mapping of config fields, got {type(fields).__name__}")
    known = {f.name for f in dataclasses.fields(cls)} | set(aliases) | set(extra_fields)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"unknown {family} config field(s) {unknown}; known fields: {sorted(known)}"
        )
    kw = dict(fields)
    for alias, name in aliases.items():
        if alias in kw:
            value = kw.pop(alias)
            if name in kw and kw[name] != value:
                raise ValueError(f"{alias}={value} disagrees with {name}={kw[name]}; give one of them")
            kw[name] = value
    missing = [k for k in tuple(required) if k not in kw]
    if missing:
        raise ValueError(f"{family} config is missing required field(s) {missing}")

    rope_theta = kw.pop("rope_theta", None)
    rope_parameters = kw.get("rope_parameters")
    if rope_theta is not None:
        if rope_parameters is not None and float(rope_parameters.get("rope_theta", rope_theta)) != float(rope_theta):
            raise ValueError(
                f"rope_theta={rope_theta} disagrees with rope_parameters={rope_parameters}; give one"
            )
        kw["rope_parameters"] = {"rope_type": "default", **(rope_parameters or {}), "rope_theta": float(rope_theta)}
    kw.pop("model_type", None)

    for name in tuple(required) + tuple(int_fields):
        if name in kw and kw[name] is not None:
            v = kw[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if kw["num_attention_heads"] % kw["num_key_value_heads"] != 0:
        raise ValueError(
            f"num_attention_heads={kw['num_attention_heads']} must be a multiple of "
            f"num_key_value_heads={kw['num_key_value_heads']}"
        )
    if kw["num_experts_per_tok"] > kw[experts_field]:
        raise ValueError(
            f"num_experts_per_tok={kw['num_experts_per_tok']} exceeds {experts_field}={kw[experts_field]}"
        )
    if "head_dim" not in kw:
        if kw["hidden_size"] % kw["num_attention_heads"] != 0:
            raise ValueError(
                "head_dim is not given and hidden_size is not a multiple of num_attention_heads; "
                "set head_dim"
            )
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    return cls(**kw)


# --------------------------------------------------------------------------------------------
# Layer spec
# --------------------------------------------------------------------------------------------


#: ``model.layer_spec`` values: which Megatron-Core layer spec build_gpt_model builds
LAYER_SPECS = ("auto", "local", "transformer_engine")
TE_INSTALL = "pip install transformer-engine[pytorch]"


def _te_unavailable() -> Optional[str]:
    """Why Transformer Engine layers cannot run here (None when they can): TE not importable, or no CUDA GPU."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or TE's own load errors (no CUDA libraries)
        return f"Transformer Engine is not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (Transformer Engine layers run on CUDA only)"
    return None


def resolve_layer_spec(layer_spec: str) -> str:
    """The layer spec ``model.layer_spec`` asks for on this machine: "local" | "transformer_engine".

    "auto" = "transformer_engine" when Transformer Engine is importable and a CUDA GPU is visible, else
    "local"; "local" always works; "transformer_engine" needs both (TE imported lazily, here only).

    Raises:
        ValueError: an unknown value, or "transformer_engine" where TE / CUDA is missing (names
            ``pip install transformer-engine[pytorch]``).
    """
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"model.layer_spec must be one of {list(LAYER_SPECS)}, got {layer_spec!r}")
    if layer_spec == "local":
        return "local"
    why = _te_unavailable()
    if layer_spec == "auto":
        return "local" if why else "transformer_engine"
    if why:
        raise ValueError(f"model.layer_spec=transformer_engine builds Megatron-Core's Transformer Engine layers, but {why}; "
                         f"install it with `{TE_INSTALL}` on a machine with a CUDA GPU, or set model.layer_spec=local "
                         "(or auto)")
    return "transformer_engine"


def gpt_block_spec(hf_config, transformer_config, layer_spec: str, vp_stage: Optional[int] = None):
    """Megatron-Core's GPT decoder block spec for ``transformer_config`` (q/k norms iff ``qk_layernorm``;
    MoE layers where ``moe_layer_freq`` says).

    * "local": Megatron-Core's local spec with MoE MLPs (SequentialMLP experts, fc1 = [gate; up] SwiGLU),
      core attention ``PackedDotProductAttention`` (also takes packed THD input with
      ``packed_seq_params``: moerl.models.packed_attention);
    * "transformer_engine" (CUDA + Transformer Engine; needed for ``precision.fp8``):
      ``get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")``
      (Megatron-Core 0.16): TELayerNormColumnParallelLinear QKV and dense fc1 with the RMSNorm fused in,
      TENorm q/k / MoE pre-MLP / final norms, TEGroupedMLP experts (``moe_grouped_gemm``),
      TEDotProductAttention, which takes packed THD with ``packed_seq_params`` itself (not wrapped).

    Raises:
        ValueError: "transformer_engine" where TE / CUDA is missing (names the install) or without
            ``moe_grouped_gemm``; another layer spec.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moerl.models.packed_attention import with_packed_core_attention

    if layer_spec == "transformer_engine":
        resolve_layer_spec("transformer_engine")  # TE importable and CUDA, else a clear error
        if not transformer_config.moe_grouped_gemm:
            raise ValueError("the Transformer Engine layer spec needs moe_grouped_gemm=True (TEGroupedMLP experts, the "
                             "names moerl.checkpoint.hf_convert maps); build the config with "
                             "transformer_config_from_hf(..., layer_spec='transformer_engine')")
        # TE core attention takes packed THD (packed_seq_params) natively: no moerl wrapper
        return get_gpt_decoder_block_spec(
            transformer_config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
    if layer_spec == "local":
        block_spec = get_gpt_decoder_block_spec(
            transformer_config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
        # local core attention that also takes packed THD input (moerl.models.packed_attention)
        return with_packed_core_attention(block_spec)
    raise ValueError(f"transformer_impl={layer_spec!r}: moerl builds 'local' or 'transformer_engine' layer specs "
                     "(model.layer_spec)")


def gpt_model_kwargs(hf_config, transformer_config) -> dict:
    """GPTModel arguments of a RoPE GPT: ``position_embedding_type="rope"``, ``rotary_percent=1.0``,
    ``rotary_base`` = the HF RoPE base."""
    return dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=hf_rope_theta(hf_config))


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Causal self-attention mask in Megatron-Core's convention: True = masked out.

    Args:
        seq_len: sequence length S (>= 1).
        device: where to allocate the mask.

    Returns:
        bool tensor [1, 1, S, S] with mask[0, 0, i, j] = (j > i); broadcast over batch and heads.
        Pass it as ``attention_mask`` to GPTModel.forward (on CPU the default mask would be
        created on "cuda").

    Raises:
        ValueError: seq_len < 1.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu_(diagonal=1)
    return mask.view(1, 1, seq_len, seq_len)


# --------------------------------------------------------------------------------------------
# TransformerConfig
# --------------------------------------------------------------------------------------------


def _parallel_size(name: str, value: Optional[int]) -> int:
    if value is not None:
        return int(value)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    getter = {
        "tp": ps.get_tensor_model_parallel_world_size,
        "pp": ps.get_pipeline_model_parallel_world_size,
        "ep": ps.get_expert_model_parallel_world_size,
        "etp": ps.get_expert_tensor_parallel_world_size,
    }[name]
    return int(getter())


def check_gpt_features(hf_config, family: str) -> None:
    """Features of an HF config that the GPT builder does not map: attention bias, a sliding window
    (``use_sliding_window`` or a set ``sliding_window``), a non-silu activation, RoPE scaling.

    Raises:
        ValueError: naming the config field and the supported value.
    """
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"attention_bias=True is not supported ({family} has no attention bias)")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by this builder")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; {family} uses 'silu' (SwiGLU)")
    hf_rope_theta(hf_config)  # rope scaling other than "default" -> ValueError


def shared_moe_fields(hf_config, *, pattern: list, num_experts: int, moe_aux_loss_coeff: float,
                      moe_router_load_balancing_type: str, params_dtype: torch.dtype, tp_size: Optional[int],
                      pp_size: Optional[int], ep_size: Optional[int], etp_size: Optional[int],
                      sequence_parallel: Optional[bool]) -> dict[str, Any]:
    """The ``TransformerConfig`` fields every moerl family shares (GQA ones and DeepSeek-V3's MLA): sizes read
    from ``hf_config`` (num_hidden_layers, hidden_size, num_attention_heads, rms_norm_eps, num_experts_per_tok,
    attention_dropout, initializer_range), RMSNorm + SwiGLU without linear biases (CPU_MEGATRON.md item 6),
    the MoE layer pattern / experts / balancing loss, the dtype and parallel sizes (None = read from
    parallel_state; etp defaults to tp; sequence parallelism on iff tp > 1 unless False), CPU initialisation
    without CUDA, and the CUDA-only fusions off. Arguments as :func:`gpt_transformer_config`.

    Raises:
        ValueError: params_dtype not float32 / bfloat16 / float16.
    """
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be torch.float32, bfloat16 or float16, got {params_dtype}")
    tp = _parallel_size("tp", tp_size)
    etp = _parallel_size("etp", etp_size) if (etp_size is not None or tp_size is None) else tp
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,  # CPU_MEGATRON.md item 6; no linear biases
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        num_moe_experts=num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_load_balancing_type=moe_router_load_balancing_type,
        moe_aux_loss_coeff=float(moe_aux_loss_coeff),
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_layer_freq=pattern if not all(pattern) else 1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=_parallel_size("pp", pp_size),
        expert_model_parallel_size=_parallel_size("ep", ep_size),
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1 and (sequence_parallel is None or bool(sequence_parallel)),
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def gpt_transformer_config(
    hf_config,
    *,
    family: str,
    qk_layernorm: bool,
    pattern: list,
    num_experts: int,
    moe_ffn_hidden_size: int,
    ffn_hidden_size: int,
    normalize_topk: bool,
    moe_aux_loss_coeff: float = 1e-3,
    moe_router_load_balancing_type: str = "aux_loss",
    params_dtype: torch.dtype = torch.float32,
    tp_size: Optional[int] = None,
    pp_size: Optional[int] = None,
    ep_size: Optional[int] = None,
    etp_size: Optional[int] = None,
    sequence_parallel: Optional[bool] = None,
    layer_spec: str = "local",
    **overrides: Any,
):
    """Megatron-Core ``TransformerConfig`` of an RMSNorm / RoPE / GQA / SwiGLU / softmax-top-k MoE model.

    Args:
        hf_config: the transformers config (num_hidden_layers, hidden_size, num_attention_heads,
            num_key_value_heads, head_dim, rms_norm_eps, num_experts_per_tok, attention_dropout,
            initializer_range, hidden_act, attention_bias, use_sliding_window are read).
        family: display name for error messages ("Qwen3-MoE").
        qk_layernorm: RMSNorm on queries and keys per head (Qwen3) or not (Mixtral).
        pattern: per-layer 1 = MoE / 0 = dense (``moe_layer_freq``).
        num_experts: routed experts; moe_ffn_hidden_size: their width; ffn_hidden_size: dense MLP width.
        normalize_topk: renormalise the top-k softmax scores (``moe_router_pre_softmax = not normalize_topk``).
        moe_aux_loss_coeff: coefficient of Megatron's load-balancing loss (Switch-style aux loss).
        moe_router_load_balancing_type: "aux_loss", "seq_aux_loss", "global_aux_loss",
            "sinkhorn" or "none".
        params_dtype: torch.float32 or torch.bfloat16 (sets bf16=True) or torch.float16.
        tp_size, pp_size, ep_size, etp_size: parallel sizes; None reads them from
            megatron parallel_state (1 when it is not initialised). The pipeline dtype (needed
            by Megatron when pp_size > 1) is ``params_dtype``.
        sequence_parallel: Megatron sequence parallelism; None = on iff tp_size > 1 (Megatron
            requires it for MoE with TP when training). Always off at tp_size == 1.
        layer_spec: "local" | "transformer_engine" | "auto" (:func:`resolve_layer_spec`; an override
            ``transformer_impl`` wins): sets Megatron's ``transformer_impl``, which ``build_gpt_model``
            builds, and for "transformer_engine" ``moe_grouped_gemm=True`` (TEGroupedMLP experts, whose
            names moerl.checkpoint.hf_convert maps) unless overridden. The config itself is built
            without TE (CPU dry checks); the model is not.
        **overrides: any TransformerConfig field, applied last (e.g. moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather", recompute_granularity="full").


    Returns:
        megatron.core.transformer.TransformerConfig.

    Raises:
        ValueError: attention bias, sliding window, a non-silu activation, rope scaling, a bad params_dtype.
    """
    from megatron.core.transformer import TransformerConfig

    check_gpt_features(hf_config, family)
    kwargs: dict[str, Any] = dict(
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_head_dim(hf_config),
        ffn_hidden_size=ffn_hidden_size,
        qk_layernorm=qk_layernorm,
        rotary_interleaved=False,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
        moe_router_pre_softmax=not normalize_topk,
        moe_router_score_function="softmax",
        **shared_moe_fields(hf_config, pattern=pattern, num_experts=num_experts,
                            moe_aux_loss_coeff=moe_aux_loss_coeff,
                            moe_router_load_balancing_type=moe_router_load_balancing_type, params_dtype=params_dtype,
                            tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, etp_size=etp_size,
                            sequence_parallel=sequence_parallel),
    )
    spec = overrides.pop("transformer_impl", None) or layer_spec
    spec = spec if spec == "transformer_engine" else resolve_layer_spec(spec)
    kwargs["transformer_impl"] = spec
    kwargs["moe_grouped_gemm"] = spec == "transformer_engine"  # TEGroupedMLP (TE GroupedLinear) experts
    kwargs.update(overrides)
    from moerl.precision.te_fp8 import apply_fp8_transformer_config

    kwargs = apply_fp8_transformer_config(kwargs)  # FP8 (Transformer Engine): router FP32, checks; no-op without fp8
    return TransformerConfig(**kwargs)


def gqa_planner_shape(hf_config, *, expert_width: int, dense_width: int, pattern: list,
                      qk_layernorm: bool) -> dict:
    """moerl.parallel.memory_model.ModelShape fields of a GQA MoE model (no shared experts, no MLA).

    Args:
        hf_config: the transformers config (layers, hidden, heads, kv heads, head_dim, vocab, top-k, tying).
        expert_width: routed expert FFN width; dense_width: dense MLP width; pattern: 1 = MoE per layer;
        qk_layernorm: the attention has q/k RMSNorms (their 2 * head_dim parameters per layer).
    """
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=hf_config.num_key_value_heads,
        head_dim=hf_head_dim(hf_config),
        vocab_size=hf_config.vocab_size,
        num_experts=hf_num_experts(hf_config),
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=int(expert_width),
        intermediate_size=int(dense_width),
        moe_layers=tuple(bool(x) for x in pattern),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qk_layernorm=qk_layernorm,
    )


# --------------------------------------------------------------------------------------------
# Packers: HF tensors <-> one Megatron tensor
# --------------------------------------------------------------------------------------------


def _expect_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} from the HF config")


def attn_dims(hf_config) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim); ValueError when nh % nkv != 0."""
    nh, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if nh % nkv != 0:
        raise ValueError(f"num_attention_heads={nh} must be a multiple of num_key_value_heads={nkv}")
    return nh, nkv, hf_head_dim(hf_config)


def _pack_qkv(tensors: list[torch.Tensor], hf_config) -> torch.Tensor:
    """[q (nh*d, H), k (nkv*d, H), v (nkv*d, H)] -> Megatron linear_qkv ((nh + 2 nkv) d, H),
    packed per query group: [q heads of group g; k_g; v_g] for g = 0..nkv-1."""
    q, k, v = tensors
    nh, nkv, d = attn_dims(hf_config)
    hidden = q.shape[-1]
    per = nh // nkv
    _expect_shape("q_proj", q, (nh * d, hidden))
    _expect_shape("k_proj", k, (nkv * d, hidden))
    _expect_shape("v_proj", v, (nkv * d, hidden))
    packed = torch.cat(
        [q.reshape(nkv, per * d, hidden), k.reshape(nkv, d, hidden), v.reshape(nkv, d, hidden)], dim=1
    )
    return packed.reshape(nkv * (per + 2) * d, hidden)


def _unpack_qkv(packed: torch.Tensor, hf_config) -> list[torch.Tensor]:
    """Inverse of ``_pack_qkv``: Megatron linear_qkv -> [q, k, v] (HF q_proj/k_proj/v_proj)."""
    nh, nkv, d = attn_dims(hf_config)
    per = nh // nkv
    hidden = packed.shape[-1]
    _expect_shape("linear_qkv", packed, ((nh + 2 * nkv) * d, hidden))
    grouped = packed.reshape(nkv, (per + 2) * d, hidden)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return [
        q.reshape(nh * d, hidden).contiguous(),
        k.reshape(nkv * d, hidden).contiguous(),
        v.reshape(nkv * d, hidden).contiguous(),
    ]


def _pack_gate_up(tensors: list[torch.Tensor], hf_config) -> torch.Tensor:
    """[gate (I, H), up (I, H)] -> Megatron SwiGLU linear_fc1 [gate; up] (2I, H)."""
    gate, up = tensors
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ in shape")
    return torch.cat([gate, up], dim=0)


def _unpack_gate_up(fc1: torch.Tensor, hf_config) -> list[torch.Tensor]:
    """Inverse of ``_pack_gate_up``: linear_fc1 (2I, H) -> [gate (I, H), up (I, H)]."""
    if fc1.shape[0] % 2 != 0:
        raise ValueError(f"linear_fc1 has an odd number of rows {fc1.shape[0]}; expected [gate; up]")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def _copy_in(tensors: list[torch.Tensor], hf_config) -> torch.Tensor:
    return tensors[0]


def _copy_out(tensor: torch.Tensor, hf_config) -> list[torch.Tensor]:
    return [tensor]


#: kind -> (HF tensors -> Megatron tensor, Megatron tensor -> HF tensors); both take (tensor(s), hf_config)
PACKERS: dict[str, tuple[Callable, Callable]] = {
    "copy": (_copy_in, _copy_out),
    "qkv": (_pack_qkv, _unpack_qkv),
    "gate_up": (_pack_gate_up, _unpack_gate_up),
}


def register_packer(kind: str, to_mcore: Callable, to_hf: Callable) -> None:
    """Add a ParamRule ``kind``: ``to_mcore(list_of_hf_tensors, hf_config) -> tensor`` and its exact inverse
    ``to_hf(tensor, hf_config) -> list_of_hf_tensors``. A new kind's TP split is a plain ``torch.chunk`` on
    the rule's ``tp_dim`` (moerl.checkpoint.hf_convert).

    Raises:
        ValueError: ``kind`` is already registered with other functions.
    """
    if kind in PACKERS and PACKERS[kind] != (to_mcore, to_hf):
        raise ValueError(f"packer kind {kind!r} is already registered")
    PACKERS[kind] = (to_mcore, to_hf)


# --------------------------------------------------------------------------------------------
# Conversion-rule builders
# --------------------------------------------------------------------------------------------


#: The Transformer Engine spec's names that differ from the local spec's, per decoder layer (Megatron-Core
#: 0.16 gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec: linear_qkv is
#: TELayerNormColumnParallelLinear, whose TE LayerNormLinear holds the fused norm as ``layer_norm_weight``
#: (no ``layer_norm_bias`` with RMSNorm) and ``input_layernorm`` is not in the spec; dense layers' fc1 is
#: TELayerNormColumnParallelLinear too, with ``pre_mlp_layernorm=IdentityOp``; MoE layers keep a TENorm
#: ``pre_mlp_layernorm``; experts with moe_grouped_gemm are TEGroupedMLP, whose TE GroupedLinear fc1 / fc2
#: register ``weight{i}`` per local expert i). tests/test_hf_convert_te.py parses those sources for each.
TE_NAMES = {
    "input_layernorm": "self_attention.linear_qkv.layer_norm_weight",
    "dense_pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_weight",
    "expert_fc1": "mlp.experts.linear_fc1.weight{e}",
    "expert_fc2": "mlp.experts.linear_fc2.weight{e}",
}
MC_EXPERT_BIAS = "mlp.router.expert_bias"
HF_EXPERT_BIAS = "e_score_correction_bias"


def attention_rules(l: int, te: bool, qk_norm: bool, is_moe: bool) -> list[ParamRule]:
    """Rules of layer ``l``'s input norm, GQA attention (QKV packed per query group, split on dim 0;
    linear_proj split on dim 1), optional q/k RMSNorms and the pre-MLP norm (HF
    ``post_attention_layernorm``), HF names ``model.layers.{l}.self_attn.*`` (Llama / Qwen / Mixtral)."""
    hf, mc = f"model.layers.{l}.", f"decoder.layers.{l}."
    rules = [
        ParamRule(mc + (TE_NAMES["input_layernorm"] if te else "input_layernorm.weight"),
                  (hf + "input_layernorm.weight",), "copy", layer=l),
        ParamRule(mc + "self_attention.linear_qkv.weight", tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                  "qkv", tp_dim=0, layer=l),
    ]
    if qk_norm:
        rules += [
            ParamRule(mc + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "copy", layer=l),
            ParamRule(mc + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "copy", layer=l),
        ]
    rules += [
        ParamRule(mc + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "copy", tp_dim=1, layer=l),
        ParamRule(mc + (TE_NAMES["dense_pre_mlp_layernorm"] if te and not is_moe else "pre_mlp_layernorm.weight"),
                  (hf + "post_attention_layernorm.weight",), "copy", layer=l),
    ]
    return rules


def expert_rules(l: int, te: bool, num_experts: int, hf_moe: str, expert_names: tuple[str, str, str],
                 expert_bias: bool) -> list[ParamRule]:
    """Rules of MoE layer ``l``: router (HF ``{hf_moe}gate.weight``, replicated), optionally the
    aux-loss-free expert bias (``mlp.router.expert_bias`` <-> ``{hf_moe}gate.e_score_correction_bias``), and
    per expert e the SwiGLU fc1 = [gate; up] (split on dim 0 per half over expert-TP) and fc2 = down (dim 1).

    Args:
        hf_moe: HF prefix of the MoE block inside the layer (``"mlp."`` Qwen3, ``"block_sparse_moe."`` Mixtral).
        expert_names: HF names of an expert's (gate, up, down) weights relative to ``experts.{e}.``
            (``("gate_proj.weight", "up_proj.weight", "down_proj.weight")`` or Mixtral's w1 / w3 / w2).
    """
    hf, mc = f"model.layers.{l}.{hf_moe}", f"decoder.layers.{l}."
    rules = [ParamRule(mc + "mlp.router.weight", (hf + "gate.weight",), "copy", layer=l)]
    if expert_bias:
        rules.append(ParamRule(mc + MC_EXPERT_BIAS, (hf + "gate." + HF_EXPERT_BIAS,), "copy", layer=l))
    gate, up, down = expert_names
    for e in range(num_experts):
        he = hf + f"experts.{e}."
        me = mc + f"mlp.experts.local_experts.{e}."
        fc1, fc2 = (mc + TE_NAMES["expert_fc1"].format(e=e), mc + TE_NAMES["expert_fc2"].format(e=e)) if te \
            else (me + "linear_fc1.weight", me + "linear_fc2.weight")
        rules += [
            ParamRule(fc1, (he + gate, he + up), "gate_up", tp_dim=0, layer=l, expert=e),
            ParamRule(fc2, (he + down,), "copy", tp_dim=1, layer=l, expert=e),
        ]
    return rules


def dense_mlp_rules(l: int) -> list[ParamRule]:
    """Rules of dense layer ``l``'s SwiGLU MLP (HF ``model.layers.{l}.mlp.{gate,up,down}_proj.weight``)."""
    hf, mc = f"model.layers.{l}.", f"decoder.layers.{l}."
    return [
        ParamRule(mc + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                  "gate_up", tp_dim=0, layer=l),
        ParamRule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "copy", tp_dim=1, layer=l),
    ]


def embedding_rules() -> list[ParamRule]:
    """The word embedding (vocabulary-parallel: split on dim 0)."""
    return [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", tp_dim=0)]


def head_rules(hf_config, head: str) -> list[ParamRule]:
    """The final norm and the output head: ``lm_head.weight`` (split on dim 0; absent when tied) or a value
    model's ``score.weight`` [1, H] / ``score.bias`` [1] (replicated, never tied)."""
    rules = [ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy")]
    if head == "value":
        rules += [ParamRule("output_layer.weight", ("score.weight",), "copy"),
                  ParamRule("output_layer.bias", ("score.bias",), "copy")]
    elif not bool(getattr(hf_config, "tie_word_embeddings", False)):
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "copy", tp_dim=0))
    return rules


_FUSED_GATE_UP = ".experts.gate_up_proj"
_FUSED_DOWN = ".experts.down_proj"
_CANONICAL = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def unfuse_experts(hf_state_dict: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """transformers 5's fused in-memory experts -> canonical per-expert names (views, no copy).

    ``<p>.experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up) -> ``<p>.experts.{e}.gate_proj.weight``
    [I, H] and ``<p>.experts.{e}.up_proj.weight`` [I, H]; ``<p>.experts.down_proj`` [E, H, I] ->
    ``<p>.experts.{e}.down_proj.weight``. Other keys pass through.

    Raises:
        ValueError: a fused tensor's expert dimension differs from ``num_experts``.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.endswith(_FUSED_GATE_UP):
            prefix = key[: -len("gate_up_proj")]
            if value.dim() != 3 or value.shape[0] != num_experts or value.shape[1] % 2:
                raise ValueError(f"{key} has shape {tuple(value.shape)}, expected [{num_experts}, 2I, H]")
            gate, up = torch.chunk(value, 2, dim=1)
            for e in range(num_experts):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif key.endswith(_FUSED_DOWN):
            prefix = key[: -len("down_proj")]
            if value.dim() != 3 or value.shape[0] != num_experts:
                raise ValueError(f"{key} has shape {tuple(value.shape)}, expected [{num_experts}, H, I]")
            for e in range(num_experts):
                out[f"{prefix}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out

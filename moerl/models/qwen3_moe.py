"""Qwen3-MoE as a Megatron-Core GPTModel (local layer spec on CPU, Transformer Engine's on GPU).

Three steps, each usable alone:

* ``make_hf_config(fields)``: a ``transformers.Qwen3MoeConfig`` from recipe fields;
* ``transformer_config_from_hf(hf_config, ...)``: the matching megatron ``TransformerConfig``;
* ``build_gpt_model(hf_config, transformer_config=None, ...)``: the ``GPTModel``.

The mapping follows the equivalence facts measured in shared design CPU_MEGATRON.md (QK RMSNorm
through the layer spec, ``rotary_interleaved=False``, ``layernorm_epsilon = rms_norm_eps``,
``rotary_base = rope_theta``, ``kv_channels = head_dim``, ``num_query_groups =
num_key_value_heads``, ``norm_topk_prob=True <-> moe_router_pre_softmax=False``).

Calling the model (CPU path)::

    tokens: LongTensor [B, S]  (right-padded; padding after the last real token)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    logits = model(tokens, position_ids, causal_attention_mask(S))   # [B, S, vocab] float

Always pass ``causal_attention_mask(S)``: with ``attention_mask=None`` megatron-core builds its
default mask on device "cuda" (CPU_MEGATRON.md item 5). GPTModel 0.16.1 applies RoPE at positions
0..S-1 whatever ``position_ids`` say, so each row must be one sequence starting at position 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "LAYER_SPECS",
    "build_gpt_model",
    "causal_attention_mask",
    "hf_moe_layer_pattern",
    "hf_num_experts",
    "hf_head_dim",
    "hf_rope_theta",
    "make_hf_config",
    "resolve_layer_spec",
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
    if not isinstance(fields, Mapping):
        raise TypeError(f"make_hf_config expects a mapping of config fields, got {type(fields).__name__}")
    cls = _qwen3_moe_config_cls()
    known = {f.name for f in dataclasses.fields(cls)} | set(_ALIASES) | _EXTRA_FIELDS
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"unknown Qwen3-MoE config field(s) {unknown}; known fields: {sorted(known)}"
        )
    kw = dict(fields)
    for alias, name in _ALIASES.items():
        if alias in kw:
            value = kw.pop(alias)
            if name in kw and kw[name] != value:
                raise ValueError(f"{alias}={value} disagrees with {name}={kw[name]}; give one of them")
            kw[name] = value
    missing = [k for k in _REQUIRED_FIELDS if k not in kw]
    if missing:
        raise ValueError(f"Qwen3-MoE config is missing required field(s) {missing}")

    rope_theta = kw.pop("rope_theta", None)
    rope_parameters = kw.get("rope_parameters")
    if rope_theta is not None:
        if rope_parameters is not None and float(rope_parameters.get("rope_theta", rope_theta)) != float(rope_theta):
            raise ValueError(
                f"rope_theta={rope_theta} disagrees with rope_parameters={rope_parameters}; give one"
            )
        kw["rope_parameters"] = {"rope_type": "default", **(rope_parameters or {}), "rope_theta": float(rope_theta)}
    kw.pop("model_type", None)

    for name in _REQUIRED_FIELDS + ("head_dim", "intermediate_size", "max_position_embeddings"):
        if name in kw and kw[name] is not None:
            v = kw[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if kw["num_attention_heads"] % kw["num_key_value_heads"] != 0:
        raise ValueError(
            f"num_attention_heads={kw['num_attention_heads']} must be a multiple of "
            f"num_key_value_heads={kw['num_key_value_heads']}"
        )
    if kw["num_experts_per_tok"] > kw["num_experts"]:
        raise ValueError(
            f"num_experts_per_tok={kw['num_experts_per_tok']} exceeds num_experts={kw['num_experts']}"
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
# Readers that hide transformers 4/5 naming differences
# --------------------------------------------------------------------------------------------


def hf_num_experts(hf_config) -> int:
    """Number of routed experts (``num_experts``, a.k.a. ``num_local_experts`` in transformers 5)."""
    for name in ("num_experts", "num_local_experts"):
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


# --------------------------------------------------------------------------------------------
# Megatron config / model
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


def transformer_config_from_hf(
    hf_config,
    *,
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
    """Megatron-Core ``TransformerConfig`` equivalent to a Qwen3-MoE HF config.

    Args:
        hf_config: transformers Qwen3MoeConfig (or any config with the same fields).
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
        ValueError: a feature this builder does not map (attention bias, sliding window,
            non-silu activation, rope scaling) or a bad params_dtype.
    """
    from megatron.core.transformer import TransformerConfig

    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported (Qwen3-MoE has no attention bias)")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by this builder")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; Qwen3-MoE uses 'silu' (SwiGLU)")
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be torch.float32, bfloat16 or float16, got {params_dtype}")

    tp = _parallel_size("tp", tp_size)
    pp = _parallel_size("pp", pp_size)
    ep = _parallel_size("ep", ep_size)
    etp = _parallel_size("etp", etp_size) if (etp_size is not None or tp_size is None) else tp
    pattern = hf_moe_layer_pattern(hf_config)
    num_experts = hf_num_experts(hf_config)
    intermediate_size = getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size

    kwargs: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_head_dim(hf_config),
        ffn_hidden_size=intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,  # CPU_MEGATRON.md item 6; Qwen3-MoE has no linear biases
        add_qkv_bias=False,
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        num_moe_experts=num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)),
        moe_router_score_function="softmax",
        moe_router_load_balancing_type=moe_router_load_balancing_type,
        moe_aux_loss_coeff=float(moe_aux_loss_coeff),
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_layer_freq=pattern if not all(pattern) else 1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
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
    spec = overrides.pop("transformer_impl", None) or layer_spec
    spec = spec if spec == "transformer_engine" else resolve_layer_spec(spec)
    kwargs["transformer_impl"] = spec
    kwargs["moe_grouped_gemm"] = spec == "transformer_engine"  # TEGroupedMLP (TE GroupedLinear) experts
    kwargs.update(overrides)
    from moerl.precision.te_fp8 import apply_fp8_transformer_config

    kwargs = apply_fp8_transformer_config(kwargs)  # FP8 (Transformer Engine): router FP32, checks; no-op without fp8
    return TransformerConfig(**kwargs)


def build_gpt_model(hf_config, transformer_config=None, **kw):
    """Build the Megatron-Core ``GPTModel`` for a Qwen3-MoE HF config (this pipeline stage).

    The layer spec is the config's ``transformer_impl`` (``transformer_config_from_hf(layer_spec=...)``):

    * "local": Megatron-Core's local spec with q/k RMSNorm, MoE MLPs (SequentialMLP experts,
      fc1 = [gate; up] SwiGLU), core attention ``PackedDotProductAttention`` (also takes packed THD
      input with ``packed_seq_params``: moerl.models.packed_attention);
    * "transformer_engine" (CUDA + Transformer Engine; needed for ``precision.fp8``):
      ``get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")``
      (Megatron-Core 0.16; q/k norms from ``config.qk_layernorm``): TELayerNormColumnParallelLinear
      QKV and dense fc1 with the RMSNorm fused in, TENorm q/k / MoE pre-MLP / final norms,
      TEGroupedMLP experts (``moe_grouped_gemm``), TEDotProductAttention, which takes packed THD with
      ``packed_seq_params`` itself (not wrapped). Parameter names: moerl.checkpoint.hf_convert.TE_NAMES.

    Both: dense MLP layers where
    ``mlp_only_layers``/``decoder_sparse_step`` say so, RoPE with base ``rope_theta``, vocabulary
    exactly ``hf_config.vocab_size`` and embeddings tied iff ``hf_config.tie_word_embeddings``.

    Args:
        hf_config: transformers Qwen3MoeConfig.
        transformer_config: a TransformerConfig; default ``transformer_config_from_hf(hf_config)``.
        **kw: passed to ``transformer_config_from_hf`` when ``transformer_config`` is None, except
            these GPTModel arguments: pre_process, post_process (default: this rank's pipeline
            stage from parallel_state), parallel_output (default True: logits stay split over
            the TP vocab shards), max_sequence_length (default max_position_embeddings),
            vp_stage.

    Returns:
        megatron.core.models.gpt.GPTModel on CPU (``use_cpu_initialization``) or the current
        CUDA device. Requires Megatron parallel_state to be initialised
        (``moerl.runtime.distributed.init_distributed``).

    Raises:
        RuntimeError: parallel_state is not initialised.
        ValueError: vocab_size not divisible by tp_size; transformer_impl "transformer_engine" where
            Transformer Engine or CUDA is missing (names ``pip install transformer-engine[pytorch]``),
            or another transformer_impl.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moerl.models.packed_attention import with_packed_core_attention

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel_state is not initialised; call moerl.runtime.distributed."
            "init_distributed() before build_gpt_model()"
        )
    model_kw = {k: kw.pop(k) for k in ("pre_process", "post_process", "parallel_output",
                                       "max_sequence_length", "vp_stage") if k in kw}
    if transformer_config is None:
        transformer_config = transformer_config_from_hf(hf_config, **kw)
    elif kw:
        raise TypeError(
            f"unexpected arguments {sorted(kw)}: transformer_config was given, so config "
            "arguments cannot be applied; pass them to transformer_config_from_hf instead"
        )
    tp = transformer_config.tensor_model_parallel_size
    if hf_config.vocab_size % tp != 0:
        raise ValueError(
            f"vocab_size={hf_config.vocab_size} is not divisible by tp_size={tp}; Megatron's "
            "vocab-parallel embedding needs vocab_size % tp_size == 0"
        )
    vp_stage = model_kw.pop("vp_stage", None)
    spec = getattr(transformer_config, "transformer_impl", "local")
    if spec == "transformer_engine":
        resolve_layer_spec("transformer_engine")  # TE importable and CUDA, else a clear error
        if not transformer_config.moe_grouped_gemm:
            raise ValueError("the Transformer Engine layer spec needs moe_grouped_gemm=True (TEGroupedMLP experts, the "
                             "names moerl.checkpoint.hf_convert maps); build the config with "
                             "transformer_config_from_hf(..., layer_spec='transformer_engine')")
        # TE core attention takes packed THD (packed_seq_params) natively: no moerl wrapper
        block_spec = get_gpt_decoder_block_spec(
            transformer_config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
    elif spec == "local":
        block_spec = get_gpt_decoder_block_spec(
            transformer_config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
        # local core attention that also takes packed THD input (moerl.models.packed_attention)
        block_spec = with_packed_core_attention(block_spec)
    else:
        raise ValueError(f"transformer_impl={spec!r}: moerl builds 'local' or 'transformer_engine' layer specs "
                         "(model.layer_spec)")
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=block_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=model_kw.pop(
            "max_sequence_length", getattr(hf_config, "max_position_embeddings", 4096)
        ),
        pre_process=model_kw.pop("pre_process", ps.is_pipeline_first_stage(ignore_virtual=True)),
        post_process=model_kw.pop("post_process", ps.is_pipeline_last_stage(ignore_virtual=True)),
        parallel_output=model_kw.pop("parallel_output", True),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=hf_rope_theta(hf_config),
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


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

"""Megatron-Core GPTModel of any registered model family (moerl.models.families), built through the registry.

Three steps, each usable alone (the family is looked up by ``hf_config.model_type``):

* ``get_family(model_type).make_hf_config(fields)``: the HF config from recipe fields;
* ``transformer_config_from_hf(hf_config, ...)``: the matching megatron ``TransformerConfig``;
* ``build_gpt_model(hf_config, transformer_config=None, ...)``: the ``GPTModel``.

Calling the model (CPU path)::

    tokens: LongTensor [B, S]  (right-padded; padding after the last real token)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    logits = model(tokens, position_ids, causal_attention_mask(S))   # [B, S, vocab] float

Always pass ``causal_attention_mask(S)``: with ``attention_mask=None`` megatron-core builds its
default mask on device "cuda" (CPU_MEGATRON.md item 5). GPTModel 0.16.1 applies RoPE at positions
0..S-1 whatever ``position_ids`` say, so each row must be one sequence starting at position 0.

Moved from moerl/models/qwen3_moe.py (issue #16), which re-exports these names.
"""

from __future__ import annotations

from typing import Any

import torch

from moerl.models.families import get_family
from moerl.models.families.common import (
    LAYER_SPECS,
    TE_INSTALL,
    causal_attention_mask,
    hf_head_dim,
    hf_num_experts,
    hf_rope_theta,
    resolve_layer_spec,
)

__all__ = [
    "LAYER_SPECS",
    "TE_INSTALL",
    "build_gpt_model",
    "causal_attention_mask",
    "hf_head_dim",
    "hf_moe_layer_pattern",
    "hf_num_experts",
    "hf_rope_theta",
    "resolve_layer_spec",
    "transformer_config_from_hf",
]


def hf_moe_layer_pattern(hf_config) -> list[int]:
    """Per-layer 1 (MoE) / 0 (dense MLP) of ``hf_config``'s model (its family's rule, e.g. Qwen3-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``; Mixtral: all MoE).

    Raises:
        moerl.errors.ModelError: an unsupported model_type (lists the supported ones).
    """
    return get_family(hf_config).moe_layer_pattern(hf_config)


def transformer_config_from_hf(hf_config, **kw: Any):
    """Megatron-Core ``TransformerConfig`` of ``hf_config``'s model: its family's
    ``transformer_config_from_hf`` (see moerl.models.families.qwen3_moe.transformer_config_from_hf for the
    arguments: moe_aux_loss_coeff, moe_router_load_balancing_type, params_dtype, tp/pp/ep/etp_size,
    sequence_parallel, layer_spec, **overrides).

    Raises:
        moerl.errors.ModelError: an unsupported model_type; ValueError: a feature the family does not map.
    """
    return get_family(hf_config).transformer_config_from_hf(hf_config, **kw)


def build_gpt_model(hf_config, transformer_config=None, **kw):
    """Build the Megatron-Core ``GPTModel`` of ``hf_config``'s model family (this pipeline stage).

    The layer spec is the family's (``ModelFamily.layer_spec``) for the config's ``transformer_impl``
    (``transformer_config_from_hf(layer_spec=...)``; moerl.models.families.common.gpt_block_spec):

    * "local": Megatron-Core's local spec (q/k RMSNorm iff the family has them), MoE MLPs (SequentialMLP
      experts, fc1 = [gate; up] SwiGLU), core attention ``PackedDotProductAttention`` (also takes packed
      THD input with ``packed_seq_params``: moerl.models.packed_attention);
    * "transformer_engine" (CUDA + Transformer Engine; needed for ``precision.fp8``): Megatron-Core's TE
      spec (TELayerNormColumnParallelLinear, TEGroupedMLP experts, TEDotProductAttention). Parameter
      names: moerl.checkpoint.hf_convert.TE_NAMES.

    Both: dense MLP layers where the family's layer pattern says so, the family's GPTModel arguments
    (RoPE with base ``rope_theta``), vocabulary exactly ``hf_config.vocab_size`` and embeddings tied iff
    ``hf_config.tie_word_embeddings``.

    Args:
        hf_config: a transformers config of a registered family (moerl.models.families).
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
        moerl.errors.ModelError: an unsupported model_type (lists the supported ones), before any work.
        RuntimeError: parallel_state is not initialised.
        ValueError: vocab_size not divisible by tp_size; transformer_impl "transformer_engine" where
            Transformer Engine or CUDA is missing (names ``pip install transformer-engine[pytorch]``),
            or another transformer_impl.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    family = get_family(hf_config)
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel_state is not initialised; call moerl.runtime.distributed."
            "init_distributed() before build_gpt_model()"
        )
    model_kw = {k: kw.pop(k) for k in ("pre_process", "post_process", "parallel_output",
                                       "max_sequence_length", "vp_stage") if k in kw}
    if transformer_config is None:
        transformer_config = family.transformer_config_from_hf(hf_config, **kw)
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
    block_spec = family.layer_spec(hf_config, transformer_config,
                                   getattr(transformer_config, "transformer_impl", "local"), vp_stage=vp_stage)
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
        vp_stage=vp_stage,
        **family.gpt_model_kwargs(hf_config, transformer_config),
    )
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model

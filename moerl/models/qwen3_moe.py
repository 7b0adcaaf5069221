"""Old import path of the Qwen3-MoE builder (issue #16 moved it into the model-family registry).

* Qwen3-MoE's own parts (``make_hf_config``): moerl.models.families.qwen3_moe;
* the family-generic model builder (``build_gpt_model``, ``transformer_config_from_hf``,
  ``hf_moe_layer_pattern``, dispatching on ``hf_config.model_type``): moerl.models.gpt;
* the HF config readers, layer-spec choice and causal mask: moerl.models.families.common.

Every name this module exported before is re-exported here unchanged in behaviour for Qwen3-MoE configs.
"""

from __future__ import annotations

from moerl.models.families.common import _parallel_size, _te_unavailable  # noqa: F401 (used by other modules)
from moerl.models.families.qwen3_moe import make_hf_config
from moerl.models.gpt import (
    LAYER_SPECS,
    TE_INSTALL,
    build_gpt_model,
    causal_attention_mask,
    hf_head_dim,
    hf_moe_layer_pattern,
    hf_num_experts,
    hf_rope_theta,
    resolve_layer_spec,
    transformer_config_from_hf,
)

__all__ = [
    "LAYER_SPECS",
    "TE_INSTALL",
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

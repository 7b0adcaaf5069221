"""Model FLOPs of a Mixture-of-Experts decoder from its Hugging Face config, and MFU.

Convention (model FLOPs, as in PaLM's MFU, arXiv 2204.02311 appendix B, and Megatron-LM's
``num_floating_point_operations`` in megatron/training/training.py; Narayanan et al. 2021,
arXiv 2104.04473, eq. 3):

* a matrix product of an (m x k) by a (k x n) operand is m*k*n multiply-accumulates (MACs);
  **forward FLOPs = 2 * MACs**;
* **backward = 2 x forward** (one product for the input gradient, one for the weight gradient), so
  one training pass (forward + backward) is 3 x forward; a log-prob pass is 1 x forward;
* DeepSeek-V3's multi-token-prediction layers (``num_nextn_predict_layers``) are not counted (neither
  transformers nor moerl's trainer builds them);
* activation recomputation is NOT counted (it is hardware FLOPs, not model FLOPs), nor are norms,
  activations, softmax, rotary embeddings or the embedding lookup (O(h) per token, not matrix products);
* only ACTIVE parameters count: each token goes through its ``top_k`` routed experts, the shared
  experts and the router, not through all experts.

Per token and layer (h = hidden_size, n_h heads, d head dim, n_kv key/value heads):

* attention, grouped-query: Q h*n_h*d, K and V 2*h*n_kv*d, output n_h*d*h MACs;
* attention, multi-head latent (DeepSeek-V2/V3, fields q_lora_rank, kv_lora_rank, qk_nope_head_dim,
  qk_rope_head_dim, v_head_dim): Q h*q_lora + q_lora*n_h*(nope+rope) (or h*n_h*(nope+rope) without
  q_lora_rank), KV down h*(kv_lora+rope), KV up kv_lora*n_h*(nope+v), output n_h*v*h MACs;
* core attention per SEQUENCE of length s, causal: s(s+1)/2 (query, key) pairs, each n_h*d_qk MACs for
  the scores and n_h*d_v for the weighted values. Packed batches count every sequence on its own
  (``cu_seqlens`` lengths, never the padded length);
* MLP, gated (SwiGLU: gate, up, down): 3*h*f MACs for width f; a dense layer uses the dense width, an
  MoE layer top_k routed experts of the expert width plus the shared experts' total width, plus the
  router h*num_experts;
* output layer: h*vocab_size per token (``output_size`` replaces the vocabulary for a value head).

The shapes (layer pattern, expert and dense widths, shared experts, MLA dims) are the model family's
(moerl.models.families, through the planner's ``ModelShape.from_hf_config``): Qwen3-MoE
(``mlp_only_layers``, ``decoder_sparse_step``), DeepSeek-V3 (``first_k_dense_replace``, ``moe_layer_freq``),
Mixtral (every layer MoE with experts of ``intermediate_size``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["model_shape", "forward_flops", "flop_breakdown", "training_flops", "logprob_flops",
           "seq_lens_from_cu_seqlens", "peak_tflops", "mfu"]


def model_shape(hf_config: Any):
    """The shapes the FLOP count needs: the planner's :class:`moerl.parallel.memory_model.ModelShape` of
    the config's model family (moerl.models.families: its layer pattern, expert and dense widths, shared
    experts, MLA dims). A ModelShape is returned as it is.

    Raises:
        moerl.errors.ModelError: the config's model_type has no model family (the supported ones are listed).
    """
    from moerl.parallel.memory_model import ModelShape

    return hf_config if isinstance(hf_config, ModelShape) else ModelShape.from_hf_config(hf_config)


def seq_lens_from_cu_seqlens(cu_seqlens: Sequence[int]) -> list[int]:
    """Sequence lengths from cumulative offsets ``[0, s0, s0+s1, ...]`` (a list or 1-D int tensor).

    Raises:
        ValueError: not starting at 0 or not non-decreasing.
    """
    cu = [int(x) for x in cu_seqlens]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
    return [b - a for a, b in zip(cu, cu[1:])]


def flop_breakdown(hf_config: Any, seq_lens: Sequence[int], *, causal: bool = True,
                   output_size: Optional[int] = None) -> dict[str, float]:
    """Forward FLOPs (2 x MACs) of one pass over sequences of ``seq_lens`` tokens, by part.

    Args:
        hf_config: HF config of a registered model family (or its :func:`model_shape`).
        seq_lens: token count of each sequence (packed: the ``cu_seqlens`` differences; no padding).
        causal: count the s(s+1)/2 (query, key) pairs of causal attention (False: all s^2, as a
            FLOP counter of dense SDPA sees it).
        output_size: width of the output layer (default the vocabulary; 1 for a value head).

    Returns:
        {"attn_proj", "attn_core", "mlp_dense", "moe_routed", "moe_shared", "router", "output"} -> FLOPs.

    Raises:
        ValueError: a negative sequence length.
    """
    s = model_shape(hf_config)
    lens = [int(x) for x in seq_lens]
    if any(x < 0 for x in lens):
        raise ValueError(f"sequence lengths must be >= 0, got {lens[:8]}")
    tokens = sum(lens)
    pairs = sum(x * (x + 1) // 2 if causal else x * x for x in lens)
    h, nh, m = s.hidden_size, s.num_attention_heads, s.mla
    if m is not None:  # multi-head latent attention
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * nh * d_qk if m.q_lora_rank else h * nh * d_qk
        proj = q + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * nh * (m.qk_nope_head_dim + d_v)
    else:
        d_qk = d_v = s.head_dim
        proj = h * nh * d_qk + 2 * h * s.num_key_value_heads * d_qk
    proj += nh * d_v * h
    n_layers, n_moe = len(s.moe_layers), sum(s.moe_layers)
    macs = {
        "attn_proj": n_layers * tokens * proj,
        "attn_core": n_layers * pairs * nh * (d_qk + d_v),
        "mlp_dense": (n_layers - n_moe) * tokens * 3 * h * s.intermediate_size,
        "moe_routed": n_moe * tokens * s.num_experts_per_tok * 3 * h * s.moe_intermediate_size,
        "moe_shared": n_moe * tokens * 3 * h * s.shared_expert_intermediate_size,
        "router": n_moe * tokens * h * s.num_experts,
        "output": tokens * h * (s.vocab_size if output_size is None else output_size),
    }
    return {k: 2.0 * v for k, v in macs.items()}


def forward_flops(hf_config: Any, seq_lens: Sequence[int], *, causal: bool = True,
                  output_size: Optional[int] = None) -> float:
    """Total forward FLOPs of one pass (sum of :func:`flop_breakdown`)."""
    return sum(flop_breakdown(hf_config, seq_lens, causal=causal, output_size=output_size).values())


def logprob_flops(hf_config: Any, seq_lens: Sequence[int]) -> float:
    """FLOPs of a log-prob (forward-only) pass: 1 x forward."""
    return forward_flops(hf_config, seq_lens)


def training_flops(hf_config: Any, seq_lens: Sequence[int], *, output_size: Optional[int] = None) -> float:
    """FLOPs of one training pass (forward + backward = 3 x forward; backward = 2 x forward)."""
    return 3.0 * forward_flops(hf_config, seq_lens, output_size=output_size)


def peak_tflops(hardware: Any = None, device_name: Optional[str] = None) -> Optional[float]:
    """Dense BF16 peak TFLOP/s of one device, or None when unknown (CPU without ``hardware.peak_bf16_tflops``).

    Order: ``hardware.peak_bf16_tflops`` (recipe), ``hardware.gpu`` (moerl.parallel.hardware.GPUS),
    else the CUDA device name (``torch.cuda.get_device_name()``, or ``device_name``) matched against the
    same table (e.g. "NVIDIA H100 80GB HBM3" -> H100, "NVIDIA H100 PCIe" -> H100-PCIE). MFU is always
    against the BF16 peak (also for FP8 training).
    """
    from moerl.parallel.hardware import GPUS, gpu_spec

    if hardware is not None and getattr(hardware, "peak_bf16_tflops", None):
        return float(hardware.peak_bf16_tflops)
    if hardware is not None and getattr(hardware, "gpu", None):
        return float(gpu_spec(hardware.gpu).bf16_tflops)
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    words = device_name.upper().replace("_", " ").replace("-", " ").split()
    for name in sorted(GPUS, key=len, reverse=True):  # H100-PCIE before H100
        parts = name.split("-")
        if parts[0] in words and all(p.replace("GB", "") in " ".join(words) for p in parts[1:]):
            return float(GPUS[name].bf16_tflops)
    return None


def mfu(flops: float, seconds: float, num_devices: int, peak: Optional[float]) -> Optional[float]:
    """Model-FLOPs utilisation: ``flops / seconds / num_devices / (peak * 1e12)``; None when ``peak`` is None.

    Args:
        flops: model FLOPs done by all devices together.
        seconds: wall seconds they took.
        num_devices: devices that shared the work.
        peak: dense peak TFLOP/s of one device (:func:`peak_tflops`).
    """
    if peak is None or seconds <= 0 or num_devices < 1:
        return None
    return flops / seconds / num_devices / (peak * 1e12)

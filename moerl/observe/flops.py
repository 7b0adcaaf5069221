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
* MLP, gated (SwiGLU: gate, up, down): 3*h*f MACs for width f; a dense layer uses ``intermediate_size``,
  an MoE layer top_k experts of ``moe_intermediate_size`` plus the shared experts' total width, plus the
  router h*num_experts (and Qwen2-MoE's shared-expert gate h*1);
* output layer: h*vocab_size per token (``output_size`` replaces the vocabulary for a value head).

The layer pattern follows each family's HF modeling code: Qwen3-MoE/Qwen2-MoE (``mlp_only_layers``,
``decoder_sparse_step``), DeepSeek-V3 (``first_k_dense_replace``, ``moe_layer_freq``), Mixtral (every
layer MoE with experts of ``intermediate_size``: a config without ``moe_intermediate_size``).
Fields are read with ``getattr`` so a transformers config, moerl's
``model.hf_config`` section or any object with these attributes works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["ModelShape", "model_shape", "forward_flops", "flop_breakdown", "training_flops", "logprob_flops",
           "seq_lens_from_cu_seqlens", "peak_tflops", "mfu"]


@dataclass(frozen=True)
class ModelShape:
    """The shapes the FLOP count needs (read from an HF config by :func:`model_shape`).

    ``moe_layers[i]`` is True for a layer whose MLP is an MoE block. ``q_lora_rank`` / ``kv_lora_rank``
    are None for grouped-query attention; ``kv_lora_rank`` set means multi-head latent attention.
    ``shared_expert_size`` is the total width of the shared experts of an MoE layer (0: none).
    """

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    qk_head_dim: int  # per head, scores (MLA: nope + rope)
    v_head_dim: int
    moe_layers: tuple[bool, ...]
    intermediate_size: int  # dense MLP width
    moe_intermediate_size: int  # one routed expert's width
    num_experts: int
    top_k: int
    shared_expert_size: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(h, 1)) on the shared expert
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: int = 0


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def model_shape(hf_config: Any) -> ModelShape:
    """Read a :class:`ModelShape` from an HF config (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, Mixtral naming).

    Raises:
        ValueError: a field the count needs is missing or not positive (hidden_size, num_hidden_layers,
            num_attention_heads, vocab_size), naming it.
    """
    h = _get(hf_config, "hidden_size")
    n_layers = _get(hf_config, "num_hidden_layers")
    n_heads = _get(hf_config, "num_attention_heads")
    vocab = _get(hf_config, "vocab_size")
    for name, v in (("hidden_size", h), ("num_hidden_layers", n_layers), ("num_attention_heads", n_heads),
                    ("vocab_size", vocab)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"FLOP count: the HF config's {name} must be a positive int, got {v!r}")
    kv_lora = _get(hf_config, "kv_lora_rank")
    if kv_lora:  # multi-head latent attention (DeepseekV3Config)
        nope, rope = _get(hf_config, "qk_nope_head_dim", default=0), _get(hf_config, "qk_rope_head_dim", default=0)
        attn = dict(num_kv_heads=n_heads, qk_head_dim=nope + rope, v_head_dim=_get(hf_config, "v_head_dim"),
                    q_lora_rank=_get(hf_config, "q_lora_rank"), kv_lora_rank=kv_lora, qk_rope_head_dim=rope)
    else:
        d = _get(hf_config, "head_dim", default=h // n_heads)
        attn = dict(num_kv_heads=_get(hf_config, "num_key_value_heads", default=n_heads), qk_head_dim=d, v_head_dim=d)
    n_exp = _get(hf_config, "num_experts", "n_routed_experts", "num_local_experts", default=0)
    top_k = _get(hf_config, "num_experts_per_tok", default=0)
    dense_f = _get(hf_config, "intermediate_size", default=0)
    if _get(hf_config, "first_k_dense_replace") is not None:  # DeepSeek-V3
        k, freq = hf_config.first_k_dense_replace, _get(hf_config, "moe_layer_freq", default=1)
        moe = [n_exp > 0 and i >= k and i % freq == 0 for i in range(n_layers)]
        shared = _get(hf_config, "n_shared_experts", default=0) * _get(hf_config, "moe_intermediate_size", default=0)
        moe_f = _get(hf_config, "moe_intermediate_size", default=0)
    elif _get(hf_config, "moe_intermediate_size") is None:  # Mixtral: every layer MoE, experts of intermediate_size
        moe, shared, moe_f = [True] * n_layers, 0, dense_f
    else:  # Qwen3-MoE / Qwen2-MoE
        skip = set(_get(hf_config, "mlp_only_layers", default=[]))
        step = _get(hf_config, "decoder_sparse_step", default=1)
        moe = [i not in skip and n_exp > 0 and (i + 1) % step == 0 for i in range(n_layers)]
        shared = _get(hf_config, "shared_expert_intermediate_size", default=0)
        moe_f = _get(hf_config, "moe_intermediate_size", default=0)
    return ModelShape(hidden_size=h, vocab_size=vocab, num_heads=n_heads, moe_layers=tuple(moe),
                      intermediate_size=dense_f, moe_intermediate_size=moe_f, num_experts=n_exp, top_k=top_k,
                      shared_expert_size=shared,
                      shared_expert_gate=bool(shared) and _get(hf_config, "model_type") == "qwen2_moe", **attn)


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
        hf_config: HF config object (or :class:`ModelShape`).
        seq_lens: token count of each sequence (packed: the ``cu_seqlens`` differences; no padding).
        causal: count the s(s+1)/2 (query, key) pairs of causal attention (False: all s^2, as a
            FLOP counter of dense SDPA sees it).
        output_size: width of the output layer (default the vocabulary; 1 for a value head).

    Returns:
        {"attn_proj", "attn_core", "mlp_dense", "moe_routed", "moe_shared", "router", "output"} -> FLOPs.

    Raises:
        ValueError: a negative sequence length.
    """
    s = hf_config if isinstance(hf_config, ModelShape) else model_shape(hf_config)
    lens = [int(x) for x in seq_lens]
    if any(x < 0 for x in lens):
        raise ValueError(f"sequence lengths must be >= 0, got {lens[:8]}")
    tokens = sum(lens)
    pairs = sum(x * (x + 1) // 2 if causal else x * x for x in lens)
    h, nh = s.hidden_size, s.num_heads
    if s.kv_lora_rank:
        q = h * s.q_lora_rank + s.q_lora_rank * nh * s.qk_head_dim if s.q_lora_rank else h * nh * s.qk_head_dim
        nope = s.qk_head_dim - s.qk_rope_head_dim
        proj = q + h * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank * nh * (nope + s.v_head_dim)
    else:
        proj = h * nh * s.qk_head_dim + 2 * h * s.num_kv_heads * s.qk_head_dim
    proj += nh * s.v_head_dim * h
    n_layers, n_moe = len(s.moe_layers), sum(s.moe_layers)
    macs = {
        "attn_proj": n_layers * tokens * proj,
        "attn_core": n_layers * pairs * nh * (s.qk_head_dim + s.v_head_dim),
        "mlp_dense": (n_layers - n_moe) * tokens * 3 * h * s.intermediate_size,
        "moe_routed": n_moe * tokens * s.top_k * 3 * h * s.moe_intermediate_size,
        "moe_shared": n_moe * tokens * (3 * h * s.shared_expert_size + (h if s.shared_expert_gate else 0)),
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

"""FP8 rollout weights: the Hugging Face FP8 checkpoint layout SGLang loads, made from (and read back
into) full-precision HF state dicts.

Layout (DeepSeek-V3's HF release; SGLang's / vLLM's ``Fp8Config`` with ``weight_block_size``; the
transformers ``FineGrainedFP8Config``):

* every quantised Linear weight ``<module>.weight`` [out, in] becomes ``<module>.weight``
  float8_e4m3fn plus ``<module>.weight_scale_inv`` [ceil(out/128), ceil(in/128)] float32
  (moerl.precision.fp8.quantize_weight: 128 x 128 blocks, ``w ~ weight * weight_scale_inv``);
* config.json gains ``quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme:
  dynamic, weight_block_size: [128, 128]}`` (``scale_fmt: ue8m0`` with power-of-two scales, as
  DeepSeek-V3.1); activations are quantised on the fly by the server (``dynamic``);
* kept in full precision (as DeepSeek-V3's release and SGLang's loaders keep them): embeddings
  (``embed_tokens``), ``lm_head``, norms and every other 1-D tensor (biases,
  ``e_score_correction_bias``), the MoE router (``mlp.gate.weight``) and Qwen2-MoE's
  ``shared_expert_gate``.

``rollout.weight_dtype`` (moerl.config.schema) chooses what the trainer sends in every sync mode
(:func:`rollout_state_dict`, applied by moerl.train.weight_sync before the mode-specific send):
``auto`` = as exported (the servers cast to their serving dtype), ``bf16`` = floating tensors cast to
bfloat16, ``fp8`` = the layout above. The reference server (moerl.rollout.engine_weights) folds each
(weight, weight_scale_inv) pair back with :class:`Fp8Dequantizer` into its compute dtype.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from moerl.precision.fp8 import BLOCK, FP8_DTYPE, dequantize_weight, quantize_weight, scale_grid_shape

__all__ = ["WEIGHT_DTYPES", "SCALE_SUFFIX", "fp8_quantization_config", "is_quantized_weight_name",
           "quantize_state_dict", "rollout_state_dict", "rollout_hf_config", "fp8_block_size",
           "Fp8Dequantizer", "expected_served_weights", "sglang_fp8_shape_errors"]

WEIGHT_DTYPES = ("auto", "bf16", "fp8")
SCALE_SUFFIX = "_scale_inv"  # <module>.weight -> <module>.weight_scale_inv

# Linear weights that stay in full precision (besides every non-2-D tensor): embeddings, the output
# layer, MoE routers (``mlp.gate.weight``: Qwen2/3-MoE, DeepSeek-V3, Mixtral's ``block_sparse_moe.gate``)
# and Qwen2-MoE's shared-expert gate.
_KEEP_RE = re.compile(r"(^|\.)(embed_tokens|lm_head|gate|shared_expert_gate)\.weight$")


def fp8_quantization_config(block_size: Sequence[int] = (BLOCK, BLOCK), pow2: bool = False) -> dict:
    """The config.json ``quantization_config`` of moerl's FP8 checkpoints (SGLang ``Fp8Config``
    fields: quant_method, fmt, activation_scheme, weight_block_size; ``scale_fmt: ue8m0`` for pow2)."""
    out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [int(block_size[0]), int(block_size[1])]}
    if pow2:
        out["scale_fmt"] = "ue8m0"
    return out


def is_quantized_weight_name(name: str, tensor: torch.Tensor) -> bool:
    """True for the HF tensors the FP8 layout quantises: 2-D floating ``*.weight`` of Linear layers
    other than embeddings, lm_head, routers (``*.gate.weight``), shared-expert gates and norms."""
    return (tensor.dim() == 2 and tensor.is_floating_point() and tensor.dtype != FP8_DTYPE
            and name.endswith(".weight") and _KEEP_RE.search(name) is None)


def quantize_state_dict(hf_state_dict: Mapping[str, torch.Tensor], block_size: Sequence[int] = (BLOCK, BLOCK),
                        pow2: bool = False) -> dict[str, torch.Tensor]:
    """The FP8 layout of an HF state dict: each quantised weight is followed by its
    ``weight_scale_inv`` (so buckets usually keep a pair together); other tensors unchanged.

    Args:
        hf_state_dict: {HF name: tensor [out, in] / 1-D ...} full precision, any device.
        block_size: (block_n, block_k), 128 x 128 for SGLang.
        pow2: UE8M0 (power-of-two) scales.
    Returns: a new dict (CPU tensors for the quantised pairs, others as given).
    Raises:
        ValueError: a name already ends with ``weight_scale_inv`` (already quantised), or
            moerl.precision.fp8.quantize_weight's errors (NaN/inf weights, named).

    The blocks are quantised by moerl.kernels.fp8_quant.quantize_weight: the native csrc/ kernel
    when it builds here (``moerl doctor``), bitwise equal to moerl.precision.fp8.quantize_weight,
    which runs otherwise.
    """
    from moerl.kernels.fp8_quant import quantize_weight as native_quantize_weight

    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state_dict.items():
        if name.endswith(SCALE_SUFFIX) or t.dtype == FP8_DTYPE:
            raise ValueError(f"{name!r} is already FP8-quantised; quantize_state_dict takes full-precision weights")
        if is_quantized_weight_name(name, t):
            try:  # the native csrc kernel when it is built (bitwise equal to quantize_weight), else the reference
                q, s = native_quantize_weight(t.detach(), block_size, pow2)
            except ValueError as e:
                raise ValueError(f"cannot quantise {name!r} to FP8: {e}") from e
            out[name], out[name + SCALE_SUFFIX] = q, s
        else:
            out[name] = t
    return out


def rollout_state_dict(hf_state_dict: Mapping[str, torch.Tensor], weight_dtype: str,
                       pow2: bool = False) -> Mapping[str, torch.Tensor]:
    """What the trainer sends to the rollout servers for ``rollout.weight_dtype``.

    ``auto``: ``hf_state_dict`` itself (no copy: the sync and the failover restorer share it); ``bf16``: floating tensors cast to bfloat16 (halves fp32 traffic);
    ``fp8``: :func:`quantize_state_dict` with 128 x 128 blocks.
    Raises:
        ValueError: unknown ``weight_dtype`` (names the recipe key), or quantisation errors.
    """
    if weight_dtype == "auto":
        return hf_state_dict
    if weight_dtype == "bf16":
        return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in hf_state_dict.items()}
    if weight_dtype == "fp8":
        return quantize_state_dict(hf_state_dict, (BLOCK, BLOCK), pow2)
    raise ValueError(f"rollout.weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")


def rollout_hf_config(hf_config, weight_dtype: str, pow2: bool = False):
    """The config written beside rollout weights: a deep copy of ``hf_config`` carrying
    :func:`fp8_quantization_config` for ``fp8``, else ``hf_config`` itself."""
    if weight_dtype != "fp8":
        return hf_config
    cfg = copy.deepcopy(hf_config)
    cfg.quantization_config = fp8_quantization_config((BLOCK, BLOCK), pow2)
    return cfg


def fp8_block_size(config: Any) -> Optional[tuple[int, int]]:
    """``weight_block_size`` of an FP8 ``quantization_config`` found on ``config`` (a transformers
    config or a config.json dict), or None when the checkpoint is not block-FP8.

    Raises:
        ValueError: quant_method fp8 without a 2-entry weight_block_size (per-tensor FP8 is not
            supported by moerl's reference server).
    """
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if not qc or qc.get("quant_method") != "fp8":
        return None
    bs = qc.get("weight_block_size")
    if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
        raise ValueError(f"quantization_config {qc} has quant_method fp8 without weight_block_size [n, k]; "
                         f"the reference server reads block-wise FP8 checkpoints only")
    return int(bs[0]), int(bs[1])


class Fp8Dequantizer:
    """Folds (``<m>.weight`` float8_e4m3fn, ``<m>.weight_scale_inv``) pairs back into full-precision
    weights, also when the two arrive in different buckets (weight sync in several calls).

    :meth:`feed` returns the ready tensors: every non-FP8 tensor as is, and ``(name, q * scale)``
    (float32; moerl.precision.fp8.dequantize_weight) for each completed pair; a half pair waits in
    :attr:`pending` for its partner. ``block_size`` is the serving config's weight_block_size.
    """

    def __init__(self, block_size: Sequence[int] = (BLOCK, BLOCK)):
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> {"q": ..., "s": ...}

    def feed(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Return the ready (name, tensor) list for this batch (see the class doc).

        Raises:
            ValueError: a scale whose shape is not the block grid of its weight (names both), or a
                scale that is not floating point. The pending state is left as before the call.
        """
        pending = {k: dict(v) for k, v in self.pending.items()}
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in named:
            if name.endswith(".weight" + SCALE_SUFFIX):
                if not t.is_floating_point():
                    raise ValueError(f"{name!r}: weight_scale_inv must be floating point, got {t.dtype}")
                key, part = name[: -len(SCALE_SUFFIX)], "s"
            elif t.dtype == FP8_DTYPE:
                key, part = name, "q"
            else:
                out.append((name, t))
                continue
            pending.setdefault(key, {})[part] = t
            pair = pending[key]
            if "q" in pair and "s" in pair:
                q, s = pair["q"], pair["s"]
                want = scale_grid_shape(q.shape, self.block_size) if q.dim() == 2 else None
                if want is None or tuple(s.shape) != want:
                    raise ValueError(f"{key + SCALE_SUFFIX!r} has shape {tuple(s.shape)}, but {key!r} {tuple(q.shape)} "
                                     f"with weight_block_size {list(self.block_size)} needs {want}")
                out.append((key, dequantize_weight(q, s, self.block_size, torch.float32)))
                del pending[key]
        # a half pair outlives this call: own its bytes (the caller's tensors may be views of a
        # shared-memory bucket buffer that the next bucket overwrites)
        self.pending = {k: {p: (t if k in self.pending and self.pending[k].get(p) is t else t.clone())
                            for p, t in v.items()} for k, v in pending.items()}
        return out

    def pending_names(self) -> list[str]:
        """Names of half pairs still waiting (sorted)."""
        return sorted(k + (SCALE_SUFFIX if "s" in v else "") for k, v in self.pending.items())


def expected_served_weights(hf_state_dict: Mapping[str, torch.Tensor], weight_dtype: str,
                            serve_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights a server computing in ``serve_dtype`` must hold after a sync of ``hf_state_dict``
    with ``rollout.weight_dtype`` (the trainer's quantise-dequantise; for tests and tools): each
    tensor as sent, FP8 pairs dequantised in float32, then cast to ``serve_dtype``."""
    sent = rollout_state_dict(hf_state_dict, weight_dtype)
    ready = Fp8Dequantizer().feed(sent.items())
    return {n: t.to(serve_dtype) for n, t in ready}


def sglang_fp8_shape_errors(hf_config: Mapping[str, Any], tp_size: int = 1, ep_size: int = 1,
                            block: int = BLOCK) -> list[str]:
    """Why SGLang's block-FP8 loader would refuse this model, as a list of messages ([] = fine).

    SGLang's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` (python/sglang/srt/layers/quantization/fp8.py, the
    same rules as vLLM's) need, per TP partition: each output partition of a merged linear (q/k/v of
    ``qkv_proj``, gate/up of ``gate_up_proj``) and of a column-parallel linear at TP > 1 divisible
    by block_n; the input of a row-parallel linear (o_proj, down_proj) at TP > 1 divisible by
    block_k; and a MoE expert's intermediate size per MoE-TP partition (tp / ep) divisible by block_n
    (and block_k at MoE-TP > 1). ``hf_config``: Qwen3-MoE-style config.json fields (hidden_size,
    num_attention_heads, num_key_value_heads, head_dim, moe_intermediate_size, intermediate_size);
    absent fields are not checked.
    """
    g = hf_config.get
    errors: list[str] = []
    heads, kv, hidden = g("num_attention_heads"), g("num_key_value_heads") or g("num_attention_heads"), g("hidden_size")
    hd = g("head_dim") or (hidden // heads if hidden and heads else None)
    if heads and hd:
        q_part = heads * hd // tp_size
        kv_part = max(1, kv // tp_size) * hd if kv else None
        for what, size in (("q_proj rows (num_attention_heads*head_dim/tp)", q_part),
                           ("k_proj/v_proj rows (num_key_value_heads*head_dim/tp)", kv_part)):
            if size is not None and size % block:
                errors.append(f"{what} = {size} is not divisible by the FP8 block {block} (merged qkv_proj)")
        if tp_size > 1 and q_part % block:
            errors.append(f"o_proj input per TP rank = {q_part} is not divisible by the FP8 block {block}")
    moe_tp = max(1, tp_size // max(1, ep_size))
    inter = g("moe_intermediate_size")
    if inter and (g("num_experts") or g("n_routed_experts")):
        part = inter / moe_tp
        if part != int(part) or int(part) % block:
            errors.append(f"moe_intermediate_size / (tp/ep) = {inter}/{moe_tp} is not a multiple of the FP8 block "
                          f"{block} (expert gate/up rows)")
    dense = g("intermediate_size")
    all_moe = (g("num_experts") or g("n_routed_experts")) and not g("mlp_only_layers") and \
        (g("decoder_sparse_step") in (None, 1)) and not g("first_k_dense_replace")
    if dense and not all_moe:
        part = dense / tp_size
        if part != int(part) or int(part) % block:
            errors.append(f"intermediate_size / tp = {dense}/{tp_size} is not a multiple of the FP8 block {block} "
                          f"(dense gate_up_proj rows)")
    if g("shared_expert_intermediate_size"):
        part = g("shared_expert_intermediate_size") / tp_size
        if part != int(part) or int(part) % block:
            errors.append(f"shared_expert_intermediate_size / tp = {g('shared_expert_intermediate_size')}/{tp_size} "
                          f"is not a multiple of the FP8 block {block}")
    return errors

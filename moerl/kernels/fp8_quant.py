"""Blockwise FP8 (E4M3) quantise / dequantise through the native kernels (csrc/cpu/fp8_quant.cpp,
csrc/cuda/fp8_quant.cu), bitwise equal to the pure-torch reference :mod:`moerl.precision.fp8`
(DeepSeek-V3's 1 x 128 activation tiles and 128 x 128 weight blocks, ``s = max(amax, 1e-4) / 448``,
optional power-of-two scales, round-to-nearest-even E4M3). Each function checks its input as the
reference does, then runs the native op when :func:`moerl.kernels._build.load_native` has it, else
the reference itself (``impl="native"`` raises instead).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from moerl.precision import fp8 as ref

__all__ = ["quantize_weight", "dequantize_weight", "quantize_activation", "dequantize_activation", "native_fp8"]


def native_fp8(device: torch.device, impl: str = "auto") -> bool:
    """True when the native FP8 op runs for tensors on ``device`` (``impl``: auto | native | torch).

    Raises:
        ValueError: unknown ``impl``; moerl.kernels._build.NativeBuildError: "native" and no build.
    """
    from moerl.kernels.fused_logprob import resolve_impl

    return resolve_impl(impl, device) == "native"


def quantize_weight(w: torch.Tensor, block_size: Sequence[int] = (ref.BLOCK, ref.BLOCK), pow2: bool = False,
                    impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moerl.precision.fp8.quantize_weight` (same arguments, checks, errors and bits):
    w [N, K] float -> (float8_e4m3fn [N, K], float32 scales [ceil(N/bn), ceil(K/bk)])."""
    ref._check_float("w", w, dims=2)
    bn, bk = (ref._check_block(int(b), "block_size entry") for b in block_size)
    if not native_fp8(w.device, impl):
        return ref.quantize_weight(w, (bn, bk), pow2)
    return tuple(torch.ops.moerl.fp8_quantize_blockwise(w.detach(), bn, bk, bool(pow2)))


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, block_size: Sequence[int] = (ref.BLOCK, ref.BLOCK),
                      dtype: torch.dtype = torch.float32, impl: str = "auto") -> torch.Tensor:
    """:func:`moerl.precision.fp8.dequantize_weight`: q [N, K] with scales -> [N, K] of ``dtype``
    (``q * s`` in float32, then one cast)."""
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [out, in], got shape {tuple(q.shape)}")
    bn, bk = (ref._check_block(int(b), "block_size entry") for b in block_size)
    if tuple(scale_inv.shape) != ref.scale_grid_shape(q.shape, (bn, bk)):
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match a weight of shape "
                         f"{tuple(q.shape)} with {bn}x{bk} blocks (expected {ref.scale_grid_shape(q.shape, (bn, bk))})")
    if not native_fp8(q.device, impl):
        return ref.dequantize_weight(q, scale_inv, (bn, bk), dtype)
    return torch.ops.moerl.fp8_dequantize_blockwise(q, scale_inv, bn, bk).to(dtype)


def quantize_activation(x: torch.Tensor, block: int = ref.BLOCK, pow2: bool = False,
                        impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moerl.precision.fp8.quantize_activation`: x [..., K] -> (e4m3 [..., K], float32
    scales [..., ceil(K / block)]), per 1 x ``block`` tile."""
    ref._check_float("x", x)
    ref._check_block(block, "block")
    if not native_fp8(x.device, impl):
        return ref.quantize_activation(x, block, pow2)
    k = x.shape[-1]
    q, s = torch.ops.moerl.fp8_quantize_blockwise(x.detach().reshape(-1, k), 1, block, bool(pow2))
    return q.view(x.shape), s.view(*x.shape[:-1], math.ceil(k / block))


def dequantize_activation(q: torch.Tensor, scales: torch.Tensor, block: int = ref.BLOCK,
                          impl: str = "auto") -> torch.Tensor:
    """:func:`moerl.precision.fp8.dequantize_activation`: float32 [..., K] = q * its tile's scale."""
    ref._check_block(block, "block")
    k = q.shape[-1]
    nb = math.ceil(k / block)
    if tuple(scales.shape) != (*q.shape[:-1], nb):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match q {tuple(q.shape)} with 1x{block} "
                         f"tiles (expected {(*q.shape[:-1], nb)})")
    if not native_fp8(q.device, impl):
        return ref.dequantize_activation(q, scales, block)
    out = torch.ops.moerl.fp8_dequantize_blockwise(q.reshape(-1, k), scales.reshape(-1, nb), 1, block)
    return out.view(q.shape)

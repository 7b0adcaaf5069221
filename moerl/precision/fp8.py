"""A pure-torch reference of DeepSeek-V3's blockwise FP8 (E4M3) quantisation and block-scaled GEMM.

Scheme (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.3 "FP8 Training", "Fine-Grained
Quantization" and "Increasing Accumulation Precision"):

* activations are scaled per **1 x 128 tile** (per token, per 128 channels of the hidden dim);
* weights are scaled per **128 x 128 block** (128 output rows x 128 input columns);
* the format is ``torch.float8_e4m3fn`` (largest finite value 448); the scale of a tile / block is
  ``s = amax / 448`` (amax = largest |x| in it), the stored value is ``q = fp8(clamp(x / s, -448, 448))``
  (round to nearest even) and the dequantised value is ``q * s``;
* optional power-of-two scales (UE8M0, the DeepSeek-V3.1 / DeepGEMM format, ``scale_fmt: ue8m0`` in
  the checkpoint config): ``s = 2 ** ceil(log2(amax / 448))``, i.e. rounded UP so ``x / s`` never
  exceeds 448;
* the GEMM multiplies FP8 operands and accumulates in FP32, applying the two scales once per K-block
  of 128 (the report's "promotion to CUDA cores every 128 elements").

Hugging Face / SGLang / vLLM checkpoint layout of such a weight (DeepSeek-V3's own release): ``weight``
[out, in] float8_e4m3fn and ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] float32 holding ``s``
(despite its name it is the DEQUANTISATION multiplier: ``w = weight * weight_scale_inv`` blockwise).

Ragged edges: a dim that is not a multiple of the block size ends with one partial block (e.g. 300
rows -> blocks of 128, 128, 44); its scale comes from the elements it holds (the tensor is padded
with zeros, which never raise an amax). All-zero blocks: amax is clamped to at least
:data:`AMAX_FLOOR` = 1e-4 before the division (the convention of DeepGEMM's ``per_block_cast_to_fp8``
and SGLang's/vLLM's block quantisers), so a scale is never 0, NaN or inf and zeros stay zeros.

Everything here is exact, deterministic torch on any device (CPU included): torch has the
float8_e4m3fn dtype and its casts; the GEMM upcasts the FP8 operands to FP32 (the products of two
E4M3 values are exact in FP32), so it is a numerical reference, not a fast kernel.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["FP8_DTYPE", "FP8_E4M3_MAX", "AMAX_FLOOR", "BLOCK", "scale_from_amax", "quantize_activation",
           "dequantize_activation", "quantize_weight", "dequantize_weight", "block_scaled_gemm",
           "scale_grid_shape"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # amax clamp of DeepGEMM's per_block_cast_to_fp8 (all-zero blocks: scale > 0)
BLOCK = 128  # DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks


def _check_float(name: str, x: torch.Tensor, dims: Optional[int] = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name} must be a float32/bfloat16/float16/float64 tensor, got {x.dtype}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(x.shape)}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"{name} must be non-empty with at least one dim, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or inf values; FP8 scales need finite inputs")


def _check_block(block: int, what: str) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{what} must be an int >= 1, got {block!r}")
    return block


def scale_grid_shape(shape: Sequence[int], block_size: Sequence[int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """``[ceil(out / block_n), ceil(in / block_k)]``: the ``weight_scale_inv`` shape of a weight
    of ``shape`` [out, in] (HF/SGLang FP8 checkpoint layout)."""
    bn, bk = (_check_block(int(b), "block_size entry") for b in block_size)
    return (math.ceil(shape[0] / bn), math.ceil(shape[1] / bk))


def scale_from_amax(amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """Scale(s) ``s`` of tiles / blocks with largest magnitude ``amax`` (any shape, float32 out).

    ``s = max(amax, AMAX_FLOOR) / 448``; with ``pow2`` (UE8M0) ``s = 2 ** ceil(log2(that))``, the
    smallest power of two not below it (DeepGEMM ``ceil_to_ue8m0``). Never 0, NaN or inf for finite
    ``amax``.
    """
    s = amax.to(torch.float32).clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return s


def _to_fp8(x_scaled: torch.Tensor) -> torch.Tensor:
    # torch's float -> float8_e4m3fn cast is not guaranteed to saturate on every device: clamp first
    return x_scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def quantize_activation(x: torch.Tensor, block: int = BLOCK, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations per 1 x ``block`` tile along the last dim (DeepSeek-V3 section 3.3).

    Args:
        x: [..., K] float tensor (fp32/bf16/fp16), finite.
        block: tile width (128 in DeepSeek-V3).
        pow2: power-of-two (UE8M0) scales, rounded up.
    Returns:
        ``(q, scales)``: q [..., K] float8_e4m3fn; scales [..., ceil(K / block)] float32 (the
        dequantisation multipliers, ``x ~ q * scale`` per tile). A ragged last tile (K % block != 0)
        gets its own scale from its own elements.
    Raises:
        ValueError: non-float / FP8 input, empty, NaN or inf, or block < 1.
    """
    _check_float("x", x)
    _check_block(block, "block")
    k = x.shape[-1]
    nb = math.ceil(k / block)
    xf = x.to(torch.float32)
    padded = torch.nn.functional.pad(xf, (0, nb * block - k)).reshape(*x.shape[:-1], nb, block)
    scales = scale_from_amax(padded.abs().amax(dim=-1), pow2)
    q = _to_fp8(padded / scales.unsqueeze(-1)).reshape(*x.shape[:-1], nb * block)[..., :k]
    return q.contiguous(), scales


def dequantize_activation(q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize_activation`: [..., K] float32 = ``q * scale`` of its tile.

    Raises:
        ValueError: ``scales`` is not [..., ceil(K / block)] for ``q`` [..., K].
    """
    _check_block(block, "block")
    k = q.shape[-1]
    nb = math.ceil(k / block)
    if tuple(scales.shape) != (*q.shape[:-1], nb):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match q {tuple(q.shape)} with 1x{block} "
                         f"tiles (expected {(*q.shape[:-1], nb)})")
    return q.to(torch.float32) * scales.to(torch.float32).repeat_interleave(block, dim=-1)[..., :k]


def quantize_weight(w: torch.Tensor, block_size: Sequence[int] = (BLOCK, BLOCK),
                    pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [out, in] per ``block_n x block_k`` block (DeepSeek-V3: 128 x 128).

    Args:
        w: [N, K] float tensor (fp32/bf16/fp16; a Linear weight, out x in), finite.
        block_size: (block_n, block_k) = the checkpoint's ``weight_block_size``.
        pow2: power-of-two (UE8M0) scales, rounded up.
    Returns:
        ``(weight, weight_scale_inv)``: weight [N, K] float8_e4m3fn; weight_scale_inv
        [ceil(N / block_n), ceil(K / block_k)] float32 (``w ~ weight * weight_scale_inv`` blockwise,
        the HF/SGLang layout). Ragged edge blocks get scales from their own elements.
    Raises:
        ValueError: w not 2-D float, empty, NaN or inf, or a block size < 1.
    """
    _check_float("w", w, dims=2)
    bn, bk = (_check_block(int(b), "block_size entry") for b in block_size)
    n, k = w.shape
    gn, gk = scale_grid_shape((n, k), (bn, bk))
    wf = torch.nn.functional.pad(w.to(torch.float32), (0, gk * bk - k, 0, gn * bn - n))
    blocks = wf.reshape(gn, bn, gk, bk)
    scales = scale_from_amax(blocks.abs().amax(dim=(1, 3)), pow2)  # [gn, gk]
    q = _to_fp8(blocks / scales[:, None, :, None]).reshape(gn * bn, gk * bk)[:n, :k]
    return q.contiguous(), scales


def _expand_weight_scales(scales: torch.Tensor, shape: Sequence[int], block_size: Sequence[int]) -> torch.Tensor:
    n, k = shape
    bn, bk = (_check_block(int(b), "block_size entry") for b in block_size)
    if tuple(scales.shape) != scale_grid_shape((n, k), (bn, bk)):
        raise ValueError(f"weight_scale_inv shape {tuple(scales.shape)} does not match a weight of shape {(n, k)} "
                         f"with {bn}x{bk} blocks (expected {scale_grid_shape((n, k), (bn, bk))})")
    s = scales.to(torch.float32)
    return s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, block_size: Sequence[int] = (BLOCK, BLOCK),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_weight`: ``q * weight_scale_inv`` of its block, computed in FP32
    (one rounding: E4M3 values and their products with an FP32 scale are exact unless the scale
    is not a power of two) and then cast to ``dtype`` (a second rounding for bf16/fp16).

    Args:
        q: [N, K] float8_e4m3fn (any float dtype is accepted and upcast).
        scale_inv: [ceil(N / block_n), ceil(K / block_k)] float32.
        block_size: (block_n, block_k).
        dtype: output dtype (the serving dtype).
    Returns: [N, K] tensor of ``dtype``.
    Raises:
        ValueError: q not 2-D, or scale_inv not of the block grid's shape.
    """
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [out, in], got shape {tuple(q.shape)}")
    return (q.to(torch.float32) * _expand_weight_scales(scale_inv, q.shape, block_size)).to(dtype)


def block_scaled_gemm(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                      block: int = BLOCK, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference FP8 GEMM ``y = x @ w.T`` with per-K-block scale application and FP32 accumulation.

    For each K-block b of ``block`` columns: ``partial = xq[:, b] @ wq[:, b].T`` in FP32 (FP8 operands
    upcast: each product is exact), then ``acc += partial * x_scales[:, b, None] *
    w_scales[n // block_n, b]`` (DeepSeek-V3 section 3.3: the partial sums are promoted to FP32 and
    scaled every 128 elements). Weight blocks are square here (block_n = block_k = ``block``), as in
    DeepSeek-V3's 128 x 128.

    Args:
        xq: [M, K] float8_e4m3fn activations from :func:`quantize_activation`.
        x_scales: [M, ceil(K / block)] float32.
        wq: [N, K] float8_e4m3fn weight from :func:`quantize_weight`.
        w_scales: [ceil(N / block), ceil(K / block)] float32 (``weight_scale_inv``).
        block: the tile / block width.
        out_dtype: dtype of the result (accumulation is FP32 regardless).
    Returns: [M, N] tensor of ``out_dtype``.
    Raises:
        ValueError: shapes that do not agree (named).
    """
    _check_block(block, "block")
    if xq.dim() != 2 or wq.dim() != 2:
        raise ValueError(f"xq and wq must be 2-D, got {tuple(xq.shape)} and {tuple(wq.shape)}")
    m, k = xq.shape
    n, k2 = wq.shape
    if k != k2:
        raise ValueError(f"inner dims differ: xq [{m}, {k}] vs wq [{n}, {k2}]")
    nb = math.ceil(k / block)
    if tuple(x_scales.shape) != (m, nb):
        raise ValueError(f"x_scales shape {tuple(x_scales.shape)} must be {(m, nb)}")
    ws = _expand_weight_scales(w_scales, (n, k), (block, block))  # checks the grid
    ws_rows = ws[:, ::block]  # [N, nb]: the scale of row n's block in each K-block
    xs = x_scales.to(torch.float32)
    acc = torch.zeros(m, n, dtype=torch.float32, device=xq.device)
    for b in range(nb):
        lo, hi = b * block, min(k, (b + 1) * block)
        partial = xq[:, lo:hi].to(torch.float32) @ wq[:, lo:hi].to(torch.float32).T
        acc += partial * xs[:, b:b + 1] * ws_rows[:, b][None, :]
    return acc.to(out_dtype)

"""Token log-probabilities and entropies from logits, memory-frugal and in (at least) float32.

Both functions divide the logits by the sampling temperature first: the trainer must use the same
temperature as the rollout engine, or the importance ratio is wrong from step 0 (REFERENCE.md s.1).

Memory: the softmax over the vocabulary is never materialised for all tokens at once. Forward and
backward run over chunks of tokens (custom autograd functions); besides the input logits only one
float per token is saved for backward, and the float32 temporaries are ``chunk_size x V``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["token_log_probs_from_logits", "entropy_from_logits"]

# Default chunk: about 2**26 float32 elements (256 MiB) per temporary.
_CHUNK_ELEMENTS = 1 << 26


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, Tensor):
        temperature = float(temperature)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be a finite float > 0 (the rollout engine's sampling temperature), got {temperature}"
        )
    return float(temperature)


def _chunk_rows(num_rows: int, vocab: int, chunk_size: Optional[int]) -> int:
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 tokens, got {chunk_size}")
    return max(1, min(chunk_size, num_rows))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _TokenLogProbs(torch.autograd.Function):
    """log_softmax(logits / T)[label], chunked; labels < 0 give 0 and no gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, chunk: int) -> Tensor:  # type: ignore[override]
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        lab = labels.reshape(-1)
        cdt = _compute_dtype(logits.dtype)
        n = flat.shape[0]
        out = torch.empty(n, dtype=cdt, device=logits.device)
        lse = torch.empty(n, dtype=cdt, device=logits.device)
        safe = lab.clamp(min=0)
        for s in range(0, n, chunk):
            x = flat[s : s + chunk].to(cdt) / temperature
            l = torch.logsumexp(x, dim=-1)
            out[s : s + chunk] = x.gather(1, safe[s : s + chunk, None]).squeeze(1) - l
            lse[s : s + chunk] = l
        out = torch.where(lab >= 0, out, torch.zeros_like(out))
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        lab = labels.reshape(-1)
        cdt = lse.dtype
        g = torch.where(lab >= 0, grad_out.reshape(-1).to(cdt), torch.zeros((), dtype=cdt, device=lse.device))
        safe = lab.clamp(min=0)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            x = flat[s : s + chunk].to(cdt) / t
            gc = g[s : s + chunk, None]
            # d/dx (x_label - lse(x)) = onehot(label) - softmax(x); then d/dlogits = d/dx / T
            gx = -torch.exp(x - lse[s : s + chunk, None]) * gc
            gx.scatter_add_(1, safe[s : s + chunk, None], gc)
            grad[s : s + chunk] = (gx / t).to(grad.dtype)
        return grad.view_as(logits), None, None, None


class _Entropy(torch.autograd.Function):
    """H(softmax(logits / T)) per token, chunked."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk: int) -> Tensor:  # type: ignore[override]
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        cdt = _compute_dtype(logits.dtype)
        n = flat.shape[0]
        ent = torch.empty(n, dtype=cdt, device=logits.device)
        lse = torch.empty(n, dtype=cdt, device=logits.device)
        for s in range(0, n, chunk):
            x = flat[s : s + chunk].to(cdt) / temperature
            l = torch.logsumexp(x, dim=-1)
            p = torch.exp(x - l[:, None])
            ent[s : s + chunk] = l - (p * x).sum(dim=-1)
            lse[s : s + chunk] = l
        ctx.save_for_backward(logits, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return ent.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        cdt = lse.dtype
        g = grad_out.reshape(-1).to(cdt)
        mean_x = lse - ent  # E_p[x] = lse - H
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            x = flat[s : s + chunk].to(cdt) / t
            p = torch.exp(x - lse[s : s + chunk, None])
            # dH/dx_k = -p_k (x_k - E_p[x]); then d/dlogits = d/dx / T
            gx = -p * (x - mean_x[s : s + chunk, None]) * g[s : s + chunk, None]
            grad[s : s + chunk] = (gx / t).to(grad.dtype)
        return grad.view_as(logits), None, None


def token_log_probs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float, *, chunk_size: Optional[int] = None
) -> Tensor:
    """Log-probability of each label token: ``log_softmax(logits / temperature)[..., label]``.

    Computed in float32 (float64 stays float64) whatever the logits dtype, over chunks of tokens;
    differentiable w.r.t. ``logits`` (gradient returned in the logits' dtype). Labels are usually the
    input ids shifted left by one (the caller aligns them).

    Args:
        logits: float [B, S, V] (any leading dims [..., V]); bf16/fp16/fp32/fp64.
        labels: long [B, S] (the leading dims of ``logits``), values in [0, V); a negative label
            (e.g. -100 padding) gives log-prob 0.0 and no gradient.
        temperature: the rollout engine's sampling temperature (> 0).
        chunk_size: tokens per chunk (default: about 2**26 / V).

    Returns:
        float32 (or float64) tensor [B, S].

    Raises:
        TypeError: labels not an integer tensor, temperature not a number.
        ValueError: shape mismatch, label >= V, temperature <= 0, chunk_size < 1.
    """
    temperature = _check_temperature(temperature)
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"labels must be an integer (long) tensor of token ids, got {labels.dtype}")
    if logits.dim() < 2 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])} (logits [B, S, V], labels [B, S])"
        )
    vocab = logits.shape[-1]
    if labels.numel() and int(labels.max()) >= vocab:
        raise ValueError(f"labels contain token id {int(labels.max())} >= vocab size {vocab} of the logits")
    chunk = _chunk_rows(labels.numel(), vocab, chunk_size)
    if labels.numel() == 0:
        return torch.zeros(labels.shape, dtype=_compute_dtype(logits.dtype), device=logits.device)
    return _TokenLogProbs.apply(logits, labels.long(), temperature, chunk)


def entropy_from_logits(logits: Tensor, temperature: float, *, chunk_size: Optional[int] = None) -> Tensor:
    """Entropy of the sampling distribution per token: ``H(softmax(logits / temperature))`` in nats.

    Computed in float32 (float64 stays float64), over chunks of tokens; differentiable w.r.t.
    ``logits`` (for an entropy bonus).

    Args:
        logits: float [B, S, V] (any leading dims [..., V]).
        temperature: sampling temperature (> 0).
        chunk_size: tokens per chunk (default: about 2**26 / V).

    Returns:
        float32 (or float64) tensor [B, S].

    Raises:
        TypeError / ValueError: non-float logits, temperature <= 0, chunk_size < 1.
    """
    temperature = _check_temperature(temperature)
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"logits must be [B, S, V] (at least 2-D), got shape {tuple(logits.shape)}")
    n = logits.numel() // max(logits.shape[-1], 1)
    chunk = _chunk_rows(n, logits.shape[-1], chunk_size)
    if n == 0:
        return torch.zeros(logits.shape[:-1], dtype=_compute_dtype(logits.dtype), device=logits.device)
    return _Entropy.apply(logits, temperature, chunk)

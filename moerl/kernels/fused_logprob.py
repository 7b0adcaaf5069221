"""Fused linear log-prob + entropy: log_softmax and entropy of ``hidden @ weight.T / T`` without the
[tokens, vocab] logits.

RL trainers need, for every response token, ``log p(label)`` and the entropy of the sampling
distribution ``softmax(h W^T / T)`` over the whole vocabulary (151,936 columns for Qwen3). Forming the
logits first costs ``4 * T * V`` bytes in FP32 (5 GB at T = 8192) and as much again for their gradient.
Here the logits exist one ``[token_chunk, vocab_chunk]`` block at a time:

* forward: for each block, ``x = h_blk @ W_blk^T / T`` is folded into per-token running statistics
  with an online log-sum-exp (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
  arXiv 1805.02867): ``m = max x``, ``s = sum exp(x - m)``, ``t = sum exp(x - m) x`` and the label's
  logit. Then ``lse = m + log s``, ``entropy = lse - t / s`` (``H = lse - E_p[x]``) and
  ``log_prob = x_label - lse``.
* vocabulary parallelism (the weight is this TP rank's shard ``[V/tp, H]`` holding token ids
  ``[rank * V/tp, (rank + 1) * V/tp)``, as Megatron's ColumnParallelLinear output layer): each rank
  folds its shard, then ``m`` is all-reduced with MAX and ``s, t`` (rescaled by ``exp(m_r - M)``) and the
  label logit with SUM over the group; the results are identical on every rank.
* backward (the blocks are recomputed): ``dx_k = (g_lp (1[k = label] - p_k) - g_ent p_k (x_k - E_p[x])) / T``
  with ``p_k = exp(x_k - lse)``; ``dh += dx @ W_blk`` and ``dW_blk += dx^T @ h_blk``. Under TP the
  hidden gradient is this shard's part: the caller sums it over the group (Megatron's
  ``copy_to_tensor_model_parallel_region`` / sequence-parallel gather do it in their backward).

Two implementations of the block loop share this Python driver: the native C++ op
(``csrc/cpu/fused_logprob.cpp``, ``torch.ops.moerl.fused_logprob_fwd/bwd``; CUDA sources in csrc/cuda)
and :func:`torch_fwd_stats` / :func:`torch_bwd`, the readable pure-torch reference. Peak extra memory is
one block plus O(T) statistics (besides the gradients themselves).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moerl.algorithms.logprobs import _check_temperature

__all__ = ["fused_linear_log_probs", "naive_linear_log_probs", "torch_fwd_stats", "torch_bwd", "resolve_impl",
           "DEFAULT_TOKEN_CHUNK", "DEFAULT_VOCAB_CHUNK"]

DEFAULT_TOKEN_CHUNK = 1024  # tokens per block
DEFAULT_VOCAB_CHUNK = 4096  # vocabulary columns per block (a 16 MiB float32 block at the defaults)
_IMPLS = ("auto", "native", "torch")


def torch_fwd_stats(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, vocab_start: int,
                    token_chunk: int, vocab_chunk: int) -> Tensor:
    """Pure-torch reference of the forward block loop (what ``torch.ops.moerl.fused_logprob_fwd`` computes).

    Args:
        hidden: float32 [N, H]; weight: float32 [V_local, H] (the whole output weight or a vocab shard);
        labels: int64 [N] global token ids (negative = masked); temperature > 0;
        vocab_start: global id of the shard's first row; token_chunk, vocab_chunk: block shape.
    Returns:
        float32 [N, 4]: per token over this shard's columns ``(m, s, t, label_logit)`` with
        ``x = h W^T / T``, ``m = max x``, ``s = sum exp(x - m)``, ``t = sum exp(x - m) x`` and the
        label's ``x`` (0 when the label is not in this shard).
    """
    n, v = hidden.shape[0], weight.shape[0]
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
    s = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    t = torch.zeros_like(s)
    tgt = torch.zeros_like(s)
    for r0 in range(0, n, token_chunk):
        r1 = min(n, r0 + token_chunk)
        h, lab = hidden[r0:r1], labels[r0:r1]
        for c0 in range(0, v, vocab_chunk):
            c1 = min(v, c0 + vocab_chunk)
            x = (h @ weight[c0:c1].T) / temperature  # [tc, vc]: the only vocabulary-sized temporary
            m_new = torch.maximum(m[r0:r1], x.max(dim=1).values)
            e = torch.exp(x - m_new[:, None])
            rescale = torch.exp(m[r0:r1] - m_new)
            s[r0:r1] = s[r0:r1] * rescale + e.sum(dim=1)
            t[r0:r1] = t[r0:r1] * rescale + (e * x).sum(dim=1)
            m[r0:r1] = m_new
            local = lab - vocab_start - c0
            inside = (local >= 0) & (local < c1 - c0)
            picked = x.gather(1, local.clamp(0, c1 - c0 - 1)[:, None]).squeeze(1)
            tgt[r0:r1] = torch.where(inside, picked, tgt[r0:r1])
    return torch.stack([m, s, t, tgt], dim=1)


def torch_bwd(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, vocab_start: int, lse: Tensor,
              mean_x: Tensor, g_lp: Tensor, g_ent: Tensor, token_chunk: int, vocab_chunk: int) -> tuple[Tensor, Tensor]:
    """Pure-torch reference of the backward block loop (``torch.ops.moerl.fused_logprob_bwd``).

    Args: as :func:`torch_fwd_stats`, plus per-token float32 [N] ``lse`` (global log-sum-exp of x),
        ``mean_x`` (``E_p[x] = lse - entropy``), ``g_lp`` (gradient of the log-probs, 0 at masked
        tokens) and ``g_ent`` (gradient of the entropies).
    Returns:
        ``(d_hidden [N, H], d_weight [V_local, H])`` float32; d_hidden is this shard's part.
    """
    n, v = hidden.shape[0], weight.shape[0]
    dh = torch.zeros_like(hidden)
    dw = torch.zeros_like(weight)
    for c0 in range(0, v, vocab_chunk):
        c1 = min(v, c0 + vocab_chunk)
        w = weight[c0:c1]
        for r0 in range(0, n, token_chunk):
            r1 = min(n, r0 + token_chunk)
            h = hidden[r0:r1]
            x = (h @ w.T) / temperature
            p = torch.exp(x - lse[r0:r1, None])
            dx = -p * (g_lp[r0:r1, None] + g_ent[r0:r1, None] * (x - mean_x[r0:r1, None]))
            local = labels[r0:r1] - vocab_start - c0
            inside = (local >= 0) & (local < c1 - c0)
            dx.scatter_add_(1, local.clamp(0, c1 - c0 - 1)[:, None],
                            torch.where(inside, g_lp[r0:r1], torch.zeros_like(g_lp[r0:r1]))[:, None])
            dx /= temperature
            dh[r0:r1] += dx @ w
            dw[c0:c1] += dx.T @ h
    return dh, dw


def resolve_impl(impl: str, device: torch.device) -> str:
    """"native" or "torch" for ``impl`` ("auto" | "native" | "torch") on ``device``.

    "auto" builds the native op on first use (moerl.kernels._build.load_native) and falls back to
    the torch reference with one warning when it cannot; "native" raises instead.

    Raises:
        ValueError: an unknown ``impl``.
        moerl.kernels._build.NativeBuildError: "native" and the build failed.
    """
    from moerl.kernels._build import load_native

    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch"
    kind = "cuda" if device.type == "cuda" else "cpu"
    if device.type not in ("cpu", "cuda"):
        if impl == "native":
            raise ValueError(f"no native fused_logprob kernel for device {device}")
        return "torch"
    return "native" if load_native(kind, required=impl == "native") else "torch"


def _ops(impl: str):
    if impl == "native":
        return torch.ops.moerl.fused_logprob_fwd, torch.ops.moerl.fused_logprob_bwd
    return torch_fwd_stats, torch_bwd


class _FusedLinearLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, vocab_start, group, impl, token_chunk, vocab_chunk):  # type: ignore[override]
        fwd, _ = _ops(impl)
        hf, wf = hidden.float().contiguous(), weight.float().contiguous()
        stats = fwd(hf, wf, labels, temperature, vocab_start, token_chunk, vocab_chunk)
        m, s, t, tgt = stats.unbind(1)
        if group is not None:
            big = m.clone()
            dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
            scale = torch.exp(m - big)
            sums = torch.stack([s * scale, t * scale, tgt])
            dist.all_reduce(sums, group=group)
            m, (s, t, tgt) = big, sums.unbind(0)
        lse = m + torch.log(s)
        mean_x = t / s
        entropy = lse - mean_x
        log_probs = torch.where(labels >= 0, tgt - lse, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, labels, lse, mean_x)
        ctx.args = (temperature, vocab_start, impl, token_chunk, vocab_chunk)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):  # type: ignore[override]
        hidden, weight, labels, lse, mean_x = ctx.saved_tensors
        temperature, vocab_start, impl, token_chunk, vocab_chunk = ctx.args
        _, bwd = _ops(impl)
        zero = torch.zeros_like(lse)
        g_lp = zero if g_lp is None else torch.where(labels >= 0, g_lp.float(), zero).contiguous()
        g_ent = zero if g_ent is None else g_ent.float().contiguous()
        dh, dw = bwd(hidden.float().contiguous(), weight.float().contiguous(), labels, temperature, vocab_start,
                     lse, mean_x, g_lp, g_ent, token_chunk, vocab_chunk)
        return (dh.to(hidden.dtype) if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None, None, None, None, None)


def fused_linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    impl: str = "auto",
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each label and entropy of ``softmax(hidden @ weight.T / temperature)``, fused.

    Equal (to float32 rounding) to ``log_softmax(h W^T / T)[label]`` and ``H(softmax(h W^T / T))``
    (moerl.algorithms.logprobs on materialised logits) with gradients for ``hidden`` and ``weight``,
    but no [tokens, vocab] tensor is formed (module docstring).

    Args:
        hidden: float [..., H] (fp32/bf16/fp16; the maths runs in float32), the final-norm output.
        weight: float [V, H] output-layer weight, or this TP rank's vocabulary shard [V/tp, H].
        labels: integer [...] (hidden's leading dims) global token ids in [0, V); negative = masked
            (log-prob 0 and no gradient; the entropy is still computed).
        temperature: the rollout engine's sampling temperature (> 0).
        tp_group: the tensor-parallel group the vocabulary is sharded over (None: the weight is whole).
            Collective: every rank of the group calls with the same labels.
        vocab_start: global id of the shard's first row (default ``rank_in_group * weight.shape[0]``,
            Megatron's even split; 0 without a group).
        impl: "auto" (native when it builds, else the torch reference), "native" or "torch".
        token_chunk, vocab_chunk: block shape (>= 1).
    Returns:
        ``(log_probs, entropy)``: float32 tensors of labels' shape (identical on every TP rank). Under TP
        the gradient reaching ``hidden`` is this rank's part (sum it over the group).
    Raises:
        TypeError: non-float hidden/weight, non-integer labels, non-numeric temperature.
        ValueError: shape mismatches, temperature <= 0, chunk < 1, a label >= V (TP: >= V_local * tp).
        moerl.kernels._build.NativeBuildError: impl="native" and the op cannot be built.
    """
    temperature = _check_temperature(temperature)
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be float tensors, got {hidden.dtype} and {weight.dtype}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] must agree on H, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's without H {tuple(hidden.shape[:-1])}")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"token_chunk and vocab_chunk must be >= 1, got {token_chunk} and {vocab_chunk}")
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    if vocab_start is None:
        vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * weight.shape[0]
    if labels.numel() and int(labels.max()) >= weight.shape[0] * world:
        raise ValueError(f"labels contain token id {int(labels.max())} >= vocab size {weight.shape[0] * world}")
    lead = labels.shape
    if labels.numel() == 0:
        z = torch.zeros(lead, dtype=torch.float32, device=hidden.device)
        return z, z.clone()
    which = resolve_impl(impl, hidden.device)
    lp, ent = _FusedLinearLogProb.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                        labels.reshape(-1).long().contiguous(), temperature, int(vocab_start),
                                        tp_group, which, int(token_chunk), int(vocab_chunk))
    return lp.view(lead), ent.view(lead)


def naive_linear_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The naive computation the fused op replaces (the tests' and the benchmark's baseline): full
    float32 logits ``[..., V] = hidden @ weight.T / T``, ``log_softmax``, gather of the labels (0 where
    masked, label < 0) and ``entropy = -sum p log p``. Differentiable; memory O(tokens x V)."""
    logits = hidden.float() @ weight.float().T / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, labels.long().clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(labels >= 0, lp, torch.zeros_like(lp))
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return lp, entropy

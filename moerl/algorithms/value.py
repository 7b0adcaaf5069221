"""Critic loss for PPO with a value model (GAE advantages, :mod:`moerl.algorithms.estimators`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moerl.algorithms.policy_loss import Number, _bool_mask, aggregate_loss, masked_mean

__all__ = ["value_loss"]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    clip: Optional[float],
    loss_agg_mode: str,
    global_num_tokens: Optional[Number] = None,
    global_num_seqs: Optional[Number] = None,
    seq_token_sum_constant: Optional[float] = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss of one micro-batch (Schulman et al. 2017, arXiv 1707.06347, and the
    OpenAI baselines ``ppo2`` value clipping).

    ``V_clip = clamp(V, V_old - clip, V_old + clip)``;
    ``l_t = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)`` (``clip=None``: ``0.5 * (V_t - R_t)^2``);
    ``loss = aggregate_loss(l, loss_mask, loss_agg_mode, ...)``: this micro-batch's share of the
    global-batch loss, so the sum over micro-batches and DP ranks is independent of the cut (see
    :func:`moerl.algorithms.policy_loss.aggregate_loss`).

    Args:
        values: float [B, T], V_theta of the current critic (requires grad).
        old_values: float [B, T], the critic's values when the data was collected (detached).
        returns: float [B, T], the targets R_t (e.g. from
            :func:`moerl.algorithms.estimators.gae_advantages`; detached).
        loss_mask: [B, T] (bool/int/float).
        clip: clip range eps > 0 for the value (``algorithm.value_clip``), or None (no clipping).
        loss_agg_mode, global_num_tokens, global_num_seqs, seq_token_sum_constant: see
            :func:`moerl.algorithms.policy_loss.aggregate_loss`.

    Returns:
        (loss: scalar tensor with grad, metrics: dict of python floats): ``vf_loss`` (this
        micro-batch's share of the aggregated loss, sums over micro-batches like ``pg_loss``), and
        local masked means over this micro-batch's loss tokens: ``vf_clip_frac`` (tokens where the
        clipped term is the larger one, i.e. the token has no gradient; 0 with ``clip=None``) and
        ``value_mean`` (mean of V_theta).

    Raises:
        ValueError: bad shapes, ``clip`` <= 0, unknown mode or bad global counts.
    """
    if values.dim() != 2:
        raise ValueError(f"values must be [B, T], got shape {tuple(values.shape)}")
    for name, t in (("old_values", old_values), ("returns", returns)):
        if t.shape != values.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have the shape of values {tuple(values.shape)}")
    if clip is not None and not (float(clip) > 0 and float(clip) < float("inf")):
        raise ValueError(f"clip (algorithm.value_clip) must be a finite float > 0 or None, got {clip!r}")
    mask = _bool_mask(loss_mask, values)
    # NaN/inf padding must not reach the gradient: zero every input off the mask first.
    values = torch.where(mask, values, torch.zeros_like(values))
    ret = torch.where(mask, returns.detach(), torch.zeros_like(values))
    unclipped = (values - ret) ** 2
    if clip is None:
        per_token = 0.5 * unclipped
        clipped_mask = torch.zeros_like(mask)
    else:
        old = torch.where(mask, old_values.detach(), torch.zeros_like(values))
        v_clip = torch.maximum(torch.minimum(values, old + clip), old - clip)
        clipped = (v_clip - ret) ** 2
        clipped_mask = clipped > unclipped
        per_token = 0.5 * torch.where(clipped_mask, clipped, unclipped)
    loss = aggregate_loss(
        per_token, mask, loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
        seq_token_sum_constant=seq_token_sum_constant,
    )
    metrics = {
        "vf_loss": float(loss.detach()),
        "vf_clip_frac": float(masked_mean(clipped_mask.to(torch.float32), mask)),
        "value_mean": float(masked_mean(values.detach(), mask)),
    }
    return loss, metrics

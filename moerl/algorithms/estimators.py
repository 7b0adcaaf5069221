"""Advantage estimators beyond GRPO: RLOO, REINFORCE++ (and its group baseline), GAE, and the global
whitening REINFORCE++ applies to its advantages.

Layouts (as in :mod:`moerl.algorithms.advantages`): outcome rewards are ``[N]`` (or ``[B]``), one
per response, the ``group_size`` responses of one prompt contiguous. Token-level quantities are
``[B, T]`` with a ``loss_mask`` that is non-zero on the response tokens of each row (the actions); a
row holds one response (its prompt positions, if present, are masked out). Positions off the mask
are neither actions nor time steps: discounting (``gamma``, ``lam``) counts loss tokens, and a masked
position inside a row (e.g. a tool output between two assistant turns) is skipped, not treated as a
step or as the end of the episode. Every output is exactly 0 off the mask.

All arithmetic is float64; results are cast to ``promote(input dtypes, float32)`` (float32 for
float32/bf16/fp16 inputs, float64 for float64 inputs). Nothing here carries gradient: advantages and
returns are data (inputs are detached).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from moerl.algorithms.advantages import _as_grouped_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "rloo_advantages",
    "outcome_token_rewards",
    "token_returns",
    "reinforce_pp_advantages",
    "whiten",
    "gae_advantages",
]

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")


def _out_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_token_tensor(x: Tensor, mask: Tensor, name: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a [B, T] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape != mask.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} must equal loss_mask shape {tuple(mask.shape)}")


def _bool_2d_mask(loss_mask: Tensor) -> Tensor:
    if not isinstance(loss_mask, Tensor) or loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be a [B, T] tensor, got {getattr(loss_mask, 'shape', type(loss_mask).__name__)}")
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _check_unit_interval(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= float(value) <= 1.0):
        raise ValueError(f"{name} must be a float in [0, 1], got {value!r}")
    return float(value)


def _reverse_discounted_sum(r: Tensor, mask: Tensor, discount: float) -> Tensor:
    """``out_t = sum_{s >= t, s in mask} discount^(k(s) - k(t)) r_s`` with k counting loss tokens; 0 off mask.

    ``r`` float64 [B, T] (already 0 off the mask).
    """
    if discount == 1.0:
        suffix = torch.flip(torch.cumsum(torch.flip(r, dims=[1]), dim=1), dims=[1])
        return torch.where(mask, suffix, torch.zeros_like(suffix))
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m, r[:, t] + discount * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def rloo_advantages(rewards: Union[Tensor, Sequence[float]], group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out advantages, one per response (broadcast it to the response's tokens).

    RLOO (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al.
    2024, arXiv 2402.14740, sec. 3.2 / eq. for the RLOO estimator):
    ``A_i = r_i - (1 / (G - 1)) * sum_{j != i} r_j``, computed as ``(G * r_i - sum_j r_j) / (G - 1)``
    (= ``G / (G - 1) * (r_i - mean_g(r))``) in float64.

    - a group whose rewards are all equal gets advantages of exactly 0.0;
    - ``group_size == 1``: there is no other sample to form a baseline; the advantage is 0.0.

    Args:
        rewards: float tensor [N] (a list is accepted; integer tensors are cast to float32),
            N = num_groups * group_size, groups contiguous.
        group_size: G = n_samples_per_prompt (>= 1).

    Returns:
        Tensor [N] of the dtype of ``rewards`` (float32 for lists/ints), on its device.

    Raises:
        TypeError: ``group_size`` not an int.
        ValueError: ``rewards`` not 1-D, N not a multiple of ``group_size``, non-finite rewards,
            ``group_size < 1``.
    """
    rewards, grouped = _as_grouped_rewards(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    total = grouped.sum(dim=1, keepdim=True)
    adv = (group_size * grouped - total) / (group_size - 1)
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(rewards.dtype)


def outcome_token_rewards(
    outcome_rewards: Union[Tensor, Sequence[float]],
    token_rewards: Optional[Tensor],
    loss_mask: Tensor,
) -> Tensor:
    """Per-token rewards r_t: ``token_rewards`` on the loss tokens plus each row's outcome reward on
    its LAST loss token (the usual sparse-reward placement of PPO / REINFORCE++ for LLMs).

    Args:
        outcome_rewards: float [B] (a list is accepted), one per row.
        token_rewards: float [B, T] (e.g. ``-kl_coef * KL`` from
            :func:`moerl.algorithms.shaping.kl_reward_penalty`) or None (no dense reward).
            Values off the mask are ignored (NaN there is harmless).
        loss_mask: [B, T] (bool/int/float; non-zero = loss token).

    Returns:
        Tensor [B, T], dtype ``promote(outcome, token_rewards, float32)``, 0 off the mask. A row
        without loss tokens gets no reward (all 0): its outcome reward has no token to sit on.

    Raises:
        ValueError: bad shapes, B mismatch, non-finite outcome rewards or non-finite token rewards
            on loss tokens.
    """
    mask = _bool_2d_mask(loss_mask)
    if not isinstance(outcome_rewards, Tensor):
        outcome_rewards = torch.as_tensor(outcome_rewards, dtype=torch.float32, device=mask.device)
    if outcome_rewards.dim() != 1 or outcome_rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"outcome_rewards must be [B] with B = {mask.shape[0]} rows of loss_mask, got shape "
            f"{tuple(outcome_rewards.shape)}"
        )
    if not torch.isfinite(outcome_rewards).all():
        raise ValueError("outcome_rewards contains NaN or inf; a reward must be a finite float")
    dtype = _out_dtype(outcome_rewards, token_rewards)
    r = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if token_rewards is not None:
        _check_token_tensor(token_rewards, mask, "token_rewards")
        dense = token_rewards.detach().to(torch.float64)
        if not torch.isfinite(dense[mask]).all():
            raise ValueError("token_rewards contains NaN or inf on loss tokens")
        r = torch.where(mask, dense, r)
    T = mask.shape[1]
    has_tokens = mask.any(dim=1)
    # index of the last loss token of each row: the largest position index where the mask is set
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    rows = torch.nonzero(has_tokens, as_tuple=False).squeeze(1)
    r[rows, last[rows]] += outcome_rewards.detach().to(device=mask.device, dtype=torch.float64)[rows]
    return r.to(dtype)


def token_returns(
    outcome_rewards: Union[Tensor, Sequence[float]],
    token_rewards: Optional[Tensor],
    loss_mask: Tensor,
    gamma: float = 1.0,
) -> Tensor:
    """Discounted return-to-go over each row's loss tokens.

    With r_t from :func:`outcome_token_rewards` (dense ``token_rewards`` plus the outcome reward on
    the row's last loss token): ``G_t = sum_{s >= t} gamma^(s - t) r_s``, where s and t run over the
    row's loss tokens and ``s - t`` counts loss tokens (masked positions inside a row are skipped,
    neither discounted nor a reset). This is the REINFORCE++ return (Hu 2025, arXiv 2501.03262,
    sec. 3, "advantage = return-to-go" with the token-level KL penalty in the reward).

    Args:
        outcome_rewards: float [B] (a list is accepted).
        token_rewards: float [B, T] or None.
        loss_mask: [B, T] (bool/int/float).
        gamma: discount in [0, 1] (1.0 in REINFORCE++).

    Returns:
        Tensor [B, T], dtype ``promote(outcome, token_rewards, float32)``, 0 off the mask.

    Raises:
        ValueError: as :func:`outcome_token_rewards`; ``gamma`` outside [0, 1].
    """
    gamma = _check_unit_interval(gamma, "gamma")
    dtype = _out_dtype(outcome_rewards if isinstance(outcome_rewards, Tensor) else None, token_rewards)
    r = outcome_token_rewards(outcome_rewards, token_rewards, loss_mask).to(torch.float64)
    return _reverse_discounted_sum(r, _bool_2d_mask(loss_mask), gamma).to(dtype)


def reinforce_pp_advantages(
    rewards: Union[Tensor, Sequence[float]],
    loss_mask: Tensor,
    *,
    token_rewards: Optional[Tensor] = None,
    group_size: Optional[int] = None,
    baseline: bool = False,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++ token advantages, NOT whitened (Hu 2025, arXiv 2501.03262).

    - REINFORCE++ (``baseline=False``): ``A_t = G_t`` of :func:`token_returns` (outcome reward on the
      last loss token, ``token_rewards`` such as the per-token KL penalty on every loss token).
    - REINFORCE++-baseline (``baseline=True``): the outcome rewards are first centred on their
      prompt group, ``r_i - mean_g(r)`` (float64; a group of identical rewards gives exactly 0),
      then the returns are taken as above. The token rewards are not centred.

    The paper then normalises the advantages over the whole GLOBAL batch (z-score over all loss
    tokens); that is a separate step: :func:`whiten` with the DP process group.

    Args:
        rewards: outcome rewards, float [B] (a list is accepted), one per row; with ``baseline``
            the ``group_size`` rows of one prompt are contiguous.
        loss_mask: [B, T].
        token_rewards: float [B, T] or None.
        group_size: G = n_samples_per_prompt; required with ``baseline=True`` (checked against B
            when given).
        baseline: subtract the group mean of the outcome reward (REINFORCE++-baseline).
        gamma: discount in [0, 1].

    Returns:
        Tensor [B, T], dtype ``promote(rewards, token_rewards, float32)``, 0 off the mask.

    Raises:
        ValueError: ``baseline=True`` without ``group_size``; and as :func:`token_returns` /
            :func:`moerl.algorithms.advantages.grpo_advantages` (B not a multiple of group_size...).
        TypeError: ``group_size`` not an int.
    """
    if baseline and group_size is None:
        raise ValueError(
            "reinforce_plus_plus_baseline needs group_size (n_samples_per_prompt) to subtract the group mean reward"
        )
    outcome = rewards
    if group_size is not None:
        rew, grouped = _as_grouped_rewards(rewards, group_size)
        outcome = rew
        if baseline:
            centred = grouped - grouped.mean(dim=1, keepdim=True)
            constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
            centred = torch.where(constant, torch.zeros_like(centred), centred)
            outcome = centred.reshape(-1).to(rew.dtype)
    return token_returns(outcome, token_rewards, loss_mask, gamma)


def whiten(
    values: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: Optional["dist.ProcessGroup"] = None,
) -> Tensor:
    """Masked z-score over all loss tokens of the GLOBAL batch (REINFORCE++'s advantage
    normalisation, arXiv 2501.03262 eq. for ``A_norm = (A - mean(A)) / std(A)``; verl's
    ``masked_whiten``).

    ``mean = sum(v*m) / n``, ``var = sum((v - mean)^2 * m) / (n - 1)`` (UNBIASED, Bessel-corrected,
    as verl's ``masked_whiten``; OpenRLHF divides by n, a difference of a factor n/(n-1) in the
    variance, negligible at batch scale), ``out = (v - mean) / sqrt(var + eps)``; with
    ``shift_mean=False`` the mean is added back: ``out = (v - mean) / sqrt(var + eps) + mean``
    (verl's convention: only the scale is normalised).

    With ``group`` (the DP process group) and ``torch.distributed`` initialised, the statistics are
    those of the union of every rank's masked tokens: two all-reduces (SUM) in float64, first of
    ``(sum, count)`` for the mean, then of the sum of squared deviations from that global mean (two
    passes rather than ``E[v^2] - E[v]^2``, which cancels catastrophically when the spread is small
    next to the mean). Every rank of ``group`` must call it (a collective), even with an empty mask.
    Without ``group`` (or without an initialised process group) the statistics are local.

    Special cases: ``n == 0`` returns zeros; ``n == 1`` uses variance 0 (the lone token becomes 0).

    Args:
        values: float [B, T] (detached in the computation).
        mask: [B, T] (bool/int/float; non-zero = loss token).
        shift_mean: subtract the mean (True) or keep it (False).
        eps: added to the variance under the square root (>= 0).
        group: a ``torch.distributed`` process group (e.g. the DP group), or None.

    Returns:
        Tensor [B, T] of the dtype of ``values`` (float32 for non-float input), 0 off the mask.

    Raises:
        ValueError: bad shapes, ``eps < 0``, non-finite values on masked-in positions.
    """
    m = _bool_2d_mask(mask)
    _check_token_tensor(values, m, "values")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    out_dtype = values.dtype if values.is_floating_point() else torch.float32
    v = torch.where(m, values.detach().to(torch.float64), torch.zeros((), dtype=torch.float64, device=values.device))
    if not torch.isfinite(v).all():
        raise ValueError("values contains NaN or inf on masked-in positions")
    distributed = group is not None and dist.is_available() and dist.is_initialized()
    stats = torch.stack([v.sum(), m.sum().to(torch.float64)])
    if distributed:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, n = stats[0], stats[1]
    mean = total / n.clamp(min=1.0)
    centred = torch.where(m, v - mean, torch.zeros_like(v))
    sq = (centred * centred).sum().reshape(1)
    if distributed:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    var = sq[0] / (n - 1.0) if float(n) > 1 else sq.new_zeros(())
    out = centred * torch.rsqrt(var + eps) if float(var) + eps > 0 else centred
    if not shift_mean:
        out = out + mean
    out = torch.where(m, out, torch.zeros_like(out))
    return out.to(out_dtype)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over each row's loss tokens (Schulman et al. 2016,
    arXiv 1506.02438, eq. 16; PPO with a critic).

    For the loss tokens t_1 < ... < t_n of a row: ``delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}``
    with ``V_{t_{n+1}} = 0`` (the response ends: terminal state), and
    ``A_{t_k} = sum_{l >= 0} (gamma * lam)^l * delta_{k+l}``, computed by the backward recursion
    ``A_{t_k} = delta_k + gamma * lam * A_{t_{k+1}}``. Returns (the critic's targets) are
    ``R_t = A_t + V_t``. Masked positions are skipped (neither steps nor terminals) and are 0 in
    both outputs. Put the outcome reward on each row's last loss token with
    :func:`outcome_token_rewards`.

    Args:
        token_rewards: float [B, T] per-token rewards r_t (values off the mask ignored).
        values: float [B, T] critic values V_t of the states before each response token (old
            values, detached).
        loss_mask: [B, T] (bool/int/float).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1] (lam = 1: Monte-Carlo return minus V; lam = 0: one-step TD).

    Returns:
        (advantages [B, T], returns [B, T]), dtype ``promote(token_rewards, values, float32)``,
        0 off the mask. Not whitened (PPO usually whitens the advantages with :func:`whiten`).

    Raises:
        ValueError: bad shapes, ``gamma`` / ``lam`` outside [0, 1], non-finite inputs on loss tokens.
    """
    mask = _bool_2d_mask(loss_mask)
    _check_token_tensor(token_rewards, mask, "token_rewards")
    _check_token_tensor(values, mask, "values")
    gamma = _check_unit_interval(gamma, "gamma")
    lam = _check_unit_interval(lam, "lam")
    dtype = _out_dtype(token_rewards, values)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    r = torch.where(mask, token_rewards.detach().to(torch.float64), zero)
    v = torch.where(mask, values.detach().to(torch.float64), zero)
    if not (torch.isfinite(r).all() and torch.isfinite(v).all()):
        raise ValueError("token_rewards / values contain NaN or inf on loss tokens")
    adv = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])
    next_adv = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, v[:, t], next_value)
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
    returns = torch.where(mask, adv + v, zero)
    return adv.to(dtype), returns.to(dtype)

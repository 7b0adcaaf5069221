"""Reward shaping: DAPO's soft overlong punishment and the KL penalty folded into the reward.

Both return rewards (data, no gradient): ``overlong_penalty`` is added to each response's outcome
reward before the advantages are computed; ``kl_reward_penalty`` gives per-token rewards for the
token-level estimators (:func:`moerl.algorithms.estimators.token_returns`, GAE).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from moerl.algorithms.kl import KL_ESTIMATORS, kl_penalty

__all__ = ["overlong_penalty", "kl_reward_penalty"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def overlong_penalty(
    response_lengths: Union[Tensor, Sequence[int]],
    max_new_tokens: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, sec. 3.4, eq. 13).

    With ``L_max = max_new_tokens`` and ``L_cache = buffer_len``, for a response of ``L`` tokens::

        0                                           if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache * factor  if L_max - L_cache < L < L_max
        -factor                                     if L >= L_max

    (At ``L == L_max`` the middle formula also gives ``-factor``: the penalty is continuous, and a
    response cut at ``max_new_tokens`` gets the full ``-factor``.) The value is ADDED to the outcome
    reward of the response.

    Args:
        response_lengths: int tensor [B] (or a list of ints) of response lengths in tokens (>= 0).
        max_new_tokens: L_max, the rollout's ``max_new_tokens`` (>= 1).
        buffer_len: L_cache (``algorithm.overlong_buffer_len``), 1 <= buffer_len <= max_new_tokens.
        penalty_factor: scale of the penalty (``algorithm.overlong_penalty_factor``, >= 0; DAPO: 1.0).

    Returns:
        float32 tensor [B] (values in [-penalty_factor, 0]), on the device of ``response_lengths``.

    Raises:
        ValueError: ``buffer_len`` not an int in [1, max_new_tokens] (message names
            ``algorithm.overlong_buffer_len``), ``max_new_tokens`` not an int >= 1,
            ``penalty_factor`` < 0 or not finite (names ``algorithm.overlong_penalty_factor``),
            lengths not 1-D, not integer-valued or negative.
    """
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not _is_int(buffer_len) or not (1 <= buffer_len <= max_new_tokens):
        raise ValueError(
            f"algorithm.overlong_buffer_len must be an int in [1, max_new_tokens={max_new_tokens}], got {buffer_len!r}"
        )
    if isinstance(penalty_factor, bool) or not isinstance(penalty_factor, (int, float)) or not (
        0.0 <= float(penalty_factor) < float("inf")
    ):
        raise ValueError(f"algorithm.overlong_penalty_factor must be a finite float >= 0, got {penalty_factor!r}")
    lengths = response_lengths if isinstance(response_lengths, Tensor) else torch.as_tensor(response_lengths)
    if lengths.dim() != 1:
        raise ValueError(f"response_lengths must be a 1-D tensor [B], got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point():
        if not (torch.isfinite(lengths).all() and torch.equal(lengths, lengths.round())):
            raise ValueError("response_lengths must be integer token counts")
    elif lengths.dtype == torch.bool:
        raise ValueError("response_lengths must be integer token counts, got a bool tensor")
    lengths = lengths.to(torch.float64)
    if (lengths < 0).any():
        raise ValueError("response_lengths must be >= 0")
    start = float(max_new_tokens - buffer_len)
    soft = (start - lengths) / float(buffer_len)
    pen = torch.where(lengths <= start, torch.zeros_like(lengths), soft)
    pen = torch.where(lengths >= float(max_new_tokens), torch.full_like(lengths, -1.0), pen)
    return (pen * float(penalty_factor)).to(torch.float32)


def kl_reward_penalty(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    loss_mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> Tensor:
    """Per-token KL penalty as a reward (KL in the reward, InstructGPT: Ouyang et al. 2022,
    arXiv 2203.02155, eq. 2 ``r - beta * log(pi_RL / pi_SFT)``; verl's ``use_kl_in_reward``;
    REINFORCE++, arXiv 2501.03262).

    ``token_rewards_t = -kl_coef * kl_penalty(log_probs_t, ref_log_probs_t, estimator)`` on loss
    tokens, exactly 0 elsewhere (``torch.where``: NaN padding does not leak). With ``kl_coef == 0``
    the KL is not computed at all and the result is all zeros (0 * NaN would be NaN).

    Args:
        log_probs: float [B, T], log pi_old of the response tokens (the policy that sampled them).
        ref_log_probs: float [B, T], log pi_ref of the same tokens.
        loss_mask: [B, T] (bool/int/float).
        kl_coef: beta >= 0.
        estimator: "k1" (default: the InstructGPT log-ratio), "k2" or "k3"
            (:func:`moerl.algorithms.kl.kl_penalty`).

    Returns:
        Tensor [B, T], detached, dtype of :func:`moerl.algorithms.kl.kl_penalty` (float32 for
        low-precision inputs).

    Raises:
        ValueError: ``kl_coef`` < 0 or not finite, unknown estimator, mismatched shapes.
    """
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not (0.0 <= float(kl_coef) < float("inf")):
        raise ValueError(f"kl_coef must be a finite float >= 0, got {kl_coef!r}")
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if log_probs.dim() != 2 or ref_log_probs.shape != log_probs.shape or loss_mask.shape != log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)}, ref_log_probs {tuple(ref_log_probs.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must all be the same [B, T] shape"
        )
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    dtype = torch.promote_types(torch.promote_types(log_probs.dtype, ref_log_probs.dtype), torch.float32)
    if float(kl_coef) == 0.0:
        return torch.zeros(log_probs.shape, dtype=dtype, device=log_probs.device)
    kl = kl_penalty(log_probs.detach(), ref_log_probs.detach(), estimator)
    return torch.where(mask, -float(kl_coef) * kl, torch.zeros_like(kl))

"""Group-relative advantages: GRPO (arXiv 2402.03300) and Dr.GRPO (arXiv 2503.20783).

A rollout batch holds ``num_groups`` prompts with ``group_size`` (= n_samples_per_prompt) responses
each; the responses of one group are contiguous: group g is ``rewards[g * G:(g + 1) * G]``.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

__all__ = ["grpo_advantages", "group_has_signal"]


def _as_grouped_rewards(rewards: Union[Tensor, Sequence[float]], group_size: int) -> tuple[Tensor, Tensor]:
    """Validate ``rewards``/``group_size``; return (rewards as a float tensor, float64 view [num_groups, G])."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int (n_samples_per_prompt), got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (n_samples_per_prompt), got {group_size}")
    if not isinstance(rewards, Tensor):
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got shape {tuple(rewards.shape)}")
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(
            f"rewards has {n} entries, not a multiple of group_size={group_size}; every prompt group must "
            f"be complete (n_samples_per_prompt responses, contiguous)"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contains NaN or inf; fix the reward function (a reward must be a finite float)")
    return rewards, rewards.to(torch.float64).view(-1, group_size)


def grpo_advantages(
    rewards: Union[Tensor, Sequence[float]],
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-normalised advantages, one per response (broadcast it to the response's tokens).

    GRPO (arXiv 2402.03300, section 4.1.2, outcome supervision):
    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)``; Dr.GRPO (arXiv 2503.20783, eq. for "GRPO Done
    Right") drops the std: ``A_i = r_i - mean_g(r)`` (``normalize_std=False``).

    Numerics (see REFERENCE.md section 1):

    - computed in float64 from centred values (``std = sqrt(sum((r - mean)^2) / (G - 1))``), never as
      ``sqrt(E[r^2] - E[r]^2)``, then cast back to the dtype of ``rewards``;
    - ``std`` is the *unbiased* (Bessel-corrected, ``G - 1``) sample std, as in the GRPO reference
      code (``torch.std`` default);
    - a group whose rewards are all equal gets advantages of exactly 0.0 (no 1e-9 residue);
    - ``group_size == 1``: there is no baseline (the unbiased std is undefined), so the advantage is
      defined as exactly 0.0 for every sample, with or without ``normalize_std``.

    Args:
        rewards: float tensor [N] (a list of floats is accepted; integer tensors are cast to float32),
            N = num_groups * group_size, the responses of one group contiguous.
        group_size: G = n_samples_per_prompt (>= 1).
        normalize_std: divide by (std + eps) (GRPO) or not (Dr.GRPO).
        eps: added to the std in the denominator (>= 0).

    Returns:
        Tensor [N] of the dtype of ``rewards`` (float32 for lists/ints), on its device.

    Raises:
        TypeError: ``group_size`` not an int.
        ValueError: ``rewards`` not 1-D, N not a multiple of ``group_size``, non-finite rewards,
            ``group_size < 1`` or ``eps < 0``.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards, grouped = _as_grouped_rewards(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    mean = grouped.mean(dim=1, keepdim=True)
    centred = grouped - mean
    # All-equal groups: force exact zeros (the float64 mean of equal values can differ by an ulp).
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    centred = torch.where(constant, torch.zeros_like(centred), centred)
    if normalize_std:
        std = torch.sqrt((centred * centred).sum(dim=1, keepdim=True) / (group_size - 1))
        adv = centred / (std + eps)
        # eps == 0 with a constant group would be 0/0; the advantage is 0 by definition there.
        adv = torch.where(constant, torch.zeros_like(adv), adv)
    else:
        adv = centred
    return adv.reshape(-1).to(rewards.dtype)


def group_has_signal(rewards: Union[Tensor, Sequence[float]], group_size: int) -> Tensor:
    """Which prompt groups carry a learning signal (DAPO dynamic sampling, arXiv 2503.14476).

    A group whose rewards are all equal has all-zero group-relative advantages and contributes no
    policy gradient; DAPO drops such groups and samples more.

    Args:
        rewards: float tensor [N], N = num_groups * group_size, groups contiguous.
        group_size: G = n_samples_per_prompt (>= 1).

    Returns:
        BoolTensor [num_groups]: False where every reward of the group is equal (always False for G = 1).

    Raises:
        TypeError / ValueError: as :func:`grpo_advantages`.
    """
    _, grouped = _as_grouped_rewards(rewards, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)

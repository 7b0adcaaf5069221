"""Per-token KL estimators between the policy and the reference policy (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).

Tokens are sampled from the policy pi_theta, so with ``delta = log_probs - ref_log_probs``
(= -log r, r = pi_ref / pi_theta) the estimators of KL[pi_theta || pi_ref] are:

- ``k1 = delta``                        (unbiased, high variance, can be negative)
- ``k2 = delta^2 / 2``                  (biased, low variance, >= 0)
- ``k3 = exp(-delta) - 1 + delta``      (unbiased, low variance, >= 0; "low_var_kl" in GRPO/verl)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kl_penalty", "KL_ESTIMATORS", "K3_CLAMP"]

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_CLAMP = 10.0
# exp(20) ~ 4.9e8 >> K3_CLAMP: clamping -delta there changes no unclamped k3 value but keeps exp finite.
_K3_EXP_ARG_MAX = 20.0


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate between pi_theta (sampling policy) and pi_ref.

    ``k3`` is computed as ``expm1(-delta) + delta`` (never negative in floating point, unlike
    ``exp(-delta) - 1 + delta``) and clamped to ``[-10, 10]`` (:data:`K3_CLAMP`) as in verl's
    ``low_var_kl``, so one token whose log-probs disagree wildly cannot dominate the loss; where the
    clamp is active the gradient is 0. (k3 >= 0, so only the upper bound can act.) k1 and k2 are not
    clamped.

    Args:
        log_probs: float tensor [...] (e.g. [B, T]) of log pi_theta of the sampled tokens.
        ref_log_probs: float tensor of the same shape, log pi_ref of the same tokens.
        estimator: "k1", "k2" or "k3".

    Returns:
        Tensor of the same shape; dtype float32 when the inputs are fp16/bf16, else the input dtype.
        Differentiable w.r.t. ``log_probs`` (and ``ref_log_probs``).

    Raises:
        ValueError: unknown ``estimator`` or mismatched shapes.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} must have the same shape"
        )
    dtype = torch.promote_types(torch.promote_types(log_probs.dtype, ref_log_probs.dtype), torch.float32)
    delta = log_probs.to(dtype) - ref_log_probs.to(dtype)
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta * delta
    neg = torch.clamp(-delta, max=_K3_EXP_ARG_MAX)
    k3 = torch.expm1(neg) - neg
    return torch.clamp(k3, min=-K3_CLAMP, max=K3_CLAMP)

"""Clipped policy-gradient losses (PPO / GRPO / DAPO token level with optional dual clip, GSPO
sequence level and GSPO-token, CISPO), KL and entropy terms, and micro-batch-invariant loss
aggregation.

Conventions: a micro-batch is ``[B, T]`` (B responses, T response positions, padded); ``loss_mask``
is 1 on response tokens that enter the loss. Each row of a GSPO micro-batch must hold one WHOLE
response, because GSPO's ratio is a per-sequence quantity.

Micro-batch invariance: :func:`aggregate_loss` divides by GLOBAL counts (tokens or sequences of the
whole global batch, over all micro-batches and DP ranks). The loss it returns is therefore this
micro-batch's *share* of the global loss: summing the returned losses (and their gradients) over
every micro-batch of every DP rank gives the global loss exactly, however the batch was cut. If the
DP gradient all-reduce averages (divides by dp size) instead of summing, the trainer must multiply
the loss by dp size to keep this property.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from moerl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from moerl.algorithms.off_policy import check_off_policy_args, off_policy_weights

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "masked_mean",
    "count_loss_tokens_and_seqs",
    "ppo_token_loss",
    "gspo_token_loss",
    "ppo_dual_clip_token_loss",
    "cispo_token_loss",
    "aggregate_loss",
    "compute_policy_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
POLICY_LOSSES = ("gspo", "ppo", "gspo_token", "cispo")
# exp(20) ~ 4.9e8: log-ratios beyond +-20 are clamped before exp so that the ratio stays finite.
LOG_RATIO_CLAMP = 20.0

Number = Union[int, float, Tensor]


def _bool_mask(mask: Tensor, like: Tensor, name: str = "loss_mask") -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(mask.shape)} must equal the per-token shape {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is non-zero.

    Masked-out positions are excluded with ``torch.where`` (not multiplied by 0), so NaN/inf values
    there do not leak into the result. An empty mask gives 0.

    Args:
        x: tensor [...].
        mask: tensor of the same shape (bool, int or float; non-zero = included).
        dim: reduce over this dim only (default: all elements).

    Returns:
        Scalar tensor (or the reduced tensor when ``dim`` is given), dtype of ``x``.

    Raises:
        ValueError: shapes differ.
    """
    m = _bool_mask(mask, x, "mask")
    total = torch.where(m, x, torch.zeros_like(x)).sum() if dim is None else torch.where(m, x, torch.zeros_like(x)).sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp(min=1).to(total.dtype)


def count_loss_tokens_and_seqs(loss_mask: Tensor) -> tuple[int, int]:
    """Counts to pass as ``global_num_tokens`` / ``global_num_seqs`` (sum them over all micro-batches
    and DP ranks of the global batch first).

    A sequence is a row of ``loss_mask`` with at least one loss token; all-zero rows (padding
    micro-batches) are not counted, matching :func:`aggregate_loss`'s own counts.

    Args:
        loss_mask: [B, T] (bool/int/float).

    Returns:
        (number of loss tokens, number of rows with at least one loss token).
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    m = loss_mask != 0
    return int(m.sum().item()), int(m.any(dim=1).sum().item())


def _check_pair(log_probs: Tensor, old_log_probs: Tensor) -> None:
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got shape {tuple(log_probs.shape)}")
    if old_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"old_log_probs {tuple(old_log_probs.shape)} must have the shape of log_probs {tuple(log_probs.shape)}"
        )


def _check_eps(eps_clip_low: float, eps_clip_high: float) -> None:
    if not (0.0 <= eps_clip_low < 1.0):
        raise ValueError(f"eps_clip_low must be in [0, 1), got {eps_clip_low}")
    if not eps_clip_high >= 0.0:
        raise ValueError(f"eps_clip_high must be >= 0, got {eps_clip_high}")


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """[B] -> [B, 1] (broadcast over tokens) or [B, T] as is."""
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(1)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] (one per response) or [B, T] (per token) with B, T of log_probs "
        f"{tuple(like.shape)}; got {tuple(advantages.shape)}"
    )


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_clip_low: float, eps_clip_high: float
) -> tuple[Tensor, Tensor]:
    """-min(ratio * A, clip(ratio) * A) and the mask where the clipped branch is the smaller one.

    Where the clipped branch wins, the loss is the constant ``-clip(ratio) * A`` (clamp is outside
    its range there), so the gradient is exactly 0; elsewhere the gradient is that of ``-ratio * A``.
    """
    low, high = 1.0 - eps_clip_low, 1.0 + eps_clip_high
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(low, high) * advantages
    clipped_mask = clipped > unclipped  # (A > 0 and ratio > high) or (A < 0 and ratio < low)
    return torch.where(clipped_mask, clipped, unclipped), clipped_mask


def ppo_token_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip_low: float,
    eps_clip_high: float,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token (Schulman et al. 2017; GRPO arXiv 2402.03300; DAPO's
    asymmetric "clip-higher" arXiv 2503.14476).

    ``rho_t = exp(log_probs_t - old_log_probs_t)`` (the log-ratio is clamped to +-20 before exp);
    ``loss_t = -min(rho_t * A_t, clip(rho_t, 1 - eps_clip_low, 1 + eps_clip_high) * A_t)``.

    Args:
        log_probs: float [B, T], log pi_theta of the response tokens (requires grad).
        old_log_probs: float [B, T], log pi_old (detached).
        advantages: float [B] (broadcast over tokens) or [B, T].
        eps_clip_low, eps_clip_high: clip range (e.g. 0.2 / 0.28 for DAPO).

    Returns:
        (per_token_loss [B, T] float, clipped_mask [B, T] bool: True where the clipped branch was
        taken, i.e. the token's gradient is 0). Padding positions are not masked here; pass the
        result to :func:`aggregate_loss` with the loss mask.

    Raises:
        ValueError: bad shapes or clip range.
    """
    _check_pair(log_probs, old_log_probs)
    _check_eps(eps_clip_low, eps_clip_high)
    adv = _token_advantages(advantages, log_probs)
    log_ratio = (log_probs - old_log_probs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    return _clipped_surrogate(ratio, adv.detach(), eps_clip_low, eps_clip_high)


def _check_dual_clip_c(dual_clip_c: float) -> float:
    if isinstance(dual_clip_c, bool) or not isinstance(dual_clip_c, (int, float)) or not (
        1.0 < float(dual_clip_c) < float("inf")
    ):
        raise ValueError(
            f"algorithm.dual_clip_c must be a finite float > 1 (Ye et al. 2020 use 3) or null, got {dual_clip_c!r}"
        )
    return float(dual_clip_c)


def ppo_dual_clip_token_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip_low: float,
    eps_clip_high: float,
    dual_clip_c: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Dual-clip PPO per token (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    RL", arXiv 1912.09729, eq. 5).

    ``l_t`` = :func:`ppo_token_loss`'s ``-min(rho_t A_t, clip(rho_t) A_t)``; for ``A_t < 0`` it is
    bounded by ``-c * A_t = c * |A_t|``: ``loss_t = min(l_t, -c * A_t)`` (the paper's
    ``max(min(rho A, clip(rho) A), c A)`` as a loss). This caps the loss of a token whose ratio
    exploded (``rho_t > c`` for large enough negative advantages); where the bound is active the
    loss is the constant ``-c * A_t`` and the gradient is 0. For ``A_t >= 0`` the loss is PPO's.

    Args:
        log_probs, old_log_probs, advantages, eps_clip_low, eps_clip_high: as :func:`ppo_token_loss`.
        dual_clip_c: c > 1 (``algorithm.dual_clip_c``; the paper uses 3).

    Returns:
        (per_token_loss [B, T], clipped_mask [B, T] bool (PPO's clip, as :func:`ppo_token_loss`),
        dual_clipped_mask [B, T] bool: True where the ``-c * A`` bound is taken (gradient 0)).

    Raises:
        ValueError: bad shapes or clip range; ``dual_clip_c`` not a finite float > 1 (the message
            names ``algorithm.dual_clip_c``).
    """
    c = _check_dual_clip_c(dual_clip_c)
    loss, clipped = ppo_token_loss(log_probs, old_log_probs, advantages, eps_clip_low, eps_clip_high)
    adv = _token_advantages(advantages, log_probs).detach()
    bound = (-c * adv).to(loss.dtype).expand_as(loss)
    dual = (adv < 0) & (loss > bound)
    return torch.where(dual, bound, loss), clipped, dual


def cispo_token_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip_low: float,
    eps_clip_high: float,
) -> tuple[Tensor, Tensor]:
    """CISPO per token (MiniMax-M1, arXiv 2506.13585, sec. 3.1, eqs. 4-5: Clipped IS-weight Policy
    Optimization).

    ``r_t = exp(log_probs_t - old_log_probs_t)`` (log-ratio clamped to +-20);
    ``loss_t = -sg[clip(r_t, 1 - eps_clip_low, 1 + eps_clip_high)] * A_t * log_probs_t``.
    Unlike PPO no token is dropped: the IS weight is clipped and detached, and the gradient
    ``-clip(r_t) * A_t * grad log_probs_t`` flows through every token. (The paper sets no lower
    bound in practice: a large ``eps_clip_low`` such as 0.999... keeps ``1 - eps_clip_low`` near 0.)
    Note the loss VALUE contains ``log_probs`` (it is not ``-r A``); only its gradient is meaningful.

    Args:
        log_probs: float [B, T], log pi_theta (requires grad).
        old_log_probs: float [B, T], log pi_old (detached).
        advantages: float [B] (broadcast over tokens) or [B, T].
        eps_clip_low, eps_clip_high: IS-weight clip range (eps_low in [0, 1), eps_high >= 0).

    Returns:
        (per_token_loss [B, T], clipped_mask [B, T] bool: True where the IS weight was truncated
        (the token still has a gradient)). Padding positions are not masked here; aggregate with
        :func:`aggregate_loss`.

    Raises:
        ValueError: bad shapes or clip range.
    """
    _check_pair(log_probs, old_log_probs)
    _check_eps(eps_clip_low, eps_clip_high)
    adv = _token_advantages(advantages, log_probs).detach()
    with torch.no_grad():
        ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
        clipped = weight != ratio
        # NaN log-probs on padding: weight 0 keeps the (masked-out) token's gradient 0 instead of NaN.
        weight = torch.where(torch.isfinite(weight), weight, torch.zeros_like(weight))
    return -weight * adv * log_probs, clipped


def gspo_token_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip_low: float,
    eps_clip_high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO in its GSPO-token form (Group Sequence Policy Optimization, arXiv 2507.18071, eqs. 5-7
    and 13-14).

    ``s_i = exp(mean_{t in mask_i}(log_probs_{i,t} - old_log_probs_{i,t}))`` (length-normalised
    sequence ratio; the mean log-ratio is clamped to +-20);
    ``s_{i,t} = sg[s_i] * exp(log_probs_{i,t} - sg[log_probs_{i,t}])`` (value s_i, gradient
    s_i * grad log_probs_{i,t});
    ``loss_{i,t} = -min(s_{i,t} * A_{i,t}, clip(s_{i,t}, 1 - eps_clip_low, 1 + eps_clip_high) * A_{i,t})``.

    With a per-sequence advantage and ``aggregate_loss(..., "seq-mean-token-mean",
    global_num_seqs=G_total)`` the result equals ``-J_GSPO = -(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``
    in value and gradient. Each row must hold one whole response: s_i is computed from the row alone.

    Args:
        log_probs: float [B, T], log pi_theta (requires grad).
        old_log_probs: float [B, T], log pi_old (detached).
        advantages: float [B] or [B, T] (GSPO-token allows per-token advantages).
        loss_mask: [B, T] (bool/int/float); rows with no loss token get s_i = 1.
        eps_clip_low, eps_clip_high: clip range (paper: 3e-4 / 4e-4).

    Returns:
        (per_token_loss [B, T] float, clipped_mask [B, T] bool (True where the clipped branch was
        taken; constant along a row for per-sequence advantages), seq_ratio [B] float = s_i, detached).

    Raises:
        ValueError: bad shapes or clip range.
    """
    _check_pair(log_probs, old_log_probs)
    _check_eps(eps_clip_low, eps_clip_high)
    adv = _token_advantages(advantages, log_probs)
    mask = _bool_mask(loss_mask, log_probs)
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), torch.zeros_like(log_probs))
    num_tokens = mask.sum(dim=1).clamp(min=1).to(log_ratio.dtype)
    seq_log_ratio = (log_ratio.sum(dim=1) / num_tokens).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # Value s_i on every token, gradient s_i * d log_probs_t.
    # (Masked positions get value s_i and no gradient, so NaN/inf padding cannot poison the grad.)
    grad_carrier = torch.where(mask, log_probs - log_probs.detach(), torch.zeros_like(log_probs))
    token_log_ratio = seq_log_ratio.detach().unsqueeze(1) + grad_carrier
    ratio = torch.exp(token_log_ratio)
    per_token_loss, clipped_mask = _clipped_surrogate(ratio, adv.detach(), eps_clip_low, eps_clip_high)
    return per_token_loss, clipped_mask, torch.exp(seq_log_ratio.detach())


def _denominator(value: Optional[Number], own: Tensor, name: str) -> Tensor:
    if value is None:
        return own.clamp(min=1)
    v = value.detach() if isinstance(value, Tensor) else torch.tensor(float(value))
    if v.numel() != 1 or not bool(v.reshape(()) > 0):
        raise ValueError(
            f"{name} must be a positive count of the whole global batch (all micro-batches and DP ranks), "
            f"got {value!r}; pass None to use this micro-batch's own count"
        )
    return v.reshape(()).to(device=own.device, dtype=own.dtype)


def aggregate_loss(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    mode: str,
    *,
    global_num_tokens: Optional[Number] = None,
    global_num_seqs: Optional[Number] = None,
    seq_token_sum_constant: Optional[float] = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to this micro-batch's share of the global-batch loss.

    Modes (sums run over this micro-batch; denominators are global):

    - ``"token-mean"`` (DAPO): ``sum_{i,t} l*m / global_num_tokens``.
    - ``"seq-mean-token-mean"`` (GRPO, GSPO): ``sum_i (sum_t l*m / |y_i|) / global_num_seqs``.
    - ``"seq-mean-token-sum"``: ``sum_{i,t} l*m / (global_num_seqs * C)`` with
      ``C = seq_token_sum_constant`` (default 1). Dr.GRPO (arXiv 2503.20783) uses a constant
      C such as max_new_tokens, so no length normalisation biases the gradient.

    ``global_num_tokens`` / ``global_num_seqs`` are the counts of the whole global batch (see
    :func:`count_loss_tokens_and_seqs`); summing the returned values over all micro-batches and DP
    ranks then gives the same loss and gradient however the batch is cut. When None, this tensor's
    own counts are used (tokens with mask != 0; rows with at least one such token), min 1.
    Masked positions are excluded with ``torch.where`` so NaN/inf padding values do not leak.

    Args:
        per_token_loss: float [B, T].
        loss_mask: [B, T] (bool/int/float; non-zero = in the loss).
        mode: one of :data:`LOSS_AGG_MODES`.
        global_num_tokens: total loss tokens of the global batch (int, float or 0-d tensor, > 0).
        global_num_seqs: total responses with loss tokens in the global batch (> 0).
        seq_token_sum_constant: C for "seq-mean-token-sum" (> 0).

    Returns:
        Scalar tensor (dtype of ``per_token_loss``).

    Raises:
        ValueError: unknown mode, bad shapes, non-positive global counts or constant.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss must be [B, T], got shape {tuple(per_token_loss.shape)}")
    mask = _bool_mask(loss_mask, per_token_loss)
    loss = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    dtype = per_token_loss.dtype
    if mode == "token-mean":
        denom = _denominator(global_num_tokens, mask.sum().to(dtype), "global_num_tokens")
        return loss.sum() / denom
    seqs = _denominator(global_num_seqs, mask.any(dim=1).sum().to(dtype), "global_num_seqs")
    if mode == "seq-mean-token-mean":
        row_tokens = mask.sum(dim=1).clamp(min=1).to(dtype)
        return (loss.sum(dim=1) / row_tokens).sum() / seqs
    c = 1.0 if seq_token_sum_constant is None else float(seq_token_sum_constant)
    if not c > 0:
        raise ValueError(f"seq_token_sum_constant must be > 0 (e.g. max_new_tokens), got {seq_token_sum_constant!r}")
    return loss.sum() / (seqs * c)


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    policy_loss: str = "gspo",
    eps_clip_low: float,
    eps_clip_high: float,
    loss_agg_mode: str,
    global_num_tokens: Optional[Number] = None,
    global_num_seqs: Optional[Number] = None,
    seq_token_sum_constant: Optional[float] = None,
    ref_log_probs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Optional[Tensor] = None,
    behaviour_log_probs: Optional[Tensor] = None,
    off_policy_correction: str = "none",
    is_level: str = "token",
    is_cap: float = 2.0,
    is_lower: float = 0.0,
    icepop_beta: float = 2.0,
    token_staleness: Optional[Tensor] = None,
    max_staleness: Optional[int] = None,
    dual_clip_c: Optional[float] = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Policy loss of one micro-batch: clipped surrogate (+ kl_coef * KL loss term, GRPO-style;
    - entropy_coef * entropy bonus), optionally corrected for off-policy (asynchronous) data.

    ``loss = aggregate(c * pg_per_token) + kl_coef * aggregate(kl_penalty(log_probs, ref_log_probs))
    - entropy_coef * aggregate(entropy)``, all aggregated with the same mode and global denominators
    (see :func:`aggregate_loss`). With ``kl_coef == 0`` (``entropy_coef == 0``) the KL (entropy)
    term is not added at all (0 * NaN would be NaN); the ``kl`` (``entropy``) metric is still
    reported when ``ref_log_probs`` (``entropy``) is given.

    Policy losses (``policy_loss``):

    - ``"ppo"``: :func:`ppo_token_loss` (PPO / GRPO / DAPO token-level clipped surrogate); with
      ``dual_clip_c`` the dual-clip bound of :func:`ppo_dual_clip_token_loss` (Ye et al. 2020).
    - ``"gspo"``: :func:`gspo_token_loss` (GSPO, arXiv 2507.18071, sequence-level ratio s_i).
    - ``"gspo_token"``: GSPO-token (arXiv 2507.18071, sec. 4.3):
      ``s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]`` with per-token advantages
      ``A_{i,t}``. moerl's ``"gspo"`` is already computed in this form, so the two give the same
      loss and gradient for the same inputs; ``"gspo_token"`` names the intent (token-level
      advantages [B, T], e.g. REINFORCE++ returns or GAE). With advantages constant along each row
      both equal the sequence-level GSPO objective, value and gradient.
    - ``"cispo"``: :func:`cispo_token_loss` (MiniMax-M1, arXiv 2506.13585, eqs. 4-5): detached,
      clipped IS weight times ``A * log pi_theta``; ``eps_clip_low`` / ``eps_clip_high`` bound the
      IS weight.

    Off-policy correction (:mod:`moerl.algorithms.off_policy`): ``old_log_probs`` are the proximal
    policy pi_prox (the trainer's recomputed log-probs; the PPO / GSPO ratio is always taken against
    them) and ``behaviour_log_probs`` the behaviour policy mu (the rollout server's). The detached
    weight ``c`` of :func:`moerl.algorithms.off_policy.off_policy_weights` (from
    ``w = pi_prox / mu`` at ``is_level``) multiplies each token's policy-gradient loss; tokens it
    removes (decoupled / mis / icepop) contribute 0. For PPO the per-token loss is
    ``-c_t * min(r_t A, clip(r_t) A)`` with ``r_t = pi_theta / pi_prox`` per token; for GSPO it is
    ``-c_{i,t} * min(s_{i,t} A, clip(s_{i,t}) A)`` with the sequence ratio ``s_i`` (GSPO-token form)
    and ``c`` per token at ``is_level="token"`` or the row's ``c_i`` at the sequence levels. The GSPO
    ratio ``s_i`` itself is computed over all of the row's loss tokens, removed ones included. The
    correction applies to the policy-gradient term only, not to the KL term. With
    ``off_policy_correction="none"`` the loss is bitwise what it is without ``behaviour_log_probs``.

    Denominators: removed tokens (by the correction or by staleness) only lose their numerator
    term; every denominator stays that of ``loss_mask`` (the global counts passed in, this batch's
    own counts when None, and each row's ``|y_i|`` in ``"seq-mean-token-mean"``). Masking therefore
    lowers the loss magnitude instead of re-normalising over the surviving tokens (as verl does), and
    the loss stays independent of how the batch is cut into micro-batches.

    Staleness defence: with ``max_staleness`` set, loss tokens whose ``token_staleness`` exceeds it
    are removed from the loss (from the policy-gradient and the KL term; denominators unchanged) and
    counted in ``over_bound_token_frac``. The data pipeline is meant to guarantee this never happens; this
    is the last line of defence. Sequence-level IS weights and the GSPO ratio are still computed over
    the whole ``loss_mask`` row.

    Args:
        log_probs, old_log_probs: float [B, T].
        advantages: float [B] or [B, T].
        loss_mask: [B, T].
        policy_loss: one of :data:`POLICY_LOSSES` (see above).
        eps_clip_low, eps_clip_high: clip range.
        loss_agg_mode, global_num_tokens, global_num_seqs, seq_token_sum_constant: see
            :func:`aggregate_loss`.
        ref_log_probs: float [B, T] of the reference policy, or None.
        kl_coef: weight of the KL loss term (>= 0); > 0 requires ``ref_log_probs``.
        kl_estimator: "k1", "k2" or "k3" (:func:`moerl.algorithms.kl.kl_penalty`).
        entropy: float [B, T] token entropies (logged only), or None.
        behaviour_log_probs: float [B, T], log mu of the response tokens (the rollout server's
            ``Sample.rollout_log_probs``, label-aligned like ``old_log_probs``), or None. Required
            when ``off_policy_correction != "none"``; when given, the mismatch metrics are reported
            even with ``"none"``.
        off_policy_correction: ``algorithm.off_policy_correction``: "none", "decoupled", "tis",
            "mis" or "icepop".
        is_level: ``algorithm.is_level``: "token", "sequence" or "geo_mean".
        is_cap, is_lower, icepop_beta: ``algorithm.is_cap`` (> 0), ``algorithm.is_lower`` (>= 0),
            ``algorithm.icepop_beta`` (> 1).
        token_staleness: [B, T] float/int, per token the trainer's weight version minus the version
            that generated it, or None.
        max_staleness: int >= 0 (``train.max_staleness``) or None (no check). Requires
            ``token_staleness``.
        dual_clip_c: ``algorithm.dual_clip_c``: c > 1 enables dual-clip PPO (only with
            ``policy_loss="ppo"``), None disables it.
        entropy_coef: ``algorithm.entropy_coef`` (>= 0): weight of the entropy bonus. When > 0,
            ``entropy`` must be given and must carry the graph to the logits (e.g.
            :func:`moerl.algorithms.logprobs.entropy_from_logits` computed with grad): a detached
            entropy would add a constant and silently do nothing, so it is refused while
            ``log_probs`` requires grad. Stale tokens (``max_staleness``) are removed from the
            bonus like from the KL term; the off-policy weight ``c`` does not apply to it.

    Returns:
        (loss: scalar tensor with grad, metrics: dict of python floats). Metrics:
        ``pg_loss`` (this micro-batch's share of the aggregated policy loss; sums to the global value
        over micro-batches), ``kl_loss`` (same, only when kl_coef > 0), ``entropy_loss`` (same: the
        aggregated entropy, before the coefficient and sign; only when entropy_coef > 0), and local
        masked means over this micro-batch's loss tokens: ``clip_frac`` (PPO / GSPO: clipped branch
        taken, gradient 0; CISPO: IS weight truncated, gradient kept), ``dual_clip_frac`` (only with
        ``dual_clip_c``: the ``-c * A`` bound taken), ``ratio_mean`` (token ratio for PPO / CISPO,
        mean of s_i over rows for GSPO), ``kl`` (when ``ref_log_probs`` is given), ``entropy`` (when given);
        when ``behaviour_log_probs`` is given: ``is_weight_mean``, ``is_masked_frac``,
        ``behav_prox_kl`` (local means) and ``is_weight_max`` (a local MAX: reduce it with max, not
        a sum; see :func:`moerl.algorithms.off_policy.off_policy_weights`); when ``max_staleness`` is
        set: ``over_bound_token_frac`` (local mean); ``num_tokens`` (loss tokens of this micro-batch, to
        weight local means when averaging).

    Raises:
        ValueError: unknown policy_loss / mode / estimator, bad shapes, kl_coef < 0, or
            kl_coef > 0 without ref_log_probs; bad off-policy options (the message names the
            ``algorithm.*`` key), a correction other than "none" without ``behaviour_log_probs``,
            ``max_staleness`` < 0 or given without ``token_staleness``; ``dual_clip_c`` not > 1 or
            given with a policy loss other than "ppo" (names ``algorithm.dual_clip_c``);
            ``entropy_coef`` < 0, or > 0 without a differentiable ``entropy`` (names
            ``algorithm.entropy_coef``).
    """
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if kl_coef > 0 and ref_log_probs is None:
        raise ValueError("kl_coef > 0 needs ref_log_probs (compute them with the reference model) or set kl_coef=0")
    if dual_clip_c is not None:
        _check_dual_clip_c(dual_clip_c)
        if policy_loss != "ppo":
            raise ValueError(
                f"algorithm.dual_clip_c={dual_clip_c!r} applies to policy_loss='ppo' only (got {policy_loss!r}); "
                "set it to null"
            )
    if isinstance(entropy_coef, bool) or not isinstance(entropy_coef, (int, float)) or not (
        0.0 <= float(entropy_coef) < float("inf")
    ):
        raise ValueError(f"algorithm.entropy_coef must be a finite float >= 0, got {entropy_coef!r}")
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError("algorithm.entropy_coef > 0 needs the per-token entropy [B, T] (with grad)")
        if entropy.shape != log_probs.shape:
            raise ValueError(
                f"entropy {tuple(entropy.shape)} must have the shape of log_probs {tuple(log_probs.shape)}"
            )
        if torch.is_grad_enabled() and log_probs.requires_grad and not entropy.requires_grad:
            raise ValueError(
                "algorithm.entropy_coef > 0 needs a differentiable entropy (computed from the logits with grad); "
                "a detached entropy makes the bonus a constant that does nothing"
            )
    check_off_policy_args(off_policy_correction, is_level, is_cap, is_lower, icepop_beta)
    if off_policy_correction != "none" and behaviour_log_probs is None:
        raise ValueError(
            f"algorithm.off_policy_correction={off_policy_correction!r} needs behaviour_log_probs (the rollout "
            "server's per-token log-probs, micro-batch extra 'behaviour_log_probs'); set it to 'none' otherwise"
        )
    if max_staleness is not None:
        if token_staleness is None:
            raise ValueError(
                f"max_staleness={max_staleness!r} needs token_staleness (micro-batch extra 'token_staleness'); "
                "pass max_staleness=None to skip the check"
            )
        if not max_staleness >= 0:
            raise ValueError(f"max_staleness (train.max_staleness) must be >= 0 or None, got {max_staleness!r}")
    _check_pair(log_probs, old_log_probs)
    mask = _bool_mask(loss_mask, log_probs)
    metrics: dict[str, float] = {}
    is_weights = is_keep = None
    if behaviour_log_probs is not None:
        is_weights, is_keep, metrics = off_policy_weights(
            old_log_probs, behaviour_log_probs, mask, correction=off_policy_correction, level=is_level,
            cap=is_cap, lower=is_lower, beta=icepop_beta,
        )
    stale = None
    if max_staleness is not None:
        if token_staleness.shape != log_probs.shape:
            raise ValueError(
                f"token_staleness {tuple(token_staleness.shape)} must have the shape of log_probs "
                f"{tuple(log_probs.shape)}"
            )
        stale = mask & (token_staleness.detach() > max_staleness)
        metrics["over_bound_token_frac"] = float(stale.sum()) / max(int(mask.sum()), 1)
    agg = dict(
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        seq_token_sum_constant=seq_token_sum_constant,
    )
    dual = None
    if policy_loss in ("gspo", "gspo_token"):
        pg, clipped, seq_ratio = gspo_token_loss(
            log_probs, old_log_probs, advantages, mask, eps_clip_low, eps_clip_high
        )
        rows = mask.any(dim=1)
        ratio_mean = seq_ratio[rows].mean() if bool(rows.any()) else seq_ratio.new_ones(())
    else:
        if policy_loss == "cispo":
            pg, clipped = cispo_token_loss(log_probs, old_log_probs, advantages, eps_clip_low, eps_clip_high)
        elif dual_clip_c is not None:
            pg, clipped, dual = ppo_dual_clip_token_loss(
                log_probs, old_log_probs, advantages, eps_clip_low, eps_clip_high, dual_clip_c
            )
        else:
            pg, clipped = ppo_token_loss(log_probs, old_log_probs, advantages, eps_clip_low, eps_clip_high)
        with torch.no_grad():
            ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            ratio_mean = masked_mean(ratio, mask)
    if off_policy_correction != "none":  # c * loss on kept tokens, 0 on removed ones (NaN-safe)
        pg = torch.where(is_keep, (pg * is_weights).to(pg.dtype), torch.zeros_like(pg))
    if stale is not None:
        pg = torch.where(stale, torch.zeros_like(pg), pg)
    pg_loss = aggregate_loss(pg, mask, loss_agg_mode, **agg)
    loss = pg_loss
    metrics.update({
        "pg_loss": float(pg_loss.detach()),
        "clip_frac": float(masked_mean(clipped.to(torch.float32), mask)),
        "ratio_mean": float(ratio_mean),
        "num_tokens": float(mask.sum()),
    })
    if dual is not None:
        metrics["dual_clip_frac"] = float(masked_mean(dual.to(torch.float32), mask))
    if ref_log_probs is not None:
        if ref_log_probs.shape != log_probs.shape:
            raise ValueError(
                f"ref_log_probs {tuple(ref_log_probs.shape)} must have the shape of log_probs {tuple(log_probs.shape)}"
            )
        kl = kl_penalty(log_probs, ref_log_probs.detach(), kl_estimator)
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
        if kl_coef > 0:
            if stale is not None:
                kl = torch.where(stale, torch.zeros_like(kl), kl)
            kl_loss = aggregate_loss(kl, mask, loss_agg_mode, **agg)
            loss = loss + kl_coef * kl_loss.to(loss.dtype)
            metrics["kl_loss"] = float(kl_loss.detach())
    if entropy is not None:
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if entropy_coef > 0:
            ent = entropy if stale is None else torch.where(stale, torch.zeros_like(entropy), entropy)
            entropy_loss = aggregate_loss(ent, mask, loss_agg_mode, **agg)
            loss = loss - float(entropy_coef) * entropy_loss.to(loss.dtype)
            metrics["entropy_loss"] = float(entropy_loss.detach())
    return loss, metrics

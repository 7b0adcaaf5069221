"""Off-policy corrections for asynchronous RL: importance weights between the behaviour policy that
generated the tokens and the proximal policy the update starts from.

Three policies per response token t (REFERENCE.md "Decoupled / staleness-aware PPO", ASYNC.md
"Corrections for off-policy tokens"):

- behaviour ``mu``: the rollout server's log-probs of the token, of the weight version that generated
  it (``Sample.rollout_log_probs``; a partial rollout may mix versions inside one response);
- proximal ``pi_prox``: the trainer's log-probs recomputed with the weights the update starts from
  (``old_log_probs``);
- ``pi_theta``: the policy being optimised (the PPO / GSPO ratio is taken against ``pi_prox``).

The importance weight is ``w = pi_prox / mu``, computed from ``log w_t = old_t - behaviour_t`` at one of
three levels (``is_level``), over the response's loss tokens ``t in m_i`` (``loss_mask`` != 0):

- ``"token"``:    ``w_{i,t} = exp(log w_{i,t})``;
- ``"sequence"``: ``w_{i,t} = W_i = exp(sum_{t in m_i} log w_{i,t})`` (the product of the token weights);
- ``"geo_mean"``: ``w_{i,t} = W_i = exp(mean_{t in m_i} log w_{i,t})`` (their geometric mean).

The log-weight is clamped to ``+-LOG_WEIGHT_CLAMP`` (20, the policy ratio's ``LOG_RATIO_CLAMP``)
before ``exp``. At the sequence levels a cap
applies to ``W_i`` and a mask removes the whole response.

Corrections (``off_policy_correction``) turn ``w`` into the weight ``c`` that multiplies the token's
policy-gradient loss (``c = 0`` removes the token from the loss):

- ``"none"``: ``c = 1`` (no correction; the metrics below are still reported).
- ``"tis"``: truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"; verl's ``tis_imp_ratio_cap``): ``c = min(w, is_cap)``; no token is removed.
- ``"decoupled"``: decoupled PPO as AReaL implements it (Fu et al., "AReaL", arXiv 2505.24298, its
  decoupled PPO objective ``-(pi_prox/mu) * min(r A, clip(r, 1-e, 1+e) A)``, ``r = pi_theta/pi_prox``;
  AReaL's ``behav_imp_weight_cap``): ``c = w`` where ``w <= is_cap``, else ``c = 0``. The paper
  writes the weight uncapped; AReaL's code *filters out* the tokens whose weight exceeds the cap
  ("We filter out the tokens where behav_imp_weight exceeds behav_imp_weight_cap") instead of
  truncating them. That is the one difference from ``"tis"``: both multiply the same clipped surrogate
  taken against ``pi_prox``, tis keeps a heavy token at weight ``is_cap``, decoupled drops it.
  (``decoupled`` is therefore ``mis`` with ``is_lower = 0``.)
- ``"mis"``: masked IS (verl's rollout-correction doc ``docs/algo/rollout_corr.md``; slime's
  ``examples/train_infer_mismatch_helper``): ``c = w`` where ``is_lower <= w <= is_cap``, else 0.
  Kept tokens keep their (untruncated, since ``w <= is_cap`` there) weight ``w``.
- ``"icepop"``: IcePop (Ling team 2025, Ring-1T technical report "Every Step Evolves" and the
  IcePop blog post): ``c = M(w) = w`` where ``1/icepop_beta <= w <= icepop_beta``, else 0. IcePop's
  mask function is ``M(k; a, b) = k`` for ``k`` in ``[a, b]`` and 0 outside, i.e. kept tokens keep
  their IS weight rather than weight 1 (INTELLECT-3's report, eq. 1, writes it the same way);
  icepop is mis with the symmetric band ``[1/beta, beta]``.

Band edges are inclusive. Everything returned is detached: the weights are data, not a function of
``theta``. The caller multiplies the per-token loss by ``c`` where ``keep_mask`` is True and writes 0
elsewhere (with ``torch.where``, so NaN padding cannot leak); aggregation denominators stay those of
``loss_mask`` (see :func:`moerl.algorithms.policy_loss.compute_policy_loss`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moerl.algorithms.kl import kl_penalty

__all__ = [
    "OFF_POLICY_CORRECTIONS",
    "IS_LEVELS",
    "LOG_WEIGHT_CLAMP",
    "check_off_policy_args",
    "off_policy_weights",
    "rollout_mismatch_metrics",
]

OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis", "mis", "icepop")
IS_LEVELS = ("token", "sequence", "geo_mean")
# Same bound as policy_loss.LOG_RATIO_CLAMP (exp(20) ~ 4.9e8): log-weights are clamped before exp.
LOG_WEIGHT_CLAMP = 20.0
# Corrections that remove tokens (or sequences) whose weight lies outside a band.
_MASKING = ("decoupled", "mis", "icepop")


def check_off_policy_args(
    correction: str, level: str, cap: float, lower: float, beta: float
) -> None:
    """Validate the recipe's off-policy keys (names as in ``algorithm.*``).

    Raises:
        ValueError: unknown ``algorithm.off_policy_correction`` / ``algorithm.is_level``;
            ``algorithm.is_cap`` <= 0 (or NaN); ``algorithm.is_lower`` < 0 (or NaN), or above
            ``is_cap`` with ``mis`` (an empty band would remove every token);
            ``algorithm.icepop_beta`` <= 1 (or NaN).
    """
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"algorithm.off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {correction!r}"
        )
    if level not in IS_LEVELS:
        raise ValueError(f"algorithm.is_level must be one of {IS_LEVELS}, got {level!r}")
    if not float(cap) > 0:
        raise ValueError(f"algorithm.is_cap must be > 0, got {cap!r}")
    if not float(lower) >= 0:
        raise ValueError(f"algorithm.is_lower must be >= 0, got {lower!r}")
    if correction == "mis" and float(lower) > float(cap):
        raise ValueError(
            f"algorithm.is_lower ({lower}) must be <= algorithm.is_cap ({cap}) with off_policy_correction=mis "
            "(the band [is_lower, is_cap] would be empty)"
        )
    if not float(beta) > 1:
        raise ValueError(f"algorithm.icepop_beta must be > 1, got {beta!r}")


def off_policy_weights(
    old_log_probs: Tensor,
    behaviour_log_probs: Tensor,
    loss_mask: Tensor,
    *,
    correction: str = "none",
    level: str = "token",
    cap: float = 2.0,
    lower: float = 0.0,
    beta: float = 2.0,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Per-token off-policy weights ``c`` and keep-mask of one micro-batch (see the module docstring
    for the equations and sources).

    Args:
        old_log_probs: float [B, T], log pi_prox of the response tokens (the trainer's recomputed
            log-probs before the update). Detached here.
        behaviour_log_probs: float [B, T], log mu of the same tokens (the rollout server's, of the
            weight version that generated each token). Detached here.
        loss_mask: [B, T] (bool/int/float; non-zero = in the loss). Rows without loss tokens
            (zero-length or aborted responses) get weight 0 and are not kept.
        correction: one of :data:`OFF_POLICY_CORRECTIONS` (``algorithm.off_policy_correction``).
        level: one of :data:`IS_LEVELS` (``algorithm.is_level``).
        cap: ``algorithm.is_cap`` (> 0): truncation cap of tis, upper band edge of decoupled / mis.
        lower: ``algorithm.is_lower`` (>= 0): lower band edge of mis (0 = none).
        beta: ``algorithm.icepop_beta`` (> 1): icepop keeps ``w`` in ``[1/beta, beta]``.

    Returns:
        ``(weights, keep_mask, metrics)``:

        - ``weights``: [B, T], dtype ``promote(old, behaviour, float32)`` (float32 for fp16/bf16
          inputs), detached: ``c`` on kept tokens, 0 elsewhere (non-loss positions and removed tokens).
          With ``correction="none"``: 1 on every loss token.
        - ``keep_mask``: [B, T] bool: loss tokens that stay in the loss (``loss_mask`` minus the
          tokens/sequences the correction removed).
        - ``metrics`` (python floats; means are local masked means over this micro-batch's loss tokens,
          0 when it has none): ``is_weight_mean`` / ``is_weight_max`` (mean / max of the RAW weight
          ``w`` at ``level``, before any cap or mask: the train/rollout mismatch; at the sequence
          levels every loss token carries its row's ``W_i``), ``is_masked_frac`` (fraction of loss
          tokens removed by the correction; 0 for none/tis), ``behav_prox_kl`` (k3 estimate of
          ``KL(mu || pi_prox)`` per token, ``w - 1 - log w`` clamped to [-10, 10] as in
          :func:`moerl.algorithms.kl.kl_penalty`, tokens being samples of ``mu``).

    Raises:
        ValueError: bad option values (see :func:`check_off_policy_args`), tensors not [B, T], or
            shapes that differ.
    """
    check_off_policy_args(correction, level, cap, lower, beta)
    if old_log_probs.dim() != 2:
        raise ValueError(f"old_log_probs must be [B, T], got shape {tuple(old_log_probs.shape)}")
    if behaviour_log_probs.shape != old_log_probs.shape:
        raise ValueError(
            f"behaviour_log_probs {tuple(behaviour_log_probs.shape)} must have the shape of old_log_probs "
            f"{tuple(old_log_probs.shape)}"
        )
    if loss_mask.shape != old_log_probs.shape:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} must have the shape of old_log_probs {tuple(old_log_probs.shape)}"
        )
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    dtype = torch.promote_types(torch.promote_types(old_log_probs.dtype, behaviour_log_probs.dtype), torch.float32)
    with torch.no_grad():
        old = old_log_probs.detach().to(dtype)
        behav = behaviour_log_probs.detach().to(dtype)
        zeros = torch.zeros_like(old)
        log_w = torch.where(mask, old - behav, zeros)  # padding (possibly NaN) never enters
        if level != "token":
            row = log_w.sum(dim=1, keepdim=True)
            if level == "geo_mean":
                row = row / mask.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)
            log_w = row.expand_as(old)
        raw = torch.exp(log_w.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))

        if correction == "none":
            applied, keep = torch.ones_like(raw), mask
        elif correction == "tis":
            applied, keep = raw.clamp(max=float(cap)), mask
        else:  # masking corrections: kept tokens keep w, the others leave the loss
            lo, hi = {
                "decoupled": (0.0, float(cap)),
                "mis": (float(lower), float(cap)),
                "icepop": (1.0 / float(beta), float(beta)),
            }[correction]
            applied, keep = raw, mask & (raw >= lo) & (raw <= hi)
        weights = torch.where(keep, applied, zeros)

        n = int(mask.sum())
        denom = max(n, 1)
        raw_on_mask = torch.where(mask, raw, zeros)
        k3 = kl_penalty(behav, old, "k3")  # delta = log mu - log pi_prox: KL(mu || pi_prox), samples of mu
        metrics = {
            "is_weight_mean": float(raw_on_mask.sum()) / denom,
            "is_weight_max": float(raw_on_mask.max()) if n else 0.0,
            "is_masked_frac": float((mask & ~keep).sum()) / denom,
            "behav_prox_kl": float(torch.where(mask, k3, zeros).sum()) / denom,
        }
    return weights, keep, metrics


def mismatch_per_token(old_log_probs: Tensor, behaviour_log_probs: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token train/rollout mismatch terms (the ones :func:`rollout_mismatch_metrics` averages), float64:
    ``|log pi_prox - log mu|`` and the k3 estimate of ``KL(mu || pi_prox)`` (:func:`moerl.algorithms.kl.kl_penalty`
    with delta = log mu - log pi_prox, clamped at 10).

    Args:
        old_log_probs, behaviour_log_probs: float tensors of one shape (e.g. [T] or [B, S]), nats.
    Returns: (abs_diff, k3), float64 tensors of that shape.
    """
    old, behav = old_log_probs.double(), behaviour_log_probs.double()
    return (old - behav).abs(), kl_penalty(behav, old, "k3")


def rollout_mismatch_metrics(old_log_probs, behaviour_log_probs) -> dict:
    """Train/rollout mismatch of one step, logged every step whatever the correction (the step line's
    ``lp_diff`` and ``mis_kl``; TensorBoard ``logprob_abs_diff_mean`` / ``_max`` and
    ``rollout/mismatch_kl_k3``): over every response token of the step's samples,

    * mean and max of ``|log pi_prox - log mu|`` (trainer's recomputed old_log_probs vs the rollout
      server's log-probs of the sampled tokens; units: nats);
    * the k3 estimate of ``KL(mu || pi_prox)`` (Schulman's k3 ``w - 1 - log w`` with ``w = pi_prox / mu``,
      tokens being samples of mu; :func:`moerl.algorithms.kl.kl_penalty`, clamped at 10 per token),
      the mismatch KL that FP8/BF16 rollouts raise (slime / verl log it the same way).

    Args:
        old_log_probs, behaviour_log_probs: one sequence of floats per sample (response tokens), paired
            row by row (a row pairs its first min(len) tokens).
    Returns: dict of python floats (0 when there are no tokens).
    """
    old, behav = [], []
    for o, b in zip(old_log_probs, behaviour_log_probs):
        n = min(len(o), len(b))
        old.extend(o[:n])
        behav.extend(b[:n])
    if not old:
        return {"logprob_abs_diff_mean": 0.0, "logprob_abs_diff_max": 0.0, "rollout/mismatch_kl_k3": 0.0}
    diff, k3 = mismatch_per_token(torch.tensor(old, dtype=torch.float64), torch.tensor(behav, dtype=torch.float64))
    return {"logprob_abs_diff_mean": float(diff.mean()), "logprob_abs_diff_max": float(diff.max()),
            "rollout/mismatch_kl_k3": float(k3.mean())}

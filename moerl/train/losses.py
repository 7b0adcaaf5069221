"""Loss closures handed to MegatronActor.train_step (one per training phase)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from moerl.algorithms.off_policy import mismatch_per_token
from moerl.algorithms.policy_loss import compute_policy_loss
from moerl.train.batching import MicroBatch

# Loss-closure metrics whose name ends with this are local maxima: reduce them with max over
# micro-batches and DP ranks (MegatronActor.train_step), not with a sum.
MAX_METRIC_SUFFIX = "_max"


def combine_micro_batch_metrics(outs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Combine a loss closure's per-micro-batch metrics of one rank (MegatronActor.train_step): sum,
    except names ending in :data:`MAX_METRIC_SUFFIX` (e.g. ``is_weight_max``), which are local maxima
    and combine with max. (The DP all-reduce follows the same rule.)

    Args:
        outs: one metrics dict per micro-batch (values: floats or 0-d tensors).

    Returns:
        name -> float; a name missing from some micro-batches combines over those that have it.
    """
    metrics: dict[str, float] = {}
    for d in outs:
        for k, v in d.items():
            if k.endswith(MAX_METRIC_SUFFIX):
                metrics[k] = max(metrics[k], float(v)) if k in metrics else float(v)
            else:
                metrics[k] = metrics.get(k, 0.0) + float(v)
    return metrics


#: metrics compute_policy_loss / value_loss already return as this micro-batch's share of the global value
SHARE_METRICS = ("pg_loss", "kl_loss", "entropy_loss", "vf_loss")


def sft_loss(global_num_tokens: int):
    """Token-mean negative log-likelihood of the response tokens over the whole global batch.

    Returns loss_fn(log_probs [B,S], entropy [B,S], mb) -> (sum(-log_probs*mask)/global_num_tokens,
    {"sft_loss": ..., "entropy_sum": ...}).
    """

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        mask = mb.loss_mask
        loss = -(log_probs * mask).sum() / global_num_tokens
        return loss, {"sft_loss": loss.detach(), "entropy": (entropy * mask).sum() / global_num_tokens}

    # a model with multi-token prediction layers trains them on this loss (MegatronActor passes the labels;
    # the entropy is then not computed: 0)
    loss_fn.trains_mtp = True
    return loss_fn


def policy_loss(
    algo,
    *,
    global_num_tokens: int,
    global_num_seqs: int,
    seq_token_sum_constant: Optional[float] = None,
    max_staleness: Optional[int] = None,
):
    """RL loss closure: GSPO or PPO-clip policy loss (+ optional KL to a reference policy), with the
    recipe's off-policy correction (:func:`moerl.algorithms.policy_loss.compute_policy_loss`).

    ``algo`` is the recipe's algorithm section (policy_loss, eps_clip_low/high, loss_agg_mode,
    kl_coef, kl_estimator, off_policy_correction, is_level, is_cap, is_lower, icepop_beta). The
    micro-batch carries extras "old_log_probs" (the proximal policy; without them the update's own
    forward, detached, is the proximal policy: right only for ONE update from the weights that made them,
    see algorithm.recompute_old_log_probs; the train/rollout mismatch metrics are then reported as
    ``mismatch_*``, see :func:`update_mismatch_metrics`) and "ref_log_probs" when a reference policy is
    kept, label-aligned [B,S] float32. Optional extras, same layout:
    "behaviour_log_probs" (the rollout server's per-token log-probs; required when
    ``algo.off_policy_correction != "none"``, and when present the mismatch metrics are reported
    with any correction) and "token_staleness" (per token, trainer weight version minus the version
    that generated it).

    ``max_staleness`` (``train.max_staleness``; None = no check): loss tokens whose
    "token_staleness" exceeds it are removed from the loss (``over_bound_token_frac`` counts them). Pass
    it only when the micro-batches carry "token_staleness" (compute_policy_loss raises otherwise).

    Metric reduction rule: metrics are already divided by the global counts, so summing them over
    micro-batches (and DP ranks) gives global means, except those whose name ends in "_max"
    (``is_weight_max``): they are this micro-batch's local max, and MegatronActor.train_step reduces
    "*_max" metrics with max.
    """

    # An ``algo`` without the off-policy keys (a duck-typed section) gets AlgorithmConfig's defaults.
    off_policy_kwargs = {
        key: getattr(algo, key, default)
        for key, default in (
            ("off_policy_correction", "none"), ("is_level", "token"), ("is_cap", 2.0), ("is_lower", 0.0),
            ("icepop_beta", 2.0),
        )
    }

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        mask = mb.loss_mask
        old = mb.extras.get("old_log_probs")
        from_update = old is None
        if from_update:  # one update from the weights of this very forward: they ARE the proximal log-probs
            old = log_probs.detach()
        loss, metrics = compute_policy_loss(
            log_probs,
            old,
            mb.extras.get("token_advantages", mb.advantages),  # per-token estimators / whitening: [B,S]
            mask,
            policy_loss=algo.policy_loss,
            eps_clip_low=algo.eps_clip_low,
            eps_clip_high=algo.eps_clip_high,
            loss_agg_mode=algo.loss_agg_mode,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
            seq_token_sum_constant=seq_token_sum_constant,
            ref_log_probs=mb.extras.get("ref_log_probs"),  # KL logged; in the loss only when kl_coef > 0
            kl_coef=0.0 if getattr(algo, "kl_in_reward", False) else algo.kl_coef,  # in the rewards instead
            kl_estimator=algo.kl_estimator,
            entropy=entropy,
            behaviour_log_probs=mb.extras.get("behaviour_log_probs"),
            **off_policy_kwargs,
            token_staleness=mb.extras.get("token_staleness"),
            max_staleness=max_staleness,
            dual_clip_c=getattr(algo, "dual_clip_c", None),
            entropy_coef=getattr(algo, "entropy_coef", 0.0),
        )
        # pg_loss / kl_loss are already this micro-batch's share of the global value; "*_max" are
        # local maxima (reduced with max by train_step); the other metrics are local token means:
        # weight them by this micro-batch's share of the tokens.
        share = float(mask.sum()) / global_num_tokens
        out = {"loss": loss.detach()}
        # sum over tokens of |log_probs - old_log_probs|: exactly 0 iff every token ratio is exactly 1
        out["logratio_abs_sum"] = float(((log_probs.detach() - old).abs() * mask).sum())
        behaviour = mb.extras.get("behaviour_log_probs")
        if from_update and behaviour is not None:  # what the old-log-prob pass would have measured (loss tokens)
            diff, k3 = mismatch_per_token(old, behaviour)
            keep = mask.double()
            out["mismatch_lp_abs_diff_mean"] = float((diff * keep).sum()) / global_num_tokens
            out["mismatch_lp_abs_diff" + MAX_METRIC_SUFFIX] = float((diff * keep).max()) if keep.any() else 0.0
            out["mismatch_kl_k3"] = float((k3 * keep).sum()) / global_num_tokens
        for k, v in metrics.items():
            if k == "num_tokens":
                continue
            out[k] = float(v) if k in SHARE_METRICS or k.endswith(MAX_METRIC_SUFFIX) else float(v) * share
        return loss, out

    return loss_fn


def update_mismatch_metrics(m: dict) -> dict:
    """The train/rollout mismatch metrics of a step whose old log-probs came from the update's own forward
    (algorithm.recompute_old_log_probs): ``m``'s ``train/mismatch_*`` (from :func:`policy_loss`, over the
    loss tokens) under the names :func:`moerl.algorithms.off_policy.rollout_mismatch_metrics` gives them
    (``logprob_abs_diff_mean`` / ``_max``, ``rollout/mismatch_kl_k3``), popped from ``m``, plus
    ``train/old_log_probs_from_update`` = 1 (the step-0 ratio check then holds by construction)."""
    names = {"train/mismatch_lp_abs_diff_mean": "logprob_abs_diff_mean",
             "train/mismatch_lp_abs_diff_max": "logprob_abs_diff_max",
             "train/mismatch_kl_k3": "rollout/mismatch_kl_k3"}
    out = {new: m.pop(old) for old, new in names.items() if old in m}
    out["train/old_log_probs_from_update"] = 1.0
    return out


def critic_loss(algo, *, global_num_tokens: int, global_num_seqs: int, seq_token_sum_constant: Optional[float] = None):
    """Critic loss closure for MegatronCritic.train_step: PPO's clipped value loss
    (:func:`moerl.algorithms.value.value_loss`, clip algorithm.value_clip) with the policy loss's aggregation
    mode and global denominators. The micro-batch carries extras "old_values" (the critic's values before
    this step's updates) and "returns" (GAE returns), label-aligned [B,S] float32.

    Returns loss_fn(values [B,S] with grad, mb) -> (loss, metrics: vf_loss (share of the global value),
    vf_clip_frac, value_mean (token means weighted by this micro-batch's share of the tokens))."""
    from moerl.algorithms.value import value_loss

    def loss_fn(values: torch.Tensor, mb: MicroBatch):
        loss, metrics = value_loss(values, mb.extras["old_values"], mb.extras["returns"], mb.loss_mask,
                                   clip=algo.value_clip, loss_agg_mode=algo.loss_agg_mode,
                                   global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                                   seq_token_sum_constant=seq_token_sum_constant)
        share = float(mb.loss_mask.sum()) / global_num_tokens
        return loss, {k: float(v) if k in SHARE_METRICS else float(v) * share for k, v in metrics.items()}

    return loss_fn

"""Loss closures handed to MegatronActor.train_step (one per training phase)."""

from __future__ import annotations

from typing import Optional

import torch

from moerl.algorithms.policy_loss import compute_policy_loss
from moerl.train.batching import MicroBatch


def sft_loss(global_num_tokens: int):
    """Token-mean negative log-likelihood of the response tokens over the whole global batch.

    Returns loss_fn(log_probs [B,S], entropy [B,S], mb) -> (sum(-log_probs*mask)/global_num_tokens,
    {"sft_loss": ..., "entropy_sum": ...}).
    """

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        mask = mb.loss_mask
        loss = -(log_probs * mask).sum() / global_num_tokens
        return loss, {"sft_loss": loss.detach(), "entropy": (entropy * mask).sum() / global_num_tokens}

    return loss_fn


def policy_loss(
    algo,
    *,
    global_num_tokens: int,
    global_num_seqs: int,
    seq_token_sum_constant: Optional[float] = None,
):
    """RL loss closure: GSPO or PPO-clip policy loss (+ optional KL to a reference policy).

    ``algo`` is the recipe's algorithm section (policy_loss, eps_clip_low/high, loss_agg_mode,
    kl_coef, kl_estimator). The micro-batch must carry extras "old_log_probs" (and
    "ref_log_probs" when a reference policy is kept), label-aligned [B,S] float32.

    Metrics are already divided by the global counts, so summing them over micro-batches gives
    global means.
    """

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        mask = mb.loss_mask
        loss, metrics = compute_policy_loss(
            log_probs,
            mb.extras["old_log_probs"],
            mb.advantages,
            mask,
            policy_loss=algo.policy_loss,
            eps_clip_low=algo.eps_clip_low,
            eps_clip_high=algo.eps_clip_high,
            loss_agg_mode=algo.loss_agg_mode,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
            seq_token_sum_constant=seq_token_sum_constant,
            ref_log_probs=mb.extras.get("ref_log_probs"),  # KL logged; in the loss only when kl_coef > 0
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
            entropy=entropy,
        )
        # pg_loss / kl_loss are already this micro-batch's share of the global value; the other
        # metrics are local token means: weight them by this micro-batch's share of the tokens.
        share = float(mask.sum()) / global_num_tokens
        out = {"loss": loss.detach()}
        # sum over tokens of |log_probs - old_log_probs|: exactly 0 iff every token ratio is exactly 1
        out["logratio_abs_sum"] = float(((log_probs.detach() - mb.extras["old_log_probs"]).abs() * mask).sum())
        for k, v in metrics.items():
            if k == "num_tokens":
                continue
            out[k] = float(v) if k in ("pg_loss", "kl_loss") else float(v) * share
        return loss, out

    return loss_fn

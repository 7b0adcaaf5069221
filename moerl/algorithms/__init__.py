"""RL algorithm functions: group advantages, KL estimators, clipped policy losses, log-probs."""

from moerl.algorithms.advantages import group_has_signal, grpo_advantages
from moerl.algorithms.kl import kl_penalty
from moerl.algorithms.logprobs import entropy_from_logits, token_log_probs_from_logits
from moerl.algorithms.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    compute_policy_loss,
    count_loss_tokens_and_seqs,
    gspo_token_loss,
    masked_mean,
    ppo_token_loss,
)

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "aggregate_loss",
    "compute_policy_loss",
    "count_loss_tokens_and_seqs",
    "entropy_from_logits",
    "group_has_signal",
    "grpo_advantages",
    "gspo_token_loss",
    "kl_penalty",
    "masked_mean",
    "ppo_token_loss",
    "token_log_probs_from_logits",
]

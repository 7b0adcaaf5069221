"""RL algorithm functions: advantage estimators, reward shaping, KL estimators, policy and value
losses, log-probs."""

from moerl.algorithms.advantages import group_has_signal, grpo_advantages
from moerl.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    gae_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    token_returns,
    whiten,
)
from moerl.algorithms.kl import kl_penalty
from moerl.algorithms.logprobs import entropy_from_logits, token_log_probs_from_logits
from moerl.algorithms.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    cispo_token_loss,
    compute_policy_loss,
    count_loss_tokens_and_seqs,
    gspo_token_loss,
    masked_mean,
    ppo_dual_clip_token_loss,
    ppo_token_loss,
)
from moerl.algorithms.shaping import kl_reward_penalty, overlong_penalty
from moerl.algorithms.value import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "aggregate_loss",
    "cispo_token_loss",
    "compute_policy_loss",
    "count_loss_tokens_and_seqs",
    "entropy_from_logits",
    "gae_advantages",
    "group_has_signal",
    "grpo_advantages",
    "gspo_token_loss",
    "kl_penalty",
    "kl_reward_penalty",
    "masked_mean",
    "outcome_token_rewards",
    "overlong_penalty",
    "ppo_dual_clip_token_loss",
    "ppo_token_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_log_probs_from_logits",
    "token_returns",
    "value_loss",
    "whiten",
]

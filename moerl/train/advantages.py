"""The advantage stage of an RL step: reward shaping, per-response estimators before the log-prob pass,
per-token estimators and whitening after it (moerl.algorithms.estimators does the math).

Every rank holds the whole global batch (rank 0 broadcasts it), so "over the global batch across DP
ranks" is a local reduction here: each rank whitens the same tensors and gets the same numbers.

algorithm.advantage_estimator:

=============================  ====================  ===============================================
estimator                      granularity           source
=============================  ====================  ===============================================
grpo                           per response          Shao et al. 2024 (arXiv 2402.03300) sec. 4.1.2
dr_grpo                        per response          Liu et al. 2025 (arXiv 2503.20783)
rloo                           per response          Ahmadian et al. 2024 (arXiv 2402.14740)
reinforce_plus_plus            per token, whitened   Hu 2025 (arXiv 2501.03262)
reinforce_plus_plus_baseline   per token, whitened   Hu 2025 (group-mean baseline on the outcome)
gae                            per token (critic)    Schulman et al. 2016 (arXiv 1506.02438) eq. 16
=============================  ====================  ===============================================
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from moerl.algorithms.advantages import group_has_signal, grpo_advantages
from moerl.algorithms.estimators import (
    gae_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from moerl.algorithms.shaping import kl_reward_penalty, overlong_penalty
from moerl.config.schema import TOKEN_ESTIMATORS
from moerl.types import Sample


def shape_rewards(ctx, samples: Sequence[Sample]) -> dict:
    """DAPO's soft overlong punishment (algorithm.overlong_buffer_len; Yu et al. 2025, arXiv 2503.14476
    eq. 13) added to each reward in place (the verifier's reward stays in metadata["raw_reward"]).
    Returns metrics (overlong_penalty_mean) or {}."""
    algo = ctx.cfg.algorithm
    if algo.overlong_buffer_len is None or not samples:
        return {}
    pen = overlong_penalty(torch.tensor([s.response_length for s in samples]), ctx.cfg.rollout.max_new_tokens,
                           algo.overlong_buffer_len, algo.overlong_penalty_factor)
    for s, p in zip(samples, pen.tolist()):
        s.metadata["raw_reward"] = s.reward
        s.reward = s.reward + p
    return {"overlong_penalty_mean": float(pen.mean())}


def outcome_advantages(ctx, samples: Sequence[Sample]) -> tuple[list[Sample], dict]:
    """Per-response advantages (grpo | dr_grpo | rloo) in ``Sample.advantage``, and the filter of groups
    without reward variance (algorithm.filter_uniform_groups, every estimator). Per-token estimators get
    their advantages later (:func:`token_advantages`); ``Sample.advantage`` is then 0.
    Returns (kept samples, metrics)."""
    algo, n = ctx.cfg.algorithm, ctx.cfg.rollout.n_samples_per_prompt
    if not samples:
        return [], {"groups_with_signal": 0.0}
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if algo.advantage_estimator == "rloo":
        adv = rloo_advantages(rewards, n)
    elif algo.advantage_estimator in ("grpo", "dr_grpo"):
        adv = grpo_advantages(rewards, n, normalize_std=(algo.advantage_estimator == "grpo"))
    else:
        adv = torch.zeros_like(rewards)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    signal = group_has_signal(rewards, n)
    kept = [s for s in samples if bool(signal[s.group_id])] if algo.filter_uniform_groups else list(samples)
    return kept, {"groups_with_signal": float(signal.float().mean())}


def needs_token_advantages(algo) -> bool:
    """True when advantages are per token (a per-token estimator, or whitening of any estimator)."""
    return algo.advantage_estimator in TOKEN_ESTIMATORS or algo.whiten_advantages


def _padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.float64)
    return out


def token_advantages(ctx, kept: Sequence[Sample], values: Optional[Sequence[Sequence[float]]] = None) -> dict:
    """Per-token advantages after the log-prob pass, into ``s.metadata["token_advantages"]`` (a list per
    response token): reinforce_plus_plus(_baseline) returns-to-go of (outcome + KL-in-reward) token rewards,
    whitened over the global batch; gae from the critic's ``values`` (old values, per response token; also
    sets metadata "returns" and "old_values"); or the per-response advantage broadcast to the tokens and
    whitened (algorithm.whiten_advantages). Token rewards carry -kl_coef * KL(old || ref) per token with
    algorithm.kl_in_reward (needs metadata "old_log_probs" and "ref_log_probs").

    Returns metrics: advantage_mean / advantage_std (over loss tokens, before whitening), kl_reward_mean
    (with kl_in_reward), returns_mean and value_mean (gae).

    Raises:
        ValueError: gae without ``values``.
    """
    algo = ctx.cfg.algorithm
    if not kept or not needs_token_advantages(algo):
        return {}
    width = max(len(s.response_ids) for s in kept)
    mask = _padded([s.loss_mask for s in kept], width) > 0
    outcome = torch.tensor([s.reward for s in kept], dtype=torch.float64)
    token_rewards, m = None, {}
    if algo.kl_in_reward:
        lp = _padded([s.metadata["old_log_probs"] for s in kept], width)
        ref = _padded([s.metadata["ref_log_probs"] for s in kept], width)
        token_rewards = kl_reward_penalty(lp, ref, mask, algo.kl_coef, algo.kl_estimator)
        m["kl_reward_mean"] = float(token_rewards[mask].mean()) if mask.any() else 0.0
    est = algo.advantage_estimator
    if est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = reinforce_pp_advantages(outcome, mask, token_rewards=token_rewards, gamma=algo.gamma,
                                      group_size=ctx.cfg.rollout.n_samples_per_prompt,
                                      baseline=est == "reinforce_plus_plus_baseline")
        # the baseline variant needs whole groups: filtered groups are whole, so group_size still holds
    elif est == "gae":
        if values is None:
            raise ValueError("advantage_estimator=gae needs the critic's values")
        v = _padded(values, width)
        adv, returns = gae_advantages(outcome_token_rewards(outcome, token_rewards, mask), v, mask, algo.gamma, algo.lam)
        for s, r, old in zip(kept, returns.tolist(), v.tolist()):
            n = len(s.response_ids)
            s.metadata["returns"], s.metadata["old_values"] = r[:n], old[:n]
        m["returns_mean"] = float(returns[mask].mean()) if mask.any() else 0.0
        m["value_mean"] = float(v[mask].mean()) if mask.any() else 0.0
    else:  # a per-response estimator, whitened per token
        adv = torch.tensor([s.advantage for s in kept], dtype=torch.float64)[:, None].expand(-1, width) * mask
    if mask.any():
        m["advantage_mean"], m["advantage_std"] = float(adv[mask].mean()), float(adv[mask].std(unbiased=False))
    if est.startswith("reinforce_plus_plus") or algo.whiten_advantages:
        adv = whiten(adv, mask)
    for s, a in zip(kept, adv.tolist()):
        s.metadata["token_advantages"] = a[: len(s.response_ids)]
    return m

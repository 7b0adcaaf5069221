"""moerl.train.advantages: the advantage stage of an RL step wired to the recipe, checked against numbers
worked by hand (the estimators' own math is tested in tests/test_estimators.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from moerl.train.advantages import needs_token_advantages, outcome_advantages, shape_rewards, token_advantages
from moerl.types import Sample


def _ctx(**algo):
    base = dict(advantage_estimator="grpo", whiten_advantages=False, gamma=1.0, lam=1.0, kl_in_reward=False,
                kl_coef=0.0, kl_estimator="k1", filter_uniform_groups=True, overlong_buffer_len=None,
                overlong_penalty_factor=1.0)
    base.update(algo)
    return SimpleNamespace(cfg=SimpleNamespace(algorithm=SimpleNamespace(**base),
                                               rollout=SimpleNamespace(n_samples_per_prompt=2, max_new_tokens=8)))


def _samples(rewards, lengths):
    return [Sample(index=i, group_id=i // 2, prompt="p", label="l", prompt_ids=[1], response_ids=[5] * n,
                   loss_mask=[1] * n, reward=r) for i, (r, n) in enumerate(zip(rewards, lengths))]


def test_overlong_shaping_by_hand():
    # max_new_tokens 8, buffer 4: no penalty up to 4 tokens, linear to -1 at 8
    ss = _samples([1.0, 1.0, 0.0, 1.0], [3, 5, 7, 8])
    m = shape_rewards(_ctx(overlong_buffer_len=4), ss)
    assert [s.reward for s in ss] == [1.0, 0.75, -0.75, 0.0]
    assert [s.metadata["raw_reward"] for s in ss] == [1.0, 1.0, 0.0, 1.0]
    assert m["overlong_penalty_mean"] == pytest.approx((0 - 0.25 - 0.75 - 1.0) / 4)
    assert shape_rewards(_ctx(), ss) == {} and ss[1].reward == 0.75  # off: untouched


def test_rloo_per_response_and_the_uniform_group_filter():
    ss = _samples([1.0, 0.0, 1.0, 1.0], [2, 2, 2, 2])
    kept, m = outcome_advantages(_ctx(advantage_estimator="rloo"), ss)
    assert [s.advantage for s in ss] == [1.0, -1.0, 0.0, 0.0]  # r_i - mean of the other one
    assert kept == ss[:2] and m["groups_with_signal"] == 0.5
    kept, _ = outcome_advantages(_ctx(advantage_estimator="rloo", filter_uniform_groups=False), ss)
    assert kept == ss


def test_reinforce_pp_returns_whitened_over_the_batch_by_hand():
    # rewards 1 (2 tokens) and 0 (1 token): returns-to-go [1, 1] and [0]; over the 3 loss tokens mean 2/3,
    # unbiased variance ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3
    ss = _samples([1.0, 0.0], [2, 1])
    ctx = _ctx(advantage_estimator="reinforce_plus_plus", filter_uniform_groups=False)
    assert needs_token_advantages(ctx.cfg.algorithm)
    kept, _ = outcome_advantages(ctx, ss)
    m = token_advantages(ctx, kept)
    sd = math.sqrt(1 / 3 + 1e-8)
    assert ss[0].metadata["token_advantages"] == pytest.approx([(1 / 3) / sd] * 2, abs=1e-9)
    assert ss[1].metadata["token_advantages"] == pytest.approx([(-2 / 3) / sd], abs=1e-9)
    assert m["advantage_mean"] == pytest.approx(2 / 3)


def test_kl_in_reward_enters_the_returns_by_hand():
    # one response of 2 tokens, reward 1, k1 KL per token = old - ref = [0.5, -0.25], kl_coef 0.2:
    # token rewards [-0.1, 0.05 + 1] -> returns [0.95, 1.05]; baseline variant with a pair (second reward 0,
    # 1 token, KL 0): outcome baseline 0.5 -> returns [0.45, 0.55] and [-0.5]
    ss = _samples([1.0, 0.0], [2, 1])
    ss[0].metadata.update(old_log_probs=[-1.0, -2.0], ref_log_probs=[-1.5, -1.75])
    ss[1].metadata.update(old_log_probs=[-1.0], ref_log_probs=[-1.0])
    ctx = _ctx(advantage_estimator="reinforce_plus_plus_baseline", kl_in_reward=True, kl_coef=0.2,
               filter_uniform_groups=False)
    m = token_advantages(ctx, ss)
    raw = [0.45, 0.55, -0.5]
    mean = sum(raw) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in raw) / 2 + 1e-8)
    got = ss[0].metadata["token_advantages"] + ss[1].metadata["token_advantages"]
    assert got == pytest.approx([(x - mean) / sd for x in raw], abs=1e-9)
    assert m["kl_reward_mean"] == pytest.approx((-0.1 + 0.05 + 0.0) / 3)


def test_whitened_grpo_broadcasts_then_whitens_over_tokens():
    ss = _samples([1.0, 0.0], [1, 3])
    ctx = _ctx(whiten_advantages=True)
    kept, _ = outcome_advantages(ctx, ss)
    a = kept[0].advantage  # grpo: (1 - 0.5) / (std 0.7071 + 1e-6)
    token_advantages(ctx, kept)
    raw = [a, -a, -a, -a]
    mean = sum(raw) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in raw) / 3 + 1e-8)
    assert kept[0].metadata["token_advantages"] == pytest.approx([(a - mean) / sd], abs=1e-9)
    assert kept[1].metadata["token_advantages"] == pytest.approx([(-a - mean) / sd] * 3, abs=1e-9)
    assert token_advantages(_ctx(), kept) == {}  # per-response, unwhitened: nothing per token

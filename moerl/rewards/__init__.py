"""Rewards: verifiers, user reward functions, a sandboxed worker pool, reward-model scoring.

- ``resolve_reward_fn(spec, group=)``: ``reward.function`` (registered name, ``package.module:function``
  or ``/path/to/file.py:function``) -> a checked callable; raises ``RewardConfigError``.
- ``RewardPool``: scores groups in worker processes with a per-task wall-clock limit (``pool.py``),
  optionally adding a reward model (``model.py``).
- ``RewardBroker``: the same pool run in a child process, off the caller's interpreter (``broker.py``;
  the trainer uses it in train.mode one_step_off / async, ``reward.pool_process``).
- built-ins: ``arithmetic``, ``math`` (math-verify), ``exact_match``, ``countdown``, ``reasoning_gym``.

Light to import (the config schema imports it): nothing here imports torch, transformers, math_verify
or reasoning_gym at import time.
"""

from __future__ import annotations

from moerl.rewards.arithmetic import arithmetic_reward, check_arithmetic_label
from moerl.rewards.countdown import check_countdown_label, countdown_reward
from moerl.rewards.errors import RewardConfigError, RewardValueError
from moerl.rewards.math_reward import math_reward
from moerl.rewards.model import RewardModel
from moerl.rewards.broker import RewardBroker
from moerl.rewards.pool import RewardPool, RewardResult, reward_pool_from_config
from moerl.rewards.reasoning_gym_reward import reasoning_gym_reward
from moerl.rewards.registry import (
    RewardFn,
    as_metadata,
    available_reward_fns,
    check_label,
    get_reward_fn,
    normalize_group_reward,
    normalize_reward,
    register_reward_fn,
    resolve_reward_fn,
)
from moerl.rewards.text import exact_match_reward

register_reward_fn("arithmetic", arithmetic_reward, check_label=check_arithmetic_label)
register_reward_fn("math", math_reward)
register_reward_fn("exact_match", exact_match_reward)
register_reward_fn("countdown", countdown_reward, check_label=check_countdown_label)
register_reward_fn("reasoning_gym", reasoning_gym_reward)

__all__ = [
    "RewardBroker", "RewardConfigError", "RewardFn", "RewardModel", "RewardPool", "RewardResult", "RewardValueError",
    "arithmetic_reward", "as_metadata", "available_reward_fns",
    "check_label", "countdown_reward", "exact_match_reward", "get_reward_fn", "math_reward",
    "normalize_group_reward", "normalize_reward", "reasoning_gym_reward", "register_reward_fn", "resolve_reward_fn",
]

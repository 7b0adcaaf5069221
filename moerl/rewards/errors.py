"""Reward errors (a leaf module: no moerl imports)."""

from __future__ import annotations


class RewardConfigError(ValueError):
    """A reward setting cannot work: ``reward.function`` does not resolve (unknown name, module not
    importable, file missing, attribute missing, not callable, wrong signature), or ``reward.model_path``
    cannot be loaded. The message names the recipe key and the fix. Raised before any work when
    possible (``resolve_reward_fn`` at start-up), so a run refuses a bad recipe instead of scoring 0."""


class RewardValueError(ValueError):
    """A reward function returned something that is not a reward (not a number, NaN/inf, a dict
    without a float ``"score"``, a group result of the wrong length), or was given metadata that is
    neither a dict nor a JSON object string. The message names the problem."""

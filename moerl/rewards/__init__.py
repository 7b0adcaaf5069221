"""Verifiers and reward functions: ``get_reward_fn(name)`` -> ``fn(response_text, label) -> float``."""

from __future__ import annotations

from typing import Callable

from moerl.rewards.arithmetic import arithmetic_reward

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, RewardFn] = {"arithmetic": arithmetic_reward}


def register_reward_fn(name: str, fn: RewardFn) -> None:
    """Register ``fn(response_text, label) -> float`` under ``name``.

    Raises:
        ValueError: ``name`` is already registered to a different function.
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"reward function for {name!r} must be callable, got {type(fn).__name__}")
    if name in _REGISTRY and _REGISTRY[name] is not fn:
        raise ValueError(f"reward function {name!r} is already registered")
    _REGISTRY[name] = fn


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as ``name`` (``"arithmetic"``; the task name of data.task).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reward function {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def available_reward_fns() -> list[str]:
    """Registered reward function names, sorted."""
    return sorted(_REGISTRY)


__all__ = ["RewardFn", "arithmetic_reward", "available_reward_fns", "get_reward_fn", "register_reward_fn"]

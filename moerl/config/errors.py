"""The recipe error type, in a leaf module so that both the schema (cross-field rules checked after
loading, e.g. :meth:`RecipeConfig.check_world_size`) and the loader can raise it without importing
each other. Re-exported as ``moerl.config.ConfigError`` and ``moerl.config.loader.ConfigError``.
"""

from __future__ import annotations

from moerl.errors import RecipeError


class ConfigError(RecipeError):
    """A recipe that cannot run (the "recipe" kind of :mod:`moerl.errors`; a ValueError).
    ``str(err)`` lists every problem, one per line."""


__all__ = ["ConfigError"]

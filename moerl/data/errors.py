"""Errors of the data pipeline (kept free of heavy imports)."""

from moerl.errors import DataError


class DatasetError(DataError):
    """A prompt file that cannot be used (the "data" kind of :mod:`moerl.errors`; a ValueError); the
    message names the file, the row and the recipe key."""

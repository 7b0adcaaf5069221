"""Errors of the data pipeline (kept free of heavy imports)."""


class DatasetError(ValueError):
    """A prompt file that cannot be used; the message names the file, the row and the recipe key."""

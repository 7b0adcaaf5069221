"""Shared fixtures."""

from __future__ import annotations

import pytest

from moerl.runtime.distributed import destroy_distributed, init_distributed


@pytest.fixture
def dist():
    """A single-process Megatron runtime (world size 1, gloo), torn down after the test; yields
    the DistInfo. Seed 0, 2 torch threads."""
    info = init_distributed(seed=0, num_threads=2)
    try:
        yield info
    finally:
        destroy_distributed()

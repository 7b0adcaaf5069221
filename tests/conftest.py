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


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny Qwen3-MoE HF checkpoints (model A: seed 0, model B: seed 1) -> (path_a, path_b)."""
    from moerl.rollout.testing import make_tiny_moe_checkpoint

    a = str(tmp_path_factory.mktemp("model_a"))
    b = str(tmp_path_factory.mktemp("model_b"))
    make_tiny_moe_checkpoint(a, seed=0)
    make_tiny_moe_checkpoint(b, seed=1)
    return a, b


@pytest.fixture(scope="module")
def ref_models(ckpts):
    """Independent transformers models of ``ckpts`` (transformers' own loader) for reference forwards."""
    import torch
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in ckpts)

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


@pytest.fixture(scope="session")
def fast_main_job(tmp_path_factory):
    """One `moerl train` of the tiny recipe with tests/test_main_job.py's FAST overrides (sync, disaggregated:
    the recipe's defaults), shared by the slow tests that check it or compare another run with it
    (test_main_job's reproducibility test, test_offload's colocated-vs-disaggregated test): launched once
    per session instead of once per test (CI time). Returns (stdout, run_dir); tests only read them."""
    from test_main_job import FAST, RECIPE, moerl_train, port_args

    tmp = tmp_path_factory.mktemp("fast_main_job")
    r = moerl_train(RECIPE, *port_args(tmp), *FAST, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, tmp / "run"



def _xdist_group(item) -> str | None:
    """The xdist_group for a test that uses a fixture of this test suite wider than a function: the name of a
    session-scoped one (``fast_main_job``), else the module for a module- or class-scoped one; None when all
    its fixtures are per test (or pytest's own, like tmp_path_factory)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    group = None
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if not defs or not defs[-1].baseid:  # not a fixture of tests/ (pytest's, a plugin's)
            continue
        scope = defs[-1].scope
        if scope == "session":
            return name
        if scope != "function":
            group = item.nodeid.split("::")[0]
    return group


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """pytest-xdist (.ci/run runs the suites with ``-n 2 --dist loadgroup``): a test that uses a module-scoped
    fixture (a reference run, a server, checkpoints) is put in the xdist_group of its module, so that the
    fixture is built once on one worker and not once per worker; the tests that use the session-scoped
    ``fast_main_job`` (a `moerl train` run) share one group for the same reason. Other tests go to whichever
    worker is free. A test's own xdist_group mark is kept; without xdist the marks do nothing. (tryfirst:
    before xdist's hook reads the marks.)"""
    for item in items:
        if item.get_closest_marker("xdist_group") is None and (group := _xdist_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))

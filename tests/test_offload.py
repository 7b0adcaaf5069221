"""Trainer offload for colocated placement (moerl.train.offload): after an offload every parameter,
gradient-buffer and optimizer-state storage of a MegatronActor is freed (0 bytes), and after the
reload a further train step gives parameters bitwise equal to an actor that never offloaded (the
independent reference: the same two steps run without offload)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_actor import _old_log_probs, _policy_step, actor_with, make_samples  # noqa: E402
from test_hf_convert import FIELDS, random_hf_model  # noqa: E402

from moerl.train.offload import ActorOffloader, OffloadState, actor_tensors, offload_actor, reload_actor  # noqa: E402


def _storages(tensors):
    """Distinct storages of ``tensors`` (by object identity of the underlying StorageImpl via
    data_ptr while allocated); returns {key: storage}."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        out[(s.data_ptr(), s.device.type)] = s
    return out


def _two_steps(actor, samples, offload_between: bool):
    """Step 1, (offload + checks + reload), step 2; returns the parameters after step 2 and the
    offload state (or None)."""
    old = _old_log_probs(actor, samples, 3)
    _policy_step(actor, samples, old, 3)
    state = None
    if offload_between:
        tensors = actor_tensors(actor)
        before = _storages(tensors)
        expected = sum(s.nbytes() for s in before.values())
        snapshot = [t.detach().clone() for t in tensors]
        state = offload_actor(actor)
        assert state.nbytes == expected > 0
        # every param / grad / optimizer storage freed
        assert sum(t.untyped_storage().nbytes() for t in tensors) == 0
        assert all(s.nbytes() == 0 for s in before.values())
        assert reload_actor(actor, state) == expected
        for t, ref in zip(tensors, snapshot):  # every view back, bitwise, with its aliasing intact
            assert torch.equal(t.detach(), ref)
        assert all(t.untyped_storage().nbytes() > 0 for t in tensors)
    _policy_step(actor, samples, old, 3)
    return [p.detach().clone() for p in actor.model.parameters()], state


@pytest.mark.parametrize("use_distributed_optimizer, params_dtype",
                         [(False, "float32"), (True, "float32"), (False, "bfloat16"), (True, "bfloat16")])
def test_offload_reload_is_bitwise_transparent(dist, use_distributed_optimizer, params_dtype):
    """(bfloat16: the FP32 main params of Megatron's mixed-precision optimizers move too.)"""
    hf = random_hf_model()
    samples = make_samples(FIELDS["vocab_size"])
    kw = dict(lr=1e-2, use_distributed_optimizer=use_distributed_optimizer, params_dtype=params_dtype)
    ref_params, _ = _two_steps(actor_with(hf, **kw), samples, offload_between=False)
    actor = actor_with(hf, **kw)
    params, state = _two_steps(actor, samples, offload_between=True)
    # fp32 weights + fp32 grad buffer + Adam exp_avg + exp_avg_sq were moved: at least 4x the weights
    n_weights = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    assert state.nbytes >= 4 * n_weights
    # the two steps changed the weights (so the comparison below can fail) and both runs agree bitwise
    # bfloat16: the optimizer's FP32 main params are among the tensors moved (fp32: there are none)
    from moerl.train.actor import _fp32_main_params

    mains, moved = _fp32_main_params(actor.optimizer), _storages(actor_tensors(actor))
    assert (len(mains) > 0) == (params_dtype == "bfloat16")
    assert all((m.untyped_storage().data_ptr(), m.device.type) in moved for m in mains)
    initial = actor_with(hf, trainable=False, params_dtype=params_dtype)
    assert any(not torch.equal(a.detach(), b) for a, b in zip(initial.model.parameters(), params))
    assert len(params) == len(ref_params)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)


def test_ddp_buffers_share_one_storage_offloaded_once(dist):
    """With the distributed optimizer the params are views of DDP's flat param buffer: the buffer's
    storage is counted once, and the views still alias it after the reload."""
    hf = random_hf_model()
    actor = actor_with(hf, lr=1e-2, use_distributed_optimizer=True)
    buf = actor.ddp_model.buffers[0]
    assert buf.param_data is not None
    p = next(actor.model.parameters())
    assert p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
    distinct = _storages(actor_tensors(actor))
    state = offload_actor(actor)
    assert state.nbytes == sum(h.numel() for h in state.host)
    assert len(state.storages) == len(distinct)
    reload_actor(actor, state)
    with torch.no_grad():
        buf.param_data.view(-1)[p.storage_offset()] += 1.0  # write through the buffer ...
    before = p.detach().reshape(-1)[0].item()
    assert p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
    assert before == buf.param_data.view(-1)[p.storage_offset()].item()  # ... and read it via the param


def test_frozen_actor_weights_only_and_errors(dist):
    hf = random_hf_model()
    ref = actor_with(hf, trainable=False)
    want = {k: v.clone() for k, v in ref.model.state_dict().items() if isinstance(v, torch.Tensor)}
    n_weights = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    state = offload_actor(ref, include_optimizer=False)
    assert state.nbytes == n_weights  # separate fp32 tensors: exactly the parameter bytes
    assert all(p.untyped_storage().nbytes() == 0 for p in ref.model.parameters())
    assert reload_actor(ref, state) == n_weights
    got = ref.model.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with pytest.raises(RuntimeError, match="already reloaded"):
        reload_actor(ref, state)
    with pytest.raises(TypeError, match="OffloadState"):
        reload_actor(ref, object())
    with pytest.raises(TypeError, match="MegatronActor"):
        offload_actor(object())
    assert isinstance(OffloadState(), OffloadState)


def test_actor_offloader_idempotent_and_loaded_context(dist):
    hf = random_hf_model()
    actor = actor_with(hf, lr=1e-2)
    ref = actor_with(hf, trainable=False)
    msgs = []
    off = ActorOffloader([(actor, True), (ref, False), (None, False)], log=msgs.append)
    n = off.offload()
    assert n > 0 and off.offloaded and off.offload() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in ref.model.parameters())
    with off.loaded():
        assert not off.offloaded
        assert all(p.untyped_storage().nbytes() > 0 for p in actor.model.parameters())
    assert off.offloaded
    assert off.reload() == n and off.reload() == 0 and not off.offloaded
    with off.loaded():  # not offloaded: stays loaded afterwards
        pass
    assert not off.offloaded
    assert off.total_offload_bytes == 2 * n == off.total_reload_bytes
    assert len(msgs) == 4 and "MiB" in msgs[0]


@pytest.mark.slow
def test_main_job_colocated_offloads_and_matches_disaggregated(tmp_path, fast_main_job):
    """`moerl train` with rollout.placement=colocated: the step-0 checks pass, the trainer really is
    offloaded every step (bytes reported, at least weights + grads + Adam moments of the policy), and
    every per-step number equals a disaggregated run with the same seed (offload is bitwise). The
    disaggregated run is the session's shared FAST run (conftest.fast_main_job: the recipe's default
    placement, asserted below)."""
    import json
    import re

    from safetensors import safe_open
    from test_main_job import FAST, RECIPE, _step_lines, moerl_train, port_args

    outs = {}
    r = moerl_train(RECIPE, *port_args(tmp_path / "colocated"), *FAST, "rollout.placement=colocated", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    outs["colocated"] = r.stdout
    outs["disaggregated"], ref_run = fast_main_job
    import yaml

    assert yaml.safe_load((ref_run / "recipe.yaml").read_text())["rollout"]["placement"] == "disaggregated"
    out = outs["colocated"]
    m = re.search(r"STEP-0 CHECK: .*: (PASS|FAIL); .*: (PASS|FAIL)", out)
    assert m and m.groups() == ("PASS", "PASS"), out[-3000:]
    assert "offload:" in out and "reload:" in out and "offload:" not in outs["disaggregated"]
    assert _step_lines(out) == _step_lines(outs["disaggregated"])
    run = tmp_path / "colocated" / "run"
    first = json.loads((run / "summary.json").read_text())["first_step_metrics"]
    with safe_open(str(run / "hf_export" / "model.safetensors"), "pt") as f:
        weight_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # fp32
    assert first["train/offload_bytes"] >= 4 * weight_bytes
    assert first["train/reload_bytes"] >= weight_bytes


def test_refuses_non_resizable_and_regrown_storages(dist):
    import numpy as np
    from types import SimpleNamespace

    lin = torch.nn.Linear(3, 2)
    lin.weight.data = torch.from_numpy(np.ones((2, 3), dtype=np.float32))  # numpy memory: not resizable
    fake = SimpleNamespace(model=lin, trainable=False)
    with pytest.raises(RuntimeError, match="non-resizable"):
        offload_actor(fake)
    assert lin.bias.untyped_storage().nbytes() == 2 * 4  # checked before anything was freed
    hf = random_hf_model()
    ref = actor_with(hf, trainable=False)
    state = offload_actor(ref)
    next(ref.model.parameters()).untyped_storage().resize_(8)  # someone re-allocated it meanwhile
    with pytest.raises(RuntimeError, match="re-allocated"):
        reload_actor(ref, state)

"""Dry check of DualPipe's overlapped F&B through Megatron-Core schedule plans (moerl.pipeline.overlap) on CPU.

There are no CUDA streams on CPU, so Megatron's plan code runs with its CUDA event / stream / NVTX /
record_stream calls replaced by no-ops (``moerl.pipeline.overlap.cpu_dry_run``): the pieces of each F&B then run one after the
other on one thread.  What this checks is everything moerl adds around Megatron's plans: a plan per chunk and
micro-batch, the last chunk's criterion on the plan's logits, the gradient handed to the plan's backward, the
input gradient sent upstream, weight gradients, DualPipe's mirrored copies.

Reference: the plain interpreter (stage_fn + torch.autograd.grad, itself checked against a non-pipelined
model in tests/test_pipeline_megatron.py) on the same processes and weights, as run by
tools/check_pipeline_overlap.py (the same script checks and times it on GPUs under torchrun).  4 processes = pp 2 x ep 2
(Megatron's plans need ep_size > 1), 8 micro-batches: losses bitwise equal, every local gradient with
1 - 2*sum(xy)/sum(x^2+y^2) < 1e-12 (the plan accumulates a layer's weight gradient in a different order).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.slow
# dualpipev is slow_extra (CI's 30-min budget): DualPipe's plan executor stays in CI and DualPipeV with overlap runs
# against one process in CI (test_pipeline_ep test_pp2_ep2_dualpipev_with_pipeline_overlap_matches_single_process).
# What leaves CI: DualPipeV's executor against the plain interpreter.
@pytest.mark.parametrize("name", [pytest.param("dualpipev", marks=pytest.mark.slow_extra), "dualpipe"])
def test_megatron_plan_executor_matches_plain_interpreter(name, tmp_path):
    """tools/check_pipeline_overlap.py --device cpu: 4 gloo processes, pp 2 x ep 2, 8 micro-batches."""
    tool = Path(__file__).resolve().parents[1] / "tools" / "check_pipeline_overlap.py"
    proc = subprocess.run([sys.executable, str(tool), "--device", "cpu", "--schedule", name, "--pp", "2", "--ep", "2",
                           "--microbatches", "8", "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["losses_bitwise"]
    assert summary["max_grad_rel_err"] < 1e-12
    assert summary["fb_actions"] > 0 and summary["fb_through_plan"] == summary["fb_actions"]
    # (the tool's micro-batches end in padding and the aux loss is on: the routers' padding mask counts)
    assert sorted({m for r in summary["ranks"] for m in r["loss_microbatches"]}) == list(range(8))
    assert all(r["same_grad_params"] for r in summary["ranks"])
    assert summary["ok"]


def test_overlap_refuses_cpu_and_ep1():
    """Clear errors before any work: no CUDA, or a layout Megatron's plans cannot run."""
    import types

    from moerl.pipeline.overlap import MegatronOverlapExecutor, check_overlap_supported

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            MegatronOverlapExecutor(lambda *a: None)
        with pytest.raises(RuntimeError, match="pipeline_overlap=false"):
            check_overlap_supported(types.SimpleNamespace(num_moe_experts=4, expert_model_parallel_size=2))
    cfg = types.SimpleNamespace(num_moe_experts=4, expert_model_parallel_size=1, moe_token_dispatcher_type="alltoall")
    with pytest.raises(ValueError, match="ep_size >= 2"):
        check_overlap_supported(cfg, require_cuda=False)
    cfg.expert_model_parallel_size = 2
    cfg.moe_token_dispatcher_type = "allgather"
    with pytest.raises(ValueError, match="alltoall or flex"):
        check_overlap_supported(cfg, require_cuda=False)
    cfg.moe_token_dispatcher_type = "alltoall"
    check_overlap_supported(cfg, require_cuda=False)
    with pytest.raises(ValueError, match="no MoE"):
        check_overlap_supported(types.SimpleNamespace(num_moe_experts=None), require_cuda=False)
    # a dense last layer on the last stage: Megatron's plan would skip the final norm
    cfg.moe_layer_freq, cfg.num_layers = [1, 0], 2
    check_overlap_supported(cfg, require_cuda=False)  # not the last stage: fine
    with pytest.raises(ValueError, match="MoE last decoder layer"):
        check_overlap_supported(cfg, require_cuda=False, last_stage=True)
    cfg.moe_layer_freq = 1
    check_overlap_supported(cfg, require_cuda=False, last_stage=True)

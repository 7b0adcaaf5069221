"""DualPipe's overlapped forward & backward (``FB`` actions) through Megatron-Core's fine-grained schedule plans.

DualPipe (DeepSeek-V3 report, section 3.2.1) hides the MoE all-to-all of one micro-batch behind the compute of
another: a chunk's forward and another chunk's backward are cut into attention / dispatch / experts / combine
pieces and interleaved, communication on one CUDA stream while computation runs on another.  Megatron-Core
0.16 implements exactly that cut for ``GPTModel`` (``GPTModel.build_schedule_plan`` ->
``TransformerModelChunkSchedulePlan``; ``TransformerModelChunkSchedulePlan.run(f_plan, b_plan, b_grad)``
interleaves, per layer: combine-bwd | attn-fwd, mlp-bwd | dispatch-fwd, dispatch-bwd | mlp-fwd, attn-bwd |
combine-fwd on its ``comp_stream`` / ``comm_stream``).  It is what Megatron's own ``combined_1f1b`` schedule
(``overlap_moe_expert_parallel_comm``) calls.  :class:`MegatronOverlapExecutor` plugs it into moerl's
interpreter (:class:`moerl.pipeline.interpreter.ChunkExecutor`), so DualPipe(V)'s FB steps overlap on GPU.

Requirements (Megatron's, checked here): CUDA (the plans record CUDA events and use two streams), and MoE
layers with expert parallelism (ep_size > 1) and the ``alltoall`` or ``flex`` token dispatcher: with ep_size 1
the "dispatch" returns its input, which the plan frees after use.  The backward computes weight gradients in
place (``W`` actions are empty: no zero-bubble weight deferral in this mode).

On CPU there are no streams: use the default interpreter (FB runs forward then backward).  The test
``tests/test_pipeline_overlap.py`` still runs this executor's code path on CPU with Megatron's CUDA event,
stream and NVTX calls replaced by no-ops (``require_cuda=False``): a dry check of the plumbing (losses bitwise,
gradients to 1e-12 against the plain interpreter), not of the streams.  ``tools/check_pipeline_overlap.py``
runs the same comparison on GPUs with real streams and NCCL and times the overlap.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence
from unittest import mock

import torch

from moerl.pipeline.interpreter import ChunkExecutor

__all__ = ["MegatronOverlapExecutor", "megatron_stage_plan_fn", "check_overlap_supported", "cpu_dry_run"]

PlanFn = Callable[[int, torch.nn.Module, Any, int], Any]


def _gpt_model(module: torch.nn.Module):
    """The ``GPTModel`` inside a MegatronStage / Megatron DDP / Float16Module wrapper."""
    from megatron.core.models.gpt import GPTModel

    m = module
    for _ in range(8):
        if isinstance(m, GPTModel):
            return m
        m = getattr(m, "model", None) or getattr(m, "module", None)
        if m is None:
            break
    raise TypeError(f"MegatronOverlapExecutor needs Megatron GPTModel chunks, got {type(module).__name__}")


def check_overlap_supported(config, *, require_cuda: bool = True) -> None:
    """Raise a clear error when Megatron's fine-grained F&B overlap cannot run with this TransformerConfig.

    Raises:
        RuntimeError: CUDA is not available (``require_cuda``).
        ValueError: no MoE layers, ep_size 1, a token dispatcher other than alltoall/flex, or full
            recomputation (Megatron's conditions for ``overlap_moe_expert_parallel_comm``).
    """
    if require_cuda and not torch.cuda.is_available():
        raise RuntimeError("the F&B overlap (train.pipeline_overlap=true) runs on two CUDA streams and needs "
                           "CUDA GPUs; on CPU leave train.pipeline_overlap=false (FB runs forward then backward)")
    if not getattr(config, "num_moe_experts", None):
        raise ValueError("the F&B overlap hides MoE all-to-all: the model has no MoE layers; set "
                         "train.pipeline_overlap=false")
    if getattr(config, "expert_model_parallel_size", 1) < 2:
        raise ValueError("the F&B overlap needs expert parallelism (parallel.ep_size >= 2): with ep_size 1 there is "
                         "no all-to-all to hide and Megatron's schedule plan frees the undispatched tokens; set "
                         "train.pipeline_overlap=false or ep_size >= 2")
    if getattr(config, "moe_token_dispatcher_type", "alltoall") not in ("alltoall", "flex"):
        raise ValueError(f"the F&B overlap needs the alltoall or flex token dispatcher, got "
                         f"{config.moe_token_dispatcher_type!r}")
    if getattr(config, "recompute_granularity", None) == "full" or getattr(config, "recompute_method", None):
        raise ValueError("the F&B overlap does not support full recomputation: set parallel.recompute to none or "
                         "selective")


@contextlib.contextmanager
def cpu_dry_run() -> Iterator[None]:
    """Run Megatron's schedule-plan code on CPU for a dry check: ``torch.cuda.Event``,
    ``torch.cuda.current_stream``, ``torch.cuda.nvtx.range_push/pop`` and ``Tensor.record_stream`` become
    no-ops inside the block (``torch.cuda.stream(None)`` already is one), so each F&B runs its pieces one
    after the other on one thread.  For tests and ``tools/check_pipeline_overlap.py --device cpu`` only:
    nothing overlaps; never use it around real training.

    Raises:
        RuntimeError: CUDA is available (use the real streams there).
    """
    if torch.cuda.is_available():
        raise RuntimeError("cpu_dry_run() is for CPU-only machines; with CUDA use the real streams")

    class _Event:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

    with mock.patch.object(torch.cuda, "Event", _Event), \
            mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: None), \
            mock.patch.object(torch.cuda.nvtx, "range_push", lambda *a, **k: None), \
            mock.patch.object(torch.cuda.nvtx, "range_pop", lambda *a, **k: None), \
            mock.patch.object(torch.Tensor, "record_stream", lambda self, stream: None):
        yield


class MegatronOverlapExecutor(ChunkExecutor):
    """:class:`~moerl.pipeline.interpreter.ChunkExecutor` running every training F / B / FB of Megatron
    ``GPTModel`` chunks as Megatron-Core schedule plans (``TransformerModelChunkSchedulePlan.run``), so an FB
    overlaps one chunk's forward with another's backward on two CUDA streams.

    Args:
        build_plan: ``build_plan(chunk, module, x, m) -> TransformerModelChunkSchedulePlan``: set the chunk's
            input (``set_input_tensor(x)`` on a non-first chunk) and return ``GPTModel.build_schedule_plan``
            for micro-batch ``m`` (same arguments as the model's forward).  :func:`megatron_stage_plan_fn`
            builds it for :class:`moerl.pipeline.megatron_stages.MegatronStage` chunks.
        require_cuda: check for CUDA and create Megatron's computation / communication streams
            (``megatron.core.pipeline_parallel.utils.set_streams``).  False only for CPU dry checks, run
            inside :func:`cpu_dry_run`.

    Tensors: ``x`` and the outputs are the chunk's hidden states ``[S, B, H]`` (float), the last chunk's
    output its logits ``[B, S, V]``; ``backward`` takes the gradient w.r.t. that output and returns the
    gradient w.r.t. ``x`` (None on the first chunk).

    Raises:
        RuntimeError: ``require_cuda`` and no CUDA.
    """

    splits_backward = False

    def __init__(self, build_plan: PlanFn, *, require_cuda: bool = True):
        if require_cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("MegatronOverlapExecutor needs CUDA (Megatron's schedule plans run on two CUDA "
                                   "streams); on CPU run the interpreter without an executor")
            from megatron.core.pipeline_parallel.utils import set_streams

            set_streams()  # comp = current stream, comm = a new stream (no-op when already set)
        self.build_plan = build_plan

    @staticmethod
    def _run(f_plan, b_plan, b_grad):
        from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

        return TransformerModelChunkSchedulePlan.run(f_plan, b_plan, b_grad=b_grad)

    def forward(self, chunk: int, module: torch.nn.Module, x: Any, m: int):
        plan = self.build_plan(chunk, module, x, m)
        y = self._run(plan, None, None)
        return y, (plan, x if isinstance(x, torch.Tensor) and x.requires_grad else None)

    def backward(self, chunk: int, state: Any, grad_y: torch.Tensor) -> Optional[torch.Tensor]:
        plan, x = state
        self._run(None, plan, grad_y)
        return None if x is None else x.grad

    def forward_backward(self, f_chunk: int, f_module: torch.nn.Module, x: Any, f_m: int, b_chunk: int,
                         b_state: Any, b_grad_y: torch.Tensor):
        f_plan = self.build_plan(f_chunk, f_module, x, f_m)
        b_plan, b_x = b_state
        y = self._run(f_plan, b_plan, b_grad_y)
        return (y, (f_plan, x if isinstance(x, torch.Tensor) and x.requires_grad else None),
                None if b_x is None else b_x.grad)


def megatron_stage_plan_fn(micro_batches: Sequence[Any]) -> PlanFn:
    """``build_plan`` for :class:`MegatronOverlapExecutor` over
    :class:`moerl.pipeline.megatron_stages.MegatronStage` chunks: the plan of ``stage.model`` for
    ``micro_batches[m]`` with the arguments ``MegatronStage.forward`` would pass (tokens on the first stage,
    ``set_input_tensor(x)`` on later ones)."""
    from moerl.train.batching import model_forward_args

    def build(chunk, stage, x, m):
        model = _gpt_model(stage)
        args, kwargs = model_forward_args(micro_batches[m])
        if stage.is_first:
            return model.build_schedule_plan(*args, **kwargs)
        model.set_input_tensor(x)
        return model.build_schedule_plan(None, None, args[2], **kwargs)

    return build

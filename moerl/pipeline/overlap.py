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
the "dispatch" returns its input, which the plan frees after use; the model's last layer must be an MoE
layer (the plan applies the final norm in the MoE combine step only).  Two gaps of Megatron-Core 0.16's plan
code are closed here: MoE layers route with the micro-batch's padding mask (the plan omits it), and
:func:`check_overlap_supported` refuses a dense last layer.  The backward computes weight gradients in
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
from moerl.pipeline.stage_args import stage_model_args

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


def _moe_pattern(config) -> list[int]:
    """Per decoder layer of a chunk's TransformerConfig: 1 MoE, 0 dense (Megatron's moe_layer_freq rule)."""
    freq, n = getattr(config, "moe_layer_freq", 1), int(getattr(config, "num_layers", 0) or 0)
    if isinstance(freq, (list, tuple)):
        return [int(bool(x)) for x in freq]
    return [int(i % int(freq) == 0) for i in range(n)]


def check_overlap_supported(config, *, require_cuda: bool = True, last_stage: bool = False) -> None:
    """Raise a clear error when Megatron's fine-grained F&B overlap cannot run with this chunk's
    TransformerConfig (``last_stage``: the chunk holds the final norm and output layer).

    Megatron's conditions for ``overlap_moe_expert_parallel_comm`` that apply to its schedule plans (moerl does
    not set that flag: it drives the plans itself, in fp32 too), plus one of the plan code: Megatron-Core
    0.16's plan applies the decoder's final layer norm in the MoE combine step only, so the model's last
    layer must be an MoE layer.

    Raises:
        RuntimeError: CUDA is not available (``require_cuda``).
        ValueError: no MoE layers, ep_size 1, a token dispatcher other than alltoall/flex, full
            recomputation, shared-expert overlap, more than one MTP layer, CUDA graphs, or (``last_stage``)
            a dense last layer.
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
        raise ValueError(f"the F&B overlap needs moe.token_dispatcher alltoall or flex, got "
                         f"{config.moe_token_dispatcher_type!r}")
    if (getattr(config, "recompute_granularity", None) == "full" or getattr(config, "recompute_method", None)
            or getattr(config, "recompute_num_layers", None)):
        raise ValueError("the F&B overlap does not support full recomputation: set parallel.recompute to none or "
                         "selective")
    if getattr(config, "moe_shared_expert_overlap", False):
        raise ValueError("the F&B overlap does not support moe_shared_expert_overlap: turn it off")
    if (getattr(config, "mtp_num_layers", None) or 0) > 1:
        raise ValueError("the F&B overlap supports at most one MTP layer")
    if getattr(config, "cuda_graph_impl", "none") not in ("none", None):
        raise ValueError("the F&B overlap does not support CUDA graphs here: set cuda_graph_impl to none")
    if last_stage:
        pattern = _moe_pattern(config)
        if pattern and not pattern[-1]:
            raise ValueError("the F&B overlap needs an MoE last decoder layer (Megatron-Core 0.16's schedule plan "
                             "applies the final layer norm after an MoE layer's combine only): the model's last "
                             "layer is dense (model.hf_config.mlp_only_layers); set train.pipeline_overlap=false")


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


@contextlib.contextmanager
def _route_with_padding(module: torch.nn.Module, plan) -> Iterator[None]:
    """While ``plan`` runs its forward: every MoE layer of ``module`` routes with the micro-batch's padding
    mask, as ``MoELayer.forward`` does (Megatron-Core 0.16's plan calls ``mlp.route(hidden)`` without it, so
    padding tokens would enter the load-balancing / z losses and expert-bias counts).  The mask is the one
    ``GPTModel._preprocess`` produced for this plan (``plan.state.padding_mask``, [B, S] True = padding),
    transposed to Megatron's [S, B] like ``MoELayer.forward``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    patched = []
    for layer in _gpt_model(module).decoder.layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, MoELayer):
            continue

        def route(hidden_states, padding_mask=None, _route=mlp.route):
            if padding_mask is None:
                mask = getattr(plan.state, "padding_mask", None)
                if mask is not None:
                    padding_mask = mask.transpose(0, 1).bool()
            return _route(hidden_states, padding_mask)

        mlp.route = route
        patched.append(mlp)
    try:
        yield
    finally:
        for mlp in patched:
            del mlp.route  # the class's method again


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
        with _route_with_padding(module, plan):
            y = self._run(plan, None, None)
        return y, self._state(plan, x)

    @staticmethod
    def _state(plan, x):
        """What the backward needs: the plan, and the input whose ``.grad`` it fills (None on a first chunk)."""
        return plan, x if isinstance(x, torch.Tensor) and x.requires_grad else None

    def backward(self, chunk: int, state: Any, grad_y: torch.Tensor) -> Optional[torch.Tensor]:
        plan, x = state
        self._run(None, plan, grad_y)
        return None if x is None else x.grad

    def forward_backward(self, f_chunk: int, f_module: torch.nn.Module, x: Any, f_m: int, b_chunk: int,
                         b_state: Any, b_grad_y: torch.Tensor):
        f_plan = self.build_plan(f_chunk, f_module, x, f_m)
        b_plan, b_x = b_state
        with _route_with_padding(f_module, f_plan):
            y = self._run(f_plan, b_plan, b_grad_y)
        return y, self._state(f_plan, x), None if b_x is None else b_x.grad


def megatron_stage_plan_fn(micro_batches: Sequence[Any]) -> PlanFn:
    """``build_plan`` for :class:`MegatronOverlapExecutor` over
    :class:`moerl.pipeline.megatron_stages.MegatronStage` chunks: the plan of ``stage.model`` for
    ``micro_batches[m]`` with the arguments ``MegatronStage.forward`` would pass (tokens on the first stage,
    ``set_input_tensor(x)`` on later ones)."""
    def build(chunk, stage, x, m):
        model = _gpt_model(stage)
        if not stage.is_first:
            model.set_input_tensor(x)
        args, kwargs = stage_model_args(micro_batches[m], stage.is_first, model.config)
        return model.build_schedule_plan(*args, **kwargs)

    return build

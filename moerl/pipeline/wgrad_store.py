"""A layer-level split of the backward into B (input gradients) and W (weight gradients): the weight-grad store.

Zero-bubble schedules (ZB1P, DualPipe, DualPipeV) pay off only when the weight-gradient step ``W`` costs what
it saves, i.e. when ``B + W`` costs about one ordinary backward.  DeepSeek's DualPipe gets there with a
``WeightGradStore`` (its linear layers' backward, while the store is enabled, queues the weight-gradient
GEMM instead of running it; ``W`` pops and runs the queue); Megatron-Core does the same for Transformer
Engine layers with ``TransformerConfig.delay_wgrad_compute`` and ``module.backward_dw()``.  This module is
moerl's version for the layers moerl trains on CPU and GPU (the idea is theirs; the code is written here):

- Megatron-Core's ``ColumnParallelLinear`` and ``RowParallelLinear`` (the local spec: attention
  ``linear_qkv``/``linear_proj``, dense MLP ``linear_fc1``/``linear_fc2``, the MoE experts of ``SequentialMLP``
  whose experts are such MLPs, and the ``output_layer``).  :meth:`WeightGradStore.install` replaces, on each
  such module INSTANCE, ``_forward_impl`` (the method through which both classes call
  ``linear_with_grad_accumulation_and_async_allreduce``; Megatron-Core 0.16 documents no deferral hook for
  these layers -- their ``backward_dw()`` "does nothing") by a function that, while the store is armed
  (:meth:`WeightGradStore.arm`, the interpreter arms the forwards whose backward is split), runs
  :class:`DeferredWgradLinear` -- the same forward maths as Megatron's
  ``LinearWithGradAccumulationAndAsyncCommunication`` (sequence-parallel all-gather of the input, ``x @ w.T +
  b``), whose backward computes the input gradient (with the TP all-reduce or the sequence-parallel
  reduce-scatter, as Megatron) and, inside :meth:`WeightGradStore.capture`, queues ``(input, grad_output)``
  for the weight GEMM instead of running it.  Outside an armed forward (1F1B's unsplit backward, log-prob
  forwards, frozen weights, ``defer_embedding_wgrad_compute`` buffers) Megatron's own function runs
  unchanged.  Biases passed to the GEMM get their gradient in B (a reduction, no GEMM).
- Transformer Engine modules of Megatron-Core (``megatron.core.extensions.transformer_engine``: TELinear,
  TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear, TEGroupedLinear of
  ``TEGroupedMLP``) built with ``TransformerConfig.delay_wgrad_compute=True`` (TE >= 2.3): TE then skips the
  weight GEMM in every backward and queues it per module (FIFO); ``W`` calls each module's ``backward_dw()``
  (Megatron-Core's documented API).  This needs W of a chunk to run in the order of its B's (checked by
  :func:`check_fifo_weight_order`; true of moerl's schedules), and an unsplit backward (BW) of such a chunk is
  followed by its ``backward_dw()`` at once (:meth:`WeightGradStore.after_unsplit`).  Where it does NOT apply:
  TE modules built without ``delay_wgrad_compute`` (their weight gradients are computed in B and they are
  named as uncovered) -- and Megatron-Core 0.16's TransformerConfig accepts ``delay_wgrad_compute`` only
  together with ``overlap_moe_expert_parallel_comm`` (the EP-overlap schedule plans) and without the legacy
  grouped GEMM, so in moerl's interpreter without ``train.pipeline_overlap`` TE layers stay in B; TE < 2.3
  (Megatron refuses the flag at build time); and the executor path of ``train.pipeline_overlap``
  (:mod:`moerl.pipeline.overlap`: Megatron's schedule plans run their own ``backward_dw``, the interpreter's W
  is empty there).  Not run on CPU (TE does not install here): written against the documented API only.

Parameters the store does not cover (norms, the router, the embedding, biases, modules of other classes --
e.g. the legacy ``GroupedMLP`` whose expert weights are raw parameters of a grouped GEMM, or a forward
re-run by activation recomputation inside B) get their gradients in B as before; :class:`Coverage` names them and :meth:`WeightGradStore.install` logs them
once (logger ``moerl.pipeline``), so nothing is silently left out.  A parameter used by a covered linear AND
elsewhere (a tied embedding: the embedding lookup and the output layer) gets the lookup's share in B and the
output GEMM's share in W, into the same tensor.

Gradients go where :class:`moerl.pipeline.interpreter.PipelineInterpreter` puts them (:func:`accumulate_grad`):
Megatron DDP's ``param.main_grad`` when present, else ``param.grad``.  With
``gradient_accumulation_fusion`` (GPU, apex/TE's ``fused_weight_gradient_mlp_cuda``) the W GEMM accumulates
into ``main_grad`` with that kernel, as Megatron does; without it (CPU) W computes ``grad_output^T @ input``
in the input's dtype and adds it.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Optional

import torch

__all__ = ["Coverage", "DeferredWgradLinear", "WeightGradStore", "accumulate_grad", "check_fifo_weight_order"]

logger = logging.getLogger("moerl.pipeline")

_TE_MODULE = "megatron.core.extensions.transformer_engine"


def accumulate_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    """Add a weight gradient ``g`` (same shape as ``p``) to ``p.main_grad`` (Megatron DDP's fp32 buffer, whose
    autograd hooks do not fire for ``torch.autograd.grad``) when present, else to ``p.grad`` (set to a copy
    when None).  ``g=None`` is a no-op."""
    if g is None:
        return
    if getattr(p, "main_grad", None) is not None:
        p.main_grad.add_(g)
    elif p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)


@dataclass
class _WgradJob:
    """One deferred weight-gradient GEMM: ``weight += grad_output^T @ all_gather(input)`` (2-D views)."""

    weight: torch.nn.Parameter
    input: torch.Tensor
    grad_output: torch.Tensor
    sequence_parallel: bool
    tp_group: Any
    fusion: bool

    def run(self) -> None:
        x = _gather_sequence(self.input, self.tp_group) if self.sequence_parallel else self.input
        g = self.grad_output.reshape(-1, self.grad_output.shape[-1])
        x = x.reshape(-1, x.shape[-1])
        main_grad = getattr(self.weight, "main_grad", None)
        if self.fusion and main_grad is not None and main_grad.is_cuda:
            import fused_weight_gradient_mlp_cuda  # apex / TE's kernel, as Megatron's linear uses it

            kernel = (fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32
                      else fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16)
            kernel(x.contiguous(), g.contiguous(), main_grad)
            return
        accumulate_grad(self.weight, g.t().matmul(x))


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x`` [S/tp, ...] along dim 0 over the TP group (a collective: every TP rank calls)."""
    out = torch.empty((x.shape[0] * group.size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class DeferredWgradLinear(torch.autograd.Function):
    """``y = all_gather(x) @ w.T + b`` whose backward may leave the weight GEMM to a :class:`WeightGradStore`.

    Forward as Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication``: ``x`` [S(/tp), B, in]
    (any leading dims), ``w`` [out, in], ``b`` [out] or None; with ``sequence_parallel`` ``x`` is this TP
    rank's sequence shard and is all-gathered along dim 0 over ``tp_group`` first.  Returns [S, B, out] in
    ``x``'s dtype.

    Backward: ``dx = dy @ w``, all-reduced over ``tp_group`` (``allreduce_dgrad``) or reduce-scattered along
    dim 0 (``sequence_parallel``); ``db = sum(dy)``; the weight gradient ``dy^T @ all_gather(x)`` is queued on
    ``store`` (returned as None) when the backward runs inside ``store.capture(key)``, else computed and
    returned like any autograd gradient.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, store, fusion, allreduce_dgrad, sequence_parallel, tp_group):
        ctx.save_for_backward(input, weight)
        ctx.store, ctx.fusion, ctx.use_bias = store, fusion, bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total = _gather_sequence(input, tp_group) if sequence_parallel else input
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        import torch.distributed as dist

        input, weight = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
            if ctx.allreduce_dgrad:
                dist.all_reduce(grad_input, group=ctx.tp_group)
            elif ctx.sequence_parallel:
                shard = torch.empty_like(input)
                dist.reduce_scatter_tensor(shard, grad_input.contiguous(), group=ctx.tp_group)
                grad_input = shard
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.use_bias else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            job = _WgradJob(weight, input, grad_output, ctx.sequence_parallel, ctx.tp_group, ctx.fusion)
            if not ctx.store._put(job):  # not capturing: an ordinary backward
                x = _gather_sequence(input, ctx.tp_group) if ctx.sequence_parallel else input
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


@dataclass
class Coverage:
    """What :meth:`WeightGradStore.install` found in one module.

    Attributes:
        deferred: names of the parameters whose weight-gradient GEMMs run in W (every use through a covered
            linear).
        in_b: names of the parameters whose gradients (or part of them) are computed in B: not the weight of
            a covered linear, or also used elsewhere (tied embedding), or a bias.
        te_modules: names of Transformer Engine modules deferred with ``delay_wgrad_compute``.
    """

    deferred: list[str] = field(default_factory=list)
    in_b: list[str] = field(default_factory=list)
    te_modules: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: counts and the B-side names with layer numbers folded (``decoder.layers.*.x``)."""
        folded = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in self.in_b})
        return (f"{len(self.deferred)} weight tensors deferred to W"
                + (f" ({len(self.te_modules)} TE modules via delay_wgrad_compute)" if self.te_modules else "")
                + f"; {len(self.in_b)} parameters get their gradients in B: {', '.join(folded) or '(none)'}")


class WeightGradStore:
    """Queues of deferred weight-gradient GEMMs, keyed by (chunk, micro-batch), for a B/W split.

    Use (what :class:`moerl.pipeline.interpreter.PipelineInterpreter` does with ``split_backward="store"``)::

        store = WeightGradStore()
        store.install(module, chunk=c)           # once per chunk module (instances are patched in place)
        with store.arm():                         # a forward whose backward will be split
            y = module(x)
        with store.capture((c, m)):               # B: input grads (+ grads of uncovered parameters)
            torch.autograd.grad(y, [x, *params], g, allow_unused=True)
        store.run((c, m))                         # W: exactly the queued GEMMs, into main_grad / grad

    A module is patched for one store at a time (installing another store re-points it).  Not thread-safe
    (one store per pipeline interpreter, one backward at a time).
    """

    def __init__(self):
        self._queues: dict[Hashable, list[_WgradJob]] = {}
        self._key: Optional[Hashable] = None
        self._armed = False
        self._te: dict[Hashable, list[torch.nn.Module]] = {}  # chunk -> TE modules with delay_wgrad_compute
        self.coverage: dict[Hashable, Coverage] = {}

    # ---------------------------------------------------------------------------------------------- setup
    def install(self, module: torch.nn.Module, chunk: Hashable = 0, *, log: bool = True) -> Coverage:
        """Patch every Megatron-Core ``ColumnParallelLinear`` / ``RowParallelLinear`` of ``module`` (in place,
        opt-in per instance) to defer its weight GEMM to this store, register its Transformer Engine modules
        built with ``delay_wgrad_compute``, and return (and log once) the :class:`Coverage`.

        Args:
            module: a chunk module (e.g. :class:`moerl.pipeline.megatron_stages.MegatronStage`, or a Megatron
                DDP / Float16Module wrapping one: any ``nn.Module``).
            chunk: the chunk id whose ``W`` will run the TE modules' ``backward_dw`` (TE only).
            log: log the coverage (INFO; a WARNING when nothing is deferred), once per module and coverage
                (:func:`moerl.pipeline.megatron_stages.make_forward_backward_func` installs a store every step).
        """
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        cov = Coverage()
        deferred_ids: set[int] = set()
        b_ids: set[int] = set()
        te = []
        for name, mod in module.named_modules():
            own = [(n, p) for n, p in mod.named_parameters(recurse=False) if p.requires_grad]
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                if "_moerl_wgrad_store" not in mod.__dict__:
                    mod._forward_impl = _deferring_forward_impl(mod)
                mod._moerl_wgrad_store = self
                for n, p in own:
                    (deferred_ids if n == "weight" else b_ids).add(id(p))
            elif type(mod).__module__.startswith(_TE_MODULE) and hasattr(mod, "backward_dw") and own:
                if getattr(getattr(mod, "config", None), "delay_wgrad_compute", False):
                    te.append(mod)
                    cov.te_modules.append(name)
                    for n, p in own:
                        (deferred_ids if "weight" in n else b_ids).add(id(p))
                else:
                    b_ids.update(id(p) for _, p in own)
            else:
                b_ids.update(id(p) for _, p in own)
        seen: set[int] = set()
        for n, p in module.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (cov.in_b if id(p) in b_ids or id(p) not in deferred_ids else cov.deferred).append(n)
        self._te[chunk] = te
        self.coverage[chunk] = cov
        if log and module.__dict__.get("_moerl_wgrad_logged") != cov.summary():  # once per module and coverage
            module._moerl_wgrad_logged = cov.summary()
            if cov.deferred:
                logger.info("split_backward=store: chunk %s: %s", chunk, cov.summary())
            else:
                logger.warning("split_backward=store: chunk %s has no Megatron linear to defer: its whole backward "
                               "runs in B and W is empty (split_backward='retrace' or 'torch' split it by "
                               "re-traversing the graph instead)", chunk)
        return cov

    # ---------------------------------------------------------------------------------------------- use
    @contextlib.contextmanager
    def arm(self) -> Iterator[None]:
        """Forwards inside build graphs whose covered linears can defer their weight GEMMs."""
        prev, self._armed = self._armed, True
        try:
            yield
        finally:
            self._armed = prev

    @contextlib.contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Backwards inside queue the weight GEMMs of armed forwards under ``key`` (e.g. ``(chunk, mb)``).

        Raises:
            RuntimeError: ``key`` already has queued GEMMs (run W first) or captures are nested."""
        if self._key is not None:
            raise RuntimeError(f"WeightGradStore: capture({key!r}) inside capture({self._key!r})")
        if self._queues.get(key):
            raise RuntimeError(f"WeightGradStore: {key!r} already has {len(self._queues[key])} queued weight GEMMs; "
                               "run W for it first")
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def _put(self, job: _WgradJob) -> bool:
        if self._key is None:
            return False
        self._queues.setdefault(self._key, []).append(job)
        return True

    def run(self, key: Hashable, chunk: Optional[Hashable] = None) -> int:
        """W of ``key``: run its queued GEMMs (in queue order) and accumulate them (:func:`accumulate_grad`,
        or the fused kernel into ``main_grad``), then ``backward_dw()`` of the TE modules of ``chunk``
        (default ``key[0]``).  Returns the number of GEMMs run (TE modules not counted)."""
        jobs = self._queues.pop(key, [])
        with torch.no_grad():  # the saved inputs are activations that require grad: W builds no graph
            for job in jobs:
                job.run()
        self._te_backward_dw(key[0] if chunk is None and isinstance(key, tuple) else chunk)
        return len(jobs)

    def after_unsplit(self, chunk: Hashable) -> None:
        """After an unsplit backward (BW) of ``chunk``: TE modules with ``delay_wgrad_compute`` queued their
        weight GEMMs anyway; run them now."""
        self._te_backward_dw(chunk)

    def _te_backward_dw(self, chunk) -> None:
        for mod in self._te.get(chunk, ()):
            mod.backward_dw()

    def pending(self) -> list[Hashable]:
        """Keys with queued GEMMs (W not run yet)."""
        return [k for k, v in self._queues.items() if v]

    def clear(self) -> None:
        """Drop every queued GEMM (after a failed step)."""
        self._queues.clear()
        self._key = None


def _deferring_forward_impl(mod: torch.nn.Module) -> Callable:
    """The ``_forward_impl`` installed on ``mod``: :class:`DeferredWgradLinear` when ``mod._moerl_wgrad_store``
    (the store it was last installed for) is armed, grad mode is on and the weight trains; Megatron's own
    implementation otherwise (also when an embedding-wgrad deferral buffer is passed)."""
    original = type(mod)._forward_impl.__get__(mod)

    def forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                     grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, **kwargs):
        store = mod._moerl_wgrad_store
        if (not store._armed or not torch.is_grad_enabled() or not weight.requires_grad
                or grad_output_buffer is not None or kwargs):
            return original(input=input, weight=weight, bias=bias,
                            gradient_accumulation_fusion=gradient_accumulation_fusion,
                            allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                            grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                            tp_group=tp_group, **kwargs)
        if (allreduce_dgrad or sequence_parallel) and tp_group is None:
            from megatron.core.utils import get_tensor_model_parallel_group_if_none

            tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        return DeferredWgradLinear.apply(input, weight, bias, store, bool(gradient_accumulation_fusion),
                                         bool(allreduce_dgrad), bool(sequence_parallel), tp_group)

    return forward_impl


def check_fifo_weight_order(schedule, rank: int) -> None:
    """Transformer Engine's ``delay_wgrad_compute`` queue is FIFO per module: ``W`` of a chunk must follow the
    order of its ``B``'s.  Raises ValueError naming the first chunk of ``rank`` where ``schedule`` does not."""
    from moerl.pipeline.schedules import _plan_actions

    bs: dict[int, list[int]] = {}
    ws: dict[int, list[int]] = {}
    for a in _plan_actions(schedule, rank, False):
        for kind, c, m in a.parts():
            if kind == "B":
                bs.setdefault(c, []).append(m)
            elif kind == "W":
                ws.setdefault(c, []).append(m)
    for c, order in ws.items():
        split_bs = [m for m in bs.get(c, []) if m in set(order)]
        if split_bs != order:
            raise ValueError(f"schedule {schedule.name}: chunk {c} runs W in micro-batch order {order} but B in "
                             f"{split_bs}; Transformer Engine's delay_wgrad_compute queue needs the same order "
                             "(use split_backward='retrace' or build the TE layers without delay_wgrad_compute)")

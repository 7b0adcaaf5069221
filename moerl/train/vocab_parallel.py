"""Token log-probs and entropies from vocabulary-parallel logits (tensor parallelism, tp > 1).

With tp > 1, Megatron's output layer (ColumnParallelLinear, ``parallel_output=True``) leaves each
TP rank with logits for its slice of the vocabulary, ``[B, S, V / tp]``: rank r holds token ids
``[r * V/tp, (r + 1) * V/tp)``. The softmax normaliser and the label's logit live on different
ranks, so both reductions run over the TP group. Nothing of size V is ever gathered.

``vocab_parallel_log_probs`` is differentiable: it is ``-megatron.core.tensor_parallel.
vocab_parallel_cross_entropy(logits / T, labels)`` (Megatron's vocab-parallel cross entropy, the
one GPTModel uses for its own loss). ``vocab_parallel_entropy`` is forward-only (logged, no bonus).
Both must be called on every rank of the TP group with the same labels (collectives inside).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs", "vocab_parallel_entropy", "OutputLayerSkipped", "skip_output_layer"]


def _check(logits: torch.Tensor, temperature: float) -> float:
    if not logits.is_floating_point() or logits.dim() < 2:
        raise ValueError(f"logits must be a float tensor [B, S, V/tp], got {logits.dtype} {tuple(logits.shape)}")
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite float > 0 (the sampling temperature), got {temperature}")
    return t


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)[label]`` for vocabulary-parallel logits.

    Args:
        logits: float [B, S, V/tp], this TP rank's vocabulary slice (any float dtype; the maths
            runs in float32).
        labels: long [B, S], global token ids in [0, V) (the same on every TP rank).
        temperature: the sampling temperature (> 0).

    Returns:
        float32 [B, S], identical on every TP rank; gradients flow to this rank's logits slice.

    Raises:
        ValueError: bad shapes or temperature.
    """
    from megatron.core import tensor_parallel

    t = _check(logits, temperature)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without the vocab dim")
    # a fresh float32 tensor: megatron's cross entropy subtracts the max in place
    scaled = logits.float() / t
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels.long())


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float, *, grad: bool = False) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits / T)`` over the whole vocabulary, for vocabulary-parallel
    logits [B, S, V/tp]; returns float32 [B, S], identical on every TP rank.

    H = lse - E_p[x] with x = logits / T, computed with a (detached) max-shift: the max, sum(exp)
    and sum(exp * x) are all-reduced over the TP group. ``grad=False``: no gradient (a metric).
    ``grad=True`` (an entropy bonus, algorithm.entropy_coef > 0): the sums are reduced with
    Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward),
    so each rank gets dH/d(its logit shard), as Megatron's vocab-parallel cross entropy does.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    t = _check(logits, temperature)
    group = ps.get_tensor_model_parallel_group()
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        x = logits.float() / t
        m = x.detach().max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m.unsqueeze(-1))
        sums = torch.stack([e.sum(-1), (e * x).sum(-1)])
        if torch.is_grad_enabled():
            sums = reduce_from_tensor_model_parallel_region(sums)
        else:
            dist.all_reduce(sums, group=group)
        return m + torch.log(sums[0]) - sums[1] / sums[0]


class OutputLayerSkipped:
    """What :func:`skip_output_layer` hands the loss: ``weight``, the output-layer weight (or its
    vocabulary shard [V/tp, H], or the tied embedding) the last forward would have used."""

    def __init__(self) -> None:
        self.weight: Optional[torch.Tensor] = None


@contextlib.contextmanager
def skip_output_layer(model) -> Iterator[OutputLayerSkipped]:
    """Make a Megatron GPTModel return its final hidden states instead of logits (for the fused
    linear log-prob, moerl.kernels.fused_logprob): inside the block the model's ``output_layer``
    (ColumnParallelLinear) hands back its input [S, B, H] prepared as it would prepare it for its
    GEMM, so GPTModel's own ``[s b h] => [b s h]`` transpose yields hidden states [B, S, H] where
    logits [B, S, V/tp] were. The input preparation keeps the layer's communication: with sequence
    parallelism the sequence all-gather (reduce-scatter in backward), else with tp > 1 Megatron's
    ``copy_to_tensor_model_parallel_region`` (the all-reduce of the hidden gradient in backward:
    each rank's fused op gives the gradient of its own vocabulary shard). The weight the layer would
    have used (the tied embedding weight when it is passed in) is recorded in the yielded object.

    A model without an output layer (a pipeline stage before the last) is left unchanged.
    """
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    box = OutputLayerSkipped()
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if layer is None:
        yield box
        return

    def passthrough(input_, weight=None, runtime_gather_output=None):
        box.weight = layer.weight if weight is None else weight
        group = getattr(layer, "tp_group", None)
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group), None
        if group is not None and dist.get_world_size(group) > 1:
            return copy_to_tensor_model_parallel_region(input_, group=group), None
        return input_, None

    layer.forward = passthrough
    try:
        yield box
    finally:
        del layer.forward

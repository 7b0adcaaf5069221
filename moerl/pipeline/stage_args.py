"""GPTModel arguments of a micro-batch for one pipeline stage.

Shared by :class:`moerl.pipeline.megatron_stages.MegatronStage` (its forward), the overlap executor's plan
builder (:func:`moerl.pipeline.overlap.megatron_stage_plan_fn`) and the actor's forward step.  A leaf of
``moerl.pipeline`` (no moerl import at module level) so that ``megatron_stages`` and ``overlap`` need not
import each other; both names stay importable from :mod:`moerl.pipeline.megatron_stages`.
"""

from __future__ import annotations

__all__ = ["stage_model_args", "sequence_parallel_kwargs"]


def stage_model_args(mb, is_first: bool, config) -> tuple[tuple, dict]:
    """``GPTModel.forward`` (or ``build_schedule_plan``) arguments of micro-batch ``mb`` for one pipeline
    stage: ``moerl.train.batching.model_forward_args(mb)`` on the stage that embeds the tokens; on a later
    stage, whose input comes from ``set_input_tensor``, ``(None, None, attention_mask)`` and the
    sequence-parallel slice of the padding mask (:func:`sequence_parallel_kwargs`)."""
    from moerl.train.batching import model_forward_args

    args, kwargs = model_forward_args(mb)
    if is_first:
        return args, kwargs
    return (None, None, args[2]), sequence_parallel_kwargs(config, kwargs)


def sequence_parallel_kwargs(config, kwargs: dict) -> dict:
    """GPTModel keyword arguments for a stage WITHOUT the embedding under sequence parallelism: GPTModel
    scatters ``padding_mask`` [B, S] along the sequence only where it embeds (pre_process), so a later
    stage must get this TP rank's slice ``[:, r*S/tp:(r+1)*S/tp]``.  ``kwargs`` unchanged otherwise."""
    from megatron.core import parallel_state as ps

    pad = kwargs.get("padding_mask")
    if pad is None or not getattr(config, "sequence_parallel", False):
        return kwargs
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return kwargs
    if pad.shape[1] % tp:
        raise ValueError(f"sequence parallelism needs the sequence length ({pad.shape[1]}) divisible by "
                         f"tp_size ({tp}): pad the micro-batches")
    n, r = pad.shape[1] // tp, ps.get_tensor_model_parallel_rank()
    return dict(kwargs, padding_mask=pad[:, r * n:(r + 1) * n].contiguous())

"""Parallel-layout arithmetic shared by the recipe checks, the checkpoint converter and the memory
planner. Pure python (no torch import), so the recipe schema can use it cheaply."""

from __future__ import annotations

from typing import Optional

__all__ = ["pipeline_layer_range"]


def pipeline_layer_range(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
) -> range:
    """Global decoder layers of pipeline stage ``pp_rank`` (no virtual pipeline).

    Megatron-Core's rule (transformer_layer.get_transformer_layer_offset /
    transformer_block.get_num_layers_to_build): the first and/or last stage take the given
    numbers of layers, and the remaining layers split evenly over the other stages; with neither
    given, all ``num_layers`` split evenly.

    Raises:
        ValueError: the layers do not split evenly, or a stage would get no layer.
    """
    if pp_size == 1:
        return range(num_layers)
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_stages == 0:
        if middle_layers != 0:
            raise ValueError(
                f"num_layers_in_first_pipeline_stage={first} + num_layers_in_last_pipeline_stage={last} "
                f"must equal num_layers={num_layers} when pp_size=2"
            )
        per = 0
    else:
        if middle_layers < middle_stages or middle_layers % middle_stages:
            what = "num_layers" if first is None and last is None else "the layers left after the first/last stage"
            raise ValueError(
                f"{what} ({middle_layers}) must split evenly over {middle_stages} pipeline stage(s) "
                f"(num_layers={num_layers}, pp_size={pp_size}, num_layers_in_first_pipeline_stage={first}, "
                f"num_layers_in_last_pipeline_stage={last})"
            )
        per = middle_layers // middle_stages
    sizes = [per] * pp_size
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    if min(sizes) < 1:
        raise ValueError(f"pipeline stages would get {sizes} layers; every stage needs at least one")
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])

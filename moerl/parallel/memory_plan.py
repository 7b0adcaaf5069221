"""``moerl plan RECIPE.yaml``: the answer to "does this recipe fit on these GPUs, and if not, which
layout does", printed. The memory model (parameters, gradients, optimizer state, activations,
reference policy, critic, colocated rollout engines, sequence lengths from the recipe) is
moerl.parallel.memory_model, the GPU table moerl.parallel.hardware, the layout search and its
step-time model moerl.parallel.plan_search. This module re-exports the memory model's public names
(``from moerl.parallel.memory_plan import plan_memory`` keeps working).

Exit codes of ``main``: 0 answered (FITS or DOES NOT FIT), 2 bad input: one line on stderr naming
the recipe key or flag (an invalid recipe value, a non-positive length or world size, an unknown
hardware.gpu with the known names, a world size no layout tiles).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from moerl.parallel.memory_model import (  # noqa: F401 - re-exported
    GIB,
    Hardware,
    MemoryPlan,
    MLAShape,
    ModelShape,
    RecipePlan,
    RolloutPlan,
    StagePlan,
    Workload,
    critic_param_counts,
    hardware_from_recipe,
    kv_bytes_per_token,
    plan_from_recipe,
    plan_memory,
    plan_recipe,
    plan_rollout,
    rank_param_counts,
    recipe_workload,
    total_params,
)

__all__ = [
    "GIB", "Hardware", "MemoryPlan", "MLAShape", "ModelShape", "RecipePlan", "RolloutPlan", "StagePlan", "Workload",
    "critic_param_counts", "hardware_from_recipe", "kv_bytes_per_token", "plan_from_recipe", "plan_memory",
    "plan_recipe", "plan_rollout", "rank_param_counts", "recipe_workload", "total_params", "format_plan", "main",
]


# --------------------------------------------------------------------------------------------
# output and CLI
# --------------------------------------------------------------------------------------------


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _verdict(total: float, usable: Optional[float]) -> str:
    if usable is None:
        return ""
    room = usable - total
    word = "FITS" if room >= 0 else "DOES NOT FIT"
    return f"{word} ({'+' if room >= 0 else '-'}{abs(room) / GIB:.2f} GiB headroom)"


def format_plan(plan, title: str = "") -> str:
    """Human-readable table of a MemoryPlan or a RecipePlan (GiB per rank), with a FITS / DOES NOT
    FIT verdict per pipeline rank when the GPU memory is known."""
    rp = plan if isinstance(plan, RecipePlan) else None
    mem = rp.memory if rp else plan
    usable = rp.hardware.usable_bytes if rp else None
    mp = mem.model_params
    opts = [f"params {mem.params_dtype}", "sequence parallel" if mem.sequence_parallel else "no sequence parallel",
            "distributed optimizer" if mem.use_distributed_optimizer else "replicated optimizer",
            "flash attention" if mem.flash_attention else "S x S attention probs kept"]
    if mem.pp_size > 1:
        opts.append(f"schedule {mem.pipeline_schedule}")
    extra = [x for x, on in (("reference policy weights", mem.reference_policy),
                             ("critic weights+grads+Adam", mem.critic)) if on]
    lines = [
        f"moerl plan{': ' + (title or (rp.recipe if rp else '')) if (title or rp) else ''}",
        f"model: {_count(mp['total'])} parameters ({_count(mp['active'])} active per token; experts {_count(mp['expert'])})",
        f"layout: world_size {mem.world_size} = tp {mem.tp_size} x pp {mem.pp_size} x dp {mem.dp_size}; "
        f"ep {mem.ep_size}, etp {mem.etp_size} (expert dp {mem.expert_dp_size}); " + ", ".join(opts),
    ]
    if rp:
        w = rp.workload
        lines.append(f"sequence: {w.sample_tokens} tokens ({w.source}); micro-batch "
                     + (f"packed to {w.seq_length} tokens (train.max_tokens_per_micro_batch)" if w.packed
                        else f"{w.micro_batch_size} x {w.seq_length} tokens"))
        hw = rp.hardware
        gpu = (f"{hw.name}, {hw.memory_gib:g} GiB, usable {usable / GIB:.1f} GiB after "
               f"hardware.reserved_fraction {hw.reserved_fraction:g}") if usable else \
            "unknown memory (set hardware.gpu, e.g. hardware.gpu=H100, or hardware.gpu_memory_gib)"
        lines.append(f"GPU: {gpu}")
    lines += [
        f"micro-batches: {mem.num_microbatches} per step per DP rank"
        + (" (1F1B: stage r holds min(pp - r, micro-batches) in flight)" if mem.pp_size > 1
           and mem.pipeline_schedule == "1f1b" else ""),
        "training side" + (f" (actor + {' + '.join(extra)})" if extra else " (actor)") + ":",
        "per rank, GiB  layers  params   weights    grads optimizer  ref+critic | activations: none selective"
        f"     full | total (recompute={mem.recompute})",
    ]
    for st in mem.stages:
        a = st.activations
        total = st.total(mem.recompute)
        lines.append(
            f"pp stage {st.pp_rank:<4d} {st.layers:6d} {_count(st.params):>8s} {_gib(st.weights)} {_gib(st.grads)} "
            f"{_gib(st.optimizer)}  {_gib(st.reference + st.critic)}   |    {_gib(a['none'])} {_gib(a['selective'])} "
            f"{_gib(a['full'])} | {_gib(total)}  {_verdict(total, usable)}"
        )
    worst = mem.worst()
    wt = worst.total(mem.recompute)
    lines.append(f"peak: {wt / GIB:.2f} GiB per GPU (pp stage {worst.pp_rank}, {worst.in_flight:g} micro-batch(es) "
                 "in flight)" + (f": {_verdict(wt, usable)}" if usable else
                                 "; add ~10-20 % for buffers and fragmentation"))
    if rp and rp.rollout is not None:
        ro = rp.rollout
        lines.append(
            f"colocated rollout engines: {ro.replicas} SGLang replica(s) of rollout.server_tp_size "
            f"{mem.world_size // ro.replicas} GPU(s), {ro.sequences} sequences of {ro.sample_tokens} tokens each at once; "
            f"per GPU: weights {ro.weights / GIB:.2f} GiB + KV cache {ro.kv_needed / GIB:.2f} GiB "
            f"({ro.kv_per_token / 1024:.1f} KiB/token)")
        if ro.static_budget is not None:
            pool = ro.kv_pool
            verdict = "FITS" if ro.fits else "DOES NOT FIT"
            lines.append(
                f"  mem_fraction_static {ro.mem_fraction_static:g} x {rp.hardware.memory_gib:g} GiB = "
                f"{ro.static_budget / GIB:.2f} GiB -> KV pool {pool / GIB:.2f} GiB: {verdict} "
                + (f"(+{(pool - ro.kv_needed) / GIB:.2f} GiB headroom)" if ro.fits else
                   f"(the pool holds {ro.sequences_held} of {ro.sequences} full-length sequences; SGLang queues the "
                   "rest: raise rollout.mem_fraction_static or rollout.server_tp_size, or lower "
                   "rollout.rollout_batch_size)"))
    if rp and rp.fits() is not None:
        lines.append(f"answer: {'FITS' if rp.fits() else 'DOES NOT FIT'} on {mem.world_size} x {rp.hardware.name}"
                     + ("" if rp.fits() else "; try `moerl plan RECIPE --search --world-size N`"))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``moerl plan RECIPE.yaml [key=value ...] [--world-size N] [--seq-length S] [--search] [--json]``.

    Returns 0, or 2 (one line on stderr naming the key) for a bad recipe, length, GPU name or a
    world size no layout tiles."""
    parser = argparse.ArgumentParser(
        prog="moerl plan",
        description="Does the recipe fit its GPUs? Per-GPU memory (weights, gradients, Adam state, activations, "
        "reference policy, critic, colocated SGLang engines) of the recipe's layout with a FITS / DOES NOT FIT "
        "verdict per pipeline stage (hardware.gpu=H100 ...); --search ranks the layouts that fit. Dotted "
        "key=value pairs override recipe keys (e.g. parallel.tp_size=4).",
    )
    parser.add_argument("recipe", help="path to a recipe YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, key=value")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of GPUs (default: parallel.world_size, else the smallest the layout tiles)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="longest sample, prompt + response tokens (default: hardware.max_prompt_tokens + "
                        "rollout.max_new_tokens)")
    parser.add_argument("--no-flash-attention", action="store_true",
                        help="count the S x S attention probabilities (local attention, as on CPU)")
    parser.add_argument("--search", action="store_true",
                        help="enumerate the layouts of --world-size GPUs, keep those that fit, rank by estimated step time")
    parser.add_argument("--top", type=int, default=5, help="layouts --search prints (default 5)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_intermixed_args(argv)
    from moerl.config.loader import ConfigError, load_config

    try:
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError(f"--world-size must be a positive number of GPUs, got {args.world_size}")
        if args.top < 1:
            raise ConfigError(f"--top must be >= 1, got {args.top}")
        cfg = load_config(args.recipe, args.overrides)
        if args.search:
            from moerl.parallel.plan_search import format_search, search_layouts

            if args.world_size is None:
                raise ConfigError("--search needs --world-size N (the GPUs to lay the recipe out on)")
            result = search_layouts(cfg, args.world_size, seq_length=args.seq_length,
                                    flash_attention=not args.no_flash_attention)
            print(json.dumps(result.to_dict(args.top), indent=2) if args.json else
                  format_search(result, args.top, title=args.recipe))
            return 0
        plan = plan_recipe(cfg, args.world_size, args.seq_length, flash_attention=not args.no_flash_attention,
                           recipe=args.recipe)
    except (ConfigError, ValueError) as e:
        print("moerl plan: " + " ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0

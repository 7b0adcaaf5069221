"""``moerl plan RECIPE.yaml``: the answer to "does this recipe fit on these GPUs, and if not, which
layout does", printed. The memory model (parameters, gradients, optimizer state, activations,
reference policy, critic, colocated rollout engines, sequence lengths from the recipe) is
moerl.parallel.memory_model, the GPU table moerl.parallel.hardware, the layout search and its
step-time model moerl.parallel.plan_search. This module re-exports the memory model's public names
(``from moerl.parallel.memory_plan import plan_memory`` keeps working).

Exit codes of ``main``: 0 answered (FITS or DOES NOT FIT), 2 bad input: ``moerl plan: bad <kind> input:
...`` on stderr naming the recipe key or flag, and a ``fix:`` line (moerl.errors.run_entry; ``moerl --debug
plan`` adds the traceback): an invalid recipe value, a non-positive length or world size, a --seq-length
reaching model.hf_config.max_position_embeddings, an unknown hardware.gpu with the known names,
precision.fp8 on a GPU without that FP8 recipe, a world size no layout tiles.
"""

from __future__ import annotations

import argparse
import json
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
    if rp and rp.fp8:
        opts.append(f"FP8 GEMMs {rp.fp8} (precision.fp8; TE's FP8 weight copies not counted)")
    elif rp:
        opts.append("BF16 GEMMs (precision.fp8 null)")
    extra = [x for x, on in (("reference policy weights", mem.reference_policy),
                             ("critic weights+grads+Adam", mem.critic)) if on]
    from moerl.parallel.memory_model import recipe_vocab_is_default

    default_vocab = bool(rp and recipe_vocab_is_default(rp.vocab_source))
    lines = [
        f"moerl plan{': ' + (title or (rp.recipe if rp else '')) if (title or rp) else ''}",
        f"model: {_count(mp['total'])} parameters ({_count(mp['active'])} active per token; experts {_count(mp['expert'])})"
        + (f"; vocab {rp.vocab_size} from {rp.vocab_source}" if rp and not default_vocab else ""),
        f"layout: world_size {mem.world_size} = tp {mem.tp_size} x pp {mem.pp_size} x dp {mem.dp_size}; "
        f"ep {mem.ep_size}, etp {mem.etp_size} (expert dp {mem.expert_dp_size}); " + ", ".join(opts),
    ]
    if default_vocab:
        lines.append(f"WARNING: vocab {rp.vocab_size} from {rp.vocab_source}; the embedding, output layer and "
                     "logits below are that small")
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
                     + ("" if rp.fits() else "; try `moerl plan RECIPE --search --world-size N`")
                     + (f" (with the DEFAULT vocab {rp.vocab_size}, not the model's: set model.hf_config.vocab_size)"
                        if default_vocab else ""))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``moerl plan RECIPE.yaml [key=value ...] [--world-size N] [--seq-length S] [--search] [--json]``.

    Returns 0, or 2 for bad input (moerl.errors.run_entry prints ``moerl plan: bad <kind> input: ...``
    naming the key or flag, plus a ``fix:`` line): a bad recipe, length, GPU name, FP8 on a GPU without
    it, or a world size no layout tiles."""
    from moerl.errors import run_entry

    return run_entry("moerl plan", lambda: _main(argv))


def _main(argv: Optional[list[str]]) -> int:
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
                        help="number of GPUs (default: parallel.world_size, else the smallest the layout tiles); "
                        "without --search, the recipe's layout at that many GPUs (dp derived)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="longest sample, prompt + response tokens, < model.hf_config.max_position_embeddings "
                        "(default: hardware.max_prompt_tokens + rollout.max_new_tokens)")
    parser.add_argument("--no-flash-attention", action="store_true",
                        help="count the S x S attention probabilities (local attention, as on CPU)")
    parser.add_argument("--search", action="store_true",
                        help="enumerate the layouts of --world-size GPUs, keep those that fit, rank by estimated step "
                        "time; each comes with the overrides that reproduce it")
    parser.add_argument("--top", type=int, default=5, help="layouts --search prints (default 5)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_intermixed_args(argv)
    from moerl.config.loader import ConfigError, load_config
    from moerl.errors import CLIError, input_kind

    if args.world_size is not None and args.world_size < 1:
        raise CLIError(f"--world-size must be a positive number of GPUs, got {args.world_size}", key="--world-size",
                       hint="give --world-size N with N >= 1, or leave it out to use parallel.world_size")
    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}", key="--top", hint="give --top K with K >= 1")
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.search:
            from moerl.parallel.plan_search import format_search, search_layouts

            if args.world_size is None:
                raise CLIError("--search needs --world-size N (the GPUs to lay the recipe out on)", key="--world-size",
                               hint="add --world-size N, e.g. --world-size 8")
            result = search_layouts(cfg, args.world_size, seq_length=args.seq_length,
                                    flash_attention=not args.no_flash_attention)
            print(json.dumps(result.to_dict(args.top), indent=2) if args.json else
                  format_search(result, args.top, title=args.recipe))
            return 0
        note = ""
        if args.world_size is not None and cfg.parallel.world_size not in (None, args.world_size):
            # the recipe's layout at --world-size GPUs (dp derived), as with parallel.world_size=N
            from moerl.config.schema import RecipeConfig

            note = (f"world size: {args.world_size} from --world-size (the recipe's parallel.world_size is "
                    f"{cfg.parallel.world_size}); the same as the override parallel.world_size={args.world_size}")
            d = cfg.to_dict()
            cfg = RecipeConfig.model_validate({**d, "parallel": {**d["parallel"], "world_size": args.world_size}})
        plan = plan_recipe(cfg, args.world_size, args.seq_length, flash_attention=not args.no_flash_attention,
                           recipe=args.recipe)
    except ValueError as e:  # every moerl input error is a ValueError; name any other (pydantic's) as a recipe one
        if input_kind(e) is not None:
            raise
        raise ConfigError(" ".join(line.strip() for line in str(e).splitlines() if line.strip()),
                          hint="correct the recipe key named above") from e
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        text = format_plan(plan)
        print(text if not note else text.replace("\nlayout:", f"\n{note}\nlayout:", 1))
    return 0

"""Batch assembly for the trainer: supervised samples, this DP rank's micro-batches (best-fit packed
or padded), and trainer log-probs attached to samples. Every DP rank gets the same sample list and
builds its own share; losses use global denominators (moerl.algorithms.policy_loss)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from moerl.parallel.packing import flops_linear_coeff, pack_micro_batches
from moerl.runtime import world
from moerl.train.batching import make_micro_batch, split_micro_batches, split_packed_micro_batches
from moerl.types import Sample

if TYPE_CHECKING:  # annotations only (no import at run time)
    from moerl.train.setup import RunContext


def sft_samples(ctx: RunContext, rows) -> list[Sample]:
    """Supervised samples: templated prompt, response = label tokens + eos
    (moerl.data.tokenizer.encode_sft_example, memoized: RunContext.prompt_encoder)."""
    d, out, encoder = ctx.cfg.data, [], ctx.prompt_encoder()
    for i, r in enumerate(rows):
        ids, mask = encoder.sft_example(r[d.prompt_key], str(r[d.label_key]))
        n_prompt = mask.index(1)
        out.append(
            Sample(index=i, group_id=i, prompt=r[d.prompt_key], label=str(r[d.label_key]),
                   prompt_ids=ids[:n_prompt], response_ids=ids[n_prompt:], loss_mask=mask[n_prompt:])
        )
    return out


def flops_coeff(hf_config) -> float:
    """a of the a*L + L^2 FLOP load for DP balancing (moerl.parallel.packing.flops_linear_coeff)."""
    from moerl.parallel.memory_plan import ModelShape, total_params

    active = total_params(ModelShape.from_hf_config(hf_config))["active"]
    return flops_linear_coeff(hf_config.num_hidden_layers, hf_config.hidden_size, active)


def dp_padded_micro_batches(samples: list[Sample], micro_batch_size: int, pad_id: int, fields=None,
                            dp_size: int = 1, dp_rank: int = 0) -> list:
    """This DP rank's padded micro-batches: the samples are cut into ``dp_size`` contiguous shares
    (sizes differing by at most one) and every share into the same number of micro-batches,
    ``ceil(smallest share / micro_batch_size)`` (so each rank runs as many micro-batches as the
    others; a micro-batch may then hold one sample more than micro_batch_size). dp_size 1 keeps
    split_micro_batches' consecutive micro_batch_size chunks. ``sample_indices`` index ``samples``.

    Raises:
        ValueError: fewer samples than DP ranks.
    """
    if dp_size == 1:
        return split_micro_batches(samples, micro_batch_size, pad_id, fields)
    if len(samples) < dp_size:
        raise ValueError(f"{len(samples)} samples cannot feed {dp_size} data-parallel ranks")
    bounds = [len(samples) * r // dp_size for r in range(dp_size + 1)]
    share = list(range(bounds[dp_rank], bounds[dp_rank + 1]))
    smallest = min(bounds[r + 1] - bounds[r] for r in range(dp_size))
    n_mb = math.ceil(smallest / micro_batch_size)
    out = []
    for chunk in np.array_split(np.array(share), n_mb):
        idx = [int(i) for i in chunk]
        sub = {k: [v[i] for i in idx] for k, v in (fields or {}).items()}
        out.append(make_micro_batch([samples[i] for i in idx], idx, pad_id, sub))
    return out


def build_micro_batches(ctx: RunContext, samples: list[Sample], fields=None) -> tuple[list, dict]:
    """This DP rank's micro-batches for ``samples`` (ALL samples of the update, identical on every
    rank): best-fit packed THD micro-batches balanced over DP ranks (train.pack, pp_size 1;
    moerl.parallel.packing), else padded micro-batches of about train.micro_batch_size samples from
    this rank's contiguous share (dp_padded_micro_batches). Returns (micro_batches, packing stats)."""
    tr = ctx.cfg.train
    dp_size, dp_rank = world.dp_info()
    if not tr.pack or ctx.cfg.parallel.pp_size > 1:
        return dp_padded_micro_batches(samples, tr.micro_batch_size, ctx.pad_id, fields, dp_size, dp_rank), {}
    plan = pack_micro_batches(
        [len(s.tokens) for s in samples], tr.max_tokens_per_micro_batch, dp_size=dp_size,
        max_seq_len=ctx.hf_config.max_position_embeddings, balance=tr.pack_balance,
        linear_coeff=flops_coeff(ctx.hf_config) if tr.pack_balance == "flops" else None,
    )
    multiple = ctx.cfg.parallel.tp_size if ctx.cfg.parallel.tp_size > 1 else 1
    mbs = split_packed_micro_batches(samples, plan.for_rank(dp_rank), ctx.pad_id, fields,
                                     pad_to_multiple_of=multiple)
    st = plan.stats()
    return mbs, {"pack_utilisation": st["utilisation"], "pack_utilisation_vs_bound": st["utilisation_vs_bound"],
                 "num_micro_batches": float(plan.num_micro_batches)}


def recompute_old_log_probs(cfg, n_updates: int, step: Optional[int] = None) -> bool:
    """Whether RL step ``step`` computes its old (proximal) log-probs in a pass of their own before the update
    (algorithm.recompute_old_log_probs; null = only where needed, see
    :func:`moerl.config.schema.old_log_probs_pass_reason`), or the update takes them from its own forward. A
    critic warm-up step (gae, step <= critic.warmup_steps) makes no policy update, so it keeps the pass (the
    train/rollout mismatch metrics come from it)."""
    from moerl.config.schema import old_log_probs_pass_reason

    setting = getattr(cfg.algorithm, "recompute_old_log_probs", None)
    warmup = (step is not None and cfg.algorithm.advantage_estimator == "gae"
              and step <= getattr(getattr(cfg, "critic", None), "warmup_steps", 0))
    return True if setting or warmup or old_log_probs_pass_reason(cfg, n_updates) else False


def attach_pre_update(ctx: RunContext, actor, ref, critic, samples, temperature: float, *, old: bool = True) -> None:
    """Before a step's updates, on every rank, into each sample's metadata: the proximal (old) log-probs under
    ``actor`` ("old_log_probs"; not computed with ``old`` False: the update then takes them from its own
    forward, :func:`recompute_old_log_probs`) and, for moe.routing_replay=r2, that pass's routing; the
    reference policy's log-probs ("ref_log_probs", ``ref`` not None) and the critic's values ("old_values",
    ``critic`` not None). One set of micro-batches serves every pass."""
    if not (old or ref is not None or critic is not None):
        return
    mbs = build_micro_batches(ctx, samples)[0]
    if old:
        _attach(samples, "old_log_probs", ((mb, lp) for mb, lp, _ in actor.compute_log_probs(mbs, temperature)))
        if ctx.cfg.moe.routing_replay == "r2":  # replay the old-log-prob pass's routing in the updates
            from moerl.moe.routing_replay import gather_recorded_routing

            gather_recorded_routing(actor.routing_replay, samples)
    if ref is not None:
        _attach(samples, "ref_log_probs", ((mb, lp) for mb, lp, _ in ref.compute_log_probs(mbs, temperature)))
    if critic is not None:
        _attach(samples, "old_values", zip(mbs, critic.compute_values(mbs)))


def _attach(samples, key: str, per_mb) -> list[list[float]]:
    """Scatter per-micro-batch [B,S] tensors (pairs (mb, tensor) of this DP rank) into one list per
    sample's response tokens, all-gather them over the ranks, store them in ``metadata[key]``."""
    out: list[Optional[list[float]]] = [None] * len(samples)
    for mb, t in per_mb:
        for i, resp in zip(mb.sample_indices, mb.gather_response(t)):
            out[i] = resp.tolist()
    if world.world_size() > 1:
        parts: list = [None] * world.world_size()
        torch.distributed.all_gather_object(parts, {i: v for i, v in enumerate(out) if v is not None})
        for part in parts:
            for i, v in part.items():
                if out[i] is None:
                    out[i] = v
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:  # pragma: no cover - would be a packing bug
        raise RuntimeError(f"no {key} were computed for samples {missing[:10]}")
    for s, v in zip(samples, out):
        s.metadata[key] = v
    return out

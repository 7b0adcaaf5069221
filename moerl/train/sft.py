"""The SFT warm start and the greedy held-out evaluation the main job runs around RL."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from moerl.runtime import world
from moerl.runtime.world import broadcast_from_main, log
from moerl.train.losses import sft_loss
from moerl.train.micro_batches import dp_padded_micro_batches, sft_samples
from moerl.train.rollout import evaluate_accuracy

if TYPE_CHECKING:  # annotations only (no import at run time)
    from moerl.train.setup import RunContext


def evaluate(ctx: RunContext, client, rows, manager=None) -> float:
    """Greedy accuracy on ``rows``, computed by rank 0 (which holds the client) and broadcast; with the RL
    ``manager`` (a RolloutManager), once its background weight push has landed (the servers hold the
    weights being evaluated)."""
    if manager is not None:
        manager.wait_weights()
    acc = None
    if client is not None:
        acc = evaluate_accuracy(
            client, rows, ctx.encode, ctx.decode, ctx.rewards,
            prompt_key=ctx.cfg.data.prompt_key, label_key=ctx.cfg.data.label_key,
            max_new_tokens=ctx.cfg.rollout.max_new_tokens, stop_token_ids=[ctx.eos_id],
        )
    return float(broadcast_from_main(acc))


def run_sft(ctx: RunContext, actor, client, sync, logger, state,
            samplers: dict, ckpt) -> None:
    """Warm start: supervised steps until greedy accuracy on sft.eval_prompts held-out prompts first
    reaches sft.target_accuracy (checked every sft.eval_every steps), or sft.max_steps. Continues
    from ``state.sft_step``; each DP rank trains on its contiguous share of every batch. With
    sft.warmup_steps w > 0, step s trains at lr ``sft.lr * min(1, s / w)`` (a function of the step alone,
    so a resumed run trains at the lr an uninterrupted one does)."""
    sft = ctx.cfg.sft
    eval_rows = ctx.eval_rows[: sft.eval_prompts]
    dp_size, dp_rank = world.dp_info()
    t_proc = time.time()
    t0 = t_proc - state.sft_seconds  # elapsed counts the SFT time of earlier (killed) runs too
    start = state.sft_step
    for step in range(start + 1, sft.max_steps + 1):
        samples = sft_samples(ctx, samplers["sft"].next_batch())
        mbs = dp_padded_micro_batches(samples, sft.micro_batch_size, ctx.pad_id, None, dp_size, dp_rank)
        n_tok = sum(sum(s.loss_mask) for s in samples)  # global denominator
        if sync.placement.trainer_offloaded:  # colocated, after a sync: servers release, trainer reloads
            sync.placement.before_train()
        if sft.warmup_steps:
            actor.set_step_lr(sft.lr * min(1.0, step / sft.warmup_steps))
        m = actor.train_step(mbs, sft_loss(n_tok), temperature=1.0)
        state.sft_step = step
        if step % sft.eval_every == 0 or step == sft.max_steps:
            sync(actor)
            acc = evaluate(ctx, client, eval_rows)
            state.sft_accuracy = acc
            rate = (step - start) / max(1e-9, time.time() - t_proc)
            mtp = {"sft/mtp_loss": m["mtp_loss"]} if "mtp_loss" in m else {}  # DeepSeek-V3 MTP layers (rank 0's)
            if logger is not None:
                logger.log(step, {"sft/loss": m["sft_loss"], "sft/eval_accuracy": acc, "sft/grad_norm": m["grad_norm"],
                                  **mtp})
            log(f"sft step {step}/{sft.max_steps} loss {m['sft_loss']:.4f}"
                + (f" mtp_loss {m['mtp_loss']:.4f}" if mtp else "") + f" greedy acc {acc:.3f} "
                f"({rate:.1f} steps/s, elapsed {time.time() - t0:.0f}s, target {sft.target_accuracy})")
            state.sft_done = acc >= sft.target_accuracy or step == sft.max_steps
        state.sft_seconds = time.time() - t0
        ckpt(step)
        if state.sft_done:
            break
    state.sft_done = True

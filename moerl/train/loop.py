"""The RL loop: rollout -> reward -> advantages -> log-probs -> update -> weight sync -> log.

``train.mode`` only changes *when* rollouts run, never what a step does: the RolloutManager
(moerl.rollout.manager) produces scored groups (sync: when the step asks; one_step_off: the next batch
while this one trains; async: continuously, weight updates landing in flight) under the
``train.max_staleness`` bound, and every step below is the same in every mode.

Single process or under torchrun (any TP/PP/EP/DP layout the recipe allows): global rank 0 alone runs
the servers and the manager and broadcasts each batch (and every eval / early-stop decision); every DP
rank trains its share with global loss denominators; weight export is collective, rank 0 pushes.
Checkpoints and resume: moerl.checkpoint.run_state; batch assembly: moerl.train.micro_batches; the
warm start and reference policy: moerl.train.components.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

from moerl.algorithms.off_policy import rollout_mismatch_metrics
from moerl.checkpoint.hf_io import save_hf_checkpoint
from moerl.checkpoint.run_state import Checkpointer, TrainState, load_checkpoint, resolve_resume
from moerl.moe.routing_replay import RoutingReplay
from moerl.observe.metrics import MetricsLogger, perf_line
from moerl.observe.profiling import StepMonitor
from moerl.observe.report import step0_check, step0_logprob_tolerance, step_line
from moerl.rollout.client import RolloutClient
from moerl.runtime import world
from moerl.runtime.distributed import destroy_distributed, init_distributed
from moerl.runtime.world import broadcast_from_main, log
from moerl.train.advantages import needs_token_advantages, outcome_advantages, shape_rewards, token_advantages
from moerl.train.components import (build_actor, build_critic, build_reference, export_final, frozen_gc,
                                    reset_reference, reward_pool, rollout_manager, rollout_servers,
                                    train_critic, warm_page_pool, warm_start)
from moerl.train.losses import policy_loss, update_mismatch_metrics
from moerl.train.micro_batches import attach_pre_update, build_micro_batches, recompute_old_log_probs
from moerl.train.setup import prepare_run
from moerl.train.sft import evaluate
from moerl.train.stop_rule import first_rl_step, should_stop
from moerl.train.weight_sync import WeightSync, rollout_weights


def train(cfg) -> dict:
    """Run the main job for a validated RecipeConfig; returns the final summary dict (also written
    to <output_dir>/summary.json by rank 0). Works in one process and under torchrun."""
    t_start = time.time()
    if cfg.train.cpu_affinity:  # emulate a trainer device (rollout.cpu_affinity pins the servers)
        os.sched_setaffinity(0, set(cfg.train.cpu_affinity))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    dist = init_distributed(tp_size=cfg.parallel.tp_size, pp_size=cfg.parallel.pp_size, ep_size=cfg.parallel.ep_size,
                            etp_size=cfg.parallel.etp_size, seed=cfg.seed,
                            num_threads=max(1, cfg.train.num_threads // local_world))
    world.set_main(dist.is_main)
    try:
        return _train(prepare_run(cfg, dist), t_start)
    finally:
        destroy_distributed()
        world.set_main(True)


def _train(ctx, t_start: float) -> dict:
    cfg, ro, main = ctx.cfg, ctx.cfg.rollout, world.is_main()
    if not cfg.sft.enabled and ctx.init_hf_state_dict is None:
        log("WARNING: sft.enabled=false and no model.init_from: RL starts from a RANDOM model, which cannot "
            "learn the task by RL alone (rewards stay ~0); set model.init_from=<HF dir> or sft.enabled=true")
    actor, telemetry, pkw = build_actor(ctx)
    v0 = ctx.run_dir / "weights" / "init"
    init_sd = actor.export_hf_state_dict(dst=0)
    if main:
        save_hf_checkpoint(*rollout_weights(ro, init_sd, ctx.hf_config), v0, tokenizer=ctx.tokenizer)
    resume_path = broadcast_from_main(resolve_resume(cfg, ctx.run_dir) if main else None)
    timers = StepMonitor(cfg, ctx.run_dir)  # + profiler/NVTX ranges, memory, FLOPs/MFU (moerl.observe.profiling)
    state = TrainState(phase="sft" if cfg.sft.enabled else "rl", sft_done=not cfg.sft.enabled, summary={"seed": cfg.seed})
    if resume_path is not None:
        state = load_checkpoint(ctx, actor, Path(resume_path))
        log(f"RESUME from {resume_path}: phase {state.phase}, sft step {state.sft_step}, rl step {state.rl_step}")
    samplers = {"sft": ctx.make_sampler(ctx.train_ds, cfg.sft.global_batch_size, cfg.seed + 1),
                "rl": ctx.make_sampler(ctx.train_ds, ro.rollout_batch_size, cfg.seed)}
    for name, st in state.samplers.items():
        samplers[name].load_state_dict(st)
    logger = MetricsLogger(ctx.run_dir / "tensorboard", tensorboard=cfg.log.tensorboard,
                           wandb_project=cfg.log.wandb_project) if main else None
    ckpt = Checkpointer(ctx, actor, state, samplers, timers)
    node_cm, cluster_cm = rollout_servers(ctx, str(v0))
    with node_cm, cluster_cm as cluster, reward_pool(ctx) as ctx.rewards:  # reward workers on rank 0
        client = None
        if cluster is not None:
            client = RolloutClient(cluster.router_url, timeout_s=ro.request_timeout_s, max_retries=ro.max_retries,
                                   cluster=cluster)
            log(f"rollout: {ro.num_servers} servers {cluster.server_urls} behind sglang-router {cluster.router_url}")
        if world.world_size() > 1:
            log(f"trainer: {world.world_size()} ranks, tp {cfg.parallel.tp_size} pp {cfg.parallel.pp_size} ep "
                f"{cfg.parallel.ep_size} dp {world.dp_info()[0]}")
        sync = WeightSync(ctx, cluster, version=state.weight_version)
        sync.offload_with(actor)
        ckpt.loaded = sync.trainer_loaded
        if resume_path is not None:
            sync.republish(actor)  # the fresh servers hold the initial weights
        resumed_rl = resume_path is not None and state.phase == "rl" and state.rl_step > 0
        warm_start(ctx, actor, client, sync, logger, state, samplers, ckpt, resumed=resume_path is not None)
        ref = build_reference(ctx, actor, sync, pkw, resumed_rl, init_sd, rl_step=state.rl_step)
        ckpt.critic = critic = build_critic(ctx, actor, sync, pkw, resume_path if resumed_rl else None)  # gae
        eval_rows = ctx.eval_rows[: cfg.eval.num_prompts]
        manager = rollout_manager(ctx, cluster, samplers["rl"], sync, state)  # rank 0 only (else None)

        def save_cursor() -> None:
            state.weight_version = sync.version
            if manager is not None:
                state.rollout = manager.state_dict()

        ckpt.before_save = save_cursor
        t_rl, first = time.time(), first_rl_step(cfg, state.summary, state.rl_step + 1)  # eval.stop_at_gain
        metrics: dict = {}
        if telemetry is not None:
            telemetry.enabled = True
        if cfg.moe.routing_replay != "none":  # R2/R3 in the RL passes only (not SFT)
            actor.routing_replay = RoutingReplay(actor.model, cfg.moe.routing_replay)
        warm_page_pool(cfg.train)  # train.warm_memory_mb; train.freeze_gc: start-up state out of the GC's walks
        with frozen_gc(ctx, cluster), (manager if manager is not None else contextlib.nullcontext()):
            for step in timers.steps(first, cfg.train.num_steps):  # step clock, profile.steps
                metrics = rl_step(ctx, step, actor, ref, manager, sync, timers, critic)
                state.rl_step, state.weight_version = step, sync.version
                if telemetry is not None:  # collective: every rank
                    metrics.update({f"moe/{k}": v for k, v in telemetry.step_end(step)["metrics"].items()})
                # the step-0 checks need an update: the first step whose groups carried a reward signal
                if "step0_check" not in state.summary and "train/logratio_abs_sum" in metrics:
                    state.summary["step0_check"] = dict(step0_check(metrics, step0_logprob_tolerance(cfg)), step=step)
                    state.summary["first_step_metrics"] = {k: float(v) for k, v in metrics.items()}
                if step < cfg.train.num_steps:
                    ckpt(step)
                if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or step == cfg.train.num_steps:
                    with timers("eval"):
                        metrics["eval/accuracy"] = acc_rl = evaluate(ctx, client, eval_rows, manager)
                stop = should_stop(cfg, step, metrics, state.summary)  # eval.stop_at_gain, same on every rank
                metrics.update(timers.end(step, metrics))  # time/, memory/, perf/, straggler/ (collective)
                if logger is not None:
                    logger.log(step, metrics)
                eta = (time.time() - t_rl) / (step - first + 1) * (cfg.train.num_steps - step)
                log(step_line(step, cfg.train.num_steps, metrics, eta) + perf_line(metrics))
                if stop:
                    break
            if "eval/accuracy" not in metrics:  # the last step's eval already measured these weights
                acc_rl = evaluate(ctx, client, eval_rows, manager)
            if "stopped_at_step" not in state.summary:
                state.rl_step = max(state.rl_step, cfg.train.num_steps)
            ckpt(state.rl_step, force=True)
    if telemetry is not None:
        telemetry.close()
    summary = state.summary
    summary["accuracy_after_rl"] = acc_rl
    log(f"EVAL after RL: greedy accuracy {acc_rl:.4f} on {len(eval_rows)} held-out prompts (after warm start "
        f"{summary['accuracy_after_warm_start']:.4f}, change {100 * (acc_rl - summary['accuracy_after_warm_start']):+.1f} points)")
    export_final(ctx, actor, critic, sync)  # hf_export (and hf_critic), collective
    summary["total_seconds"] = time.time() - t_start
    if resume_path is not None:
        summary["resumed_from"] = str(resume_path)
    if main:
        (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.close()
    log(f"done in {summary['total_seconds']:.0f}s; Megatron checkpoint in {ctx.run_dir / 'checkpoints'}, "
        f"HF export in {ctx.run_dir / 'hf_export'}")
    return summary


def rl_step(ctx, step: int, actor, ref, manager, sync, timers, critic=None) -> dict:
    """One RL step on every rank: take the step's batch, advantages, old (and reference) log-probs and
    values, the critic and policy update(s), the weight push (wrapped by the manager: pause / drain /
    continue)."""
    cfg, algo, ro = ctx.cfg, ctx.cfg.algorithm, ctx.cfg.rollout
    with timers("rollout"):  # the trainer waits for this step's groups (generated and scored)
        batch = broadcast_from_main(manager.get_batch(step) if manager is not None else None)
    m = dict(batch.metrics)
    m.update(shape_rewards(ctx, batch.samples))  # DAPO overlong punishment (algorithm.overlong_buffer_len)
    kept, adv_m = outcome_advantages(ctx, batch.samples)  # grpo | dr_grpo | rloo; uniform groups filtered
    m.update(adv_m)
    if cfg.log.samples and world.is_main():
        batch.write_jsonl(ctx.run_dir / "samples.jsonl", step)
    if len(kept) < world.dp_info()[0]:  # nothing (or too little) to share over the DP ranks
        m["skipped_update"] = 1.0
        log(f"step {step}: no update: {len(kept)} of {len(batch.samples)} samples carry a learning signal (groups with "
            "equal rewards are dropped by algorithm.filter_uniform_groups; rollout.dynamic_sampling draws more)")
        _push(manager, sync, step)
        return m
    n_updates = max(1, int(m["num_samples"]) // cfg.train.global_batch_size)  # one per global batch
    chunk = math.ceil(len(kept) / n_updates)
    parts = [p for p in (kept[lo: lo + chunk] for lo in range(0, len(kept), chunk)) if len(p) >= world.dp_info()[0]]
    sync.placement.before_train()  # colocated: the servers release their memory before training
    old = recompute_old_log_probs(cfg, len(parts), step)  # else one update from these weights: its own forward
    with timers("log_prob"):  # proximal (old) + reference log-probs, critic values, before any update
        for part in parts:
            timers.count("logprob", ctx.hf_config, part, passes=old + (ref is not None))  # model FLOPs (MFU)
            attach_pre_update(ctx, actor, ref, critic, part, ro.temperature, old=old)
    flat = [s for p in parts for s in p]  # per token: reinforce++, gae, whitening
    m.update(token_advantages(ctx, flat, [s.metadata["old_values"] for s in flat] if critic else None))
    if old:  # lp_diff, mismatch KL (else from the update's forward, see policy_loss)
        m.update(rollout_mismatch_metrics([s.metadata["old_log_probs"] for s in flat],
                                          [s.rollout_log_probs for s in flat]))
    with timers("update"):
        for part in parts:
            if critic is not None:
                m.update(train_critic(ctx, critic, part, step))
                if step <= cfg.critic.warmup_steps:  # critic warm-up: the policy waits
                    continue
            fields = {"behaviour_log_probs": [s.rollout_log_probs for s in part],
                      "token_staleness": [[float(batch.trainer_version - v) for v in s.token_versions]
                                          or [0.0] * len(s.response_ids) for s in part]}
            if old:
                fields["old_log_probs"] = [s.metadata["old_log_probs"] for s in part]
            if ref is not None:
                fields["ref_log_probs"] = [s.metadata["ref_log_probs"] for s in part]
            if needs_token_advantages(algo):
                fields["token_advantages"] = [s.metadata["token_advantages"] for s in part]
            mbs, pack_stats = build_micro_batches(ctx, part, fields)
            m.update({f"train/{k}": v for k, v in pack_stats.items()})
            loss_fn = policy_loss(algo, global_num_tokens=max(1, sum(sum(s.loss_mask) for s in part)),
                                  global_num_seqs=len(part), seq_token_sum_constant=float(ro.max_new_tokens),
                                  max_staleness=cfg.train.max_staleness if cfg.train.mode != "sync" else 0)
            out = actor.train_step(mbs, loss_fn, temperature=ro.temperature)
            timers.count("update", ctx.hf_config, part)
            # the step-0 check reads the FIRST update's ratio (later ones follow an optimizer step)
            first = m.get("train/logratio_abs_sum", out.get("logratio_abs_sum"))
            m.update({f"train/{k}": v for k, v in out.items()}, **{"train/logratio_abs_sum": first})
            if not old:  # lp_diff, mismatch KL from the update's own forward
                m.update(update_mismatch_metrics(m))
    if ref is not None and algo.reference_reset_every and step % algo.reference_reset_every == 0:
        reset_reference(ctx, actor, ref, sync, step)  # the KL anchor moves to the current policy
    with timers("weight_sync"):
        _push(manager, sync, step, actor)
    if sync.offloader is not None:  # colocated: bytes moved to host / back this step
        m["train/offload_bytes"] = float(sync.offloader.last_offload_bytes)
        m["train/reload_bytes"] = float(sync.offloader.last_reload_bytes)
    return m


def _push(manager, sync, step: int, actor=None) -> None:
    """The weight update after ``step`` (none: ``actor`` None, the update was skipped). Every rank joins the
    collective export; rank 0's manager pushes it (pause / drain, push, continue), on a background thread
    with rollout.background_push, after the previous push has landed (the export may reuse its memory)."""
    if manager is not None:
        manager.wait_weights()
    push = sync.export(actor) if actor is not None else None
    if manager is not None:
        manager.update_weights(push, step, version=sync.version)
    elif push is not None:
        push()

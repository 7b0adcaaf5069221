"""The pieces the main job assembles before RL: the Megatron actor (and MoE telemetry), the rollout
servers, the warm-start phase and the frozen reference policy. Each is one function so that
moerl.train.loop reads like the algorithm."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

from moerl.checkpoint.hf_io import load_hf_state_dict, save_hf_checkpoint
from moerl.models.dtypes import rollout_serving_dtype
from moerl.moe.config import moe_actor_kwargs
from moerl.moe.telemetry import MoETelemetry
from moerl.rollout.sglang_launcher import launch_reference_rollout, launch_sglang_rollout, resolve_host
from moerl.runtime import world
from moerl.runtime.procs import pinned  # noqa: F401 - re-exported (moerl.train.components.pinned)
from moerl.runtime.world import broadcast_from_main, log
from moerl.train.actor import MegatronActor, actor_parallel_kwargs
from moerl.train.sft import evaluate, run_sft


def actor_kwargs(cfg, mk: dict) -> dict:
    """MegatronActor keyword arguments of the recipe's parallel layout, pipeline keys and the Megatron
    config overrides of ``mk`` (moerl.moe.config.moe_actor_kwargs)."""
    pkw = actor_parallel_kwargs(cfg.parallel)
    pkw["config_overrides"] = {**pkw.get("config_overrides", {}), **mk["config_overrides"]}
    from moerl.precision.te_fp8 import fp8_transformer_config_kwargs  # precision.fp8 (Transformer Engine)

    pkw["config_overrides"].update(fp8_transformer_config_kwargs(cfg.precision,
                                                                 num_experts=cfg.model.hf_config.num_experts))
    from moerl.models.gpt import resolve_layer_spec  # model.layer_spec -> Megatron's transformer_impl

    pkw["config_overrides"]["transformer_impl"] = resolve_layer_spec(cfg.model.layer_spec)
    pkw["pipeline_schedule"] = cfg.train.pipeline_schedule  # 1f1b | dualpipe | dualpipev (moerl.pipeline)
    pkw["pipeline_overlap"] = cfg.train.pipeline_overlap  # F&B on two CUDA streams (moerl.pipeline.overlap)
    pkw["split_backward"] = cfg.train.split_backward  # B/W split of DualPipe(V) (moerl.pipeline.wgrad_store)
    pkw["params_dtype"] = cfg.model.params_dtype  # float32 | bfloat16 (Megatron mixed precision)
    pkw["fused_logprob"] = cfg.train.fused_logprob  # log-probs from hidden states (moerl.kernels.fused_logprob)
    return pkw


def export_dtype(cfg):
    """The torch dtype of the run's HF exports (model.export_dtype, else model.params_dtype)."""
    from moerl.models.dtypes import export_torch_dtype

    return export_torch_dtype(cfg.model.export_dtype, cfg.model.params_dtype)


def build_actor(ctx) -> tuple[MegatronActor, Optional[MoETelemetry], dict]:
    """The trainable policy (init_from weights loaded when given), its expert-load telemetry (RL update
    passes only; None with moe.telemetry=false) and the actor kwargs (for the reference policy)."""
    cfg = ctx.cfg
    mk = moe_actor_kwargs(cfg)  # balancing loss, z-loss, expert bias, routing, dispatcher (recipe keys)
    pkw = actor_kwargs(cfg, mk)
    actor = MegatronActor(
        ctx.hf_config, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, adam_beta1=cfg.train.adam_beta1,
        adam_beta2=cfg.train.adam_beta2, clip_grad=cfg.train.clip_grad,
        moe_aux_loss_coeff=mk["moe_aux_loss_coeff"], moe_load_balancing_type=mk["moe_load_balancing_type"], **pkw,
    )
    actor.entropy_grad = cfg.algorithm.entropy_coef > 0  # the entropy bonus needs the entropy's gradient
    telemetry = None
    if cfg.moe.telemetry:
        telemetry = MoETelemetry(
            actor.model, jsonl_path=str(ctx.run_dir / "moe_telemetry.jsonl") if world.is_main() else None,
            entropy_threshold=cfg.moe.entropy_threshold, dead_expert_steps=cfg.moe.dead_expert_steps, enabled=False,
        )
    if ctx.init_hf_state_dict is not None:
        actor.load_hf_state_dict(ctx.init_hf_state_dict)
    return actor, telemetry, pkw


def rollout_servers(ctx, model_path: str):
    """(node context, cluster context): entering them starts this job's rollout servers behind
    sglang-router: reference servers (rollout.num_servers per node) or real SGLang, started by local rank 0
    of every node (a collective under torchrun). The cluster context yields the RolloutCluster on rank 0,
    None elsewhere; the node context holds another node's servers (moerl.rollout.sglang_launcher)."""
    cfg, ro = ctx.cfg, ctx.cfg.rollout
    cluster_cm = node_cm = contextlib.nullcontext(None)
    if ro.backend == "sglang":  # collective: local rank 0 of every node starts its node's servers
        launched = launch_sglang_rollout(
            model_path, rollout_gpu_ids=ro.gpu_ids, router_port=ro.router_port, base_port=ro.base_port, host=ro.host,
            tp_size=ro.server_tp_size, dp_size=ro.server_dp_size, ep_size=ro.server_ep_size,
            mem_fraction_static=ro.mem_fraction_static, colocated=ro.placement == "colocated",
            external_urls=ro.external_urls, log_dir=str(ctx.run_dir / "logs"), router_policy=ro.router_policy,
            failover=ro.failover, startup_timeout_s=ro.startup_timeout_s, random_seed=cfg.seed,
            return_routed_experts=cfg.moe.routing_replay == "r3", dtype=rollout_serving_dtype(ro))
        if world.is_main():
            cluster_cm = launched
        elif launched is not None:
            node_cm = launched
    else:  # collective under torchrun: rollout.num_servers reference servers on every node (one node: rank 0's)
        launched = launch_reference_rollout(
            model_path, num_servers=ro.num_servers, host=resolve_host(ro.host), base_port=ro.base_port,
            router_port=ro.router_port, router_policy=ro.router_policy, threads_per_server=ro.threads_per_server,
            startup_timeout_s=ro.startup_timeout_s, log_dir=str(ctx.run_dir / "logs"),
            failover=ro.failover, max_restarts=ro.max_restarts, external_urls=ro.external_urls,
            dtype=rollout_serving_dtype(ro),
        )
        if world.is_main():
            cluster_cm = launched
        elif launched is not None:
            node_cm = launched
    if ro.cpu_affinity:
        cluster_cm, node_cm = pinned_start(cluster_cm, ro.cpu_affinity), pinned_start(node_cm, ro.cpu_affinity)
    return node_cm, cluster_cm


def rollout_manager(ctx, cluster, sampler, sync, state):
    """The RolloutManager of rank 0 (None on other ranks, where ``cluster`` is None): its own RolloutClient
    (the producer runs its own event loop), resumed from ``state.rollout``; routing recorded for R3. With
    rollout.producer_process (null: in one_step_off / async) a moerl.rollout.producer_process
    .RolloutManagerProcess: the same manager in a child process (rollout.producer_cpu_affinity; null: the trainer's cores)."""
    if cluster is None:
        return None
    from moerl.config.schema import async_keys_without_effect, producer_in_process
    from moerl.rollout.client import RolloutClient
    from moerl.rollout.manager import RolloutManager

    cfg, ro = ctx.cfg, ctx.cfg.rollout
    for note in async_keys_without_effect(cfg):
        log(note)
    routing_shape = ((ctx.hf_config.num_hidden_layers, ctx.hf_config.num_experts_per_tok)
                     if cfg.moe.routing_replay == "r3" else None)
    common = dict(eos_id=ctx.eos_id, num_steps=cfg.train.num_steps, version=sync.version, steps_done=state.rl_step,
                  state=state.rollout or None, routing_shape=routing_shape)
    if producer_in_process(cfg):  # rollout.producer_process: the whole producer in a child process
        from moerl.rollout.producer_process import RolloutManagerProcess

        spec = dict(common, router_url=cluster.router_url, timeout_s=ro.request_timeout_s, max_retries=ro.max_retries,
                    cfg=cfg, sampler=sampler, tokenizer=ctx.tokenizer, system_prompt=cfg.data.system_prompt,
                    reward_cpu_affinity=list(ro.cpu_affinity))
        return RolloutManagerProcess(cluster=cluster, spec=spec, cpu_affinity=ro.producer_cpu_affinity or (), log=log)
    return RolloutManager(
        client=RolloutClient(cluster.router_url, timeout_s=ro.request_timeout_s, max_retries=ro.max_retries,
                             cluster=cluster),
        cluster=cluster, sampler=sampler, encode=ctx.encode, decode=ctx.decode, reward_fn=ctx.rewards, cfg=cfg,
        log=log, **common)


@contextlib.contextmanager
def frozen_gc(ctx, cluster):
    """train.freeze_gc, around the RL loop: on entry ``gc.collect()`` + ``gc.freeze()`` in this process (every
    rank) and, on rank 0, SGLang's POST /freeze_gc on the rollout servers moerl started (best effort: a
    server that refuses is named in a warning); on exit ``gc.unfreeze()`` in this process (the servers end
    with the run). Objects alive at entry (model, optimizer, tokenizer, start-up state) are not walked by
    the cyclic collector meanwhile; reference counting still frees them (only a reference cycle among them
    that becomes garbage waits for the exit)."""
    if not ctx.cfg.train.freeze_gc:
        yield
        return
    import gc

    if cluster is not None:
        for url, why in cluster.freeze_gc().items():
            if why:
                log(f"WARNING: POST {url}/freeze_gc failed ({why}); that server's garbage collector keeps walking "
                    "all its objects (train.freeze_gc)")
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def warm_page_pool(train_cfg, on_cpu: Optional[bool] = None) -> int:
    """train.warm_memory_mb: touch that many MiB of fresh anonymous memory (one write per 4 KiB page of an
    ``mmap``) and unmap it again, before RL starts; returns the MiB touched (0 = off: GPU training, sync
    mode by default, or 0 given). Every trainer process calls it (the loop, before the rollout producer
    starts).

    Why (measured, ``tools/bench_async.py``, 2026-12-05, a 2-core Firecracker VM): on some stretches of
    the VM a minor page fault of the trainer cost 30-40 us while the rollout core was busy (async: the
    server generates during the update) against ~2.5 us in sync, so the async update stalled 0.1-0.65 s
    at the steps where the trainer's memory grew (23,000 faults at step 1, 2,000-7,000 at a few later
    steps: 0.76-0.84 s first updates, 0.3-0.47 s at step 8, against 0.10-0.15 s). After touching and
    freeing 512 MiB first, the same faults cost about as much as in sync (step 1 0.14-0.19 s, step 8
    0.13-0.15 s) in 6 of 6 runs (4 with the memory kept in the heap, 2 touched and unmapped as here), with
    the same number of faults. Our reading: the pages the guest kernel then hands out are ones the host
    already backs (the VM returns free guest memory to its host). Harmless elsewhere: 0.1-0.45 s once,
    nothing kept. GPU training has no such host faults in its steps (activations live on the device).

    A speed-up only, so it never fails the run: at most a quarter of the memory available now
    (``MemAvailable`` of /proc/meminfo, when readable) is touched, and a mapping the system refuses is
    skipped; both with a warning naming the key."""
    import mmap

    import torch

    mb = train_cfg.warm_memory_mb
    if mb is None:
        mb = 512 if train_cfg.mode != "sync" else 0
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    if not mb or not on_cpu:
        return 0
    mb = int(mb)
    avail = _available_mib()
    if avail is not None and mb > avail // 4:
        log(f"WARNING: train.warm_memory_mb={mb} is more than a quarter of the memory available now ({avail} MiB): "
            f"touching {avail // 4} MiB")
        mb = avail // 4
    try:
        with mmap.mmap(-1, mb << 20) as m:
            for i in range(0, len(m), mmap.PAGESIZE):
                m[i] = 1
    except (OSError, ValueError) as e:
        log(f"WARNING: train.warm_memory_mb={mb}: could not map that much memory ({e}); skipped")
        return 0
    return mb


def _available_mib() -> Optional[int]:
    """MemAvailable of /proc/meminfo in MiB, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reward_pool(ctx):
    """Context manager of the run's RewardPool (moerl.rewards.pool; reward.* keys): worker processes on
    global rank 0, which scores every rollout and evaluation; None on the other ranks. With
    reward.pool_process (null: in train.mode one_step_off / async) the pool runs in a child process, a
    moerl.rewards.RewardBroker with the same API."""
    if not world.is_main():
        return contextlib.nullcontext(None)
    from moerl.rewards import RewardBroker, RewardPool, reward_pool_from_config

    r = ctx.cfg.reward
    use = r.pool_process
    if use is None:
        use = ctx.cfg.train.mode != "sync" and r.num_workers > 0
    cls = RewardBroker if use else RewardPool
    # started on the rollout cores (rollout.cpu_affinity): the workers and the broker process are rollout-side
    # host work, kept off an emulated training device; the pool's threads in this process stay on its cores
    with pinned(ctx.cfg.rollout.cpu_affinity):
        return reward_pool_from_config(r, cls, log=log)


@contextlib.contextmanager
def pinned_start(cm, cores: list[int]):
    """Enter ``cm`` (which starts server processes) with this process pinned to ``cores``, so the
    processes it starts inherit that CPU affinity (rollout.cpu_affinity), then restore this process's
    own affinity (and its threads', see :func:`pinned`). A RolloutCluster keeps the cores for a server that
    failover restarts later."""
    with contextlib.ExitStack() as stack:
        with pinned(cores):
            entered = stack.enter_context(cm)
        yield entered


def warm_start(ctx, actor, client, sync, logger, state, samplers, ckpt, resumed: bool) -> None:
    """The SFT warm start (unless done or disabled), its HF export, and the greedy evaluation RL starts
    from (state.summary["accuracy_after_warm_start"]); leaves the actor with RL's learning rate and fresh
    Adam moments, and ``state.phase == "rl"``."""
    cfg = ctx.cfg
    eval_rows = ctx.eval_rows[: cfg.eval.num_prompts]
    if state.phase == "sft":
        if not state.sft_done:
            if not resumed:
                actor.set_lr(cfg.sft.lr)  # else load_checkpoint rebuilt it and loaded its state
            run_sft(ctx, actor, client, sync, logger, state, samplers, ckpt)
        state.summary.update({"sft_steps": state.sft_step, "sft_seconds": state.sft_seconds,
                              "sft_accuracy": state.sft_accuracy})
        warm = ctx.run_dir / "hf_warm_start"
        with sync.trainer_loaded():
            warm_sd = actor.export_hf_state_dict(dst=0)
        if world.is_main():
            save_hf_checkpoint(warm_sd, ctx.hf_config, warm, tokenizer=ctx.tokenizer, dtype=export_dtype(cfg))
        log(f"warm-start weights saved to {warm} (reuse with model.init_from={warm} sft.enabled=false)")
    if state.phase == "sft" or "accuracy_after_warm_start" not in state.summary:
        sync(actor)
        acc = evaluate(ctx, client, eval_rows)
        state.summary["accuracy_after_warm_start"] = acc
        log(f"EVAL after warm start: greedy accuracy {acc:.4f} on {len(eval_rows)} held-out prompts")
        if logger is not None:
            logger.log(0, {"eval/accuracy": acc})
        state.phase = "rl"
        with sync.trainer_loaded():
            actor.set_lr(cfg.train.lr)  # fresh Adam moments for RL
    state.phase = "rl"


def _reference_resets(ctx) -> list[tuple[int, Path]]:
    """(step, dir) of the reference policies saved by :func:`reset_reference`, oldest first."""
    root = ctx.run_dir / "reference_resets"
    found = [(int(d.name.split("_")[-1]), d) for d in root.glob("step_*") if (d / "config.json").is_file()]
    return sorted(found)


def reset_reference(ctx, actor, ref, sync, step: int) -> None:
    """algorithm.reference_reset_every: the reference policy becomes the current policy (collective).
    Rank 0 also saves it as HF weights (<output_dir>/reference_resets/step_N) so that a resume rebuilds
    the reference of its step."""
    with sync.trainer_loaded():  # colocated: the reference's weights are offloaded with the actor's
        sd = actor.export_hf_state_dict()
        ref.load_hf_state_dict(sd)
    if world.is_main():
        save_hf_checkpoint(sd, ctx.hf_config, ctx.run_dir / "reference_resets" / f"step_{step}")
    log(f"reference policy reset to the policy of step {step} (algorithm.reference_reset_every)")


def build_reference(ctx, actor, sync, pkw: dict, resumed_rl: bool, init_sd,
                    rl_step: int = 0) -> Optional[MegatronActor]:
    """The frozen policy RL starts from (KL logged, in the loss when algorithm.kl_coef > 0), or None.
    On a resume inside RL it is rebuilt from the newest reference reset at or before ``rl_step``
    (algorithm.reference_reset_every), else the warm-start export (or the init weights)."""
    cfg = ctx.cfg
    if not (cfg.algorithm.kl_coef > 0 or cfg.algorithm.reference_policy):
        return None
    ref = MegatronActor(ctx.hf_config, trainable=False, **pkw)
    resets = broadcast_from_main([str(d) for k, d in _reference_resets(ctx) if k <= rl_step] if world.is_main() else None)
    if resumed_rl and cfg.algorithm.reference_reset_every and resets:
        ref_sd = load_hf_state_dict(resets[-1])
    elif resumed_rl:
        ref_sd = (load_hf_state_dict(str(ctx.run_dir / "hf_warm_start")) if cfg.sft.enabled
                  else broadcast_from_main(init_sd if world.is_main() else None))
    else:
        with sync.trainer_loaded():
            ref_sd = actor.export_hf_state_dict()
    ref.load_hf_state_dict(ref_sd)
    sync.offload_with(ref, include_optimizer=False)  # weights only
    return ref


def build_critic(ctx, actor, sync, pkw: dict, resume_path):
    """The value model of algorithm.advantage_estimator=gae (moerl.train.critic.MegatronCritic: the
    policy's architecture with a zero-initialised scalar head and its own Adam, critic.* keys), None for
    the other estimators. Initialised from the policy's weights at the start of RL; on a resume inside RL
    it is loaded from the checkpoint's ``critic`` directory."""
    cfg = ctx.cfg
    if cfg.algorithm.advantage_estimator != "gae":
        return None
    from moerl.train.critic import MegatronCritic

    mk = moe_actor_kwargs(cfg)
    # the value model trains in FP32 whatever model.params_dtype says (its own DDP/optimizer set-up) and
    # runs 1F1B only (no DualPipe B/W split)
    ckw = {k: v for k, v in pkw.items() if k not in ("params_dtype", "split_backward", "fused_logprob")}
    critic = MegatronCritic(ctx.hf_config, lr=cfg.critic.lr, weight_decay=cfg.critic.weight_decay,
                            clip_grad=cfg.critic.clip_grad, adam_beta1=cfg.train.adam_beta1,
                            adam_beta2=cfg.train.adam_beta2, moe_aux_loss_coeff=mk["moe_aux_loss_coeff"],
                            moe_load_balancing_type=mk["moe_load_balancing_type"], **ckw)
    with sync.trainer_loaded():
        critic.load_hf_state_dict(actor.export_hf_state_dict())
    if resume_path is not None and (Path(resume_path) / "critic").is_dir():
        from moerl.checkpoint.run_state import layout, saved_layout

        critic.load(Path(resume_path) / "critic", load_optimizer=saved_layout(resume_path) == layout(cfg))
        log(f"critic restored from {Path(resume_path) / 'critic'}")
    sync.offload_with(critic)
    return critic


def train_critic(ctx, critic, part, step: int) -> dict:
    """One critic update on ``part`` (samples with metadata "old_values" and "returns"): the clipped
    value loss of moerl.train.losses.critic_loss. Returns metrics prefixed critic/."""
    from moerl.train.losses import critic_loss
    from moerl.train.micro_batches import build_micro_batches

    fields = {k: [s.metadata[k] for s in part] for k in ("old_values", "returns")}
    mbs, _ = build_micro_batches(ctx, part, fields)
    loss_fn = critic_loss(ctx.cfg.algorithm, global_num_tokens=max(1, sum(sum(s.loss_mask) for s in part)),
                          global_num_seqs=len(part), seq_token_sum_constant=float(ctx.cfg.rollout.max_new_tokens))
    return {f"critic/{k}": v for k, v in critic.train_step(mbs, loss_fn).items()}


def export_final(ctx, actor, critic, sync) -> None:
    """Collective: the trained policy as HF weights in <output_dir>/hf_export (with the tokenizer), and
    the critic (gae) as transformers' Qwen3MoeForTokenClassification (num_labels=1) in hf_critic, in
    model.export_dtype (default model.params_dtype; config.json's dtype says which)."""
    with sync.trainer_loaded():
        final_sd = actor.export_hf_state_dict(dst=0)
        critic_sd = critic.export_hf_state_dict(dst=0) if critic is not None else None
    if world.is_main():
        dtype = export_dtype(ctx.cfg)  # model.export_dtype (default: model.params_dtype)
        save_hf_checkpoint(final_sd, ctx.hf_config, ctx.run_dir / "hf_export", tokenizer=ctx.tokenizer, dtype=dtype)
        if critic_sd is not None:
            from moerl.models.value_head import value_model_hf_config

            save_hf_checkpoint(critic_sd, value_model_hf_config(ctx.hf_config), ctx.run_dir / "hf_critic",
                               dtype=dtype)

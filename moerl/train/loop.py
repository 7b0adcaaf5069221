"""The synchronous RL loop: SFT warm start, then rollout -> reward -> advantages -> old log-probs
-> update -> weight sync -> log. Reads like the algorithm; every piece it calls lives elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from moerl.algorithms.advantages import group_has_signal, grpo_advantages
from moerl.checkpoint.dist_ckpt import save_dist_checkpoint
from moerl.checkpoint.hf_io import save_hf_checkpoint
from moerl.observe.metrics import MetricsLogger
from moerl.observe.timers import Timers
from moerl.rollout.client import RolloutClient
from moerl.rollout.launcher import RolloutCluster
from moerl.rollout.weight_sync import sync_weights_from_disk, sync_weights_from_tensor
from moerl.runtime.distributed import destroy_distributed, init_distributed
from moerl.train.actor import MegatronActor
from moerl.parallel.packing import flops_linear_coeff, pack_micro_batches
from moerl.train.batching import split_micro_batches, split_packed_micro_batches
from moerl.train.losses import policy_loss, sft_loss
from moerl.train.rollout import evaluate_accuracy, generate_rollout
from moerl.train.setup import RunContext, prepare_run
from moerl.types import Sample


def log(msg: str) -> None:
    print(f"[moerl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- helpers
class WeightSync:
    """Pushes the actor's weights to every rollout server and tracks weight_version."""

    def __init__(self, ctx: RunContext, cluster: RolloutCluster):
        self.ctx, self.cluster, self.version = ctx, cluster, 0

    def __call__(self, actor: MegatronActor) -> str:
        self.version += 1
        version = str(self.version)
        hf_sd = actor.export_hf_state_dict()
        if self.ctx.cfg.rollout.weight_sync == "disk":
            sync_weights_from_disk(
                self.cluster.server_urls, hf_sd, self.ctx.hf_config, self.ctx.run_dir / "weights", version
            )
        else:
            sync_weights_from_tensor(self.cluster.server_urls, hf_sd, version, bucket_bytes=64 << 20)
        return version


def sft_samples(ctx: RunContext, rows) -> list[Sample]:
    """Supervised samples: templated prompt, response = label tokens + eos."""
    out = []
    for i, r in enumerate(rows):
        resp = ctx.tokenizer.encode(str(r[ctx.cfg.data.label_key]), add_special_tokens=False) + [ctx.eos_id]
        out.append(
            Sample(index=i, group_id=i, prompt=r[ctx.cfg.data.prompt_key], label=str(r[ctx.cfg.data.label_key]),
                   prompt_ids=ctx.encode(r[ctx.cfg.data.prompt_key]), response_ids=resp, loss_mask=[1] * len(resp))
        )
    return out


def evaluate(ctx: RunContext, client, rows) -> float:
    return evaluate_accuracy(
        client, rows, ctx.encode, ctx.decode, ctx.reward_fn,
        prompt_key=ctx.cfg.data.prompt_key, label_key=ctx.cfg.data.label_key,
        max_new_tokens=ctx.cfg.rollout.max_new_tokens, stop_token_ids=[ctx.eos_id],
    )


def run_sft(ctx: RunContext, actor: MegatronActor, client, sync: WeightSync, logger: MetricsLogger) -> dict:
    """Warm start: supervised steps until greedy accuracy on sft.eval_prompts held-out prompts first
    reaches sft.target_accuracy (checked every sft.eval_every steps), or sft.max_steps."""
    sft = ctx.cfg.sft
    sampler = ctx.make_sampler(ctx.train_ds, sft.global_batch_size, ctx.cfg.seed + 1)
    eval_rows = ctx.eval_rows[: sft.eval_prompts]
    actor.set_lr(sft.lr)
    t0, acc, step = time.time(), 0.0, 0
    for step in range(1, sft.max_steps + 1):
        samples = sft_samples(ctx, sampler.next_batch())
        mbs = split_micro_batches(samples, sft.micro_batch_size, ctx.pad_id)
        n_tok = int(sum(mb.loss_mask.sum() for mb in mbs))
        m = actor.train_step(mbs, sft_loss(n_tok), temperature=1.0)
        if step % sft.eval_every == 0 or step == sft.max_steps:
            sync(actor)
            acc = evaluate(ctx, client, eval_rows)
            rate = step / (time.time() - t0)
            logger.log(step, {"sft/loss": m["sft_loss"], "sft/eval_accuracy": acc, "sft/grad_norm": m["grad_norm"]})
            log(f"sft step {step}/{sft.max_steps} loss {m['sft_loss']:.4f} greedy acc {acc:.3f} "
                f"({rate:.1f} steps/s, elapsed {time.time() - t0:.0f}s, target {sft.target_accuracy})")
            if acc >= sft.target_accuracy:
                break
    return {"sft_steps": step, "sft_seconds": time.time() - t0, "sft_accuracy": acc}


def compute_advantages(ctx: RunContext, samples: list[Sample]) -> tuple[list[Sample], dict]:
    """Rewards -> GRPO (or Dr.GRPO) group advantages; optionally drop groups without signal."""
    algo, n = ctx.cfg.algorithm, ctx.cfg.rollout.n_samples_per_prompt
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    adv = grpo_advantages(rewards, n, normalize_std=(algo.advantage_estimator == "grpo"))
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    signal = group_has_signal(rewards, n)
    kept = samples
    if algo.filter_uniform_groups:
        kept = [s for s in samples if bool(signal[s.group_id])]
    return kept, {"groups_with_signal": float(signal.float().mean())}


def _flops_coeff(hf_config) -> float:
    """a of the a*L + L^2 FLOP load for DP balancing (moerl.parallel.packing.flops_linear_coeff)."""
    from moerl.parallel.memory_plan import ModelShape, total_params

    active = total_params(ModelShape.from_hf_config(hf_config))["active"]
    return flops_linear_coeff(hf_config.num_hidden_layers, hf_config.hidden_size, active)


def build_micro_batches(ctx: RunContext, samples: list[Sample], fields=None) -> tuple[list, dict]:
    """This DP rank's micro-batches for ``samples``: best-fit packed THD micro-batches balanced over
    DP ranks (train.pack, pp_size 1; moerl.parallel.packing), else padded micro-batches of
    train.micro_batch_size samples. Returns (micro_batches, packing stats for logging)."""
    tr = ctx.cfg.train
    if not tr.pack or ctx.cfg.parallel.pp_size > 1:
        return split_micro_batches(samples, tr.micro_batch_size, ctx.pad_id, fields), {}
    from megatron.core import parallel_state as ps

    plan = pack_micro_batches(
        [len(s.tokens) for s in samples], tr.max_tokens_per_micro_batch, dp_size=ps.get_data_parallel_world_size(),
        max_seq_len=ctx.hf_config.max_position_embeddings, balance=tr.pack_balance,
        linear_coeff=_flops_coeff(ctx.hf_config) if tr.pack_balance == "flops" else None,
    )
    multiple = ctx.cfg.parallel.tp_size if ctx.cfg.parallel.tp_size > 1 else 1
    mbs = split_packed_micro_batches(samples, plan.for_rank(ps.get_data_parallel_rank()), ctx.pad_id, fields,
                                     pad_to_multiple_of=multiple)
    st = plan.stats()
    return mbs, {"pack_utilisation": st["utilisation"], "pack_utilisation_vs_bound": st["utilisation_vs_bound"],
                 "num_micro_batches": float(plan.num_micro_batches)}


def attach_log_probs(ctx: RunContext, actor, samples, temperature, key) -> list[list[float]]:
    """Trainer log-probs of every sample's response tokens under ``actor`` (list per sample)."""
    out: list[Optional[list[float]]] = [None] * len(samples)
    for mb, lp, _ in actor.compute_log_probs(build_micro_batches(ctx, samples)[0], temperature):
        for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
            out[i] = resp.tolist()
    for s, v in zip(samples, out):
        s.metadata[key] = v
    return out


# --------------------------------------------------------------------------- main job
def train(cfg) -> dict:
    """Run the main job for a validated RecipeConfig; returns the final summary dict (also written
    to <output_dir>/summary.json)."""
    t_start = time.time()
    dist = init_distributed(
        tp_size=cfg.parallel.tp_size, pp_size=cfg.parallel.pp_size, ep_size=cfg.parallel.ep_size,
        seed=cfg.seed, num_threads=cfg.train.num_threads,
    )
    try:
        ctx = prepare_run(cfg, dist)
        return _train(ctx, t_start)
    finally:
        destroy_distributed()


def _train(ctx: RunContext, t_start: float) -> dict:
    cfg, algo, ro = ctx.cfg, ctx.cfg.algorithm, ctx.cfg.rollout
    actor = MegatronActor(
        ctx.hf_config, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, adam_beta1=cfg.train.adam_beta1,
        adam_beta2=cfg.train.adam_beta2, clip_grad=cfg.train.clip_grad,
        moe_aux_loss_coeff=algo.moe_aux_loss_coeff, moe_load_balancing_type=algo.moe_load_balancing_type,
    )
    if ctx.init_hf_state_dict is not None:
        actor.load_hf_state_dict(ctx.init_hf_state_dict)
    v0 = ctx.run_dir / "weights" / "init"
    save_hf_checkpoint(actor.export_hf_state_dict(), ctx.hf_config, v0, tokenizer=ctx.tokenizer)
    logger = MetricsLogger(ctx.run_dir / "tensorboard", tensorboard=cfg.log.tensorboard, wandb_project=cfg.log.wandb_project)
    summary: dict = {"seed": cfg.seed}
    timers = Timers()
    with RolloutCluster(
        model_path=str(v0), num_servers=ro.num_servers, host=ro.host, base_port=ro.base_port,
        router_port=ro.router_port, router_policy=ro.router_policy, threads_per_server=ro.threads_per_server,
        startup_timeout_s=ro.startup_timeout_s, log_dir=str(ctx.run_dir / "logs"),
    ) as cluster:
        client = RolloutClient(cluster.router_url, timeout_s=ro.request_timeout_s, max_retries=ro.max_retries, cluster=cluster)
        sync = WeightSync(ctx, cluster)
        log(f"rollout: {ro.num_servers} servers {cluster.server_urls} behind sglang-router {cluster.router_url}")
        eval_rows = ctx.eval_rows[: cfg.eval.num_prompts]
        if cfg.sft.enabled:
            summary.update(run_sft(ctx, actor, client, sync, logger))
            warm = ctx.run_dir / "hf_warm_start"
            save_hf_checkpoint(actor.export_hf_state_dict(), ctx.hf_config, warm, tokenizer=ctx.tokenizer)
            log(f"warm-start weights saved to {warm} (reuse with model.init_from={warm} sft.enabled=false)")
        sync(actor)
        acc = evaluate(ctx, client, eval_rows)
        summary["accuracy_after_warm_start"] = acc
        log(f"EVAL after warm start: greedy accuracy {acc:.4f} on {len(eval_rows)} held-out prompts")
        logger.log(0, {"eval/accuracy": acc})

        actor.set_lr(cfg.train.lr)
        ref = None
        if algo.kl_coef > 0:
            ref = MegatronActor(ctx.hf_config, trainable=False)
            ref.load_hf_state_dict(actor.export_hf_state_dict())
        sampler = ctx.make_sampler(ctx.train_ds, ro.rollout_batch_size, cfg.seed)
        sampling_params = dict(
            temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
            max_new_tokens=ro.max_new_tokens, stop_token_ids=[ctx.eos_id],
        )
        t_rl = time.time()
        for step in range(1, cfg.train.num_steps + 1):
            metrics = _rl_step(ctx, step, actor, ref, client, sync, sampler, sampling_params, timers)
            if step == 1:
                summary["step0_check"] = step0_check(metrics)
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.num_steps:
                with timers("checkpoint"):
                    save_dist_checkpoint(actor.model, actor.optimizer, ctx.run_dir / "checkpoints" / f"step_{step}",
                                         extra={"step": step, "seed": cfg.seed})
            if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or step == cfg.train.num_steps:
                with timers("eval"):
                    metrics["eval/accuracy"] = evaluate(ctx, client, eval_rows)
            metrics.update({f"time/{k}": v for k, v in timers.pop().items()})
            logger.log(step, metrics)
            eta = (time.time() - t_rl) / step * (cfg.train.num_steps - step)
            log(_step_line(step, cfg.train.num_steps, metrics, eta))
        acc_rl = evaluate(ctx, client, eval_rows)
    summary["accuracy_after_rl"] = acc_rl
    log(f"EVAL after RL: greedy accuracy {acc_rl:.4f} on {len(eval_rows)} held-out prompts "
        f"(after warm start {summary['accuracy_after_warm_start']:.4f}, "
        f"change {100 * (acc_rl - summary['accuracy_after_warm_start']):+.1f} points)")
    save_dist_checkpoint(actor.model, actor.optimizer, ctx.run_dir / "checkpoints" / f"step_{cfg.train.num_steps}",
                         extra={"step": cfg.train.num_steps, "seed": cfg.seed})
    save_hf_checkpoint(actor.export_hf_state_dict(), ctx.hf_config, ctx.run_dir / "hf_export", tokenizer=ctx.tokenizer)
    summary["total_seconds"] = time.time() - t_start
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"done in {summary['total_seconds']:.0f}s; Megatron checkpoint in {ctx.run_dir / 'checkpoints'}, "
        f"HF export in {ctx.run_dir / 'hf_export'}")
    logger.close()
    return summary


def _rl_step(ctx, step, actor, ref, client, sync, sampler, sampling_params, timers) -> dict:
    cfg, algo, ro = ctx.cfg, ctx.cfg.algorithm, ctx.cfg.rollout
    with timers("rollout"):
        samples = generate_rollout(
            client, sampler.next_batch(), ctx.encode, n_samples_per_prompt=ro.n_samples_per_prompt,
            sampling_params=sampling_params, seed=cfg.seed, step=step,
            prompt_key=cfg.data.prompt_key, label_key=cfg.data.label_key,
        )
    with timers("reward"):
        for s in samples:
            s.reward = ctx.reward_fn(ctx.decode(s.response_ids), s.label)
    m: dict = {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "response_length": sum(s.response_length for s in samples) / len(samples),
        "truncated_frac": sum(s.status == "truncated" for s in samples) / len(samples),
    }
    m["accuracy"] = sum(s.reward >= 1.0 for s in samples) / len(samples)
    kept, adv_m = compute_advantages(ctx, samples)
    m.update(adv_m)
    if not kept:
        m["skipped_update"] = 1.0
        return m
    with timers("log_prob"):
        old = attach_log_probs(ctx, actor, kept, ro.temperature, "old_log_probs")
        if ref is not None:
            attach_log_probs(ctx, ref, kept, ro.temperature, "ref_log_probs")
    diffs = [abs(a - b) for s, lp in zip(kept, old) for a, b in zip(lp, s.rollout_log_probs)]
    m["logprob_abs_diff_mean"] = sum(diffs) / len(diffs)
    m["logprob_abs_diff_max"] = max(diffs)
    with timers("update"):
        n_updates = max(1, (len(samples)) // cfg.train.global_batch_size)
        chunk = math.ceil(len(kept) / n_updates)
        for lo in range(0, len(kept), chunk):
            part = kept[lo : lo + chunk]
            fields = {"old_log_probs": [s.metadata["old_log_probs"] for s in part]}
            if ref is not None:
                fields["ref_log_probs"] = [s.metadata["ref_log_probs"] for s in part]
            mbs, pack_stats = build_micro_batches(ctx, part, fields)
            m.update({f"train/{k}": v for k, v in pack_stats.items()})
            loss_fn = policy_loss(
                algo, global_num_tokens=sum(sum(s.loss_mask) for s in part), global_num_seqs=len(part),
                seq_token_sum_constant=float(ro.max_new_tokens),
            )
            out = actor.train_step(mbs, loss_fn, temperature=ro.temperature)
            for k, v in out.items():
                m[f"train/{k}"] = v
    with timers("weight_sync"):
        sync(actor)
    return m


STEP0_LOGPROB_TOL = 1e-5


def step0_check(m: dict) -> dict:
    """The step-0 checks, printed every run: right after a weight sync the trainer's log-probs of the
    rollout tokens match the server's (mean |diff| <= 1e-5 in fp32), and the policy ratio is exactly
    1 before the first update (sum over tokens of |log_probs - old_log_probs| == 0)."""
    lp = m.get("logprob_abs_diff_mean", float("nan"))
    dev = m.get("train/logratio_abs_sum", float("nan"))
    res = {
        "logprob_abs_diff_mean": lp,
        "logprob_abs_diff_max": m.get("logprob_abs_diff_max", float("nan")),
        "logprob_pass": bool(lp <= STEP0_LOGPROB_TOL),
        "logratio_abs_sum": dev,
        "ratio_pass": bool(dev == 0.0),
    }
    log(
        f"STEP-0 CHECK: trainer vs rollout-server log-probs mean |diff| {lp:.2e} (max {res['logprob_abs_diff_max']:.2e}, "
        f"tolerance {STEP0_LOGPROB_TOL:g}): {'PASS' if res['logprob_pass'] else 'FAIL'}; policy ratio before the first "
        f"update: sum |log ratio| = {dev:g} (exactly 1): {'PASS' if res['ratio_pass'] else 'FAIL'}"
    )
    return res


def _step_line(step: int, total: int, m: dict, eta: float) -> str:
    g = lambda k, fmt="{:.3f}": fmt.format(m[k]) if k in m else "-"  # noqa: E731
    t = " ".join(f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/"))
    line = (
        f"step {step}/{total} reward {g('reward_mean')} acc {g('accuracy')} "
        f"kl {g('train/kl', '{:.2e}')} entropy {g('train/entropy')} aux {g('train/aux_loss', '{:.4f}')} "
        f"resp_len {g('response_length', '{:.2f}')} lp_diff {g('logprob_abs_diff_mean', '{:.1e}')} "
        f"ratio {g('train/ratio_mean', '{:.6f}')} pack_util {g('train/pack_utilisation')} | {t} | eta {eta:.0f}s"
    )
    if "eval/accuracy" in m:
        line += f" | EVAL greedy acc {m['eval/accuracy']:.4f}"
    return line

"""The synchronous RL loop: SFT warm start, then rollout -> reward -> advantages -> old log-probs
-> update -> weight sync -> log. Reads like the algorithm; every piece it calls lives elsewhere.

Single process or under torchrun (any TP/PP/EP/DP layout the recipe allows). With several ranks,
global rank 0 alone runs the rollout cluster: it generates rollouts, scores rewards, computes
advantages and runs the greedy evaluations, then broadcasts the kept samples (and every eval /
early-stop decision) to all ranks over the default (gloo on CPU) process group. Each DP rank trains
on its share (best-fit packing balanced over DP, or contiguous shares when unpacked); losses use
global denominators, so the update is the single-process one up to float summation order. Weight
export is collective (every rank gathers its TP/EP/PP shards); rank 0 pushes the weights to the
servers. Only rank 0 prints, writes TensorBoard and summary.json.

Checkpoints (``<output_dir>/checkpoints/{sft_step_N|step_N}``, torch_dist, atomic) hold the model,
the optimizer and a ``moerl_state`` extra: phase, SFT / RL step counters, the PromptSampler
cursors, the weight-sync version, the summary so far and every rank's python / numpy / torch /
Megatron-tracker RNG states; a ``moerl_complete.json`` marker is written once the directory is in
place. ``resume=auto`` continues from the newest checkpoint that has the marker.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as tdist

from moerl.algorithms.advantages import group_has_signal, grpo_advantages
from moerl.checkpoint.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint
from moerl.checkpoint.hf_io import load_hf_state_dict, save_hf_checkpoint
from moerl.observe.metrics import MetricsLogger
from moerl.observe.timers import Timers
from moerl.parallel.packing import flops_linear_coeff, pack_micro_batches
from moerl.rollout.client import RolloutClient
from moerl.rollout.launcher import RolloutCluster, failover_restorer
from moerl.rollout.placement import RolloutPlacement
from moerl.rollout.sglang_launcher import launch_sglang_rollout, resolve_host
from moerl.rollout.weight_sync import DistributedWeightUpdater, resolve_master_address, sync_weights
from moerl.runtime.distributed import destroy_distributed, fault_injection_point, init_distributed
from moerl.data.tokenizer import encode_sft_example
from moerl.moe.config import moe_actor_kwargs
from moerl.moe.routing_replay import RoutingReplay, gather_recorded_routing
from moerl.moe.telemetry import MoETelemetry
from moerl.train.actor import MegatronActor, actor_parallel_kwargs
from moerl.train.batching import make_micro_batch, split_micro_batches, split_packed_micro_batches
from moerl.train.losses import policy_loss, sft_loss
from moerl.train.offload import ActorOffloader
from moerl.train.rollout import evaluate_accuracy, generate_rollout
from moerl.train.setup import RunContext, prepare_run
from moerl.types import Sample

_IS_MAIN = True  # False on ranks other than global rank 0 (they print nothing)
COMPLETE_MARKER = "moerl_complete.json"


def log(msg: str) -> None:
    if _IS_MAIN:
        print(f"[moerl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _world() -> int:
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def broadcast_from_main(obj: Any) -> Any:
    """``obj`` of global rank 0 on every rank (torch.distributed.broadcast_object_list on the
    default group; identity in a single process). Collective."""
    if _world() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _dp() -> tuple[int, int]:
    """(dp_size, dp_rank) from Megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()


# --------------------------------------------------------------------------- helpers
class WeightSync:
    """Pushes the actor's weights to every rollout server and tracks weight_version.

    Collective: every rank calls it (the HF export gathers the TP/EP/PP shards onto rank 0); only
    rank 0, which holds ``cluster``, talks to the servers (``cluster`` is None elsewhere)."""

    def __init__(self, ctx: RunContext, cluster: Optional[RolloutCluster], version: int = 0):
        """Raises ValueError (before any push) when rollout.weight_sync=distributed and the servers'
        rendezvous address (rollout.weight_sync_master_address, else rollout.host; "auto" resolved)
        is loopback / wildcard while some server runs on another machine."""
        self.ctx, self.cluster, self.version = ctx, cluster, version
        ro = ctx.cfg.rollout
        self.updater: Optional[DistributedWeightUpdater] = None  # rollout.weight_sync == "distributed"
        self.master_address: Optional[str] = None
        if cluster is not None and ro.weight_sync == "distributed":
            self.master_address = resolve_master_address(ro.weight_sync_master_address, ro.host,
                                                         list(cluster.server_urls) + list(cluster.extra_worker_urls))
        # rollout.placement: colocated releases / resumes server memory around training (every rank
        # calls the trainer offload hooks; rank 0 alone talks to the servers). Colocated: the actors
        # given to offload_with() go to host memory while rollout runs (moerl.train.offload).
        # Released / resumed: the live servers moerl started on every node (this cluster's and the
        # other nodes', RolloutCluster.colocated_server_urls), never rollout.external_urls (not
        # moerl's: they keep their memory and only get the weights). With several ranks a barrier
        # follows every trainer offload and precedes every reload, so rank 0 resumes the servers only
        # once every rank has offloaded, and no rank reloads before rank 0 released the servers.
        off = self.offloader = ActorOffloader([], log=log) if ro.placement == "colocated" else None

        def offload() -> None:
            off.offload()
            if _world() > 1:
                tdist.barrier()

        def reload() -> None:
            if _world() > 1:
                tdist.barrier()
            off.reload()

        self.placement = RolloutPlacement(ro.placement,
                                          cluster.colocated_server_urls if cluster is not None else None,
                                          offload_trainer=offload if off else None,
                                          reload_trainer=reload if off else None)

    def offload_with(self, actor, include_optimizer: bool = True) -> None:
        """Colocated placement: offload ``actor`` with the trainer (weights only when
        include_optimizer is False, e.g. the reference policy); no-op otherwise."""
        if self.offloader is not None:
            self.offloader.add(actor, include_optimizer)

    def trainer_loaded(self):
        """Context in which the offloaded actors are on the device (reloaded, offloaded again on
        exit): checkpoints, exports and optimizer rebuilds between rollouts."""
        return self.offloader.loaded() if self.offloader is not None else contextlib.nullcontext()

    def __call__(self, actor: MegatronActor) -> str:
        self.version += 1
        version = str(self.version)
        with self.trainer_loaded():
            hf_sd = actor.export_hf_state_dict(dst=0)
        self.placement.before_weight_sync()
        if self.cluster is not None:
            ro = self.ctx.cfg.rollout
            bucket_bytes = int(ro.weight_sync_bucket_mb * (1 << 20))
            out_root = self.ctx.run_dir / "weights"

            def push(urls: list[str]) -> None:
                if ro.weight_sync == "distributed" and (self.updater is None or self.updater.server_urls != urls):
                    if self.updater is not None:
                        self.updater.close()
                        self.updater = None
                    if urls:  # [] (failover: every server restarting): nothing to push, the restorer catches up
                        self.updater = DistributedWeightUpdater(urls, master_address=self.master_address,
                                                                backend=ro.weight_sync_backend)
                try:
                    sync_weights(ro.weight_sync, urls, hf_sd, version, bucket_bytes=bucket_bytes,
                                 hf_config=self.ctx.hf_config, out_root=out_root, updater=self.updater)
                except Exception:
                    if self.updater is not None:  # the group may be out of step: rebuild it next time
                        self.updater.close()
                        self.updater = None
                    raise

            def restore(url: str) -> None:  # what a restarted server receives before it serves again;
                # built when called, so disk mode finds (and reloads) the version directory push wrote
                failover_restorer(ro.weight_sync, hf_sd, version, out_root, bucket_bytes=bucket_bytes)(url)

            # A server that dies during the push (failover on) is restarted and restored later; the
            # cluster retries the push once on the survivors (RolloutCluster.update_weights).
            self.cluster.update_weights(version, push, restore=restore if ro.failover else None)
        self.placement.before_rollout()
        return version


def sft_samples(ctx: RunContext, rows) -> list[Sample]:
    """Supervised samples: templated prompt, response = label tokens + eos
    (moerl.data.tokenizer.encode_sft_example)."""
    d, out = ctx.cfg.data, []
    for i, r in enumerate(rows):
        ids, mask = encode_sft_example(ctx.tokenizer, r[d.prompt_key], str(r[d.label_key]))
        n_prompt = mask.index(1)
        out.append(
            Sample(index=i, group_id=i, prompt=r[d.prompt_key], label=str(r[d.label_key]),
                   prompt_ids=ids[:n_prompt], response_ids=ids[n_prompt:], loss_mask=mask[n_prompt:])
        )
    return out


def evaluate(ctx: RunContext, client, rows) -> float:
    """Greedy accuracy on ``rows``, computed by rank 0 (which holds the client) and broadcast."""
    acc = None
    if client is not None:
        acc = evaluate_accuracy(
            client, rows, ctx.encode, ctx.decode, ctx.reward_fn,
            prompt_key=ctx.cfg.data.prompt_key, label_key=ctx.cfg.data.label_key,
            max_new_tokens=ctx.cfg.rollout.max_new_tokens, stop_token_ids=[ctx.eos_id],
        )
    return float(broadcast_from_main(acc))


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
    dp_size, dp_rank = _dp()
    if not tr.pack or ctx.cfg.parallel.pp_size > 1:
        return dp_padded_micro_batches(samples, tr.micro_batch_size, ctx.pad_id, fields, dp_size, dp_rank), {}
    plan = pack_micro_batches(
        [len(s.tokens) for s in samples], tr.max_tokens_per_micro_batch, dp_size=dp_size,
        max_seq_len=ctx.hf_config.max_position_embeddings, balance=tr.pack_balance,
        linear_coeff=_flops_coeff(ctx.hf_config) if tr.pack_balance == "flops" else None,
    )
    multiple = ctx.cfg.parallel.tp_size if ctx.cfg.parallel.tp_size > 1 else 1
    mbs = split_packed_micro_batches(samples, plan.for_rank(dp_rank), ctx.pad_id, fields,
                                     pad_to_multiple_of=multiple)
    st = plan.stats()
    return mbs, {"pack_utilisation": st["utilisation"], "pack_utilisation_vs_bound": st["utilisation_vs_bound"],
                 "num_micro_batches": float(plan.num_micro_batches)}


def attach_log_probs(ctx: RunContext, actor, samples, temperature, key) -> list[list[float]]:
    """Trainer log-probs of every sample's response tokens under ``actor`` (list per sample), on
    every rank: each DP rank computes its share, then the shares are all-gathered."""
    out: list[Optional[list[float]]] = [None] * len(samples)
    for mb, lp, _ in actor.compute_log_probs(build_micro_batches(ctx, samples)[0], temperature):
        for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
            out[i] = resp.tolist()
    if _world() > 1:
        parts: list = [None] * _world()
        tdist.all_gather_object(parts, {i: v for i, v in enumerate(out) if v is not None})
        for part in parts:
            for i, v in part.items():
                if out[i] is None:
                    out[i] = v
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:  # pragma: no cover - would be a packing bug
        raise RuntimeError(f"no log-probs were computed for samples {missing[:10]}")
    for s, v in zip(samples, out):
        s.metadata[key] = v
    return out


# --------------------------------------------------------------------------- run state + checkpoints
@dataclass
class TrainState:
    """Everything beyond model and optimizer that a resumed run needs (stored in checkpoints)."""

    phase: str = "sft"  # "sft" (warm start running) | "rl"
    sft_step: int = 0  # SFT steps done
    sft_done: bool = False  # warm start finished (target reached or max_steps)
    sft_accuracy: float = 0.0
    sft_seconds: float = 0.0
    rl_step: int = 0  # RL steps done
    weight_version: int = 0
    samplers: dict = field(default_factory=dict)  # name -> PromptSampler.state_dict()
    summary: dict = field(default_factory=dict)

    @property
    def order_key(self) -> tuple[int, int]:
        return (0, self.sft_step) if self.phase == "sft" else (1, self.rl_step)


def _rng_state() -> dict:
    """This rank's python / numpy / torch (/ CUDA) / Megatron-tracker RNG states."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    st["megatron_tracker"] = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    return st


def _set_rng_state(st: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    get_cuda_rng_tracker().set_states(st["megatron_tracker"])


def _layout(cfg) -> dict:
    p = cfg.parallel
    # the pipeline schedule places stages differently (DualPipe(V) chunks): a change reshards like TP/PP/EP
    return {"world_size": _world(), "tp_size": p.tp_size, "pp_size": p.pp_size, "ep_size": p.ep_size,
            "etp_size": p.expert_tp_size, "pipeline_schedule": cfg.train.pipeline_schedule}


def checkpoint_dir(run_dir: Path, state: TrainState) -> Path:
    """<run_dir>/checkpoints/sft_step_N during the warm start, step_N (RL step) after."""
    name = f"sft_step_{state.sft_step}" if state.phase == "sft" else f"step_{state.rl_step}"
    return run_dir / "checkpoints" / name


_CKPT_NAME = re.compile(r"^(sft_)?step_(\d+)$")


def list_complete_checkpoints(ckpt_root: Path, warn: bool = True) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest first (SFT ones before RL ones, then by
    step). A directory without the completion marker, or a leftover ``*.tmp`` from a save that
    was cut short, is skipped (with a warning when ``warn``)."""
    found = []
    if not ckpt_root.is_dir():
        return []
    for d in sorted(ckpt_root.iterdir()):
        if not d.is_dir():
            continue
        if d.name.endswith(".tmp") or d.name.endswith(".old"):
            if warn:
                log(f"WARNING: skipping incomplete checkpoint {d} (a save that did not finish)")
            continue
        m = _CKPT_NAME.match(d.name)
        if not m:
            continue
        marker = d / COMPLETE_MARKER
        if not marker.is_file():
            if warn:
                log(f"WARNING: skipping incomplete checkpoint {d}: no {COMPLETE_MARKER} marker")
            continue
        found.append(((0 if m.group(1) else 1, int(m.group(2))), d))
    return [d for _, d in sorted(found)]


def resolve_resume(cfg, run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from for ``cfg.resume`` ("none" | "auto" | a path), or None.

    Raises:
        FileNotFoundError: ``resume`` is a path without a complete checkpoint.
    """
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        found = list_complete_checkpoints(run_dir / "checkpoints")
        return found[-1] if found else None
    path = Path(cfg.resume)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"resume: {path} is not a complete moerl checkpoint (no {COMPLETE_MARKER}); use resume=auto or "
            "a <output_dir>/checkpoints/step_N directory"
        )
    return path


def save_checkpoint(ctx: RunContext, actor: MegatronActor, state: TrainState, samplers: dict) -> Path:
    """Collective: model + optimizer + TrainState + every rank's RNG states into the phase's
    checkpoint directory (atomic), then the completion marker, then prune to train.keep_checkpoints."""
    state.samplers = {k: s.state_dict() for k, s in samplers.items()}
    rng: list = [None] * _world()
    if _world() > 1:
        tdist.all_gather_object(rng, _rng_state())
    else:
        rng = [_rng_state()]
    path = checkpoint_dir(ctx.run_dir, state)
    # rank 0's copy: wall-clock fields (sft_seconds) differ between ranks
    extra = {"moerl_state": broadcast_from_main(asdict(state)), "rng": rng, "layout": _layout(ctx.cfg), "seed": ctx.cfg.seed,
             "step": state.rl_step, "phase": state.phase}
    save_dist_checkpoint(actor.model, actor.optimizer, path, extra=extra)
    if _IS_MAIN:
        tmp = path / (COMPLETE_MARKER + ".tmp")
        tmp.write_text(json.dumps({"phase": state.phase, "sft_step": state.sft_step, "rl_step": state.rl_step,
                                   "layout": _layout(ctx.cfg), "time": time.time()}))
        tmp.replace(path / COMPLETE_MARKER)
        keep = ctx.cfg.train.keep_checkpoints
        complete = list_complete_checkpoints(path.parent, warn=False)
        if keep and len(complete) > keep:
            for old in complete[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    if _world() > 1:
        tdist.barrier()
    return path


def load_checkpoint(ctx: RunContext, actor: MegatronActor, path: Path) -> TrainState:
    """Collective: restore model, optimizer (rebuilt for the checkpoint's phase first), TrainState
    and, when the layout is unchanged, every rank's RNG states. After a TP/PP/EP/world-size or
    pipeline-schedule change
    the model weights reshard but the optimizer state is not loaded (it reshards over DP only) and
    the RNG states are not restored; both are warned about."""
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    saved = {"pipeline_schedule": "1f1b", **marker["layout"]}  # checkpoints older than the schedule key
    now = _layout(ctx.cfg)
    same = saved == now
    actor.set_lr(ctx.cfg.sft.lr if marker["phase"] == "sft" else ctx.cfg.train.lr)
    if {k: v for k, v in saved.items() if k != "world_size"} == {k: v for k, v in now.items() if k != "world_size"}:
        extra = load_dist_checkpoint(actor.model, actor.optimizer, path)  # DP changes reshard
    else:
        log(f"WARNING: checkpoint layout {saved} differs from this run's {now} in TP/PP/EP/schedule: model weights "
            "are resharded, the optimizer state is NOT loaded (fresh Adam moments)")
        extra = load_dist_checkpoint(actor.model, None, path)
    state = TrainState(**extra["moerl_state"])
    if same:
        rank = tdist.get_rank() if _world() > 1 else 0
        _set_rng_state(extra["rng"][rank])
    else:
        log("WARNING: layout changed since the checkpoint; RNG states are not restored (reseeded)")
    return state


# --------------------------------------------------------------------------- SFT
def run_sft(ctx: RunContext, actor: MegatronActor, client, sync: WeightSync, logger, state: TrainState,
            samplers: dict, ckpt) -> None:
    """Warm start: supervised steps until greedy accuracy on sft.eval_prompts held-out prompts first
    reaches sft.target_accuracy (checked every sft.eval_every steps), or sft.max_steps. Continues
    from ``state.sft_step``; each DP rank trains on its contiguous share of every batch."""
    sft = ctx.cfg.sft
    eval_rows = ctx.eval_rows[: sft.eval_prompts]
    dp_size, dp_rank = _dp()
    t_proc = time.time()
    t0 = t_proc - state.sft_seconds  # elapsed counts the SFT time of earlier (killed) runs too
    start = state.sft_step
    for step in range(start + 1, sft.max_steps + 1):
        samples = sft_samples(ctx, samplers["sft"].next_batch())
        mbs = dp_padded_micro_batches(samples, sft.micro_batch_size, ctx.pad_id, None, dp_size, dp_rank)
        n_tok = sum(sum(s.loss_mask) for s in samples)  # global denominator
        if sync.placement.trainer_offloaded:  # colocated, after a sync: servers release, trainer reloads
            sync.placement.before_train()
        m = actor.train_step(mbs, sft_loss(n_tok), temperature=1.0)
        state.sft_step = step
        if step % sft.eval_every == 0 or step == sft.max_steps:
            sync(actor)
            acc = evaluate(ctx, client, eval_rows)
            state.sft_accuracy = acc
            rate = (step - start) / max(1e-9, time.time() - t_proc)
            if logger is not None:
                logger.log(step, {"sft/loss": m["sft_loss"], "sft/eval_accuracy": acc, "sft/grad_norm": m["grad_norm"]})
            log(f"sft step {step}/{sft.max_steps} loss {m['sft_loss']:.4f} greedy acc {acc:.3f} "
                f"({rate:.1f} steps/s, elapsed {time.time() - t0:.0f}s, target {sft.target_accuracy})")
            state.sft_done = acc >= sft.target_accuracy or step == sft.max_steps
        state.sft_seconds = time.time() - t0
        ckpt(step)
        if state.sft_done:
            break
    state.sft_done = True


# --------------------------------------------------------------------------- main job
def train(cfg) -> dict:
    """Run the main job for a validated RecipeConfig; returns the final summary dict (also written
    to <output_dir>/summary.json by rank 0). Works in one process and under torchrun."""
    global _IS_MAIN
    t_start = time.time()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    dist = init_distributed(
        tp_size=cfg.parallel.tp_size, pp_size=cfg.parallel.pp_size, ep_size=cfg.parallel.ep_size,
        etp_size=cfg.parallel.etp_size, seed=cfg.seed,
        num_threads=max(1, cfg.train.num_threads // local_world),
    )
    _IS_MAIN = dist.is_main
    try:
        ctx = prepare_run(cfg, dist)
        return _train(ctx, t_start)
    finally:
        destroy_distributed()
        _IS_MAIN = True


class _Checkpointer:
    """Decides when to save (every train.save_every steps and/or train.save_every_minutes
    wall-clock minutes; rank 0's clock decides and broadcasts) and saves. Collective."""

    def __init__(self, ctx, actor, state, samplers, timers):
        self.ctx, self.actor, self.state, self.samplers, self.timers = ctx, actor, state, samplers, timers
        self.last = time.time()
        self.loaded = contextlib.nullcontext  # WeightSync.trainer_loaded under colocated placement

    def __call__(self, step: int, force: bool = False) -> bool:
        fault_injection_point(self.state.phase, step)  # test-only switch; no-op unless MOERL_FAULT_EXIT_AT is set
        tr = self.ctx.cfg.train
        due = force or bool(tr.save_every and step % tr.save_every == 0)
        if tr.save_every_minutes and not due:
            due = bool(broadcast_from_main(time.time() - self.last >= 60.0 * tr.save_every_minutes))
        if not due:
            return False
        with self.timers("checkpoint"), self.loaded():
            save_checkpoint(self.ctx, self.actor, self.state, self.samplers)
        self.last = time.time()
        return True


def _train(ctx: RunContext, t_start: float) -> dict:
    cfg, algo, ro = ctx.cfg, ctx.cfg.algorithm, ctx.cfg.rollout
    main = ctx.dist.is_main
    if not cfg.sft.enabled and ctx.init_hf_state_dict is None:
        log("WARNING: sft.enabled=false and no model.init_from: RL starts from a RANDOM model, which cannot "
            "learn the task by RL alone (rewards stay ~0); set model.init_from=<HF dir> or sft.enabled=true")
    mk = moe_actor_kwargs(cfg)  # balancing loss, z-loss, expert bias, routing, dispatcher (recipe keys)
    pkw = actor_parallel_kwargs(cfg.parallel)
    pkw["config_overrides"] = {**pkw.get("config_overrides", {}), **mk["config_overrides"]}
    pkw["pipeline_schedule"] = cfg.train.pipeline_schedule  # 1f1b | dualpipe | dualpipev (moerl.pipeline)
    pkw["pipeline_overlap"] = cfg.train.pipeline_overlap  # F&B on two CUDA streams (moerl.pipeline.overlap)
    actor = MegatronActor(
        ctx.hf_config, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, adam_beta1=cfg.train.adam_beta1,
        adam_beta2=cfg.train.adam_beta2, clip_grad=cfg.train.clip_grad,
        moe_aux_loss_coeff=mk["moe_aux_loss_coeff"], moe_load_balancing_type=mk["moe_load_balancing_type"], **pkw,
    )
    # expert-load telemetry of the RL update passes (not SFT, log-prob or eval passes)
    telemetry = None
    if cfg.moe.telemetry:
        telemetry = MoETelemetry(
            actor.model, jsonl_path=str(ctx.run_dir / "moe_telemetry.jsonl") if main else None,
            entropy_threshold=cfg.moe.entropy_threshold, dead_expert_steps=cfg.moe.dead_expert_steps, enabled=False,
        )
    if ctx.init_hf_state_dict is not None:
        actor.load_hf_state_dict(ctx.init_hf_state_dict)
    v0 = ctx.run_dir / "weights" / "init"
    init_sd = actor.export_hf_state_dict(dst=0)
    if main:
        save_hf_checkpoint(init_sd, ctx.hf_config, v0, tokenizer=ctx.tokenizer)
    resume_path = broadcast_from_main(resolve_resume(cfg, ctx.run_dir) if main else None)
    timers = Timers()
    state = TrainState(phase="sft" if cfg.sft.enabled else "rl", sft_done=not cfg.sft.enabled,
                       summary={"seed": cfg.seed})
    if resume_path is not None:
        state = load_checkpoint(ctx, actor, Path(resume_path))
        log(f"RESUME from {resume_path}: phase {state.phase}, sft step {state.sft_step}, rl step {state.rl_step}")
    samplers = {"sft": ctx.make_sampler(ctx.train_ds, cfg.sft.global_batch_size, cfg.seed + 1),
                "rl": ctx.make_sampler(ctx.train_ds, ro.rollout_batch_size, cfg.seed)}
    for name, st in state.samplers.items():
        samplers[name].load_state_dict(st)
    logger = None
    if main:
        logger = MetricsLogger(ctx.run_dir / "tensorboard", tensorboard=cfg.log.tensorboard,
                               wandb_project=cfg.log.wandb_project)
    ckpt = _Checkpointer(ctx, actor, state, samplers, timers)
    cluster_cm = node_cm = contextlib.nullcontext(None)
    if ro.backend == "sglang":  # collective: local rank 0 of every node starts its node's servers
        launched = launch_sglang_rollout(
            str(v0), rollout_gpu_ids=ro.gpu_ids, router_port=ro.router_port, base_port=ro.base_port, host=ro.host,
            tp_size=ro.server_tp_size, dp_size=ro.server_dp_size, ep_size=ro.server_ep_size,
            mem_fraction_static=ro.mem_fraction_static, colocated=ro.placement == "colocated",
            external_urls=ro.external_urls, log_dir=str(ctx.run_dir / "logs"), router_policy=ro.router_policy,
            failover=ro.failover, startup_timeout_s=ro.startup_timeout_s, random_seed=cfg.seed,
            return_routed_experts=cfg.moe.routing_replay == "r3")
        if main:
            cluster_cm = launched
        elif launched is not None:
            node_cm = launched
    elif main:
        cluster_cm = RolloutCluster(
            model_path=str(v0), num_servers=ro.num_servers, host=resolve_host(ro.host), base_port=ro.base_port,
            router_port=ro.router_port, router_policy=ro.router_policy, threads_per_server=ro.threads_per_server,
            startup_timeout_s=ro.startup_timeout_s, log_dir=str(ctx.run_dir / "logs"),
            failover=ro.failover, max_restarts=ro.max_restarts, extra_worker_urls=ro.external_urls,
        )
    with node_cm, cluster_cm as cluster:
        client = None
        if cluster is not None:
            client = RolloutClient(cluster.router_url, timeout_s=ro.request_timeout_s, max_retries=ro.max_retries,
                                   cluster=cluster)
            log(f"rollout: {ro.num_servers} servers {cluster.server_urls} behind sglang-router {cluster.router_url}")
        if _world() > 1:
            log(f"trainer: {_world()} ranks, tp {cfg.parallel.tp_size} pp {cfg.parallel.pp_size} ep "
                f"{cfg.parallel.ep_size} dp {_dp()[0]}")
        sync = WeightSync(ctx, cluster, version=state.weight_version)
        sync.offload_with(actor)
        ckpt.loaded = sync.trainer_loaded
        eval_rows = ctx.eval_rows[: cfg.eval.num_prompts]
        if resume_path is not None:
            sync(actor)  # the fresh servers hold the initial weights
        if state.phase == "sft":
            if not state.sft_done:
                if resume_path is None:
                    actor.set_lr(cfg.sft.lr)  # else load_checkpoint rebuilt it and loaded its state
                run_sft(ctx, actor, client, sync, logger, state, samplers, ckpt)
            state.summary.update({"sft_steps": state.sft_step, "sft_seconds": state.sft_seconds,
                                  "sft_accuracy": state.sft_accuracy})
            warm = ctx.run_dir / "hf_warm_start"
            with sync.trainer_loaded():
                warm_sd = actor.export_hf_state_dict(dst=0)
            if main:
                save_hf_checkpoint(warm_sd, ctx.hf_config, warm, tokenizer=ctx.tokenizer)
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

        ref = None
        if algo.kl_coef > 0 or algo.reference_policy:
            ref = MegatronActor(ctx.hf_config, trainable=False, **pkw)
            if resume_path is not None and state.rl_step > 0:
                ref_sd = (load_hf_state_dict(str(ctx.run_dir / "hf_warm_start")) if cfg.sft.enabled
                          else broadcast_from_main(init_sd if main else None))
            else:
                with sync.trainer_loaded():
                    ref_sd = actor.export_hf_state_dict()
            ref.load_hf_state_dict(ref_sd)
            sync.offload_with(ref, include_optimizer=False)  # weights only
        sampling_params = dict(
            temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
            max_new_tokens=ro.max_new_tokens, stop_token_ids=[ctx.eos_id],
        )
        t_rl, first = time.time(), state.rl_step + 1
        if telemetry is not None:
            telemetry.enabled = True
        if cfg.moe.routing_replay != "none":  # R2/R3 in the RL passes only (not SFT)
            actor.routing_replay = RoutingReplay(actor.model, cfg.moe.routing_replay)
        for step in range(first, cfg.train.num_steps + 1):
            metrics = _rl_step(ctx, step, actor, ref, client, sync, samplers["rl"], sampling_params, timers)
            state.rl_step, state.weight_version = step, sync.version
            if telemetry is not None:  # collective: every rank
                metrics.update({f"moe/{k}": v for k, v in telemetry.step_end(step)["metrics"].items()})
            # the step-0 checks need an update: the first step whose groups carried a reward signal
            if "step0_check" not in state.summary and "train/logratio_abs_sum" in metrics:
                state.summary["step0_check"] = step0_check(metrics)
                state.summary["step0_check"]["step"] = step
                state.summary["first_step_metrics"] = {k: float(v) for k, v in metrics.items()}
            if step < cfg.train.num_steps:
                ckpt(step)
            if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or step == cfg.train.num_steps:
                with timers("eval"):
                    metrics["eval/accuracy"] = evaluate(ctx, client, eval_rows)
            metrics.update({f"time/{k}": v for k, v in timers.pop().items()})
            if logger is not None:
                logger.log(step, metrics)
            eta = (time.time() - t_rl) / (step - first + 1) * (cfg.train.num_steps - step)
            log(_step_line(step, cfg.train.num_steps, metrics, eta))
        acc_rl = evaluate(ctx, client, eval_rows)
    if telemetry is not None:
        telemetry.close()
    summary = state.summary
    summary["accuracy_after_rl"] = acc_rl
    log(f"EVAL after RL: greedy accuracy {acc_rl:.4f} on {len(eval_rows)} held-out prompts "
        f"(after warm start {summary['accuracy_after_warm_start']:.4f}, "
        f"change {100 * (acc_rl - summary['accuracy_after_warm_start']):+.1f} points)")
    state.rl_step = max(state.rl_step, cfg.train.num_steps)
    ckpt(state.rl_step, force=True)
    with sync.trainer_loaded():
        final_sd = actor.export_hf_state_dict(dst=0)
    summary["total_seconds"] = time.time() - t_start
    if resume_path is not None:
        summary["resumed_from"] = str(resume_path)
    if main:
        save_hf_checkpoint(final_sd, ctx.hf_config, ctx.run_dir / "hf_export", tokenizer=ctx.tokenizer)
        (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.close()
    log(f"done in {summary['total_seconds']:.0f}s; Megatron checkpoint in {ctx.run_dir / 'checkpoints'}, "
        f"HF export in {ctx.run_dir / 'hf_export'}")
    return summary


def _rollout_on_main(ctx, step, client, sampler, sampling_params, timers) -> tuple[list[Sample], dict]:
    """Rank 0: rollout, rewards, advantages -> (kept samples, metrics). Other ranks only advance
    their sampler copy (so its state matches rank 0's for checkpoints)."""
    cfg, ro = ctx.cfg, ctx.cfg.rollout
    rows = sampler.next_batch()
    if client is None:
        return [], {}
    with timers("rollout"):
        samples = generate_rollout(
            client, rows, ctx.encode, n_samples_per_prompt=ro.n_samples_per_prompt,
            sampling_params=sampling_params, seed=cfg.seed, step=step,
            prompt_key=cfg.data.prompt_key, label_key=cfg.data.label_key,
            routing_shape=((ctx.hf_config.num_hidden_layers, ctx.hf_config.num_experts_per_tok)
                           if cfg.moe.routing_replay == "r3" else None),
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
    m["num_samples"] = float(len(samples))
    return kept, m


def _rl_step(ctx, step, actor, ref, client, sync, sampler, sampling_params, timers) -> dict:
    cfg, algo, ro = ctx.cfg, ctx.cfg.algorithm, ctx.cfg.rollout
    kept, m = broadcast_from_main(_rollout_on_main(ctx, step, client, sampler, sampling_params, timers))
    n_samples = int(m.pop("num_samples"))
    if len(kept) < _dp()[0]:  # nothing (or too little) to share over the DP ranks
        m["skipped_update"] = 1.0
        return m
    sync.placement.before_train()  # colocated: the servers release their memory before training
    with timers("log_prob"):
        old = attach_log_probs(ctx, actor, kept, ro.temperature, "old_log_probs")
        if cfg.moe.routing_replay == "r2":  # replay the old-log-prob pass's routing in the updates
            gather_recorded_routing(actor.routing_replay, kept)
        if ref is not None:
            attach_log_probs(ctx, ref, kept, ro.temperature, "ref_log_probs")
    diffs = [abs(a - b) for s, lp in zip(kept, old) for a, b in zip(lp, s.rollout_log_probs)]
    m["logprob_abs_diff_mean"] = sum(diffs) / len(diffs)
    m["logprob_abs_diff_max"] = max(diffs)
    with timers("update"):
        n_updates = max(1, n_samples // cfg.train.global_batch_size)
        chunk = math.ceil(len(kept) / n_updates)
        for lo in range(0, len(kept), chunk):
            part = kept[lo : lo + chunk]
            if len(part) < _dp()[0]:
                continue
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
    if sync.offloader is not None:  # colocated: bytes moved to host / back this step
        m["train/offload_bytes"] = float(sync.offloader.last_offload_bytes)
        m["train/reload_bytes"] = float(sync.offloader.last_reload_bytes)
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

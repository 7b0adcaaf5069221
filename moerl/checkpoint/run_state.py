"""Run-state checkpoints of the main job: where they live, what they hold, when they are taken.

Checkpoints (``<output_dir>/checkpoints/{sft_step_N|step_N}``, torch_dist, atomic) hold the model, the
optimizer and a ``moerl_state`` extra (:class:`TrainState`): phase, SFT / RL step counters, the
PromptSampler cursors, the rollout manager's resume cursor, the weight-sync version, the summary so far
and every rank's python / numpy / torch / Megatron-tracker RNG states; a ``moerl_complete.json`` marker is
written once the directory is in place. ``resume=auto`` continues from the newest checkpoint that has it.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from moerl.checkpoint.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint
from moerl.runtime import world
from moerl.runtime.distributed import fault_injection_point
from moerl.runtime.world import broadcast_from_main, log

COMPLETE_MARKER = "moerl_complete.json"


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
    rollout: dict = field(default_factory=dict)  # RolloutManager.state_dict() (resume cursor), RL phase

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


def layout(cfg) -> dict:
    """The parallel layout a checkpoint is written in (a change reshards the model weights)."""
    p = cfg.parallel
    # the pipeline schedule places stages differently (DualPipe(V) chunks): a change reshards like TP/PP/EP;
    # model.params_dtype changes the optimizer's state (bfloat16 adds FP32 main params): the weights load
    # (cast), the optimizer state does not
    return {"world_size": world.world_size(), "tp_size": p.tp_size, "pp_size": p.pp_size, "ep_size": p.ep_size,
            "etp_size": p.expert_tp_size, "pipeline_schedule": cfg.train.pipeline_schedule,
            "params_dtype": cfg.model.params_dtype}


def saved_layout(path: Path) -> dict:
    """The :func:`layout` a complete checkpoint at ``path`` was written in (from its completion marker;
    checkpoints older than the pipeline_schedule / params_dtype keys were 1F1B / float32)."""
    marker = json.loads((Path(path) / COMPLETE_MARKER).read_text())
    return {"pipeline_schedule": "1f1b", "params_dtype": "float32", **marker["layout"]}


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
        if not (d / COMPLETE_MARKER).is_file():
            if warn:
                log(f"WARNING: skipping incomplete checkpoint {d}: no {COMPLETE_MARKER} marker")
            continue
        found.append(((0 if m.group(1) else 1, int(m.group(2))), d))
    return [d for _, d in sorted(found)]


def resolve_resume(cfg, run_dir: Path, announce: bool = True) -> Optional[Path]:
    """The checkpoint to resume from for ``cfg.resume`` ("none" | "auto" | a path), or None. With ``announce``,
    resume=auto that finds no complete checkpoint says so (a fresh start).

    Raises:
        FileNotFoundError: ``resume`` is a path without a complete checkpoint.
    """
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        found = list_complete_checkpoints(run_dir / "checkpoints")
        if not found and announce:
            log(f"resume=auto: no complete checkpoint in {run_dir / 'checkpoints'}: starting from the beginning")
        return found[-1] if found else None
    path = Path(cfg.resume)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"resume: {path} is not a complete moerl checkpoint (no {COMPLETE_MARKER}); use resume=auto or "
            "a <output_dir>/checkpoints/step_N directory"
        )
    return path


def save_checkpoint(ctx, actor, state: TrainState, samplers: dict, critic=None) -> Path:
    """Collective: model + optimizer + TrainState + every rank's RNG states into the phase's
    checkpoint directory (atomic), the critic (PPO with GAE) into its ``critic`` subdirectory, then the
    completion marker, then prune to train.keep_checkpoints."""
    state.samplers = {k: s.state_dict() for k, s in samplers.items()}
    rng: list = [None] * world.world_size()
    if world.world_size() > 1:
        torch.distributed.all_gather_object(rng, _rng_state())
    else:
        rng = [_rng_state()]
    path = checkpoint_dir(ctx.run_dir, state)
    # rank 0's copy: wall-clock fields (sft_seconds) and the rollout cursor live on rank 0
    extra = {"moerl_state": broadcast_from_main(asdict(state)), "rng": rng, "layout": layout(ctx.cfg),
             "seed": ctx.cfg.seed, "step": state.rl_step, "phase": state.phase}
    save_dist_checkpoint(actor.model, actor.optimizer, path, extra=extra)
    if critic is not None:  # after the actor's save, which replaces the whole directory
        critic.save(path / "critic")
    if world.is_main():
        tmp = path / (COMPLETE_MARKER + ".tmp")
        tmp.write_text(json.dumps({"phase": state.phase, "sft_step": state.sft_step, "rl_step": state.rl_step,
                                   "layout": layout(ctx.cfg), "time": time.time(),
                                   # data / tokenizer fingerprints: a resume with other inputs is refused
                                   "inputs": getattr(ctx, "inputs", {})}))
        tmp.replace(path / COMPLETE_MARKER)
        keep = ctx.cfg.train.keep_checkpoints
        complete = list_complete_checkpoints(path.parent, warn=False)
        if keep and len(complete) > keep:
            for old in complete[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    world.barrier()
    return path


def load_checkpoint(ctx, actor, path: Path) -> TrainState:
    """Collective: restore model, optimizer (rebuilt for the checkpoint's phase first), TrainState
    and, when the layout is unchanged, every rank's RNG states. After a TP/PP/EP/world-size,
    pipeline-schedule or model.params_dtype change the model weights reshard (and are cast) but the
    optimizer state is not loaded (it reshards over DP only; a dtype change changes its tensors) and
    the RNG states are not restored; both are warned about."""
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    saved, now = saved_layout(path), layout(ctx.cfg)
    same = saved == now
    actor.set_lr(ctx.cfg.sft.lr if marker["phase"] == "sft" else ctx.cfg.train.lr)
    if {k: v for k, v in saved.items() if k != "world_size"} == {k: v for k, v in now.items() if k != "world_size"}:
        extra = load_dist_checkpoint(actor.model, actor.optimizer, path)  # DP changes reshard
    else:
        log(f"WARNING: checkpoint layout {saved} differs from this run's {now} in TP/PP/EP/schedule/params_dtype: "
            "model weights are resharded, the optimizer state is NOT loaded (fresh Adam moments)")
        extra = load_dist_checkpoint(actor.model, None, path)
        actor.optimizer.reload_model_params()  # BF16: the FP32 main params follow the loaded weights
    state = TrainState(**extra["moerl_state"])
    if same:
        _set_rng_state(extra["rng"][world.global_rank()])
    else:
        log("WARNING: layout changed since the checkpoint; RNG states are not restored (reseeded)")
    return state


class Checkpointer:
    """Decides when to save (every train.save_every steps and/or train.save_every_minutes
    wall-clock minutes; rank 0's clock decides and broadcasts) and saves. Collective.

    ``before_save`` (optional) runs on every rank right before a save (e.g. to store the rollout
    manager's resume cursor in the state)."""

    def __init__(self, ctx, actor, state, samplers, timers):
        self.ctx, self.actor, self.state, self.samplers, self.timers = ctx, actor, state, samplers, timers
        self.last = time.time()
        self.loaded = contextlib.nullcontext  # WeightSync.trainer_loaded under colocated placement
        self.before_save = None
        self.critic = None  # the PPO critic (algorithm.advantage_estimator=gae), saved with the actor

    def __call__(self, step: int, force: bool = False) -> bool:
        fault_injection_point(self.state.phase, step)  # test-only switch; no-op unless MOERL_FAULT_EXIT_AT is set
        tr = self.ctx.cfg.train
        due = force or bool(tr.save_every and step % tr.save_every == 0)
        if tr.save_every_minutes and not due:
            due = bool(broadcast_from_main(time.time() - self.last >= 60.0 * tr.save_every_minutes))
        if not due:
            return False
        if self.before_save is not None:
            self.before_save()
        with self.timers("checkpoint"), self.loaded():
            save_checkpoint(self.ctx, self.actor, self.state, self.samplers, critic=self.critic)
        self.last = time.time()
        return True

"""Megatron-Core distributed checkpoints (torch_dist format) for model + optimizer, atomic.

The checkpoint is written by all ranks into ``<path>.tmp`` (a name every rank agrees on without
communication), then rank 0 renames it to ``path`` after a barrier. A crash mid-save leaves at
most a stale ``.tmp`` directory; ``path`` is either the old or the new checkpoint (a crash
between rank 0's two renames leaves the old one at ``<path>.old``).

Model weights in torch_dist reshard on load: a checkpoint saved at one TP/EP/PP layout loads into
another (shared design CPU_MEGATRON.md). The distributed optimizer's state is saved in its
``dp_reshardable`` format (reshards across data parallelism only; megatron-core 0.16.1's
``fully_reshardable`` gathers with ``.cuda()`` and ``fully_sharded_model_space`` is rejected by
dist_checkpointing), so after a TP/EP/PP change load with ``optimizer=None``. The saver may use
forked writer processes (``FileSystemWriterAsync.write_preloaded_data_multiproc``, one per write
bucket; TorchDistSaveShardedStrategy thread_count=2 by default); it also needs ``psutil``.

No checkpoint process outlives the trainer. megatron-core 0.16.1's synchronous torch_dist save
(``AsyncSaveShardedStrategy.save`` -> ``execute_sync``) would otherwise leave two processes per
rank behind a ``kill -9`` of the trainer: a ``multiprocessing`` *spawn* Manager server holding the
write-results queue (``filesystem_async._get_write_results_queue``, created on the first save and
kept for the life of the process) and the resource tracker it starts. Neither watches its parent.
In a synchronous save that queue is filled and read by the saving process itself, so
``save_dist_checkpoint`` hands megatron an in-process ``queue.Queue`` for the duration of the save
(no Manager, no tracker). The writer processes it forks get ``PR_SET_PDEATHSIG=SIGKILL`` (Linux
prctl, from an ``os.register_at_fork`` hook that is active only inside ``save_dist_checkpoint``),
so a trainer killed mid-save takes them with it instead of leaving them writing into ``.tmp``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

__all__ = ["save_dist_checkpoint", "load_dist_checkpoint", "unwrap_model"]

SHARDED_STRATEGY = ("torch_dist", 1)
_OPTIM_SHARDING_TYPE = "dp_reshardable"
_EXTRA_KEY = "moerl_extra"


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_SAVE_STATE = threading.local()  # .parent_pid set while this thread runs a save
_FORK_HOOK_INSTALLED = False
_LIBC: Optional[ctypes.CDLL] = None


def _set_pdeathsig_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)`` hook: in a child forked while a save runs (a
    megatron writer process), ask Linux to SIGKILL it when the forking thread's process dies; exit
    at once if that already happened before the prctl took effect."""
    parent = getattr(_SAVE_STATE, "parent_pid", None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    _SAVE_STATE.parent_pid = None  # a process the writer itself forks is not covered
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def _writer_processes_die_with_trainer():
    """Inside: megatron's torch_dist writer uses an in-process results queue instead of a spawned
    multiprocessing Manager, and the writer processes it forks die with this process (see the
    module docstring). The previous queue object is restored on exit."""
    global _FORK_HOOK_INSTALLED, _LIBC
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not _FORK_HOOK_INSTALLED:
        if sys.platform.startswith("linux"):  # resolved here: the fork hook must not run ldconfig
            _LIBC = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's prctl among them
        os.register_at_fork(after_in_child=_set_pdeathsig_in_child)
        _FORK_HOOK_INSTALLED = True
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    _SAVE_STATE.parent_pid = os.getpid()
    try:
        yield
    finally:
        _SAVE_STATE.parent_pid = None
        filesystem_async._results_queue = previous


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip Megatron DDP / Float16Module wrappers (their ``.module`` attribute)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _metadata() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "distrib_optim_sharding_type": _OPTIM_SHARDING_TYPE,
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _ensure_optimizer_state(optimizer) -> None:
    """Give a fresh (never stepped) torch Adam inside a Megatron optimizer zero-valued state (zero
    moments, step 0: what torch Adam creates at its first step, so the next step is unchanged).

    Loading: megatron-core 0.16.1 without Apex/TE reads ``state["step"]`` of every parameter in
    ``DistributedOptimizer.state_dict()`` (called by ``sharded_state_dict(is_loading=True)``) and
    asserts there is exactly one value, so loading into a fresh optimizer fails; the zeros are
    overwritten by the checkpoint's values. Saving: a checkpoint taken before the first optimizer step
    (e.g. every RL step so far was skipped: no group carried a reward signal) would hold no moments,
    and loading it would then fail (KeyError ``optimizer.state.exp_avg...``); with the zeros it holds
    the fresh state. Parameters are not touched.
    """
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        init_state_fn = getattr(opt, "init_state_fn", None)
        if inner is None or init_state_fn is None:
            continue
        if any(len(inner.state[p]) == 0 for g in inner.param_groups for p in g["params"]):
            init_state_fn(inner, getattr(opt, "config", None))
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):  # torch's own Adam keeps a step per
                # parameter; TE's / Apex's FusedAdam keep it in param_groups and refuse other state keys
                for group in inner.param_groups:
                    for p in group["params"]:
                        inner.state[p].setdefault("step", torch.tensor(0.0))


def _fill_step_0(optimizer_sd) -> None:
    """Give a loaded (non-distributed) optimizer state dict saved at step 0 its step back.

    megatron-core 0.16.1's FP32Optimizer.sharded_state_dict stores the shared per-parameter step as
    ``state["common_step"]`` only ``if step:``, so a state saved before the first optimizer step (zero
    moments, step 0: :func:`_ensure_optimizer_state`) comes back without any step and torch Adam's
    ``load_state_dict`` raises KeyError 'step'. Adds ``common_step`` 0 to every (nested) torch-format
    state dict whose parameter states lack a step; a dict that has one is left alone."""
    if isinstance(optimizer_sd, dict):
        state = optimizer_sd.get("state")
        if isinstance(state, dict) and "param_groups" in optimizer_sd:
            if "common_step" not in state and any(isinstance(v, dict) and v and "step" not in v
                                                  for v in state.values()):
                state["common_step"] = torch.tensor(0.0)
            return
        for v in optimizer_sd.values():
            _fill_step_0(v)
    elif isinstance(optimizer_sd, (list, tuple)):
        for v in optimizer_sd:
            _fill_step_0(v)


def _restore_torch_adam_steps(optimizer) -> None:
    """Set every parameter's torch-Adam ``step`` from its param group after a load.

    megatron-core 0.16.1 (torch optimizer path, i.e. no Apex/TE) saves the step in the param
    groups, but its dp_reshardable loader then copies the *pre-load* per-parameter step over it,
    and gives all parameters one shared step tensor (which torch Adam would increment once per
    parameter). Each parameter gets its own tensor holding the checkpoint's step.
    """
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group or group["step"] is None:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (a ChainedOptimizer is unrolled; stubs skipped)."""
    inners = [getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]]
    return [o for o in inners if isinstance(o, torch.optim.Optimizer)]


_KERNEL_FLAGS = ("fused", "foreach")


@contextlib.contextmanager
def _kernel_flags_kept(optimizer):
    """Keep the torch optimizers' kernel choice (each param group's ``fused`` / ``foreach``) over the block.
    torch's ``load_state_dict`` replaces the param groups with the saved ones, flags included: without this a
    checkpoint written elsewhere (another version, a GPU run) would switch the running optimizer's kernel
    (moerl.runtime.cpu_compat.fused_cpu_adam on CPU)."""
    inners = _torch_optimizers(optimizer)
    kept = [[{k: g.get(k) for k in _KERNEL_FLAGS} for g in o.param_groups] for o in inners]
    yield
    for o, flags in zip(inners, kept):
        for group, saved in zip(o.param_groups, flags):
            group.update(saved)


def _sharded_state_dict(model, optimizer, is_loading: bool) -> dict:
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
    metadata = _metadata()
    model_sd = unwrap_model(model).sharded_state_dict(metadata=metadata)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return state


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_dist_checkpoint(model, optimizer, path: Union[str, os.PathLike], extra: Optional[dict] = None) -> Path:
    """Save model (and optimizer) state with megatron.core.dist_checkpointing, torch_dist format.

    Collective: every rank of the job must call it with the same ``path``.

    Args:
        model: the Megatron GPTModel, possibly wrapped in Megatron DDP.
        optimizer: a MegatronOptimizer from get_megatron_optimizer, or None (model only).
        path: checkpoint directory on a file system all ranks share; replaced if it exists.
        extra: picklable, rank-independent values (step, weight_version, data-loader position,
            RNG seeds...) stored in the checkpoint's common state; returned by
            ``load_dist_checkpoint``.

    Returns:
        Path of the checkpoint directory.

    Raises:
        TypeError: ``extra`` is not a dict.
    """
    from megatron.core import dist_checkpointing

    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    path = Path(path).absolute()
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state = _sharded_state_dict(model, optimizer, is_loading=False)
    state[_EXTRA_KEY] = dict(extra or {})
    with _writer_processes_die_with_trainer():
        dist_checkpointing.save(
            state,
            str(tmp),
            sharded_strategy=SHARDED_STRATEGY,
            content_metadata={"moerl_optim_sharding_type": _OPTIM_SHARDING_TYPE,
                              "has_optimizer": optimizer is not None},
        )
    _barrier()
    if _rank() == 0:
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return path


def load_dist_checkpoint(model, optimizer, path: Union[str, os.PathLike]) -> dict[str, Any]:
    """Load a checkpoint written by ``save_dist_checkpoint`` into ``model`` (and ``optimizer``).

    Collective. The current TP/EP/PP layout may differ from the saving one (torch_dist reshards).
    Model parameters are loaded strictly (every parameter must be in the checkpoint).

    Args:
        model: a freshly built (or trained) GPTModel, possibly DDP-wrapped, same architecture.
        optimizer: the MegatronOptimizer to restore, or None to load the model only.
        path: checkpoint directory.

    Returns:
        the ``extra`` dict given at save time.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: an optimizer is requested but the checkpoint has none.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    content = dist_checkpointing.load_content_metadata(str(path)) or {}
    if optimizer is not None and not content.get("has_optimizer", True):
        raise ValueError(f"checkpoint {path} has no optimizer state; pass optimizer=None")
    state = _sharded_state_dict(model, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, str(path), sharded_strategy=SHARDED_STRATEGY)
    unwrap_model(model).load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        # no_grad: with fp32 params the distributed optimizer's main params are views of the
        # model params, and 0.16.1 copies into them in place.
        _fill_step_0(loaded["optimizer"])
        with _kernel_flags_kept(optimizer), torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_torch_adam_steps(optimizer)
    return dict(loaded.get(_EXTRA_KEY, {}))

"""Trainer memory offload for colocated placement: move an actor's parameters, gradient buffers and
optimizer state to host memory while the rollout servers use the accelerator, then put them back.

The offload works on storages, not on tensors (the approach of FSDP's ``_free_storage`` /
``_alloc_storage``): every tensor to offload is reduced to its ``untyped_storage()``; storages
shared by several tensors are handled once (Megatron DDP's ``_ParamAndGradBuffer.param_data`` /
``grad_data`` are flat storages that every parameter, ``param.main_grad``, bucket and
distributed-optimizer shard is a view of). Each storage's bytes are copied into a host buffer
(pinned when the storage lives on CUDA) and the storage is resized to 0 bytes, which frees the
device memory while every tensor object, view and alias keeps pointing at the same (now empty)
storage. Reload resizes each storage back to its saved size and copies the bytes in, so all those
views see exactly the bytes they had (bitwise). Nothing is re-created: optimizers, DDP hooks and
buckets keep working without being rebuilt.

What is collected from a moerl.train.actor.MegatronActor:

* every parameter of ``actor.model`` (including dual-pipeline stage chunks, which live in it);
* for a trainable actor, every DDP buffer's ``param_data`` (None without the distributed
  optimizer) and ``grad_data`` (``ddp_model.buffers`` and ``expert_parallel_buffers``), and each
  parameter's ``main_grad`` / ``grad``;
* every tensor of the Megatron optimizer's torch optimizers (``ChainedOptimizer`` is unrolled):
  the parameters they step (fp32 main params when the model is not fp32; views of the model
  parameters otherwise), their ``.grad`` and every tensor in ``optimizer.state`` (Adam ``exp_avg``,
  ``exp_avg_sq``, ``step``).

A frozen actor (``trainable=False``, e.g. the reference policy) has parameters only. Module buffers
(rotary tables, router expert bias bookkeeping) are not moved.

While offloaded, the actor must not be used: its tensors have 0-byte storages and some kernels
(e.g. the optimizer step on CPU) do not check storage bounds, so using it is undefined behaviour
(it can crash the process, not only raise). Rebuilding the optimizer (``set_lr``) while offloaded is not
supported: reload first (``ActorOffloader.loaded()``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["OffloadState", "offload_actor", "reload_actor", "actor_tensors", "ActorOffloader"]


@dataclass
class OffloadState:
    """What ``offload_actor`` took away, needed by ``reload_actor``.

    Attributes:
        storages: the offloaded torch.UntypedStorage objects (each now 0 bytes), one per distinct
            storage.
        host: one uint8 host tensor per storage with its saved bytes (pinned when the storage was on
            CUDA); same order as ``storages``.
        nbytes: total bytes moved to the host (sum of the storages' sizes before the offload).
        reloaded: set by ``reload_actor``; a state can be reloaded once.
    """

    storages: list = field(default_factory=list)
    host: list = field(default_factory=list)
    nbytes: int = 0
    reloaded: bool = False


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Tensors held by a Megatron optimizer (a ChainedOptimizer is unrolled): the torch optimizers'
    stepped parameters, their grads and their state tensors."""
    if optimizer is None:
        return
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is not None:
        for sub in subs:
            yield from _optimizer_tensors(sub)
        return
    torch_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "optimizer", None)
    if torch_opt is None:  # a stub optimizer (a rank without parameters of this kind)
        return
    for group in torch_opt.param_groups:
        for p in group["params"]:
            yield p
            if p.is_leaf and p.grad is not None:
                yield p.grad
    for st in torch_opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                yield v


def actor_tensors(actor, include_optimizer: bool = True) -> list[torch.Tensor]:
    """Every tensor ``offload_actor`` moves (see the module docstring), possibly several views of
    one storage.

    Args:
        actor: a MegatronActor (anything with ``.model``; ``.ddp_model`` / ``.optimizer`` are used
            when present and the actor is trainable).
        include_optimizer: False keeps the DDP gradient buffers and the optimizer state out (weights
            only).
    Raises:
        TypeError: ``actor`` has no ``model`` module.
    """
    model = getattr(actor, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload needs a MegatronActor (with a .model torch.nn.Module), got {type(actor).__name__}")
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        if include_optimizer:
            for name in ("main_grad", "grad"):
                g = getattr(p, name, None) if (name == "main_grad" or p.is_leaf) else None
                if isinstance(g, torch.Tensor):
                    out.append(g)
    if not include_optimizer or not getattr(actor, "trainable", False):
        return out
    ddp = getattr(actor, "ddp_model", None)
    for buf in list(getattr(ddp, "buffers", None) or []) + list(getattr(ddp, "expert_parallel_buffers", None) or []):
        for name in ("param_data", "grad_data"):
            t = getattr(buf, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    out.extend(_optimizer_tensors(getattr(actor, "optimizer", None)))
    return out


def _flat_bytes(storage) -> torch.Tensor:
    """A uint8 tensor viewing all of ``storage``."""
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


def offload_actor(actor, include_optimizer: bool = True) -> OffloadState:
    """Copy the actor's parameters, gradient buffers and optimizer state to host memory and free
    their storages (each resized to 0 bytes).

    Aliases are preserved: tensors sharing a storage (DDP flat buffers and every parameter /
    main_grad / bucket / optimizer-shard view of them) are offloaded once, and every tensor object
    stays in place with its shape, strides and storage offset; only the storage's bytes go away.
    On CPU the "device" storage is host memory too: it is still freed (nbytes 0) and the bytes live
    in a separate host tensor. Storages that are already empty are skipped. On CUDA the copies go
    to pinned host memory and ``torch.cuda.empty_cache()`` returns the freed blocks to the driver
    (so another process, e.g. a colocated SGLang server, can use them).

    Args:
        actor: a MegatronActor (trainable or frozen).
        include_optimizer: False offloads the weights only (a reference policy).
    Returns:
        OffloadState with the host copies; ``.nbytes`` is the number of bytes moved.
    Raises:
        TypeError: not an actor (no ``.model``).
        RuntimeError: a storage that cannot be resized (e.g. memory-mapped or from numpy); nothing is
            freed in that case (checked before any storage is resized).
    """
    seen: dict[tuple, object] = {}
    for t in actor_tensors(actor, include_optimizer):
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        key = (s.device.type, s.device.index, s.data_ptr())
        if key not in seen:
            seen[key] = s
    storages = list(seen.values())
    for s in storages:
        if not s.resizable():
            raise RuntimeError(f"cannot offload a non-resizable storage ({s.nbytes()} bytes on {s.device}); "
                               "offload needs tensors allocated by torch (not from numpy / mmap)")
    state = OffloadState()
    for s in storages:
        flat = _flat_bytes(s)
        pin = flat.is_cuda
        host = torch.empty(flat.numel(), dtype=torch.uint8, device="cpu", pin_memory=pin)
        host.copy_(flat, non_blocking=pin)
        state.storages.append(s)
        state.host.append(host)
        state.nbytes += flat.numel()
    if torch.cuda.is_available() and any(h.is_pinned() for h in state.host):
        torch.cuda.synchronize()  # the async device-to-host copies must land before the memory is freed
    for s in state.storages:
        s.resize_(0)
    if any(h.is_pinned() for h in state.host):
        torch.cuda.empty_cache()  # hand the freed blocks back to the driver (the rollout servers allocate outside torch)
    return state


def reload_actor(actor, state: OffloadState) -> int:
    """Undo ``offload_actor``: resize every offloaded storage back to its saved size on its device
    and copy the saved bytes in, so every tensor / view of it holds bitwise the bytes it had.

    Args:
        actor: the actor that was offloaded (only checked for being an actor; the storages in
            ``state`` are what is restored).
        state: the OffloadState returned by ``offload_actor``.
    Returns:
        Number of bytes copied back (equal to ``state.nbytes``).
    Raises:
        TypeError: ``state`` is not an OffloadState, or ``actor`` is not an actor.
        RuntimeError: ``state`` was already reloaded, or a storage was re-grown by someone else
            meanwhile (its memory would be overwritten).
    """
    if not isinstance(state, OffloadState):
        raise TypeError(f"reload_actor needs the OffloadState from offload_actor, got {type(state).__name__}")
    if not isinstance(getattr(actor, "model", None), torch.nn.Module):
        raise TypeError(f"reload_actor needs a MegatronActor (with a .model torch.nn.Module), got {type(actor).__name__}")
    if state.reloaded:
        raise RuntimeError("this OffloadState was already reloaded; offload again before reloading")
    for s in state.storages:
        if s.nbytes() != 0:
            raise RuntimeError(f"an offloaded storage was re-allocated meanwhile ({s.nbytes()} bytes on {s.device}); "
                               "the actor was modified while offloaded")
    total = 0
    for s, host in zip(state.storages, state.host):
        s.resize_(host.numel())
        _flat_bytes(s).copy_(host, non_blocking=host.is_pinned())
        total += host.numel()
    if torch.cuda.is_available() and any(h.is_pinned() for h in state.host):
        torch.cuda.synchronize()
    state.reloaded = True
    state.host = []  # release the host copies
    return total


class ActorOffloader:
    """Offload / reload of one or more actors as one unit, idempotent, for
    moerl.rollout.placement.RolloutPlacement's ``offload_trainer`` / ``reload_trainer`` hooks.

    Args:
        actors: (actor, include_optimizer) pairs, e.g. [(policy, True), (reference, False)]; None
            entries are skipped.
        log: optional callable taking one message string (called after each offload / reload with
            the bytes moved).

    Attributes:
        offloaded: whether the actors are on the host now.
        last_offload_bytes / last_reload_bytes: bytes moved by the latest offload / reload.
        total_offload_bytes / total_reload_bytes: running totals.
    """

    def __init__(self, actors: Sequence[tuple[object, bool]], log=None):
        self.actors = [(a, bool(opt)) for a, opt in actors if a is not None]
        self.log = log
        self._states: Optional[list[OffloadState]] = None
        self.last_offload_bytes = self.last_reload_bytes = 0
        self.total_offload_bytes = self.total_reload_bytes = 0

    @property
    def offloaded(self) -> bool:
        return self._states is not None

    def add(self, actor, include_optimizer: bool = True) -> None:
        """Manage one more actor; when the others are offloaded now, it is offloaded at once too
        (so the next reload brings everything back)."""
        if actor is None:
            return
        self.actors.append((actor, bool(include_optimizer)))
        if self._states is not None:
            st = offload_actor(actor, include_optimizer=include_optimizer)
            self._states.append(st)
            self.last_offload_bytes += st.nbytes
            self.total_offload_bytes += st.nbytes

    def offload(self) -> int:
        """Offload every actor (no-op returning 0 when already offloaded); returns bytes moved."""
        if self._states is not None:
            return 0
        self._states = [offload_actor(a, include_optimizer=opt) for a, opt in self.actors]
        n = sum(s.nbytes for s in self._states)
        self.last_offload_bytes = n
        self.total_offload_bytes += n
        if self.log is not None:
            self.log(f"offload: {n / 2**20:.1f} MiB of trainer weights / grads / optimizer state moved to host")
        return n

    def reload(self) -> int:
        """Reload every actor (no-op returning 0 when not offloaded); returns bytes moved."""
        if self._states is None:
            return 0
        states, self._states = self._states, None
        n = sum(reload_actor(a, s) for (a, _), s in zip(self.actors, states))
        self.last_reload_bytes = n
        self.total_reload_bytes += n
        if self.log is not None:
            self.log(f"reload: {n / 2**20:.1f} MiB of trainer weights / grads / optimizer state back on device")
        return n

    @contextlib.contextmanager
    def loaded(self):
        """Context in which the actors are on the device: reloads them if offloaded and offloads them
        again on exit (for checkpoints, exports or an optimizer rebuild between rollouts)."""
        was = self.offloaded
        self.reload()
        try:
            yield
        finally:
            if was:
                self.offload()

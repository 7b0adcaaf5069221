"""A reusable shared-memory arena the trainer's HF export writes into (issue #14: one copy, not two).

The tensor weight sync (moerl.rollout.weight_sync.sync_weights_from_tensor) passes a tensor whose
storage is already in shared memory by its own handle, without copying it into a bucket buffer. When
the export (moerl.checkpoint.hf_convert.gather_megatron_to_hf ``out_alloc=``) writes every HF tensor
straight into this arena instead of a private clone, the export's own copy is the only copy on the
trainer side, and the server's copy into its parameters the only other one.

Layout: an arena has two slots (double buffer). A slot is one or more uint8 storages in /dev/shm
(torch's file_system sharing, as moerl.rollout.weight_sync.SharedBucketBuffers); :meth:`ArenaSlot.alloc`
hands out 64-byte aligned views of them in call order. A slot is reused export after export: while the
sequence of (name, shape, dtype) is unchanged every tensor lands at the same offset of the same files,
so a server that keeps the files mapped (moerl.rollout.engine_weights.WeightUpdater._keep_shared_mappings)
maps nothing and takes no page fault on the next sync. When a slot runs out of room it adds a storage
(``grow``); the next time that slot is begun, a slot made of several storages is replaced by ONE
storage of the bytes last used (one more new file, then stable again); an empty slot begun after the
other slot was filled starts with one storage of that export's size. So the first export grows slot 0
(several files), the second fills slot 1 (one file), the third re-makes slot 0 as one file, and from
the third export on no new file is made while the layout stays the same.

Lifetimes (exactly):
  * The tensors :meth:`ArenaSlot.alloc` returned stay valid and unchanged until the same slot is
    begun again by :meth:`SharedExportArena.next`; until then nothing in this module writes them.
  * :meth:`SharedExportArena.next` never returns the slot last passed to :meth:`SharedExportArena.publish`
    (the slot whose tensors the failover restorer of the current weight_version re-sends). So while
    version v (published, slot s) can still be restored, version v+1 is exported into the other slot;
    only after v+1 is published may slot s be overwritten (by v+2). A version that is exported but
    never published (its push failed) leaves the published slot alone, and the next export reuses
    the unpublished slot.
  * Before anything is published, :meth:`next` alternates 0, 1, 0, ...
  * The servers copy the tensors while they answer the update request, so a slot may be refilled as
    soon as the sync that sent it returned (and it is not the published slot).
Memory: up to two exported state dicts in /dev/shm (the restorer used to keep one private copy while
the next was exported, so the peak is the same two copies; /dev/shm must have room for them). With
``slots=1`` (no failover restorer to protect) one: :meth:`SharedExportArena.next` then always returns
slot 0, and :meth:`SharedExportArena.publish` is refused.
Not thread-safe: one trainer thread exports and publishes.
"""

from __future__ import annotations

from typing import Optional

import torch

from moerl.rollout.tensor_serde import share_filename

__all__ = ["ArenaSlot", "SharedExportArena", "shared_buffer"]

_ALIGN = 64  # bytes; every tensor starts at a multiple of this (as in SharedBucketBuffers)
_MIN_STORAGE = 1 << 20  # bytes; storages are sized in whole MiB


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of at least ``nbytes`` bytes, rounded up to whole MiB (at least 1 MiB), whose storage is
    a /dev/shm file of torch's file_system strategy (moerl.rollout.tensor_serde.share_filename)."""
    buf = torch.empty(max(_MIN_STORAGE, -(-nbytes // _MIN_STORAGE) * _MIN_STORAGE), dtype=torch.uint8)
    share_filename(buf.untyped_storage())
    return buf


class ArenaSlot:
    """One slot of a :class:`SharedExportArena`: a bump allocator over shared uint8 storages.

    Args:
        index: the slot's number in its arena (0 or 1).
        initial_bytes: size of the first storage made when the slot is empty (rounded up to 1 MiB).
    """

    def __init__(self, index: int, initial_bytes: int):
        self.index = index
        self._initial = int(initial_bytes)
        self._chunks: list[torch.Tensor] = []
        self._chunk = 0  # storage the cursor is in
        self._at = 0  # byte offset in that storage
        self.used = 0  # bytes handed out (aligned) since the slot was begun
        self.names: list[str] = []  # names allocated since the slot was begun, in order
        self._seen: set[str] = set()

    def _reset(self, size_hint: int = 0) -> None:
        """Start over (called by :meth:`SharedExportArena.next`): a slot of several storages becomes one
        storage of the bytes used last time, so the layout settles into a single file; an empty slot
        starts with one storage of ``size_hint`` bytes (the other slot's last export) when given."""
        if len(self._chunks) > 1:
            self._chunks = [shared_buffer(self.used)]
        elif not self._chunks and size_hint > 0:
            self._chunks = [shared_buffer(size_hint)]
        self._chunk, self._at, self.used, self.names, self._seen = 0, 0, 0, [], set()

    def alloc(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` / ``dtype`` in shared memory (a view of this slot's
        storage, 64-byte aligned), for the export to copy HF tensor ``name`` into.

        Valid until this slot is begun again (see the module docstring).
        Raises:
            ValueError: ``name`` was already allocated in this slot since it was begun, or ``dtype``
                is not a torch.dtype / ``shape`` has a negative size.
        """
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"alloc({name!r}): dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"alloc({name!r}): shape {shape} has a negative size")
        if name in self._seen:
            raise ValueError(f"alloc({name!r}): already allocated in arena slot {self.index} since it was begun; "
                             f"every exported HF name must be allocated once per export")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        span = -(-nbytes // _ALIGN) * _ALIGN
        while True:
            if self._chunk >= len(self._chunks):  # grow: a new storage (at least this tensor, at least the last one)
                size = max(self._initial, span, self._chunks[-1].numel() if self._chunks else 0)
                self._chunks.append(shared_buffer(size))
            buf = self._chunks[self._chunk]
            if self._at + nbytes <= buf.numel():
                break
            self._chunk, self._at = self._chunk + 1, 0
        view = buf[self._at:self._at + nbytes].view(dtype).view(shape)
        self._at += span
        self.used += span
        self.names.append(name)
        self._seen.add(name)
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory this slot holds."""
        return sum(c.numel() for c in self._chunks)

    @property
    def storages(self) -> list[torch.UntypedStorage]:
        """This slot's shared storages (one after the layout settled)."""
        return [c.untyped_storage() for c in self._chunks]


class SharedExportArena:
    """Two reusable shared-memory slots (double buffer) for the trainer's HF export; lifetimes in the
    module docstring.

    Usage (moerl.train.weight_sync.WeightSync)::

        slot = arena.next()                         # never the published slot
        sd = actor.export_hf_state_dict(dst=0, out_alloc=slot.alloc)
        ... push sd, register a restorer holding sd ...
        arena.publish(slot)                         # sd's slot is kept until another slot is published

    Args:
        initial_bytes: size of a slot's first storage (default 64 MiB; a slot grows as needed and
            settles into one storage of the export's size on its second use).
        slots: 2 (double buffer, for a failover restorer that keeps the published slot) or 1 (no
            restorer: every export overwrites the one slot, after the sync that sent it returned).
    Raises:
        ValueError: initial_bytes < 1 or slots not 1 or 2.
    """

    def __init__(self, initial_bytes: int = 64 << 20, slots: int = 2):
        if initial_bytes < 1:
            raise ValueError(f"initial_bytes must be >= 1, got {initial_bytes}")
        if slots not in (1, 2):
            raise ValueError(f"slots must be 1 or 2, got {slots!r}")
        self.slots = [ArenaSlot(i, initial_bytes) for i in range(slots)]
        self.published: Optional[int] = None  # the slot the current restorer holds
        self._last: Optional[int] = None  # the slot last returned by next()

    def next(self) -> ArenaSlot:
        """Begin the slot the next export writes into: the one that is not published (before any
        publish: the other one than last time). Its earlier tensors are overwritten from now on."""
        if len(self.slots) == 1:
            self.slots[0]._reset()
            return self.slots[0]
        avoid = self.published if self.published is not None else self._last
        i = 0 if avoid is None else 1 - avoid
        self._last = i
        slot = self.slots[i]
        slot._reset(size_hint=self.slots[1 - i].used)
        return slot

    def publish(self, slot: ArenaSlot) -> None:
        """Mark ``slot`` as holding the weights the restorer re-sends: :meth:`next` avoids it until
        another slot is published. Raises ValueError for a slot of another arena, or in a one-slot
        arena (its slot is overwritten by the next export: nothing can be kept for a restorer)."""
        if not any(slot is s for s in self.slots):
            raise ValueError("publish() got a slot of another arena")
        if len(self.slots) == 1:
            raise ValueError("a one-slot SharedExportArena cannot publish (the next export overwrites it); "
                             "use slots=2 when a failover restorer keeps the exported tensors")
        self.published = slot.index

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory held by every slot."""
        return sum(s.nbytes for s in self.slots)

    def release(self) -> None:
        """Drop every storage (their /dev/shm files go when the servers drop their mappings)."""
        self.slots = [ArenaSlot(s.index, s._initial) for s in self.slots]
        self.published = self._last = None

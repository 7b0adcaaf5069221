"""SGLang's wire format for /update_weights_from_tensor: MultiprocessingSerializer payloads.

SGLang 0.5.9 (``sglang.srt.utils.common.MultiprocessingSerializer``) sends tensors as base64 text of
a pickle written by ``multiprocessing.reduction.ForkingPickler``; ``serialized_named_tensors`` of
``UpdateWeightsFromTensorReqInput`` holds one such string per TP rank, and TP rank r unpickles
element r (``sglang.srt.managers.tp_worker``). What the pickle holds depends on ``load_format``:

  * ``None`` / ``"direct"``: a list of ``(name, tensor)`` pairs (HF on-disk names); a tensor may be
    wrapped in ``LocalSerializedTensor`` (``values``: one nested serialized tensor per rank).
  * ``"flattened_bucket"``: ``{"flattened_tensor": uint8 [N], "metadata": [FlattenedTensorMetadata
    (name, shape, dtype, start_idx, end_idx, numel)]}`` (``sglang.srt.weight_sync.tensor_bucket``):
    tensor i is ``flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)``.

A tensor inside the pickle is either inline (plain pickling: ``torch._utils._rebuild_tensor_v2`` on
bytes; what :func:`serialize_named_tensors` writes, readable by SGLang and by this module on any
machine), or a same-host shared-memory handle (:func:`serialize_shared`: torch.multiprocessing's
reducers, ``reduce_tensor`` -> ``rebuild_tensor`` / ``rebuild_typed_storage`` /
``rebuild_storage_filename``, the CPU analogue of the CUDA IPC handles SGLang's own trainers send).

Shared-memory handles use torch's *file_system* sharing strategy (a storage is a file in /dev/shm,
named ``/torch_<pid>_<n>_<k>``, whose reference count lives in the mapping; torch's
``torch_shm_manager`` unlinks what a dead process left). The *file_descriptor* strategy (torch's
default) cannot reach an unrelated process: its ``DupFd`` is fetched from the sender's
``multiprocessing.resource_sharer`` with the sender's multiprocessing authkey, which only a
multiprocessing family shares, so a rollout server started as its own program (``moerl serve``,
SGLang) cannot open it; :func:`deserialize` refuses it by name. Reference counts: each pickling of a
storage adds one reference for its receiver (``_shared_incref``) and each unpickling gives it back
(``_shared_decref`` in ``rebuild_storage_filename``), so every payload must be unpickled exactly
once (one payload per server and TP rank; see moerl.rollout.weight_sync). A CUDA tensor (CUDA IPC
handle) cannot be opened by the CPU server: refused with a clear error.

Trust: unpickling data from the network is what SGLang does, and it is only as safe as the network.
:func:`deserialize` resolves only an allow-list of exact globals (tensor / storage rebuilders,
dtypes, ``torch.Size``, ``OrderedDict`` and stand-ins for SGLang's two payload classes; it replaces
``torch.storage._load_from_bytes`` by a ``torch.load(weights_only=True)``, and checks a shared-memory
handle before torch opens it: a ``/dev/shm/torch_*`` name, a size within that file, the sender's
``torch_shm_manager`` socket), so a payload cannot name arbitrary callables or files; but the
server must still listen only on addresses that trusted trainers reach (``--host``: loopback or a
private cluster network), as SGLang's must.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

import torch

__all__ = ["FlattenedTensorMetadata", "LocalSerializedTensor", "TENSOR_LOAD_FORMATS", "deserialize",
           "flatten_bucket", "named_tensors_from_payload", "serialize", "serialize_named_tensors",
           "serialize_shared", "share_filename", "shared_storages"]

#: load_format values of /update_weights_from_tensor that the reference server reads.
TENSOR_LOAD_FORMATS = (None, "direct", "flattened_bucket")


@dataclass
class FlattenedTensorMetadata:
    """Stand-in for ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` (same fields):
    tensor ``name`` is bytes ``start_idx:end_idx`` (``numel`` bytes) of the flattened uint8 bucket,
    viewed as ``dtype`` and reshaped to ``shape``."""

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """Stand-in for ``sglang.srt.model_executor.model_runner.LocalSerializedTensor``: ``values[r]``
    is the serialized tensor for TP rank r (what verl sends per tensor)."""

    values: list

    def get(self, rank: int) -> torch.Tensor:
        """The tensor of TP rank ``rank`` (ValueError when there is no such element)."""
        if not 0 <= rank < len(self.values):
            raise ValueError(f"LocalSerializedTensor has {len(self.values)} values, no rank {rank}")
        return deserialize(self.values[rank])


def _load_storage_bytes(b: bytes):
    # torch.storage._load_from_bytes unpickles with weights_only=False; a storage needs no more than this
    return torch.load(io.BytesIO(b), weights_only=True)


def _no_cuda_ipc(*args, **kwargs):
    raise ValueError("the payload holds CUDA tensors (CUDA IPC handles), which the CPU reference server "
                     "cannot open; serialize CPU tensors (e.g. moerl.rollout.tensor_serde.serialize_named_tensors)")


def _no_fd_sharing(*args, **kwargs):
    raise ValueError("the payload holds file-descriptor shared-memory handles (torch's file_descriptor sharing "
                     "strategy), which only processes of one multiprocessing family can open; send file_system "
                     "handles (moerl.rollout.tensor_serde.serialize_shared) or inline bytes (serialize_named_tensors)")


#: directory where shm_open (torch's file_system sharing) keeps its files, and the names torch gives them
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")


#: tries of a call that registers a shared-memory file with torch_shm_manager (see :func:`_with_shm_manager`)
SHM_MANAGER_TRIES = 5
_SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"


def _with_shm_manager(call, *args):
    """``call(*args)``, tried again (up to SHM_MANAGER_TRIES in all) when torch's libshm raises its
    manager-connection timeout. libshm waits only 1 s (one poll) for torch_shm_manager's "OK" to a
    registration, which a loaded machine can miss (pytorch/pytorch#2482; seen here on 2 busy cores). The
    two calls wrapped here register a file before they create or map it, so one that raises has created,
    mapped and counted nothing: the next try starts clean (a late "OK" left on the socket is read as the next
    registration's, and every answer is "OK"). Any other error is raised at once."""
    for attempt in range(SHM_MANAGER_TRIES):
        try:
            return call(*args)
        except RuntimeError as e:
            if _SHM_MANAGER_TIMEOUT not in str(e) or attempt == SHM_MANAGER_TRIES - 1:
                raise


def share_filename(storage: torch.UntypedStorage) -> tuple[bytes, bytes, int]:
    """``storage._share_filename_cpu_()``: a CPU storage moved into a /dev/shm file of torch's file_system
    strategy (once; a storage already there keeps its file), as (manager socket, handle, nbytes); the
    manager's registration timeout is tried again (:func:`_with_shm_manager`)."""
    return _with_shm_manager(storage._share_filename_cpu_)


def _rebuild_shared_storage(cls, manager, handle, size, dtype=None):
    """torch.multiprocessing.reductions.rebuild_storage_filename after checking its arguments: a
    torch shared-memory file that exists on this host and holds ``size`` bytes, and the sender's
    ``torch_shm_manager`` socket (not any path)."""
    from torch.multiprocessing.reductions import rebuild_storage_filename

    if cls is not torch.UntypedStorage or dtype is not None:
        raise ValueError("a shared-memory storage handle must rebuild a torch.UntypedStorage (no dtype)")
    if not (isinstance(handle, bytes) and _SHM_NAME.fullmatch(handle)):
        raise ValueError(f"shared-memory handle {handle!r} is not a torch /dev/shm name (/torch_<pid>_<n>_<k>)")
    if not (isinstance(manager, bytes) and manager.startswith(b"/") and manager.endswith(b"/manager.sock")
            and os.path.basename(os.path.dirname(manager)).startswith(b"torch-shm-dir-")):
        raise ValueError(f"shared-memory handle names {manager!r}, not a torch_shm_manager socket")
    if type(size) is not int or size < 0:
        raise ValueError(f"shared-memory handle size must be an int >= 0, got {size!r}")
    path = SHM_DIR + handle.decode()
    try:
        have = os.stat(path).st_size
    except FileNotFoundError:
        raise ValueError(f"shared-memory handle {path} does not exist on this host: the sender runs on another "
                         f"machine or in another /dev/shm (container), or released the buffer; send inline "
                         f"bytes instead (transport 'bytes')") from None
    if size > have:
        raise ValueError(f"shared-memory handle {path} claims {size} bytes, the file holds {have}")
    return _with_shm_manager(rebuild_storage_filename, cls, manager, handle, size)


def _rebuild_empty_storage(cls):
    """torch.multiprocessing.reductions.rebuild_storage_empty, for torch.UntypedStorage only."""
    if cls is not torch.UntypedStorage:
        raise ValueError("an empty shared storage must be a torch.UntypedStorage")
    return cls()


def _rebuild_shared_tensor(cls, storage, metadata):
    """torch.multiprocessing.reductions.rebuild_tensor for a plain tensor on a storage (torch's
    ``set_`` refuses sizes / strides outside the storage)."""
    from torch.multiprocessing.reductions import rebuild_tensor

    if cls not in (torch.Tensor, torch.nn.Parameter) or not isinstance(storage, torch.TypedStorage):
        raise ValueError("a shared tensor must rebuild a torch.Tensor on a typed storage")
    return rebuild_tensor(cls, storage, metadata)


def _allowed() -> dict[tuple[str, str], Any]:
    import collections

    import torch._utils as tu
    import torch.multiprocessing.reductions as red

    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): tu._rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): tu._rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): tu._rebuild_parameter,
        ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
        ("torch", "Size"): torch.Size, ("torch", "Tensor"): torch.Tensor,
        ("torch", "UntypedStorage"): torch.UntypedStorage, ("torch", "device"): torch.device,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage, ("torch.storage", "TypedStorage"): torch.TypedStorage,
        ("torch._tensor", "_rebuild_from_type_v2"): torch._tensor._rebuild_from_type_v2,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _no_cuda_ipc,
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
        ("moerl.rollout.tensor_serde", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
        ("moerl.rollout.tensor_serde", "LocalSerializedTensor"): LocalSerializedTensor,
        # same-host shared memory (CPU), exactly what reduce_tensor + the file_system strategy write
        ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_shared_tensor,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): red.rebuild_typed_storage,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_shared_storage,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_empty_storage,
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _no_fd_sharing,
    }
    for n in ("list", "dict", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "object"):
        table[("builtins", n)] = __builtins__[n] if isinstance(__builtins__, dict) else getattr(__builtins__, n)
    return table


_ALLOWED: Optional[dict] = None


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        global _ALLOWED
        if _ALLOWED is None:
            _ALLOWED = _allowed()
        got = _ALLOWED.get((module, name))
        if got is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            got = getattr(torch, name)
        if got is None:
            raise ValueError(f"the payload names {module}.{name}, which the reference server does not "
                             f"unpickle (only tensors, storages, dtypes and SGLang's bucket classes)")
        return got


def deserialize(data: Union[str, bytes]) -> Any:
    """Read one MultiprocessingSerializer payload (base64 text, or the raw pickle bytes).

    Implements the reading side of SGLang's ``MultiprocessingSerializer.deserialize`` with an
    allow-list of globals (see the module docstring for the trust assumption).
    Raises:
        ValueError: not base64, not a pickle, or a pickle naming a global outside the allow-list
            (the message names it); CUDA IPC handles.
    """
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"not base64 text: {e}") from e
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"expected base64 text or bytes, got {type(data).__name__}")
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except ValueError:
        raise
    except Exception as e:  # truncated / corrupt pickle, failed storage rebuild
        raise ValueError(f"could not unpickle the payload: {type(e).__name__}: {e}") from e


def _unflatten(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(bucket, dict) or "flattened_tensor" not in bucket or "metadata" not in bucket:
        raise ValueError('load_format "flattened_bucket" needs a dict {"flattened_tensor", "metadata"}, '
                         f"got {type(bucket).__name__}")
    flat, meta = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D tensor")
    flat = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    out = []
    for m in meta:
        for f in ("name", "shape", "dtype", "start_idx", "end_idx"):
            if not hasattr(m, f):
                raise ValueError(f"flattened bucket metadata entry lacks {f!r}")
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            raise ValueError(f"flattened bucket metadata of {m.name!r}: bytes {m.start_idx}:{m.end_idx} "
                             f"outside the {flat.numel()}-byte bucket")
        try:
            out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(tuple(m.shape))))
        except RuntimeError as e:
            raise ValueError(f"flattened bucket tensor {m.name!r}: {e}") from e
    return out


def named_tensors_from_payload(obj: Any, load_format: Optional[str] = None,
                               tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list of one deserialized payload, as SGLang's ModelRunner reads it.

    Args:
        obj: what :func:`deserialize` returned for this rank's element.
        load_format: None or "direct" (a list of (name, tensor | LocalSerializedTensor)) or
            "flattened_bucket" (a dict flattened_tensor + metadata, see the module docstring).
        tp_rank: rank whose value a LocalSerializedTensor yields.
    Raises:
        ValueError: another load_format, or a payload of the wrong shape (message names it).
    """
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format={load_format!r} is not supported; use one of {list(TENSOR_LOAD_FORMATS)}")
    if isinstance(obj, Mapping):  # a dict {name: tensor} is accepted as well (same pairs)
        obj = list(obj.items())
    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"the payload must be a list of (name, tensor) pairs, got {type(obj).__name__}")
    out = []
    for k, pair in enumerate(obj):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"payload element {k} must be a (name, tensor) pair")
        name, t = pair
        if isinstance(t, LocalSerializedTensor):
            t = t.get(tp_rank)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"payload element {k} ({name!r}) holds a {type(t).__name__}, not a tensor")
        out.append((name, t))
    return out


def serialize(obj: Any) -> str:
    """base64 text of a plain pickle of ``obj`` with tensors inline (SGLang's
    ``MultiprocessingSerializer.serialize(obj, output_str=True)`` reads the same bytes; no shared
    memory, so the receiver may be on another machine). Tensors must be on the CPU."""
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            tp_size: int = 1) -> list[str]:
    """``serialized_named_tensors`` for /update_weights_from_tensor with load_format null: one
    identical element per TP rank of the receiving server (SGLang gives element r to TP rank r).

    Args:
        named: {HF name: tensor} or (name, tensor) pairs; any dtype, any device (copied to the CPU,
            contiguous).
        tp_size: TP size of the receiving server (>= 1).
    Raises:
        ValueError: tp_size < 1.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    items = list(named.items()) if isinstance(named, Mapping) else list(named)
    blob = serialize([(n, t.detach().to("cpu").contiguous()) for n, t in items])
    return [blob] * tp_size


def flatten_bucket(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """Flatten tensors into one uint8 tensor [sum of bytes] plus metadata, the layout of SGLang's
    FlattenedTensorBucket (tensor bytes back to back in order). Used by load_format
    "flattened_bucket" of /update_weights_from_distributed (one broadcast per bucket).
    Raises:
        ValueError: no tensors.
    """
    meta, parts, at = [], [], 0
    for name, t in named:
        b = t.contiguous().reshape(-1).view(torch.uint8)
        meta.append(FlattenedTensorMetadata(name, tuple(t.shape), t.dtype, at, at + b.numel(), b.numel()))
        parts.append(b)
        at += b.numel()
    if not parts:
        raise ValueError("cannot flatten an empty bucket")
    return torch.cat(parts), meta


class _SharedMemoryPickler(pickle.Pickler):
    """A pickler that writes CPU tensors as torch.multiprocessing handles: ``reduce_tensor`` for the
    tensor, ``reduce_typed_storage`` for its typed storage, and the file_system strategy for the
    bytes (chosen here for this pickle only; the process-wide sharing strategy is left alone)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._storages: dict = {}  # (data_ptr, dtype) -> one TypedStorage object, so the memo pickles it once

    def reducer_override(self, obj):
        from torch.multiprocessing import reductions as red

        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise ValueError(f"serialize_shared takes CPU tensors, got one on {obj.device}")
            key = (obj.untyped_storage().data_ptr(), obj.dtype)
            if type(obj) is torch.Tensor and not obj.requires_grad and key in self._storages:
                # another view of a storage already in this payload: reduce_tensor's CPU reduction
                # (rebuild_tensor, (cls, typed storage, (offset, size, stride, requires_grad))) without
                # its per-call set-up (about 50 us a tensor, 465 tensors a sync in the bench)
                return red.rebuild_tensor, (torch.Tensor, self._storages[key],
                                            (obj.storage_offset(), obj.size(), obj.stride(), False))
            rebuild, (cls, storage, meta) = red.reduce_tensor(obj)
            # views of one buffer share one storage handle (and one reference) per payload
            storage = self._storages.setdefault(key, storage)
            return rebuild, (cls, storage, meta)
        if isinstance(obj, torch.TypedStorage):
            return red.reduce_typed_storage(obj)
        if isinstance(obj, torch.UntypedStorage):
            if obj.nbytes() == 0:
                return red.rebuild_storage_empty, (torch.UntypedStorage,)
            manager, handle, size = share_filename(obj)  # moves the bytes to /dev/shm once
            obj._shared_incref()  # the receiver's reference; its rebuild_storage_filename gives it back
            red.shared_cache[handle] = red.StorageWeakRef(obj)
            return red.rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size)
        return NotImplemented


def serialize_shared(obj: Any) -> str:
    """base64 text of a pickle of ``obj`` whose CPU tensors travel as shared-memory handles (a
    /dev/shm file name, offset, sizes and strides), not bytes: what torch.multiprocessing's
    ``reduce_tensor`` writes under the file_system sharing strategy, inside the same
    MultiprocessingSerializer payload SGLang's /update_weights_from_tensor reads.

    A tensor whose storage is not yet in shared memory is moved there (``_share_filename_cpu_``:
    one copy, then the tensor keeps using the shared storage, as ``Tensor.share_memory_``), so
    callers pass buffers they reuse. Lifetime: the receiver maps the file while it holds the
    tensor; the sender must keep its storage alive (and unchanged) until the receiver has rebuilt
    the payload, and the payload must be unpickled exactly once (it carries one reference).
    Only a process on this host (same /dev/shm) can read it.

    Raises:
        ValueError: a tensor is not on the CPU.
    """
    buf = io.BytesIO()
    _SharedMemoryPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def shared_storages(named: Iterable[tuple[str, torch.Tensor]]) -> list[torch.UntypedStorage]:
    """The distinct shared-memory storages under ``named`` tensors (those :func:`deserialize` mapped
    from handles; inline tensors have none). A receiver that keeps them referenced keeps the
    mappings, so a sender reusing the same buffers costs no new mmap or page faults next time
    (torch's ``shared_cache`` finds them by handle)."""
    out, seen = [], set()
    for _, t in named:
        st = t.untyped_storage()
        if st.is_shared() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out

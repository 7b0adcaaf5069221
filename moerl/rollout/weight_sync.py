"""Push trainer weights (HF names) to every rollout server and check they took effect.

Three modes (``rollout.weight_sync``), all bucketed by ``bucket_bytes`` (``rollout.weight_sync_bucket_mb``)
and all ending with every server reporting the new ``weight_version`` on /get_model_info:
  * disk:   write an HF safetensors directory per version (atomically), sharded into files of about
            ``bucket_bytes`` (``model.safetensors.index.json``), POST /update_weights_from_disk
            {model_path, weight_version} to each server, keep only the new and previous directories.
  * tensor: POST /update_weights_from_tensor per bucket in SGLang's own wire format (load_format null,
            serialized_named_tensors = one MultiprocessingSerializer payload per TP rank of the
            server, as /get_server_info's tp_size says; see moerl.rollout.tensor_serde), so the same
            sender feeds real SGLang and the reference server. Two transports, chosen per server by
            :func:`tensor_transports`: ``shm`` for a server on this machine (its URL's host is
            loopback or one of this machine's addresses): the bucket is copied into a reusable
            shared-memory buffer and the HTTP body carries only torch.multiprocessing handles, as
            SGLang's trainers pass CUDA IPC handles; ``bytes`` for a server on another host: the
            tensors travel inline in the pickle (base64 in the JSON). weight_version rides on the
            last bucket (SGLang sets it on that call). A state dict already in shared memory (the
            trainer's export arena, moerl.rollout.shm_arena) goes to shm servers in ONE request.
  * distributed: SGLang's NCCL/gloo path. Once: POST /init_weights_update_group {master_address,
            master_port, rank_offset, world_size, group_name, backend} to every server while the
            trainer joins the same group as rank 0 (:class:`DistributedWeightUpdater`). Per bucket:
            POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
            weight_version} to every server and, while those requests wait, broadcast each tensor of
            the bucket from rank 0 in that group (in ``names`` order). Server i (tp size t_i) holds
            ranks rank_offset_i .. rank_offset_i + t_i - 1 (SGLang: rank = rank_offset + tp_rank).

hf_state_dict: {HF on-disk name: tensor}, per-expert names for MoE experts
(``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` ...), any dtype, any device.

Uneven layouts: :func:`gather_buckets` walks the union of every trainer rank's (possibly empty)
local HF tensors in buckets, moving each bucket to one rank; a rank that owns nothing in a bucket
(or nothing at all) just takes part in the metadata exchange.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import httpx
import torch

from moerl.rollout.common import (  # noqa: F401 - re-exported (moerl.train.weight_sync imports them from here)
    is_loopback_or_wildcard, remote_server_urls, resolve_master_address, url_host)
from moerl.rollout.common import this_machines_addresses as _this_machines_addresses  # noqa: F401
from moerl.rollout.common import per_server, plain_http_client
from moerl.rollout.common import version_dirname as _version_dirname
from moerl.rollout.errors import WeightSyncError

_MANIFEST = "rollout_weight_versions.json"


def _cpu_tensors(hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU tensors; tensors sharing storage are cloned (safetensors refuses them)."""
    out, seen = {}, set()
    for name, t in hf_state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hf_state_dict[{name!r}] is a {type(t).__name__}, expected a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if key is not None and (key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            t = t.clone()
        if key is not None:
            seen.add(key)
        out[name] = t
    return out


def _response_error(url: str, r: "httpx.Response") -> Optional[str]:
    """None when an SGLang weight endpoint answered HTTP 200 with ``success: true``; otherwise an
    error string naming the server, the status and the server's message."""
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code != 200 or not body.get("success", False):
        return f"{url}: HTTP {r.status_code}: {body.get('message', r.text[:500])}"
    return None


def _post_all(server_urls: Sequence[str], path: str, payload: Union[dict, Callable[[str], dict]], timeout_s: float,
              http_client: Optional[httpx.Client]) -> None:
    """POST ``payload`` (one body for all, or url -> body) to every server, in parallel (one server: from
    this thread); raise WeightSyncError naming each failure. Without ``http_client`` each call makes its
    own client."""

    def one(url: str) -> Optional[str]:
        body = payload(url) if callable(payload) else payload
        if http_client is not None:
            return _post_one(http_client, url, path, body)
        with plain_http_client([url], timeout_s) as client:
            return _post_one(client, url, path, body)

    errors = [e for e in per_server(list(server_urls), one) if e]
    if errors:
        raise WeightSyncError(f"{path} failed on {len(errors)} of {len(server_urls)} servers:\n" + "\n".join(errors))


def verify_weight_version(server_urls: Sequence[str], weight_version: str, *, timeout_s: float = 30.0,
                          http_client: Optional[httpx.Client] = None) -> None:
    """Raise WeightSyncError unless every server's /get_model_info reports ``weight_version``."""
    bad = []
    client = http_client or plain_http_client(server_urls, timeout_s)
    try:
        for url in server_urls:
            try:
                got = client.get(url.rstrip("/") + "/get_model_info", timeout=timeout_s).json().get("weight_version")
            except (httpx.HTTPError, ValueError) as e:
                got = f"<error {type(e).__name__}: {e}>"
            if got != weight_version:
                bad.append(f"{url} reports weight_version {got!r}")
    finally:
        if http_client is None:
            client.close()
    if bad:
        raise WeightSyncError(f"expected weight_version {weight_version!r}: " + "; ".join(bad))


def write_hf_version_dir(hf_state_dict: Mapping[str, torch.Tensor], hf_config, out_root, weight_version: str,
                         max_shard_bytes: int = 5 << 30) -> str:
    """Write ``out_root/weights_<version>`` (HF safetensors + config.json) atomically; returns it.

    Tensors are written in their own dtype, in shards of at most ``max_shard_bytes`` (a larger tensor
    gets a shard of its own; several shards come with ``model.safetensors.index.json``). Written to
    a temporary sibling directory first and renamed into place, so a server never sees a
    half-written version (moerl.checkpoint.hf_io.save_hf_checkpoint).
    Raises:
        ValueError: hf_state_dict is empty or max_shard_bytes <= 0.
    """
    from moerl.checkpoint.hf_io import save_hf_checkpoint

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    out_root = os.fspath(out_root)
    os.makedirs(out_root, exist_ok=True)
    final = os.path.join(out_root, _version_dirname(weight_version))
    save_hf_checkpoint(_cpu_tensors(hf_state_dict), hf_config, final, max_shard_size=int(max_shard_bytes))
    return final


def _record_and_prune(out_root: str, new_dir: str, keep: int) -> None:
    """Append new_dir to the manifest of version dirs written here; delete all but the last ``keep``."""
    path = os.path.join(out_root, _MANIFEST)
    try:
        with open(path) as f:
            dirs = [d for d in json.load(f) if isinstance(d, str)]
    except (OSError, ValueError):
        dirs = []
    name = os.path.basename(new_dir)
    dirs = [d for d in dirs if d != name] + [name]
    for d in dirs[:-keep]:
        shutil.rmtree(os.path.join(out_root, d), ignore_errors=True)
    dirs = dirs[-keep:]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dirs, f)
    os.replace(tmp, path)


def sync_weights_from_disk(server_urls: Sequence[str], hf_state_dict: Mapping[str, torch.Tensor], hf_config,
                           out_root, weight_version: str, *, timeout_s: float = 600.0,
                           keep_versions: int = 2, http_client: Optional[httpx.Client] = None,
                           bucket_bytes: int = 5 << 30) -> str:
    """Write the weights as an HF checkpoint and make every server load it (SGLang /update_weights_from_disk).

    Args:
        server_urls: base URL of each server (not the router).
        hf_state_dict: {HF on-disk name: tensor} covering every model parameter.
        hf_config: transformers config of the served model (written as config.json).
        out_root: directory holding one ``weights_<version>`` subdirectory per version.
        weight_version: new version string (servers report it on /generate and /get_model_info).
        keep_versions: version directories written by this function to keep (new + previous).
        bucket_bytes: safetensors shard size in bytes (one bucket = one shard file).
        http_client: optional httpx.Client to use (e.g. a FastAPI TestClient).
    Returns: the version directory.
    Raises:
        WeightSyncError: a server refused the update or reports another weight_version.
    """
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    path = write_hf_version_dir(hf_state_dict, hf_config, out_root, weight_version, max_shard_bytes=bucket_bytes)
    _post_all(server_urls, "/update_weights_from_disk",
              {"model_path": os.path.abspath(path), "weight_version": weight_version}, timeout_s, http_client)
    verify_weight_version(server_urls, weight_version, http_client=http_client)
    _record_and_prune(os.fspath(out_root), path, keep_versions)
    return path


def serialize_bucket(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """base64 text of ``safetensors.torch.save(named_tensors)``: moerl's earlier wire format, which
    the reference server still reads (real SGLang does not; :func:`sync_weights_from_tensor` sends
    SGLang's format, moerl.rollout.tensor_serde.serialize_named_tensors)."""
    from safetensors.torch import save

    return base64.b64encode(save(dict(named_tensors))).decode("ascii")


def server_tp_sizes(server_urls: Sequence[str], *, timeout_s: float = 30.0,
                    http_client: Optional[httpx.Client] = None, cache: Optional[dict] = None) -> list[int]:
    """tp_size of each server from GET /get_server_info (SGLang ServerArgs.tp_size; 1 when absent).

    ``cache``: {url: tp_size} of earlier answers: a URL found there is not asked again, and each answer is
    stored there (a server's tp_size is fixed by its launch command; the trainer's weight sync keeps one
    cache per run and empties it after a failed push). One GET less per push: 1-4 ms of an async weight
    update's latency on the 2-core demo, with the server's core busy.

    Raises:
        WeightSyncError: a server did not answer (names it).
    """
    cache = {} if cache is None else cache
    missing = [u for u in server_urls if u not in cache]
    if missing:
        client = http_client or plain_http_client(missing, timeout_s)
        try:
            for url in missing:
                try:
                    info = client.get(url.rstrip("/") + "/get_server_info", timeout=timeout_s).json()
                except (httpx.HTTPError, ValueError) as e:
                    raise WeightSyncError(f"{url}/get_server_info failed: {type(e).__name__}: {e}") from e
                cache[url] = max(1, int(info.get("tp_size") or 1))
        finally:
            if http_client is None:
                client.close()
    return [cache[u] for u in server_urls]


def make_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split into consecutive buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[dict[str, torch.Tensor]] = []
    cur: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += n
    if cur:
        buckets.append(cur)
    return buckets


TENSOR_TRANSPORTS = ("auto", "shm", "bytes")


def tensor_transports(server_urls: Sequence[str], transport: str = "auto") -> dict[str, str]:
    """How :func:`sync_weights_from_tensor` reaches each server: {url: "shm" | "bytes"}.

    ``auto``: ``shm`` (shared-memory handles) when the URL's host is loopback / wildcard or one of
    this machine's names or interface addresses (moerl.rollout.common.remote_server_urls; names
    are not looked up in DNS, so an unknown name is remote), else ``bytes`` (tensors inline).
    ``shm`` / ``bytes`` force one transport for every server (``bytes`` for a server that shares
    this machine's network but not its /dev/shm, e.g. another container).
    Raises:
        ValueError: transport is not one of :data:`TENSOR_TRANSPORTS`.
    """
    if transport not in TENSOR_TRANSPORTS:
        raise ValueError(f"tensor transport must be one of {TENSOR_TRANSPORTS}, got {transport!r}")
    if transport != "auto":
        return {u: transport for u in server_urls}
    remote = set(remote_server_urls(server_urls))
    return {u: "bytes" if u in remote else "shm" for u in server_urls}


class SharedBucketBuffers:
    """Reusable shared-memory byte buffers (uint8, /dev/shm files of torch's file_system sharing
    strategy) that the tensor weight sync copies buckets into: bucket k uses buffer k % ``depth``,
    so with depth 2 the next bucket is filled while the servers apply the previous one.

    Lifetimes: a buffer is overwritten only after every server acknowledged the bucket it held
    (the sender waits for the answers first); buffers are kept across syncs (same /dev/shm files,
    which the servers keep mapped, so no file, mmap or page fault per sync) and grow, never
    shrink, when a bucket is larger (a tensor larger than the bucket size travels alone). The
    file of a released or replaced buffer disappears when its last mapping closes (a server drops
    the mappings of buffers its last complete sync did not use). :meth:`release` drops them all.
    Thread-safe: :attr:`lock` is held for a whole sync.
    Raises: ValueError for depth < 1.
    """

    def __init__(self, depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._bufs: list[Optional[torch.Tensor]] = [None] * depth
        self.lock = threading.Lock()

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """Buffer for bucket ``k``: a shared uint8 tensor of at least ``nbytes`` bytes (rounded up to
        1 MiB when it must grow)."""
        i = k % self.depth
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            from moerl.rollout.shm_arena import shared_buffer

            buf = self._bufs[i] = shared_buffer(nbytes)  # a /dev/shm file now, once
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held in shared memory by this sender."""
        return sum(b.numel() for b in self._bufs if b is not None)

    def release(self) -> None:
        """Drop every buffer (their files go when the servers drop their mappings)."""
        with self.lock:
            self._bufs = [None] * self.depth


#: the buffers sync_weights_from_tensor uses when not given any (one set per trainer process)
SHARED_BUCKET_BUFFERS = SharedBucketBuffers()

_ALIGN = 64  # bytes; every tensor starts at a multiple of this in a shared bucket buffer


def _already_shared(t: torch.Tensor) -> bool:
    """A CPU tensor whose storage is in shared memory already: it travels by its own handle, uncopied."""
    return t.device.type == "cpu" and t.is_shared()


def _fill_shared(buf: Optional[torch.Tensor], bucket: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Copy ``bucket`` into ``buf`` (64-byte aligned, in order); returns (name, view of buf) pairs.
    Tensors already in shared memory are not copied: their pair holds the tensor itself (zero copy,
    as SGLang's trainers hand over their own CUDA tensors by IPC handle)."""
    out, at = [], 0
    with torch.no_grad():
        for name, t in bucket.items():
            if _already_shared(t):
                out.append((name, t.detach()))
                continue
            nb = t.numel() * t.element_size()
            view = buf[at:at + nb].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
            out.append((name, view))
            at += -(-nb // _ALIGN) * _ALIGN
    return out


def _bucket_span(bucket: Mapping[str, torch.Tensor]) -> int:
    return sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in bucket.values() if not _already_shared(t))


def _bytes_payload(bucket: Mapping[str, torch.Tensor]) -> tuple[str, Optional[str]]:
    """(serialized payload, load_format) of one bucket for the ``bytes`` transport: SGLang's list of
    (name, tensor) pairs (load_format None); a bucket holding float8 tensors (rollout.weight_dtype=fp8)
    goes as SGLang's flattened bucket (one uint8 tensor + metadata naming each dtype, load_format
    "flattened_bucket"), because torch 2.13 cannot unpickle a plainly pickled float8 tensor."""
    from moerl.rollout.tensor_serde import flatten_bucket, serialize, serialize_named_tensors

    if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in bucket.values()):
        flat, meta = flatten_bucket(bucket.items())
        return serialize({"flattened_tensor": flat, "metadata": meta}), "flattened_bucket"
    return serialize_named_tensors(bucket)[0], None


def _sync_all_shared(server_urls: Sequence[str], hf_state_dict: Mapping[str, torch.Tensor], weight_version: str,
                     timeout_s: float, client: httpx.Client, tp_cache: Optional[dict]) -> None:
    """The one-request form of :func:`sync_weights_from_tensor` for a state dict whose every tensor is
    already in shared memory, to servers that are all ``shm`` transport: per server ONE
    /update_weights_from_tensor carrying every tensor's handle (one MultiprocessingSerializer payload
    per TP rank, SGLang's format), weight_version and flush_cache=True, then /get_model_info checks
    the version. Raises WeightSyncError naming the servers that refused or report another version."""
    from moerl.rollout.tensor_serde import serialize_shared

    named = list(hf_state_dict.items())
    tp_of = dict(zip(server_urls, server_tp_sizes(server_urls, timeout_s=timeout_s, http_client=client,
                                                  cache=tp_cache)))
    body = {"load_format": None, "flush_cache": True, "weight_version": weight_version}
    payloads = {u: {"serialized_named_tensors": [serialize_shared(named) for _ in range(tp_of[u])], **body}
                for u in server_urls}
    # one server is posted from this thread (no pool thread per push on the trainer's core)
    _post_all(server_urls, "/update_weights_from_tensor", payloads.__getitem__, timeout_s, client)
    verify_weight_version(server_urls, weight_version, http_client=client)


def _raise_refused(futures) -> None:
    """Wait for the /update_weights_from_tensor answers in ``futures`` (error text or None each).
    Raises WeightSyncError naming every server that refused."""
    errors = [e for e in (f.result() for f in futures) if e]
    if errors:
        raise WeightSyncError(f"/update_weights_from_tensor failed on {len(errors)} of {len(futures)} "
                              f"servers:\n" + "\n".join(errors))


def sync_weights_from_tensor(server_urls: Sequence[str], hf_state_dict: Mapping[str, torch.Tensor],
                             weight_version: str, bucket_bytes: int = 64 << 20, *, timeout_s: float = 600.0,
                             http_client: Optional[httpx.Client] = None, transport: str = "auto",
                             buffers: Optional[SharedBucketBuffers] = None, tp_cache: Optional[dict] = None) -> int:
    """Send the weights in buckets via /update_weights_from_tensor in SGLang's wire format
    (UpdateWeightsFromTensorReqInput; load_format null; one MultiprocessingSerializer payload per TP
    rank of each server, tp_size read from /get_server_info once per call).

    Transport per server (:func:`tensor_transports`): ``shm`` servers get payloads of handles into
    ``buffers`` (default :data:`SHARED_BUCKET_BUFFERS`; one payload per server and TP rank, as each
    carries one reference; buffer k % depth is refilled once bucket k - depth was applied everywhere,
    so with depth d up to d buckets are in flight: bucket k is posted as soon as it is copied, while
    the servers still apply the earlier ones, and a server always has the next bucket queued; a tensor already
    in shared memory, e.g. after ``Tensor.share_memory_()``, is passed by its own handle without a
    copy and must stay unchanged until this call returns; the servers keep its mapping until the end
    of their next sync), ``bytes``
    servers the tensors inline (moerl.rollout.tensor_serde.serialize_named_tensors). The buckets
    before the last may be applied in any order (disjoint names); the last bucket carries
    weight_version and flush_cache=True and is sent only after every server answered every other
    bucket, so a server reports the new version only with all of it applied. After a refused bucket
    the buckets already in flight (at most depth - 1) may still be applied, but no version is set.
    /get_server_info (tp sizes) is asked while bucket 0 is copied, for the servers not in ``tp_cache``
    (:func:`server_tp_sizes`).
    One request instead of buckets: when EVERY tensor of ``hf_state_dict`` is already in shared memory
    (e.g. exported into a moerl.rollout.shm_arena.SharedExportArena) and every server is ``shm``,
    each server gets one request carrying all the handles, weight_version and flush_cache=True (the
    bucket size bounds staging memory, and nothing is staged); it counts as one bucket.
    The servers apply what they get (SGLang semantics): ``hf_state_dict`` must
    cover every weight the servers should change. Returns the number of buckets sent (0, nothing
    serialized, when ``server_urls`` is empty).

    Args:
        hf_state_dict: {HF name: tensor}, any dtype / device (copied, never modified).
        bucket_bytes: bucket size in bytes (a larger tensor goes alone).
        transport: "auto" | "shm" | "bytes" (see :func:`tensor_transports`).
        tp_cache: {url: tp_size} kept across syncs (see :func:`server_tp_sizes`), or None (ask every time).
    Raises:
        ValueError: empty weight_version or hf_state_dict, bad transport.
        WeightSyncError: a server refused a bucket (e.g. an unknown name, or a shared-memory handle
            it cannot open: use transport "bytes" for it) or /get_server_info, or reports another
            weight_version afterwards.
    """
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
    how = tensor_transports(server_urls, transport)
    buckets = make_buckets(dict(hf_state_dict), bucket_bytes)
    if not buckets:
        raise ValueError("hf_state_dict is empty")
    if not server_urls:  # nothing to send to (e.g. every server restarting: the restorer catches them up)
        return 0
    from moerl.rollout.tensor_serde import serialize_shared

    client = http_client or plain_http_client(server_urls, timeout_s)  # one client per sync
    shm_urls = [u for u in server_urls if how[u] == "shm"]
    byte_urls = [u for u in server_urls if how[u] == "bytes"]
    if not byte_urls and all(_already_shared(t) for t in hf_state_dict.values()):
        try:  # every tensor by its own handle: one request per server, no staging buffer to bound
            _sync_all_shared(server_urls, hf_state_dict, weight_version, timeout_s, client, tp_cache)
        finally:
            if http_client is None:
                client.close()
        return 1
    buffers = buffers if buffers is not None else SHARED_BUCKET_BUFFERS

    def body(blobs: list[str], last: bool, load_format: Optional[str] = None) -> dict:
        return {"serialized_named_tensors": blobs, "load_format": load_format, "flush_cache": last,
                "weight_version": weight_version if last else None}

    try:
        with buffers.lock, ThreadPoolExecutor(max_workers=len(server_urls) * max(2, buffers.depth)) as pool:
            # the tp sizes are asked while bucket 0 is copied (one round trip off the critical path)
            tp_future = pool.submit(server_tp_sizes, server_urls, timeout_s=timeout_s, http_client=client,
                                    cache=tp_cache)
            tp_of: Optional[dict] = None
            sent: list = []  # sent[k]: the futures of bucket k (one per server)
            for k, bucket in enumerate(buckets):
                last = k == len(buckets) - 1
                if k >= buffers.depth:  # buffer k % depth held bucket k - depth: free once it was applied everywhere
                    _raise_refused(sent[k - buffers.depth])
                span = _bucket_span(bucket) if shm_urls else 0
                shared = _fill_shared(buffers.buffer(k, span) if span else None, bucket) if shm_urls else None
                if tp_of is None:
                    tp_of = dict(zip(server_urls, tp_future.result()))
                if last:  # weight_version goes last: every earlier bucket applied everywhere first
                    for f in sent:
                        _raise_refused(f)
                futures = []
                for u in shm_urls:
                    payload = body([serialize_shared(shared) for _ in range(tp_of[u])], last)
                    futures.append(_post_async(pool, client, u, "/update_weights_from_tensor", payload))
                if byte_urls:
                    blob, fmt = _bytes_payload(bucket)
                    for u in byte_urls:
                        futures.append(_post_async(pool, client, u, "/update_weights_from_tensor",
                                                   body([blob] * tp_of[u], last, fmt)))
                sent.append(futures)
            for f in sent:
                _raise_refused(f)
        verify_weight_version(server_urls, weight_version, http_client=client)
    finally:
        if http_client is None:
            client.close()
    return len(buckets)


# ----------------------------------------------------------------------------- uneven layouts


def _comm_device(group) -> torch.device:
    """cuda (current device) when ``group`` runs NCCL, else cpu."""
    import torch.distributed as tdist

    return (torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(tdist.get_backend(group)).lower()
            else torch.device("cpu"))


def gather_buckets(local: Mapping[str, torch.Tensor], bucket_bytes: int, *, dst: int = 0,
                   group=None) -> Iterator[dict[str, torch.Tensor]]:
    """Walk the union of every rank's local HF tensors in buckets, each bucket gathered on ``dst``.

    Collective over ``group`` (torch.distributed; the default group when None; a plain
    :func:`make_buckets` walk when torch.distributed is not initialized or has one rank). Every
    rank passes the HF-named tensors it owns (any subset, possibly none: uneven TP/EP/PP layouts);
    names must be unique across ranks. The global order is rank 0's tensors, then rank 1's, ...,
    each in its own order, cut into buckets of at most ``bucket_bytes`` (a larger tensor goes
    alone). Every rank yields once per bucket: on ``dst`` the bucket {name: tensor} (dst's own
    tensors as given, the others received with send/recv onto the group's device: cuda for NCCL,
    cpu for gloo), on the other ranks an empty dict. A rank owning nothing in a bucket neither
    sends nor receives for it, so no rank waits on it.

    Args:
        local: this rank's {HF name: tensor}.
        bucket_bytes: bucket size in bytes (> 0).
        dst: group rank that receives the buckets.
        group: a torch.distributed process group, or None for the default group.
    Raises:
        ValueError: bucket_bytes <= 0, or a name owned by several ranks (raised on every rank).
        TypeError: a value of ``local`` is not a tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    for name, t in local.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"local[{name!r}] is a {type(t).__name__}, expected a torch.Tensor")
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size(group) == 1:
        yield from make_buckets(dict(local), bucket_bytes)
        return
    me, world = tdist.get_rank(group), tdist.get_world_size(group)
    mine = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for n, t in local.items()]
    metas: list = [None] * world
    tdist.all_gather_object(metas, mine, group=group)
    owner: dict[str, int] = {}
    for r, meta in enumerate(metas):
        for n, *_ in meta:
            if n in owner:
                raise ValueError(f"weight {n!r} is owned by ranks {owner[n]} and {r}; every HF name must "
                                 f"come from exactly one rank")
            owner[n] = r
    plan: list[list[tuple]] = []
    cur: list[tuple] = []
    size = 0
    for r, meta in enumerate(metas):
        for n, dt, shape, nbytes in meta:
            if cur and size + nbytes > bucket_bytes:
                plan.append(cur)
                cur, size = [], 0
            cur.append((r, n, dt, shape))
            size += nbytes
    if cur:
        plan.append(cur)
    device = _comm_device(group)
    for bucket in plan:
        out: dict[str, torch.Tensor] = {}
        for r, n, dt, shape in bucket:
            if me == dst:
                if r == me:
                    out[n] = local[n]
                else:
                    t = torch.empty(shape, dtype=getattr(torch, dt), device=device)
                    if t.numel():
                        tdist.recv(t, group=group, group_src=r)
                    out[n] = t
            elif r == me and local[n].numel():
                tdist.send(local[n].detach().to(device).contiguous(), group=group, group_dst=dst)
        yield out


# ----------------------------------------------------------------------------- distributed mode


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name of a dtype: ``torch.bfloat16`` -> ``"bfloat16"`` (it does getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def _free_port(host: str) -> int:
    """A free TCP port in 20000..32000 (below Linux's ephemeral range, see tests/_mp_helpers.py).

    Raises:
        WeightSyncError: ``host`` is not an address of this machine (names
            rollout.weight_sync_master_address / rollout.host), or no port is free.
    """
    import errno
    import random
    import socket

    rng = random.Random(os.getpid() * 7919 + uuid.uuid4().int)
    for _ in range(500):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except socket.gaierror as e:
                raise WeightSyncError(_not_here(host, e)) from e
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    raise WeightSyncError(_not_here(host, e)) from e
                continue
        return port
    raise WeightSyncError(f"no free port on {host} for the weight update group")


def _not_here(host: str, e: OSError) -> str:
    return (f"the weight update group's master address {host!r} is not an address of this machine ({e}); "
            f"set rollout.weight_sync_master_address (else rollout.host is used) to an address of trainer "
            f"rank 0's node that every rollout server can reach")


def _post_one(client: httpx.Client, url: str, path: str, payload: dict) -> Optional[str]:
    """POST ``payload`` to ``url + path``: None when it succeeded, else an error string naming the server."""
    try:
        r = client.post(url.rstrip("/") + path, json=payload)
    except httpx.HTTPError as e:
        return f"{url}: {type(e).__name__}: {e}"
    return _response_error(url, r)


def _post_async(pool: ThreadPoolExecutor, client: httpx.Client, url: str, path: str, payload: dict):
    """Submit one :func:`_post_one`; the future returns None or an error string naming the server."""
    return pool.submit(_post_one, client, url, path, payload)


class DistributedWeightUpdater:
    """Trainer side of SGLang's distributed weight update (rank 0 of a dedicated process group).

    The group is SGLang's: servers join it from POST /init_weights_update_group with
    ``init_custom_process_group`` (tcp:// rendezvous at master_address:master_port, the store
    prefixed with group_name, a gloo or NCCL backend made by torch's process-group helper); server
    i joins as ranks rank_offset_i .. rank_offset_i + tp_i - 1. The trainer joins as rank 0 with
    the same store layout but builds the backend object directly (``ProcessGroupGloo`` /
    ``ProcessGroupNCCL`` on ``PrefixStore("<dev>/", PrefixStore("<group>/", PrefixStore(group,
    store)))``), so the trainer's default group (Megatron's) is neither used nor registered with.

    Args:
        server_urls: base URL of each server (not the router).
        master_address: address the servers reach the trainer at (its TCPStore listens there).
        master_port: TCPStore port; None = a free port.
        backend: "nccl" (GPU trainer and servers) or "gloo" (the moerl reference server, CPU).
        group_name: group name; None = a fresh ``moerl_weight_sync_<hex>`` per group.
        timeout_s: rendezvous, collective and HTTP timeout in seconds.
        http_client: optional httpx.Client (e.g. a FastAPI TestClient) used for every request.
    The group is created on first use (:meth:`init_group`); :meth:`close` tears it down on both sides
    (POST /destroy_weights_update_group). After a failed update or a server restart call
    :meth:`close` and make a new updater (world size and ranks are fixed per group).
    """

    def __init__(self, server_urls: Sequence[str], *, master_address: str = "127.0.0.1",
                 master_port: Optional[int] = None, backend: str = "gloo", group_name: Optional[str] = None,
                 timeout_s: float = 600.0, http_client: Optional[httpx.Client] = None):
        if not server_urls:
            raise ValueError("server_urls is empty; the distributed weight sync needs at least one server")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.server_urls = list(server_urls)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name or f"moerl_weight_sync_{uuid.uuid4().hex[:8]}"
        self.timeout_s = float(timeout_s)
        self._client = http_client
        self._own_client = http_client is None
        self._pg = None
        self.world_size: Optional[int] = None
        self.rank_offsets: list[int] = []

    # ------------------------------------------------------------------ helpers
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s, trust_env=False)
        return self._client

    @property
    def device(self) -> torch.device:
        """Where broadcast tensors must live: cuda (current device) for NCCL, cpu for gloo."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _server_tp_sizes(self) -> list[int]:
        sizes = []
        for url in self.server_urls:
            try:
                info = self.client.get(url.rstrip("/") + "/get_server_info").json()
            except (httpx.HTTPError, ValueError) as e:
                raise WeightSyncError(f"{url}/get_server_info failed: {type(e).__name__}: {e}") from e
            for key in ("dp_size", "pp_size"):
                if int(info.get(key) or 1) != 1:
                    raise WeightSyncError(
                        f"{url} runs {key}={info.get(key)}; SGLang's weight update group gives rank "
                        f"rank_offset + tp_rank to each worker, so distributed sync needs dp_size = pp_size = 1 "
                        f"per server (run more servers instead, or use rollout.weight_sync: disk|tensor)")
            sizes.append(int(info.get("tp_size") or 1))
        return sizes

    def _wait(self, futures, works=()) -> None:
        """Wait for the HTTP futures and the broadcast works; fail fast when a server refuses."""
        import time

        deadline = time.monotonic() + self.timeout_s
        while True:
            errors = [f.result() for f in futures if f.done() and f.result()]
            if errors:
                raise WeightSyncError(f"{len(errors)} of {len(futures)} servers failed:\n" + "\n".join(errors))
            if all(f.done() for f in futures) and all(w.is_completed() for w in works):
                for w in works:
                    w.wait()  # surfaces a backend error
                return
            if time.monotonic() > deadline:
                raise WeightSyncError(f"distributed weight sync timed out after {self.timeout_s:.0f} s "
                                      f"(group {self.group_name!r})")
            time.sleep(0.001)

    # ------------------------------------------------------------------ API
    def init_group(self) -> None:
        """Create the group: POST /init_weights_update_group to every server while joining as rank 0.

        Raises:
            WeightSyncError: a server refused, the rendezvous timed out, or a server cannot take part.
        """
        import datetime

        import torch.distributed as tdist
        from torch.distributed import PrefixStore

        if self._pg is not None:
            return
        tp = self._server_tp_sizes()
        self.world_size = 1 + sum(tp)
        self.rank_offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
        if self.master_port is None:
            self.master_port = _free_port(self.master_address)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        box: dict = {}

        def join() -> None:
            try:
                # rank 0 HOSTS the store: not tdist.rendezvous("tcp://..."), which under torchrun
                # (TORCHELASTIC_USE_AGENT_STORE=True in every worker's environment) only connects as a
                # client to a store it assumes the elastic agent runs, so nobody listened and the first
                # sync hung with more than one trainer rank
                store = tdist.TCPStore(self.master_address, int(self.master_port), self.world_size, True,
                                       timeout=timeout, multi_tenant=True)
                dev = "cuda" if self.backend == "nccl" else "cpu"
                store = PrefixStore(f"{dev}/", PrefixStore(f"{self.group_name}/", PrefixStore(self.group_name, store)))
                if self.backend == "gloo":
                    pg = tdist.ProcessGroupGloo(store, 0, self.world_size, timeout)
                else:
                    opts = tdist.ProcessGroupNCCL.Options()
                    opts.is_high_priority_stream = False
                    opts._timeout = timeout
                    pg = tdist.ProcessGroupNCCL(store, 0, self.world_size, opts)
                pg._set_sequence_number_for_group()  # rank 0 publishes it; the servers wait for it
                box["store"], box["pg"] = store, pg
            except BaseException as e:  # reported by the waiter below
                box["error"] = e

        with ThreadPoolExecutor(max_workers=len(self.server_urls) + 1) as pool:
            futures = [_post_async(pool, self.client, url, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": off, "world_size": self.world_size, "group_name": self.group_name,
                "backend": self.backend}) for url, off in zip(self.server_urls, self.rank_offsets)]
            joined = pool.submit(join)
            self._wait(futures + [joined])
        if "error" in box:
            raise WeightSyncError(f"joining weight update group {self.group_name!r} at "
                                  f"{self.master_address}:{self.master_port} failed: {box['error']}")
        self._store, self._pg = box["store"], box["pg"]

    def update_bucket(self, bucket: Mapping[str, torch.Tensor], *, weight_version: Optional[str] = None,
                      flush_cache: bool = False) -> None:
        """Send one bucket: POST /update_weights_from_distributed to every server, broadcast its tensors.

        ``bucket`` may be empty (the servers then receive nothing; a weight_version still travels).
        Tensors are broadcast in the bucket's order, on :attr:`device`, in their own dtype.
        Raises:
            WeightSyncError: a server refused the update or the broadcast failed / timed out.
        """
        import torch.distributed as tdist

        self.init_group()
        names = list(bucket)
        tensors = [bucket[n].detach().to(self.device).contiguous() for n in names]
        payload = {"names": names, "dtypes": [dtype_name(t.dtype) for t in tensors],
                   "shapes": [list(t.shape) for t in tensors], "group_name": self.group_name,
                   "flush_cache": bool(flush_cache)}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if self.backend == "gloo" and any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors):
            # gloo cannot broadcast float8 tensors (rollout.weight_dtype=fp8): send the bucket as ONE uint8
            # tensor in SGLang's FlattenedTensorBucket layout (load_format "flattened_bucket")
            from moerl.rollout.tensor_serde import flatten_bucket

            tensors = [flatten_bucket(zip(names, tensors))[0]]
            payload["load_format"] = "flattened_bucket"
        with ThreadPoolExecutor(max_workers=len(self.server_urls)) as pool:
            futures = [_post_async(pool, self.client, url, "/update_weights_from_distributed", payload)
                       for url in self.server_urls]
            works = []
            for t in tensors:
                opts = tdist.BroadcastOptions()
                opts.rootRank = 0
                works.append(self._pg.broadcast([t], opts))
            self._wait(futures, works)

    def sync(self, buckets: Iterable[Mapping[str, torch.Tensor]], weight_version: str) -> int:
        """Send every bucket; the last one carries ``weight_version`` and flush_cache=True; then check
        that every server reports it. Returns the number of buckets sent (>= 1).

        Raises:
            ValueError: weight_version is not a non-empty string.
            WeightSyncError: as :meth:`update_bucket`, or a server reports another weight_version.
        """
        if not isinstance(weight_version, str) or not weight_version:
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
        it = iter(buckets)
        cur = next(it, {})
        n = 0
        for nxt in it:
            self.update_bucket(cur)
            n += 1
            cur = nxt
        self.update_bucket(cur, weight_version=weight_version, flush_cache=True)
        verify_weight_version(self.server_urls, weight_version, http_client=self._client)
        return n + 1

    def close(self) -> None:
        """POST /destroy_weights_update_group to every server (errors ignored) and drop the group."""
        if self._pg is not None:
            for url in self.server_urls:
                try:
                    self.client.post(url.rstrip("/") + "/destroy_weights_update_group",
                                     json={"group_name": self.group_name})
                except httpx.HTTPError:
                    pass
            try:
                self._pg.shutdown()
            except Exception:
                pass
            self._pg = None
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None


def sync_weights_from_distributed(updater: DistributedWeightUpdater, hf_state_dict: Mapping[str, torch.Tensor],
                                  weight_version: str, bucket_bytes: int = 64 << 20) -> int:
    """Send ``hf_state_dict`` through ``updater`` in buckets of at most ``bucket_bytes``; returns the
    number of buckets. An empty dict sends one empty bucket carrying weight_version.
    Raises: as :meth:`DistributedWeightUpdater.sync`; ValueError for bucket_bytes <= 0."""
    return updater.sync(make_buckets(dict(hf_state_dict), bucket_bytes), weight_version)


WEIGHT_SYNC_MODES = ("disk", "tensor", "distributed")


def sync_weights(mode: str, server_urls: Sequence[str], hf_state_dict: Mapping[str, torch.Tensor],
                 weight_version: str, *, bucket_bytes: int = 64 << 20, hf_config=None, out_root=None,
                 updater: Optional[DistributedWeightUpdater] = None, http_client: Optional[httpx.Client] = None,
                 timeout_s: float = 600.0, tensor_transport: str = "auto", tp_cache: Optional[dict] = None) -> None:
    """One weight sync in ``mode`` (``rollout.weight_sync``): disk | tensor | distributed.

    disk needs ``hf_config`` and ``out_root``; distributed needs ``updater`` (kept across syncs: the
    group is created once); tensor uses ``tensor_transport`` (auto | shm | bytes,
    :func:`tensor_transports`) and ``tp_cache`` (:func:`server_tp_sizes`). Empty ``server_urls`` (failover: every server restarting; the cluster's
    restorer catches them up) pushes to nobody: disk still writes the version directory the
    restorer loads, tensor sends nothing, distributed does nothing (no updater needed: a group
    needs at least one server). Raises ValueError for a bad mode or missing argument,
    WeightSyncError when a server refuses or ends on another weight_version.
    """
    if mode == "disk":
        if hf_config is None or out_root is None:
            raise ValueError("weight_sync 'disk' needs hf_config and out_root")
        sync_weights_from_disk(server_urls, hf_state_dict, hf_config, out_root, weight_version,
                               bucket_bytes=bucket_bytes, http_client=http_client, timeout_s=timeout_s)
    elif mode == "tensor":
        sync_weights_from_tensor(server_urls, hf_state_dict, weight_version, bucket_bytes,
                                 http_client=http_client, timeout_s=timeout_s, transport=tensor_transport,
                                 tp_cache=tp_cache)
    elif mode == "distributed":
        if not server_urls:
            return
        if updater is None:
            raise ValueError("weight_sync 'distributed' needs a DistributedWeightUpdater (updater=...)")
        sync_weights_from_distributed(updater, hf_state_dict, weight_version, bucket_bytes)
    else:
        raise ValueError(f"rollout.weight_sync must be one of {WEIGHT_SYNC_MODES}, got {mode!r}")
